"""The held-out evaluation on the rollout engines (the built-in task's probe and data.eval_files): the report codec
and its checks, the learner-side sums, the worker-side runner against the real vLLM engine (answers compared with
the engine's own greedy generation), and the probe on the transformers engine against the in-process probe."""

from __future__ import annotations

import json
import types

import msgpack
import pytest

from asyncppo.data.heldout import EvalSet, eval_file_names
from asyncppo.rollout.evaluation import EvalRunner, eval_points
from asyncppo.stream.evals import (
    TASK_SET, EvalAggregator, EvalReceiver, EvalReport, EvalReportError, EvalSender, FileScores, decode_report,
    encode_report,
)


def _report(point=5, worker=0, **scores):
    base = dict(prompts=4, greedy_reward=3.0, sampled=16, sampled_reward=8.0, tokens=60, answers=20)
    base.update(scores)
    return EvalReport(point=point, worker_id=worker, version_min=point, version_max=point,
                      files={"test.jsonl": FileScores(**base)})


def test_points_and_names():
    assert eval_points(3, 10) == [0, 3, 6, 9, 10]
    assert eval_points(0, 10) == [0, 10]
    assert eval_points(5, 10) == [0, 5, 10]
    assert eval_points(5, 10, at_start=False) == [5, 10]  # trainer.eval_at_start=false: no point-0 round
    assert eval_points(0, 10, at_start=False) == [10]
    assert eval_file_names(["/a/test.jsonl", "/b/test.jsonl", "x.parquet", "/c/test.jsonl"]) == \
        ["test.jsonl", "test.jsonl#2", "x.parquet", "test.jsonl#3"]
    assert eval_file_names(["/a/<task>", "/b/t.jsonl"], reserved=(TASK_SET,)) == ["<task>#2", "t.jsonl"]


def test_report_round_trip_and_hand_computed_aggregate():
    rep = decode_report(encode_report(_report()), num_workers=2)
    assert rep.files["test.jsonl"] == _report().files["test.jsonl"]
    agg = EvalAggregator(num_workers=2)
    assert agg.add(rep) is None  # one of two workers
    assert agg.add(rep) is None and agg.duplicates == 1  # the same worker again does not complete the point
    other = _report(worker=1, prompts=6, greedy_reward=0.0, sampled=24, sampled_reward=12.0, tokens=90, answers=30)
    other.version_max = 6
    point, metrics = agg.add(other)
    assert point == 5
    # shards add exactly: greedy 3/10, sampled 20/40, length 150/50
    assert metrics["eval/test.jsonl/accuracy_greedy"] == pytest.approx(0.3)
    assert metrics["eval/test.jsonl/accuracy_sampled"] == pytest.approx(0.5)
    assert metrics["eval/test.jsonl/length_mean"] == pytest.approx(3.0)
    assert metrics["eval/test.jsonl/num_prompts"] == 10
    assert (metrics["eval/version_min"], metrics["eval/version_max"], metrics["eval/workers"]) == (5, 6, 2)
    assert agg.pending() == []


@pytest.mark.parametrize("mutate", [
    lambda m: m.update(kind="group"),
    lambda m: m.update(point=-1),
    lambda m: m.update(point=2 ** 63),
    lambda m: m.update(worker_id=7),  # not one of the run's 2 workers
    lambda m: m.update(version_min=9, version_max=3),
    lambda m: m.update(extra=1),
    lambda m: m["files"]["test.jsonl"].update(sampled_reward=float("nan")),
    lambda m: m["files"]["test.jsonl"].update(greedy_reward=-1.0),
    lambda m: m["files"]["test.jsonl"].update(prompts="4"),
    lambda m: m["files"]["test.jsonl"].update(answers=19),  # inconsistent with prompts + sampled
    lambda m: m["files"]["test.jsonl"].update(greedy_success=5),  # more solved than the 4 greedy episodes
    lambda m: m["files"]["test.jsonl"].update(sampled_success=17),
    lambda m: m["files"]["test.jsonl"].update(episodes=21),  # more episodes than answers
    lambda m: m["files"].update({"": m["files"]["test.jsonl"]}),
    lambda m: m["files"].update({f"f{i}": m["files"]["test.jsonl"] for i in range(100)}),
])
def test_malformed_reports_are_refused(mutate):
    msg = msgpack.unpackb(encode_report(_report()), raw=False)
    mutate(msg)
    with pytest.raises(EvalReportError):
        decode_report(msgpack.packb(msg, use_bin_type=True), num_workers=2)


