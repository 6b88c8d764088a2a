"""The built-in model: a char-level tokenizer and a tiny Qwen2, built from configs (no model hub needed).

Why Qwen2: it is an architecture both transformers and vLLM implement natively, so the same directory serves
the learner (transformers) and the rollout engine (vLLM) with identical parameter names — weight broadcast can
then ship HF names unchanged. Why these sizes: head_dim 64 is a head size vLLM's CPU attention supports; untied
embeddings because vLLM (0.32, CPU, float32) does not update a tied output layer when weights are reloaded.

:func:`ensure_builtin_model` builds the model once per build-parameter set, warm-starts it with a short
supervised pass (so the policy starts with some accuracy PPO can improve) and caches it under
``$ASYNCPPO_CACHE`` (default ``~/.cache/asyncppo``). The cache is written atomically (built in a temporary
directory, then renamed), so concurrent processes or a crash never leave a half-written model behind.

A multi-turn task's model (``"chat": True``, e.g. ``tiny-calculator``) carries the chat tokenizer of
:mod:`asyncppo.data.chat_tokenizer` and is warm-started on transcripts (:mod:`asyncppo.data.transcript_warmstart`);
its head_dim 32 is the other size vLLM's CPU attention supports. The existing models' builds are unchanged, so
``BUILD_FORMAT`` stays: their cache entries remain valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .chat_tokenizer import (  # noqa: F401 (the special tokens are re-exported: tests and launch/ read them here)
    BOS, CHAT_SPECIAL_TOKENS, EOS, PAD, SPECIAL_TOKENS, TINY_TOOLS_TEMPLATE, UNK, build_chat_tokenizer)
from .tasks import get_task

BUILD_FORMAT = 2  # bump when the build changes in a way the parameters do not capture
DEFAULT_ALPHABET = "0123456789+="


def build_tokenizer(alphabet: str = DEFAULT_ALPHABET, model_max_length: int = 1024):
    """A char-level ``PreTrainedTokenizerFast``: one token per character of ``alphabet`` plus the specials.

    Each character is its own pre-token (regex split), looked up in a word-level vocabulary; the ``Fuse``
    decoder concatenates tokens without spaces, so ``decode(encode(s)) == s`` and vLLM's incremental
    detokenizer produces the same text.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # heavy: tokenizers
    from transformers import PreTrainedTokenizerFast  # heavy: transformers

    chars = list(dict.fromkeys(alphabet))
    if any(len(c) != 1 or c.isspace() for c in chars):
        raise ValueError(f"alphabet must be distinct non-space characters, got {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=BOS,
        padding_side="left",  # generation pads prompts on the left
        model_max_length=model_max_length,  # the model's context: a longer input is a user error
    )
    return fast


def build_tiny_model(
    out_dir: str,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    intermediate: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
    max_position_embeddings: int = 1024,
    chat: bool = False,
    moe: dict | None = None,
) -> str:
    """Write a randomly initialised fp32 Qwen2ForCausalLM and its tokenizer to ``out_dir``; return the path.

    ``chat``: the tokenizer is :func:`~asyncppo.data.chat_tokenizer.build_chat_tokenizer`'s (printable ASCII and
    the chat special tokens, with the Qwen-style ``TINY_TOOLS_TEMPLATE``) instead of one over ``alphabet``.
    ``moe``: a Qwen3-MoE instead (:func:`asyncppo.data.tiny_moe.moe_model`, e.g. ``{"experts": 8, "top_k": 2}``)."""
    import torch  # heavy: torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # heavy: transformers

    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    tokenizer = (build_chat_tokenizer(template=TINY_TOOLS_TEMPLATE) if chat
                 else build_tokenizer(alphabet, model_max_length=max_position_embeddings))
    vocab_size = len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_sliding_window=False,
        rope_theta=10000.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if moe is not None:
            from .tiny_moe import moe_model  # heavy: transformers

            model = moe_model(config, **moe)
        else:
            model = Qwen2ForCausalLM(config).to(torch.float32)
    # No sampling defaults in the generation config: vLLM and transformers would otherwise silently apply them.
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


