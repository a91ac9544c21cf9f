"""The draft's trimmed output head (vLLM glue): its greedy proposal over fewer ids.

vLLM's draft proposes `argmax(hidden @ head.T)` over the whole vocabulary; for
Qwen2.5's 151,936 ids that head is a quarter of the draft's bytes read per proposed
token. Here, in the worker process, the draft's greedy proposal becomes the argmax
over two sets of ids instead:

- the first N ids of a frequency ranking (server/weights/draft_vocab.py), whose rows
  of the head are copied once into a packed matrix of their own;
- per request, the ids of its own prompt and output outside those N (the names of a
  file being edited, a rare word the user wrote), whose rows are gathered each step.
  A request is never proposed another request's ids.

The target still verifies every draft token, so the output is unchanged; only
acceptance can drop, when the target's token lies outside both sets. `install()`
patches the proposer once per process where the engine enabled the patch (it builds
on `draft_idle`, which hands the proposer the runner's input batch); a head this
cannot trim (a bias, a quantized head, vLLM's vocabulary mapping) keeps vLLM's
proposal, and an exception hands it back to vLLM for the rest of the process.
`DRAFT_VOCAB` declares the patch for the registry.
"""

import logging
from typing import Any

from server.vllm_plugins import patching
from server.vllm_plugins.autopilot_report import Reporter
from server.vllm_plugins.vllm_source import Hook

logger = logging.getLogger(__name__)

DRAFT_VOCAB = patching.Patch(
    "draft_vocab",
    "the trimmed draft head of --draft-vocab (otherwise the whole head, the same output)",
    (
        Hook(
            "vllm.v1.spec_decode.llm_base_proposer",
            "SpecDecodeBaseProposer._greedy_sample",
            ("hidden_states",),
        ),
        Hook(
            "vllm.v1.spec_decode.draft_model",
            "DraftModelProposer",
            members=(
                "model",
                "use_local_argmax_reduction",
                "use_heterogeneous_vocab",
                "_sample_draft_tokens",
            ),
        ),
        Hook(
            "vllm.v1.worker.gpu_input_batch",
            "InputBatch",
            members=("req_ids", "token_ids_cpu", "num_tokens_no_spec"),
        ),
        Hook(
            "vllm.model_executor.layers.logits_processor",
            "LogitsProcessor",
            members=("org_vocab_size",),
        ),
        Hook(
            "vllm.model_executor.layers.utils",
            "dispatch_cpu_unquantized_gemm",
            ("layer", "remove_weight"),
        ),
    ),
    needs=("draft_idle",),
    v1_runner=True,
    speculation_only=True,
    plugin="specserve_draft_vocab",
    only_when_asked=True,
)


def install() -> None:
    """`vllm.general_plugins` hook: patch the draft's greedy proposal where enabled."""
    if not patching.enabled("draft_vocab"):
        return
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    if patching.is_replaced(DraftModelProposer._greedy_sample):
        return
    original = DraftModelProposer._greedy_sample
    settings = patching.settings()["draft_vocab"]

    def vllms_own(proposer: Any, hidden_states: Any) -> Any:
        return original(proposer, hidden_states)

    guarded = patching.contained(DRAFT_VOCAB, vllms_own)(_greedy_sample)

    def greedy_sample(self: Any, hidden_states: Any) -> Any:
        head = getattr(self, "specserve_head", None)
        if head is None:
            head = self.specserve_head = _TrimmedHead.of(
                self, settings["ranking"], settings["size"]
            )
        if head is False:
            return original(self, hidden_states)
        return guarded(self, hidden_states)

    patching.mark(greedy_sample, original)
    DraftModelProposer._greedy_sample = greedy_sample  # type: ignore[method-assign]


