"""Launch checks of a text-environment run (``env.text_env``), made before any actor starts.

Why at resolve time: a class path that does not import, or a model whose tokenizer has no chat template (which
renders every environment turn), would otherwise fail inside each rollout worker after Ray, the learner and the
engines have started; here the refusal names the option in seconds. So would SkyRL-format rows the run cannot
draw or evaluate (files of two formats, no usable row).
"""

from __future__ import annotations

from asyncppo.config.schema import AsyncPPOConfig


def check_text_env_launch(cfg: AsyncPPOConfig, model_path: str) -> None:
    """ValueError naming ``env.text_env`` or ``model.path`` when the run cannot play its environment."""
    from transformers import AutoTokenizer  # heavy: transformers

    from asyncppo.data.text_row_draws import draws_text_env_rows, text_env_rows_in
    from asyncppo.data.text_rows import read_text_env_rows
    from asyncppo.envs.text_env import load_text_env

    load_text_env(cfg.env.text_env)  # raises ValueError naming env.text_env
    d = cfg.data
    if draws_text_env_rows(cfg):  # raises ValueError naming data.train_files
        read_text_env_rows(list(d.train_files), prompt_key=d.prompt_key)  # no usable row: names them
    if d.eval_files and text_env_rows_in(list(d.eval_files), d.prompt_key, "data.eval_files"):
        read_text_env_rows(list(d.eval_files), prompt_key=d.prompt_key)  # episodes to evaluate: usable rows
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"env.text_env={cfg.env.text_env!r} needs a tokenizer with a chat template (it renders the "
                         f"environment's turns); the tokenizer of model.path={cfg.model.path!r} has none. A local "
                         "chat model: python -m asyncppo.envs.examples DIR, then model.path=DIR")
