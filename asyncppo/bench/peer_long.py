"""``asyncppo bench peer``: asyncppo against TRL's GRPOTrainer on ``data=long``, accuracy against time.

Both contenders start from the preset's model (``builtin:tiny-long``, the same cached build the launch uses) and
train for the same wall-clock budget ``S`` with the preset's shape: GRPO without KL, 16 prompts x 8 samples, one
optimizer update per batch, constant lr 1e-4, token-mean loss, responses up to ``rollout.response_length`` (1,028)
tokens, exact match of the whole working.

* asyncppo: ``asyncppo launch data=long`` (vLLM CPU engine, Ray, the stream), saving a checkpoint every
  ``SAVE_EVERY`` steps and with no engine-side evaluation (it would compete with training for the two cores); its
  clock is the learner's ``time/wall_s``. Stopped (SIGTERM: the launch stops its actors as on Ctrl-C) once a
  checkpoint at or past ``S`` exists.
* TRL: ``GRPOTrainer`` in this process, in each setup of ``trl`` (peer.py: :func:`trl_mode`; issue #48 asked for
  TRL at its best: ``steps_per_generation`` 1 or 4, ``transformers.generate`` (a batch runs until its longest answer
  ends) or continuous batching, vLLM colocate where it runs, gradient checkpointing off); a callback saves the
  weights when the training clock passes each point, the time spent saving left out of the clock. The pilot picks
  the setup: the highest mean sampled accuracy over its points (``mean sampled <name>``), fixed before it ran.
  Generation is timed around ``_generate_single_turn`` (for vLLM that includes TRL's weight sync).

The points are ``S/P, 2S/P, ..., S`` (``points=P``): for each, the first checkpoint at or past it. Every point, and
the start (shared, at 0 s), is scored after both have trained (so scoring never competes with training) by one
probe: the preset's 128 held-out prompts, 4 answers each at T=1 (one seeded draw, the same call for every point)
and one greedy, up to the task's longest answer + eos; "correct" is the exact working, ended by eos. The reference
loop of the addition task is not run here: it would cost another ``S`` for a contender the issue does not ask for.

The figures (curves.py: :func:`peer_figures`) are the time each needs to reach the thresholds start + 0.05 and
start + 0.10, fixed in advance, at the conservative bound (no credit between scored points) and interpolated, and
the old measure (the time to the lower of the two finals) beside them; issue #48 showed that the old measure is set
by the point spacing whenever asyncppo leads at its first point.
"""



from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import torch

from asyncppo.bench.curves import peer_figures
from asyncppo.bench.inproc import load
from asyncppo.bench.peer import trl_mode, trl_trainer
from asyncppo.config import load_config
from asyncppo.data.heldout import SAMPLES_PER_PROMPT, is_exact_answer
from asyncppo.data.tasks import get_task
from asyncppo.data.tiny import model_of
from asyncppo.data.warmstart import _left_padded_prompts  # the probe's own left padding (variable prompt lengths)
from asyncppo.learner.checkpoint import _complete_steps, checkpoints_root

SAVE_EVERY = 4  # asyncppo steps between checkpoints: a point lands at most this many steps past its mark


def preset(overrides: list[str], name: str = "data=long"):
    """The ``data=long`` (or ``name``) config with the user's overrides: the model, lengths and held-out set both
    use."""
    return load_config([name, *overrides])


# ---------------------------------------------------------------------------------------------- the probe
@torch.no_grad()
def generate_answers(model, tok, prompts: list[str], *, temperature: float, seed: int, max_new: int):
    """One answer per prompt (texts, and whether each ended with eos), sampled with one seeded generator.

    Rows leave the batch and its KV cache as soon as they end, so a 1,000-token runaway costs its own row: decoding
    the whole batch to its longest answer (``answer_accuracy``, ``generate``) made 640 answers of up to 1,027 tokens
    cost minutes per point on this box."""
    model.eval()
    ids, attn, _ = _left_padded_prompts(tok, [{"prompt": p} for p in prompts])
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    gen = torch.Generator().manual_seed(seed)
    alive, out, ended = list(range(len(prompts))), [[] for _ in prompts], [False] * len(prompts)
    past = None
    for _ in range(max_new):
        res = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=past, use_cache=True)
        past, logits = res.past_key_values, res.logits[:, -1].float()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        keep = []
        for j, (row, token) in enumerate(zip(alive, nxt.tolist())):
            if token == tok.eos_token_id:
                ended[row] = True
            else:
                out[row].append(token)
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(alive):
            index = torch.tensor(keep)
            past.reorder_cache(index)
            nxt, attn, pos, alive = nxt[index], attn[index], pos[index], [alive[j] for j in keep]
        ids, pos = nxt[:, None], pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
    return [tok.decode(o) for o in out], ended