def test_channel_counts_garbage_and_delivers_valid_reports():
    receiver = EvalReceiver("tcp://127.0.0.1:0", num_workers=1)
    sender = EvalSender(receiver.address)
    raw = __import__("zmq").Context.instance().socket(__import__("zmq").PUSH)
    raw.connect(receiver.address)
    try:
        raw.send(b"\x80\x04 pickle? no")
        raw.send(b"x" * (200 << 10))  # over the report size limit
        assert sender.send(_report())
        got = []
        for _ in range(50):
            got += receiver.poll(0.1)
            if got and receiver.rejected == 2:
                break
        assert [r.point for r in got] == [5] and receiver.rejected == 2
    finally:
        raw.close(linger=0)
        sender.close()
        receiver.close()


class _Rows:
    def __init__(self, items):
        self.items = items


def _runner(cfg_over, datasets, decode, resumed=False):
    cfg = types.SimpleNamespace(
        rollout=types.SimpleNamespace(max_num_seqs=cfg_over.get("max_num_seqs", 8), response_length=8,
                                      sampling=types.SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, seed=3)),
        data=types.SimpleNamespace(eval_samples=cfg_over.get("eval_samples", 2)),
        trainer=types.SimpleNamespace(eval_every=cfg_over.get("eval_every", 2), total_steps=4,
                                eval_at_start=cfg_over.get("eval_at_start", True)),
    )
    from asyncppo.data.rewards import score_safely

    def reward(text, answer, **_):  # the first digit: the briefly warm-started test model gets some right
        return float(text.strip()[:1] == answer[:1])

    return EvalRunner(cfg, datasets, 0, decode, reward, score_safely, resumed=resumed)


def test_runner_against_vllm_greedy_answers(vllm_engine, tiny_tokenizer):
    """Greedy accuracy equals what the engine's own greedy generation scores; the engine holds at most the
    evaluation's share of max_num_seqs at once; the round reports exactly one greedy and eval_samples sampled
    answers per prompt."""
    from asyncppo.data.tasks import get_task
    from asyncppo.rollout.engine import SamplingSpec

    rows = get_task("addition", seed=0).splits().eval[:12]
    items = [types.SimpleNamespace(index=i, prompt_ids=tiny_tokenizer.encode(r["prompt"]), answer=r["answer"])
             for i, r in enumerate(rows)]
    decode = vllm_engine.decode
    # the expected greedy score, from the engine's own greedy generation
    for it in items:
        vllm_engine.add_group(f"ref-{it.index}", it.prompt_ids, SamplingSpec(n=1, max_tokens=8, temperature=0.0))
    expected = 0.0
    while vllm_engine.num_unfinished_seqs():
        for done in vllm_engine.step():
            it = items[int(done.key.split("-")[1])]
            expected += float(decode(done.completions[0].token_ids).strip()[:1] == it.answer[:1])
    runner = _runner({"max_num_seqs": 8, "eval_samples": 2}, {"add.jsonl": _Rows(items)}, decode)
    assert runner.on_version(0, loaded=False) is None and runner.active
    report, peak = None, 0
    while report is None:
        runner.admit(vllm_engine)
        peak = max(peak, vllm_engine.num_unfinished_seqs())
        for done in vllm_engine.step():
            assert runner.owns(done.key)
            report = runner.finished(done) or report
    assert peak <= 4  # half of max_num_seqs=8
    scores = report.files["add.jsonl"]
    assert (report.point, scores.prompts, scores.sampled, scores.answers) == (0, 12, 24, 36)
    assert scores.greedy_reward == expected
    assert 0 < expected < 12  # the warm-started model gets some, not all, right: the comparison means something
    assert not runner.active and vllm_engine.num_unfinished_seqs() == 0
    # version 1 is not a point (eval_every=2); version 3 covers point 2; version 4 covers the final point
    assert runner.on_version(1, loaded=True) is None and not runner.active
    runner.on_version(3, loaded=True)
    assert runner._round.point == 2
    vllm_engine.abort_all()
    # trainer.eval_at_start=false: no round at version 0; the first is at point 2
    late = _runner({"max_num_seqs": 8, "eval_samples": 2, "eval_at_start": False}, {"add.jsonl": _Rows(items)}, decode)
    assert late.on_version(0, loaded=True) is None and not late.active
    late.on_version(2, loaded=True)
    assert late.active and late._round.point == 2
    vllm_engine.abort_all()


