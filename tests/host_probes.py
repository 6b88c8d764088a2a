"""What crosses the link between two test hosts, and what a stranger on that link gets (scripts/two_hosts.py).

* :class:`LinkTraffic` samples every established TCP connection of one host (``ss -tni`` inside its namespace)
  while a run goes on, keeping each connection's bytes sent and received. A host is its own network namespace, so
  a connection from B to A's address *is* traffic over B's cable: no other path exists.
* :func:`listening` lists the TCP ports a host listens on, with the owning process.
* ``python tests/host_probes.py HOST:PORT ...`` (run inside the intruder's namespace) tries each port as a stranger
  would: a plain TCP connect, a ZeroMQ peer with no keys (ZMTP's NULL mechanism), an HTTP request with no key, and
  a torch ``TCPStore`` client (what it can list and read). It prints one JSON object per port.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

_SS_PEER = re.compile(r"^(?:[A-Z-]+\s+)?\d+\s+\d+\s+(\S+):(\d+)\s+(\S+):(\d+)")  # [State] Recv-Q Send-Q Local Peer
_BYTES = re.compile(r"bytes_(sent|received):(\d+)")


def _split_addr(text: str) -> str:
    return text.strip("[]").replace("::ffff:", "")


@dataclass
class LinkTraffic:
    """Bytes per established TCP connection of host ``host`` (a TwoHosts), sampled every ``every_s`` until
    :meth:`stop`. ``conns[(local, lport, peer, pport)] = [sent, received]`` (the largest seen: counters only grow
    while a connection lives)."""

    hosts: object
    host: str
    every_s: float = 0.5
    conns: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "LinkTraffic":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        out = self.hosts.run(self.host, ["ss", "-tniH", "state", "established"], timeout=30).stdout
        lines, key = out.splitlines(), None
        for line in lines:
            m = _SS_PEER.match(line.strip()) if not line.startswith((" ", "\t")) else None
            if m:
                key = (_split_addr(m.group(1)), int(m.group(2)), _split_addr(m.group(3)), int(m.group(4)))
                self.conns.setdefault(key, [0, 0])
                continue
            if key is not None:
                for kind, n in _BYTES.findall(line):
                    i = 0 if kind == "sent" else 1
                    self.conns[key][i] = max(self.conns[key][i], int(n))

    def to(self, addr: str, port: int) -> list[int]:
        """[sent, received] summed over this host's connections to ``addr:port``."""
        tot = [0, 0]
        for (_, _, peer, pport), (s, r) in self.conns.items():
            if peer == addr and pport == port:
                tot[0] += s
                tot[1] += r
        return tot


def listening(hosts, host: str) -> list[tuple[str, int, str]]:
    """(address, port, process) of every TCP socket listening in ``host``; the process is its name and pid."""
    out = hosts.run(host, ["ss", "-tlnpH"], timeout=30).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        addr, _, port = parts[3].rpartition(":")
        proc = re.search(r'users:\(\("([^"]+)",pid=(\d+)', line)
        found.append((_split_addr(addr), int(port), f"{proc.group(1)}/{proc.group(2)}" if proc else "?"))
    return sorted(set(found))


# ---------------------------------------------------------------------------------------------------------------
# the intruder's side
def _tcp(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=2):
            return "accepted"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return f"no answer ({type(e).__name__})"


def _zmq_null(host: str, port: int) -> str:
    """Connect a DEALER with no keys (ZMTP NULL) and watch the handshake: a CURVE server fails it."""
    import zmq  # noqa: PLC0415 - the intruder script's own dependency
    from zmq.utils.monitor import recv_monitor_message  # noqa: PLC0415

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    mon = sock.get_monitor_socket()
    sock.connect(f"tcp://{host}:{port}")
    verdict, deadline = "no handshake within 3 s", time.monotonic() + 3
    try:
        while time.monotonic() < deadline:
            if not mon.poll(200):
                continue
            ev = recv_monitor_message(mon)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                verdict = "HANDSHAKE SUCCEEDED (plain ZeroMQ peer accepted)"
                break
            if ev in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                      zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                verdict = "handshake refused"
                break
            if ev == zmq.EVENT_DISCONNECTED:
                verdict = "disconnected by the server"
                break
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
    return verdict


def _http(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            s.settimeout(2)
            head = s.recv(256)
    except OSError as e:
        return f"no reply ({type(e).__name__})"
    first = head.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    return first if first.startswith("HTTP/") else (f"non-HTTP bytes ({len(head)})" if head else "closed, no reply")


def _store(host: str, port: int) -> str:
    """What a torch TCPStore client gets: the number of keys, and their names if the server lists them."""
    from datetime import timedelta  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=3), use_libuv=True)
    except Exception as e:  # noqa: BLE001 - anything the client raises is the answer
        return f"not a store ({type(e).__name__})"
    try:
        n = store.num_keys()
        try:
            keys = store.list_keys()
        except Exception as e:  # noqa: BLE001
            keys = [f"list_keys refused ({type(e).__name__})"]
        return f"TCPStore: {n} key(s): {sorted(keys)[:6]}"
    except Exception as e:  # noqa: BLE001
        return f"store connect, then {type(e).__name__}"


CHECKS = {"tcp": _tcp, "zmq_null": _zmq_null, "http": _http, "store": _store}


def probe(host: str, port: int, timeout_s: float = 10.0) -> dict:
    """Every check on ``host:port``, each in a thread with a deadline: a client library that hangs on a peer
    speaking another protocol is an answer too ("hung"), not a stuck scan (the thread is left behind; the script
    ends with ``os._exit``)."""
    row = {"host": host, "port": port}
    for name, check in CHECKS.items():
        if name != "tcp" and row["tcp"] != "accepted":
            break
        box: list = []

        def run(check=check, box=box):
            try:
                box.append(check(host, port))
            except Exception as e:  # noqa: BLE001 - anything raised is the answer
                box.append(f"error ({type(e).__name__}: {str(e)[:80]})")

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout_s)
        row[name] = box[0] if box else f"hung (no answer in {timeout_s:.0f} s)"
    return row


def probe_all(targets: list[tuple[str, int]]) -> list[dict]:
    """:func:`probe` on every target at once (a thread each): the scan takes as long as its slowest port, so it
    ends while the run it scans is still going."""
    rows: dict = {}
    threads = [threading.Thread(target=lambda t=t: rows.__setitem__(t, probe(*t)), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [rows.get(t, {"host": t[0], "port": t[1], "tcp": "probe did not finish"}) for t in targets]


if __name__ == "__main__":
    import os

    wanted = [(h, int(p)) for h, _, p in (t.rpartition(":") for t in sys.argv[1:])]
    for row in probe_all(wanted):
        print(json.dumps(row), flush=True)
    os._exit(0)
