"""The fault drill across two hosts (``python scripts/fault_drill.py --hosts 2``): faults *between* the hosts.

Host A (the Ray head) runs the launch, the learner and rollout worker "A"; host B (a Ray worker node) runs rollout
worker "B" (scripts/two_hosts.py: network namespaces on one bridge; one ``rollout_node`` resource on each host
places one worker on each). The worker on A keeps the run training while B's is cut off, as on a real cluster where
one node misbehaves. Faults, in order, each once the run has recovered from the previous one and trained a few more
steps:

1. ``link down 5 s``: B's cable unplugged for 5 s, then plugged back; nothing has to notice, the run goes on
   (recovered: a group B's worker drew after the cut was trained);
2. ``push stalled across the link``: the link towards B slowed to 1 Mbit/s (``tc qdisc ... tbf``; this machine's
   kernel has no ``netem`` for delay or loss), so a weight push (2 MB) cannot finish by the push deadline: the
   late member is retired and the worker replaced (the link is restored once the fault is named);
3. ``link down past the hang timeout``: B unplugged until the launcher names the worker hung, then plugged back;
4. ``host B's Ray node stopped``: every process of B killed (what ``ray stop`` on B does), then B's Ray node
   started again, as an operator or an autoscaler would;
5. ``SIGKILL learner``: the learner on A is killed; it resumes from its checkpoint and both workers, B's across the
   link, reconnect to its new addresses.

The columns and the end checks are those of the one-host drill (scripts/fault_drill.py). A fault that the run
cannot recover from is reported with the line that named it, or as not detected: never a silent hang.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import two_hosts  # noqa: E402  (a sibling script)
from fault_drill import Drill, Run, drill_overrides, drive, report  # noqa: E402


def detect(worker: int) -> str:
    """The launcher's or learner's line naming ``worker`` as hung, late, dead or failed."""
    return rf"rollout worker\(?s?\)? \[?{worker}\b.*(hung|late|did not take|died|no progress|failed)"


class HostsDrill(Drill):
    def __init__(self, run: Run, hosts: two_hosts.TwoHosts, recover_s: float, worker_cpus: int):
        super().__init__(run, recover_s)
        self.hosts, self.worker_cpus = hosts, worker_cpus
        self.b = -1  # the worker Ray placed on host B (placement.json)

    def find_b(self) -> int:
        roles = json.loads((self.run.out / "placement.json").read_text())["roles"]
        (self.b,) = [int(r.split("-")[1]) for r, n in roles.items()
                     if r.startswith("rollout-") and n["node_ip"] == self.hosts.addr("B")]
        return self.b

    def link_blip(self, seconds: float = 5.0) -> None:
        def cut():
            self.hosts.link("B", up=False)
            time.sleep(seconds)
            self.hosts.link("B", up=True)
        self.inject(f"link down {seconds:.0f} s", self.b, cut, None, same_process=True)
        self.rows[-1]["transient"] = True

    def push_stall(self, slow: str = "tbf rate 1mbit burst 16kb latency 400ms") -> None:
        self.inject("push stalled across the link", self.b, lambda: self.hosts.qdisc("B", slow),
                    rf"{detect(self.b)}|did not take the weights", after_detect=lambda: self.hosts.qdisc("B", None))

    def link_down_past_hang(self) -> None:
        self.inject("link down past the hang timeout", self.b, lambda: self.hosts.link("B", up=False),
                    detect(self.b), after_detect=self._plug_back)

    def _plug_back(self) -> None:
        self.hosts.link("B", up=True)
        self._rejoin_if_gone()

    def _rejoin_if_gone(self) -> None:
        """Ray declares a node it has not heard from for a while dead, and that node's raylet then exits: start
        B's node again (the replacement's bundle needs its resources)."""
        time.sleep(5)
        if self.hosts.addr("B") not in self.hosts.alive_nodes():
            two_hosts.kill_namespace(self.hosts.ns("B"))
            self.hosts.join_ray({"rollout_node": 1}, cpus=self.worker_cpus)

    def stop_node_b(self) -> None:
        def restart():
            time.sleep(2)
            self.hosts.join_ray({"rollout_node": 1}, cpus=self.worker_cpus)
        self.inject("host B's Ray node stopped", self.b, lambda: self.hosts.stop_ray("B"), detect(self.b),
                    after_detect=restart)


def main(args) -> int:
    why = two_hosts.unavailable()
    if why:
        print(f"fault_drill --hosts 2: cannot make two hosts here: {why}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="fault-drill-hosts-")) / "run"
    cpus = 2
    two_hosts.sweep()
    with two_hosts.TwoHosts() as hosts:
        hosts.start_ray({"learner_node": 1, "rollout_node": 1}, {"rollout_node": 1}, cpus=cpus)
        run = Run(out, drill_overrides(args, [
            "cluster.rollout_workers=2", "cluster.hang_timeout_s=20", "cluster.push_timeout_s=10",
            f"cluster.address={hosts.head}", "+cluster.learner_resources.learner_node=1",
            "+cluster.rollout_resources.rollout_node=1"]), prefix=tuple(hosts.command("A", [])), env=hosts.ray_env)
        drill = HostsDrill(run, hosts, args.recover_s, cpus)
        t_start = time.time()
        drive(run, drill, (drill.link_blip, drill.push_stall, drill.link_down_past_hang, drill.stop_node_b,
                           drill.kill_learner), t_start, cleanup=lambda: hosts.qdisc("B", None),
              started=lambda: print(f"[drill] rollout worker {drill.find_b()} is on host B", flush=True))
        return report(run, drill, args, out, t_start, where=f"; learner and worker {1 - drill.b} on "
                      f"{hosts.addr('A')}, worker {drill.b} on {hosts.addr('B')}")
