"""Routing replay through the real parts: the experts vLLM (CPU) and the transformers engine chose, on the wire, in the
learner's batch, and forced on the learner's forward.

Checked: each engine's record of every position equals the experts transformers' own forward chooses at the same
weights (the last token, which no engine ran, has none); groups streamed side by side, with several samples, keep
their own records; after the learner's router moved away from the engine's (the lag), ``measure`` counts the
disagreement and leaves the forward alone, and ``rollout`` makes every recorded position use the engine's experts,
padded and packed alike.

Every vLLM engine runs in a spawned child (tests/component/test_moe_push.py says why)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from asyncppo.data.tiny_moe import moe_model  # noqa: E402
from asyncppo.learner.batch import collate_groups  # noqa: E402
from asyncppo.learner.forward import policy_forward  # noqa: E402
from asyncppo.learner.packing import ONE_ROW  # noqa: E402
from asyncppo.models.moe_routing import RoutingHooks, RoutingRecorder, moe_routers  # noqa: E402
from asyncppo.rollout.engine import SamplingSpec  # noqa: E402
from asyncppo.stream.records import Sample, TrajectoryGroup  # noqa: E402
from asyncppo.stream.routing import RoutingColumn  # noqa: E402
from asyncppo.stream.wire import decode_group, encode_group  # noqa: E402

from tests.component.test_moe_push import VLLM_ENV  # noqa: E402

PROMPTS = [[3, 5, 7, 9, 11], [4, 6, 8], [12, 13, 14, 15, 16, 17, 18]]
VOCAB = 40


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A random 2-layer Qwen3-MoE, 8 experts top-2, routers with real preferences, saved as a checkpoint dir."""
    torch.manual_seed(0)
    dense = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = moe_model(dense, experts=8, top_k=2, expert_intermediate=32)
    with torch.no_grad():
        for r in moe_routers(model):
            r.weight.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("moe") / "model"
    model.save_pretrained(path)
    return str(path)


def _stream(engine, n=3, max_tokens=6):
    """All prompts added at once (one engine step serves several groups), streamed to the end."""
    for i, p in enumerate(PROMPTS):
        engine.add_group(f"g{i}", p, SamplingSpec(n=n, max_tokens=max_tokens, seed=10 + i, ignore_eos=True))
    done = {}
    while engine.num_unfinished_seqs():
        for g in engine.step():
            done[g.key] = [(c.token_ids.tolist(), c.logprobs.tolist(), c.routed_experts) for c in g.completions]
    return [done[f"g{i}"] for i in range(len(PROMPTS))]


@functools.lru_cache(maxsize=2)
def _reference_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, RoutingRecorder(model)


def _own_routing(path, prompt, tokens):
    model, rec = _reference_model(path)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt + tokens]))
    return rec.take().numpy()


def _vllm_child(path, q):
    import os
    import traceback
    try:
        os.environ.update(VLLM_ENV)
        from asyncppo.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(path, max_model_len=64, seed=0, capture_routing=True)
        try:
            q.put({"groups": _stream(engine), "experts": engine.num_experts})
        finally:
            engine.close()
    except BaseException:
        q.put({"error": traceback.format_exc()})


def _in_child(path):
    import multiprocessing as mp
    import queue
    import time
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_vllm_child, args=(path, q))
    proc.start()
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                res = q.get(timeout=2)
                break
            except queue.Empty:
                assert proc.is_alive(), f"vLLM child exited with code {proc.exitcode} before reporting"
                assert time.monotonic() < deadline
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert "error" not in res, res["error"]
    return res


def _check_records(path, groups):
    agree = total = 0
    for prompt, samples in zip(PROMPTS, groups):
        for tokens, _, record in samples:
            assert record.shape == (len(prompt) + len(tokens), 2, 2)
            assert (record[-1] == -1).all() and (record[:-1] >= 0).all()
            own = np.sort(_own_routing(path, prompt, tokens)[:-1], axis=-1)
            same = (np.sort(record[:-1], axis=-1) == own).all(axis=-1)
            agree, total = agree + int(same.sum()), total + same.size
    assert agree / total >= 0.99, f"engine and learner routing agree on {agree}/{total} (token, layer) pairs"
    return agree, total


