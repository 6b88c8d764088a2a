"""Single-process pieces shared by the peer, LoRA and collapse benchmarks (asyncppo/bench/peer.py, lora.py,
scripts/bench_collapse.py).

Sampling with the HF KV cache, turning sampled groups into the learner's :class:`TrainBatch`, and the held-out probe.
With these, asyncppo's own update (:class:`asyncppo.learner.ppo.PPOUpdate`, the real config and losses) runs
synchronously in one process: exactly what ``rollout.max_staleness=0`` trains on, without Ray, vLLM or the stream.
That is what makes learning experiments of hundreds of steps affordable on a loaded 2-core machine, and what lets
the profile separate the update's cost from the pipeline's.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from asyncppo.data.heldout import HeldOutProbe
from asyncppo.data.rewards import exact_match
from asyncppo.learner.batch import TrainBatch

PROMPTS, GROUP, MAX_NEW = 16, 8, 5  # the embedded default's batch shape; answers are <= 3 digits + eos


def load(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path)


def evaluate(model, tokenizer, rows) -> dict:
    """The run's held-out probe (data/heldout.py; a launch measures it on the rollout engines), in process, at T=1
    with seed 0: 4 sampled answers per prompt, and greedy."""
    probe = HeldOutProbe(rows=rows, temperature=1.0, seed=0, max_new_tokens=MAX_NEW)
    out = probe.evaluate(model, tokenizer)
    return {"sampled": out["accuracy_sampled"], "greedy": out["accuracy_greedy"]}


@torch.no_grad()
def sample_group(model, prompt_ids: torch.Tensor, n: int, eos: int, pad: int, gen: torch.Generator):
    """``n`` answers per prompt at T=1 with the KV cache (the addition task's prompts all have one length).
    Returns response ids (``pad`` after eos), a mask up to and including eos, and the sampling log-probs."""
    was = model.training
    model.eval()
    ids = prompt_ids.repeat_interleave(n, dim=0)
    rows = ids.shape[0]
    done = torch.zeros(rows, dtype=torch.bool)
    out, logps, past, step_ids = [], [], None, ids
    for _ in range(MAX_NEW):
        res = model(input_ids=step_ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        logp = torch.log_softmax(res.logits[:, -1].float(), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        out.append(nxt)
        logps.append(logp.gather(-1, nxt[:, None]).squeeze(1))
        done |= nxt == eos
        if bool(done.all()):
            break
        step_ids = nxt[:, None]
    model.train(was)
    resp = torch.stack(out, 1)
    mask = torch.ones_like(resp, dtype=torch.bool)
    seen_eos = torch.zeros(rows, dtype=torch.bool)
    for t in range(resp.shape[1]):
        mask[:, t] = ~seen_eos
        seen_eos |= resp[:, t] == eos
    return resp, mask, torch.stack(logps, 1) * mask


def rewards(tok, resp, mask, answers: list[str], n: int) -> torch.Tensor:
    """Exact match of each answer (eos required, as the rollout worker's reward sees a finished answer)."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    texts = tok.batch_decode(torch.where(mask & (resp != eos), resp, pad), skip_special_tokens=True)
    ended = (resp == eos).any(1)
    return torch.tensor([exact_match(t, answers[i // n]) * float(ended[i]) for i, t in enumerate(texts)])


def sampled_batch(model, tok, rows: list[dict], gen: torch.Generator, n: int = GROUP) -> TrainBatch:
    """One synchronous batch in the learner's layout (left-aligned prompts of equal length, responses after)."""
    prompt_ids = torch.tensor([tok.encode(r["prompt"], add_special_tokens=False) for r in rows])
    resp, mask, logps = sample_group(model, prompt_ids, n, tok.eos_token_id, tok.pad_token_id, gen)
    B, P = resp.shape[0], prompt_ids.shape[1]
    ids = torch.cat([prompt_ids.repeat_interleave(n, 0), torch.where(mask, resp, tok.pad_token_id)], 1)
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], 1)
    return TrainBatch(
        input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0),
        response_mask=mask.float(), behavior_logprobs=logps,
        scores=rewards(tok, resp, mask, [r["answer"] for r in rows], n),
        group_index=torch.arange(len(rows)).repeat_interleave(n), version_min=torch.zeros(B, dtype=torch.long),
        prompt_len=P,
    )


class Timers:
    """Exclusive wall time per label: a timed call inside another timed call counts only for the inner one."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}  # exclusive
        self.inclusive: dict[str, float] = {}
        self._stack: list[list] = []

    def wrap(self, label, fn):
        """``label``: a string, or a callable returning one at call time (e.g. to tell grad from no-grad)."""

        def timed(*a, **kw):
            t0 = time.perf_counter()
            name = label() if callable(label) else label
            self._stack.append([name, 0.0])
            try:
                return fn(*a, **kw)
            finally:
                _, inner = self._stack.pop()
                spent = time.perf_counter() - t0
                self.totals[name] = self.totals.get(name, 0.0) + spent - inner
                self.inclusive[name] = self.inclusive.get(name, 0.0) + spent
                if self._stack:
                    self._stack[-1][1] += spent

        return timed

    @contextmanager
    def patched(self, targets: list[tuple[object, str, str]]):
        """Replace ``getattr(obj, name)`` with a timed version for the duration, for each (obj, name, label)."""
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
        try:
            for obj, name, label in targets:
                setattr(obj, name, self.wrap(label, getattr(obj, name)))
            yield self
        finally:
            for obj, name, original in saved:
                setattr(obj, name, original)


def run_variants(command: list[str], names: list[str], known: dict, root: str, *, steps: int, eval_every: int,
                 parallel: int, overrides: list[str]) -> None:
    """Train each of ``names`` (keys of ``known``) as ``command + ["--one", NAME, ...]`` processes, at most
    ``parallel`` at once, each writing ``<root>/<NAME>.jsonl`` (and its log). Learning, not speed, is compared, so
    variants share the machine; a variant that fails is named with its log and the others go on."""
    import os
    import subprocess

    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {sorted(known)}")
    os.makedirs(root, exist_ok=True)
    print(f"[bench] {len(names)} variants, {steps} steps, records in {root}", flush=True)
    pending, running = list(names), []
    while pending or running:
        while pending and len(running) < parallel:
            name = pending.pop(0)
            cmd = [*command, "--one", name, "--keep", root, "--steps", str(steps), "--eval-every", str(eval_every),
                   *overrides]
            log = open(os.path.join(root, f"{name}.log"), "w")
            running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
        name, proc = running.pop(0)
        if proc.wait() != 0:
            print(f"[bench] {name} failed (exit {proc.returncode}); see {root}/{name}.log", flush=True)


def variant_parser(doc: str, *, steps: int, eval_every: int, variants: str, parallel: int):
    """The command line every variant benchmark shares (``--one`` is how :func:`run_variants` starts a variant)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--eval-every", type=int, default=eval_every)
    p.add_argument("--variants", default=variants)
    p.add_argument("--parallel", type=int, default=parallel, help="variants trained at once (one thread each)")
    p.add_argument("--keep", default="", help="directory for the per-variant JSONL (default: a temp dir)")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: train one variant into --keep
    p.add_argument("overrides", nargs="*", help="config overrides added to every variant")
    return p