# name -> task name, architecture kwargs of build_tiny_model and optional "sft": supervised_warmstart kwargs.
# Every entry is part of the cache key.
BUILTIN_MODELS: dict[str, dict] = {
    "tiny-addition": {"task": "addition", "hidden": 128, "layers": 2, "heads": 2, "intermediate": 512},
    # String reversal with heavy-tailed lengths (data=reverse). Same architecture. Warm start measured on 2 shared
    # cores (seed 0): 200 steps of 64 rows at lr 1e-3 reach held-out greedy 0.44 / sampled (T=1) 0.30 accuracy,
    # sampled ~0.6 on 1-3 letters, ~0.3 on 4-6, ~0.1 on 7-12, ~0 beyond 12: room and signal for RL. Batches of 64
    # in 4 length buckets because a padded batch of 128 costs ~4x more per step with this length tail.
    "tiny-reverse": {
        "task": "reverse", "hidden": 128, "layers": 2, "heads": 2, "intermediate": 512,
        "sft": {"batch_size": 64, "lr": 1e-3, "length_buckets": 4},
    },
    # 3-digit x 2-digit products with a calc tool (data=calculator), over the chat tokenizer. Warm start: supervised
    # transcripts, a "tool_share" of them calling the tool and the rest answering in the head (data/calculator.py,
    # data/transcript_warmstart.py); figures in docs/environments.md ("The calculator task").
    "tiny-calculator": {
        "task": "calculator", "hidden": 64, "layers": 2, "heads": 2, "intermediate": 256, "chat": True,
        "sft": {"transcripts": True, "copy_steps": 400, "copy_batch_size": 32, "batch_size": 16, "lr": 2e-3,
                "tool_share": 0.4},
    },
    # The guess game (data=guess), same architecture: games played by halving (a "tool_share" of them) or by
    # ignoring the replies (data/guess.py); no copy phase (no tool).
    "tiny-guess": {
        "task": "guess", "hidden": 64, "layers": 2, "heads": 2, "intermediate": 256, "chat": True,
        "sft": {"transcripts": True, "copy_steps": 0, "batch_size": 32, "lr": 2e-3, "tool_share": 0.3},
    },
    # A mixture of experts (Qwen3-MoE: 8 experts, top-2, every layer sparse) on the default addition task, warm-started
    # like tiny-addition (at lr 2e-3: it learns slower, docs/moe.md); data/tiny_moe.py says why this architecture.
    "tiny-moe": {
        "task": "addition", "hidden": 128, "layers": 2, "heads": 2, "intermediate": 512,
        "moe": {"experts": 8, "top_k": 2, "expert_intermediate": 256}, "sft": {"lr": 2e-3},
    },
    # Long generations (data=long, asyncppo/data/long_task.py): responses up to 1,027 tokens, so a 2,048-token
    # context. Warm start: see configs/data/long.yaml and docs/benchmarks.md ("data=long").
    "tiny-long": {
        "task": "long", "hidden": 128, "layers": 2, "heads": 2, "intermediate": 512,
        "max_position_embeddings": 2048,
        # eval_rows 0: the build skips its own held-out probe (transformers decoding 1,000-token answers took
        # minutes); the launch measures held-out accuracy on the engines at step 0.
        "sft": {"batch_size": 32, "lr": 1e-3, "length_buckets": 2, "max_answer_chars": 160, "eval_rows": 0},
    },
    # data=long on a mixture of experts (routing replay's long-generation proof, docs/moe.md): tiny-long's task and
    # context with tiny-moe's sparse layers (8 experts, top-2). Warm start: 300 steps at lr 2e-3 left it at 0 held-out
    # (loss 0.18); build it with trainer.sft_warmup_steps=1200 (loss ~0.002, 337 s on 2 cores; held-out greedy 0.75
    # / sampled 0.71 at seed 0), as the moe-replay-long benchmark does
    "tiny-long-moe": {
        "task": "long", "hidden": 128, "layers": 2, "heads": 2, "intermediate": 512,
        "max_position_embeddings": 2048, "moe": {"experts": 8, "top_k": 2, "expert_intermediate": 256},
        "sft": {"batch_size": 32, "lr": 2e-3, "length_buckets": 2, "max_answer_chars": 160, "eval_rows": 0},
    },
}


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("ASYNCPPO_CACHE") or Path.home() / ".cache" / "asyncppo")


