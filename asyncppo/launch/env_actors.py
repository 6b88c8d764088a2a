"""Ray actor wrappers for embodied runs: the embodied learner and the env rollout workers.

Like :mod:`asyncppo.launch.actors`, they only rebuild the typed config from a plain dict and forward calls, so the
learner and the worker stay ordinary classes that tests can run without Ray.
"""

from __future__ import annotations

import logging

import ray

from asyncppo.launch.actors import _config, pin_cpus, set_learner_threads
from asyncppo.launch.console import redirect_output


@ray.remote(max_restarts=0)
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


@ray.remote(max_restarts=0)
class EnvRolloutActor:
    def __init__(self, cfg_dict: dict, worker_id: int, num_workers: int, endpoints, model_path: str = ""):
        # torch and gymnasium are imported in the actor's process only, never in the launcher
        import torch  # heavy: torch

        from asyncppo.envs.worker import EnvWorker  # heavy: torch, gymnasium

        redirect_output(cfg_dict["trainer"]["output_dir"], f"worker-{worker_id}")
        logging.basicConfig(level=logging.WARNING)
        pin_cpus("ASYNCPPO_ROLLOUT_CPUS")
        torch.set_num_threads(1)
        cfg = _config(cfg_dict)
        device = "cuda" if cfg.cluster.rollout_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.worker = EnvWorker(cfg, worker_id, num_workers, endpoints, device=device)

    def run(self) -> dict:
        return self.worker.run()
