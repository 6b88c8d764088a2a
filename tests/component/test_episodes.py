"""Multi-turn episodes through the real vLLM CPU engine (envs/episodes.py).

* A scripted 3-turn environment: the episode's sequence is prompt + model ids + environment ids exactly (the
  environment's ids are its chat rendering, appended), with the mask as environment runs, and a transformers
  forward pass of the generating weights over the whole sequence reproduces the behaviour log-probs at every
  model token.
* A weight update while the environment answers turn 1: turn 1 carries version 0, turns 2 and 3 version 1 (the
  environment tokens in between the version of the model token before them), and the later turns' log-probs are
  the new weights'.
* An environment that sleeps leaves the engine to the other groups: one finishes while it sleeps, and the engine
  keeps decoding meanwhile.

The model is a random tiny Qwen2 over the chat tokenizer of envs/chat.py (so the chat special tokens exist).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from asyncppo.envs.chat import build_chat_tokenizer, turn_ids
from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.text_env import TextEnv
from asyncppo.rollout.engine import SamplingSpec
from asyncppo.envs.episodes import EpisodeEngine

TOL = 2e-5
REPLIES = ["first reply", "second reply"]
PROMPT = [{"role": "user", "content": "hi"}]


class ScriptedEnv(TextEnv):
    """Replies with fixed text twice, then ends on the third turn; turn k earns reward k."""

    def __init__(self, gate: threading.Event | None = None, sleep_s: float = 0.0):
        super().__init__()
        self.actions, self.gate, self.sleep_s = [], gate, sleep_s

    def step(self, action_text):
        self.actions.append(action_text)
        if self.gate is not None and len(self.actions) == 1:
            assert self.gate.wait(60), "the test never released the environment"
        time.sleep(self.sleep_s)
        turn = len(self.actions)
        if turn == 3:
            return [], float(turn), True, {}
        return [{"role": "user", "content": REPLIES[turn - 1]}], float(turn), False, {}


def tiny_chat_qwen2(tok):
    """A random 2-layer Qwen2 (fp32, seed 0) over the chat tokenizer ``tok``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id, use_sliding_window=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(torch.float32)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    tok = build_chat_tokenizer()
    model = tiny_chat_qwen2(tok).eval()
    out = str(tmp_path_factory.mktemp("chat-model"))
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out, tok, model


@pytest.fixture(scope="module")
def engine(chat_model):
    from vllm_required import require_vllm

    require_vllm()
    from asyncppo.rollout.engines import make_engine

    # 32-token blocks (vLLM caches whole blocks only; the CPU default of 128 exceeds these short episodes), stats
    # on so that the test can read the prefix cache's hits
    eng = make_engine("vllm", chat_model[0], dtype="float32", max_model_len=400, seed=0, kv_cache_gib=1,
                      enable_prefix_caching=True, block_size=32, disable_log_stats=False)
    yield eng
    eng.close()


def _episodes(engine, tok, runner, **kw):
    return EpisodeEngine(engine, tok, runner, max_turns=kw.pop("max_turns", 4),
                         response_length=kw.pop("response_length", 200), turn_max_tokens=kw.pop("turn_max", 12))


def _run(eps, want: int, deadline_s: float = 60.0, on_step=None):
    got, t0 = [], time.monotonic()
    while len(got) < want:
        assert time.monotonic() - t0 < deadline_s, f"episodes: {len(got)} of {want} groups after {deadline_s}s"
        got += eps.step()
        if on_step is not None:
            on_step()
        if not eps.engine.num_unfinished_seqs():
            time.sleep(0.005)
    return got


@torch.no_grad()
def _forward_logprobs(model, prompt, response) -> np.ndarray:
    ids = torch.tensor([list(prompt) + list(response)])
    lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1: -1].double(), -1)
    return lp.gather(1, torch.tensor(response)[:, None]).squeeze(1).numpy()


def _cached_prompt_tokens(engine) -> int:
    return int(next(m.value for m in engine.llm.get_metrics() if m.name == "vllm:prompt_tokens_cached"))


