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


def _perturbed(path: str, seed: int):
    """The chat model with every weight moved by half its mean magnitude, seeded: other weights for a push."""
    from transformers import Qwen2ForCausalLM

    new = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return new


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
    stepped = []
    with EnvRunner(max_concurrency=4, step_timeout_s=30) as runner:
        eps = _episodes(engine, tok, runner)
        eps.add_group("0-0", prompt, SamplingSpec(n=2, max_tokens=200, temperature=1.0, seed=3), envs)
        [group] = _run(eps, 1, on_step=lambda: stepped.append(eps.last_stepped))
        eps.close()
    assert group.key == "0-0" and not group.dropped and len(group.completions) == 2
    model_tokens = 0
    for env, c in zip(envs, group.completions):
        mask = _check_sequence(tok, env, c)
        model_tokens += int(mask.sum())
        lp = _forward_logprobs(model, prompt, [int(t) for t in c.token_ids])
        np.testing.assert_allclose(c.logprobs[mask], lp[mask], atol=TOL, rtol=0)
        assert c.reward == 6.0 and c.ended == "done"
    assert eps.counters["turns"] == 6 and eps.counters["truncated"] == 0
    # the worker's meter counts the sequences each step ran (the turns that re-entered it included): every model
    # token came from one engine step of its sequence, so the counts add up to the model's tokens
    assert sum(stepped) == model_tokens, (sum(stepped), model_tokens)
    return prompt, group


def _record_through_door(engine, tok, prompt, group, learner_version: int):
    """The group as the worker would send it, encoded, decoded, and admitted by the learner's door."""
    from types import SimpleNamespace

    from asyncppo.envs.episode_groups import EpisodeGroupBuilder
    from asyncppo.rollout.meter import EngineMeter
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
    path, tok, old = chat_model
    new = _perturbed(path, seed=5)
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
            eps.add_group("0-1", prompt, SamplingSpec(n=1, max_tokens=200, temperature=1.0, seed=11), [env])
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


def test_a_version_that_comes_back_with_other_weights_meets_no_prefix_cached_under_the_first(chat_model, engine):
    """vLLM resets its prefix cache after a load only when no request holds a block (mid-generation loads nearly
    always have one), and a version number can come back with other weights: a learner resumed from an older
    checkpoint pushes the versions after it again. So the engine salts new requests with its count of loads as well
    as the version (rollout/vllm_engine.py: add_group). Here a long request holds blocks across two loads, so the
    reset cannot happen; the same prompt is generated under one set of weights and then, labelled with the same
    version, under another: the second must be computed under the weights in force, not read from the block the
    first left in the cache (with the version alone as the salt, all 12 of its log-probs were off, by up to 0.16
    nats: measured)."""
    path, tok, old = chat_model
    new = _perturbed(path, seed=9)
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = (_prompt_ids(tok) * 8)[: block + 5]  # one whole block the cache can keep, and a few tokens more
    spec = SamplingSpec(n=1, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)

    def run(key: str):
        engine.add_group(key, prompt, spec)
        done: list = []
        while key not in [g.key for g in done]:
            done += engine.step()
        return next(g for g in done if g.key == key).completions[0]

    try:
        engine.add_group("holder", _prompt_ids(tok)[:5], SamplingSpec(n=1, max_tokens=300, temperature=1.0, seed=1,
                                                                      ignore_eos=True))
        engine.step()
        engine.update_weights(new.state_dict().items())
        engine.set_weight_version(7)
        first = run("first")  # leaves the prompt's first block cached, computed under the new weights
        engine.update_weights(old.state_dict().items())  # the holder still runs: vLLM cannot reset its cache
        engine.set_weight_version(7)  # the same number, other weights
        second = run("second")
        assert engine.num_unfinished_seqs() == 1  # the holder held its blocks throughout
    finally:
        engine.abort_all()
        engine.update_weights(old.state_dict().items())
        engine.set_weight_version(8)
    for c, model in ((first, new), (second, old)):
        toks = [int(t) for t in c.token_ids]
        np.testing.assert_allclose(c.logprobs, _forward_logprobs(model, prompt, toks), atol=TOL, rtol=0)


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


def test_a_dropped_groups_turn_in_the_engine_is_stepped_out(chat_model, engine):
    """A group dropped while a turn of it is still decoding (a fault of its sibling's environment): the turn stays
    counted as unfinished, so a worker keeps stepping until it runs out of the engine and frees its slot (an episode
    engine that reported 0 while holding it was never stepped again, and the slot stayed taken); the group comes
    back dropped."""
    _, tok, _ = chat_model
    with EnvRunner(max_concurrency=4, step_timeout_s=30) as runner:
        eps = _episodes(engine, tok, runner, turn_max=24)
        eps.add_group("g", _prompt_ids(tok), SamplingSpec(n=2, max_tokens=200, temperature=1.0, seed=5),
                      [ScriptedEnv(), ScriptedEnv()])
        t0 = time.monotonic()
        while not eps.engine.num_unfinished_seqs():  # the episodes' init, then their first turns enter the engine
            assert time.monotonic() - t0 < 30
            eps.step()
        eps._drop_group("g", "raised", "a sibling's tool crashed")
        orphans = eps.engine.num_unfinished_seqs()
        assert orphans > 0 and eps.num_unfinished_seqs() == orphans
        got = []
        while eps.num_unfinished_seqs():
            assert time.monotonic() - t0 < 60
            got += eps.step()
        assert eps.engine.num_unfinished_seqs() == 0  # stepped out: the slots are free
        got += eps.step()
        eps.close()
    assert [g.key for g in got] == ["g"] and got[0].dropped and "crashed" in got[0].detail


