"""Everything the learner binds before any worker starts, and the addresses the workers get for it.

Why a module of its own: which sockets exist, on which ports, with which limits and keys is one decision (it is
what the launcher hands every worker as :class:`~asyncppo.stream.endpoints.Endpoints`); the learner process around
it only needs the bound objects. Binding order is also the closing order.
"""

from __future__ import annotations

import secrets

from asyncppo.config.validate_window import widest_lookahead
from asyncppo.data.heldout import has_eval_sets
from asyncppo.learner.evaluation import EngineEvaluation
from asyncppo.rollout.evaluation import eval_points
from asyncppo.staleness import AdmissionController, AdmissionServer
from asyncppo.staleness.fairness import auto_ticket_cap
from asyncppo.stream.channels import ControlPublisher, TrajectoryReceiver
from asyncppo.stream.endpoints import Endpoints, bind_endpoint, connect_endpoint
from asyncppo.sync.fanout import WeightFanout
from asyncppo.sync.group import find_free_port


class LearnerSockets:
    """Bind the trajectory receiver, the control publisher, the admission server (with its controller), the
    optional engine-evaluation socket and the per-worker weight-sync fan-out on ``host``.

    ``curve`` is the run's CURVE keys or ``None`` (docs/security.md); ``start_version`` is the version training
    resumes from (the admission controller counts its tickets from slot ``start_version * B``). Each bound object
    is appended to ``closables`` (the owner's list) as soon as it exists, so a failure half-way still releases
    what was bound.
    """

    def __init__(self, cfg, host: str, curve, num_workers: int, start_version: int, sync_backend: str,
                 closables: list):
        cl, ro = cfg.cluster, cfg.rollout
        self.cfg, self.curve, self.num_workers, self.sync_backend = cfg, curve, num_workers, sync_backend
        self.receiver = TrajectoryReceiver(
            bind_endpoint(host, cl.trajectory_port), hwm=cl.stream_hwm, max_message_bytes=cl.max_message_mb << 20,
            curve=curve,
        )
        self.control = ControlPublisher(bind_endpoint(host, cl.control_port), curve=curve)
        self.admission = AdmissionController(ro.rollout_batch_size, ro.max_staleness, start_version=start_version,
                                             lookahead=ro.admission_lookahead,  # None: = max_staleness
                                             total_slots=max(cfg.trainer.total_steps, start_version)
                                             * ro.rollout_batch_size)  # nothing past the last step
        cap = cl.max_tickets_per_worker or auto_ticket_cap(
            ro.max_num_seqs, ro.num_return_sequences_in_group, ro.prompts_per_call,
            # the window (j + 1) * B; an auto lookahead may widen it during the run: sized by the widest it may reach
            window=(widest_lookahead(ro) + 1) * ro.rollout_batch_size,
            episodes=bool(cfg.env.text_env))
        self.admission_server = AdmissionServer(
            self.admission, bind_endpoint(host, cl.admission_port), curve=curve,
            max_tickets_per_peer=cap, fair_tickets=cl.fair_tickets,
            expected_workers=num_workers,
        )
        self.sync_prefix = secrets.token_hex(16)
        closables += [self.receiver, self.control, self.admission_server]
        self.engine_eval = None  # held-out evaluation on the rollout engines (learner/evaluation.py)
        if has_eval_sets(cfg):
            tr = cfg.trainer  # the learner takes reports of the points the workers evaluate, and no others
            self.engine_eval = EngineEvaluation(bind_endpoint(host, 0), num_workers, curve=curve,
                                                points=eval_points(tr.eval_every, tr.total_steps, tr.eval_at_start))
            closables.append(self.engine_eval)
        self.sync_port = cl.sync_port or find_free_port(host)
        # one two-rank weight-sync group per worker, so a dead worker breaks nobody (sync/fanout.py)
        self.fanout = WeightFanout(host, self.sync_port, self.sync_prefix, backend=sync_backend,
                                   timeout_s=cl.timeout_s, bucket_bytes=ro.weight_bucket_mb << 20)
        for w in range(num_workers):
            self.fanout.add(w, 0, join=False)  # the wait (and its deadline) starts in the learner's run
        closables.append(self.fanout)

    def endpoints(self, public: str) -> Endpoints:
        """The addresses the workers dial: the bound ports on the advertised host ``public``."""
        return Endpoints(
            trajectory=connect_endpoint(self.receiver.address, public),
            control=connect_endpoint(self.control.address, public),
            admission=connect_endpoint(self.admission_server.address, public),
            sync_host=public,
            sync_port=self.sync_port,
            sync_world_size=1 + self.num_workers,
            sync_backend=self.sync_backend,
            curve=self.curve.for_workers() if self.curve is not None else None,
            max_message_bytes=self.cfg.cluster.max_message_mb << 20,
            sync_prefix=self.sync_prefix,
            eval=connect_endpoint(self.engine_eval.address, public) if self.engine_eval is not None else "",
            sync_per_worker=True,
        )
