"""The learner's one training loop, shared by every workload (LLM token groups, embodied segments, and what is next).

Once per policy version ``v``:
  take ``rollout_batch_size`` records (whole groups, or segments) from the staleness buffer (stale ones are dropped
  and their tickets reused) -> the workload's update -> ``v + 1`` -> every ``sync_every`` versions (``auto``: a
  cadence set from the engines' load time, learner/push_cadence.py): announce and push the weights (in the
  background) -> tell the admission controller the new version (which releases more tickets) -> log one metrics
  record, with the held-out evaluations the workers reported since (they evaluate version 0, every
  ``trainer.eval_every`` versions and the final weights on their engines)
  -> every ``trainer.save_every`` versions (and at the end): a checkpoint.

Resuming (``trainer.resume_from``) continues at the checkpoint's version ``V``: step numbers and policy versions go on
from ``V + 1`` and the weights are announced and pushed once before training, so every worker holds version ``V``
(they start at version 0 whatever weights their engine loaded) before a ticket that needs it is served.

Why one loop and a workload: the steps, versions, admission, pushes, checkpoints and evaluation cadence are the same
whatever is trained, and two hand-copied loops drift apart. A workload (:class:`Workload`) knows only how admitted
records become a batch and a batch becomes an update and its metrics. The sockets, addresses, keys and worker
membership are wiring: the launcher binds them and hands them in as a :class:`Wiring` (launch/learner_wiring.py).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Optional, Protocol

import torch

from asyncppo.config.deadlines import push_timeout
from asyncppo.config.devices import learner_on_gpu
from asyncppo.learner.final_model import write_whole
from asyncppo.learner.push_cadence import PushCadence
from asyncppo.learner.run_files import latest_name
from asyncppo.learner.step_metrics import make_logger
from asyncppo.learner.window import buffer_bound, window_hook
from asyncppo.metrics import batch_token_lag_stats, lag_stats, token_lag_stats
from asyncppo.staleness import Feeder, StalenessBuffer

log = logging.getLogger("asyncppo.learner")


class StopRequested(Exception):
    """Raised out of the wait for a batch when the launcher asked the run to stop (:meth:`LearnerLoop.request_stop`)."""


class Wiring(Protocol):
    """The bound sockets the loop talks through (made by the launcher before any worker starts)."""

    receiver: Any  # stream.channels.TrajectoryReceiver: records in
    control: Any  # stream.channels.ControlPublisher: version and stop out
    admission: Any  # staleness.AdmissionController: tickets, the batch order
    admission_server: Any  # staleness.AdmissionServer: hands the tickets out
    fanout: Any  # sync.fanout.WeightFanout: weights out
    engine_eval: Any  # the held-out evaluation on the rollout engines (task probe, eval files), or None

    def close(self) -> None: ...


class Workload(Protocol):
    """What one kind of training adds to the loop. ``records`` are what the staleness buffer hands out."""

    workers_name: str  # how log lines name the producers ("rollout worker", "env worker")
    record_kind: str  # how errors name one record ("trajectory", "segment")
    response_length: int  # the staleness buffer's waste accounting
    pushes_initial_weights: bool  # workers act only after loading version 0 from the learner
    streamed: bool  # pushes keep no snapshot: a worker that joins late is pushed at the next step
    evaluates_on_engines: bool  # held-out sets are evaluated on the workers' engines with the pushed weights

    def start_version(self) -> int: ...  # the version a resume continues from (0: a fresh run)
    def saved_position(self) -> dict: ...  # the data position a resume continues from
    def saved_window(self) -> Optional[dict]: ...  # an auto window's (k, j) when the checkpoint was written
    def resumed_from(self) -> Optional[str]: ...  # the checkpoint a resume continues from
    def build(self, device: torch.device, wiring: Optional[Wiring]) -> None: ...
    def follow(self) -> int: ...  # ranks > 0: do what rank 0 broadcasts; the steps done
    def door(self, current_version: Callable[[], int]) -> tuple[Any, Any]: ...  # (validator, rejection summary)
    def on_take(self, record) -> None: ...
    def start_step(self) -> None: ...
    def keep(self, records: list) -> list: ...
    def late_error(self, buffer, n: int, got: int, version: int) -> Exception: ...
    def begin(self, t_train0: float) -> None: ...
    def update(self, records: list, version: int) -> tuple[dict, Any]: ...  # (metrics, batch)
    def push(self, version: int) -> None: ...
    def step_metrics(self, step: int, version: int, records: list, batch, t_step: float, t_work: float,
                     buffer_stats: dict) -> dict: ...
    def refresh_weights(self) -> None: ...  # make the saved copy current (collective when sharded)
    def checkpoint(self, version: int, logger, window: Optional[dict] = None) -> None: ...
    def save_final(self, final_dir: str, version: int) -> None: ...
    def summary(self, buffer_stats: dict) -> dict: ...
    def run_info(self) -> dict: ...  # what summary.json names first, besides the output directory


class LearnerLoop:
    """One learner rank. Rank 0 trains; ranks > 0 (a sharded actor) follow rank 0's broadcasts."""

    def __init__(self, cfg, workload: Workload, num_workers: int, output_dir: str, rank: int = 0,
                 world_size: int = 1):
        self.cfg, self.workload, self.num_workers, self.output_dir = cfg, workload, num_workers, output_dir
        self.rank, self.world_size = rank, world_size
        self.version = 0  # the policy version: the learner's step counter (a resume sets it first)
        self.pushed_version = 0  # the newest version announced as weights (the stop message repeats it)
        self.pushes_coalesced = 0  # due pushes skipped under rollout.coalesce_pushes (_may_coalesce)
        self._push_owed = False  # a push was skipped: the next step pushes, whatever the sync_every cadence
        self._cadence = PushCadence() if cfg.rollout.sync_auto else None  # rollout.sync_every=auto
        self._feeder: Optional[Feeder] = None
        self._logger = None
        self._joined = False  # the weight push may still be running: the shutdown waits for it
        self._in_group = False  # this rank joined the learner group: the shutdown leaves it
        self._engine_eval = None  # the held-out evaluation on the rollout engines, when the workload has one
        self._window = None  # rollout.max_staleness=auto: the window tuner's hook (learner/window.py)
        # set by the launcher when it restarted a dead learner (launch/learner_restart.py): the live workers hold
        # the dead learner's newer weights, so the checkpoint's are pushed before any ticket; the restart count and
        # the steps it lost go into every metrics record
        self.push_first = False
        self.run_metrics: dict = {}
        self.checkpoint_failures = 0  # checkpoints that could not be written (_checkpoint)
        self.written_version: Optional[int] = None  # the newest version this learner wrote a checkpoint of
        # set by the launcher on Ctrl-C or SIGTERM (request_stop): checkpoint after the step in hand, then stop
        self.stop_requested = threading.Event()
        # recent step durations: the auto push and hang deadlines scale with them (config/deadlines.py)
        self.step_seconds: collections.deque = collections.deque(maxlen=50)

    def run(self, wiring: Optional[Wiring], master_addr: Optional[str] = None, master_port: Optional[int] = None,
            bind_host: Optional[str] = None) -> dict:
        """Train; whatever happens, tell the workers to stop and release every socket, group and thread.
        ``wiring`` is None on ranks > 0, which bind nothing."""
        try:
            return self._run(wiring, master_addr, master_port, bind_host)
        finally:
            self._shutdown(wiring)

    # ------------------------------------------------------------------------------------------------------------
    def _run(self, wiring, master_addr, master_port, bind_host) -> dict:
        cfg, tr, work = self.cfg, self.cfg.trainer, self.workload
        torch.manual_seed(tr.seed)
        work.build(self._device(master_addr, master_port, bind_host), wiring)
        if self.rank > 0:
            return {"rank": self.rank, "steps": work.follow()}
        logger = self._logger = make_logger(cfg, self.output_dir)
        self._engine_eval = wiring.engine_eval if work.evaluates_on_engines else None
        summary: dict = {"output_dir": self.output_dir, **work.run_info()}
        logger.message(f"waiting for {self.num_workers} {work.workers_name}(s) to join the weight-sync group")
        self._join_workers(wiring)
        buffer = self._open_buffer(wiring)
        self._window = window_hook(cfg, wiring.admission, logger.message, self.num_workers, self.world_size)
        if self._window is not None:
            self._window.restore(work.saved_window())  # a resumed run goes on at the window it had, not the start
        start = saved_version = self.version
        self.written_version = start  # the checkpoint resumed from (nothing to write at version 0)
        t_train0 = time.perf_counter()  # time/wall_s: the x axis of the run report's wall-time panels
        work.begin(t_train0)
        resumed = f" (resumed from {work.resumed_from()})" if work.resumed_from() else ""
        logger.message(f"training started at step {start + 1}{resumed}" if start < tr.total_steps else
                       f"no step left to train{resumed}: finishing the run (final evaluation and model)")
        self._announce_start(wiring, start)
        for step in range(start + 1, tr.total_steps + 1):
            t_step = time.monotonic()
            try:
                if self.stop_requested.is_set():
                    raise StopRequested
                metrics = self._train_step(step, wiring, buffer)
            except StopRequested:
                return self._stop_early(summary)
            self.step_seconds.append(time.monotonic() - t_step)
            logger.log(step, metrics)
            if self._engine_eval is not None:
                self._engine_eval.poll(logger, version=self.version)
            if tr.save_every and step % tr.save_every == 0:
                self._checkpoint()
                saved_version = self.version  # tried: a failed save is told once, not retried at the end
        return self._finish(wiring, buffer, summary, saved_version)

    def _device(self, master_addr, master_port, bind_host) -> torch.device:
        """This rank's device; with several ranks, after joining the learner group (learner/distributed.py)."""
        cl = self.cfg.cluster
        if self.world_size > 1:
            from asyncppo.learner import distributed as D  # heavy: the LLM PPO update, only with several ranks

            self._in_group = True  # set first: a half-made group is still left at shutdown
            return D.init_learner_group(self.rank, self.world_size, master_addr, master_port,
                                        timeout_s=cl.timeout_s, bind_host=bind_host)
        return torch.device("cuda" if torch.cuda.is_available() and learner_on_gpu(self.cfg) else "cpu")

    def _join_workers(self, wiring) -> None:
        """Wait until every worker joined its weight-sync group; the deadline counts from here, not from start-up."""
        sender = wiring.fanout
        sender.start()
        self._joined = True
        sender.wait_joined(range(self.num_workers), timeout_s=self.cfg.cluster.timeout_s)

    def _open_buffer(self, wiring) -> StalenessBuffer:
        """The ticket-ordered staleness buffer and the feeder thread that fills it through the workload's door."""
        ro, work = self.cfg.rollout, self.workload
        k = buffer_bound(self.cfg)  # the cap under an auto window: each ticket's own k is the guard (window.py)
        buffer = StalenessBuffer(
            k,
            # room for everything admission lets into flight, so the feeder never blocks a worker's send
            capacity_groups=max((k + 2) * ro.rollout_batch_size, 64),
            on_drop=lambda record: self._release_dropped(wiring, record),
            on_take=work.on_take,  # consumes the ticket (or, for a skipped group, releases it)
            # the batch at version v is the B lowest outstanding tickets: lag <= k without dropping long samples
            order=wiring.admission,
            response_length=work.response_length,
        )
        door, rejections = work.door(lambda: self.version)
        self._feeder = Feeder(wiring.receiver, buffer, validator=door, summary=rejections)
        return buffer

    def _announce_start(self, wiring, start: int) -> None:
        """Tell the workers the starting version. A resumed run pushes the checkpoint's weights first (workers begin
        at version 0; tickets need version >= start - j, j the admission lookahead, so they wait for this push; when
        j >= start they may generate before it with their engine's weights stamped 0, an older stamp than the truth,
        which only errs towards the lag guard). A workload whose workers start with no weights pushes version 0 too."""
        wiring.control.publish(version=start, weights_version=start)
        if start > 0 or self.workload.pushes_initial_weights or self.push_first:
            self.workload.push(start)
            self.pushed_version = start

    def _train_step(self, step: int, wiring, buffer) -> dict:
        """Take a batch, update, advance the version, push when due, release the next tickets; the step's metrics."""
        work, n = self.workload, self.cfg.rollout.rollout_batch_size
        t_step = time.perf_counter()
        work.start_step()
        records = self._take(buffer, n, wiring)
        t_work = time.perf_counter()
        metrics, batch = work.update(records, self.version)
        metrics.update(lag_stats(self.version, [m for r in records for m in r.sample_version_mins()]))  # per sample
        metrics.update(token_lag_stats(self.version, records) if batch is None  # per-token lag from the batch
                       else batch_token_lag_stats(self.version, batch.token_versions, batch.response_mask))
        self.version += 1
        last = step == self.cfg.trainer.total_steps
        due = self._push_due(wiring, last)
        if due and self._may_coalesce(wiring, last):
            self.pushes_coalesced += 1
            self._push_owed = True
        elif due:
            self._push_owed = False
            self._finish_push(wiring)
            wiring.control.publish(version=self.version, weights_version=self.version)
            work.push(self.version)
            self.pushed_version = self.version
        if last:
            wiring.admission_server.stop()  # no more generation while the run evaluates and saves
        wiring.admission.set_version(self.version)
        wiring.control.publish(version=self.version, weights_version=self.pushed_version)
        metrics.update(work.step_metrics(step, self.version, records, batch, t_step, t_work, buffer.stats()))
        metrics.update(self.run_metrics)
        if self._cadence is not None:
            self._cadence.observe(metrics)
            metrics["sync/every"] = self._cadence.last  # the cadence this step's push decision used
            metrics["sync/weights_version"] = self.pushed_version  # the newest weights sent to the engines
        if self._window is not None:
            self._window.after_step(metrics, records)
        if self.cfg.rollout.coalesce_pushes:
            metrics["sync/pushes_coalesced"] = self.pushes_coalesced
        return metrics

    def push_deadline(self) -> float:
        """Seconds a worker gets to take a push (``cluster.push_timeout_s``, auto: config/deadlines.py)."""
        cl = self.cfg.cluster
        return push_timeout(cl.push_timeout_s, cl.hang_timeout_s, list(self.step_seconds), cl.timeout_s)

    def _finish_push(self, wiring) -> None:
        """Wait for the previous push; a worker that does not take it within the push deadline is retired from
        the weight sync (the launcher replaces it as hung, launch/hang.py) instead of holding up the others."""
        wiring.fanout.retire_late(self.push_deadline())

    def _push_due(self, wiring, last: bool) -> bool:
        """Every ``sync_every`` versions; at the end only for an evaluation on the engines (nobody else generates
        with the final weights); and after a streamed push that a late-joining worker missed."""
        by_cadence = self._cadence_due()  # also at the last step: its record says the cadence in force then
        if last:
            return self._engine_eval is not None
        return (by_cadence or self._push_owed
                or (self.workload.streamed and wiring.fanout.behind()))

    def _cadence_due(self) -> bool:
        """A push by the cadence: every ``sync_every`` versions, or under ``auto`` once the steps since the last push
        reach the cadence the engines' loads ask for (learner/push_cadence.py), said on the console when it moves."""
        if self._cadence is None:
            return self.version % self.cfg.rollout.sync_every == 0
        every = self._cadence.every(self._lookahead())
        line = self._cadence.used(every)
        if line and self._logger is not None:
            self._logger.message(line)
        return self.version - self.pushed_version >= every

    def _lookahead(self) -> int:
        """The smallest admission lookahead a ticket still outstanding may carry: ``admission_lookahead``
        (``max_staleness`` unless set), or under an auto window the smallest ever in force (outstanding tickets keep
        the ``j`` of their grant)."""
        ro = self.cfg.rollout
        lookahead = ro.max_staleness if ro.admission_lookahead is None else ro.admission_lookahead
        return lookahead if self._window is None else self._window.j_min

    def _may_coalesce(self, wiring, last: bool) -> bool:
        """``rollout.coalesce_pushes``: skip a due push while the previous one is still being taken (the engines are
        slower to load than the learner is to step), but only while the weights already pushed serve every ticket
        of the next batch: that batch (version ``v``) holds tickets of ``min_version = v - j`` (``j`` the admission
        lookahead, ``max_staleness`` unless set), so a skip needs ``pushed_version >= v - j`` (never under ``j=0``);
        under an auto window ``j`` is the smallest ever in force (outstanding tickets keep the ``j`` of their grant).
        Otherwise, and at the last step, the push waits for the previous one as usual (its deadline retires a late
        worker)."""
        return (self.cfg.rollout.coalesce_pushes and not last
                and self.pushed_version >= self.version - self._lookahead() and wiring.fanout.pushing())

    def _take(self, buffer, n: int, wiring=None) -> list:
        """Block until ``n`` fresh records are in; fail loudly if the workers stop producing. Meanwhile a worker
        that has not taken a push within the push deadline is retired (``WeightFanout.retire_overdue``): the batch
        may be waiting for that very worker's groups."""
        timeout_s = self.cfg.cluster.timeout_s
        deadline = time.monotonic() + timeout_s
        records: list = []
        while len(records) < n:
            if wiring is not None:
                wiring.fanout.retire_overdue(self.push_deadline())
            if not records and self.stop_requested.is_set():
                raise StopRequested  # nothing of the next batch taken yet: stop here (taken records are trained)
            taken = buffer.take(n - len(records), self.version, timeout_s=1.0)
            records += self.workload.keep(taken)
            if self._feeder is not None and not self._feeder.alive:
                raise RuntimeError(f"the {self.workload.record_kind} feeder stopped: {self._feeder.error!r}")
            if time.monotonic() > deadline:
                raise self.workload.late_error(buffer, n, len(records), self.version)
            if taken:  # progress, skipped groups included: the deadline counts from the last group taken (it was
                deadline = time.monotonic() + timeout_s  # pushed on at every pass once a batch was partly in)
        return records

    def request_stop(self) -> None:
        """Ctrl-C or SIGTERM at the launcher (a scheduler's preemption): finish the step in hand, write a checkpoint
        and end the run without its final evaluation and model (:meth:`_stop_early`). Called from another thread."""
        self.stop_requested.set()

    def _stop_early(self, summary: dict) -> dict:
        """End a run the launcher asked to stop: a checkpoint of the steps trained since the last one written
        (under ``trainer.save_every > 0``; a periodic save that failed is tried again here), so that
        ``trainer.resume_from`` continues with no step lost; ``summary.json`` says where it stopped and which
        checkpoint is the latest. No final evaluation and no ``final/``: the run is not done."""
        tr, logger = self.cfg.trainer, self._logger
        save = bool(tr.save_every) and self.written_version != self.version
        logger.message(f"stop requested at step {self.version}: " + (
            "writing a checkpoint, then stopping" if save else "stopping (its checkpoint is written)"
            if tr.save_every else "stopping (trainer.save_every=0: no checkpoint)"))
        if save:
            self._checkpoint(stopping=True)
        summary.update(stopped_at=self.version, steps=self.version, version=self.version,
                       checkpoint=latest_name(self.output_dir), checkpoint_failures=self.checkpoint_failures)
        self._write_summary(summary)
        logger.message(f"stopped at step {self.version}; latest checkpoint: {summary['checkpoint'] or 'none'}")
        return summary

    def _checkpoint(self, stopping: bool = False) -> None:
        """Save a checkpoint. One that cannot be written (a full disk, ...) costs that
        checkpoint, not the run: the error is told with the newest checkpoint still there and counted
        (``checkpoint/failures`` in every record after it), and training goes on; the next save tries again. A run
        that stopped at a full disk would lose every step since its last checkpoint and, restarted, stop again."""
        from asyncppo.learner.checkpoint import CheckpointWriteError  # heavy: torch's checkpointing

        try:
            self.workload.checkpoint(self.version, self._logger,
                                     window=self._window.state() if self._window is not None else None)
            self.written_version = self.version
        except CheckpointWriteError as exc:
            self.checkpoint_failures += 1
            self.run_metrics["checkpoint/failures"] = self.checkpoint_failures
            tr = self.cfg.trainer
            then = ("the run stops without it" if stopping else
                    f"training goes on and tries again at step {min(self.version + tr.save_every, tr.total_steps)}"
                    if self.version < tr.total_steps else "this was the run's last checkpoint")
            latest = latest_name(self.output_dir)
            self._logger.message(f"WARNING: {exc}. " + (f"The newest checkpoint is still {latest}" if latest else
                                                        "There is no checkpoint yet") + f"; {then} "
                                 f"({self.checkpoint_failures} checkpoint(s) not written in this run)")

    @staticmethod
    def _release_dropped(wiring, record) -> None:
        """A record the lag guard dropped gives its ticket back, so the slot is generated again (a record whose
        ticket is no longer outstanding has nothing to give back)."""
        if wiring.admission.is_outstanding(record.ticket):
            wiring.admission.release(record.ticket)

    def _finish(self, wiring, buffer, summary: dict, saved_version: int) -> dict:
        """The last checkpoint, evaluations and the final weights; ``summary.json``."""
        tr, work, logger = self.cfg.trainer, self.workload, self._logger
        wiring.admission_server.stop()  # done by the last step already, but not when none was left to train
        self._finish_push(wiring)
        if tr.save_every and saved_version != self.version:
            self._checkpoint()
        work.refresh_weights()
        if self._engine_eval is not None:  # the engines evaluate the final weights pushed by the last step
            self._engine_eval.finish(logger, tr.total_steps, self.cfg.cluster.timeout_s)
            summary.update(self._engine_eval.task_before_after(tr.eval_at_start))
            summary["eval_files"] = self._engine_eval.summary()
        write_whole(os.path.join(self.output_dir, "final"), lambda path: work.save_final(path, self.version))
        summary.update(steps=tr.total_steps, version=self.version, checkpoint_failures=self.checkpoint_failures)
        summary.update(work.summary(buffer.stats()))
        summary.update(self._window.summary() if self._window is not None else {})
        if self._cadence is not None:  # rollout.sync_every=auto: the fewest and most steps between pushes it used
            summary["sync_every_range"] = self._cadence.range
        self._write_summary(summary)
        # the sampled group lengths (for `asyncppo advise`) stay in summary.json, out of the log line
        shown = dict(summary)
        if isinstance(shown.get("rollout"), dict):
            shown["rollout"] = {k: v for k, v in shown["rollout"].items() if k != "group_lengths"}
        logger.message(f"done: {shown}")
        return summary

    def _write_summary(self, summary: dict) -> None:
        with open(os.path.join(self.output_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, default=str)

    # ------------------------------------------------------------------------------------------------------------
    def _shutdown(self, wiring: Optional[Wiring]) -> None:
        """Each step on its own: one failing cleanup must not skip the others or mask the run's own error."""

        def attempt(what: str, fn) -> None:
            try:
                fn()
            except Exception as exc:
                log.warning("learner shutdown: %s failed: %r", what, exc)

        if self.rank == 0 and wiring is not None:
            attempt("publish stop", lambda: wiring.control.publish(
                version=self.version, weights_version=self.pushed_version, stop=True))
            attempt("stop admission", wiring.admission_server.stop)
        if self._joined:
            # short: a normal end already waited for every push; a worker that is late must not delay the error
            attempt("finish weight push", lambda: wiring.fanout.wait(timeout_s=5.0))
        if self._in_group:
            from asyncppo.learner import distributed as D  # heavy: the LLM PPO update, only with several ranks

            if self.rank == 0:
                attempt("release learner followers", D.broadcast_stop)
            attempt("leave learner group", D.destroy)
        if self.rank == 0 and wiring is not None:
            time.sleep(1.0)  # keep the stop visible a moment (it is re-sent) for workers busy in an engine call
        if self._window is not None:
            attempt("stop the window tuner's process", self._window.close)
        if self._feeder is not None:
            attempt("close Feeder", self._feeder.close)
        if wiring is not None:
            attempt("close the learner's sockets", wiring.close)
        if self._logger is not None:
            attempt("close MetricsLogger", self._logger.close)