@pytest.fixture
def hf_engine(chat_model):
    """Per test: its close gives the process's thread count back before the next vLLM test (rollout/hf_engine.py)."""
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


# ---------------------------------------------------------------------------------------------- faults on vLLM
HANG_S, DEADLINE_S = 8.0, 3.0  # a hanging step sleeps well past the runner's deadline in these tests


class FaultAtTurn2Env(ScriptedEnv):
    """:class:`ScriptedEnv` whose second step (or ``init``, for the ``init_*`` kinds) breaks one way."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def init(self, prompt_messages):
        if self.kind == "init_not_messages":
            return "not a list of messages", {}
        return super().init(prompt_messages)

    def step(self, action_text):
        if len(self.actions) != 1:
            return super().step(action_text)
        self.actions.append(action_text)
        reply, kind = [{"role": "user", "content": REPLIES[1]}], self.kind
        if kind == "raise":
            raise RuntimeError("tool crashed")
        if kind == "hang":
            time.sleep(HANG_S)
        return {"not_a_list": ({"role": "user", "content": "x"}, 2.0, False, {}),
                "non_string_content": ([{"role": "user", "content": 42}], 2.0, False, {}),
                "nan": (reply, float("nan"), False, {}), "inf": (reply, float("-inf"), False, {}),
                }.get(kind, (reply, 2.0, False, {}))


#: the fault kind of the outcome (and the episode's end) for each way a FaultAtTurn2Env breaks
FAULT_OF = {"raise": "raised", "hang": "timeout", "not_a_list": "malformed", "non_string_content": "malformed",
            "nan": "nonfinite_reward", "inf": "nonfinite_reward"}
#: what the dropped group's detail says of each
DETAIL_OF = {"raise": "RuntimeError: tool crashed", "hang": "no answer within env.step_timeout_s",
             "not_a_list": "must be a list of chat messages", "non_string_content": "with str 'role' and 'content'",
             "nan": "reward nan is not finite", "inf": "reward -inf is not finite"}


def _fault_groups(engine, tok, on_error: str):
    """One group per fault kind (a healthy episode beside the faulty one), one group whose ``init`` is malformed,
    and one healthy group, all in flight at once on one engine; the groups by key, the runner's fault counts and
    the episode counters."""
    groups = {kind: [ScriptedEnv(), FaultAtTurn2Env(kind)] for kind in [*FAULT_OF, "init_not_messages"]}
    groups["healthy"] = [ScriptedEnv(), ScriptedEnv()]
    with EnvRunner(max_concurrency=16, step_timeout_s=DEADLINE_S, on_error=on_error) as runner:
        eps = _episodes(engine, tok, runner)
        for i, (key, envs) in enumerate(groups.items()):
            eps.add_group(key, _prompt_ids(tok), SamplingSpec(n=2, max_tokens=200, temperature=1.0, seed=20 + i),
                          envs)
        got = {g.key: g for g in _run(eps, len(groups))}
        eps.close()
        faults = dict(runner.faults)
    return got, faults, eps.counters


@pytest.mark.slow  # 5-12 s each (the hung step's deadline is 3 s)
@pytest.mark.parametrize("on_error", ["zero_reward", "drop"])
def test_every_fault_kind_on_vllm(chat_model, engine, on_error):
    """Each fault through the episode loop on vLLM: a raise, a step hung past ``env.step_timeout_s``, observations
    that are not a list of messages or whose content is not a string, a NaN or infinite reward, and an ``init``
    that returns no messages. ``zero_reward``: the faulty episode ends there with reward 0 for that turn and its
    group is kept (the healthy episode beside it earns its 1 + 2 + 3); ``drop``: the group comes back dropped,
    naming the fault. A failed ``init`` drops its group either way. No other group is touched, and every fault is
    counted by kind."""
    _, tok, _ = chat_model
    t0 = time.monotonic()
    got, faults, counters = _fault_groups(engine, tok, on_error)
    assert time.monotonic() - t0 < HANG_S + 30  # the hung step was left behind at its deadline
    assert faults == {"raised": 1, "timeout": 1, "malformed": 3, "nonfinite_reward": 2}, faults
    assert got["init_not_messages"].dropped and "init messages must be a list" in got["init_not_messages"].detail
    healthy = got["healthy"]
    assert not healthy.dropped and [c.reward for c in healthy.completions] == [6.0, 6.0]
    for kind, fault in FAULT_OF.items():
        group = got[kind]
        if on_error == "drop":
            assert group.dropped and group.completions == [] and DETAIL_OF[kind] in group.detail, group.detail
            continue
        assert not group.dropped, (kind, group.detail)
        good, bad = group.completions
        assert good.reward == 6.0 and good.ended == "done"
        assert bad.ended == fault and list(bad.turn_rewards) == [1.0, 0.0], (kind, bad.ended, bad.turn_rewards)
        assert bad.env_runs.shape == (1, 2)  # the first reply only: a faulty reply is never appended
    assert counters["dropped_groups"] == (1 if on_error == "zero_reward" else 1 + len(FAULT_OF))


# ---------------------------------------------------------------------------------------------- tool calls on vLLM
CALC = {"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}
#: the model's scripted turns: a call that is not JSON, a call of a tool that does not exist, a good call, the answer
TOOL_TURNS = ['<tool_call>{x</tool_call>', '<tool_call>{"name": "ask"}</tool_call>',
              '<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>', "42"]


class CalcEnv(TextEnv):
    """The calculator of docs/environments.md: malformed or unknown calls are answered with an error observation
    (the episode goes on), a good call with its result, a turn without a call is the final answer."""

    tools = [CALC]

    def step(self, action_text):
        from asyncppo.envs.tools import error_observation, parse_tool_calls, tool_message

        parsed = parse_tool_calls(action_text, known_tools={"calc"})
        if parsed.errors:
            return error_observation(parsed.errors), 0.0, False, {}
        if parsed.calls:
            a, b = parsed.calls[0].arguments["expr"].split("*")
            return [tool_message(str(int(a) * int(b)))], 0.0, False, {}
        return [], float(parsed.text.strip() == "42"), True, {}


def _tool_script(tok):
    """Prompt ids (rendered without the tools' long system text: the engine's context is 400 tokens), the
    scripted sequence (the model's turns and the calculator's replies, appended as the loop appends them) and the
    mask of the model's tokens."""
    prompt = _prompt_ids(tok)
    env, ids, model = CalcEnv(), list(prompt), [False] * len(prompt)
    for text in TOOL_TURNS:
        said = tok.encode(text + "<|im_end|>", add_special_tokens=False)
        ids, model = ids + said, model + [True] * len(said)
        observations, _, done, _ = env.step(text)
        if not done:
            reply = turn_ids(tok, observations, tools=CalcEnv.tools, model_stop_text="<|im_end|>")
            ids, model = ids + reply, model + [False] * len(reply)
    return prompt, ids, model


