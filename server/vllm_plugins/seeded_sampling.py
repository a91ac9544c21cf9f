"""Seeded sampling that repeats whatever K a step runs at (vLLM glue, worker process).

vLLM draws a seeded request's random numbers from one `torch.Generator` per
request, in the order its steps consume them: a verify step of K drafts draws K
uniforms, a recovery row and the bonus token's noise, a step without drafts
only the latter. So the same seed gives another text as soon as K changes (the
autopilot's choice, the batch cut-off under load, a neighbour's `logit_bias`).

Here the noise that decides the token at sequence position p of a seeded
request comes from a generator seeded by (seed, p) alone, and that token is
always vLLM's own sampler's Gumbel-max choice over the processed target logits
at p (temperature, top-k/top-p, penalties, grammar) with that noise:

- a step's sampled token (no drafts, or the bonus after accepted drafts) goes
  through vLLM's sampler, handed the keyed generator;
- at a verified draft position the target's choice is computed the same way;
  the draft token is accepted iff it equals it, and the first position where
  they differ emits the target's choice.

A seeded request's text is therefore what the engine gives for that seed
without speculation: drafts only decide how many of its tokens a step emits.
Each token is still an exact sample from the target's distribution (Gumbel-max
with fresh noise per position), and with vLLM's greedy draft a draft token is
accepted with probability p(draft token), as under rejection sampling.
Unseeded and greedy requests are untouched.

`install()` is a `vllm.general_plugins` entry point, active in engine processes
where the engine enabled the patch (`registry`, which checked its hooks);
an exception in it hands sampling back to vLLM's own code for the rest of the
process. `SEEDED_SAMPLING` declares the patch for the registry.
"""

import hashlib
import inspect
from dataclasses import replace
from typing import Any

from server.vllm_plugins import patching
from server.vllm_plugins.vllm_source import Hook

SEEDED_SAMPLING = patching.Patch(
    "seeded_sampling",
    "a seeded request's text independent of K (otherwise it follows K)",
    (
        Hook(
            "vllm.v1.worker.gpu_model_runner",
            "GPUModelRunner._sample",
            ("logits", "spec_decode_metadata"),
        ),
        Hook(
            "vllm.v1.worker.gpu_model_runner",
            "GPUModelRunner",
            members=("input_batch", "query_start_loc", "positions", "requests", "sampler"),
        ),
        Hook(
            "vllm.v1.sample.rejection_sampler",
            "rejection_sample",
            (
                "draft_token_ids",
                "num_draft_tokens",
                "max_spec_len",
                "target_logits",
                "bonus_token_ids",
                "sampling_metadata",
            ),
        ),
        Hook("vllm.v1.sample.sampler", "Sampler", members=("topk_topp_sampler",)),
        Hook("vllm.v1.sample.metadata", "SamplingMetadata", members=("generators",)),
        Hook("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata", members=("num_draft_tokens",)),
        Hook("vllm.v1.worker.gpu_input_batch", "InputBatch", members=("sampling_metadata",)),
    ),
    v1_runner=True,
    plugin="specserve_position_keyed_seeds",
)

PLACEHOLDER_TOKEN_ID = -1  # vLLM's rejection sampler's mark for "no token here"