def test_vllm_records_every_position_as_the_learner_would_route_it(moe_dir):
    res = _in_child(moe_dir)
    assert res["experts"] == 8
    agree, total = _check_records(moe_dir, res["groups"])
    print(f"vLLM vs transformers routing at the same weights: {agree}/{total} (token, layer) pairs agree")


def test_transformers_engine_records_every_position_as_the_learner_would_route_it(moe_dir):
    from asyncppo.rollout.hf_engine import HFEngine

    engine = HFEngine(moe_dir, max_model_len=64, seed=0, max_num_seqs=5, capture_routing=True)
    agree, total = _check_records(moe_dir, _stream(engine))  # 9 sequences through 5 slots: admitted mid-stream
    print(f"transformers engine vs forward routing: {agree}/{total} (token, layer) pairs agree")


def _batch(path):
    """A learner batch of the transformers engine's groups, through the wire (routing column included)."""
    from asyncppo.rollout.hf_engine import HFEngine

    engine = HFEngine(path, max_model_len=64, seed=0, max_num_seqs=16, capture_routing=True)
    groups = []
    for i, (prompt, samples) in enumerate(zip(PROMPTS, _stream(engine))):
        ss = [Sample(np.array(t, np.int32), np.array(lp, np.float32), float(j % 2), "length", 0, 0)  # GRPO: a spread
              for j, (t, lp, _) in enumerate(samples)]
        col = RoutingColumn.from_samples([r for _, _, r in samples], 8)
        groups.append(decode_group(encode_group(TrajectoryGroup(f"0-{i}", 0, np.array(prompt, np.int32), ss,
                                                                 ticket=i, routing=col))))
    return collate_groups(groups, pad_token_id=0)


def test_the_learner_measures_disagreement_and_replays_the_engines_experts(moe_dir):
    batch = _batch(moe_dir)
    assert batch.routed_experts.shape[:2] == batch.input_ids.shape and batch.routed_experts.dtype == torch.int16
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # the learner's routers moved on (a lag): some tokens now choose other experts
        for r in moe_routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    own_lp = policy_forward(model, batch, 1.0, False)[0]

    hooks = RoutingHooks.attach(model, apply=False)  # measure
    hooks.counting, hooks.current_version = True, 0
    with torch.no_grad():
        measured_lp = policy_forward(model, batch, 1.0, False)[0]
    m = hooks.take_metrics()
    assert torch.equal(measured_lp, own_lp)
    assert 0.02 < m["moe/routing_mismatch"] < 0.9 and m["moe/routing_mismatch_fresh"] == m["moe/routing_mismatch"]

    hooks.apply = True  # rollout (R3)
    rec = RoutingRecorder(model)  # registered after the replay hooks: sees the experts actually used
    for pack in (0, ONE_ROW):
        batch.pack_capacity = pack
        with torch.no_grad():
            replay_lp = policy_forward(model, batch, 1.0, False)[0]
        used = rec.take()
        if pack == 0:
            padded_lp = replay_lp
            lo = int(batch.attention_mask.any(0).nonzero()[0, 0])
            wanted = batch.routed_experts[:, lo:].reshape(-1, 2, 2)
            given = (wanted >= 0).all(-1)
            assert torch.equal(used[given].sort(-1).values, wanted[given].long().sort(-1).values)
        else:
            assert torch.allclose(replay_lp, padded_lp, atol=1e-5)  # packed and padded replay agree
    assert not torch.allclose(replay_lp, own_lp, atol=1e-4)  # replay changed the learner's log-probs


