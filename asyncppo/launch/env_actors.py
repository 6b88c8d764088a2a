"""Ray actor wrappers for embodied runs: the embodied learner and the env rollout workers.

Like :mod:`asyncppo.launch.actors`, they only rebuild the typed config from a plain dict and forward calls, so the
learner and the worker stay ordinary classes that tests can run without Ray.
"""

from __future__ import annotations

import logging

import ray

from asyncppo.launch.actors import _config, pin_cpus, set_learner_threads
from asyncppo.launch.console import redirect_output


# Threaded: the launcher calls replace_worker / note_restart while run() trains (launch/membership.py locks).
@ray.remote(max_restarts=0, max_concurrency=4)
class EnvLearnerActor:
    def __init__(self, cfg_dict: dict, model_path: str, num_workers: int, output_dir: str, rank: int = 0,
                 world_size: int = 1, keys=None):
        # the learner stack is imported in the actor's process only, never in the launcher
        from asyncppo.launch.learner_wiring import EmbodiedLearnerProcess  # heavy: torch, gymnasium

        redirect_output(output_dir, "learner")
        logging.basicConfig(level=logging.WARNING)
        pin_cpus("ASYNCPPO_LEARNER_CPUS")
        set_learner_threads(cfg_dict)
        self.service = EmbodiedLearnerProcess(_config(cfg_dict), num_workers, output_dir, keys=keys)

    def setup(self):
        return self.service.setup()

    def addresses(self) -> dict:
        """What setup() bound and advertised, why, and this actor's Ray node (launch/addresses.py)."""
        return self.service.addresses.as_dict()

    def run(self, master_addr=None, master_port=None) -> dict:
        return self.service.run(master_addr, master_port)

    def data_position(self, worker_id: int) -> dict:
        return self.service.data_position(worker_id)

    def replace_worker(self, worker_id: int, incarnation: int, hung: bool = False) -> dict:
        return self.service.replace_worker(worker_id, incarnation, hung)

    def note_restart(self, restarts: int, steps_done: int, lost_before: int, incarnations: dict) -> tuple:
        return self.service.note_restart(restarts, steps_done, lost_before, incarnations)

    def health(self) -> dict:
        return self.service.health()

    def request_stop(self) -> None:
        self.service.request_stop()


# Three threads: run() steps the env; beside it the launcher's control ping (heartbeat, launch/hang.py: a stopped
# process answers nothing, one whose env step never returns answers with a progress counter that stands still) or a
# restarted learner's endpoints (reconnect).
@ray.remote(max_restarts=0, max_concurrency=3)
class EnvRolloutActor:
    def __init__(self, cfg_dict: dict, worker_id: int, num_workers: int, model_path: str = "", incarnation: int = 0):
        # torch and gymnasium are imported in the actor's process only, never in the launcher
        import torch  # heavy: torch

        from asyncppo.envs.worker import EnvWorker  # heavy: torch, gymnasium

        redirect_output(cfg_dict["trainer"]["output_dir"], f"worker-{worker_id}")
        logging.basicConfig(level=logging.WARNING)
        pin_cpus("ASYNCPPO_ROLLOUT_CPUS")
        torch.set_num_threads(1)
        cfg = _config(cfg_dict)
        device = "cuda" if cfg.cluster.rollout_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.worker = EnvWorker(cfg, worker_id, num_workers, None, device=device, incarnation=incarnation)

    def prepare(self) -> None:
        """Nothing slow to build before the learner is up: the env and its small policy start in run()."""

    def run(self, endpoints, position=None) -> dict:
        # position: env workers draw no dataset, so a replacement only needs its incarnation
        self.worker.attach(endpoints)
        return self.worker.run()

    def reconnect(self, endpoints, position=None) -> None:
        """A restarted learner's addresses (rollout/skeleton.py)."""
        self.worker.request_reconnect(endpoints, position)

    def heartbeat(self) -> dict:
        return self.worker.heartbeat()
