"""The advisor's model of multi-turn episodes (report/simulator.py, report/rates.py): samples leave the engine for
an environment call after every model turn, and the engine admits by the episode worker's expected load. Cases
solved by hand, the window law behind a slow tool, and the rates read back from a run directory."""

from __future__ import annotations

import json
import os

import pytest

from asyncppo.report.lengths import FixedLengths, LogNormalLengths
from asyncppo.report.rates import measure
from asyncppo.report.simulator import EngineSpeed, Setup, TrainSpeed, simulate


def test_one_episode_by_hand():
    """k = 0, one episode of 4 tokens in 2 turns, 1 s per decode step, 10 s per environment call, 1 s of training:
    turn (2 s) + call (10 s) + turn (2 s) + the call that ends it (10 s) + training (1 s) = 25 s a step; the engine
    decodes 4 s of them with 1 of its 4 slots."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=1, group_size=1, max_staleness=0, steps=6,
                       warmup_steps=1, turns=2, env_s=10.0), EngineSpeed(1.0, 0.0, 0.0, 4), TrainSpeed(1.0, 0.0),
                 FixedLengths(4))
    assert r.step_s == pytest.approx(25.0, rel=1e-9)
    assert r.rollout_busy == pytest.approx(4 / 25, rel=1e-9)
    assert r.occupancy == pytest.approx(0.25)


def test_environment_tokens_are_trained_but_not_decoded():
    """10 response tokens of which the environment wrote 6 (model_frac 0.4): the engine decodes 4, 2 a turn, at
    0.5 s a step (2 x 1 s), the two calls take 2 s, and the learner trains all 10 tokens at 0.1 s each (1 s):
    5 s a step, 4 decoded tokens in it."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=1, group_size=1, max_staleness=0, steps=6,
                       warmup_steps=1, turns=2, env_s=1.0, model_frac=0.4), EngineSpeed(0.5, 0.0, 0.0, 4),
                 TrainSpeed(0.0, 0.1), FixedLengths(10))
    assert r.step_s == pytest.approx(5.0, rel=1e-9)
    assert r.tokens_per_s == pytest.approx(4 / 5, rel=1e-9)


def test_a_later_turn_reads_the_environment_tokens_in_its_context():
    """Step time 1 s per context token (one sequence, no prompt): 10 response tokens, 4 decoded in 2 turns of 2,
    the environment writing the other 6 between them (its answer to the last turn ends the episode and adds
    nothing). Turn 1 integrates a context of 0 -> 2 tokens (2 s); turn 2 starts from its own 2 tokens plus the
    environment's 6 and integrates 8 -> 10 (18 s): 20 s a step (8 s if the environment's tokens were left out)."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=1, group_size=1, max_staleness=0, steps=5,
                       warmup_steps=1, turns=2, model_frac=0.4), EngineSpeed(0.0, 0.0, 1.0, 4), TrainSpeed(0.0, 0.0),
                 FixedLengths(10))
    assert r.step_s == pytest.approx(20.0, rel=1e-9)


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_behind_a_slow_tool_the_window_sets_the_rate(k):
    """Decoding and training nearly free, 2 turns of 1 s calls: an episode lives 2 s, and the window holds
    (k + 1) x B groups of n, so (k + 1) x 4 episodes every 2 s, whatever the engine's 4 slots: at k = 7 it holds 32
    episodes (the expected load, in flight x share of time in the engine, is what admission counts)."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=2, group_size=2, max_staleness=k, steps=60,
                       warmup_steps=20, turns=2, env_s=1.0), EngineSpeed(0.001, 0.0, 0.0, 4), TrainSpeed(1e-6, 0.0),
                 FixedLengths(2))
    assert r.samples_per_s == pytest.approx(2 * (k + 1), rel=0.01)
    assert r.lag_max == k