def test_a_group_larger_than_the_evaluation_share_runs_alone_and_the_round_ends(vllm_engine, tiny_tokenizer):
    """max_num_seqs=4 leaves evaluation 2 sequences, and a sampled group of eval_samples=4 needs 4: it must still
    run (alone), or the round never ends and the worker, which loads weights between rounds, never loads any."""
    from asyncppo.data.tasks import get_task

    rows = get_task("addition", seed=0).splits().eval[:3]
    items = [types.SimpleNamespace(index=i, prompt_ids=tiny_tokenizer.encode(r["prompt"]), answer=r["answer"])
             for i, r in enumerate(rows)]
    runner = _runner({"max_num_seqs": 4, "eval_samples": 4}, {"add.jsonl": _Rows(items)}, vllm_engine.decode)
    runner.on_version(0, loaded=False)
    report, steps, peak = None, 0, 0
    while report is None and steps < 500:
        runner.admit(vllm_engine)
        peak = max(peak, vllm_engine.num_unfinished_seqs())
        for done in vllm_engine.step():
            report = runner.finished(done) or report
        steps += 1
    assert report is not None, "the round never finished"
    scores = report.files["add.jsonl"]
    assert (scores.prompts, scores.sampled, scores.answers) == (3, 12, 15)
    assert peak == 4  # a sampled group alone; greedy ones two at a time (the share)
    assert not runner.active and vllm_engine.num_unfinished_seqs() == 0


def test_empty_shard_reports_at_once_and_resume_skips_past_points():
    runner = _runner({}, {"f": _Rows([])}, decode=str)
    rep = runner.on_version(0, loaded=False)
    assert rep is not None and rep.files["f"].prompts == 0 and not runner.active
    resumed = _runner({}, {"f": _Rows([])}, decode=str, resumed=True)
    assert resumed.on_version(0, loaded=False) is None  # the placeholder stamp before the checkpoint's push
    rep = resumed.on_version(3, loaded=True)  # resumed at 3: points 0 and 2 are history, 4 is still to come
    assert rep is None
    rep = resumed.on_version(4, loaded=True)
    assert rep is not None and rep.point == 4


def test_summary_mentions_no_version_bookkeeping(tmp_path):
    from asyncppo.launch.console import summary_table

    records = [{"step": 0, "eval/t.jsonl/accuracy_greedy": 0.25, "eval/version_min": 0.0, "eval/workers": 1.0,
                "eval/t.jsonl/num_prompts": 8.0},
               {"step": 4, "eval/t.jsonl/accuracy_greedy": 0.5, "eval/version_min": 4.0, "eval/workers": 1.0}]
    table = summary_table(records, {}, 1.0)
    assert "eval/t.jsonl/accuracy_greedy | 0.250 -> 0.500" in table.replace("  ", " ").replace("  ", " ") or \
        "0.250 -> 0.500" in table
    assert "version_min" not in table and "workers" not in table and "num_prompts" not in table
    json.dumps(table)


def test_eval_channel_with_curve_keys_takes_reports_only_from_key_holders():
    from asyncppo.stream.security import CurveKeys

    keys = CurveKeys.generate()
    receiver = EvalReceiver("tcp://127.0.0.1:0", num_workers=2, curve=keys)
    stranger = EvalSender(receiver.address)  # no keys
    impostor = EvalSender(receiver.address, curve=CurveKeys.generate().for_workers())  # another run's keys
    worker = EvalSender(receiver.address, curve=keys.for_workers())
    try:
        stranger.send(_report(point=1), timeout_s=0.5)
        impostor.send(_report(point=2), timeout_s=0.5)
        assert worker.send(_report(point=3, worker=1))
        got = []
        for _ in range(20):
            got += receiver.poll(0.1)
        assert [r.point for r in got] == [3]
    finally:
        for s in (stranger, impostor, worker):
            s._sock.close(linger=0)
        receiver.close()


