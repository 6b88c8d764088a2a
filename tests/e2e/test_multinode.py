"""Multi-node without hand-set addresses (launch/addresses.py): the discovery rule, the early reachability check, and a
real launch on Ray's own multi-node simulator (``ray.cluster_utils.Cluster``) with the learner and the rollout worker
pinned to different Ray nodes by custom resources. Every node of the simulator is on 127.0.0.1 (loopback only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from asyncppo.launch.addresses import (
    BundleNode, LearnerAddresses, UnreachableLearner, check_reachable, discover_learner_addresses,
    resolve_addresses,
)
from asyncppo.stream.security import auth_enabled

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------------------
# the rule, exactly
@pytest.mark.parametrize("bind, advertise, node_ip, nodes, want", [
    # no Ray, one node (whatever its address), several nodes on this machine's loopback: loopback, as before
    ("auto", None, None, [], ("127.0.0.1", "127.0.0.1")),
    ("auto", "auto", "10.1.2.3", ["10.1.2.3"], ("127.0.0.1", "127.0.0.1")),
    ("auto", None, "127.0.0.1", ["127.0.0.1", "127.0.0.1", "127.0.0.1"], ("127.0.0.1", "127.0.0.1")),
    ("auto", None, "127.0.0.1", ["127.0.0.1", "127.0.0.2"], ("127.0.0.1", "127.0.0.1")),
    ("auto", None, "10.1.2.3", ["10.1.2.3", "10.1.2.3"], ("127.0.0.1", "127.0.0.1")),  # two raylets, one machine
    # several machines: the learner node's own address, bound and advertised
    ("auto", None, "10.0.0.5", ["10.0.0.5", "10.0.0.6"], ("10.0.0.5", "10.0.0.5")),
    ("auto", None, "10.0.0.6", ["10.0.0.5", "10.0.0.6", "10.0.0.7"], ("10.0.0.6", "10.0.0.6")),
    ("auto", "", "fd00::6", ["fd00::5", "fd00::6"], ("fd00::6", "fd00::6")),
    # explicit overrides win; a wildcard bind advertises the node's address (never 0.0.0.0)
    ("127.0.0.1", None, "10.0.0.5", ["10.0.0.5", "10.0.0.6"], ("127.0.0.1", "127.0.0.1")),
    ("10.0.0.9", "auto", "10.0.0.5", ["10.0.0.5", "10.0.0.6"], ("10.0.0.9", "10.0.0.9")),
    ("0.0.0.0", None, "10.0.0.5", ["10.0.0.5", "10.0.0.6"], ("0.0.0.0", "10.0.0.5")),
    ("0.0.0.0", "0.0.0.0", "10.0.0.5", ["10.0.0.5"], ("0.0.0.0", "10.0.0.5")),  # resolve_derived copies a wildcard
    ("0.0.0.0", "gpu-node-3", "10.0.0.5", ["10.0.0.5", "10.0.0.6"], ("0.0.0.0", "gpu-node-3")),
    ("auto", "lb.example", "10.0.0.5", ["10.0.0.5", "10.0.0.6"], ("10.0.0.5", "lb.example")),
])
def test_discovery_rule(bind, advertise, node_ip, nodes, want):
    host, public, reason = resolve_addresses(bind, advertise, node_ip, nodes)
    assert (host, public) == want, reason


def test_discovery_turns_authentication_on_exactly_beyond_loopback():
    single = resolve_addresses("auto", None, "10.1.2.3", ["10.1.2.3"])[0]
    multi = resolve_addresses("auto", None, "10.0.0.5", ["10.0.0.5", "10.0.0.6"])[0]
    assert not auth_enabled("auto", single) and auth_enabled("auto", multi)


def test_discovery_outside_ray_is_loopback():
    a = discover_learner_addresses("auto", None)
    assert (a.bind, a.advertise, a.ray_nodes, a.node_id) == ("127.0.0.1", "127.0.0.1", 0, "")
    assert "no Ray cluster" in a.reason


def test_reachability_check():
    loop = LearnerAddresses("127.0.0.1", "127.0.0.1", "explicit", "aaaa", "10.0.0.5", 2)
    other = BundleNode("bbbb", "10.0.0.6")
    with pytest.raises(UnreachableLearner) as err:
        check_reachable(loop, "rollout-3", other, 600.0)
    msg = str(err.value)
    for part in ("rollout-3", "10.0.0.6", "10.0.0.5", "127.0.0.1", "600s", "cluster.bind_address=auto"):
        assert part in msg, msg
    check_reachable(loop, "rollout-0", BundleNode("aaaa", "10.0.0.5"), 600.0)  # same node
    check_reachable(loop, "rollout-0", BundleNode("cccc", "10.0.0.5"), 600.0)  # another raylet, same machine
    # simulator: distinct nodes, all on loopback, are one machine
    check_reachable(LearnerAddresses("127.0.0.1", "127.0.0.1", "", "aaaa", "127.0.0.1", 2), "rollout-0",
                    BundleNode("bbbb", "127.0.0.1"), 600.0)
    # the learner bound its node's address: other machines reach it
    check_reachable(LearnerAddresses("10.0.0.5", "10.0.0.5", "", "aaaa", "10.0.0.5", 2), "rollout-0", other, 600.0)
    # bound everywhere but advertised as loopback: as unreachable as bound to loopback
    with pytest.raises(UnreachableLearner):
        check_reachable(LearnerAddresses("0.0.0.0", "127.0.0.1", "", "aaaa", "10.0.0.5", 2), "learner-1", other, 1.0)


def test_config_defaults_and_errors():
    from asyncppo.config import load_config
    from asyncppo.config.validate import ConfigError

    cfg = load_config([])
    assert (cfg.cluster.bind_address, cfg.cluster.advertise_address) == ("auto", "auto")
    assert cfg.cluster.learner_resources == {} and cfg.cluster.rollout_resources == {}
    cfg = load_config(["+cluster.learner_resources.learner_node=1", "+cluster.rollout_resources.rollout_node=0.5"])
    assert cfg.cluster.learner_resources == {"learner_node": 1.0}
    assert cfg.cluster.rollout_resources == {"rollout_node": 0.5}
    for overrides, needle in (
        (["+cluster.learner_resources.GPU=1"], "custom Ray resource names only"),
        (["+cluster.rollout_resources.rollout_node=0"], "finite amount > 0"),
        (["cluster.bind_address=127.0.0.1", "cluster.advertise_address=10.0.0.1"],
         "bind_address=127.0.0.1 is loopback"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(overrides)
        assert needle in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# a real launch across two simulated Ray nodes
def _processes_under(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (this test's private Ray temp dir): ours only, not other jobs'."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def _start_cluster(attempts: int = 3):
    """Head node = the learner's node, one more node for the rollout worker; both on 127.0.0.1. Node start-up can time
    out on a loaded machine: retry."""
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args=dict(
                node_ip_address="127.0.0.1", num_cpus=1, resources={"learner_node": 1}, include_dashboard=False))
            rollout_node = cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, resources={"rollout_node": 1})
            cluster.wait_for_nodes(timeout=120)
            return cluster, rollout_node
        except Exception:
            if cluster is not None:
                cluster.shutdown()
            if attempt == attempts - 1:
                raise
            time.sleep(5)


@pytest.mark.slow
def test_learner_and_worker_on_different_ray_nodes(tmp_path, monkeypatch):
    # A private Ray temp dir: the simulator records its address in <temp>/ray/ray_current_cluster, where any other
    # job's plain ray.init() on this machine would otherwise find (and join) it. Short: Ray's socket paths live there.
    ray_tmp = tempfile.mkdtemp(prefix="amn", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's own processes: loopback only
    cluster = None
    try:
        cluster, rollout_node = _start_cluster()
        head_id, rollout_id = cluster.head_node.node_id, rollout_node.node_id
        assert head_id != rollout_id
        out_dir = tmp_path / "run"
        env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1")
        t0 = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "asyncppo", "launch", f"trainer.output_dir={out_dir}", "trainer.logger.wandb=false",
             "rollout.engine=vllm", f"cluster.address={cluster.address}", "+cluster.learner_resources.learner_node=1",
             "+cluster.rollout_resources.rollout_node=1", "trainer.total_steps=3", "rollout.rollout_batch_size=8",
             "rollout.max_staleness=1", "cluster.timeout_s=120", "data.num_eval_prompts=16"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=420,
        )
        took = time.time() - t0
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        train = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if "reward/mean" in x]
        assert [r["policy_version"] for r in train] == [1, 2, 3]

        placement = json.loads((out_dir / "placement.json").read_text())
        learner, roles, endpoints = placement["learner"], placement["roles"], placement["endpoints"]
        # the bundles landed where the custom resources say, i.e. on two different Ray nodes
        assert roles["learner-0"]["node_id"] == head_id and roles["rollout-0"]["node_id"] == rollout_id
        # the learner actor itself saw it was on the head node, and discovered 2 nodes, both this machine: loopback
        assert learner["node_id"] == head_id and learner["ray_nodes"] == 2
        assert (learner["bind"], learner["advertise"]) == ("127.0.0.1", "127.0.0.1")
        assert "2 Ray node(s), all on this machine" in learner["reason"], learner
        # what the workers were handed is what the learner discovered (not a config constant)
        for key in ("trajectory", "control", "admission"):
            assert endpoints[key].startswith(f"tcp://{learner['advertise']}:"), endpoints
        assert endpoints["sync_host"] == learner["advertise"] and endpoints["auth"] is False
        assert f"learner sockets: bind 127.0.0.1, advertise 127.0.0.1 ({learner['reason']})" in proc.stdout

        # independently of the launcher's record: where Ray says the actors ran
        where = {}
        for info in cluster.global_state.actor_table(None).values():
            where.setdefault(info["ActorClassName"], set()).add(info["Address"]["NodeID"])
        assert where.get("LearnerActor") == {head_id} and where.get("RolloutActor") == {rollout_id}, where
        print(f"two-node launch: {took:.0f}s")
    finally:
        if cluster is not None:
            cluster.shutdown()
        left = _release(ray_tmp)
    assert not left, f"processes left behind: {left}"


def _release(ray_tmp: str) -> list[str]:
    """Wait up to 20 s for the processes of the Ray session under ``ray_tmp`` to exit, remove the directory, and
    return those still alive."""
    deadline = time.time() + 20
    while _processes_under(ray_tmp) and time.time() < deadline:
        time.sleep(1)
    left = _processes_under(ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return left


@pytest.mark.slow
def test_missing_custom_resource_fails_before_any_actor_starts(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="amn", dir="/tmp")
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", RAY_TMPDIR=ray_tmp)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "asyncppo", "launch", f"trainer.output_dir={tmp_path / 'run'}",
             "trainer.logger.wandb=false", "+cluster.learner_resources.learner_node=1"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "cluster.learner_resources" in proc.stderr and "'learner_node'" in proc.stderr, proc.stderr[-3000:]
        assert not (tmp_path / "run" / "logs").exists()  # no actor was started
    finally:
        left = _release(ray_tmp)
    assert not left, f"processes left behind: {left}"


def test_custom_resources_are_counted_per_bundle():
    """Every rollout engine and learner rank is a bundle asking for its role's resources: two workers need twice
    the amount, refused before any placement group waits for it."""
    from asyncppo.config import load_config
    from asyncppo.launch.resolve import LaunchError, check_cluster

    cfg = load_config(["+cluster.rollout_resources.rollout_node=1", "cluster.rollout_workers=2"])
    check_cluster(cfg, {"rollout_node": 2}, [])
    with pytest.raises(LaunchError, match="2 for its 2 bundle"):
        check_cluster(cfg, {"rollout_node": 1}, [])
