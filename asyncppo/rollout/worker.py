"""The rollout worker loop: generate, score, stamp, stream — never waiting for the learner unless staleness says so.

Each iteration between two engine calls:
1. read the control channel (newest state wins); stop if asked;
2. if the learner announced weights newer than ours, join the broadcast and load them in place;
3. take admission tickets (one per prompt group) — a ticket says the minimum policy version allowed to generate it;
4. make sure our weights are at least that version (else go back to 2);
5. generate ``n`` samples per prompt in one engine call, score them (a failing reward function scores 0 and is counted),
   stamp each sample with the version of the weights that produced it, and stream each group to the learner.

Weights only change between engine calls, so every token of a sample comes from one version:
``version_min == version_max``. The learner's broadcast waits for at most one engine call per worker
(``rollout.prompts_per_call`` bounds that call).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from asyncppo.sync.engine_load import receive_into_engine

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.stream.records import Sample, TrajectoryGroup

log = logging.getLogger("asyncppo.rollout")


def sync_backend(cfg: AsyncPPOConfig) -> str:
    """NCCL when both the learner and the engines hold GPUs, gloo otherwise (both sides must agree)."""
    return "nccl" if cfg.cluster.train_gpus > 0 and cfg.cluster.rollout_gpus > 0 else "gloo"


@dataclass
class Endpoints:
    """Where the learner listens; handed to every worker by the launcher."""

    trajectory: str
    control: str
    admission: str
    sync_host: str
    sync_port: int
    sync_world_size: int


class RolloutWorker:
    def __init__(self, cfg: AsyncPPOConfig, worker_id: int, num_workers: int, endpoints: Endpoints, model_path: str):
        self.cfg = cfg
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.endpoints = endpoints
        self.model_path = model_path
        self.version = 0
        self.stats = {"groups_sent": 0, "samples": 0, "reward_failures": 0, "weight_loads": 0, "gen_tokens": 0}
        self._seq = 0

    # ------------------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from asyncppo.data.datasets import build_prompt_dataset
        from asyncppo.data.rewards import resolve_reward_fn, score_safely
        from asyncppo.rollout.engine import make_engine
        from asyncppo.staleness import AdmissionClient
        from asyncppo.stream.channels import ControlSubscriber, TrajectorySender
        from asyncppo.sync import WeightReceiver, make_sync_group

        cfg, ro = self.cfg, self.cfg.rollout
        self._score_safely = score_safely
        engine = make_engine(
            ro.engine,
            self.model_path,
            dtype=ro.dtype,
            max_model_len=ro.prompt_length + ro.response_length,
            seed=cfg.trainer.seed + 1000 * (self.worker_id + 1),
            device="cuda" if cfg.cluster.rollout_gpus > 0 else "cpu",
            kv_cache_gib=ro.kv_cache_gib,
            enforce_eager=ro.enforce_eager,
            gpu_memory_utilization=ro.gpu_memory_utilization,
            num_threads=max(1, int(cfg.cluster.cpus_per_worker)),
        )
        dataset = build_prompt_dataset(cfg, self.model_path, split="train").shard(self.worker_id, self.num_workers)
        prompts = iter(dataset.iterate(seed=cfg.data.seed + self.worker_id, shuffle=cfg.data.shuffle))
        self.stats["dataset"] = dataset.stats.as_dict()
        print(f"[asyncppo] rollout worker {self.worker_id}: {len(dataset)} prompts, dataset {self.stats['dataset']}",
              flush=True)
        reward_fn = resolve_reward_fn(ro.reward_fn, task=cfg.data.task if not cfg.data.train_files else None)
        ep = self.endpoints
        group = make_sync_group(ep.sync_host, ep.sync_port, rank=1 + self.worker_id, world_size=ep.sync_world_size,
                                backend=sync_backend(cfg), timeout_s=cfg.cluster.timeout_s)
        self._group = group
        receiver = WeightReceiver(group)
        sender = TrajectorySender(ep.trajectory, hwm=cfg.cluster.stream_hwm)
        control = ControlSubscriber(ep.control)
        admission = AdmissionClient(ep.admission, self.worker_id)
        per_call = ro.prompts_per_call or max(1, ro.rollout_batch_size // self.num_workers)
        state = None
        try:
            while True:
                state = control.latest(timeout_ms=0) or state
                if state is None and control.rejected.get("version", 0):
                    # Every control message is refused: the learner runs another asyncppo wire version. Waiting
                    # would hang the run until its timeout; fail now with the reason.
                    raise RuntimeError(
                        f"rollout worker {self.worker_id}: the learner's control messages use another wire schema "
                        "version; run the same asyncppo version on every node"
                    )
                if state is not None and state.stop:
                    break
                if state is not None and state.weights_version > self.version:
                    self._load_weights(receiver, engine)
                    continue
                ticket = admission.acquire(timeout_s=0.2)
                if ticket is None:
                    if admission.stopped:
                        break
                    continue
                tickets = [ticket]
                while len(tickets) < per_call:
                    more = admission.acquire(timeout_s=0.05)
                    if more is None:
                        break
                    tickets.append(more)
                # Weights must be at least as new as every ticket demands before a token is generated.
                needed = max(t.min_version for t in tickets)
                while self.version < needed:
                    # sleeps in poll until the learner announces newer weights (or stops): no spinning
                    state = control.wait_for(lambda s: s.stop or s.weights_version > self.version, 1.0) or state
                    if state is not None and state.stop:
                        return self._finish(engine, sender, control, admission)
                    if state is not None and state.weights_version > self.version:
                        self._load_weights(receiver, engine)
                rows = [next(prompts) for _ in tickets]
                groups = self._generate(engine, rows, tickets, reward_fn)
                for g in groups:
                    while not sender.send(g, timeout_s=1.0):
                        state = control.latest(timeout_ms=0) or state
                        if state is not None and state.stop:
                            return self._finish(engine, sender, control, admission)
                    self.stats["groups_sent"] += 1
        except BaseException:
            self._finish(engine, sender, control, admission)
            raise
        return self._finish(engine, sender, control, admission)

    def _finish(self, engine, sender, control, admission) -> dict:
        for closable in (sender, control, admission, getattr(self, "_group", None), engine):
            if closable is None:
                continue
            try:
                closable.close()
            except Exception:  # closing must not mask the run's outcome
                pass
        return dict(self.stats, worker_id=self.worker_id, version=self.version)

    # ------------------------------------------------------------------------------------------------------------
    def _load_weights(self, receiver, engine) -> None:
        t0 = time.perf_counter()
        ro = self.cfg.rollout
        # Layer group by layer group: memory stays bounded by a bucket, and tied fp32 embeddings are handled.
        version = receive_into_engine(
            receiver, engine, flush_bytes=ro.weight_bucket_mb << 20, model_config=self.model_path, dtype=ro.dtype
        )
        self.version = version
        self.stats["weight_loads"] += 1
        log.info("worker %d loaded weights v%d in %.3fs", self.worker_id, version, time.perf_counter() - t0)

    def _generate(self, engine, rows, tickets, reward_fn) -> list[TrajectoryGroup]:
        ro = self.cfg.rollout
        s = ro.sampling
        t0 = time.perf_counter()
        outputs = engine.generate(
            [row.prompt_ids for row in rows],
            n=ro.num_return_sequences_in_group,
            max_tokens=ro.response_length,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            # vLLM seeds sample j of prompt i with seed + i * n + j: advance past every seed this call uses, and keep
            # workers' sequences apart
            seed=None if s.seed is None else s.seed + 1_000_003 * self.worker_id + self._seq * ro.num_return_sequences_in_group,
        )
        gen_s = time.perf_counter() - t0
        groups = []
        version = self.version
        for row, ticket, completions in zip(rows, tickets, outputs):
            t1 = time.perf_counter()
            samples = []
            for c in completions:
                text = engine.decode(c.token_ids)
                reward, failed, _err = self._score_safely(reward_fn, text, row.answer)
                self.stats["reward_failures"] += int(failed)
                self.stats["gen_tokens"] += len(c.token_ids)
                samples.append(
                    Sample(
                        response_ids=np.asarray(c.token_ids, dtype=np.int32),
                        behavior_logprobs=np.asarray(c.logprobs, dtype=np.float32),
                        reward=float(reward),
                        finish_reason=c.finish_reason,
                        version_min=version,
                        version_max=version,
                        reward_failed=bool(failed),
                    )
                )
            reward_s = time.perf_counter() - t1
            self.stats["samples"] += len(samples)
            groups.append(
                TrajectoryGroup(
                    group_id=f"{self.worker_id}-{self._seq}",
                    worker_id=self.worker_id,
                    prompt_ids=np.asarray(row.prompt_ids, dtype=np.int32),
                    samples=samples,
                    prompt_index=int(row.index),
                    ticket=int(ticket.index),
                    answer=str(row.answer),
                    timings={
                        "gen_s": gen_s / len(rows),
                        "reward_s": reward_s,
                        "busy_s": gen_s / len(rows) + reward_s,
                        "created_at": time.time(),
                    },
                )
            )
            self._seq += 1
        return groups
