"""OpenAI's `logit_bias` with speculation on (vLLM glue; this module: the worker's half).

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

- `allow_in_request_checks()` (API process, called by the engine; in
  engine/logit_bias.py, since it runs there): vLLM's spec-decode check runs as
  before on a copy without `logit_bias`, so `min_p` and whatever else vLLM
  refuses there stays refused;
- `install()` here (`vllm.general_plugins` entry point, worker process, where the
  engine enabled the patch): `build_logitsprocs` adds the LogitBias processor
  to what vLLM builds under speculation.

Both only where `registry` finds what they patch (and the autopilot's
scheduler runs); otherwise vLLM's refusal stays in place. Neither is contained:
a builder that failed would leave a bias accepted and not applied. `LOGIT_BIAS`
declares the patch, both halves' hooks, for the registry.
"""

from typing import Any

from server.vllm_plugins import patching
from server.vllm_plugins.vllm_source import Hook

LOGIT_BIAS = patching.Patch(
    "logit_bias",
    "logit_bias with speculation on (otherwise a 400)",
    (
        Hook("vllm.sampling_params", "SamplingParams._validate_spec_decode"),
        Hook(
            "vllm.v1.worker.gpu_model_runner",
            "build_logitsprocs",
            (
                "vllm_config",
                "device",
                "is_pin_memory",
                "is_pooling_model",
                "custom_logitsprocs",
            ),
        ),
        Hook("vllm.v1.sample.logits_processor.builtin", "LogitBiasLogitsProcessor"),
        Hook("vllm.v1.sample.logits_processor.state", "LogitsProcessors", members=("all",)),
    ),
    needs=("autopilot",),
    v1_runner=True,
    speculation_only=True,
    plugin="specserve_logit_bias_under_speculation",
)


def install() -> None:
    """`vllm.general_plugins` hook: build the LogitBias processor under speculation too,
    in engine processes where specserve enabled the patch."""
    if not patching.enabled("logit_bias"):
        return
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor
    from vllm.v1.worker import gpu_model_runner

    original = gpu_model_runner.build_logitsprocs
    if patching.is_replaced(original):
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

    patching.mark(build_logitsprocs, original)
    gpu_model_runner.build_logitsprocs = build_logitsprocs