# --- the built-in task's probe as one of the engine's held-out sets ------------------------------------------------
def test_task_set_keeps_the_probes_metric_names_and_summary():
    from asyncppo.learner.evaluation import EngineEvaluation

    task = FileScores(prompts=4, greedy_reward=1.0, sampled=16, sampled_reward=8.0, tokens=40, answers=20)
    rep = EvalReport(point=0, worker_id=0, version_min=0, version_max=0,
                     files={TASK_SET: task, "f.jsonl": FileScores(**vars(task))})
    point, metrics = EvalAggregator(num_workers=1).add(decode_report(encode_report(rep), num_workers=1))
    assert metrics["eval/accuracy_greedy"] == 0.25 and metrics["eval/accuracy_sampled"] == 0.5
    assert metrics["eval/f.jsonl/accuracy_greedy"] == 0.25 and not any("<task>" in k for k in metrics)
    evaluation = EngineEvaluation.__new__(EngineEvaluation)  # the sums only: no socket
    evaluation.logged = {}
    assert evaluation.task_before_after() == {}
    evaluation.logged = {0: metrics, 6: {**metrics, "eval/accuracy_greedy": 0.75}, 3: {"eval/f.jsonl/x": 1.0}}
    assert evaluation.task_before_after() == {"eval_before": {"accuracy_sampled": 0.5, "accuracy_greedy": 0.25},
                                              "eval_after": {"accuracy_sampled": 0.5, "accuracy_greedy": 0.75}}
    evaluation.logged = {6: {**metrics, "eval/accuracy_greedy": 0.75}}  # eval_at_start=false: the end point only
    assert evaluation.task_before_after(with_before=False) == {
        "eval_after": {"accuracy_sampled": 0.5, "accuracy_greedy": 0.75}}


def test_episode_sets_report_their_success_rate_beside_the_mean_reward():
    """A multi-turn set's answers are episodes: ``success_*`` is the share whose reward is positive (the game
    solved), ``accuracy_*`` stays the mean reward (which a game paying less for later solves keeps apart); a
    single-turn set reports no success rate. Hand-computed over two workers' shards."""
    from asyncppo.learner.evaluation import EngineEvaluation

    def episodes(worker, **sums):
        return EvalReport(point=0, worker_id=worker, version_min=0, version_max=0,
                          files={TASK_SET: FileScores(**sums), "single.jsonl": FileScores(
                              prompts=2, greedy_reward=1.0, sampled=8, sampled_reward=4.0, tokens=10, answers=10)})

    agg = EvalAggregator(num_workers=2)
    assert agg.add(decode_report(encode_report(episodes(
        0, prompts=4, greedy_reward=2.5, sampled=16, sampled_reward=6.0, tokens=100, answers=20, episodes=20,
        greedy_success=3, sampled_success=9)), num_workers=2)) is None
    _, m = agg.add(decode_report(encode_report(episodes(
        1, prompts=4, greedy_reward=1.0, sampled=16, sampled_reward=3.0, tokens=100, answers=20, episodes=20,
        greedy_success=1, sampled_success=4)), num_workers=2))
    assert m["eval/success_greedy"] == pytest.approx(4 / 8) and m["eval/success_sampled"] == pytest.approx(13 / 32)
    assert m["eval/accuracy_greedy"] == pytest.approx(3.5 / 8) and m["eval/accuracy_sampled"] == pytest.approx(9 / 32)
    assert not any(k.startswith("eval/single.jsonl/success") for k in m) and "eval/single.jsonl/accuracy_greedy" in m
    evaluation = EngineEvaluation.__new__(EngineEvaluation)  # the sums only: no socket
    evaluation.logged = {0: m, 4: {**m, "eval/success_sampled": 0.75}}
    assert evaluation.task_before_after()["eval_after"] == {
        "accuracy_sampled": m["eval/accuracy_sampled"], "accuracy_greedy": m["eval/accuracy_greedy"],
        "success_sampled": 0.75, "success_greedy": 0.5}


