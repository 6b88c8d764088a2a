"""The learner process: owns the stream sink, the admission controller, the models and the weight broadcast.

Loop, once per policy version ``v``:
  take ``rollout_batch_size`` whole groups from the staleness buffer (stale ones are dropped and their tickets reused)
  -> PPO update -> ``v + 1`` -> every ``sync_every`` versions: announce and broadcast the weights (in the background)
  -> tell the admission controller the new version (which releases more tickets) -> log one metrics record
  -> every ``trainer.save_every`` versions (and at the end): a checkpoint (:mod:`asyncppo.learner.checkpoint`).

Resuming (``trainer.resume_from``) continues at the checkpoint's version ``V``: step numbers and policy versions go on
from ``V + 1``, the admission controller counts its tickets from slot ``V * B`` (so the workers are not flooded with
``V * B`` extra tickets), and the weights are announced and pushed once before training, so every worker holds version
``V`` (they start at version 0 whatever weights their engine loaded) before a ticket that needs it is served.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Optional

import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.metrics import BusyMeter, EngineTotals, MetricsLogger, RateMeter, lag_stats, token_lag_stats
from asyncppo.stream.endpoints import Endpoints
from asyncppo.sync.group import backend_for, find_free_port

log = logging.getLogger("asyncppo.learner")


class LearnerService:
    def __init__(
        self, cfg: AsyncPPOConfig, model_path: str, num_workers: int, output_dir: str, rank: int = 0, world_size: int = 1
    ):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.model_path = model_path
        self.num_workers = num_workers
        self.output_dir = output_dir
        self.version = 0
        self._closables: list = []
        self._feeder = None
        self._state: dict = {}  # what _shutdown must release: multi, sender, group, pushed_version
        self.resume = None  # the Checkpoint being resumed from, resolved in setup()

    # ------------------------------------------------------------------------------------------------------------
    def setup(self) -> Endpoints:
        """Bind every socket the workers need and return their addresses (called before any worker starts)."""
        from asyncppo.staleness import AdmissionController, AdmissionServer
        from asyncppo.stream.channels import ControlPublisher, TrajectoryReceiver
        from asyncppo.stream.endpoints import bind_endpoint, connect_endpoint

        cl, ro = self.cfg.cluster, self.cfg.rollout
        if self.cfg.trainer.resume_from:
            from asyncppo.learner.checkpoint import resolve_checkpoint

            self.resume = resolve_checkpoint(self.cfg.trainer.resume_from)
            self.version = self.resume.version
            if self.version >= self.cfg.trainer.total_steps:
                raise ValueError(
                    f"trainer.resume_from: the checkpoint {self.resume.path!r} is at step {self.version}, but "
                    f"trainer.total_steps={self.cfg.trainer.total_steps} (the total, not the steps to add): nothing "
                    "to train"
                )
        host = cl.bind_address
        public = cl.advertise_address or host
        self.receiver = TrajectoryReceiver(
            bind_endpoint(host, cl.trajectory_port), hwm=cl.stream_hwm, max_message_bytes=cl.max_message_mb << 20
        )
        self.control = ControlPublisher(bind_endpoint(host, cl.control_port))
        self.admission = AdmissionController(ro.rollout_batch_size, ro.max_staleness, start_version=self.version)
        self.admission_server = AdmissionServer(self.admission, bind_endpoint(host, cl.admission_port))
        self._closables += [self.receiver, self.control, self.admission_server]
        self.sync_port = cl.sync_port or find_free_port(host)
        return Endpoints(
            trajectory=connect_endpoint(self.receiver.address, public),
            control=connect_endpoint(self.control.address, public),
            admission=connect_endpoint(self.admission_server.address, public),
            sync_host=public,
            sync_port=self.sync_port,
            sync_world_size=1 + self.num_workers,
            sync_backend=self._sync_backend(),
        )

    def _sync_backend(self) -> str:
        return backend_for(self.cfg.cluster.train_gpus > 0, self.cfg.cluster.rollout_gpus > 0)

    # ------------------------------------------------------------------------------------------------------------
    def group_address(self) -> tuple[str, int]:
        """Where the learner ranks rendezvous (rank 0's node, a free port)."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, find_free_port("0.0.0.0")

    def run(self, master_addr: Optional[str] = None, master_port: Optional[int] = None) -> dict:
        """Train; whatever happens, tell the workers to stop and release every socket, group and thread."""
        try:
            return self._run(master_addr, master_port)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Each step on its own: one failing cleanup must not skip the others or mask the run's own error."""

        def attempt(what: str, fn) -> None:
            try:
                fn()
            except Exception as exc:
                log.warning("learner shutdown: %s failed: %r", what, exc)

        state = self._state
        if self.rank == 0 and hasattr(self, "control"):
            attempt("publish stop", lambda: self.control.publish(
                version=self.version, weights_version=state.get("pushed_version", 0), stop=True))
            attempt("stop admission", self.admission_server.stop)
        if "sender" in state:
            attempt("finish weight push", state["sender"].wait)
        if state.get("multi"):
            from asyncppo.learner import distributed as D

            if self.rank == 0:
                attempt("release learner followers", D.broadcast_stop)
            attempt("leave learner group", D.destroy)
        if self.rank == 0 and hasattr(self, "control"):
            # Keep the stop visible a moment (the publisher re-sends it) for workers busy in an engine call.
            time.sleep(1.0)
        if "group" in state:
            attempt("close weight-sync group", state["group"].close)
        for closable in self._closables:
            attempt(f"close {type(closable).__name__}", closable.close)

    def _run(self, master_addr: Optional[str], master_port: Optional[int]) -> dict:
        from asyncppo.learner import distributed as D
        from asyncppo.learner.batch import collate_groups
        from asyncppo.learner.checkpoint import check_compatible, restore, save_checkpoint
        from asyncppo.learner.models import (
            full_state_dict, load_actor, load_critic, load_reference, maybe_shard, torch_dtype,
        )
        from asyncppo.learner.ppo import PPOUpdate, needs_critic, needs_reference
        from asyncppo.staleness import Feeder, StalenessBuffer
        from asyncppo.sync import WeightSender, make_sync_group
        from transformers import AutoTokenizer

        cfg, ro, tr = self.cfg, self.cfg.rollout, self.cfg.trainer
        multi = self.world_size > 1
        torch.manual_seed(tr.seed)
        if multi:
            self._state["multi"] = True
            device = D.init_learner_group(
                self.rank, self.world_size, master_addr, master_port, timeout_s=cfg.cluster.timeout_s
            )
        else:
            device = torch.device("cuda" if torch.cuda.is_available() and cfg.cluster.train_gpus > 0 else "cpu")
        dtype = torch_dtype(cfg.model.dtype) if device.type == "cuda" else torch.float32
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        remote = cfg.model.trust_remote_code
        if self.resume is not None:
            check_compatible(self.resume, self.model_path, needs_critic=needs_critic(cfg))
        # The reference (and a fresh critic body) always come from the configured model; only the actor resumes.
        actor_path = self.resume.actor_dir if self.resume is not None else self.model_path
        actor = maybe_shard(
            load_actor(actor_path, dtype, device, remote, cfg.model.gradient_checkpointing), self.world_size, device
        )
        critic = (
            maybe_shard(load_critic(cfg.model.critic_path or self.model_path, dtype, device, remote),
                        self.world_size, device)
            if needs_critic(cfg)
            else None
        )
        reference = (
            load_reference(cfg.model.ref_path or self.model_path, dtype, device, remote) if needs_reference(cfg) else None
        )
        if multi:
            updater = D.ShardedPPOUpdate(cfg, actor, critic, reference, device, rank=self.rank,
                                         world_size=self.world_size)
            if self.rank > 0:  # followers do what rank 0 broadcasts, until it says stop
                steps = D.run_follower(updater)
                return {"rank": self.rank, "steps": steps}
        else:
            updater = PPOUpdate(cfg, actor, critic, reference, device)

        # Rank 0 evaluates and saves an unsharded copy when the actor is sharded over several ranks.
        plain_actor = load_actor(actor_path, dtype, device, remote) if multi else actor
        samples_trained = 0
        if self.resume is not None:
            state = restore(self.resume, updater, critic)
            samples_trained = int(state["extra"].get("samples_trained", 0))

        def actor_state() -> dict:
            if not multi:
                return full_state_dict(actor)
            D.broadcast_gather(0)
            state = D.gather_full_state_dict(actor, 0)
            plain_actor.load_state_dict(state)
            return state
        logger = MetricsLogger(
            self.output_dir,
            console=tr.logger.console,
            jsonl=tr.logger.jsonl,
            wandb=tr.logger.wandb,
            wandb_mode=tr.logger.wandb_mode,
            wandb_project=tr.logger.wandb_project,
            wandb_run_name=tr.logger.wandb_run_name,
            total_steps=tr.total_steps,
            config=dataclasses.asdict(cfg),
            log_every=tr.logger.log_every,
        )
        self._closables.append(logger)
        evaluator = _make_evaluator(cfg, tokenizer)
        summary: dict = {"output_dir": self.output_dir}
        if evaluator is not None:
            summary["eval_before"] = evaluator(plain_actor)
            logger.log(self.version, {f"eval/{k}": v for k, v in summary["eval_before"].items()})

        logger.message(f"waiting for {self.num_workers} rollout worker(s) to join the weight-sync group")
        group = make_sync_group(
            self.cfg.cluster.bind_address, self.sync_port, rank=0, world_size=1 + self.num_workers,
            backend=self._sync_backend(),
            timeout_s=cfg.cluster.timeout_s,
        )
        self._state["group"] = group
        sender = WeightSender(group, bucket_bytes=ro.weight_bucket_mb << 20)
        self._state["sender"] = sender
        buffer = StalenessBuffer(
            ro.max_staleness,
            # room for everything admission lets into flight, so the feeder never blocks a worker's send
            capacity_groups=max((ro.max_staleness + 2) * ro.rollout_batch_size, 64),
            on_drop=self._release_dropped,
            on_take=lambda g: self.admission.consumed(g.ticket),
            # the batch at version v is the B lowest outstanding tickets: lag <= k without dropping long samples
            order=self.admission,
            response_length=ro.response_length,
        )
        feeder = Feeder(self.receiver, buffer)
        self._closables.insert(0, feeder)
        self._feeder = feeder
        start = self.version
        pushed_version = 0
        logger.message(f"training started at step {start + 1}" + (f" (resumed from {self.resume.path})"
                                                                 if self.resume is not None else ""))

        def checkpoint() -> None:
            if multi:
                actor_state()  # the collective gather into plain_actor
            t0 = time.perf_counter()
            ckpt = save_checkpoint(self.output_dir, self.version, actor=plain_actor, tokenizer=tokenizer,
                                   updater=updater, critic=critic, keep=tr.keep_checkpoints,
                                   extra={"samples_trained": samples_trained})
            logger.message(f"checkpoint {ckpt.path} written in {time.perf_counter() - t0:.2f}s")

        train_tokens, rollout_busy, train_busy = RateMeter(), BusyMeter(), BusyMeter()
        engine_totals = EngineTotals(ro.max_num_seqs)
        B = ro.rollout_batch_size
        saved_version = start
        try:
            if start > 0:
                # Workers begin at version 0: announce and push the checkpoint's weights, as the loop does after a
                # step. Tickets need version >= start - k, so workers wait for this push; when k >= start they may
                # generate before it, with their engine's weights (the checkpoint's actor, from the launcher)
                # stamped version 0: an older stamp than the truth, which only errs towards the lag guard.
                self.control.publish(version=start, weights_version=start)
                sender.push_async(actor_state(), start)
                pushed_version = self._state["pushed_version"] = start
            else:
                self.control.publish(version=0, weights_version=0)
            for step in range(start + 1, tr.total_steps + 1):
                t_step = time.perf_counter()
                groups = self._take_batch(buffer, B)
                t_work = time.perf_counter()
                batch = collate_groups(groups, tokenizer.pad_token_id)
                metrics = updater.step(D.broadcast_batch(batch) if multi else batch)
                metrics.update(lag_stats(self.version, [g.version_min for g in groups]))
                metrics.update(token_lag_stats(self.version, groups))
                metrics.update(engine_totals.add(groups))
                self.version += 1
                last = step == tr.total_steps
                if self.version % ro.sync_every == 0 and not last:  # nobody generates with the final weights
                    sender.wait()
                    self.control.publish(version=self.version, weights_version=self.version)
                    sender.push_async(actor_state(), self.version)
                    pushed_version = self._state["pushed_version"] = self.version
                if last:
                    self.admission_server.stop()  # no more generation while the run evaluates and saves
                self.admission.set_version(self.version)
                self.control.publish(version=self.version, weights_version=pushed_version)
                train_busy.add(time.perf_counter() - t_work)
                n_tokens = int(batch.response_mask.sum())
                gen_seconds = sum(g.timings.get("gen_s", 0.0) for g in groups)
                train_tokens.add(n_tokens)
                rollout_busy.add(sum(g.timings.get("busy_s", 0.0) for g in groups))
                samples_trained += batch.size
                stats = buffer.stats()
                metrics.update(
                    {
                        "policy_version": self.version,
                        # engine throughput while generating these groups (tokens per engine-second)
                        "throughput/gen_tokens_per_s": n_tokens / max(gen_seconds, 1e-9),
                        "throughput/train_tokens_per_s": train_tokens.rate(),
                        "util/rollout_busy": rollout_busy.fraction(self.num_workers),
                        "util/train_busy": train_busy.fraction(),
                        "time/step_s": time.perf_counter() - t_step,
                        "time/wait_s": t_work - t_step,
                        "buffer/size": stats.get("size", 0),
                        "buffer/dropped_stale": stats.get("dropped_stale", 0),
                        "buffer/rejected_ticket": stats.get("rejected_ticket", 0),
                        "staleness/version_spread_max": stats.get("version_spread_max", 0),
                        "waste/tokens_frac": stats.get("dropped_tokens", 0)
                        / max(1, stats.get("dropped_tokens", 0) + engine_totals.trained_tokens),
                        "stream/rejected": sum(self.receiver.rejected.values()),
                        "samples_trained": samples_trained,
                        "reward/failed_frac": sum(s.reward_failed for g in groups for s in g.samples) / batch.size,
                    }
                )
                for meter in (train_tokens, rollout_busy, train_busy):
                    meter.reset()
                if tr.eval_every and evaluator is not None and step % tr.eval_every == 0 and step < tr.total_steps:
                    if multi and self.version % ro.sync_every:
                        actor_state()
                    metrics.update({f"eval/{k}": v for k, v in evaluator(plain_actor).items()})
                logger.log(step, metrics)
                if tr.save_every and step % tr.save_every == 0:
                    checkpoint()
                    saved_version = self.version
            sender.wait()
            if tr.save_every and saved_version != self.version:
                checkpoint()
            if multi:
                actor_state()
            if evaluator is not None:
                summary["eval_after"] = evaluator(plain_actor)
                logger.log(tr.total_steps, {f"eval/{k}": v for k, v in summary["eval_after"].items()})
            final_dir = os.path.join(self.output_dir, "final")
            plain_actor.save_pretrained(final_dir)
            tokenizer.save_pretrained(final_dir)
            summary.update(steps=tr.total_steps, version=self.version, samples_trained=samples_trained,
                           buffer=buffer.stats(), rejected=dict(self.receiver.rejected),
                           rollout=engine_totals.summary())
            with open(os.path.join(self.output_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1, default=str)
            logger.message(f"done: {summary}")
            return summary
        finally:
            self._state["pushed_version"] = pushed_version

    def _release_dropped(self, group) -> None:
        """A group the lag guard dropped gives its ticket back, so the slot is generated again (a group whose
        ticket is no longer outstanding has nothing to give back)."""
        if self.admission.is_outstanding(group.ticket):
            self.admission.release(group.ticket)

    def _take_batch(self, buffer, n: int):
        """Block until ``n`` fresh groups are available; fail loudly if the workers stop producing."""
        deadline = time.monotonic() + self.cfg.cluster.timeout_s
        groups = []
        while len(groups) < n:
            groups += buffer.take(n - len(groups), self.version, timeout_s=1.0)
            if self._feeder is not None and not self._feeder.alive:
                raise RuntimeError(f"the trajectory feeder stopped: {self._feeder.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no trajectories for {self.cfg.cluster.timeout_s:.0f}s at policy version {self.version} "
                    f"({len(groups)}/{n} groups; waiting for tickets {buffer.missing(n)[:8]}): are the rollout "
                    "workers alive? (cluster.timeout_s)"
                )
            if groups:
                deadline = time.monotonic() + self.cfg.cluster.timeout_s
        return groups


def _make_evaluator(cfg: AsyncPPOConfig, tokenizer):
    """Held-out accuracy of the built-in task: sampled at the rollout temperature (4 samples per prompt, so the
    estimate's standard error is about half that of one sample) and greedy."""
    if cfg.data.train_files:
        return None
    from asyncppo.data.tasks import get_task
    from asyncppo.data.warmstart import answer_accuracy

    task = get_task(cfg.data.task, seed=cfg.data.seed, num_eval=cfg.data.num_eval_prompts)
    rows = task.splits().eval
    temperature = cfg.rollout.sampling.temperature
    # the task's longest answer + eos (5 for addition, as always), never more than a rollout may generate
    max_new = min(getattr(task, "max_response_tokens", 5), cfg.rollout.response_length)

    def evaluate(model) -> dict:
        was_training = model.training
        out = {
            "accuracy_sampled": answer_accuracy(model, tokenizer, rows * 4, temperature=temperature,
                                                seed=cfg.trainer.seed, max_new_tokens=max_new),
            "accuracy_greedy": answer_accuracy(model, tokenizer, rows, temperature=0.0, max_new_tokens=max_new),
        }
        model.train(was_training)
        return out

    return evaluate
