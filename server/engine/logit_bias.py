"""OpenAI's `logit_bias` with speculation on (vLLM glue).

vLLM 0.32 refuses `logit_bias` whenever speculation is configured: the
rejection sampler does not add the bias to the target's logits at verified
draft positions, so an accepted draft could be a token the bias bans. It
refuses it in `SamplingParams._validate_spec_decode` (front end) and does not
even build the `LogitBiasLogitsProcessor` in the worker (`build_logitsprocs`).

specserve keeps biased requests away from drafts instead: the autopilot
scheduler runs every step that holds one at K=0 (reason "logit_bias").
Drafts are proposed at the end of a step for that step's requests only, so a
biased request never has one to verify (in its first step, neighbours may
still verify drafts proposed before it came). Under speculation the rejection
sampler runs even at K=0, but a row without drafts gets its "bonus" token,
drawn by vLLM's plain `Sampler`, which applies every non-argmax-invariant
logits processor, LogitBias included. Two narrow patches make that reachable:

- `allow_in_request_checks()` (front-end process, called by the engine):
  vLLM's spec-decode check runs as before on a copy without `logit_bias`,
  so `min_p` and whatever else vLLM refuses there stays refused;
- `install()` (`vllm.general_plugins` entry point, worker process, only when
  `ENABLED_ENV` is set by specserve's engine): `build_logitsprocs` adds the
  LogitBias processor to what vLLM builds under speculation.

Both only where `missing_hooks()` finds what they patch; otherwise vLLM's
refusal stays in place.
"""

import copy
import inspect
import logging
import os
from importlib.metadata import entry_points
from typing import Any

logger = logging.getLogger(__name__)

ENABLED_ENV = "SPECSERVE_LOGIT_BIAS_UNDER_SPECULATION"
# This module's entry point in pyproject.toml; VLLM_PLUGINS may leave it out.
PLUGIN_NAME = "specserve_logit_bias_under_speculation"
_BUILD_PARAMETERS = (
    "vllm_config",
    "device",
    "is_pin_memory",
    "is_pooling_model",
    "custom_logitsprocs",
)


def missing_hooks() -> str | None:
    """What this vLLM (or its plugin allowlist) lacks for logit_bias under speculation, or None."""
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor  # noqa: F401
        from vllm.v1.worker import gpu_model_runner
    except ImportError as exc:
        return str(exc)
    if not hasattr(SamplingParams, "_validate_spec_decode"):
        return "SamplingParams._validate_spec_decode"
    build = getattr(gpu_model_runner, "build_logitsprocs", None)
    if build is None:
        return "gpu_model_runner.build_logitsprocs"
    build = getattr(build, "specserve_original", build)
    if tuple(inspect.signature(build).parameters) != _BUILD_PARAMETERS:
        return f"build_logitsprocs({', '.join(_BUILD_PARAMETERS)})"
    if PLUGIN_NAME not in {e.name for e in entry_points(group="vllm.general_plugins")}:
        # An install older than this module: the worker would never build the processor.
        return f"the {PLUGIN_NAME} plugin (reinstall specserve: make install)"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        return f"the {PLUGIN_NAME} plugin (VLLM_PLUGINS leaves it out)"
    return None


def allow_in_request_checks() -> None:
    """Let vLLM's request checks in this process pass `logit_bias` with speculation."""
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode
    if hasattr(original, "specserve_original"):
        return

    def validate_spec_decode(self: Any, speculative_config: Any) -> None:
        without_bias = copy.copy(self)
        without_bias.logit_bias = None
        original(without_bias, speculative_config)

    validate_spec_decode.specserve_original = original  # type: ignore[attr-defined]
    SamplingParams._validate_spec_decode = validate_spec_decode  # type: ignore[method-assign]


def install() -> None:
    """`vllm.general_plugins` hook: build the LogitBias processor under speculation too,
    in engine processes specserve started."""
    if not os.environ.get(ENABLED_ENV):
        return
    missing = missing_hooks()
    if missing is not None:
        # The engine checked the same before setting ENABLED_ENV; say it if this process differs.
        logger.warning("specserve: logit_bias processor not built (vLLM lacks %s)", missing)
        return
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor
    from vllm.v1.worker import gpu_model_runner

    original = gpu_model_runner.build_logitsprocs
    if hasattr(original, "specserve_original"):
        return

    def build_logitsprocs(
        vllm_config: Any,
        device: Any,
        is_pin_memory: bool,
        is_pooling_model: bool,
        custom_logitsprocs: Any = (),
    ) -> Any:
        processors = original(
            vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs
        )
        if vllm_config.speculative_config is None or is_pooling_model:
            return processors
        bias = LogitBiasLogitsProcessor(vllm_config, device, is_pin_memory)
        return LogitsProcessors([*processors.all, bias])

    build_logitsprocs.specserve_original = original  # type: ignore[attr-defined]
    gpu_model_runner.build_logitsprocs = build_logitsprocs