def probe(model, tok, rows: list[dict], *, seed: int, max_new: int) -> dict:
    """Held-out accuracy: ``SAMPLES_PER_PROMPT`` answers per row at T=1 (one seeded draw) and one greedy."""
    t0 = time.perf_counter()
    result = {}
    for name, reps, temperature in (("sampled", SAMPLES_PER_PROMPT, 1.0), ("greedy", 1, 0.0)):
        batch = rows * reps
        texts, ended = generate_answers(model, tok, [r["prompt"] for r in batch], temperature=temperature,
                                        seed=seed, max_new=max_new)
        hits = [is_exact_answer(t, r["answer"], e) for t, r, e in zip(texts, batch, ended)]
        result[name] = sum(hits) / len(batch)
    result["probe_s"] = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------------------------------- asyncppo
def _learner_records(out: str) -> list[dict]:
    """The learner's per-step records so far (a line still being written is skipped)."""
    records = []
    path = os.path.join(out, "metrics.jsonl")
    for line in open(path).read().splitlines() if os.path.exists(path) else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "reward/mean" in record:
            records.append(record)
    return records


def _stop_when_trained(proc, out: str, seconds: float, log_path: str) -> None:
    """Poll the run until a checkpoint at or past ``seconds`` of learner time exists; a deadline names the late
    party (the launch, or its learner)."""
    deadline = time.monotonic() + 2 * seconds + 900  # start-up (Ray, engine) and slack on a loaded box
    while True:
        time.sleep(5)
        if proc.poll() is not None:
            raise RuntimeError(f"[bench] asyncppo launch ended (exit {proc.returncode}) before {seconds:.0f} s of "
                             f"training; see {log_path}")
        wall = {r["step"]: r["time/wall_s"] for r in _learner_records(out)}
        if any(wall.get(step, -1.0) >= seconds for step, _ in _complete_steps(checkpoints_root(out))):
            return
        if time.monotonic() > deadline:
            last = max(wall.items(), default=None)
            raise RuntimeError(f"[bench] asyncppo: the learner had not trained {seconds:.0f} s with a checkpoint "
                             f"past it by the deadline (last step, wall: {last}); see {log_path}")


