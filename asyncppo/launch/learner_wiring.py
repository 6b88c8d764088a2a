"""The learner process as the launcher drives it: its wiring (sockets, addresses, keys, worker membership and
restarts) bound in ``setup()``, then the learner loop (learner/loop.py) run with it.

Why the wiring lives here and not in learner/: where the learner listens, which keys protect its sockets, which
workers belong to the run and how a dead one is replaced are decisions about the roles of a run and the machines they
are on, i.e. launch decisions. The learner only needs the bound objects; it gets them injected, and learner/ imports
nothing from launch/.
"""

from __future__ import annotations

import logging
from typing import Optional

from asyncppo.config.devices import engines_on_gpu, learner_on_gpu, shared_mode
from asyncppo.envs.spaces import describe_env
from asyncppo.launch.addresses import LearnerAddresses, discover_learner_addresses
from asyncppo.launch.learner_sockets import LearnerSockets
from asyncppo.launch.membership import WorkerLedger
from asyncppo.learner.embodied_workload import EmbodiedWorkload
from asyncppo.learner.llm_workload import LLMWorkload
from asyncppo.learner.loop import LearnerLoop
from asyncppo.stream.endpoints import Endpoints
from asyncppo.stream.security import CurveKeys, auth_enabled, is_loopback
from asyncppo.stream.segments import segment_decoder
from asyncppo.sync.group import backend_for, find_free_port

log = logging.getLogger("asyncppo.launch")


class LearnerWiring:
    """Everything rank 0 of the learner binds before any worker starts, and the record of its workers.

    The loop reads ``receiver``, ``control``, ``admission``, ``admission_server``, ``fanout`` and ``engine_eval``
    (:class:`asyncppo.learner.loop.Wiring`); the LLM workload also uses ``ledger`` (membership.py)."""

    def __init__(self, cfg, num_workers: int, output_dir: str, keys: Optional[CurveKeys] = None):
        self.cfg, self.num_workers, self.output_dir = cfg, num_workers, output_dir
        self.keys = keys  # the run's CURVE keys from the launcher; made here if needed
        self.addresses: Optional[LearnerAddresses] = None  # what bind() bound and advertised, and why
        self.sockets: Optional[LearnerSockets] = None
        self.ledger: Optional[WorkerLedger] = None
        self._closables: list = []

    def bind(self, start_version: int, saved_position: dict) -> Endpoints:
        """Bind every socket the workers need and return their addresses. ``start_version`` is the version a resume
        continues from (the admission controller counts its tickets from slot ``start_version * B``, so the workers
        are not flooded with extra tickets); ``saved_position`` the data position it continues from."""
        cl = self.cfg.cluster
        # cluster.bind_address=auto: loopback on one machine, this node's address when Ray spans several; decided
        # here, in the learner's process on the node Ray placed it on (launch/addresses.py, docs/configuration.md)
        self.addresses = discover_learner_addresses(cl.bind_address, cl.advertise_address)
        host, public = self.addresses.bind, self.addresses.advertise
        log.info("learner sockets: bind %s, advertise %s (%s)", host, public, self.addresses.reason)
        # Authentication (docs/security.md): CURVE beyond loopback (cluster.auth=auto) or when forced.
        self.keys = (self.keys or CurveKeys.generate()) if auth_enabled(cl.auth, host) else None
        # --gpus N: engine and learner rank share one device, where NCCL refuses two ranks: host shared memory
        backend = "shm" if shared_mode(self.cfg) else backend_for(learner_on_gpu(self.cfg), engines_on_gpu(self.cfg))
        self.sockets = LearnerSockets(self.cfg, host, self.keys, self.num_workers, start_version, backend,
                                      closables=self._closables)
        self.ledger = WorkerLedger(self.output_dir, saved_position,  # data positions, restarts (membership.py)
                                   keep_groups=self.cfg.trainer.save_trained_groups)
        return self.sockets.endpoints(public)

    # the bound objects, under the names the learner loop reads (learner.loop.Wiring)
    receiver = property(lambda self: self.sockets.receiver)
    control = property(lambda self: self.sockets.control)
    admission = property(lambda self: self.sockets.admission)
    admission_server = property(lambda self: self.sockets.admission_server)
    fanout = property(lambda self: self.sockets.fanout)
    engine_eval = property(lambda self: self.sockets.engine_eval)

    @property
    def bound(self) -> bool:
        return self.sockets is not None

    def group_address(self) -> tuple[str, int]:
        """Where the learner ranks rendezvous (rank 0's node, a free port)."""
        # rank 0's store listens on the bind address only (learner.distributed.init_learner_group); the followers
        # dial the advertised one (for a wildcard bind, this node's address: launch/addresses.py)
        bind, public = self.addresses.bind, self.addresses.advertise
        return (bind if is_loopback(bind) else public), find_free_port(bind.strip("[]"))

    # worker restarts (launch/runner.py supervises; membership.py keeps the record; docs/reliability.md)
    def data_position(self, worker_id: int) -> dict:
        """Where worker ``worker_id``'s prompt sequence starts (a resumed run's workers; data/position.py)."""
        return self.ledger.trained.of(worker_id)

    def replace_worker(self, worker_id: int, incarnation: int, hung: bool = False) -> dict:
        """The launcher saw worker ``worker_id`` die (or killed it as hung) and starts incarnation ``incarnation``
        (WorkerLedger.replace). Called from the launcher's thread while the loop trains (the actor is threaded; all
        of it is locked)."""
        return self.ledger.replace(worker_id, incarnation, self.admission_server, self.fanout,
                                   self.cfg.cluster.timeout_s, hung=hung)

    def close(self) -> None:
        """Release every bound socket, group and thread in binding order, each on its own: one failing close must
        not skip the others."""
        for closable in self._closables:
            try:
                closable.close()
            except Exception as exc:
                log.warning("learner shutdown: close %s failed: %r", type(closable).__name__, exc)


