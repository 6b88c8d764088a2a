"""The rollout worker: keep the engine full, swap weights between decode steps, stream each group when it is done.

One turn of :meth:`RolloutWorker.run`'s loop, top to bottom:

1. **control** - read the learner's newest state; stop if asked.
2. **weights** - if the learner announced newer weights, load them now or mark the engine as *draining*:
   ``rollout.inflight_update=keep`` loads between two decode steps and keeps the sequences in flight (and their
   KV cache, computed under the old weights); ``recompute`` loads, then has the engine re-prefill every running
   sequence under the new weights; ``off`` (and ``generation=batch``) stops admitting and loads once the
   sequences in flight have finished.
3. **admit** - ``generation=continuous``: while the engine has room (``max_num_seqs``) and a ticket is at hand
   whose ``min_version`` our weights satisfy, add the next prompt as a group of ``n`` samples. Room is counted in
   whole groups (``rollout.admission_unit=group``) or in slots (``slot``: a group goes in once one slot is free,
   the engine queues the rest; :func:`admission_room`).
   ``generation=batch``: only when the engine is empty, up to ``prompts_per_call`` groups at once. Tickets are
   requested ahead without waiting (:meth:`AdmissionClient.request`), so a decode step never waits on a round trip.
4. **step** - one engine iteration; every group whose ``n`` samples finished in it is scored and sent at once
   (:mod:`asyncppo.rollout.groups`). With nothing to do, sleep on the admission socket instead of spinning.

Every token carries the version of the weights that produced it (the engine labels steps with
``set_weight_version``), so a sample that lived through a swap records both versions and its lag is exact.
"""

from __future__ import annotations

import logging
import os
import time

from asyncppo.config.choices import admission_room
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.data.datasets import build_prompt_dataset
from asyncppo.data.position import resume_draws
from asyncppo.data.rewards import resolve_reward_fn
from asyncppo.rollout.engine import SamplingSpec, warm_up, warm_up_prompt
from asyncppo.rollout.engines import worker_engine
from asyncppo.rollout.evaluation import build_eval_runner
from asyncppo.rollout.groups import GroupBuilder, InFlight, group_spec
from asyncppo.rollout.meter import EngineMeter, LinkCounters
from asyncppo.rollout.skeleton import WorkerSkeleton
from asyncppo.staleness.order import take_startable
from asyncppo.stream.endpoints import Endpoints
from asyncppo.stream.group_ids import group_key
from asyncppo.stream.evals import EvalSender
from asyncppo.sync.adapter import AdapterMerger
from asyncppo.sync.engine_load import receive_into_engine

log = logging.getLogger("asyncppo.rollout")


