"""``asyncppo bench peer-default``: asyncppo's embedded default against the peers a user would try instead, on the
same task, model and box.

Three contenders, run one after the other in one invocation (so they see the same machine load), all starting
from the same cached built-in model (``builtin:tiny-addition``: 2-digit addition, 0.5M-parameter Qwen2 after the
supervised warm start) with the same batch shape (16 prompts x 8 samples), learning rate and sampling temperature:

* ``asyncppo``  - ``asyncppo launch`` with no arguments but the output directory (PPO: critic, GAE, vLLM CPU
  engine, Ray, ZeroMQ stream, weight pushes); its training time is the learner's ``time/wall_s`` at the last step.
* ``trl``       - TRL's ``GRPOTrainer`` (HF generation, one process), stopped after the same training time. Skipped
  with a message when ``trl`` is not installed (it is not a dependency of asyncppo: ``pip install trl``).
* ``reference`` - a plain single-process loop: sample 16 x 8 answers with the KV cache, exact-match reward,
  group-baseline advantage ``(r - mean) / (std + 1e-6)``, token-mean REINFORCE loss, AdamW, grad clip 1; stopped
  after the same training time.

Every contender's final weights are scored here by the same probe the learner uses (256 held-out prompts, 4 sampled
answers each at T=1, and greedy), so accuracies are comparable; equal training time, not equal steps, is the
comparison a user feels. ``profile=true`` instead profiles the default PPO update in process (where its time goes
per trained sample, beside the reference loop's update). The long-generation comparison is peer_long.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Optional

import torch

from asyncppo.bench.inproc import GROUP, MAX_NEW, PROMPTS, Timers, evaluate, load, rewards, sample_group, sampled_batch
from asyncppo.data.rewards import exact_match
from asyncppo.data.tasks import get_task
from asyncppo.data.tiny import resolve_model_path

LR = 1e-4


# ---------------------------------------------------------------------------------------------- asyncppo
def run_asyncppo(overrides: list[str], root: str) -> dict:
    """``asyncppo launch`` with only ``overrides`` (the default run has none); its learner time and final weights."""
    out = os.path.join(root, "asyncppo")
    cmd = [sys.executable, "-m", "asyncppo", "launch", f"trainer.output_dir={out}", *overrides]
    print(f"[bench] asyncppo: {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"[bench] asyncppo failed with exit code {proc.returncode}")
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = [r for r in records if "reward/mean" in r]
    return {
        "name": "asyncppo", "wall_s": wall, "train_s": train[-1]["time/wall_s"],
        "samples": train[-1]["samples_trained"], "model_dir": os.path.join(out, "final"),
        "learner_busy_s": sum(r["time/step_s"] - r["time/wait_s"] for r in train),
    }


# ---------------------------------------------------------------------------------------------- reference loop
def run_reference(model_dir: str, seconds: float, rows_train: list[dict]) -> dict:
    """The plain single-process loop, trained for ``seconds``."""
    model, tok = load(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(rows_train), generator=gen).tolist()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    samples, step, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        batch = [rows_train[order[(step * PROMPTS + i) % len(order)]] for i in range(PROMPTS)]
        prompt_ids = torch.tensor([tok.encode(r["prompt"], add_special_tokens=False) for r in batch])
        resp, mask, _ = sample_group(model, prompt_ids, GROUP, eos, pad, gen)
        r = rewards(tok, resp, mask, [x["answer"] for x in batch], GROUP).view(PROMPTS, GROUP)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        model.train()
        full = torch.cat([prompt_ids.repeat_interleave(GROUP, 0), resp], 1)
        p = prompt_ids.shape[1]
        logits = model(input_ids=full).logits[:, p - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1)
        m = mask.float()
        loss = -(adv[:, None] * logp * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        samples += PROMPTS * GROUP
        step += 1
    train_s = time.perf_counter() - t0
    return {"name": "reference", "train_s": train_s, "samples": samples, "model": model, "tokenizer": tok}


# ---------------------------------------------------------------------------------------------- TRL
TRL_GENERATORS = {"generate": {}, "cb": {"use_transformers_continuous_batching": True},
                  "vllm": {"use_vllm": True, "vllm_mode": "colocate"}}


def trl_mode(text: str) -> dict:
    """A TRL setup named ``spg<N>[-cb|-vllm][-ckpt]``: ``steps_per_generation`` N (one generation of N x 128
    answers, shuffled, then N optimizer updates of 128 each: each sample used once, the later updates on answers
    1 to N - 1 versions old), the generator (``transformers.generate`` by default, ``cb`` transformers continuous
    batching, ``vllm`` TRL's vLLM colocate mode, which also turns on TRL's importance-sampling correction) and
    gradient checkpointing (off unless ``-ckpt``: TRL's default is on, asyncppo's learner does not checkpoint)."""
    head, *flags = text.split("-")
    if not head.startswith("spg") or not head[3:].isdigit() or int(head[3:]) < 1:
        raise ValueError(f"TRL mode {text!r}: expected spg<N>[-cb|-vllm][-ckpt], e.g. spg4-cb")
    generators = [f for f in flags if f in TRL_GENERATORS]
    unknown = [f for f in flags if f not in TRL_GENERATORS and f != "ckpt"]
    if unknown or len(generators) > 1 or len(set(flags)) < len(flags):
        raise ValueError(f"TRL mode {text!r}: unknown or repeated parts {unknown or generators}")
    return {"steps_per_generation": int(head[3:]), "gradient_checkpointing": "ckpt" in flags,
            "generator": generators[0] if generators else "generate"}


def trl_trainer(model_dir: str, rows_train: list[dict], root: str, *, max_completion: int, callbacks: list,
                logging_steps: int = 50, mask_truncated: bool = False, beta: float = 0.0, mode: str = "spg1",
                reward=None, tools=None, tokenizer=None, config: Optional[dict] = None):
    """TRL's ``GRPOTrainer`` set up as asyncppo's preset trains: 16 prompts x 8 samples per optimizer update, each
    sample used once, constant learning rate ``LR`` without warm-up, ``beta`` (KL to the reference in the loss, k3,
    asyncppo's ``use_kl_loss`` with ``kl_penalty=low_var_kl``: 0 = none, the default), grad clip 1, T=1, exact
    match; ``loss_type="dapo"`` (TRL's default, stated): token-mean over the batch's active tokens, which with one
    process, no accumulation and one batch per generation is asyncppo's ``loss_agg_mode=token-mean`` (with N
    batches a generation TRL divides by the generation's active tokens over N); ``mask_truncated``: TRL's
    ``mask_truncated_completions``, asyncppo's ``algorithm.mask_truncated``. ``mode`` (:func:`trl_mode`) is how a
    TRL user would speed it up: more batches per generation, another generator, no gradient checkpointing. None
    (with a message) without trl.

    A multi-turn task (peer_calc.py) passes its own ``reward`` (TRL's signature), ``tools`` (Python callables),
    the ``tokenizer`` TRL trains with (its chat template and response parser; the model directory's own tokenizer is
    still the one returned, for saving points) and further ``config`` fields (``max_tool_calling_iterations``)."""
    setup = trl_mode(mode)
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        print(f"[bench] trl: SKIPPED ({exc}); `pip install trl` to include TRL's GRPOTrainer", flush=True)
        return None
    model, tok = load(model_dir)

    def exact(prompts, completions, answer, **kw):
        return [exact_match(c, a) for c, a in zip(completions, answer)]

    args = GRPOConfig(
        output_dir=os.path.join(root, "trl"), learning_rate=LR, per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, max_completion_length=max_completion, temperature=1.0, beta=beta, max_steps=100_000,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, logging_steps=logging_steps,
        loss_type="dapo", report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, mask_truncated_completions=mask_truncated,
        steps_per_generation=setup["steps_per_generation"], gradient_checkpointing=setup["gradient_checkpointing"],
        **TRL_GENERATORS[setup["generator"]], **(config or {}),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward or exact], args=args, processing_class=tokenizer or tok,
                          train_dataset=Dataset.from_list(rows_train), callbacks=callbacks, tools=tools)
    return trainer, tok


def run_trl(model_dir: str, seconds: float, rows_train: list[dict], root: str) -> dict:
    """TRL's ``GRPOTrainer`` stopped after ``seconds`` of training ({} without trl)."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.steps = 0

        def on_train_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.steps = state.global_step
            if time.perf_counter() - self.t0 >= seconds:
                control.should_training_stop = True

    stop = StopAfter()
    built = trl_trainer(model_dir, rows_train, root, max_completion=MAX_NEW, callbacks=[stop])
    if built is None:
        return {}
    trainer, tok = built
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    return {"name": "trl", "train_s": train_s, "samples": stop.steps * PROMPTS * GROUP,
            "model": trainer.model, "tokenizer": tok}


# ---------------------------------------------------------------------------------------------- learner profile
def profile_learner(overrides: list[str], model_dir: str, rows_train: list[dict], steps: int = 20) -> dict:
    """Where the default PPO update spends its time per trained sample, in one process and one thread (as the
    learner actor runs), on batches sampled from the model itself; next to it the reference loop's costs.
    Exclusive wall time per part (inproc.py ``Timers``); fractions survive a loaded machine better than
    absolute times."""
    import asyncppo.algo as algo
    import asyncppo.learner.ppo as ppo_mod
    from asyncppo.config import load_config
    from asyncppo.learner.models import load_actor
    from asyncppo.learner.value_head import build_critic

    cfg = load_config(overrides)
    dev = torch.device("cpu")
    actor, critic = load_actor(model_dir, torch.float32, dev), build_critic(cfg, model_dir, torch.float32, dev, False)
    tok = load(model_dir)[1]
    update = ppo_mod.PPOUpdate(cfg, actor, critic, None, dev)
    gen = torch.Generator().manual_seed(0)
    timers = Timers()
    sample = timers.wrap("sampling 16x8 (HF, KV cache; not the vLLM engine)", sampled_batch)
    def grad(what):
        return lambda: f"{what} forward, " + ("with grad" if torch.is_grad_enabled() else "no grad (proximal/old)")

    targets = [
        (ppo_mod, "policy_forward", grad("actor")),
        (ppo_mod, "value_forward", grad("critic")),
        (ppo_mod, "policy_value_forward", grad("actor + value head")),
        (torch.Tensor, "backward", "backward, actor + critic"),
        (update.actor_opt, "step", "AdamW step, actor"),
        (update.critic_opt, "step", "AdamW step, critic"),
        (torch.nn.utils, "clip_grad_norm_", "grad-norm clipping"),
        (algo, "policy_loss", "policy loss + its metrics"),
        (algo, "value_loss", "value loss + its metrics"),
        (algo, "compute_advantages", "GAE + whitening"),
        (algo, "rollout_correction", "rollout-correction weights + metrics"),
        (ppo_mod, "micro_batches", "micro-batch sort + slicing"),
    ]
    step = timers.wrap("PPOUpdate.step total", update.step)
    update.step(sample(actor, tok, rows_train[:PROMPTS], gen))  # warm-up
    timers.totals.clear()
    timers.inclusive.clear()
    with timers.patched(targets):
        for i in range(1, steps + 1):
            step(sample(actor, tok, rows_train[i * PROMPTS : (i + 1) * PROMPTS], gen))
    n = steps * PROMPTS * GROUP
    total = timers.inclusive["PPOUpdate.step total"]
    timers.totals["other (metrics, batch moves, Python)"] = timers.totals.pop("PPOUpdate.step total")
    print(f"\nlearner profile: {steps} PPO updates of {PROMPTS}x{GROUP} samples, {torch.get_num_threads()} "
          f"thread(s), load average {os.getloadavg()[0]:.1f}: update {total / n * 1e6:.0f} us per trained sample "
          f"({n / total:.0f} samples/s)")
    for label, v in sorted(timers.totals.items(), key=lambda kv: -kv[1]):
        share = "" if label.startswith("sampling") else f"{v / total:6.1%}"
        print(f"  {label:<52} {share:>6} {v / n * 1e6:7.0f} us/sample")

    # the reference loop's update on the same batches: one forward + backward of the actor, one AdamW step
    model, _ = load(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    upd = 0.0
    for i in range(1, steps + 1):
        b = sampled_batch(model, tok, rows_train[i * PROMPTS : (i + 1) * PROMPTS], gen)
        t1 = time.perf_counter()
        r = b.scores.view(PROMPTS, GROUP)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, b.prompt_len - 1 : -1]
        labels = b.input_ids[:, b.prompt_len :]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
        loss = -(adv[:, None] * logp * b.response_mask).sum() / b.response_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        upd += time.perf_counter() - t1  # the update only, not the sampling
    print(f"  reference loop update (1 forward + backward, 1 AdamW): {upd / n * 1e6:.0f} us/sample; "
          f"PPO update / reference update = {total / upd:.2f}x")
    return {"update us/sample": total / n * 1e6, "PPO update / reference update": total / upd}


def run(opts: dict, seed: int, work: str) -> dict:
    torch.set_num_threads(opts["threads"])
    skip = set(opts["skip"])
    splits = get_task("addition", seed=0, num_eval=256).splits()
    model_dir = resolve_model_path("builtin:tiny-addition")
    overrides = [*opts["overrides"], f"trainer.seed={seed}"]
    if opts["profile"]:
        prof = profile_learner(overrides, model_dir, splits.train)
        return {"figures": prof, "units": {"update us/sample": "us", "PPO update / reference update": "ratio"},
                "detail": {}}
    base, tok = load(model_dir)
    before = evaluate(base, tok, splits.eval)
    results, seconds = [], opts["seconds"]
    if "asyncppo" not in skip:
        r = run_asyncppo(overrides, work)
        r.update(evaluate(*load(r["model_dir"]), splits.eval))
        results.append(r)
        seconds = seconds or r["train_s"]
    seconds = seconds or 180.0
    for name in ("trl", "reference"):
        if name in skip:
            continue
        print(f"[peer-default] {name}: {seconds:.0f} s of training (load {os.getloadavg()[0]:.1f})", flush=True)
        r = run_trl(model_dir, seconds, splits.train, work) if name == "trl" else \
            run_reference(model_dir, seconds, splits.train)
        if r:
            r.update(evaluate(r.pop("model"), r.pop("tokenizer"), splits.eval))
            results.append(r)
    figures, units = {"start sampled": before["sampled"], "start greedy": before["greedy"]}, {}
    for r in results:
        n = r["name"]
        figures[f"held-out sampled {n}"], figures[f"held-out greedy {n}"] = r["sampled"], r["greedy"]
        figures[f"samples/s {n}"] = r["samples"] / r["train_s"]
        units.update({f"held-out sampled {n}": "accuracy", f"held-out greedy {n}": "accuracy",
                      f"samples/s {n}": "samples/s"})
        print(f"[peer-default] {n}: {r['train_s']:.1f} s, {r['samples']} samples, sampled {r['sampled']:.3f}, "
              f"greedy {r['greedy']:.3f}", flush=True)
    names = {r["name"] for r in results}
    if {"asyncppo", "trl"} <= names:
        figures["sampled asyncppo - trl"] = figures["held-out sampled asyncppo"] - figures["held-out sampled trl"]
        units["sampled asyncppo - trl"] = "accuracy"
    units.update({"start sampled": "accuracy", "start greedy": "accuracy"})
    return {"figures": figures, "units": units,
            "detail": {"seconds": seconds, "results": [{k: v for k, v in r.items()} for r in results]}}