def _cache_key(name: str, params: dict) -> str:
    blob = json.dumps({"format": BUILD_FORMAT, "name": name, **params}, sort_keys=True)
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def ensure_builtin_model(
    name: str = "tiny-addition",
    cache_dir: str | None = None,
    sft_steps: int = 300,
    seed: int = 0,
    verbose: bool = True,
) -> str:
    """Return the directory of built-in model ``name``, building and warm-starting it on first use.

    The cache key covers every build parameter (architecture, SFT steps, seed, build format), so changing
    any of them builds a new entry instead of reusing a stale one.
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; available: {sorted(BUILTIN_MODELS)}")
    if sft_steps < 0:
        raise ValueError(f"sft_steps={sft_steps!r} must be >= 0")
    spec = dict(BUILTIN_MODELS[name])
    task_name = spec.pop("task")
    params = {"task": task_name, **spec, "sft_steps": int(sft_steps), "seed": int(seed)}
    sft_kwargs = dict(spec.pop("sft", {}))
    root = cache_root(cache_dir)
    final = root / _cache_key(name, params)
    if (final / "build.json").is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:  # the directory is made inside: an exception (a SIGTERM turned into one) right after it still removes it
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        t0 = time.time()
        if verbose:
            print(f"[asyncppo] building builtin model {name!r} into {final}", flush=True)
        task = get_task(task_name, seed=seed)
        build_tiny_model(str(tmp), seed=seed, alphabet=task.alphabet(), **spec)
        report: dict = {}
        if sft_steps > 0 and sft_kwargs.pop("transcripts", False):
            from .transcript_warmstart import transcript_warmstart  # heavy: torch

            report = transcript_warmstart(str(tmp), task, steps=sft_steps, seed=seed, verbose=verbose, **sft_kwargs)
        elif sft_steps > 0:
            from .warmstart import supervised_warmstart  # heavy: torch

            report = supervised_warmstart(str(tmp), task, steps=sft_steps, seed=seed, verbose=verbose, **sft_kwargs)
        (tmp / "build.json").write_text(
            json.dumps({"name": name, "params": params, "sft": report, "build_s": time.time() - t0}, indent=2)
        )
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "build.json").is_file():  # not a concurrent winner: a real error
                raise
            # another process finished the same build first: use theirs
        if verbose:
            print(f"[asyncppo] builtin model ready in {time.time() - t0:.1f}s: {final}", flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def resolve_model_path(path: str, *, sft_steps: int = 300, seed: int = 0, cache_dir: str | None = None) -> str:
    """``builtin:<name>`` -> the cached built-in directory; anything else is returned unchanged."""
    if path.startswith("builtin:"):
        return ensure_builtin_model(path.split(":", 1)[1], cache_dir=cache_dir, sft_steps=sft_steps, seed=seed)
    return path


def model_of(cfg, path: str | None = None) -> str:
    """The model directory a launch of ``cfg`` starts from: its ``model.path`` (or ``path``, another model named
    as that config would build it), a ``builtin:`` name built with the config's ``trainer.sft_warmup_steps`` and
    ``trainer.seed`` (both part of the cache key). One place, so a launch, the benchmarks that start from a preset's
    model, the offline evaluator and the tests' model builder all mean the very same directory."""
    return resolve_model_path(path or cfg.model.path, sft_steps=cfg.trainer.sft_warmup_steps, seed=cfg.trainer.seed)