class RolloutWorker(WorkerSkeleton):
    role = "rollout worker"

    def __init__(self, cfg: AsyncPPOConfig, worker_id: int, num_workers: int, endpoints: Endpoints | None,
                 model_path: str, incarnation: int = 0, position: dict | None = None):
        """``incarnation``: how many times the launcher restarted this worker (0: the first process); ``position``:
        where its prompt sequence resumes (data/position.py), from the learner's record of what it trained."""
        super().__init__(cfg, worker_id, num_workers, endpoints, incarnation=incarnation)
        self.position = position
        self.model_path = model_path
        self.stats = {"groups_sent": 0, "samples": 0, "reward_failures": 0, "weight_loads": 0, "gen_tokens": 0,
                      "inflight_updates": 0}
        self.meter = EngineMeter()
        self.links = LinkCounters(self)  # the clients' re-created sockets, reported with each group
        self._in_flight: dict[str, InFlight] = {}
        self._draining = False  # weights are waiting for the sequences in flight to finish
        self._step_ended: float | None = None  # when the last decode step ended, while the engine held sequences
        self._announce_seen: dict[int, float] = {}  # weights_version -> when we first saw it announced
        self.evaluator = None  # an EvalRunner when the run has held-out sets (rollout/evaluation.py)
        self._loads_before = 0  # weight loads before the current learner's first push (a restarted learner)

    # ------------------------------------------------------------------------------------------------------------
    def _on_weights_announced(self, state) -> bool:
        self._announce_seen.setdefault(state.weights_version, time.perf_counter())
        if self.evaluator is not None and self.evaluator.active:
            # one evaluation round, one version: the weights load once the round is done (asked again every turn),
            # so a held-out number is never a mix of two policies; training generation goes on meanwhile
            return False
        self._update_weights()
        return False  # the turn goes on: evaluation, admission and a decode step

    def _work(self) -> None:
        if self.evaluator is not None:
            self._evaluate()
        self._admit()
        if self.engine.num_unfinished_seqs():
            self.phase = "generating"
            self._step()
        else:
            self.phase = "waiting"
            self._idle()

    # ------------------------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """The engine, warmed up, and the tokenizer: the slow part of a worker's start (imports, weights, the first
        step's set-up), which needs no learner; a launch builds it while the learner starts (launch/start.py)."""
        if getattr(self, "engine", None) is not None:
            return
        from transformers import AutoTokenizer  # heavy: transformers

        cfg, ro = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        engine = worker_engine(cfg, self.model_path, self.worker_id, **self._engine_opts())
        self._closables.append(engine)
        # LoRA: pushes carry adapters, merged onto this engine's base weights (sync/adapter.py)
        self.merger = (AdapterMerger(engine, self.model_path, cfg.model.lora_alpha / cfg.model.lora_rank)
                       if cfg.model.lora_rank > 0 else None)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=cfg.model.trust_remote_code)
        # before the worker joins the learner: the engine's first-step set-up is start-up, not a training stall
        self.stats["warm_up_s"] = round(warm_up(engine, warm_up_prompt(self.tokenizer, ro.prompt_length)), 3)
        self.stats["engine_build_s"] = round(time.perf_counter() - t0, 3)
        self.engine = engine
        self.model_engine = engine  # what weights load into and evaluation runs on (a subclass may wrap engine)

    def attach(self, endpoints: Endpoints, position=None) -> None:
        super().attach(endpoints)
        self.position = position

    def _open_workload(self) -> None:
        """This worker's prompt sequence, the reward function and (with held-out sets: the task's probe,
        data.eval_files) the evaluation runner and its sender, around the engine :meth:`prepare` built."""
        cfg, ro, tokenizer = self.cfg, self.cfg.rollout, self.tokenizer
        dataset = self._train_dataset(tokenizer).shard(self.worker_id, self.num_workers)
        self._prompts = resume_draws(dataset.iterate(seed=cfg.data.seed + self.worker_id, shuffle=cfg.data.shuffle),
                                     self.position)
        self._dataset = dataset
        self.stats["dataset"] = dataset.stats.as_dict()
        self._announce(len(dataset))
        reward_fn = resolve_reward_fn(ro.reward_fn, task=cfg.data.task if not cfg.data.train_files else None)
        self.builder = GroupBuilder(self.engine, reward_fn, self.worker_id, self.stats)
        self.evaluator = build_eval_runner(cfg, self.worker_id, self.num_workers, tokenizer, self.engine.decode,
                                           reward_fn) if self.endpoints.eval else None
        if self.evaluator is not None:
            self.eval_sender = EvalSender(self.endpoints.eval, curve=self.endpoints.curve)
            self._closables.append(self.eval_sender)

    def _train_dataset(self, tokenizer):
        """The rows this run draws from, before sharding (a subclass may read another row format)."""
        return build_prompt_dataset(self.cfg, self.model_path, split="train", tokenizer=tokenizer)

    def _engine_opts(self) -> dict:
        """Extra backend options (a subclass that needs e.g. vLLM's prefix caching adds them)."""
        return {}

    def _occupied(self) -> int:
        """Sequences holding an engine slot: what admission room counts."""
        return self.engine.num_unfinished_seqs()

    def _holds_sequences(self) -> bool:
        """Whether the engine has sequences to decode (the episode worker's episodes at their environment have
        none): the worker's time until its next step is then loop work, counted in ``rollout/step_gap_s``."""
        return self.engine.num_unfinished_seqs() > 0

    def _stepped(self, before: int) -> tuple[int, float]:
        """(sequences the engine step just taken ran, seconds of it spent waiting rather than stepping): what
        occupancy, the decode-step curve and the engine's unfilled time count. Here those in the engine before the
        step, and no wait; the episode worker asks its episode engine, whose step first takes back (or waits for)
        the episodes their environments answered, and which admits by an expected load, not by what a step
        runs."""
        return before, 0.0

    def _announce(self, num_prompts: int) -> None:
        ro = self.cfg.rollout
        print(f"[asyncppo] rollout worker {self.worker_id}"
              + (f" (incarnation {self.incarnation}, from draw {self.position['next'] if self.position else 0})"
                 if self.incarnation else "")
              + f": pid {os.getpid()}, {num_prompts} prompts, dataset {self.stats['dataset']}, "
              f"generation={ro.generation}, inflight_update={ro.inflight_update}, max_num_seqs={ro.max_num_seqs}, "
              f"admission per {ro.admission_unit}, engine built in {self.stats['engine_build_s']:.1f}s "
              f"(warm-up {self.stats['warm_up_s']:.2f}s)"
              + (f", tensor_parallel_size={ro.tensor_parallel_size}" if ro.tensor_parallel_size > 1 else ""),
              flush=True)

    def _drop_work(self, position) -> None:
        """A restarted learner (rollout/skeleton.py): abort every group in the engine (training and evaluation),
        resume the prompt sequence at the checkpoint's data position, and report evaluations to the new learner."""
        self.engine.abort_all()
        self._in_flight.clear()
        self._draining = False
        self._step_ended = None
        self._announce_seen.clear()
        self.position = position
        self._prompts = resume_draws(self._dataset.iterate(seed=self.cfg.data.seed + self.worker_id,
                                                           shuffle=self.cfg.data.shuffle), position)
        if self.evaluator is not None:
            self.evaluator.restart()
            self._loads_before = self.stats["weight_loads"]
            self._closables.remove(self.eval_sender)
            self.eval_sender.close()
            self.eval_sender = EvalSender(self.endpoints.eval, curve=self.endpoints.curve)
            self._closables.append(self.eval_sender)

    def _before_close(self) -> None:
        if getattr(self, "engine", None) is not None and self._in_flight:
            self.engine.abort_all()

    def _update_weights(self) -> None:
        """Load the announced weights now, or drain first (``inflight_update=off``, ``generation=batch``)."""
        ro = self.cfg.rollout
        busy = self.engine.num_unfinished_seqs() > 0
        if busy and (ro.inflight_update == "off" or ro.generation == "batch"):
            self._draining = True
            return
        t0 = time.perf_counter()
        self.phase = "loading"
        self._step_ended = None  # the load is the advisor's load_s, not the loop's gap
        # Layer group by layer group: memory stays bounded by a bucket, and tied fp32 embeddings are handled.
        # (adapters never touch the embeddings, so a LoRA push needs no tied-embedding alias: model_config None)
        version = receive_into_engine(self.receiver, self.merger or self.model_engine, flush_bytes=ro.weight_bucket_mb << 20,
                                      model_config=None if self.merger else self.model_path, dtype=ro.dtype)
        self.engine.set_weight_version(version)
        if busy:
            if ro.inflight_update == "recompute":
                self.engine.recompute_inflight()
            self.meter.inflight_updates += 1
            self.stats["inflight_updates"] += 1
        now = time.perf_counter()
        self.meter.load_s.append(now - t0)
        seen = [v for v in self._announce_seen if v <= version]
        if seen:
            self.meter.push_s.append(now - min(self._announce_seen[v] for v in seen))
        for v in seen:
            del self._announce_seen[v]
        self.version = version
        self._draining = False
        self._step_ended = time.perf_counter() if self._holds_sequences() else None
        self.stats["weight_loads"] += 1
        self.progress += 1
        self.phase = "waiting"  # until the next turn says what it does
        log.info("worker %d loaded weights v%d in %.3fs (%d sequences in flight)", self.worker_id, version,
                 now - t0, self.engine.num_unfinished_seqs())

    def _admit(self) -> None:
        """Add groups while there is room and a ticket our weights satisfy (module docstring, step 3)."""
        ro = self.cfg.rollout
        n = ro.num_return_sequences_in_group
        if self._draining or self.admission.stopped:
            return
        if ro.generation == "batch":
            if self.engine.num_unfinished_seqs():
                return
            room = ro.prompts_per_call
        else:
            room = admission_room(ro.max_num_seqs - self._occupied(), n, ro.admission_unit)
        want = room - len(self._pending) - self.admission.open_requests
        if self._pending and not self.admission.open_requests and self._waits_for_a_push(self._pending):
            # held tickets that wait for a push not announced yet fill the room (one announced loads in a moment),
            # yet a ticket released meanwhile (a skipped or dropped group) is granted again for the batch being
            # trained and needs weights we hold: keep a request open so it can reach us (with every engine's room
            # held this way it reached nobody: a deadlock). Granted a fresh ticket instead, which waits too, we ask
            # again: a worker waiting for a push may hold more than its room, up to cluster.max_tickets_per_worker
            # and the window (fair tickets split them)
            want = max(want, 1)
        if want > 0:
            self.admission.request(want)
        # Never wait while the engine has work, or (continuous) while a ticket in hand can start now: after a weight
        # load the held tickets are admissible, and waiting for more grants first cost every step of k = 0 the
        # whole 50 ms. An idle engine with nothing to start waits a little for its tickets (a batch engine also
        # waits here for the rest of its batch, below).
        startable = ro.generation == "continuous" and room > 0 and self._has_startable()
        if self.engine.num_unfinished_seqs() or startable:
            self._pending.extend(self.admission.poll_granted(0.0))
        else:
            t0, waits_for = time.perf_counter(), self._waits_for()
            self._pending.extend(self.admission.poll_granted(0.05))
            self._count_idle(waits_for, t0)
        if ro.generation == "batch":
            while len(self._pending) < room and self.admission.open_requests:
                more = self.admission.poll_granted(0.05)
                if not more:
                    break
                self._pending.extend(more)
        for _ in range(room):
            ticket = take_startable(self._pending, self.version)  # lowest index first (staleness/order.py)
            if ticket is None:
                break
            self._add_group(ticket)

    def _has_startable(self) -> bool:
        return any(t.min_version <= self.version for t in self._pending)

    def _add_group(self, ticket) -> None:
        # seq: the draw number in this worker's prompt sequence; it names the group and seeds its sampling, so a
        # replacement or a resumed run that draws it again samples it alike
        self._seq, row = next(self._prompts)
        key = group_key(self.worker_id, self.incarnation, self._seq)
        self._start_group(key, row, group_spec(self.cfg, self.worker_id, self._seq))
        self._in_flight[key] = InFlight(row=row, ticket=ticket, admitted_at=time.time(), version=self.version)

    def _start_group(self, key: str, row, spec: SamplingSpec) -> None:
        """Hand the group to the engine (a subclass may start episodes instead of single turns)."""
        self.engine.add_group(key, row.prompt_ids, spec)

    def _step(self) -> None:
        ro = self.cfg.rollout
        before = self._occupied()
        t0 = time.perf_counter()
        gap_s = 0.0 if self._step_ended is None else t0 - self._step_ended
        finished = self.engine.step()
        step_s = time.perf_counter() - t0
        running, waited_s = self._stepped(before)
        running = min(running, ro.max_num_seqs)
        self.meter.busy_s += step_s
        if running:  # an episode engine that only waited for its environments took no step
            self.meter.steps += 1
            self.meter.running_sum += running
            self.meter.gap_s += gap_s
        if 0 < running < ro.max_num_seqs and ro.generation == "continuous":  # a batch engine is never refilled
            self.meter.unfilled_s[self._waits_for()] += ((step_s - waited_s) * (ro.max_num_seqs - running)
                                                         / ro.max_num_seqs)
        self.progress += 1
        # the next step's gap is counted from here only if the engine still holds sequences (an empty one waits)
        self._step_ended = t0 + step_s if self._holds_sequences() else None
        if not self.engine.num_unfinished_seqs() and self._draining:
            self._update_weights()  # drained: the announced weights can load now
        for done in finished:
            if self.evaluator is not None and self.evaluator.owns(done.key):
                self._report_eval(self.evaluator.finished(done))
                continue
            self._finish_group(done)

    def _finish_group(self, done) -> None:
        self._send(self.builder.build(done, self._in_flight.pop(done.key), self.meter))

    def _evaluate(self) -> None:
        """Start the evaluation a new weight version makes due, and keep its groups flowing into the engine
        (rollout/evaluation.py says when and how much)."""
        loaded = self.stats["weight_loads"] > self._loads_before  # since the (restarted) learner's first push
        self._report_eval(self.evaluator.on_version(self.version, loaded=loaded))
        self.evaluator.admit(self.model_engine)

    def _report_eval(self, report) -> None:
        if report is None:
            return
        phase, self.phase = self.phase, "sending"  # waiting for the learner to take it is not a hang
        deadline, sent = time.monotonic() + self.cfg.cluster.timeout_s, False
        while not sent and time.monotonic() < deadline and self._reconnect_to is None:  # a restarted learner:
            sent = self.eval_sender.send(report, timeout_s=1.0)  # the report goes nowhere, the round is redone
        self.phase = phase
        if not sent and self._reconnect_to is None:
            log.warning("worker %d: the learner did not take the evaluation report of point %d", self.worker_id,
                        report.point)
        self.stats["eval_rounds"] = self.stats.get("eval_rounds", 0) + 1

    def _send(self, group) -> None:
        group.timings.update(self.links.take())
        phase, self.phase = self.phase, "sending"  # the learner not taking a group is not this worker's hang
        if self._send_until_sent(lambda: self.sender.send(group, timeout_s=1.0)):
            self.stats["groups_sent"] += 1
            self.progress += 1
        self.phase = phase

    def _idle(self) -> None:
        """Nothing in the engine: wait for newer weights (a ticket needs them) or for tickets, without spinning
        (the seconds are counted by what was waited for: ``rollout/idle_weights_s``, ``rollout/idle_ticket_s``)."""
        t0, waits_for = time.perf_counter(), self._waits_for()
        if waits_for == "weights":
            needed = min(t.min_version for t in self._pending)
            # briefly: a ticket granted again meanwhile (startable now) is read by the next turn's admission
            self._state = self.control.wait_for(lambda st: st.stop or st.weights_version >= needed, 0.1) \
                or self._state
            self._count_idle(waits_for, t0)
        elif self.admission.stopped:  # the run is ending: only a stop, or final weights to evaluate, can come
            self._state = self.control.wait_for(lambda st: st.stop or st.weights_version > self.version, 1.0) \
                or self._state
        elif not self._pending:
            self._pending.extend(self.admission.poll_granted(0.2))
            self._count_idle(waits_for, t0)

    def _waits_for(self) -> str:
        """What an empty engine, or a running one's free slots, wait for: the weights the next ticket needs, or a
        ticket (the admission window is full, or the run's last slot is granted)."""
        return "weights" if self._pending and not self._has_startable() else "ticket"

    def _count_idle(self, waits_for: str, since: float) -> None:
        self.meter.idle_s[waits_for] += time.perf_counter() - since