def test_the_slots_bind_when_episodes_decode_as_long_as_they_wait():
    """1 s per decode step and 1 s per call, 1 token a turn, 4 slots, a wide window (k = 8: 36 episodes). The engine
    cannot step more than 4 turns a second, i.e. 2 episodes of 2 turns: the ceiling. Counting only the episodes in
    the engine would let 4 fly, each living 4 s: 1 a second. The worker's rule (in flight x share of time in the
    engine, admission per slot) lets about 2 x 4 fly and lands between the two."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=2, group_size=2, max_staleness=8, steps=80,
                       warmup_steps=30, turns=2, env_s=1.0, admission_unit="slot"), EngineSpeed(1.0, 0.0, 0.0, 4),
                 TrainSpeed(1e-6, 0.0), FixedLengths(2))
    assert 1.3 < r.samples_per_s <= 2.0 + 1e-9
    assert r.occupancy == pytest.approx(r.samples_per_s / 2.0, rel=0.02)  # 2 turns an episode, 4 slots a step


def test_single_turn_results_are_those_of_the_model_before_episodes():
    """Golden values from the simulator as it was before it modelled episodes (commit 0271245), on a setup that
    exercises the per-KV term, admission per slot, a push every 2 versions, a lookahead and long-tailed groups:
    turns = 1, env_s = 0 and model_frac = 1 must leave every number where it was."""
    r = simulate(Setup(engines=2, train_ranks=1, batch_groups=4, group_size=4, max_staleness=3, steps=40,
                       warmup_steps=8, prompt_tokens=50, admission_unit="slot", sync_every=2, load_s=0.05,
                       lookahead=2), EngineSpeed(0.01, 0.002, 1e-5, 12), TrainSpeed(0.2, 1e-3),
                 LogNormalLengths(40, 200, 256, within_group=0.5))
    assert r.samples_per_s == pytest.approx(8.362924701667556, rel=1e-9)
    assert r.step_s == pytest.approx(1.9132062730170967, rel=1e-9)
    assert r.occupancy == pytest.approx(0.5049286462481865, rel=1e-9)
    assert r.rollout_busy == pytest.approx(0.7585409372838902, rel=1e-9)
    assert r.token_lag_mean == pytest.approx(1.5448145411338945, rel=1e-9) and r.lag_mean == 1.5


@pytest.mark.parametrize("bad", [dict(turns=0.5), dict(env_s=-1.0), dict(env_s=float("inf")),
                                 dict(turns=float("nan")), dict(model_frac=0.0), dict(model_frac=1.5)])
def test_bad_episode_fields_are_refused(bad):
    with pytest.raises(ValueError, match="turns"):
        Setup(engines=1, train_ranks=1, batch_groups=1, group_size=1, max_staleness=0, **bad)


def _run_dir(tmp_path, records: list[dict], workers: int = 1) -> str:
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "config.yaml").write_text("rollout:\n  max_num_seqs: 64\n  rollout_batch_size: 4\n"
                                   "  num_return_sequences_in_group: 4\n  max_staleness: 8\n  response_length: 64\n"
                                   f"cluster:\n  rollout_workers: {workers}\n")
    return os.fspath(d)


def test_rates_read_the_episodes_of_a_multi_turn_run(tmp_path):
    """Turns, seconds per call and the decoded share come from the run's episode metrics. response_length/mean
    counts the model's tokens (20 a sample, 0.75 of the response): the learner is fitted per response token with
    the environment's, 0.4 s of work for 16 x 20 / 0.75 tokens."""
    recs = [{"step": s, "response_length/mean": 20.0, "rollout/running_mean": 24.0, "rollout/decode_step_s": 0.03,
             "time/step_s": 0.5, "time/wait_s": 0.1, "episodes/turns_mean": 3.0 + (s % 2) * 0.5,
             "episodes/env_s_per_step": 0.0 if s == 7 else 0.2, "episodes/env_token_frac": 0.25}
            for s in range(1, 11)]  # step 7's groups brought no new environment call: it logs 0, not a latency
    rates = measure(_run_dir(tmp_path, recs), skip=2)
    assert rates.turns == pytest.approx(3.25) and rates.env_s == pytest.approx(0.2)
    assert rates.model_frac == pytest.approx(0.75)
    assert rates.gen.per_seq_s == pytest.approx(0.03 / 24)  # one occupancy: charged per sequence
    assert rates.train.per_token_s == pytest.approx(0.4 / (16 * 20 / 0.75))
    setup = rates.setup(max_staleness=16)
    assert setup.episodes and (setup.turns, setup.env_s, setup.model_frac) == (3.25, 0.2, 0.75)
    assert any("multi-turn" in note for note in rates.notes)