def test_measure_scores_each_batch_with_and_without_the_engines_experts(moe_dir):
    """``measure``: one PPO step also reports the behaviour -> learner KL of the same batch with the learner's own
    routing and with the engine's experts replayed. With the learner's routers moved away from the engine's, replay
    brings the learner's log-probs back toward the behaviour ones; the own-routing figure is the step's
    ``actor/mismatch_kl``."""
    from asyncppo.learner.ppo import PPOUpdate
    from tests.component.test_learner_distributed import _cfg

    batch = _batch(moe_dir)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    with torch.no_grad():
        for r in moe_routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    RoutingHooks.attach(model, apply=False)
    m = PPOUpdate(_cfg(dict(adv_estimator="grpo", use_critic=False)), model, None, None,
                  torch.device("cpu")).step(batch)
    assert m["moe/mismatch_kl_own"] == pytest.approx(m["actor/mismatch_kl"], rel=1e-4, abs=1e-7)
    assert m["moe/mismatch_kl_replay"] < 0.5 * m["moe/mismatch_kl_own"], m
    assert m["moe/routing_mismatch"] > 0.02


def test_learner_mode_records_its_own_routing_and_the_update_replays_it(moe_dir):
    """``learner``: the proximal pass's own routing, recorded over the batch's layout, equals what the engine
    recorded at the same weights; the update's forwards replay it, and how far the learner's own routers move from
    it within the step is counted: nothing at a zero learning rate, something at a large one."""
    from asyncppo.learner.forward import record_routing
    from asyncppo.learner.ppo import PPOUpdate
    from tests.component.test_learner_distributed import _cfg

    batch = _batch(moe_dir)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    own = record_routing(model, batch, 4)
    engine = batch.routed_experts
    recorded = (engine >= 0).all(-1)
    assert torch.equal(own[recorded].sort(-1).values, engine[recorded].long().sort(-1).values.to(torch.int16))
    assert ((own >= 0).all(-1) == batch.attention_mask.bool()[..., None]).all()  # every real position, no padding
    drift = {}
    for lr in (0.0, 0.05):
        model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
        RoutingHooks.attach(model, apply=True, by_version=False)
        cfg = _cfg(dict(adv_estimator="grpo", use_critic=False, ppo_epochs=2, routing_replay="learner", lr=lr))
        b = _batch(moe_dir)
        b.routed_experts = None  # learner mode: no engine record travels
        m = PPOUpdate(cfg, model, None, None, torch.device("cpu")).step(b)
        drift[lr] = m["moe/routing_mismatch"]
        assert "moe/routing_mismatch_fresh" not in m and m["actor/optimizer_steps"] == 2
    assert drift[0.0] == 0.0 and drift[0.05] > 0.0, drift


