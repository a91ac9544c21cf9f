"""Joining the Ray cluster of a multi-node replica (API process): its leader starts the engine
only once every node (its own and each worker's) has joined, or stops with one clear line.

vLLM places the engine's ranks on the cluster's GPUs when the engine starts; started before the
workers join, it would find too few and fail (or, worse, place every rank on the leader).
"""

import logging
import os
import time

from server.config import ConfigError

logger = logging.getLogger(__name__)

_POLL_SECONDS = 2.0


def wait_for_ray_nodes(count: int, timeout_seconds: float, address: str | None = None) -> int:
    """Block until the Ray cluster at `address` (RAY_ADDRESS, else the one this machine runs)
    has `count` live nodes; return how many it has. ConfigError when none is reachable or
    the nodes have not joined within `timeout_seconds`."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as exc:
        raise ConfigError(f"no Ray cluster at {address}: {exc}") from exc
    try:
        deadline = time.monotonic() + timeout_seconds
        reported = -1
        while True:
            alive = sum(1 for node in ray.nodes() if node["Alive"])
            if alive >= count:
                logger.info("Ray cluster at %s: %d of %d nodes joined", address, alive, count)
                return alive
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"only {alive} of {count} Ray nodes joined the cluster at {address} in "
                    f"{timeout_seconds:.0f} s (--ray-nodes, --ray-join-timeout-seconds)"
                )
            if alive != reported:
                logger.info("waiting for Ray nodes at %s: %d of %d joined", address, alive, count)
                reported = alive
            time.sleep(_POLL_SECONDS)
    finally:
        ray.shutdown()
