"""The trimmed head's choice (server/vllm_plugins/draft_head.py): per row, the argmax over the
kept ids and that row's own context ids, and never another row's."""

import numpy as np
import torch

from server.vllm_plugins.draft_head import _TrimmedHead


def test_each_row_chooses_among_the_kept_ids_and_its_own_context() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab, hidden = 300, 32
    weight = torch.randn(vocab, hidden, generator=generator)
    kept = list(range(0, 300, 7))
    head = _TrimmedHead(weight, kept)
    contexts = [
        ("a", np.array([5, 9, 13, 5], dtype=np.int32)),
        ("b", np.array([0, 1, 2], dtype=np.int32)),
        ("c", np.array([250, 251, 11], dtype=np.int32)),
    ]
    for step in range(3):
        states = torch.randn(len(contexts), hidden, generator=generator) * 4
        chosen = head.proposals(states, contexts).tolist()
        logits = states @ weight.T
        for row, (_, tokens) in enumerate(contexts):
            allowed = sorted(set(kept) | set(tokens.tolist()))
            assert chosen[row] == allowed[int(logits[row, allowed].argmax())], (step, row)
        # A reply grows: its new ids join that request's own, no one else's.
        contexts[2] = ("c", np.append(contexts[2][1], 199 - step))
    assert set(head.extras["c"][1]) == {250, 251, 11, 199, 198}  # 197 came after the last step
    assert set(head.extras["b"][1]) == {1, 2}
    head.forget_all_but({"a"})
    assert list(head.extras) == ["a"]