def test_a_multi_turn_episode_keeps_each_positions_record_from_the_turn_that_first_computed_it(tmp_path):
    """Three turns of a scripted environment through the episode engine on a transformers-engine MoE; the routers
    change between turn 1 and turn 2 (a weight push). The episode's record: the prompt and turn 1's tokens as the old
    routers chose them (when they were sampled), the environment's tokens and later turns as the new ones did (the
    next turn's prefill computed them first), the last token none; the whole record is as long as the sequence."""
    import threading

    from asyncppo.envs.chat import build_chat_tokenizer
    from asyncppo.envs.env_runner import EnvRunner
    from asyncppo.envs.episodes import EpisodeEngine
    from asyncppo.rollout.hf_engine import HFEngine
    from tests.component.test_episodes import PROMPT, ScriptedEnv, _run

    tok = build_chat_tokenizer()
    torch.manual_seed(0)
    dense = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                        bos_token_id=tok.bos_token_id)
    model = moe_model(dense, experts=8, top_k=2, expert_intermediate=32)
    with torch.no_grad():
        for r in moe_routers(model):
            r.weight.normal_(0, 0.5)
    path = str(tmp_path / "chat-moe")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    engine = HFEngine(path, max_model_len=400, seed=0, max_num_seqs=4, capture_routing=True)
    gate = threading.Event()
    runner = EnvRunner(4, 30.0, "zero_reward")
    try:
        eps = EpisodeEngine(engine, tok, runner, max_turns=4, response_length=120, turn_max_tokens=8)
        eps.add_group("g", None, SamplingSpec(n=1, max_tokens=8, seed=3), [ScriptedEnv(gate=gate)],
                      prompt_messages=PROMPT)
        while not runner_has_turned(eps):
            eps.step()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        new = {n: (p + torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.8 if ".gate." in n
                   else p) for n, p in before.items()}
        engine.update_weights(list(new.items()))  # between turn 1 and turn 2: the routers moved
        gate.set()
        (group,) = _run(eps, 1)
    finally:
        runner.shutdown()
        engine.close()
    (c,) = group.completions
    prompt = list(group.prompt_ids)
    seq = prompt + [int(t) for t in c.token_ids]
    record = c.routed_experts
    assert record.shape == (len(seq), 2, 2) and (record[-1] == -1).all() and (record[:-1] >= 0).all()
    turn1_end = len(prompt) + int(c.env_runs[0][0])  # turn 1's tokens end where the first environment run starts

    def own(weights):
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        m.load_state_dict(weights, strict=False)
        rec = RoutingRecorder(m)
        with torch.no_grad():
            m(input_ids=torch.tensor([seq]))
        return np.sort(rec.take().numpy(), axis=-1)

    old, now = own(before), own(new)
    got = np.sort(record, axis=-1)
    # positions turn 1 computed while sampling (its last token is first run by turn 2's prefill)
    assert (got[: turn1_end - 1] == old[: turn1_end - 1]).all()
    assert (got[turn1_end - 1 : -1] == now[turn1_end - 1 : -1]).all()
    # the move changed choices on both sides of the boundary, so neither check above holds by accident
    assert (old[: turn1_end - 1] != now[: turn1_end - 1]).any()
    assert (old[turn1_end - 1 : -1] != now[turn1_end - 1 : -1]).any()


def runner_has_turned(eps) -> bool:
    """Turn 1 finished and its environment call is waiting on the gate."""
    return eps.counters["turns"] >= 1 and eps.num_at_env() == 1


@pytest.mark.parametrize("kv_cache", [True, False])
def test_a_position_keeps_the_record_it_had_when_the_token_after_it_was_sampled(moe_dir, kv_cache):
    """The routers move after 4 decode steps (a push). Without a KV cache every step re-runs the whole prefix under
    the new routers; the positions that produced the 4 pre-push tokens must still hold the old routers' choices
    (first record wins), which is what the learner labels them with (their tokens' version)."""
    import copy

    from asyncppo.rollout.hf_engine import HFEngine

    engine = HFEngine(moe_dir, max_model_len=64, seed=0, max_num_seqs=4, capture_routing=True, kv_cache=kv_cache)
    old = copy.deepcopy(engine.model)
    prompt = [3, 5, 7, 9]
    engine.add_group("g", prompt, SamplingSpec(n=1, max_tokens=8, seed=1, ignore_eos=True))
    for _ in range(4):
        engine.step()
    with torch.no_grad():
        for r in moe_routers(engine.model):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(2)))
    engine.set_weight_version(1)
    done = []
    while engine.num_unfinished_seqs():
        done += engine.step()
    c = done[0].completions[0]
    assert c.versions.tolist() == [0] * 4 + [1] * 4
    seq = prompt + c.token_ids.tolist()
    got = np.sort(c.routed_experts, axis=-1)

    def own(m):
        rec = RoutingRecorder(m)
        with torch.no_grad():
            m(input_ids=torch.tensor([seq]))
        out = np.sort(rec.take().numpy(), axis=-1)
        rec.remove()
        return out

    before, after = own(old), own(engine.model)
    pre = slice(0, len(prompt) + 3)  # the prompt and the positions that produced tokens 1..3 (version 0)
    assert (got[pre] == before[pre]).all()
    assert (before[pre] != after[pre]).any()  # the move changed some of them: the check above is not vacuous
    engine.close()