def test_a_run_that_plays_episodes_evaluates_its_task_rows_as_episodes():
    """``data=guess`` seeds its games with the addition task's rows: its held-out rows are played as games (scored by
    the game), as are ``data=calculator``'s and an agent's; a single-turn run keeps the exact-answer probe."""
    from asyncppo.config import load_config
    from asyncppo.data.heldout import has_eval_sets, task_probe

    for preset in ("data=guess", "data=calculator", "data=calculator_agent"):
        cfg = load_config([preset])
        assert has_eval_sets(cfg) and task_probe(cfg).episodes and cfg.trainer.eval_every > 0, preset
    assert not task_probe(load_config([])).episodes


class _ScriptedEngine:
    """Records the groups added; the test finishes them itself."""

    def __init__(self):
        self.added = []

    def add_group(self, key, prompt_ids, spec):
        self.added.append((key, spec))


def test_task_set_scores_exact_ended_answers_with_paired_seeds():
    import numpy as np

    from asyncppo.rollout.engine import Completion, FinishedGroup

    items = [types.SimpleNamespace(index=i, prompt_ids=[1, 2], answer=str(10 + i)) for i in range(3)]
    probe = EvalSet(_Rows(items), samples=4, max_tokens=5, seed=7, paired=True, exact=True)
    runner = _runner({"max_num_seqs": 64}, {TASK_SET: probe, "f": _Rows(items)}, decode=lambda ids: ids[0])
    engine = _ScriptedEngine()
    runner.on_version(0, loaded=False)
    runner.admit(engine)
    specs = dict(engine.added)
    assert specs[f"eval:0:{TASK_SET}:1:s"].n == 4 and specs[f"eval:0:{TASK_SET}:1:s"].max_tokens == 5
    assert specs[f"eval:0:{TASK_SET}:1:g"].temperature == 0.0 and specs["eval:0:f:1:s"].max_tokens == 8
    assert specs[f"eval:0:{TASK_SET}:1:s"].seed == 7 + 7919  # trainer.seed + 7919 x index, the same at every point
    report = None
    for key, spec in engine.added:
        answer = items[int(key.rsplit(":", 2)[1])].answer
        ended = "stop" if key.endswith(":g") else "length"  # sampled answers never end: wrong for the probe
        completions = [Completion(np.array([answer], dtype=object), np.zeros(1, np.float32), ended)] * spec.n
        report = runner.finished(FinishedGroup(key, completions)) or report
    assert report.files[TASK_SET].metrics()["accuracy_greedy"] == 1.0
    assert report.files[TASK_SET].metrics()["accuracy_sampled"] == 0.0
    assert report.files["f"].metrics()["accuracy_sampled"] == 1.0  # the reward function does not look at the end
    engine.added.clear()
    runner.on_version(2, loaded=True)
    runner.admit(engine)
    later = dict(engine.added)
    assert later[f"eval:2:{TASK_SET}:1:s"].seed == specs[f"eval:0:{TASK_SET}:1:s"].seed  # paired across points
    assert later["eval:2:f:1:s"].seed != specs["eval:0:f:1:s"].seed  # eval files: a fresh draw per point


def test_task_probe_is_an_engine_set_with_the_probes_counts(tiny_tokenizer):
    from asyncppo.config import load_config
    from asyncppo.data.heldout import has_eval_sets, task_probe
    from asyncppo.rollout.evaluation import eval_sets

    cfg = load_config([])
    assert has_eval_sets(cfg) and not has_eval_sets(load_config(["data.num_eval_prompts=0"]))
    probe = task_probe(cfg)
    shards = [eval_sets(cfg, tiny_tokenizer, w, 2)[TASK_SET] for w in range(2)]
    assert sum(len(s.dataset.items) for s in shards) == len(probe.rows) == 256
    assert sorted(it.answer for s in shards for it in s.dataset.items) == sorted(r["answer"] for r in probe.rows)
    assert {(s.samples, s.max_tokens, s.seed, s.paired, s.exact) for s in shards} == \
        {(4, probe.max_new_tokens, cfg.trainer.seed, True, True)}
    assert probe.max_new_tokens == 5


