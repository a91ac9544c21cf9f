"""Suffix-tree proposals: the trees' counts and structure against brute force on random token
sequences, proposals against a brute-force reference of the same rule, tenant isolation, the
reply trees' bound, and resynchronisation after an edit."""

import random
import re
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import pytest

from server.autopilot.suffix_tree import (
    BYTES_PER_TOKEN,
    Proposal,
    ReplyTrees,
    SuffixProposer,
    SuffixTree,
)

# A held sequence and the clock time of each of its tokens.
Corpus = list[tuple[list[int], list[int]]]


def occurrences(corpus: Corpus, string: Sequence[int], depth: int) -> list[int]:
    """The clock times of the token after `string[:-1]` at each occurrence of `string`."""
    n = len(string)
    if not 0 < n <= depth:
        return []
    return [
        times[i + n - 1]
        for seq, times in corpus
        for i in range(len(seq) - n + 1)
        if seq[i : i + n] == list(string)
    ]


def reference_continuation(
    corpus: Corpus,
    match: list[int],
    depth: int,
    limit: int,
    min_prob: float,
    uncounted: int,
) -> tuple[list[int], list[float]]:
    string = list(match)
    total = len(occurrences(corpus, string, depth)) - uncounted
    vocabulary = {t for seq, _ in corpus for t in seq}
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(tokens) < limit:
        ranked = [
            (len(found), max(found), t)
            for t in vocabulary
            if (found := occurrences(corpus, [*string, t], depth))
        ]
        if not ranked:
            break
        count, _, token = max(ranked)
        prob *= count / total
        if prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        string.append(token)
        total = count
    return tokens, probs


def reference_proposal(
    context: list[int],
    replies: Corpus,
    depth: int,
    factor: float,
    min_prob: float,
    max_tokens: int,
) -> Proposal | None:
    """The rule by brute force: every suffix of the context that occurred before, in the
    context itself or in the replies, longest first, own context first; the highest score."""
    own: Corpus = [(context, list(range(len(context))))]
    best: Proposal | None = None
    score = 0.0
    for origin, corpus, longest, uncounted in (
        ("prompt", own, len(context) - 1, 1),
        ("replies", replies, len(context), 0),
    ):
        for m in range(min(depth - 1, longest), 0, -1):
            match = context[-m:]
            found = len(occurrences(corpus, match, depth)) - uncounted
            if found <= 0:
                continue
            limit = min(max_tokens, int(factor * m + 1e-9))
            tokens, probs = reference_continuation(corpus, match, depth, limit, min_prob, uncounted)
            if sum(probs) > score:
                score = sum(probs)
                best = Proposal(tokens, probs, m, found, origin)
    return best


def tree_count(tree: SuffixTree, string: list[int]) -> int:
    """The tree's count of a string: where its longest suffix match ends."""
    for match in tree.locate(string):
        if match[2] == len(string):
            return tree.occurrences(match)
    return 0


def check_tree(tree: SuffixTree, corpus: Corpus) -> None:
    """Every substring's count, and the structure: compressed, each node's best child and stamp
    right, pointing only at the sequences held, every node either in the tree or free."""
    depth = tree.depth
    held = {id(seq) for seq, _ in corpus}
    assert tree.tokens == sum(len(seq) for seq, _ in corpus)
    strings = {
        tuple(seq[i : i + n])
        for seq, _ in corpus
        for i in range(len(seq))
        for n in range(1, min(depth - 1, len(seq) - i) + 1)
    }
    for string in strings:
        assert tree_count(tree, list(string)) == len(occurrences(corpus, string, depth))
    count, children, stamp = tree._count, tree._children, tree._stamp
    assert count[0] == tree.tokens
    reached = 1
    stack: list[tuple[int, list[int]]] = [(0, [])]
    while stack:
        node, path = stack.pop()
        assert count[node] >= sum(count[c] for c in children[node].values())
        if tree._best[node] >= 0:
            assert tree._best[node] == max(
                children[node].values(), key=lambda c: (count[c], stamp[c])
            )
        for token, child in children[node].items():
            reached += 1
            assert tree._parent[child] == node
            seq, start, end = tree._seq[child], tree._start[child], tree._end_of(child)
            assert id(seq) in held
            assert tree._above[child] == len(path)
            assert start < end <= len(seq) and seq[start] == token
            label = seq[start:end]
            assert len(path) + len(label) <= depth
            assert count[child] > 0 and (node == 0 or count[child] < count[node])
            assert count[child] > 1 or not children[child]
            for n in range(1, len(label) + 1):
                found = occurrences(corpus, [*path, *label[:n]], depth)
                assert len(found) == count[child]
            assert stamp[child] == max(occurrences(corpus, [*path, token], depth))
            stack.append((child, [*path, *label]))
    assert reached + len(tree._free) == len(count)
    assert all(tree._seq[n] == [] for n in tree._free)


