"""API keys and the tenants they belong to.

The key file is JSON: `{"keys": [{"key": "sk-...", "tenant": "team-a"}, ...]}`;
an entry may also set the tenant's `requests_per_minute` and
`tokens_per_minute` (keys of one tenant share its limits, so they must agree).
Keys are kept only as SHA-256 digests and checked in constant time against
every entry, so neither the comparison nor its early exit leaks a key. A
tenant name becomes a metrics label, so the set stays as small as the file.
"""

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from server.config import ConfigError
from server.rate_limit import TenantLimits


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