class _TrimmedHead:
    """The kept rows of the draft's head, packed, and each live request's own extra ids."""

    def __init__(self, weight: Any, kept: list[int]) -> None:
        import numpy as np
        import torch

        self.weight = weight
        self.kept = torch.tensor(kept, dtype=torch.int64, device=weight.device)
        self.is_kept = np.zeros(weight.shape[0], dtype=bool)
        self.is_kept[kept] = True
        self.packed = torch.nn.Module()
        self.packed.weight = torch.nn.Parameter(weight[self.kept].contiguous(), requires_grad=False)
        self.linear: Any = torch.nn.functional.linear
        if weight.device.type == "cpu":
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            # vLLM's own CPU matmul for a weight (oneDNN, prepacked once); the gathered rows
            # are dropped where the packed copy replaces them.
            dispatch_cpu_unquantized_gemm(self.packed, remove_weight=True)
            self.linear = self.packed.cpu_linear
        # request id -> (tokens looked at, its ids outside `kept`)
        self.extras: dict[str, tuple[int, set[int]]] = {}
        self.proposals_made = 0
        self.own_proposals = 0  # proposals of a request's own ids outside `kept`
        self._reporter = Reporter("draft_head", patching.report_socket())
        self._report()

    def _report(self) -> None:
        self._reporter.send(
            {
                "draft_head": f"trimmed: {len(self.is_kept.nonzero()[0])} ids kept of "
                f"{len(self.is_kept)}, plus each request's own",
                "draft_head_proposals": self.proposals_made,
                "draft_head_own_proposals": self.own_proposals,
            }
        )

    @classmethod
    def of(cls, proposer: Any, ranking: str, size: int) -> "_TrimmedHead | bool":
        """The trimmed head of `proposer`'s draft, or False where it keeps vLLM's."""
        from pathlib import Path

        from server.weights import draft_vocab

        model = proposer.model
        head: Any = getattr(model, "lm_head", None)
        why = None
        if proposer.use_local_argmax_reduction or proposer.use_heterogeneous_vocab:
            why = "vLLM maps or reduces its vocabulary itself"
        elif head is None or getattr(head, "bias", None) is not None:
            why = "its head has a bias"
        elif type(getattr(head, "quant_method", None)).__name__ != "UnquantizedEmbeddingMethod":
            why = "its head is quantized"
        if why is not None:
            logger.warning("draft head kept whole: %s", why)
            Reporter("draft_head", patching.report_socket()).send({"draft_head": f"whole: {why}"})
            return False
        vocab = model.logits_processor.org_vocab_size
        kept = [t for t in draft_vocab.load(Path(ranking), size) if t < vocab]
        return cls(head.weight, kept)

    def proposals(self, hidden_states: Any, contexts: list[tuple[str, Any]]) -> Any:
        """The argmax over kept ids and each row's own extras: `contexts` holds each
        row's request id and its token ids so far."""
        import numpy as np
        import torch

        logits = self.linear(hidden_states, self.packed.weight, None)
        best, index = logits.max(dim=-1)
        chosen = self.kept[index]
        rows = [self._extras_of(req_id, tokens) for req_id, tokens in contexts]
        union = sorted(set().union(*rows))
        self.proposals_made += len(rows)
        if not union:
            self._report()
            return chosen
        ids = torch.tensor(union, dtype=torch.int64, device=self.weight.device)
        extra = torch.nn.functional.linear(hidden_states, self.weight[ids])
        allowed = np.array([np.isin(union, list(row)) for row in rows])
        extra[torch.from_numpy(~allowed).to(extra.device)] = float("-inf")
        extra_best, extra_index = extra.max(dim=-1)
        own = extra_best > best
        self.own_proposals += int(own.sum())
        self._report()
        return torch.where(own, ids[extra_index], chosen)

    def _extras_of(self, req_id: str, tokens: Any) -> set[int]:
        looked, extras = self.extras.get(req_id, (0, set()))
        if len(tokens) > looked:
            new = tokens[looked:]
            extras.update(new[~self.is_kept[new]].tolist())
            self.extras[req_id] = (len(tokens), extras)
        return extras

    def forget_all_but(self, live: Any) -> None:
        for req_id in [r for r in self.extras if r not in live]:
            del self.extras[req_id]


def _greedy_sample(proposer: Any, hidden_states: Any) -> Any:
    head: _TrimmedHead = proposer.specserve_head
    batch = proposer.specserve_input_batch
    head.forget_all_but(proposer.specserve_live_requests)
    rows = hidden_states.shape[0]
    contexts = [
        (req_id, batch.token_ids_cpu[row, : batch.num_tokens_no_spec[row]])
        for row, req_id in enumerate(batch.req_ids[:rows])
    ]
    return head.proposals(hidden_states, contexts)