def position_key(seed: int, position: int) -> int:
    """The generator seed for a request's seed and a sequence position: a hash, so nearby
    seeds and positions give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class KeyedGenerators(dict[int, Any]):
    """A step's generators (batch row -> generator keyed at the row's sampled position),
    and what the rejection sampler needs to key the draft positions before it."""

    def __init__(self, device: Any, choose: Any) -> None:
        super().__init__()
        self.device = device
        self.choose = choose  # vLLM's TopKTopPSampler: the noise and argmax of its platform
        self.first_positions: dict[int, tuple[int, int]] = {}  # row -> (seed, first position)

    def generator(self, seed: int, position: int) -> Any:
        import torch

        generator = torch.Generator(device=self.device)
        generator.manual_seed(position_key(seed, position))
        return generator


def install() -> None:
    """`vllm.general_plugins` hook: key seeded requests' noise by position, in engine
    processes where specserve enabled the patch."""
    if not patching.enabled("seeded_sampling"):
        return
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if patching.is_replaced(GPUModelRunner._sample):
        return
    original_sample = GPUModelRunner._sample
    original_rejection_sample = rejection_sampler.rejection_sample
    signature = inspect.signature(original_rejection_sample)

    @patching.contained(SEEDED_SAMPLING, original_sample)
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        batch = self.input_batch
        metadata = batch.sampling_metadata
        if logits is None or not metadata.generators:
            return original_sample(self, logits, spec_decode_metadata)
        keyed = _keyed_generators(self, metadata.generators, spec_decode_metadata)
        batch.sampling_metadata = replace(metadata, generators=keyed)
        try:
            return original_sample(self, logits, spec_decode_metadata)
        finally:
            batch.sampling_metadata = metadata

    def vllms_own(*args: Any, **kwargs: Any) -> Any:
        """vLLM's rejection sampling, with the request's own generators where the step
        keyed them (whose draws then follow K again)."""
        values = signature.bind(*args, **kwargs).arguments
        metadata = values["sampling_metadata"]
        if isinstance(metadata.generators, KeyedGenerators):
            values["sampling_metadata"] = replace(metadata, generators=dict(metadata.generators))
        return original_rejection_sample(**values)

    @patching.contained(SEEDED_SAMPLING, vllms_own)
    def rejection_sample(*args: Any, **kwargs: Any) -> Any:
        values = signature.bind(*args, **kwargs).arguments
        metadata = values["sampling_metadata"]
        keyed = metadata.generators
        if not isinstance(keyed, KeyedGenerators):
            return original_rejection_sample(*args, **kwargs)
        tokens = _target_choices(keyed, values)
        values["sampling_metadata"] = replace(metadata, generators={})
        output = original_rejection_sample(**values)
        _write_coupled_rows(output, keyed, values, tokens)
        return output

    patching.mark(_sample, original_sample)
    patching.mark(rejection_sample, original_rejection_sample)
    GPUModelRunner._sample = _sample  # type: ignore[method-assign]
    rejection_sampler.rejection_sample = rejection_sample


def _keyed_generators(runner: Any, generators: dict[int, Any], spec: Any) -> KeyedGenerators:
    """One generator per seeded row, keyed at the position this step samples for it without a
    draft (the bonus slot, after the step's last input token); the row's drafts sit before."""
    import torch

    batch = runner.input_batch
    rows = sorted(generators)
    last_tokens = [int(runner.query_start_loc.np[row + 1]) - 1 for row in rows]
    index = torch.tensor(last_tokens, dtype=torch.int64, device=runner.positions.device)
    # The positions the model ran at this step: right under async scheduling too, where
    # the runner's own token counts are corrected later.
    last_positions = runner.positions[index].tolist()
    keyed = KeyedGenerators(runner.device, runner.sampler.topk_topp_sampler)
    for row, last in zip(rows, last_positions, strict=True):
        seed = runner.requests[batch.req_ids[row]].sampling_params.seed
        drafts = spec.num_draft_tokens[row] if spec is not None else 0
        keyed[row] = keyed.generator(seed, last + 1)
        keyed.first_positions[row] = (seed, last + 1 - drafts)
    return keyed


def _draft_starts(num_drafts: list[int]) -> list[int]:
    """Where each row's drafts start in the flat draft (and target logits) rows."""
    starts = [0]
    for count in num_drafts[:-1]:
        starts.append(starts[-1] + count)
    return starts


def _target_choices(keyed: KeyedGenerators, values: dict[str, Any]) -> list[int]:
    """The target's keyed choice at every draft position of the seeded rows, in row order."""
    num_drafts = values["num_draft_tokens"]
    starts = _draft_starts(num_drafts)
    logit_rows: list[int] = []
    generators: dict[int, Any] = {}
    for row, (seed, first) in sorted(keyed.first_positions.items()):
        for offset in range(num_drafts[row]):
            generators[len(logit_rows)] = keyed.generator(seed, first + offset)
            logit_rows.append(starts[row] + offset)
    if not logit_rows:
        return []
    # Top-k/top-p are already applied to these logits (as the plain sampler applies them
    # before its noise), so the chooser only adds the keyed noise and takes the argmax.
    chosen, _ = keyed.choose(values["target_logits"][logit_rows], generators, None, None)
    return [int(token) for token in chosen.tolist()]


def _write_coupled_rows(
    output: Any, keyed: KeyedGenerators, values: dict[str, Any], choices: list[int]
) -> None:
    """Each seeded row's tokens: the accepted draft prefix (where draft and target chose
    alike), then the target's choice where they first differ, or the bonus after all."""
    import torch

    num_drafts = values["num_draft_tokens"]
    drafts = values["draft_token_ids"].tolist()
    bonus = values["bonus_token_ids"].view(-1).tolist()
    starts = _draft_starts(num_drafts)
    taken = 0
    for row in sorted(keyed.first_positions):
        count = num_drafts[row]
        if count == 0:
            continue  # the bonus alone, already the keyed sampler's
        mine = choices[taken : taken + count]
        taken += count
        proposed = drafts[starts[row] : starts[row] + count]
        accepted = 0
        while accepted < count and mine[accepted] == proposed[accepted]:
            accepted += 1
        tokens = mine[: accepted + 1] if accepted < count else [*mine, bonus[row]]
        output[row].fill_(PLACEHOLDER_TOKEN_ID)
        output[row, : len(tokens)] = torch.tensor(tokens, dtype=output.dtype)
