"""Bring your own environment: skyrl-gym's own multi-turn GSM8K environment, unchanged, on SkyRL-format rows.

The rows are written here in SkyRL's format and read by ``data/text_rows.py``; each episode's environment is built
by ``make_text_env`` from ``env.text_env``'s class (``load_text_env``), so the row's ``reward_spec`` reaches the
constructor as ``extras`` (with ``max_turns``), as skyrl-train passes them. The episodes run through
``EpisodeEngine`` on the real transformers engine and, once, the real vLLM engine.

A random tiny model never writes ``#### 72``, so the rewards would all be 0 and prove little. The model here is a
tiny Qwen2 over the chat tokenizer, fitted in a second or two to a scripted answer path: on the first row it
answers ``#### 72`` (right: the environment's reward 1.0, done after one turn); on the second it first answers
``#### 4`` (well formatted but wrong: the environment's format score 0.2 / max_turns, and its instruction to try
again), then ``#### 5`` (right: 1.0, done). Decoding is greedy. Every reward is the environment's own, checked
against skyrl-gym's scoring function on the text the model wrote; the sequence holds the environment's instruction
as environment tokens.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from asyncppo.data.text_rows import read_text_env_rows
from asyncppo.envs.chat import build_chat_tokenizer, turn_ids
from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.episodes import EpisodeEngine
from asyncppo.envs.text_env import load_text_env, make_text_env
from asyncppo.rollout.engine import SamplingSpec

# skyrl-gym is the optional extra asyncppo[envs], which the README's install and CI put in: a missing package fails
# this module loudly rather than skipping it, so a broken install cannot pass
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402
from skyrl_gym.envs.gsm8k import utils as gsm8k_utils  # noqa: E402

GSM8K = "skyrl_gym.envs.gsm8k.multi_turn_env.GSM8kMultiTurnEnv"
MAX_TURNS = 3
SYSTEM = {"role": "system", "content": "Reply '#### N'."}
ROWS = [  # SkyRL's format; (question, ground truth, the scripted answers of the model)
    ("8*9?", "72", ["#### 72"]),
    ("2+3?", "5", ["#### 4", "#### 5"]),
]


def _row(i, question, truth):
    return {"data_source": "local/arith", "env_class": "gsm8k_multi_turn",
            "prompt": [SYSTEM, {"role": "user", "content": question}],
            "reward_spec": {"method": "rule", "ground_truth": truth}, "extra_info": {"split": "train", "index": i}}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "train.jsonl"
    path.write_text("".join(json.dumps(_row(i, q, t)) + "\n" for i, (q, t, _) in enumerate(ROWS)))
    return read_text_env_rows([str(path)])


def _scripted_sequence(tok, row, answers):
    """Prompt ids, then per answer: its ids + <|im_end|> (model tokens), and the environment's reply rendered by
    turn_ids (environment tokens), exactly as the episode loop appends them. Also the mask of model tokens."""
    prompt = tok.encode(tok.apply_chat_template(row.prompt_messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    env = make_text_env(load_text_env(GSM8K), row.episode_extras(), max_turns=MAX_TURNS)
    ids, model = list(prompt), [False] * len(prompt)
    for answer in answers:
        said = tok.encode(answer + "<|im_end|>", add_special_tokens=False)
        ids += said
        model += [True] * len(said)
        out = env.step(answer)
        if out["done"]:
            break
        reply = turn_ids(tok, out["observations"], model_stop_text="<|im_end|>")
        ids += reply
        model += [False] * len(reply)
    return ids, model


@pytest.fixture(scope="module")
def answering_model(tmp_path_factory, rows):
    """A tiny Qwen2 fitted to the scripted answers (model tokens only) until greedy decoding reproduces them."""
    from test_episodes import tiny_chat_qwen2

    tok = build_chat_tokenizer()
    model = tiny_chat_qwen2(tok)
    seqs = [_scripted_sequence(tok, row, answers) for row, (_, _, answers) in zip(rows, ROWS)]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s, _ in seqs])
    target = torch.tensor([m + [False] * (width - len(m)) for _, m in seqs])[:, 1:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~30 ms a step; with 2 threads on a loaded 2-core box, over 20 times that
    try:
        _fit(model, ids, target)
    finally:
        torch.set_num_threads(threads)
    out = str(tmp_path_factory.mktemp("answering-model"))
    model.eval().save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out, tok


def _fit(model, ids, target, max_steps=400):
    """Adam on the scripted model tokens until each is the argmax with probability > 0.74 (some 50 steps)."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(max_steps):
        logits = model(input_ids=ids).logits[:, :-1]
        if bool((logits.argmax(-1) == ids[:, 1:])[target].all()):
            margin = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0][target].min()
            if margin > -0.3:  # every scripted token wins by far (p > 0.74): greedy decoding cannot flip on rounding
                break
        loss = torch.nn.functional.cross_entropy(logits[target], ids[:, 1:][target])
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        pytest.fail(f"the tiny model did not learn the scripted answers in {max_steps} steps")


def _run_rows(engine, tok, rows, env_cls, *, n=2, env_config=None):
    """Every row as one group of ``n`` episodes, greedy; the groups by key, and the environments by group."""
    envs = {f"row{r.index}": [make_text_env(env_cls, r.episode_extras(), env_config, max_turns=MAX_TURNS)
                              for _ in range(n)] for r in rows}
    got, t0 = {}, time.monotonic()
    with EnvRunner(max_concurrency=4, step_timeout_s=30) as runner:
        eps = EpisodeEngine(engine, tok, runner, max_turns=MAX_TURNS + 2, response_length=300, turn_max_tokens=16)
        for r in rows:
            eps.add_group(f"row{r.index}", None, SamplingSpec(n=n, max_tokens=300, temperature=0.0),
                          envs[f"row{r.index}"], prompt_messages=r.prompt_messages)
        while len(got) < len(rows):
            assert time.monotonic() - t0 < 60, f"episodes: {sorted(got)} of {len(rows)} groups after 60 s"
            got.update((g.key, g) for g in eps.step())
        eps.close()
    return got, envs