class LearnerProcess:
    """One learner rank: rank 0 binds its wiring in :meth:`setup` (before any worker starts); every rank then runs
    the loop with ``workload`` (ranks > 0 bind nothing and follow rank 0)."""

    def __init__(self, cfg, workload, num_workers: int, output_dir: str, rank: int = 0, world_size: int = 1,
                 keys: Optional[CurveKeys] = None):
        self.cfg, self.workload, self.rank = cfg, workload, rank
        self.wiring = LearnerWiring(cfg, num_workers, output_dir, keys)
        self.loop = LearnerLoop(cfg, workload, num_workers, output_dir, rank, world_size)

    def setup(self) -> Endpoints:
        self.loop.version = start = self.workload.start_version()
        self.loop.run_metrics = {"learner/restarts": 0, "learner/steps_lost": 0}
        return self.wiring.bind(start, self.workload.saved_position())

    def note_restart(self, restarts: int, steps_done: int, lost_before: int, incarnations: dict) -> tuple[int, int]:
        """This learner replaces one that died after ``steps_done`` steps (launch/learner_restart.py): await each
        live worker in the incarnation it runs (its weight-sync group's name), push the checkpoint's weights first
        and report the restart in every metrics record. Returns the version training resumes from and the steps
        lost in the run (``lost_before`` plus those the dead learner trained after its checkpoint)."""
        for worker_id, incarnation in incarnations.items():
            if incarnation:
                self.wiring.fanout.add(int(worker_id), int(incarnation), join=False)
        lost = lost_before + max(0, steps_done - self.loop.version)
        self.loop.push_first = True
        self.loop.run_metrics = {"learner/restarts": restarts, "learner/steps_lost": lost}
        return self.loop.version, lost

    @property
    def addresses(self) -> Optional[LearnerAddresses]:
        return self.wiring.addresses

    def group_address(self) -> tuple[str, int]:
        return self.wiring.group_address()

    def run(self, master_addr: Optional[str] = None, master_port: Optional[int] = None) -> dict:
        wiring = self.wiring if self.wiring.bound else None
        bind_host = self.wiring.addresses.bind if self.wiring.addresses is not None else None
        return self.loop.run(wiring, master_addr, master_port, bind_host)

    def data_position(self, worker_id: int) -> dict:
        return self.wiring.data_position(worker_id)

    def replace_worker(self, worker_id: int, incarnation: int, hung: bool = False) -> dict:
        return self.wiring.replace_worker(worker_id, incarnation, hung)

    def request_stop(self) -> None:
        """Ctrl-C or SIGTERM at the launcher: a checkpoint after the step in hand, then the run ends (learner/loop.py)."""
        self.loop.request_stop()

    def health(self) -> dict:
        """What the launcher's hang watch needs from rank 0 (launch/hang.py): the recent step durations (the auto
        deadlines scale with them) and the workers retired for missing a push deadline."""
        fanout = self.wiring.fanout if self.wiring.bound else None
        return {"step_seconds": list(self.loop.step_seconds), "push_late": list(fanout.hung) if fanout else []}


def llm_learner(cfg, model_path: str, num_workers: int, output_dir: str, rank: int = 0,
                world_size: int = 1) -> LearnerProcess:
    """A learner rank of an LLM run (its held-out sets are evaluated on the rollout engines)."""
    workload = LLMWorkload(cfg, model_path, num_workers, output_dir, rank, world_size)
    return LearnerProcess(cfg, workload, num_workers, output_dir, rank, world_size)


class EmbodiedLearnerProcess(LearnerProcess):
    """The learner of an embodied run: the environment's spaces decide the network and the segment decoder."""

    def __init__(self, cfg, num_workers: int, output_dir: str, keys: Optional[CurveKeys] = None):
        super().__init__(cfg, EmbodiedWorkload(cfg, num_workers, output_dir), num_workers, output_dir, keys=keys)

    def setup(self) -> Endpoints:
        self.workload.start_version()  # refuses a resume before the environment is made
        desc = describe_env(self.cfg.env)
        self.workload.policy_spec = desc.policy_spec(self.cfg)
        endpoints = super().setup()
        self.wiring.receiver.decode = segment_decoder(desc.segment_spec)
        return endpoints
