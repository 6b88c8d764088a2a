"""Ray actor wrappers around the learner process (launch/learner_wiring.py) and the rollout worker.

They only rebuild the typed config from a plain dict (Ray ships plain data) and forward calls, so the learner and the
worker stay ordinary classes that tests can also run without Ray.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray
from omegaconf import OmegaConf

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.launch.console import redirect_output


def parse_cpu_list(spec: str, name: str = "cpu list") -> set[int]:
    """CPU ids from a taskset-style list: ids and inclusive ranges, comma-separated (``"0-7,9"``)."""
    cpus: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"{name}={spec!r}: {part!r} is neither a CPU id nor a range like 0-7") from None
        if first < 0 or last < first:
            raise ValueError(f"{name}={spec!r}: {part!r} is not a range of CPU ids (low-high, low <= high)")
        cpus.update(range(first, last + 1))
    return cpus


def pin_cpus(env_var: str) -> None:
    """Pin this actor to the CPU ids listed in ``$env_var`` (e.g. ``ASYNCPPO_ROLLOUT_CPUS=1`` or ``0-7``), if set.

    Benchmarks use it to give the rollout worker and the learner disjoint cores, as disjoint GPU pools would be;
    a run that does not set it is scheduled by the OS as usual."""
    spec = os.environ.get(env_var, "").strip()
    if spec and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, parse_cpu_list(spec, env_var))


def set_learner_threads(cfg_dict: dict) -> None:
    """torch intra-op threads of a learner rank on CPU: ``trainer.cpu_threads``, or ``$ASYNCPPO_LEARNER_THREADS``
    when set (benchmarks). No effect on GPU, where the kernels do not run on these threads."""
    import torch  # heavy: torch, only in the actor's process (the launcher imports this module without it)

    if not torch.cuda.is_available():
        threads = os.environ.get("ASYNCPPO_LEARNER_THREADS") or cfg_dict["trainer"].get("cpu_threads", 1)
        torch.set_num_threads(int(threads))


def _config(cfg_dict: dict) -> AsyncPPOConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AsyncPPOConfig), cfg_dict))


# Threaded: the launcher calls replace_worker / data_position while run() trains (launch/membership.py locks).
@ray.remote(max_restarts=0, max_concurrency=4)
class LearnerActor:
    def __init__(self, cfg_dict: dict, model_path: str, num_workers: int, output_dir: str, rank: int, world_size: int):
        # the learner stack is imported in the actor's process only, never in the launcher
        from asyncppo.launch.learner_wiring import llm_learner  # heavy: torch, transformers

        redirect_output(output_dir, "learner" if rank == 0 else f"learner-{rank}")
        logging.basicConfig(level=logging.WARNING)
        pin_cpus("ASYNCPPO_LEARNER_CPUS")
        set_learner_threads(cfg_dict)
        self.service = llm_learner(_config(cfg_dict), model_path, num_workers, output_dir, rank, world_size)

    def setup(self):
        return self.service.setup()

    def addresses(self) -> dict:
        """What setup() bound and advertised, why, and this actor's Ray node (launch/addresses.py)."""
        return self.service.addresses.as_dict()

    def group_address(self):
        return self.service.group_address()

    def run(self, master_addr=None, master_port=None) -> dict:
        return self.service.run(master_addr, master_port)

    def data_position(self, worker_id: int) -> dict:
        return self.service.data_position(worker_id)

    def replace_worker(self, worker_id: int, incarnation: int, hung: bool = False) -> dict:
        return self.service.replace_worker(worker_id, incarnation, hung)

    def health(self) -> dict:
        return self.service.health()

    def request_stop(self) -> None:
        self.service.request_stop()

    def note_restart(self, restarts: int, steps_done: int, lost_before: int, incarnations: dict) -> tuple:
        return self.service.note_restart(restarts, steps_done, lost_before, incarnations)


# Three threads: prepare() (the engine, built while the learner starts) and run() in two, and beside them the
# launcher's control ping (heartbeat, launch/hang.py; a stopped or wedged process answers nothing, which is what the
# ping detects) or a restarted learner's endpoints (reconnect).
@ray.remote(max_restarts=0, max_concurrency=3)
class RolloutActor:
    def __init__(self, cfg_dict: dict, worker_id: int, num_workers: int, model_path: str, incarnation: int = 0):
        # torch and the engine stack are imported in the actor's process only, never in the launcher
        if cfg_dict["env"].get("agent"):  # an agent program behind an OpenAI-compatible endpoint (docs/agents.md)
            from asyncppo.agents.worker import AgentRolloutWorker as RolloutWorker  # heavy: the engines, aiohttp
        elif cfg_dict["env"].get("text_env"):  # multi-turn episodes (docs/environments.md)
            from asyncppo.envs.episode_worker import EpisodeRolloutWorker as RolloutWorker  # heavy: the engines
        else:
            from asyncppo.rollout.worker import RolloutWorker  # heavy: torch, the rollout engines

        redirect_output(cfg_dict["trainer"]["output_dir"], f"worker-{worker_id}")  # a replacement appends
        logging.basicConfig(level=logging.WARNING)
        self._threads()
        self.worker = RolloutWorker(_config(cfg_dict), worker_id, num_workers, None, model_path,
                                    incarnation=incarnation)
        self._prepared = threading.Lock()  # held while the engine is built: run() waits for it
        self._prepare_error: BaseException | None = None
        self._prepare_started: float | None = None

    @staticmethod
    def _threads() -> None:
        """Pinning and torch's thread count, set in every thread that builds or steps the engine: Ray runs each call
        of a threaded actor on one of its pool threads, and both settings are per thread."""
        import torch  # heavy: torch

        pin_cpus("ASYNCPPO_ROLLOUT_CPUS")
        torch.set_num_threads(1)

    def prepare(self) -> None:
        """Build the engine now, while the learner starts (launch/start.py); a failure is raised by run()."""
        with self._prepared:
            if self._prepare_started is not None:
                return
            self._prepare_started = time.time()
            self._threads()
            try:
                self.worker.prepare()
            except BaseException as exc:  # noqa: BLE001 - handed to run(), which the launcher waits on
                self._prepare_error = exc

    def run(self, endpoints, position=None) -> dict:
        """``endpoints``: the learner's addresses; ``position``: where this worker's draws resume."""
        asked = time.time()
        self.prepare()  # waits for a prepare() under way; builds the engine now if none was asked for
        if self._prepare_error is not None:
            raise self._prepare_error
        if self._prepare_started < asked - 0.5:
            print(f"[asyncppo] rollout worker {self.worker.worker_id}: engine build started "
                  f"{asked - self._prepare_started:.1f}s before the learner's addresses came", flush=True)
        self._threads()
        self.worker.attach(endpoints, position)
        return self.worker.run()

    def reconnect(self, endpoints, position=None) -> None:
        """A restarted learner's addresses and the data position to resume from (rollout/skeleton.py)."""
        self.worker.request_reconnect(endpoints, position)

    def heartbeat(self) -> dict:
        return self.worker.heartbeat()
