"""Documented cluster-scale workloads for ``asyncppo advise --workload NAME`` (no run directory needed).

``7b-long``: a 7B reasoning model trained with GRPO on long generations, the regime the published asynchronous
speed-ups come from (AReaL: up to 2.77x over synchronous; verl fully-async: 2.35-2.67x on 128 GPUs with
Qwen2.5-7B). The rates are derived from public specifications, not measured here:

* model: Qwen2.5-7B (28 layers, 4 KV heads x 128, 7.6e9 parameters), bf16; KV cache 2 x 28 x 4 x 128 x 2 B =
  57,344 B per token;
* GPU: H100 SXM, 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (NVIDIA's datasheet); one engine per GPU (tp=1);
* decode step: weights read once per step (15.2 GB at ~60% of peak bandwidth: ~7.6 ms) plus ~4 ms of scheduler
  and sampling overhead -> ``base_s = 0.012``; 2 x 7.6e9 FLOP per sequence per step at ~50% of peak ->
  ``per_seq_s = 3.1e-5``; the KV cache read, 57,344 B per context token at ~60% of peak ->
  ``per_kv_token_s = 2.85e-8``. Long sequences hold their slots longest, so running contexts average ~5.5k tokens;
  80 GB less the weights holds ~128 such sequences (``max_num_seqs = 128``): ~3.5k tokens/s per GPU;
* training: ~10 x 7.6e9 FLOP per response token (forward + backward of the actor 6N, the proximal and reference
  forwards 2N each), prompts adding ~12% at 512-token prompts, at 35% MFU -> ``per_token_s = 2.5e-4`` per GPU,
  ``base_s = 2`` (optimizer step, gathers);
* weight load: 15.2 GB broadcast over 400 Gb/s InfiniBand plus the in-place reload: ``load_s = 1.0``;
* colocated synchronous baseline: ``switch_s = 5`` per step to swap the engine and the trainer in and out of GPU
  memory (sleep/wake), an assumption;
* lengths: lognormal with mean 4,096 and p99 28,672 tokens, capped at 32,768, half the log-variance shared within
  a group; 512-token prompts; ``B = 256`` prompts x ``n = 16`` samples per step.
"""

from __future__ import annotations

from asyncppo.pipeline.lengths import LogNormalLengths
from asyncppo.pipeline.model import EngineSpeed, TrainSpeed
from asyncppo.report.rates import Rates

SWITCH_S = {"7b-long": 5.0}
PROMPT_TOKENS = {"7b-long": 512}


def workload(name: str) -> Rates:
    if name != "7b-long":
        raise ValueError(f"unknown workload {name!r}; known: 7b-long")
    return Rates(
        gen=EngineSpeed(base_s=0.012, per_seq_s=3.1e-5, per_kv_token_s=2.85e-8, max_num_seqs=128),
        train=TrainSpeed(base_s=2.0, per_token_s=2.5e-4),
        load_s=1.0,
        lengths=LogNormalLengths(4096, 28672, 32768, within_group=0.5),
        batch_groups=256, group_size=16, max_staleness=2, sync_every=1, engines=1, train_ranks=1,
        response_length=32768, measured_samples_per_s=0.0,
        notes=["rates derived from public specifications (see asyncppo/report/workloads.py), not measured"],
        prompt_tokens=PROMPT_TOKENS[name],
        admission_unit="slot",  # rollout.admission_unit's default
    )