def _prompt_ids(tok):
    return tok.encode(tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def _check_sequence(tok, env, c):
    """Response = model ids + the environment's rendered ids, turn by turn; the runs mark the latter."""
    runs = [tuple(r) for r in c.env_runs]
    assert len(runs) == 2 and len(c.turn_rewards) == 3
    resp = [int(t) for t in c.token_ids]
    mask = np.ones(len(resp), bool)
    for (start, length), reply in zip(runs, REPLIES):
        model_stop = "<|im_end|>" if tok.convert_ids_to_tokens(resp[start - 1]) == "<|im_end|>" else ""
        expected = turn_ids(tok, [{"role": "user", "content": reply}], model_stop_text=model_stop)
        assert resp[start: start + length] == expected
        mask[start: start + length] = False
        assert np.all(c.logprobs[start: start + length] == 0.0)
    # the environment saw exactly the model's text of each turn
    turns = np.split(np.arange(len(resp)), [s for r in runs for s in (r[0], r[0] + r[1])])[::2]
    for idx, action in zip(turns, env.actions):
        ids = [resp[i] for i in idx]
        if ids and ids[-1] in (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id):
            ids = ids[:-1]  # the stop token ended the turn; the environment reads the text before it
        assert tok.decode(ids, skip_special_tokens=False) == action
    np.testing.assert_array_equal(c.turn_rewards, [1.0, 2.0, 3.0])
    return mask


def _three_turn_group(engine, tok, model):
    prompt = _prompt_ids(tok)
    envs = [ScriptedEnv(), ScriptedEnv()]
    with EnvRunner(max_concurrency=4, step_timeout_s=30) as runner:
        eps = _episodes(engine, tok, runner)
        eps.add_group("g0", prompt, SamplingSpec(n=2, max_tokens=200, temperature=1.0, seed=3), envs)
        [group] = _run(eps, 1)
        eps.close()
    assert group.key == "g0" and not group.dropped and len(group.completions) == 2
    for env, c in zip(envs, group.completions):
        mask = _check_sequence(tok, env, c)
        lp = _forward_logprobs(model, prompt, [int(t) for t in c.token_ids])
        np.testing.assert_allclose(c.logprobs[mask], lp[mask], atol=TOL, rtol=0)
        assert c.reward == 6.0 and c.ended == "done"
    assert eps.counters["turns"] == 6 and eps.counters["truncated"] == 0
    return prompt, group


def _record_through_door(engine, tok, prompt, group, learner_version: int):
    """The group as the worker would send it, encoded, decoded, and admitted by the learner's door."""
    from types import SimpleNamespace

    from asyncppo.envs.episode_groups import EpisodeGroupBuilder
    from asyncppo.rollout.worker import EngineMeter
    from asyncppo.stream.validate import ContentLimits, GroupValidator
    from asyncppo.stream.wire import decode_group, encode_group

    row = SimpleNamespace(prompt_ids=prompt, answer="", index=0)
    flight = SimpleNamespace(row=row, ticket=SimpleNamespace(index=0), admitted_at=time.time(), version=0)
    stats = {"reward_failures": 0, "gen_tokens": 0, "samples": 0}
    record = decode_group(encode_group(EpisodeGroupBuilder(engine, 0, stats).build(group, flight, EngineMeter())))
    limits = ContentLimits(vocab_size=len(tok), max_prompt_len=64, max_response_len=200, max_samples=2)
    assert GroupValidator(limits, lambda: learner_version).check(record) is None
    return record


def test_three_turn_episode_is_exact(chat_model, engine):
    """... and the group goes out as one record that survives the wire and passes the learner's door."""
    _, tok, model = chat_model
    cached_before = _cached_prompt_tokens(engine)
    prompt, group = _three_turn_group(engine, tok, model)
    assert _cached_prompt_tokens(engine) > cached_before  # later turns re-used their prefix from the cache
    record = _record_through_door(engine, tok, prompt, group, learner_version=0)
    for s, c in zip(record.samples, group.completions):
        np.testing.assert_array_equal(s.response_ids, c.token_ids)
        np.testing.assert_array_equal(s.env_runs, c.env_runs)
        np.testing.assert_array_equal(s.turn_rewards, [1.0, 2.0, 3.0])
        assert s.reward == 6.0


def test_three_turn_episode_is_exact_on_the_hf_engine(chat_model):
    """The transformers backend behind the same interface: the same sequence form, the same log-prob check."""
    from asyncppo.rollout.engines import make_engine

    path, tok, model = chat_model
    hf = make_engine("hf", path, dtype="float32", max_model_len=400, seed=0, num_threads=1)
    try:
        _three_turn_group(hf, tok, model)
    finally:
        hf.close()


def test_weight_update_between_turns(chat_model, engine):
    from transformers import Qwen2ForCausalLM

    path, tok, old = chat_model
    new = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    gate, env = threading.Event(), None
    env = ScriptedEnv(gate=gate)
    prompt = _prompt_ids(tok)
    updated = []

    def update_while_env_waits():
        if not updated and env.actions:  # turn 1 ended and its environment is holding on the gate
            engine.update_weights(new.state_dict().items())
            engine.set_weight_version(1)
            updated.append(True)
            gate.set()

    try:
        with EnvRunner(max_concurrency=2, step_timeout_s=30) as runner:
            eps = _episodes(engine, tok, runner)
            eps.add_group("g1", prompt, SamplingSpec(n=1, max_tokens=200, temperature=1.0, seed=11), [env])
            [group] = _run(eps, 1, on_step=update_while_env_waits)
            eps.close()
        c = group.completions[0]
        mask = _check_sequence(tok, env, c)
        first_env = int(c.env_runs[0, 0])
        assert set(c.versions[:first_env]) == {0}
        assert set(c.versions[first_env + int(c.env_runs[0, 1]):]) == {1}
        assert set(c.versions[first_env: first_env + int(c.env_runs[0, 1])]) == {0}  # the model token before
        resp = [int(t) for t in c.token_ids]
        lp_old, lp_new = _forward_logprobs(old, prompt, resp), _forward_logprobs(new, prompt, resp)
        later = mask & (np.arange(len(resp)) >= first_env)
        np.testing.assert_allclose(c.logprobs[:first_env], lp_old[:first_env], atol=TOL, rtol=0)
        np.testing.assert_allclose(c.logprobs[later], lp_new[later], atol=TOL, rtol=0)
        record = _record_through_door(engine, tok, prompt, group, learner_version=1)
        s = record.samples[0]
        assert (s.version_min, s.version_max) == (0, 1)
        np.testing.assert_array_equal(s.token_versions(), c.versions)
    finally:
        engine.update_weights(old.state_dict().items())
        engine.set_weight_version(2)


def test_sleeping_environment_does_not_stall_other_groups(chat_model, engine):
    _, tok, _ = chat_model
    prompt = _prompt_ids(tok)
    sleepy = ScriptedEnv(sleep_s=2.0)
    busy = [ScriptedEnv(), ScriptedEnv()]
    steps_while_asleep = []

    def watch():
        if eps.num_at_env() and sleepy.actions and len(sleepy.actions) == 1 and eps.num_running_seqs():
            steps_while_asleep.append(eps.num_running_seqs())

    with EnvRunner(max_concurrency=4, step_timeout_s=30) as runner:
        eps = _episodes(engine, tok, runner, turn_max=24)
        eps.add_group("sleepy", prompt, SamplingSpec(n=1, max_tokens=200, temperature=1.0, seed=1), [sleepy])
        eps.add_group("busy", prompt, SamplingSpec(n=2, max_tokens=200, temperature=1.0, seed=2), busy)
        t0 = time.monotonic()
        groups = _run(eps, 2, on_step=watch)
        eps.close()
    order = [g.key for g in groups]
    assert order == ["busy", "sleepy"], order
    assert time.monotonic() - t0 >= 3 * 2.0 - 0.5  # the sleepy episode slept three times
    # while the sleepy episode's environment slept, the engine decoded the busy group (two sequences)
    assert len(steps_while_asleep) >= 20 and max(steps_while_asleep) == 2


class RaisingEnv(ScriptedEnv):
    def step(self, action_text):
        super().step(action_text)
        raise RuntimeError("tool crashed")


@pytest.fixture(scope="module")
def hf_engine(chat_model):
    from asyncppo.rollout.engines import make_engine

    eng = make_engine("hf", chat_model[0], dtype="float32", max_model_len=400, seed=0, num_threads=1)
    yield eng
    eng.close()


def _one_group(engine, tok, envs, on_error="zero_reward", **kw):
    with EnvRunner(max_concurrency=4, step_timeout_s=30, on_error=on_error) as runner:
        eps = _episodes(engine, tok, runner, **kw)
        eps.add_group("g", _prompt_ids(tok), SamplingSpec(n=len(envs), max_tokens=200, temperature=1.0, seed=4), envs)
        [group] = _run(eps, 1)
        eps.close()
    return group, eps.counters


def test_limits_turns_budget_and_faults(chat_model, hf_engine):
    """``max_turns`` ends an episode after its last allowed turn; the token budget (model and environment tokens)
    truncates, counted; a raising environment zeroes its turn (``zero_reward``) or drops the group (``drop``)."""
    _, tok, _ = chat_model
    group, counters = _one_group(hf_engine, tok, [ScriptedEnv()], max_turns=2)
    c = group.completions[0]
    assert c.ended == "max_turns" and len(c.turn_rewards) == 2 and c.env_runs.shape == (1, 2)
    assert counters["max_turns"] == 1 and counters["truncated"] == 0

    # 12 model tokens, then the first reply (> 20 tokens) does not fit in a budget of 30
    group, counters = _one_group(hf_engine, tok, [ScriptedEnv()], response_length=30, turn_max=12)
    c = group.completions[0]
    assert c.ended == "truncated" and c.finish_reason == "length" and counters["truncated"] == 1
    assert c.num_tokens <= 30 and c.env_runs.shape == (0, 2) and len(c.turn_rewards) == 1
    # a budget smaller than one turn's cap: the turn gets what remains
    group, _ = _one_group(hf_engine, tok, [ScriptedEnv()], response_length=5, turn_max=12)
    assert group.completions[0].num_tokens <= 5

    group, counters = _one_group(hf_engine, tok, [ScriptedEnv(), RaisingEnv()])
    assert not group.dropped and group.completions[1].ended == "raised"
    assert list(group.completions[1].turn_rewards) == [0.0] and group.completions[0].reward == 6.0
    group, counters = _one_group(hf_engine, tok, [ScriptedEnv(), RaisingEnv()], on_error="drop")
    assert group.dropped and "tool crashed" in group.detail and counters["dropped_groups"] == 1
