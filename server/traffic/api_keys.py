"""API keys and the tenants they belong to.

The key file is JSON: `{"keys": [{"key": "sk-...", "tenant": "team-a"}, ...]}`;
an entry may also set the tenant's `requests_per_minute` and
`tokens_per_minute` (keys of one tenant share its limits, so they must agree).
Keys are kept only as SHA-256 digests and checked in constant time against
every entry, so neither the comparison nor its early exit leaks a key. A
tenant name becomes a metrics label, so the set stays as small as the file.

Keys rotate without a restart: `ApiKeys` holds the ring in force and swaps in
the file's contents whole on SIGHUP (the process runner calls `reload`) and
when the file changes (`watch` polls it; a Kubernetes Secret update swaps the
mounted file). A file that does not load leaves the old keys in force and the
reason in the log. A request is checked once, when it arrives, so requests
already running are untouched by a rotation.
"""

import asyncio
import hashlib
import hmac
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.config import ConfigError
from server.traffic.rate_limit import TenantLimits

logger = logging.getLogger(__name__)

# How often `ApiKeys.watch` looks at the key file; a rotation takes effect within this.
KEY_FILE_POLL_SECONDS = 5.0


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    tenant: str


class KeyRing:
    """Maps a presented API key to its tenant."""

    def __init__(self, keys: dict[str, str], limits: dict[str, TenantLimits] | None = None) -> None:
        self._entries = [_Entry(_digest(key), tenant) for key, tenant in keys.items()]
        self.limits = limits or {}

    def tenant_for(self, presented: str) -> str | None:
        digest = _digest(presented)
        tenant = None
        for entry in self._entries:  # no early exit: every key costs the same
            if hmac.compare_digest(digest, entry.digest):
                tenant = entry.tenant
        return tenant

    @property
    def tenants(self) -> set[str]:
        return {entry.tenant for entry in self._entries}


class ApiKeys:
    """The key ring in force, and the file it is reloaded from (None: fixed keys)."""

    def __init__(self, ring: KeyRing, path: Path | None = None) -> None:
        self.ring = ring
        self._path = path
        self._listeners: list[Callable[[KeyRing], None]] = []
        self._file_state = _file_state(path) if path is not None else None

    def on_change(self, listener: Callable[[KeyRing], None]) -> None:
        """Call `listener` with each newly loaded ring (the rate limiter's limits)."""
        self._listeners.append(listener)

    def reload(self) -> bool:
        """Load the key file and put it in force; a bad file keeps the current keys."""
        if self._path is None:
            logger.info("no api key file to reload")
            return False
        self._file_state = _file_state(self._path)
        try:
            ring = load_key_ring(self._path)
        except ConfigError as exc:
            logger.error("api key file not reloaded, the previous keys stay in force: %s", exc)
            return False
        self.ring = ring  # one assignment: a request sees the old ring or the new one
        for listener in self._listeners:
            listener(ring)
        logger.info("api keys reloaded: %d tenants", len(ring.tenants))
        return True

    async def watch(self, interval_seconds: float = KEY_FILE_POLL_SECONDS) -> None:
        """Reload whenever the key file changes (its inode, size or modification time)."""
        if self._path is None:
            return
        while True:
            await asyncio.sleep(interval_seconds)
            if _file_state(self._path) != self._file_state:
                self.reload()


def _file_state(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)  # follows the symlink a mounted Secret swaps
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_key_ring(path: Path) -> KeyRing:
    """Read and check the key file; a bad file is a startup error."""
    try:
        data = json.loads(path.read_text())
        entries = data["keys"]
        keys = {str(e["key"]): str(e["tenant"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"api key file {path} must be JSON like "
            '{"keys": [{"key": "...", "tenant": "..."}]}: ' + str(exc)
        ) from exc
    if not keys:
        raise ConfigError(f"api key file {path} holds no keys")
    if len(keys) != len(entries):
        raise ConfigError(f"api key file {path} lists a key twice")
    if any(not key or not tenant for key, tenant in keys.items()):
        raise ConfigError(f"api key file {path} has an empty key or tenant")
    limits: dict[str, TenantLimits] = {}
    for entry in entries:
        tenant = str(entry["tenant"])
        entry_limits = TenantLimits(
            _limit(path, entry, "requests_per_minute"), _limit(path, entry, "tokens_per_minute")
        )
        if limits.setdefault(tenant, entry_limits) != entry_limits:
            raise ConfigError(f"api key file {path} gives tenant {tenant} different limits")
    return KeyRing(keys, limits)


def _limit(path: Path, entry: dict[str, object], name: str) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"api key file {path}: {name} must be a positive integer, got {value!r}")
    return value