def test_malformed_and_unknown_tool_calls_are_answered_and_counted_on_vllm(chat_model, engine):
    """A model fitted to a scripted path writes a malformed call, a call of an unknown tool, a good call and the
    answer: the first two are answered with error observations (environment tokens), counted as tool errors by the
    worker's runner, and the episode goes on to its reward."""
    from test_skyrl_gym import _fit  # the same fitting as skyrl-gym's scripted answers

    from asyncppo.envs.episode_worker import CountingRunner

    _, tok, old = chat_model
    prompt, ids, model_mask = _tool_script(tok)
    assert len(ids) < 400, len(ids)
    fitted = tiny_chat_qwen2(tok)
    fitted.load_state_dict(old.state_dict())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fit(fitted, torch.tensor([ids]), torch.tensor([model_mask])[:, 1:])
    finally:
        torch.set_num_threads(threads)
    engine.update_weights(fitted.eval().state_dict().items())
    engine.set_weight_version(10)  # a new salt: no prefix cached under other weights is reused
    try:
        env = CalcEnv()
        with CountingRunner(max_concurrency=2, step_timeout_s=30) as runner:
            eps = _episodes(engine, tok, runner, response_length=400 - len(prompt), turn_max=64)
            eps.add_group("tools", prompt, SamplingSpec(n=1, max_tokens=300, temperature=0.0), [env])
            [group] = _run(eps, 1)
            eps.close()
    finally:
        engine.update_weights(old.state_dict().items())
        engine.set_weight_version(11)
    c = group.completions[0]
    assert [int(t) for t in c.token_ids] == ids[len(prompt):]  # the scripted path, replies included
    assert c.ended == "done" and list(c.turn_rewards) == [0.0, 0.0, 0.0, 1.0] and len(c.env_runs) == 3
    replies = [tok.decode([int(t) for t in c.token_ids[s: s + n]], skip_special_tokens=False) for s, n in c.env_runs]
    assert "error: malformed tool call (not JSON" in replies[0] and "error: unknown tool 'ask'" in replies[1]
    assert "42" in replies[2] and "error" not in replies[2]
    assert dict(runner.tools.counts) == {"calls": 1, "malformed": 1, "unknown": 1}
    assert sum(runner.faults.values()) == 0  # a bad tool call is the model's error, not the environment's
