"""The autopilot's startup calibration (API process): requests that drive the scheduler through
every K at one request and at four, so the cost model has this machine's step times before
traffic comes.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from server.engine.autopilot_feed import AutopilotFeed
from server.vllm_plugins.request_args import CALIBRATION_PREFIX

logger = logging.getLogger(__name__)

# Drives the autopilot's calibration steps; any text works, code is typical traffic.
# The lone calibration request's prompt: long enough (~80 tokens) that the draft's first
# catch-up is measured over a prompt's worth of positions, not a handful (the policy prices
# catch-ups per token from it). The batch round's prompts are short: a batch prefill is slow.
CALIBRATION_PROMPT = (
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list, keeping duplicates."""\n'
    "    merged: list[int] = []\n"
    "    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            merged.append(left[i])\n"
    "            i += 1\n"
)
CALIBRATION_BATCH_PROMPT = "def fibonacci(n):\n    "
# Cycles of K = 0..Kmax the calibration runs at each of its batch sizes.
CALIBRATION_CYCLES = 3


async def calibrate(
    llm: Any, tokenize: Callable[[str], list[int]], k_max: int, feed: AutopilotFeed
) -> None:
    """Drive the autopilot's calibration: a lone request, then four at once,
    while the scheduler cycles K through 0..Kmax (two steps each) for them."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    started = time.perf_counter()
    # Tokens for one whole cycle (each K held two steps) even where every draft is accepted.
    cycle_tokens = (k_max + 1) * (k_max + 2)

    def params(cycles: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=cycles * cycle_tokens + 2,
            temperature=0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    lone = TokensPrompt(prompt_token_ids=tokenize(CALIBRATION_PROMPT))
    batched = TokensPrompt(prompt_token_ids=tokenize(CALIBRATION_BATCH_PROMPT))

    async def run(index: int, prompt: TokensPrompt, cycles: int) -> None:
        request_id = f"{CALIBRATION_PREFIX}{index}"
        async for _ in llm.generate(prompt, params(cycles), request_id):
            pass

    # Each batch size three cycles, and the cost model reads each shape as the median of
    # its samples: one slow step (the first steps of a new shape run slow on a CPU, its
    # kernels warming up) or one lucky one must not stand for a K the controller may then
    # never try again.
    await run(0, lone, cycles=CALIBRATION_CYCLES)
    await asyncio.gather(*(run(index, batched, cycles=CALIBRATION_CYCLES) for index in range(1, 5)))
    state = feed.scheduler()
    spread = state.get("step_spread_by_shape") or {}
    widest = max(spread, key=spread.__getitem__, default=None)
    logger.info(
        "speculation autopilot calibrated in %.1f s (cost model ready: %s; draft %s s per "
        "position, plain step %s s; cycles differed by up to %s)",
        time.perf_counter() - started,
        state.get("cost_ready"),
        _rounded(state.get("draft_seconds_per_token")),
        _rounded(state.get("plain_step_seconds")),
        f"{spread[widest]:.0%} at {widest} (batch x K)" if widest else "n/a",
    )


def _rounded(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.3g}"
