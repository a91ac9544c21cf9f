"""The leader of a multi-node replica waits for its Ray workers (--ray-nodes), on a real Ray
cluster of two nodes on this machine: it waits while one is missing, goes on once it joins,
and gives up with one clear line when the nodes never come. The chart's multiNode mode
(tests/deploy/test_helm_chart.py) starts the leader this way."""

import subprocess
import sys
from collections.abc import Iterator

import pytest
from ray.cluster_utils import Cluster

pytestmark = pytest.mark.deploy

NODE = {"num_cpus": 1, "object_store_memory": 100 * 1024 * 1024}


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    head = Cluster(initialize_head=True, head_node_args=NODE)
    try:
        yield head
    finally:
        head.shutdown()


def wait(address: str, nodes: int, timeout: float) -> subprocess.Popen[str]:
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
        "from server.engine.ray_cluster import wait_for_ray_nodes; "
        f"print('joined', wait_for_ray_nodes({nodes}, {timeout}, {address!r}))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_the_leader_waits_for_the_missing_node_and_goes_on_when_it_joins(
    cluster: Cluster,
) -> None:
    waiting = wait(cluster.address, 2, 300)
    assert waiting.stdout is not None
    seen = []
    for line in waiting.stdout:  # until it says it is waiting: one node of two
        seen.append(line)
        if "waiting for Ray nodes" in line:
            break
    assert "1 of 2 joined" in seen[-1], "".join(seen)
    assert waiting.poll() is None
    cluster.add_node(**NODE)
    out, _ = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, "".join(seen) + out
    assert "joined 2" in out


def test_nodes_that_never_join_stop_the_leader_with_one_line(cluster: Cluster) -> None:
    waiting = wait(cluster.address, 3, 5)
    out, _ = waiting.communicate(timeout=300)
    assert waiting.returncode != 0
    assert "only 1 of 3 Ray nodes joined the cluster" in out, out
