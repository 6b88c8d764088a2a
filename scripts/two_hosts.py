"""Two real hosts on one machine: network namespaces joined by a bridge, each its own Ray node.

Why. On one node every address is 127.0.0.1, so a wrong advertised address, a socket bound to loopback on a remote
node, a rendezvous listening on the wrong interface or an unauthenticated port are invisible. A Linux network
namespace has its own interfaces, routes and loopback: a process inside it cannot reach another namespace's
127.0.0.1, and what it serves is reached only through the address its veth carries. Three namespaces on one
bridge are three hosts on one link:

* ``A`` (``<subnet>.1``): the Ray head and the learner (the launch runs here);
* ``B`` (``<subnet>.2``): a Ray worker node with the rollout worker;
* ``X`` (``<subnet>.9``): the intruder, on the same link, in no Ray cluster, for the security checks.

The bridge lives in the root namespace and has no address: the root namespace cannot talk to the hosts, and the
hosts can talk to nothing but each other (no route beyond the subnet). Faults act on the root-side end of a host's
veth: ``link(host, up=False)`` unplugs the host's cable, ``qdisc`` slows its frames (``tc``).

Everything made here is named ``<prefix>...`` with a per-harness prefix, removed by :meth:`TwoHosts.down` (also on
failure, from the context manager), and :func:`sweep` removes what a killed earlier run left. Processes are found by
the network namespace they live in (``/proc/<pid>/ns/net``), never by name: ``ray stop`` would kill every Ray
process on the machine, other jobs' included, so it is not used; :meth:`stop_ray` kills the one host's Ray node.

Needs root and ``ip`` (iproute2); :func:`unavailable` says why not, for tests to skip with that reason.

    python scripts/two_hosts.py up      # make the hosts and start Ray in A and B; prints the head address
    python scripts/two_hosts.py down    # remove every host this tool made (any prefix)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

NAME_PREFIX = "apx"  # every namespace, bridge and veth of this tool starts with it (sweep() finds them by it)
HOSTS = {"A": 1, "B": 2, "X": 9}  # host -> last octet of its address
RAY_PORT = 6379  # inside host A's namespace: it collides with nothing outside it


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, as CI does"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"{NAME_PREFIX}probe{os.getpid() % 10000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _owner_alive(name: str, prefix: str) -> bool:
    """Whether the process whose pid tags ``name`` (``<prefix><pid><host>``) still runs: its hosts are in use."""
    digits = ""
    for ch in name[len(prefix):]:
        if not ch.isdigit():
            break
        digits += ch
    if not digits or int(digits) == os.getpid():
        return False
    try:
        os.kill(int(digits), 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def sweep(prefix: str = NAME_PREFIX) -> list[str]:
    """Remove every namespace (after killing its processes) and bridge named ``prefix...`` whose maker is gone: what
    an earlier run that was killed before its cleanup left behind (a live run's hosts are left alone). Returns the
    names removed."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(prefix) and not _owner_alive(name, prefix):
            kill_namespace(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(prefix) and not _owner_alive(name, prefix):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def namespace_inode(name: str) -> Optional[str]:
    """The ``net:[inode]`` identity of a named namespace (what ``/proc/<pid>/ns/net`` of its processes reads)."""
    try:
        return f"net:[{os.stat(f'/run/netns/{name}').st_ino}]"
    except OSError:
        return None


def pids_in(name: str) -> list[int]:
    """Every process living in the network namespace ``name``."""
    ident = namespace_inode(name)
    if ident is None:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == ident:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def kill_namespace(name: str, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every process in namespace ``name``; how many got it."""
    n = 0
    for pid in pids_in(name):
        try:
            os.kill(pid, sig)
            n += 1
        except ProcessLookupError:
            pass
    return n


@dataclass
class TwoHosts:
    """Hosts A, B and X on one bridge (module docstring). Use as a context manager: ``with TwoHosts() as h:``."""

    subnet: str = "10.231.0"
    tag: str = field(default_factory=lambda: str(os.getpid()))  # sweep() leaves hosts whose maker still runs
    ray_tmp: str = ""
    ray_env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefix = f"{NAME_PREFIX}{self.tag}"
        self.bridge = f"{self.prefix}br"

    # -- names and addresses ------------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{HOSTS[host]}"

    def cable(self, host: str) -> str:
        """The root-namespace end of ``host``'s veth: where faults on its link are made."""
        return f"{self.prefix}{host}r"

    @property
    def head(self) -> str:
        return f"{self.addr('A')}:{RAY_PORT}"

    # -- life ---------------------------------------------------------------------------------------------------
    def up(self) -> "TwoHosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for host in HOSTS:
                ns, cable, inner = self.ns(host), self.cable(host), f"{self.prefix}{host}i"
                _ip("netns", "add", ns)
                _ip("link", "add", cable, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", cable, "master", self.bridge)
                _ip("link", "set", cable, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", inner, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except Exception:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every process of the hosts, remove the namespaces (their veths go with them) and the bridge."""
        for host in HOSTS:
            kill_namespace(self.ns(host))
        time.sleep(0.2)
        for host in HOSTS:
            _ip("netns", "del", self.ns(host), check=False)
            _ip("link", "del", self.cable(host), check=False)
        _ip("link", "del", self.bridge, check=False)
        if self.ray_tmp:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def __enter__(self) -> "TwoHosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- running things on a host -------------------------------------------------------------------------------
    def command(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def run(self, host: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(host, argv), **kw)

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kw)

    def pids(self, host: str) -> list[int]:
        return pids_in(self.ns(host))

    # -- faults -------------------------------------------------------------------------------------------------
    def link(self, host: str, up: bool) -> None:
        """Plug (up) or unplug (down) ``host``'s cable: frames stop both ways; sockets stay open on both ends."""
        _ip("link", "set", self.cable(host), "up" if up else "down")

    def qdisc(self, host: str, spec: Optional[str]) -> None:
        """``tc qdisc replace ... root <spec>`` on frames towards ``host`` (e.g. ``"tbf rate 1mbit burst 16kb latency
        400ms"``: a slow link; ``"netem delay 2000ms"`` where the kernel has netem, which this machine's does not);
        None removes it."""
        dev = self.cable(host)
        if spec is None:
            subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            return
        proc = subprocess.run(["tc", "qdisc", "replace", "dev", dev, "root", *spec.split()],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"tc qdisc {spec} on {dev}: {proc.stderr.strip()}")

    # -- Ray ----------------------------------------------------------------------------------------------------
    def start_ray(self, head_resources: dict, worker_resources: dict, cpus: int = 1, timeout_s: float = 180) -> None:
        """``ray start --head`` in A and ``ray start --address`` in B, each advertising its own address, and wait
        until the head sees both nodes alive."""
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        # A short private temp dir: Ray's socket paths live there, and another job's ray.init() must not find it.
        self.ray_tmp = tempfile.mkdtemp(prefix=f"{self.prefix}-", dir="/tmp")
        # Ray's own token authentication on, with a token of this harness's (not ~/.ray's): every node and driver
        # of this cluster, and nothing else, holds it.
        token = os.path.join(self.ray_tmp, "auth_token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        self.ray_env = dict(os.environ, RAY_TMPDIR=self.ray_tmp, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
                            RAY_AUTH_TOKEN_PATH=token)
        common = [f"--num-cpus={cpus}", "--num-gpus=0", "--disable-usage-stats"]
        head = self.run("A", [ray, "start", "--head", f"--node-ip-address={self.addr('A')}", f"--port={RAY_PORT}",
                              f"--temp-dir={self.ray_tmp}", "--include-dashboard=false",
                              f"--resources={json.dumps(head_resources)}", *common],
                        env=self.ray_env, timeout=timeout_s)
        if head.returncode != 0:
            raise RuntimeError(f"ray start --head in A failed:\n{head.stdout[-2000:]}\n{head.stderr[-3000:]}")
        self.join_ray(worker_resources, cpus, timeout_s)

    def join_ray(self, worker_resources: dict, cpus: int = 1, timeout_s: float = 180) -> None:
        """(Re)start B's Ray node, joined to A's head."""
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        worker = self.run("B", [ray, "start", f"--address={self.head}", f"--node-ip-address={self.addr('B')}",
                                f"--resources={json.dumps(worker_resources)}", f"--num-cpus={cpus}", "--num-gpus=0",
                                "--disable-usage-stats"], env=self.ray_env, timeout=timeout_s)
        if worker.returncode != 0:
            raise RuntimeError(f"ray start in B failed:\n{worker.stdout[-2000:]}\n{worker.stderr[-3000:]}")
        self.wait_nodes(2, timeout_s)

    def alive_nodes(self) -> list[str]:
        """The addresses of the alive Ray nodes, as the head sees them (asked from host A)."""
        probe = ("import ray, json; ray.init(address='auto', logging_level='ERROR'); "
                 "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))")
        proc = self.run("A", [sys.executable, "-c", probe], env=dict(self.ray_env, RAY_ADDRESS=self.head),
                        timeout=120)
        if proc.returncode != 0:
            return []
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def wait_nodes(self, count: int, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = self.alive_nodes()
            if len(nodes) >= count:
                return nodes
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray saw {nodes} alive after {timeout_s:.0f}s; wanted {count} nodes")
            time.sleep(2)

    def stop_ray(self, host: str) -> int:
        """Stop ``host``'s Ray node and everything running on it (what ``ray stop`` in that host would do, without
        touching any other Ray process on this machine)."""
        return kill_namespace(self.ns(host))


@contextmanager
def two_hosts(**kw) -> Iterator[TwoHosts]:
    hosts = TwoHosts(**kw)
    with hosts:
        yield hosts


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("up", "down"):
        print(__doc__)
        return 2
    if argv[0] == "down":
        print("removed:", ", ".join(sweep()) or "nothing")
        return 0
    why = unavailable()
    if why:
        print(f"cannot make hosts here: {why}", file=sys.stderr)
        return 2
    hosts = TwoHosts(tag="cli").up()
    hosts.start_ray({"learner_node": 1}, {"rollout_node": 1})
    print(f"hosts up: A {hosts.addr('A')} (ray head {hosts.head}), B {hosts.addr('B')}, X {hosts.addr('X')}")
    print(f"run on A: ip netns exec {hosts.ns('A')} env RAY_TMPDIR={hosts.ray_tmp} asyncppo launch "
          f"cluster.address={hosts.head} +cluster.learner_resources.learner_node=1 "
          "+cluster.rollout_resources.rollout_node=1")
    print("remove with: python scripts/two_hosts.py down")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
