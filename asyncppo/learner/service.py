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

import json
import logging
import os
import time
from typing import Optional

import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.learner.task_eval import make_task_evaluator as _make_evaluator  # its old home: tests import it here
from asyncppo.metrics import batch_token_lag_stats, lag_stats
from asyncppo.stream.endpoints import Endpoints
from asyncppo.sync.group import backend_for, find_free_port

log = logging.getLogger("asyncppo.learner")


class LearnerService:
    def __init__(
        self, cfg: AsyncPPOConfig, model_path: str, num_workers: int, output_dir: str, rank: int = 0, world_size: int = 1,
        keys=None,
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
        self.keys = keys  # the run's CURVE keys (stream.security.CurveKeys) from the launcher; made here if needed
        self.addresses = None  # what setup() bound and advertised, and why (launch/addresses.py)

    # ------------------------------------------------------------------------------------------------------------
    def setup(self) -> Endpoints:
        """Bind every socket the workers need and return their addresses (called before any worker starts)."""
        cl = self.cfg.cluster
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
        # cluster.bind_address=auto: loopback on one machine, this node's address when Ray spans several; decided
        # here, in the learner's process on the node Ray placed it on (launch/addresses.py, docs/configuration.md)
        from asyncppo.launch.addresses import discover_learner_addresses

        self.addresses = discover_learner_addresses(cl.bind_address, cl.advertise_address)
        host, public = self.addresses.bind, self.addresses.advertise
        log.info("learner sockets: bind %s, advertise %s (%s)", host, public, self.addresses.reason)
        # Authentication (docs/security.md): CURVE beyond loopback (cluster.auth=auto) or when forced.
        from asyncppo.stream.security import CurveKeys, auth_enabled

        self.keys = (self.keys or CurveKeys.generate()) if auth_enabled(cl.auth, host) else None
        from asyncppo.learner.sockets import LearnerSockets

        self.sockets = LearnerSockets(self.cfg, host, self.keys, self.num_workers, self.version, self._sync_backend(),
                                      closables=self._closables)
        s = self.sockets  # the objects the loop, the shutdown and the embodied learner use, under their old names
        self.receiver, self.control, self.admission, self.admission_server = (
            s.receiver, s.control, s.admission, s.admission_server)
        self.sync_prefix, self.sync_port, self.engine_eval, self.fanout = (
            s.sync_prefix, s.sync_port, s.engine_eval, s.fanout)
        saved = {}
        if self.resume is not None:  # the prompts each worker had trained (data/position.py)
            from asyncppo.learner.checkpoint import load_trainer_state

            saved = load_trainer_state(self.resume.state_file).get("extra", {}).get("data_position", {})
        from asyncppo.learner.membership import WorkerLedger

        self.ledger = WorkerLedger(self.output_dir, saved)  # data positions, restarts (learner/membership.py)
        return self.sockets.endpoints(public)

    def _sync_backend(self) -> str:
        return backend_for(self.cfg.cluster.train_gpus > 0, self.cfg.cluster.rollout_gpus > 0)

    # ------------------------------------------------------------------------------------------------------------
    def group_address(self) -> tuple[str, int]:
        """Where the learner ranks rendezvous (rank 0's node, a free port)."""
        from asyncppo.stream.security import is_loopback

        # rank 0's store listens on the bind address only (learner.distributed.init_learner_group); the followers
        # dial the advertised one (for a wildcard bind, this node's address: launch/addresses.py)
        bind, public = self.addresses.bind, self.addresses.advertise
        return (bind if is_loopback(bind) else public), find_free_port(bind.strip("[]"))

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
            # short: a normal end already waited for every push; a worker that is late must not delay the error
            attempt("finish weight push", lambda: state["sender"].wait(timeout_s=5.0))
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
        from asyncppo.learner.build import build_models
        from asyncppo.learner.checkpoint import check_compatible, restore, save_checkpoint
        from asyncppo.learner.value_head import uses_shared_head
        from asyncppo.learner.dynamic_sampling import GroupFilter
        from asyncppo.learner.ppo import needs_critic
        from asyncppo.staleness import Feeder, StalenessBuffer
        from transformers import AutoTokenizer

        cfg, ro, tr = self.cfg, self.cfg.rollout, self.cfg.trainer
        multi = self.world_size > 1
        torch.manual_seed(tr.seed)
        if multi:
            self._state["multi"] = True
            device = D.init_learner_group(
                self.rank, self.world_size, master_addr, master_port, timeout_s=cfg.cluster.timeout_s,
                bind_host=self.addresses.bind if self.addresses is not None else None,
            )
        else:
            device = torch.device("cuda" if torch.cuda.is_available() and cfg.cluster.train_gpus > 0 else "cpu")
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.resume is None and tr.resume_from and self.rank > 0:  # followers skip setup(): resolve it here
            from asyncppo.learner.checkpoint import resolve_checkpoint

            self.resume = resolve_checkpoint(tr.resume_from)
        if self.resume is not None:
            wanted = "head" if uses_shared_head(cfg) else "model"
            check_compatible(self.resume, self.model_path, needs_critic=needs_critic(cfg), wanted_critic=wanted)
        # the actor resumes from the checkpoint; the reference and a fresh critic body from the model (build.py)
        models = build_models(cfg, self.model_path, self.resume, device, self.rank, self.world_size)
        actor, critic, updater = models.actor, models.critic, models.updater
        if multi and self.rank > 0:  # followers do what rank 0 broadcasts, until it says stop
            from asyncppo.learner.checkpoint import save_sharded, sharded_tmp_dir

            if self.resume is not None:
                restore(self.resume, updater, critic)  # collective with rank 0's restore below
            steps = D.run_follower(updater, on_checkpoint=lambda v: save_sharded(
                sharded_tmp_dir(self.output_dir, v), updater, critic))
            return {"rank": self.rank, "steps": steps}

        # Rank 0 evaluates and saves an unsharded copy when the actor is sharded over several ranks.
        plain_actor = models.unsharded_actor()
        samples_trained = 0
        if self.resume is not None:
            state = restore(self.resume, updater, critic)
            samples_trained = int(state["extra"].get("samples_trained", 0))

        from asyncppo.learner.push import WeightPusher
        from asyncppo.learner.step_metrics import StepMeters, make_logger

        # pushes to every worker's own group (sync/fanout.py) and keeps plain_actor current (learner/push.py)
        pusher = WeightPusher(actor, plain_actor, self.fanout, multi=multi, gather_mode=tr.weight_push_gather,
                              budget_bytes=tr.weight_push_budget_mb << 20)
        actor_state, push, streamed = pusher.actor_state, pusher.push, pusher.streamed
        logger = make_logger(cfg, self.output_dir)
        self._closables.append(logger)
        evaluator = _make_evaluator(cfg, tokenizer)
        summary: dict = {"output_dir": self.output_dir}
        if evaluator is not None:
            summary["eval_before"] = evaluator(plain_actor)
            logger.log(self.version, {f"eval/{k}": v for k, v in summary["eval_before"].items()})

        logger.message(f"waiting for {self.num_workers} rollout worker(s) to join the weight-sync group")
        sender = self.fanout  # pushes to every worker's own group (sync/fanout.py); raises naming who is missing
        sender.start()
        sender.wait_joined(range(self.num_workers), timeout_s=cfg.cluster.timeout_s)
        self._state["sender"] = sender
        al = cfg.algorithm
        self.group_filter = GroupFilter(self.admission, al.dynamic_sampling,
                                        al.dynamic_sampling_max_skip or 4 * ro.rollout_batch_size)
        buffer = StalenessBuffer(
            ro.max_staleness,
            # room for everything admission lets into flight, so the feeder never blocks a worker's send
            capacity_groups=max((ro.max_staleness + 2) * ro.rollout_batch_size, 64),
            on_drop=self._release_dropped,
            on_take=self.group_filter.on_take,  # consumes the ticket, or releases it for a skipped group
            # the batch at version v is the B lowest outstanding tickets: lag <= k without dropping long samples
            order=self.admission,
            response_length=ro.response_length,
        )
        self.validator, rejections = self._door(plain_actor, tokenizer)
        feeder = Feeder(self.receiver, buffer, validator=self.ledger.door(self.validator), summary=rejections)
        self._closables.insert(0, feeder)
        self._feeder = feeder
        start = self.version
        t_train0 = time.perf_counter()  # time/wall_s: the x axis of the run report's wall-time panels
        pushed_version = 0
        logger.message(f"training started at step {start + 1}" + (f" (resumed from {self.resume.path})"
                                                                 if self.resume is not None else ""))

        def checkpoint() -> None:
            if multi:
                actor_state()  # the collective gather into plain_actor
            t0 = time.perf_counter()
            from asyncppo.learner.checkpoint import save_sharded

            def sharded(path: str) -> None:  # every rank writes its own shards (collective)
                D.broadcast_checkpoint(self.version)
                save_sharded(path, updater, critic)

            ckpt = save_checkpoint(self.output_dir, self.version, actor=plain_actor, tokenizer=tokenizer,
                                   updater=updater, critic=critic, keep=tr.keep_checkpoints,
                                   sharded=sharded if multi else None,
                                   extra={"samples_trained": samples_trained,
                                          "data_position": self.ledger.trained.state_dict()})
            logger.message(f"checkpoint {ckpt.path} written in {time.perf_counter() - t0:.2f}s")

        meters = StepMeters(self.num_workers, ro.max_num_seqs, t_train0)  # throughput, util, buffer (step_metrics.py)
        B = ro.rollout_batch_size
        saved_version = start
        try:
            if start > 0:
                # Workers begin at version 0: announce and push the checkpoint's weights, as the loop does after a
                # step. Tickets need version >= start - k, so workers wait for this push; when k >= start they may
                # generate before it, with their engine's weights (the checkpoint's actor, from the launcher)
                # stamped version 0: an older stamp than the truth, which only errs towards the lag guard.
                self.control.publish(version=start, weights_version=start)
                push(start)
                pushed_version = self._state["pushed_version"] = start
            else:
                self.control.publish(version=0, weights_version=0)
            for step in range(start + 1, tr.total_steps + 1):
                t_step = time.perf_counter()
                self.group_filter.start_step()
                groups = self._take_batch(buffer, B)
                t_work = time.perf_counter()
                batch = collate_groups(groups, tokenizer.pad_token_id)
                metrics = updater.step(D.broadcast_batch(batch) if multi else batch)
                metrics.update(lag_stats(self.version, [g.version_min for g in groups]))
                if cfg.algorithm.dynamic_sampling:
                    metrics.update(self.group_filter.metrics())
                metrics.update(batch_token_lag_stats(self.version, batch.token_versions, batch.response_mask))
                metrics.update(meters.engine_totals.add(groups))
                self.version += 1
                last = step == tr.total_steps
                # Nobody generates with the final weights, except an evaluation of data.eval_files.
                if (self.version % ro.sync_every == 0 and not last) or (last and self.engine_eval is not None) or (
                        streamed and not last and sender.behind()):  # a worker that joined after a streamed push
                    sender.wait()
                    self.control.publish(version=self.version, weights_version=self.version)
                    push(self.version)
                    pushed_version = self._state["pushed_version"] = self.version
                if last:
                    self.admission_server.stop()  # no more generation while the run evaluates and saves
                self.admission.set_version(self.version)
                self.control.publish(version=self.version, weights_version=pushed_version)
                meters.record(groups, batch, time.perf_counter() - t_work)
                samples_trained += batch.size
                self.ledger.record_trained(step, groups)
                metrics.update(meters.step_metrics(
                    version=self.version, t_step=t_step, t_work=t_work, groups=groups, batch=batch,
                    samples_trained=samples_trained, buffer_stats=buffer.stats(),
                    stream_rejected=sum(self.receiver.rejected.values()),
                    content_rejected=self.validator.num_rejected, membership=self.ledger.metrics(self.fanout),
                ))
                if tr.eval_every and evaluator is not None and step % tr.eval_every == 0 and step < tr.total_steps:
                    if multi and self.version % ro.sync_every:
                        actor_state()
                    metrics.update({f"eval/{k}": v for k, v in evaluator(plain_actor).items()})
                logger.log(step, metrics)
                if self.engine_eval is not None:
                    self.engine_eval.poll(logger)
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
            if self.engine_eval is not None:
                self.engine_eval.finish(logger, tr.total_steps, cfg.cluster.timeout_s)
                summary["eval_files"] = self.engine_eval.summary()
            final_dir = os.path.join(self.output_dir, "final")
            plain_actor.save_pretrained(final_dir)
            tokenizer.save_pretrained(final_dir)
            summary.update(steps=tr.total_steps, version=self.version, samples_trained=samples_trained,
                           buffer=buffer.stats(), rejected=self.rejections(),
                           rollout=meters.engine_totals.summary())
            with open(os.path.join(self.output_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1, default=str)
            # the sampled group lengths (for `asyncppo advise`) stay in summary.json, out of the log line
            shown = dict(summary, rollout={k: v for k, v in summary["rollout"].items() if k != "group_lengths"})
            logger.message(f"done: {shown}")
            return summary
        finally:
            self._state["pushed_version"] = pushed_version

    def _door(self, actor, tokenizer):
        """The content validator at the learner's door and the one-line-per-interval rejection summary
        (:mod:`asyncppo.stream.validate`): limits from the model's vocabulary and the configured lengths."""
        from asyncppo.stream.validate import ContentLimits, GroupValidator, RejectionSummary

        cl, ro = self.cfg.cluster, self.cfg.rollout
        vocab = int(getattr(getattr(actor, "config", None), "vocab_size", 0) or len(tokenizer))
        limits = ContentLimits(vocab_size=vocab, max_prompt_len=ro.prompt_length, max_response_len=ro.response_length,
                               max_samples=ro.num_return_sequences_in_group, num_workers=self.num_workers,
                               logprob_tolerance=cl.logprob_tolerance)
        validator = GroupValidator(limits, lambda: self.version, ledger=self.admission_server)
        summary = RejectionSummary({"stream": lambda: self.receiver.rejected, "content": lambda: validator.rejected,
                                    "admission": lambda: self.admission_server.rejected}, logger=log)
        return validator, summary

    def rejections(self) -> dict:
        """Every refusal so far, by source and reason (summary.json, metrics)."""
        out = {f"stream/{k}": v for k, v in self.receiver.rejected.items()}
        if getattr(self, "validator", None) is not None:
            out.update({f"content/{k}": v for k, v in self.validator.rejected.items()})
        out.update({f"admission/{k}": v for k, v in self.admission_server.rejected.items()})
        return out

    # ------------------------------------------------------------------------------------------------------------
    # worker restarts (launch/runner.py supervises; learner/membership.py keeps the record; docs/reliability.md)
    def data_position(self, worker_id: int) -> dict:
        """Where worker ``worker_id``'s prompt sequence starts (a resumed run's workers; data/position.py)."""
        return self.ledger.trained.of(worker_id)

    def replace_worker(self, worker_id: int, generation: int) -> dict:
        """The launcher saw worker ``worker_id`` die and starts incarnation ``generation`` (WorkerLedger.replace).
        Called from the launcher's thread while :meth:`run` trains (the actor is threaded; all of it is locked)."""
        return self.ledger.replace(worker_id, generation, self.admission_server, self.fanout,
                                   self.cfg.cluster.timeout_s)

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
            groups += self.group_filter.keep(buffer.take(n - len(groups), self.version, timeout_s=1.0))
            if self._feeder is not None and not self._feeder.alive:
                raise RuntimeError(f"the trajectory feeder stopped: {self._feeder.error!r}")
            if time.monotonic() > deadline:
                missing = buffer.missing(n)
                holders = {w: self.admission_server.held_by(w) for w in range(self.num_workers)}
                late = {w: [t for t in held if t in missing] for w, held in holders.items()}
                late = {w: t for w, t in late.items() if t}
                who = ("; ".join(f"rollout worker {w} holds tickets {t[:8]} and sent nothing for them"
                                 for w, t in sorted(late.items())) or "no worker holds them (no tickets granted?)")
                raise TimeoutError(
                    f"rollout worker(s) {sorted(late) or '?'} late: no trajectories for "
                    f"{self.cfg.cluster.timeout_s:.0f}s at policy version {self.version} ({len(groups)}/{n} groups; "
                    f"waiting for tickets {missing[:8]}): {who} (cluster.timeout_s)"
                )
            if groups:
                deadline = time.monotonic() + self.cfg.cluster.timeout_s
        return groups