def run_asyncppo_long(overrides: list[str], root: str, marks: list[float], preset: str = "data=long",
                      save_every: int = SAVE_EVERY) -> dict:
    """``asyncppo launch data=long`` (or another ``preset``) until a checkpoint past the last mark; the first
    checkpoint past each mark (a checkpoint every ``save_every`` steps)."""
    out = os.path.join(root, "asyncppo")
    cmd = [sys.executable, "-m", "asyncppo", "launch", preset, f"trainer.output_dir={out}",
           "trainer.total_steps=100000", f"trainer.save_every={save_every}", "trainer.keep_checkpoints=100000",
           "trainer.eval_every=0", "trainer.eval_at_start=false", "data.num_eval_prompts=0",
           "trainer.logger.wandb=false", *overrides]
    print(f"[bench] asyncppo: {' '.join(cmd[3:])}", flush=True)
    log_path = os.path.join(root, "asyncppo.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _stop_when_trained(proc, out, marks[-1], log_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the launch stops every actor and Ray, as on Ctrl-C
                try:
                    proc.wait(timeout=180)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    records = _learner_records(out)
    wall = {r["step"]: r["time/wall_s"] for r in records}
    steps = [s for s, _ in _complete_steps(checkpoints_root(out)) if s in wall]
    points = []
    for mark in marks:
        step = next((s for s in steps if wall[s] >= mark), None)
        if step is not None and all(p["step"] != step for p in points):
            points.append({"step": step, "train_s": wall[step],
                           "path": os.path.join(checkpoints_root(out), f"step_{step}", "actor")})
    upto = [r for r in records if r["step"] <= points[-1]["step"]]
    mean = lambda key: sum(r[key] for r in upto) / len(upto)  # noqa: E731
    return {"name": "asyncppo", "points": points, "launch_s": time.perf_counter() - t0, "steps": len(upto),
            "step_s": mean("time/step_s"), "wait_s": mean("time/wait_s"), "update_s": mean("time/update_s"),
            "length_mean": mean("response_length/mean"), "length_max_mean": mean("response_length/max")}


# ---------------------------------------------------------------------------------------------- TRL
def run_trl_long(model_dir: str, rows_train: list[dict], root: str, marks: list[float], max_new: int,
                 mask_truncated: bool, beta: float, mode: str, name: str, trainer_kwargs: Optional[dict] = None
                 ) -> dict:
    """TRL's ``GRPOTrainer`` as peer.py's ``trl_trainer`` sets it up in ``mode`` (as the preset trains, truncated
    answers masked as the preset's ``algorithm.mask_truncated`` says, its KL anchor as ``beta``), saving a point at
    each mark. With ``steps_per_generation`` N the clock is read after every optimizer step, so a point can land
    inside a generation's N updates, as a TRL user stopping there would see it."""
    from transformers import TrainerCallback

    class TimedPoints(TrainerCallback):
        """Saves the weights when the training clock (saving excluded) passes each mark, then stops."""

        def __init__(self):
            self.points, self.step_s, self.logs, self.excluded, self.tok = [], [], [], 0.0, None

        def on_train_begin(self, a, state, control, **kw):
            self.t0 = self.last = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **kw):
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            clock = now - self.t0 - self.excluded
            if clock >= marks[len(self.points)]:
                path = os.path.join(root, f"{name}_points", f"step_{state.global_step}")
                model.save_pretrained(path)
                self.tok.save_pretrained(path)
                self.points.append({"step": state.global_step, "train_s": clock, "path": path})
                control.should_training_stop = len(self.points) == len(marks)
            self.last = time.perf_counter()
            self.excluded += self.last - now

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    timed = TimedPoints()
    built = trl_trainer(model_dir, rows_train, os.path.join(root, name), max_completion=max_new, callbacks=[timed],
                        logging_steps=1, mask_truncated=mask_truncated, beta=beta, mode=mode,
                        **(trainer_kwargs or {}))
    if built is None:
        return {}
    trainer, timed.tok = built
    generate_s, original = [], trainer._generate_single_turn

    def timed_generate(*a, **kw):  # one generation: N steps' answers (128 each), by the mode's generator
        t = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            generate_s.append(time.perf_counter() - t)

    trainer._generate_single_turn = timed_generate
    print(f"[bench] {name} ({mode}: {trl_mode(mode)}): up to {marks[-1]:.0f} s of training "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    trainer.train()
    logs = [g for g in timed.logs if "completions/max_length" in g]
    n = len(timed.step_s)
    generations = len(generate_s)
    return {"name": name, "mode": mode, "points": timed.points, "steps": n, "step_s": sum(timed.step_s) / n,
            "generations": generations, "generate_s": sum(generate_s) / max(1, generations),
            "update_s": (sum(timed.step_s) - sum(generate_s)) / n,
            "length_mean": sum(g["completions/mean_length"] for g in logs) / max(1, len(logs)),
            "length_max_mean": sum(g["completions/max_length"] for g in logs) / max(1, len(logs))}


def run_trl_setups(setups: list[str], skip: list[str], cfg, model_dir: str, rows_train: list[dict], work: str,
                   marks: list[float], trainer_kwargs=None) -> list[dict]:
    """:func:`run_trl_long` for each TRL setup named in ``setups`` (none when ``skip`` names ``trl``), every name
    checked before any training; each with the preset's completion length, truncation mask and KL anchor, and
    ``trainer_kwargs()`` (a fresh dict per setup: a multi-turn task's reward, tools and tokenizer). Named ``trl``
    alone, ``trl:<mode>`` among several."""
    modes = [] if "trl" in skip else list(setups)
    for mode in modes:
        trl_mode(mode)  # a misspelt mode fails here, before any training
    if len(set(modes)) < len(modes):
        raise ValueError(f"trl={','.join(modes)}: a setup named twice")
    results = []
    for mode in modes:
        r = run_trl_long(model_dir, rows_train, work, marks, cfg.rollout.response_length, cfg.algorithm.mask_truncated,
                         cfg.algorithm.kl_loss_coef if cfg.algorithm.use_kl_loss else 0.0,
                         mode=mode, name="trl" if len(modes) == 1 else f"trl:{mode}",
                         trainer_kwargs=trainer_kwargs() if trainer_kwargs else None)
        results += [r] if r else []
    return results


def seed_figures(doc: dict) -> dict:
    """One seed's figures (curves.py: :func:`peer_figures`) against each TRL setup run, and each contender's mean
    sampled accuracy over its scored points (the pilot's choice of TRL's best setup: the highest mean, fixed before
    the pilot ran). With one TRL setup the names are the plain ones the target reads; with several, each ratio
    names the setup it was measured against."""
    trls = [r["name"] for r in doc["results"] if r["name"].startswith("trl")]
    figures = peer_figures(doc, slow=trls[0] if len(trls) == 1 else "trl")
    for name in trls if len(trls) > 1 else []:
        pair = {**doc, "results": [r for r in doc["results"] if r["name"] in ("asyncppo", name)]}
        for key, value in peer_figures(pair, slow=name).items():
            if "speedup" in key:
                figures[f"{key} vs {name}"] = value
    for r in doc["results"]:
        if r["points"]:
            figures[f"mean sampled {r['name']}"] = sum(p["sampled"] for p in r["points"]) / len(r["points"])
    return figures


def run(opts: dict, seed: int, work: str) -> dict:
    """One seed: both contenders for ``seconds`` of training each, every point scored after both trained."""
    torch.set_num_threads(opts["threads"])
    overrides = [*opts["overrides"], f"trainer.seed={seed}"]
    cfg = preset(overrides)
    seconds, points = opts["seconds"], opts["points"]
    marks = [seconds * k / points for k in range(1, points + 1)]
    task = get_task(cfg.data.task, seed=cfg.data.seed, num_eval=cfg.data.num_eval_prompts)
    splits = task.splits()
    max_new = min(task.max_response_tokens, cfg.rollout.response_length)  # the probe's budget: longest + eos
    model_dir = model_of(cfg)
    print(f"[peer] data=long, {seconds:.0f} s of training each, points at {[round(m) for m in marks]} s; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    if "asyncppo" not in opts["skip"]:
        results.append(run_asyncppo_long(overrides, work, marks))
    results += run_trl_setups(opts["trl"], opts["skip"], cfg, os.path.abspath(model_dir), splits.train, work, marks)
    start = probe(*load(model_dir), splits.eval, seed=cfg.trainer.seed, max_new=max_new)
    for r in results:
        for point in r["points"]:
            point.update(probe(*load(point["path"]), splits.eval, seed=cfg.trainer.seed, max_new=max_new))
            print(f"[peer]   {r['name']} step {point['step']} ({point['train_s']:.0f} s): sampled "
                  f"{point['sampled']:.3f} greedy {point['greedy']:.3f}", flush=True)
    doc = {"start": start, "results": results, "seconds": seconds}
    return report(doc, work, "bench_peer_long", f"data=long, seed {seed}", "peer")


def report(doc: dict, work: str, stem: str, title: str, tag: str) -> dict:
    """One seed's record written (``stem``.json, its plot ``stem``.png), its figures printed, and the runner's result."""
    with open(os.path.join(work, f"{stem}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    from asyncppo.bench.plot_peer import plot  # matplotlib

    plot(doc, os.path.join(work, f"{stem}.png"), title=title)
    figures = seed_figures(doc)
    for name, value in figures.items():
        print(f"[{tag}] {name}: {'undefined' if value is None else f'{value:.3f}'}", flush=True)
    units = {k: ("accuracy" if "sampled" in k else "x") for k in figures}
    return {"figures": figures, "units": units, "detail": doc}
