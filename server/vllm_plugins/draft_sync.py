"""The draft model idles at K=0 and catches up when speculation resumes (vLLM glue).

vLLM 0.32 runs the draft's first forward pass on every step even when the
step's K is 0, "to keep the drafter KV cache in sync", so a speculative server
with speculation off still pays for the draft. Here, in the worker process:

- at K=0 the draft does not run at all: `propose` returns no draft tokens;
- each request remembers up to which position the draft's KV cache is valid;
- when K>0 resumes, one batched draft prefill over every request's missed
  positions (token ids from the runner's input batch, KV slots from the block
  table the draft shares with the target) runs before the normal proposal, so
  acceptance after a pause is what it would have been without one;
- a prompt prefix served from vLLM's prefix cache comes in KV blocks another
  request computed, maybe while the draft idled: the draft's KV is taken as
  valid over the blocks it wrote in full since the target last wrote them,
  and caught up on over the rest, so a cached prefix is not prefilled again
  by the draft unless its draft KV was never written.

The target verifies every draft token, so a stale draft could only lower
acceptance, never change the output. Forward passes and caught-up tokens are
counted and reported to the front end. `install()` patches vLLM's classes once
per process where the engine enabled the patch (`registry`, which checked its
hooks); an exception in the catch-up hands the draft back to vLLM's own code
(it then runs at K=0 again) for the rest of the process. `DRAFT_IDLE` declares the
patch for the registry.
"""

import inspect
import logging
from dataclasses import replace
from typing import Any

from server.autopilot.reports import DraftReport
from server.vllm_plugins import patching
from server.vllm_plugins.autopilot_report import Reporter
from server.vllm_plugins.vllm_source import Hook

logger = logging.getLogger(__name__)

DRAFT_IDLE = patching.Patch(
    "draft_idle",
    "the draft idles at K=0 and catches up after (otherwise it runs every step)",
    (
        Hook(
            "vllm.v1.spec_decode.draft_model",
            "DraftModelProposer.propose",
            (
                "num_speculative_tokens",
                "target_positions",
                "common_attn_metadata",
                "num_rejected_tokens_gpu",
            ),
        ),
        Hook(
            "vllm.v1.spec_decode.draft_model",
            "DraftModelProposer",
            members=(
                "propose",
                "max_num_tokens",
                "input_ids",
                "positions",
                "block_size",
                "model",
                "vllm_config",
                "num_speculative_tokens",
                "use_heterogeneous_vocab",
                "vocab_mapping",
                "_last_draft_probs",
                "_set_positions",
                "build_per_group_and_layer_attn_metadata",
                "_determine_batch_execution_and_padding",
                "build_model_inputs_first_pass",
                "_get_slot_mapping",
            ),
        ),
        Hook(
            "vllm.v1.worker.gpu_model_runner",
            "GPUModelRunner",
            members=("propose_draft_token_ids", "drafter", "input_batch", "requests"),
        ),
        Hook("vllm.v1.worker.gpu_input_batch", "InputBatch", members=("req_ids", "token_ids_cpu")),
        Hook(
            "vllm.v1.attention.backend",
            "CommonAttentionMetadata",
            members=(
                "query_start_loc",
                "query_start_loc_cpu",
                "seq_lens",
                "num_reqs",
                "num_actual_tokens",
                "max_query_len",
                "max_seq_len",
                "block_table_tensor",
                "slot_mapping",
                "positions",
                "is_prefilling",
                "seq_lens_cpu_upper_bound",
            ),
        ),
        Hook(
            "vllm.forward_context",
            "set_forward_context",
            ("num_tokens", "num_tokens_across_dp", "cudagraph_runtime_mode", "slot_mapping"),
        ),
    ),
    v1_runner=True,
    speculation_only=True,
    plugin="specserve_draft_idle_at_zero",
)


class DraftSync:
    """Per-request "draft KV valid below this position", and the counts."""

    def __init__(self) -> None:
        self.valid_until: dict[str, int] = {}
        # Physical KV blocks holding the draft's KV at every position of the block's tokens.
        self.draft_blocks: set[int] = set()
        self.forward_passes = 0
        self.caught_up_tokens = 0
        self.catch_up_passes = 0
        self.skipped_steps = 0
        self._reporter = Reporter("draft", patching.report_socket())

    def report(self) -> None:
        report: DraftReport = {
            "draft_forward_passes": self.forward_passes,
            "draft_caught_up_tokens": self.caught_up_tokens,
            "draft_catch_up_passes": self.catch_up_passes,
            "draft_skipped_steps": self.skipped_steps,
        }
        self._reporter.send(report)


