"""One writer at a time for an entry of the model cache.

Replicas that share a cache (compose's `models` volume, a ReadWriteMany PVC) start
together and would otherwise build the same entry at once, the last replacing a folder
another is already loading from. The lock is an flock on a file beside the entry: held
only while building, released by the kernel if its holder dies."""

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def building(entry: Path) -> Iterator[None]:
    """Hold the cache entry `entry`'s lock; the caller checks again inside whether another
    process built it meanwhile."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with (entry.parent / f".{entry.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