def random_sequence(rng: random.Random, vocabulary: int, length: int) -> list[int]:
    return [rng.randrange(vocabulary) for _ in range(length)]


@pytest.mark.parametrize("seed", range(40))
def test_a_growing_sequence_s_tree_counts_every_substring(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(2, 8)
    tree = SuffixTree(depth)
    tokens: list[int] = []
    vocabulary = rng.randint(1, 4)
    while len(tokens) < 40:
        chunk = random_sequence(rng, vocabulary, rng.randint(1, 5))
        if rng.random() < 0.3 and tokens:  # copy earlier text, as replies do
            start = rng.randrange(len(tokens))
            chunk = tokens[start : start + rng.randint(1, 12)]
        tree.extend(chunk)
        tokens.extend(chunk)
        check_tree(tree, [(tree.newest, list(range(1, len(tokens) + 1)))])


@pytest.mark.parametrize("seed", range(40))
def test_sequences_added_whole_and_removed_oldest_first(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(2, 7)
    tree = SuffixTree(depth)
    corpus: Corpus = []
    clock = 0
    for _ in range(12):
        if corpus and rng.random() < 0.4:
            assert tree.remove_oldest() == len(corpus.pop(0)[0])
        else:
            seq = random_sequence(rng, rng.randint(1, 3), rng.randint(1, 15))
            if corpus and rng.random() < 0.5:  # repeat part of an earlier one
                earlier = rng.choice(corpus)[0]
                seq = earlier[rng.randrange(len(earlier)) :] + seq[:3]
            tree.start()
            tree.extend(seq)
            corpus.append((tree.newest, list(range(clock + 1, clock + len(seq) + 1))))
            clock += len(seq)
        check_tree(tree, corpus)
    while corpus:
        tree.remove_oldest()
        corpus.pop(0)
        check_tree(tree, corpus)
    assert tree._children[0] == {} and len(tree._free) == len(tree._count) - 1


def occurs_in(string: list[int], sequences: list[list[int]]) -> bool:
    n = len(string)
    return any(seq[i : i + n] == string for seq in sequences for i in range(len(seq) - n + 1))


@pytest.mark.parametrize("seed", range(60))
def test_proposals_equal_the_brute_force_rule(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(3, 9)
    factor = rng.choice([0.5, 1.0, 2.0])
    min_prob = rng.choice([0.0, 0.1, 0.4])
    vocabulary = rng.randint(2, 5)
    proposer = SuffixProposer(
        index_tokens=rng.randint(10, 60),
        depth=depth,
        max_spec_factor=factor,
        min_token_prob=min_prob,
    )
    bound = proposer.replies.max_tokens
    replies: Corpus = []
    clock = 0

    def reply() -> None:
        nonlocal clock
        tokens = random_sequence(rng, vocabulary, rng.randint(1, 20))[-bound:]
        proposer.finish("other", "a", tokens)
        replies.append((tokens, list(range(clock, clock + len(tokens)))))
        clock += len(tokens)
        while sum(len(seq) for seq, _ in replies) > bound:
            replies.pop(0)

    for _ in range(4):
        reply()
    context = random_sequence(rng, vocabulary, rng.randint(1, 6))
    for _ in range(12):
        max_tokens = rng.randint(1, 6)
        found = proposer.find("r", "a", context, max_tokens)
        assert found == reference_proposal(context, replies, depth, factor, min_prob, max_tokens)
        if found is not None:
            # A proposal continues a suffix of the context where it occurred before.
            string = context[-found.match_length :] + found.tokens
            if found.origin == "prompt":  # earlier than the context's own end
                n, m = len(string), found.match_length
                assert any(context[i : i + n] == string for i in range(len(context) - m))
            else:
                assert occurs_in(string, [seq for seq, _ in replies])
            assert found.tokens and found.probs == sorted(found.probs, reverse=True)
            assert found.probs[-1] >= min_prob
            assert len(found.tokens) <= min(max_tokens, factor * found.match_length)
        if rng.random() < 0.3:
            reply()  # another request of the tenant finished: its tree changed
        context = context + random_sequence(rng, vocabulary, rng.randint(1, 3))


def test_the_context_proposes_what_followed_before_and_says_how_sure() -> None:
    proposer = SuffixProposer(index_tokens=0)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    found = proposer.find("r", None, context, 8)
    assert found is not None
    assert (found.tokens, found.match_length, found.origin) == ([4, 5, 6], 3, "prompt")
    assert found.probs == [1.0, 1.0, 1.0] and found.occurrences == 1 and found.score == 3.0
    # One token more of agreement, one more token proposed (max_spec_factor 1).
    found = proposer.find("r", None, [*context, 4], 8)
    assert found is not None and found.tokens == [5, 6, 7, 8]


def test_frequencies_pick_the_continuation_and_its_probability() -> None:
    proposer = SuffixProposer(index_tokens=0, max_spec_factor=4.0)
    # After 5 came 6 twice and 7 once; after 5 6 came 8 both times.
    context = [5, 6, 8, 1, 5, 7, 9, 2, 5, 6, 8, 3, 5]
    found = proposer.find("r", None, context, 2)
    assert found is not None
    assert found.tokens == [6, 8]
    assert found.probs == pytest.approx([2 / 3, 2 / 3])
    assert (found.match_length, found.occurrences) == (1, 3)


def test_the_most_recent_continuation_wins_a_tie() -> None:
    proposer = SuffixProposer(index_tokens=0, max_spec_factor=2.0)
    found = proposer.find("r", None, [3, 1, 4, 3, 2, 5, 3], 2)
    assert found is not None and found.tokens == [2, 5]
    found = proposer.find("q", None, [3, 2, 5, 3, 1, 4, 3], 2)
    assert found is not None and found.tokens == [1, 4]


def test_a_continuation_stops_under_min_token_prob() -> None:
    context = [7, 1, 7, 2, 7]  # 7 went on with 1 and with 2: each half the time
    low = SuffixProposer(index_tokens=0, max_spec_factor=4.0, min_token_prob=0.1)
    found = low.find("r", None, context, 4)
    assert found is not None and (found.tokens, found.probs) == ([2, 7], [0.5, 0.5])
    high = SuffixProposer(index_tokens=0, max_spec_factor=4.0, min_token_prob=0.6)
    assert high.find("r", None, context, 4) is None


def test_after_an_edit_proposals_resume_within_one_token() -> None:
    line = list(range(100, 140))
    proposer = SuffixProposer(index_tokens=0, max_spec_factor=1.0)
    # The reply copies the prompt's line, changes its 20th token, then goes on copying.
    prompt = [1, 2, *line, 3]
    reply = [*line[:19], 999]
    assert proposer.find("r", None, prompt + reply, 8) is None  # 999 never occurred
    found = proposer.find("r", None, [*prompt, *reply, line[20]], 8)
    assert found is not None
    assert (found.tokens, found.match_length) == ([line[21]], 1)
    found = proposer.find("r", None, [*prompt, *reply, *line[20:22]], 8)
    assert found is not None and found.tokens == line[22:24]
    found = proposer.find("r", None, [*prompt, *reply, *line[20:28]], 8)
    assert found is not None and found.tokens == line[28:36]


def test_replies_are_proposed_to_their_own_tenant_only() -> None:
    proposer = SuffixProposer(index_tokens=1000)
    proposer.finish("old", "a", [20, 21, 22, 23, 24, 25])
    mine = proposer.find("r", "a", [1, 2, 20, 21, 22], 8)
    assert mine is not None
    assert (mine.tokens, mine.match_length, mine.origin) == ([23, 24, 25], 3, "replies")
    assert proposer.find("s", "b", [1, 2, 20, 21, 22], 8) is None
    assert proposer.find("t", None, [1, 2, 20, 21, 22], 8) is None
    proposer.finish("old2", "b", [30, 31, 32, 33])
    assert proposer.find("u", "a", [30, 31, 32], 8) is None
    theirs = proposer.find("v", "b", [30, 31, 32], 8)
    assert theirs is not None and theirs.tokens == [33]


def test_a_request_s_matches_in_its_tenant_s_tree_follow_new_replies() -> None:
    proposer = SuffixProposer(index_tokens=1000)
    proposer.finish("old", "a", [20, 21, 22, 23, 24, 25])
    context = [1, 20, 21]
    found = proposer.find("r", "a", context, 8)
    assert found is not None and found.tokens == [22, 23]
    proposer.finish("other", "a", [20, 21, 22, 40, 41])  # 20 21 22: 23 once, 40 once
    context += [22]
    found = proposer.find("r", "a", context, 8)
    assert found is not None and found.tokens == [40, 41] and found.probs == [0.5, 0.5]


def test_the_reply_trees_evict_the_oldest_replies_past_their_bound() -> None:
    trees = ReplyTrees(max_tokens=10, depth=8)
    trees.add("a", [1, 2, 3, 4, 5, 6])
    trees.add("b", [7, 8, 9, 10])
    assert (trees.tokens, trees.replies) == (10, 2)
    trees.add("a", [11, 12, 13, 14])
    assert (trees.tokens, trees.replies) == (8, 2)
    tree = trees.tree("a")
    assert tree is not None and tree.tokens == 4
    trees.add("c", [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26])  # keeps its last 10
    assert (trees.tokens, trees.replies) == (10, 1)
    assert trees.tree("a") is None and trees.tree("b") is None
    tree = trees.tree("c")
    assert tree is not None and tree.newest == list(range(17, 27))


@pytest.mark.parametrize("seed", range(10))
def test_the_bound_holds_under_any_traffic(seed: int) -> None:
    rng = random.Random(seed)
    trees = ReplyTrees(max_tokens=50, depth=6)
    for _ in range(60):
        trees.add(rng.choice("abc"), random_sequence(rng, 3, rng.randint(0, 30)))
        assert trees.tokens <= 50
        held = [trees.tree(t) for t in "abc"]
        assert trees.tokens == sum(t.tokens for t in held if t is not None)
        assert trees.replies == sum(t.sequences for t in held if t is not None)


def test_a_zero_sized_store_holds_nothing_and_settings_are_checked() -> None:
    proposer = SuffixProposer(index_tokens=0)
    proposer.finish("r", "a", [1, 2, 3, 4, 5])
    assert (proposer.replies.tokens, proposer.find("s", "a", [1, 2, 3], 4)) == (0, None)
    with pytest.raises(ValueError):
        ReplyTrees(max_tokens=-1, depth=8)
    with pytest.raises(ValueError):
        SuffixTree(depth=1)
    with pytest.raises(ValueError):
        SuffixProposer(index_tokens=10, min_token_prob=1.5)


def test_a_finished_request_s_tree_goes() -> None:
    proposer = SuffixProposer(index_tokens=100)
    proposer.find("r", "a", [1, 2, 3, 1, 2], 4)
    proposer.finish("r", "a", [10, 11, 12, 13])
    assert proposer._requests == {}
    assert (proposer.replies.tokens, proposer.replies.replies) == (4, 1)
    proposer.finish("calibration", None, [20, 21, 22, 23])  # no tenant: not kept
    assert proposer.replies.tokens == 4


def test_a_request_s_own_tree_starts_from_its_context_s_last_tokens() -> None:
    proposer = SuffixProposer(index_tokens=0, context_tokens=6)
    # 1 2 3 went on with 4 early in the prompt, out of the tree's reach.
    context = [1, 2, 3, 4, 9, 8, 7, 6, 5, 1, 2, 3]
    assert proposer.find("r", None, context, 8) is None
    assert proposer._requests["r"].tree.newest == context[-6:]
    # Past that the tree grows with the reply: what it holds now is proposed.
    context += [10, 11, 1, 2]
    found = proposer.find("r", None, context, 8)
    assert found is not None and (found.tokens, found.match_length) == ([3, 10], 2)
    assert proposer._requests["r"].tree.newest == context[-10:]


def _code_tokens(count: int) -> list[int]:
    """Our own source as tokens: each word or symbol an id past the small ints Python shares,
    repeating as code does."""
    text = "".join(path.read_text() for path in sorted(Path("server").rglob("*.py")))
    ids: dict[str, int] = {}
    words = re.findall(r"\w+|\S", text)[:count]
    return [ids.setdefault(word, 1000 + len(ids)) for word in words]


@pytest.mark.parametrize("as_replies", [False, True])
def test_a_tree_holds_at_most_its_planned_bytes_a_token(as_replies: bool) -> None:
    """What the memory plan reserves for the lookups (server/engine/memory.py): a request's
    tree grows a token at a time, replies come whole."""
    tokens = _code_tokens(20_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tree = SuffixTree(32)
        if as_replies:
            for start in range(0, len(tokens), 500):
                tree.start()
                tree.extend(tokens[start : start + 500])
        else:
            for token in tokens:
                tree.extend([token])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tree.tokens == len(tokens) == 20_000
    assert 100 * len(tokens) < held <= BYTES_PER_TOKEN * len(tokens)