def test_rates_take_the_time_out_of_the_engine_by_littles_law(tmp_path):
    """16 samples a 0.5 s step (32 a second) of 3 turns: 96 turns a second reach the environment; 24 episodes there
    on average means 0.25 s out of the engine per turn, more than the 0.2 s call: the answer's pick-up counts."""
    recs = [{"step": s, "response_length/mean": 20.0, "rollout/running_mean": 24.0, "rollout/decode_step_s": 0.03,
             "time/step_s": 0.5, "time/wait_s": 0.1, "episodes/turns_mean": 3.0, "episodes/env_s_per_step": 0.2,
             "episodes/env_token_frac": 0.25, "episodes/at_env_mean": 24.0} for s in range(1, 11)]
    rates = measure(_run_dir(tmp_path, recs), skip=2)
    assert rates.env_s == pytest.approx(0.25)
    assert any("out of the engine per turn (200 ms per call" in note for note in rates.notes)


def test_littles_law_counts_every_workers_episodes(tmp_path):
    """The same run on two workers: at_env_mean is a mean per worker (12 each), the samples a second are the
    cluster's, so the time out of the engine per turn is still 0.25 s."""
    recs = [{"step": s, "response_length/mean": 20.0, "rollout/running_mean": 24.0, "rollout/decode_step_s": 0.03,
             "time/step_s": 0.5, "time/wait_s": 0.1, "episodes/turns_mean": 3.0, "episodes/env_s_per_step": 0.2,
             "episodes/env_token_frac": 0.25, "episodes/at_env_mean": 12.0} for s in range(1, 11)]
    rates = measure(_run_dir(tmp_path, recs, workers=2), skip=2)
    assert rates.engines == 2 and rates.env_s == pytest.approx(0.25)


def test_rates_of_a_single_turn_run_have_no_episodes(tmp_path):
    recs = [{"step": s, "response_length/mean": 20.0, "rollout/running_mean": 24.0, "rollout/decode_step_s": 0.03,
             "time/step_s": 0.5, "time/wait_s": 0.1} for s in range(1, 11)]
    rates = measure(_run_dir(tmp_path, recs), skip=2)
    assert (rates.turns, rates.env_s, rates.model_frac) == (1.0, 0.0, 1.0) and not rates.setup().episodes


def test_rates_charge_the_workers_time_between_steps_to_every_step(tmp_path):
    """0.03 s a step at one occupancy (charged per sequence) and 2 ms of the worker's loop between two steps: the
    engine makes a step every 32 ms, so the model's step is 2 ms fixed plus 30 ms for the 24 sequences."""
    recs = [{"step": s, "response_length/mean": 20.0, "rollout/running_mean": 24.0, "rollout/decode_step_s": 0.03,
             "rollout/step_gap_s": 0.002, "time/step_s": 0.5, "time/wait_s": 0.1} for s in range(1, 11)]
    rates = measure(_run_dir(tmp_path, recs), skip=2)
    assert rates.gen.base_s == pytest.approx(0.002) and rates.gen.per_seq_s == pytest.approx(0.03 / 24)
    assert any("between decode steps: 2.00 ms" in note for note in rates.notes)