def install() -> None:
    """`vllm.general_plugins` hook: patch the draft-model proposer and the runner method
    that feeds it the batch, in engine processes where specserve enabled the patch."""
    if not patching.enabled("draft_idle"):
        return
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if patching.is_replaced(DraftModelProposer.propose):
        return
    original_propose = DraftModelProposer.propose
    original_hook = GPUModelRunner.propose_draft_token_ids
    signature = inspect.signature(original_propose)

    def propose_draft_token_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # The proposer sees tensors only; the catch-up needs request ids and
        # token ids, which live on the runner's input batch.
        self.drafter.specserve_input_batch = self.input_batch
        self.drafter.specserve_live_requests = self.requests
        return original_hook(self, scheduler_output, *args, **kwargs)

    def vllms_own(proposer: Any, original: Any, values: dict[str, Any]) -> Any:
        return original(**values)

    guarded = patching.contained(DRAFT_IDLE, vllms_own)(_propose)

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(self, *args, **kwargs).arguments
        return guarded(self, original_propose, arguments)

    patching.mark(propose, original_propose)
    patching.mark(propose_draft_token_ids, original_hook)
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids  # type: ignore[method-assign]
    DraftModelProposer.propose = propose  # type: ignore[method-assign]


def _propose(proposer: Any, original: Any, values: dict[str, Any]) -> Any:
    """The draft's step: nothing at K=0, else the catch-up, then vLLM's own proposal."""
    import torch

    sync = _sync_of(proposer)
    num_speculative_tokens = values["num_speculative_tokens"]
    cad = values["common_attn_metadata"]
    batch = proposer.specserve_input_batch
    req_ids: list[str] = list(batch.req_ids[: cad.num_reqs])
    query_start = cad.query_start_loc_cpu.tolist()
    positions = values["target_positions"]
    # Each request's first position this step, read back in one transfer.
    starts: list[int] = positions[cad.query_start_loc[: cad.num_reqs]].tolist()
    _forget_finished(sync, proposer.specserve_live_requests)
    table, block_size = cad.block_table_tensor, proposer.block_size
    for row, (req_id, start) in enumerate(zip(req_ids, starts, strict=True)):
        if req_id not in sync.valid_until:
            sync.valid_until[req_id] = _draft_valid_prefix(sync, table[row], start, block_size)
        # The target writes this step's positions: their blocks hold new tokens' KV now.
        end = start + query_start[row + 1] - query_start[row]
        sync.draft_blocks.difference_update(
            table[row, start // block_size : (end - 1) // block_size + 1].tolist()
        )
    if num_speculative_tokens == 0:
        # The draft did not see these positions: its KV is valid only below
        # each query's start (a recomputed, preempted request starts lower).
        for req_id, start in zip(req_ids, starts, strict=True):
            sync.valid_until[req_id] = min(sync.valid_until.get(req_id, 0), start)
        sync.skipped_steps += 1
        sync.report()
        proposer.num_speculative_tokens = 0
        proposer._last_draft_probs = None
        return torch.empty(cad.num_reqs, 0, dtype=torch.int64, device=positions.device)
    written_from = [
        min(sync.valid_until[r], start) for r, start in zip(req_ids, starts, strict=True)
    ]
    _catch_up(proposer, sync, cad, batch, req_ids, starts)
    result = original(**values)
    sync.forward_passes += num_speculative_tokens
    rejected = values.get("num_rejected_tokens_gpu")
    rejected_list = [0] * cad.num_reqs if rejected is None else rejected.tolist()
    for i, req_id in enumerate(req_ids):
        query_len = query_start[i + 1] - query_start[i]
        valid = sync.valid_until[req_id]
        if valid >= starts[i]:
            valid = sync.valid_until[req_id] = starts[i] + query_len - int(rejected_list[i])
        # else the catch-up ran out of token budget before this step's positions: the draft's
        # KV stays valid only up to where it got, and the next catch-up goes on from there.
        # Blocks the draft wrote this step (catch-up included) and that lie wholly below
        # its valid KV.
        sync.draft_blocks.update(
            table[i, written_from[i] // block_size : valid // block_size].tolist()
        )
    sync.report()
    return result


def _sync_of(proposer: Any) -> DraftSync:
    sync = getattr(proposer, "specserve_sync", None)
    if sync is None:
        sync = proposer.specserve_sync = DraftSync()
    return sync


def _draft_valid_prefix(sync: DraftSync, blocks: Any, start: int, block_size: int) -> int:
    """Where a new request's draft KV stops being valid: its first position this step lies past
    whatever prefix the prefix cache served, valid for the draft over its leading blocks that
    the draft wrote in full."""
    valid = 0
    for block in blocks[: start // block_size].tolist():
        if block not in sync.draft_blocks:
            break
        valid += block_size
    return valid


def _forget_finished(sync: DraftSync, live_requests: Any) -> None:
    for req_id in [r for r in sync.valid_until if r not in live_requests]:
        del sync.valid_until[req_id]


def _catch_up(
    proposer: Any, sync: DraftSync, cad: Any, batch: Any, req_ids: list[str], starts: list[int]
) -> None:
    """One draft forward pass over the positions each request missed while
    the draft idled, bounded by the proposer's token buffers."""
    patching.fault_point("draft_catch_up")
    import numpy as np
    import torch
    from vllm.forward_context import set_forward_context

    budget = proposer.max_num_tokens
    rows: list[int] = []
    spans: list[tuple[int, int]] = []
    for row, (req_id, start) in enumerate(zip(req_ids, starts, strict=True)):
        begin = min(sync.valid_until.get(req_id, 0), start)
        end = min(start, begin + budget)
        if end > begin:
            rows.append(row)
            spans.append((begin, end))
            budget -= end - begin
        if budget <= 0:
            break
    if not rows:
        return
    token_ids = np.concatenate(
        [batch.token_ids_cpu[row, b:e] for row, (b, e) in zip(rows, spans, strict=True)]
    )
    positions = torch.cat([torch.arange(b, e, dtype=torch.int64) for b, e in spans])
    lengths = [e - b for b, e in spans]
    block_table = cad.block_table_tensor[rows]
    block_size = proposer.block_size
    row_of_token = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    slots = block_table[row_of_token, positions // block_size].to(torch.int64) * block_size + (
        positions % block_size
    )
    query_start = torch.zeros(len(rows) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    seq_lens = torch.tensor([e for _, e in spans], dtype=torch.int32)
    num_tokens = int(query_start[-1])
    gap_cad = replace(
        cad,
        query_start_loc=query_start.to(cad.query_start_loc.device),
        query_start_loc_cpu=query_start,
        seq_lens=seq_lens.to(cad.seq_lens.device),
        num_reqs=len(rows),
        num_actual_tokens=num_tokens,
        max_query_len=max(lengths),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=slots.to(cad.slot_mapping.device),
        positions=None,
        is_prefilling=None,
        seq_lens_cpu_upper_bound=None,
    )
    ids = torch.from_numpy(token_ids.astype(np.int64)).to(proposer.input_ids.device)
    if proposer.use_heterogeneous_vocab:
        ids = proposer.vocab_mapping.map_target_to_draft_ids(ids)
    proposer.input_ids[:num_tokens] = ids
    proposer._set_positions(num_tokens, positions.to(proposer.positions.device))
    _, per_layer = proposer.build_per_group_and_layer_attn_metadata(gap_cad)
    mode, num_input_tokens, across_dp = proposer._determine_batch_execution_and_padding(num_tokens)
    model_kwargs, slot_size = proposer.build_model_inputs_first_pass(
        num_tokens, num_input_tokens, None
    )
    with set_forward_context(
        per_layer,
        proposer.vllm_config,
        num_tokens=num_input_tokens,
        num_tokens_across_dp=across_dp,
        cudagraph_runtime_mode=mode,
        slot_mapping=proposer._get_slot_mapping(slot_size, gap_cad.slot_mapping),
    ):
        proposer.model(**model_kwargs)
    sync.forward_passes += 1
    sync.catch_up_passes += 1
    sync.caught_up_tokens += num_tokens
    for row, (_, end) in zip(rows, spans, strict=True):
        sync.valid_until[req_ids[row]] = end
