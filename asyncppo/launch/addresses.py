"""Where the learner listens and what the workers connect to, discovered at run time; and the check that they can.

Why discover. A fixed ``127.0.0.1`` is right on one machine and silently wrong on several: a worker Ray places on
another node would dial its own loopback, never reach the learner, and give up only after ``cluster.timeout_s``. A
fixed outward address is wrong the other way: on a laptop or a CI box it would open the learner's ports to the
network for nothing. So ``cluster.bind_address=auto`` (the default) decides inside the learner actor, from what Ray
says about the cluster at that moment (:func:`resolve_addresses` is the rule, kept pure so it is tested exactly):

* every alive Ray node is on this machine (one node, or several whose addresses are all loopback or all the same
  address, as in Ray's ``cluster_utils`` simulator): bind ``127.0.0.1``. Nothing listens beyond loopback, and
  ``cluster.auth=auto`` keeps the sockets plain, exactly as a single-node run always did;
* Ray spans several machines: bind the address of the node Ray placed the learner on (``ray.util.
  get_node_ip_address()`` inside the learner actor, the address Ray itself uses for that node, so the other nodes
  reach it). That is not loopback, so ``cluster.auth=auto`` turns CURVE on (docs/security.md).

``cluster.advertise_address`` null (or ``auto``, or a wildcard) is derived too: the bind address, or this node's
address when the bind address is a wildcard (``0.0.0.0``, ``::``). An explicit value of either key is used as given.

The rule cannot see the future: a node that joins after the learner bound to loopback (an autoscaler) is not covered.
So the launcher checks every placement bundle before it starts the role in it (:func:`check_reachable`): a role on
another machine than the learner while the learner listens on loopback fails the launch at once, naming the role,
both nodes and the fix, instead of a ``cluster.timeout_s`` hang.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

from asyncppo.stream.security import is_loopback

AUTO = "auto"
LOOPBACK = "127.0.0.1"


class UnreachableLearner(RuntimeError):
    """A role was placed on a machine that cannot reach the learner's sockets (they listen on loopback)."""


def is_wildcard(host: Optional[str]) -> bool:
    h = (host or "").strip().strip("[]")
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        return False


def _unset(value: Optional[str]) -> bool:
    return value is None or not value.strip() or value.strip().lower() == AUTO


def same_machine(a: Optional[str], b: Optional[str]) -> bool:
    """Two Ray node addresses name one machine: equal, or both loopback (only one machine's processes see those)."""
    if a is None or b is None:
        return a == b
    return a.strip("[]") == b.strip("[]") or (is_loopback(a) and is_loopback(b))


def machines(node_ips: Iterable[str]) -> int:
    """How many machines these node addresses span (every loopback address counts as this one machine)."""
    return len({"loopback" if is_loopback(ip) else ip.strip("[]") for ip in node_ips})


@dataclass(frozen=True)
class LearnerAddresses:
    """What the learner binds, what the workers are told, and why (kept in the run's ``placement.json``)."""

    bind: str
    advertise: str
    reason: str
    node_id: str = ""  # the Ray node the learner runs on ("" outside Ray)
    node_ip: str = ""  # that node's address as Ray knows it
    ray_nodes: int = 0  # alive Ray nodes when the learner decided (0: not in Ray)

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_addresses(bind: Optional[str], advertise: Optional[str], node_ip: Optional[str],
                      node_ips: Iterable[str]) -> tuple[str, str, str]:
    """The rule (module docstring): ``(bind, advertise, reason)`` from the two config values, the learner node's
    address and every alive node's address (empty outside Ray: treated as one machine)."""
    node_ips = [ip for ip in node_ips if ip]
    if _unset(bind):
        count = machines(node_ips)
        if count <= 1:
            host = LOOPBACK
            reason = ("no Ray cluster: loopback" if not node_ips else
                      f"{len(node_ips)} Ray node(s), all on this machine: loopback")
        elif not node_ip:
            raise UnreachableLearner("cluster.bind_address=auto: Ray spans several machines but did not say which "
                                     "node the learner runs on; set cluster.bind_address explicitly")
        else:
            host = node_ip.strip("[]")
            reason = f"{len(node_ips)} Ray nodes on {count} machines: the learner node's address"
    else:
        host = bind.strip()
        reason = f"cluster.bind_address={host} (explicit)"
    if not _unset(advertise) and not is_wildcard(advertise):
        public = advertise.strip()
        reason += f"; cluster.advertise_address={public} (explicit)"
    elif is_wildcard(host):
        public = (node_ip or LOOPBACK).strip("[]")
        reason += "; advertised: the learner node's address (wildcard bind)"
    else:
        public = host.strip("[]")
    return host, public, reason


def discover_learner_addresses(bind: Optional[str], advertise: Optional[str]) -> LearnerAddresses:
    """Apply the rule where it must run: in the learner's process, asking Ray which node this is and which nodes are
    alive. Outside Ray (tests building a learner process directly) there is no cluster, hence loopback."""
    node_id = node_ip = ""
    node_ips: list[str] = []
    try:
        import ray  # heavy/optional: ray, absent or unused where tests build a learner process directly

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id() or ""
            node_ip = ray.util.get_node_ip_address()
            node_ips = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
    except ImportError:
        pass
    host, public, reason = resolve_addresses(bind, advertise, node_ip, node_ips)
    return LearnerAddresses(host, public, reason, node_id, node_ip, len(node_ips))


# ---------------------------------------------------------------------------------------------------------------
# the launcher's side: where Ray put each bundle, and whether its role can reach the learner from there
@dataclass
class BundleNode:
    node_id: str
    node_ip: str


@dataclass
class PlacementRecord:
    """Written to ``<run_dir>/placement.json``: the learner's discovery and the node of every role."""

    learner: dict
    roles: dict[str, dict] = field(default_factory=dict)
    endpoints: dict = field(default_factory=dict)

    def write(self, output_dir: str) -> str:
        path = os.path.join(output_dir, "placement.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=1, default=str)
        return path


def bundle_nodes(pg) -> dict[int, BundleNode]:
    """Bundle index -> the node Ray reserved it on (call after the placement group is ready)."""
    # the runner imports this module before it sets Ray's environment and imports ray itself
    import ray  # heavy: ray
    from ray.util.placement_group import placement_group_table  # heavy: ray

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    table = placement_group_table(pg).get("bundles_to_node_id", {})
    return {int(i): BundleNode(node, ips.get(node, "")) for i, node in table.items()}


def check_reachable(learner: LearnerAddresses, role: str, node: BundleNode, timeout_s: float) -> None:
    """Fail now, not after ``timeout_s``, when ``role`` sits on another machine than the learner and the learner's
    sockets cannot be reached from there (bound to, or advertised as, a loopback address)."""
    if same_machine(node.node_ip, learner.node_ip) or not learner.node_ip:
        return
    if not (is_loopback(learner.bind) or is_loopback(learner.advertise)):
        return
    raise UnreachableLearner(
        f"{role} was placed on Ray node {node.node_id[:12]} ({node.node_ip}), another machine than the learner's "
        f"node {learner.node_id[:12]} ({learner.node_ip}), but the learner listens on {learner.bind} and advertises "
        f"{learner.advertise}, which that machine cannot reach: it would wait cluster.timeout_s={timeout_s:g}s and "
        f"fail. Set cluster.bind_address=auto (the learner then binds its node's address) or an address of the "
        f"learner's node that every node reaches, and leave cluster.advertise_address null "
        f"(docs/configuration.md, docs/security.md)"
    )
