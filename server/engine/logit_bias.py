"""The API process's half of the logit_bias patch: vLLM's request checks here let
`logit_bias` pass with speculation.

vllm_plugins/logit_bias.py holds the worker's half (the LogitBias processor built under
speculation), the patch's declaration (both halves' hooks) and why biased requests are safe
with speculation on. The engine calls
`allow_in_request_checks()` once the registry found both halves' hooks: vLLM's spec-decode
check runs as before on a copy without `logit_bias`, so `min_p` and whatever else vLLM
refuses there stays refused. Not contained, as the worker's half is not
(vllm_plugins/logit_bias.py says why).
"""

import copy
from typing import Any

from server.vllm_plugins import patching


def allow_in_request_checks() -> None:
    """Let vLLM's request checks in this process pass `logit_bias` with speculation."""
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode
    if patching.is_replaced(original):
        return

    def validate_spec_decode(self: Any, speculative_config: Any) -> None:
        without_bias = copy.copy(self)
        without_bias.logit_bias = None
        original(without_bias, speculative_config)

    patching.mark(validate_spec_decode, original)
    SamplingParams._validate_spec_decode = validate_spec_decode  # type: ignore[method-assign]
