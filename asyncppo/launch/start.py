"""Start a resolved plan on Ray: the placement group, the learner ranks, the placement record, the rollout workers.

Order: reserve one bundle per role (learner ranks first, then one per rollout engine); start the learner ranks;
rank 0 binds the stream, control and admission sockets and decides where to listen from the node Ray placed it on
(launch/addresses.py); every other bundle's node is checked to reach those addresses (else the launch fails at
once, not after ``cluster.timeout_s``); ``<run_dir>/placement.json`` records it all; then the rollout workers start
with those addresses (their actors were created first and have been building their engines meanwhile). Nothing here
waits for the run: that is launch/supervise.py.

Importing this module imports Ray: launch/runner.py does so only after Ray's loopback setting is in the environment.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.launch.actors import LearnerActor, RolloutActor
from asyncppo.launch.addresses import (
    LearnerAddresses, PlacementRecord, bundle_nodes, check_reachable, same_machine,
)
from asyncppo.launch.env_actors import EnvLearnerActor, EnvRolloutActor
from asyncppo.launch.resolve import LaunchError, LaunchPlan

# Seconds Ray gets to reserve the placement group before the launch is refused.
PLACEMENT_WAIT_S = 60


def alive_node_gpus() -> list[float]:
    """The GPUs of every alive Ray node (for the engine-fits check)."""
    return [n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")]


class RunActors:
    """The actors of one run: started in their placement bundles, tracked so that every one is killed at the end,
    and a rollout worker restartable in its own bundle (launch/supervise.py decides when)."""

    def __init__(self, plan: LaunchPlan, cfg: AsyncPPOConfig):
        self.plan = plan
        self.cfg_dict = dataclasses.asdict(cfg)
        self.cfg_dict["trainer"]["output_dir"] = plan.output_dir
        # embodied run: env workers and the embodied learner (docs/embodied.md)
        self.learner_cls = EnvLearnerActor if plan.embodied else LearnerActor
        self.rollout_cls = EnvRolloutActor if plan.embodied else RolloutActor
        self.actors: list = []  # every actor started, for the final kill
        self.learners: list = []
        self.workers: dict[int, Any] = {}  # worker index -> its current actor
        self.worker_refs: dict = {}  # run() ref of a worker -> its index
        self.pg = None
        self.endpoints = None
        self.worker_hosts: dict[int, str] = {}  # worker index -> its machine's address, when not the learner's
        self.addresses: LearnerAddresses | None = None

    @property
    def learner(self):
        """Learner rank 0: the sockets, admission, the weight push and the record of worker restarts."""
        return self.learners[0]

    def _placed(self, cls, index: int, bundle: dict):
        return cls.options(
            num_cpus=bundle["CPU"] if self.plan.ray_init.get("address") else 0.001,
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                 placement_group_bundle_index=index),
        )

    def reserve(self) -> None:
        """One placement group holding every role's bundle."""
        p = self.plan
        bundles = p.bundles()
        self.pg = placement_group(bundles, strategy="PACK")
        if not self.pg.wait(timeout_seconds=PLACEMENT_WAIT_S):
            raise LaunchError(f"Ray could not reserve {bundles} within {PLACEMENT_WAIT_S} s: not enough free resources")

    def start_learners(self, cfg_dict: dict | None = None) -> None:
        """Start every learner rank (with ``cfg_dict``: a restarted learner's config, launch/learner_restart.py);
        rank 0 binds its sockets and says where it listens."""
        p = self.plan
        self.learners = [
            self._placed(self.learner_cls, *p.learner_slot(r)).remote(
                cfg_dict or self.cfg_dict, p.model_path, p.num_workers, p.output_dir, r, p.num_learners)
            for r in range(p.num_learners)
        ]
        self.actors += self.learners
        self.endpoints = ray.get(self.learner.setup.remote(), timeout=p.timeout_s)
        self.addresses = LearnerAddresses(**ray.get(self.learner.addresses.remote(), timeout=p.timeout_s))
        a = self.addresses
        print(f"[asyncppo] learner sockets: bind {a.bind}, advertise {a.advertise} ({a.reason})", flush=True)

    def record_placement(self) -> None:
        """Write ``placement.json`` and fail now if any role's node cannot reach the learner's sockets."""
        p, e = self.plan, self.endpoints
        nodes = bundle_nodes(self.pg)
        roles = {f"learner-{r}": p.learner_slot(r)[0] for r in range(p.num_learners)}
        roles.update({f"rollout-{i}": p.worker_slot(i)[0] for i in range(p.num_workers)})
        PlacementRecord(
            learner=self.addresses.as_dict(),
            roles={role: dataclasses.asdict(nodes[index]) for role, index in roles.items()},
            endpoints={"trajectory": e.trajectory, "control": e.control, "admission": e.admission, "eval": e.eval,
                       "sync_host": e.sync_host, "sync_port": e.sync_port, "auth": e.curve is not None,
                       "sync_backend": e.sync_backend, "shared_devices": p.shared_devices},
        ).write(p.output_dir)
        # a worker on another machine is named with it in the launcher's lines (hung, died, replaced): across hosts
        # "rollout worker 0 hung" alone does not say which machine to look at
        self.worker_hosts = {i: nodes[p.worker_slot(i)[0]].node_ip for i in range(p.num_workers)
                             if not same_machine(nodes[p.worker_slot(i)[0]].node_ip, self.addresses.node_ip)}
        for role, index in roles.items():  # fail now, not after cluster.timeout_s, if a role cannot reach them
            if role != "learner-0":
                check_reachable(self.addresses, role, nodes[index], p.timeout_s)

    def create_worker(self, i: int, incarnation: int) -> Any:
        """Rollout worker ``i``'s actor in its bundle, its engine building at once (``prepare``): the learner's
        addresses are not needed until :meth:`start_worker`."""
        actor = self._placed(self.rollout_cls, *self.plan.worker_slot(i)).remote(
            self.cfg_dict, i, self.plan.num_workers, self.plan.worker_model_path, incarnation)
        actor.prepare.remote()  # its failure is raised by run(), which the launcher waits on
        self.actors.append(actor)
        self.workers[i] = actor
        return actor

    def start_worker(self, i: int, incarnation: int, position, created: Any = None) -> Any:
        """Start rollout worker ``i`` (incarnation ``incarnation``, resuming its prompt sequence at ``position``) in
        its bundle, or ``created`` (its actor from :meth:`create_worker`); returns the ref of its run()."""
        p = self.plan
        if incarnation:  # a bundle whose node died may have been re-placed elsewhere
            check_reachable(self.addresses, f"rollout-{i}", bundle_nodes(self.pg)[p.worker_slot(i)[0]], p.timeout_s)
        actor = created if created is not None else self.create_worker(i, incarnation)
        ref = actor.run.remote(self.endpoints, position)
        self.worker_refs[ref] = i
        return ref

    def start(self) -> tuple[Any, list]:
        """Everything, in order; returns the learner's run() ref and every ref to wait on (learner's first).

        The rollout actors start before the learner and build their engines while it starts (vLLM's start-up and
        the learner's model load overlap: 11 s of a tiny launch's 36 s on 2 CPU cores, minutes for a large model),
        except where one device holds both (``--gpus N``: the engine's memory is sized beside the learner's)."""
        p = self.plan
        self.reserve()
        early = {} if p.shared_devices else {i: self.create_worker(i, 0) for i in range(p.num_workers)}
        self.start_learners()
        self.record_placement()
        master = ray.get(self.learner.group_address.remote()) if p.num_learners > 1 else (None, None)
        positions = ray.get([self.learner.data_position.remote(i) for i in range(p.num_workers)],
                            timeout=p.timeout_s)
        for i in range(p.num_workers):
            self.start_worker(i, 0, positions[i], created=early.get(i))
        learner_ref = self.learner.run.remote(*master)
        follower_refs = [f.run.remote(*master) for f in self.learners[1:]]
        return learner_ref, [learner_ref, *follower_refs, *self.worker_refs]

    def kill_learners(self) -> None:
        """Kill every learner rank (rank 0 died: the others cannot go on without it)."""
        _kill(self.learners)

    def stop_all(self) -> None:
        """Kill every actor started (an actor already gone is fine)."""
        _kill(self.actors)


def _kill(actors: list) -> None:
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # already gone
            pass