def _evaluate_on(engine, runner, version):
    report = runner.on_version(version, loaded=True)
    while report is None:
        runner.admit(engine)
        for done in engine.step():
            report = runner.finished(done) or report
    return report.files[TASK_SET].metrics()


def _own_greedy_answers(engine, items, max_tokens):
    """Each prompt's greedy answer from the engine (None where it does not end within ``max_tokens``)."""
    from asyncppo.rollout.engine import SamplingSpec

    for it in items:
        engine.add_group(f"ref-{it.index}", it.prompt_ids, SamplingSpec(n=1, max_tokens=max_tokens, temperature=0.0))
    answers = {}
    while engine.num_unfinished_seqs():
        for done in engine.step():
            c = done.completions[0]
            answers[int(done.key.split("-")[1])] = engine.decode(c.token_ids) if c.finish_reason == "stop" else None
    return answers


def test_probe_on_the_transformers_engine_matches_the_in_process_probe_and_repeats(tiny_model_dir, tiny_tokenizer):
    """The same weights give the same probe numbers on the engine as in process (transformers generate on the same
    model), and, seeded per request, the same sampled numbers twice. The briefly warm-started test model rarely
    adds right, so the reference answers are the engine's own greedy ones: the in-process probe must find them."""
    from asyncppo.config import load_config
    from asyncppo.data.heldout import HeldOutProbe, task_probe
    from asyncppo.rollout.engines import make_engine
    from transformers import AutoModelForCausalLM

    cfg = load_config(["data.num_eval_prompts=64", "trainer.eval_every=1", "trainer.total_steps=4"])
    probe = task_probe(cfg)
    items = [types.SimpleNamespace(index=i, prompt_ids=tiny_tokenizer.encode(r["prompt"]), answer=r["answer"])
             for i, r in enumerate(probe.rows)]
    engine = make_engine("hf", tiny_model_dir, max_model_len=32, seed=0, num_threads=1, max_num_seqs=64)
    try:
        own = _own_greedy_answers(engine, items, probe.max_new_tokens)
        items = [types.SimpleNamespace(index=it.index, prompt_ids=it.prompt_ids, answer=own[it.index] or "none")
                 for it in items]
        held_out = EvalSet(_Rows(items), samples=probe.samples, max_tokens=probe.max_new_tokens, seed=probe.seed,
                           paired=True, exact=True)
        runner = _runner({"max_num_seqs": 64, "eval_every": 1}, {TASK_SET: held_out}, engine.decode)
        first, second = _evaluate_on(engine, runner, 0), _evaluate_on(engine, runner, 1)
    finally:
        engine.close()
    ended = sum(a is not None for a in own.values()) / len(own)
    assert first["num_prompts"] == 64 and first["accuracy_greedy"] == ended > 0.5
    assert first == second  # seeded per request: the same numbers at two points
    rows = [dict(r, answer=it.answer) for r, it in zip(probe.rows, items)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    in_process = HeldOutProbe(rows, probe.temperature, probe.seed, probe.max_new_tokens).evaluate(model,
                                                                                                 tiny_tokenizer)
    assert abs(first["accuracy_greedy"] - in_process["accuracy_greedy"]) <= 2 / 64, (first, in_process)
    assert abs(first["accuracy_sampled"] - in_process["accuracy_sampled"]) < 0.15, (first, in_process)  # 256 each


def test_round_adds_every_sets_greedy_answers_first_and_takes_the_sets_in_turn():
    items = [types.SimpleNamespace(index=i, prompt_ids=[1, 2], answer=str(i)) for i in range(3)]
    runner = _runner({"max_num_seqs": 200}, {"a": _Rows(items), "b": _Rows(items[:2])}, decode=str)
    engine = _ScriptedEngine()
    runner.on_version(0, loaded=False)
    runner.admit(engine)
    assert [key for key, _ in engine.added] == [
        "eval:0:a:0:g", "eval:0:b:0:g", "eval:0:a:1:g", "eval:0:b:1:g", "eval:0:a:2:g",
        "eval:0:a:0:s", "eval:0:b:0:s", "eval:0:a:1:s", "eval:0:b:1:s", "eval:0:a:2:s"]
