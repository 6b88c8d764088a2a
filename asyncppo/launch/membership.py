"""The learner's record of its rollout workers: what each one's prompt sequence has trained, and the replacement
of a worker that died (launch/runner.py asks; docs/reliability.md).

Two data positions (``data/position.py``) are kept. ``trained`` is what a checkpoint stores: after a crash, every
group not yet trained is lost and its draw must be drawn again. ``accepted`` also counts groups that passed the
door and wait in the buffer: this learner will still train them, so a replacement of their worker must skip their
draws. Accepting a group and replacing its worker are ordered by one lock, so no group of the dead process passes
the door after its tickets were taken back.
"""

from __future__ import annotations

import json
import logging
import os
import threading

from asyncppo.data.position import DataPosition
from asyncppo.stream.group_file import write_groups

log = logging.getLogger("asyncppo.launch")


class WorkerLedger:
    def __init__(self, output_dir: str, saved_position: dict | None = None, keep_groups: bool = False):
        self.output_dir = output_dir
        self.keep_groups = keep_groups  # trainer.save_trained_groups: the trained groups' frames as well
        self.trained = DataPosition(saved_position)
        self.accepted = DataPosition(saved_position)
        self.restarts: dict[int, int] = {}
        self.tickets_returned = 0
        self.hung = 0  # replacements of a worker that hung rather than died (launch/hang.py)
        self._lock = threading.Lock()

    def door(self, validator) -> "_RecordingDoor":
        """``validator`` (stream/validate.py), recording the draw of every group it accepts."""
        return _RecordingDoor(validator, self.accepted, self._lock)

    def record_trained(self, step: int, groups) -> None:
        """The data position, and one line per step in ``trained_groups.jsonl`` (group ids, tickets, prompts): the
        evidence that no group was trained twice and that a resume trained the sequence of an unbroken run. With
        ``keep_groups`` the groups themselves go to ``trained_groups.bin`` (stream/group_file.py), so the run's own
        batches can be replayed through the learner alone (learner/learner_alone.py: ``trained_batches``)."""
        for g in groups:
            self.trained.record(g.group_id)
        if self.keep_groups:  # before the step's line: a line always has its groups in the file
            write_groups(os.path.join(self.output_dir, "trained_groups.bin"), groups, append=True)
        with open(os.path.join(self.output_dir, "trained_groups.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "groups": [[g.group_id, g.ticket, g.prompt_index] for g in groups]})
                    + "\n")

    def replace(self, worker_id: int, incarnation: int, admission_server, fanout, timeout_s: float,
                hung: bool = False) -> dict:
        """Worker ``worker_id`` died (or hung and was killed: ``hung``); incarnation ``incarnation`` is starting. Its tickets go back to the pool (a group
        of it still on the way is then refused at the door), its weight-sync member is retired and a new one awaited
        (handed the current weights when it joins). Returns where the replacement's prompt sequence resumes."""
        with self._lock:
            returned = admission_server.retire(worker_id, timeout_s=timeout_s)
            position = self.accepted.of(worker_id)
        self.tickets_returned += len(returned)
        fanout.replace(worker_id, incarnation)
        self.restarts[worker_id] = self.restarts.get(worker_id, 0) + 1
        self.hung += bool(hung)
        log.warning("rollout worker %d %s: %d ticket(s) %s returned to the pool; starting incarnation %d at "
                    "draw %d", worker_id, "hung" if hung else "died", len(returned), returned[:8], incarnation, position["next"])
        return position

    def metrics(self, fanout) -> dict[str, int]:
        return {"workers/restarts": sum(self.restarts.values()), "workers/tickets_returned": self.tickets_returned,
                "workers/hung": self.hung,
                "workers/sync_failures": len(fanout.failures)}


class _RecordingDoor:
    def __init__(self, validator, accepted: DataPosition, lock: threading.Lock):
        self.validator, self.accepted, self.lock = validator, accepted, lock

    def check(self, group):
        with self.lock:
            err = self.validator.check(group)
            if err is None:
                self.accepted.record(group.group_id)
            return err

    def __getattr__(self, name):
        return getattr(self.validator, name)