def _model_turn_texts(tok, c):
    """The text of each model turn, as the environment read it (stop token cut)."""
    cuts = [x for start, length in c.env_runs for x in (int(start), int(start + length))]
    turns = np.split(np.asarray(c.token_ids), cuts)[::2]
    return [tok.decode([int(t) for t in t_ids if t != tok.convert_tokens_to_ids("<|im_end|>")],
                       skip_special_tokens=False) for t_ids in turns]


def _check_gsm8k_groups(tok, rows, got, envs):
    for r, (_, truth, answers) in zip(rows, ROWS):
        group = got[f"row{r.index}"]
        assert not group.dropped and len(group.completions) == 2
        for env, c in zip(envs[f"row{r.index}"], group.completions):
            # extras reached the constructor: the row's ground truth, the run's max_turns
            assert env.ground_truth == truth and env.max_turns == MAX_TURNS and env.turns == len(answers)
            assert _model_turn_texts(tok, c) == answers
            expected = [gsm8k_utils.compute_score(a, truth, method="strict", format_score=0.2 / MAX_TURNS)
                        for a in answers]  # skyrl-gym's own scoring of the text the model wrote
            np.testing.assert_allclose(c.turn_rewards, expected)
            assert c.turn_rewards[-1] == 1.0 and c.ended == "done"
            assert len(c.env_runs) == len(answers) - 1  # the environment's instruction between wrong and right
            if len(answers) > 1:
                start, length = (int(x) for x in c.env_runs[0])
                reply = tok.decode([int(t) for t in c.token_ids[start: start + length]], skip_special_tokens=False)
                assert "#### ANSWER" in reply and np.all(c.logprobs[start: start + length] == 0.0)
    np.testing.assert_allclose(got["row1"].completions[0].turn_rewards, [0.2 / MAX_TURNS, 1.0])


def test_gsm8k_multi_turn_on_the_hf_engine(answering_model, rows):
    from asyncppo.rollout.engines import make_engine

    path, tok = answering_model
    hf = make_engine("hf", path, dtype="float32", max_model_len=400, seed=0, num_threads=1)
    try:
        got, envs = _run_rows(hf, tok, rows, load_text_env(GSM8K))
    finally:
        hf.close()
    _check_gsm8k_groups(tok, rows, got, envs)


def test_gsm8k_multi_turn_on_the_vllm_engine(answering_model, rows):
    from vllm_required import require_vllm

    require_vllm()
    from asyncppo.rollout.engines import make_engine

    path, tok = answering_model
    eng = make_engine("vllm", path, dtype="float32", max_model_len=400, seed=0, kv_cache_gib=1,
                      enable_prefix_caching=True, block_size=32)
    try:
        got, envs = _run_rows(eng, tok, rows, load_text_env(GSM8K))
    finally:
        eng.close()
    _check_gsm8k_groups(tok, rows, got, envs)


def test_scripted_steps_give_the_environments_own_rewards(rows):
    """The scripted path straight through the runner: wrong answer, then the right one."""
    env = make_text_env(load_text_env(GSM8K), rows[1].episode_extras(), max_turns=MAX_TURNS)
    with EnvRunner(max_concurrency=1, step_timeout_s=30) as runner:
        assert runner.init(env, rows[1].prompt_messages).observations == rows[1].prompt_messages
        wrong, right = runner.step(env, "#### 4"), runner.step(env, "so #### 5")
        runner.close(env)
    assert wrong.fault is None and wrong.reward == pytest.approx(0.2 / MAX_TURNS) and not wrong.done
    assert wrong.observations[0]["role"] == "user" and "#### ANSWER" in wrong.observations[0]["content"]
    assert right.fault is None and right.reward == 1.0 and right.done and right.observations == []


class RowEchoEnv(BaseTextEnv):
    """A user's environment, as written for skyrl-gym: keeps what it was given, ends after one turn with a reward
    that says whether the model's text contains the row's ground truth."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.env_config, self.extras = env_config, dict(extras or {})
        self.prompt = None

    def init(self, prompt):
        self.prompt = prompt
        return prompt, {}

    def step(self, action):
        hit = self.extras["reward_spec"]["ground_truth"] in action
        return {"observations": [], "reward": 0.5 if hit else 0.25, "done": True, "metadata": {}}


def test_a_user_class_by_dotted_path_runs_unchanged(answering_model, rows):
    from asyncppo.rollout.engines import make_engine

    cls = load_text_env(f"{__name__}.RowEchoEnv")
    assert cls is RowEchoEnv
    path, tok = answering_model
    hf = make_engine("hf", path, dtype="float32", max_model_len=400, seed=0, num_threads=1)
    try:
        got, envs = _run_rows(hf, tok, rows, cls, n=1, env_config={"judge": "contains"})
    finally:
        hf.close()
    for r in rows:
        [env], [c] = envs[f"row{r.index}"], got[f"row{r.index}"].completions
        assert env.extras == dict(r.extras, max_turns=MAX_TURNS) and env.prompt == r.prompt_messages
        assert env.env_config.judge == env.env_config["judge"] == "contains"  # a DictConfig, as skyrl-train's
        assert c.ended == "done" and len(c.turn_rewards) == 1
    # the scripted first answers: "#### 72" holds row 0's truth, "#### 4" not row 1's
    assert [got[f"row{r.index}"].completions[0].reward for r in rows] == [0.5, 0.25]
