"""Free proposals from suffix trees, after SuffixDecoding (arXiv 2411.04975): continuations of a
request's context found in its own prompt and reply so far, and in its tenant's earlier replies,
each scored by how often it followed before.

A tree counts every substring of at most `depth` tokens of the sequences it holds (a substring's
count is the number of places it occurs). A match is a suffix of the context, of any length from
1 to depth - 1, that occurred before; its continuation follows the most frequent next token at
each step (the most recent on a tie), each token's probability being the product of count(child)
/ count(parent) along the way. A continuation stops where that probability falls under
min_token_prob, at max_spec_factor * the match length (short matches propose little, as in the
paper), or at the caller's max_tokens. Of all matches in both trees the one whose probabilities
add up highest (the expected tokens accepted) wins: the request's own tree on a tie, then the
longer match. A match of one or two tokens still proposes where what followed it was frequent,
so a proposal resumes one token after an edit.

The tree is path-compressed (a node is a run of tokens every suffix through it shares, held as a
slice of one of the sequences), so it holds O(tokens) nodes. Appending a token moves each of the
newest sequence's suffixes that still runs inside shared text one token down (O(depth) a token,
far less in new text: a suffix alone in a leaf grows with its sequence at no cost). Sequences are
added whole or grow at the end, newest only, and leave oldest first; every node points at the
newest sequence that ran through it, so removing the oldest never leaves a node pointing at it.
Nodes are indices into one list per field, not objects: the garbage collector then walks a few
lists rather than every node (a full collection took ~190 ms over a 100k-token tree of objects).

A request's own tree is built in one scheduler step, at its first proposal, from the context's
last `context_tokens` (CONTEXT_TOKENS, 4096, by default: ~10 ms where a 32k-token prompt would
hold up that step for ~100 ms), and grows with the reply from there. Replies sit in one tree per
tenant, bounded in tokens over all tenants (the oldest reply leaves first): no tenant is proposed
another's text. Stdlib only; the autopilot's scheduler asks for each decoding request's proposal
every step and hands over each finished reply.
"""

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# A place in a tree: the node, the index in its sequence of the token after the place (the
# node's end where the place is at the end of the node) and the tokens matched to get there.
Match = tuple[int, int, int]

_ROOT = 0

# The most of a context its own tree is built from at once (its last tokens).
CONTEXT_TOKENS = 4096
# The most a tree holds per token (its nodes' fields and its sequences, as Python ints and
# lists): measured with tracemalloc at 290-400 on code and random tokens
# (tests/unit/test_suffix_tree.py), for the memory the server plans.
BYTES_PER_TOKEN = 450


class SuffixTree:
    """The counts of every substring of up to `depth` tokens of its sequences."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        self.depth = depth
        self.tokens = 0  # held now
        self.version = 0  # changes with every change: Matches found before it go stale
        # Node n: the tokens _seq[n][_start[n]:_end[n]], which every suffix through it shares,
        # from string depth _above[n] on; _count[n] suffixes pass through it or end in it. A
        # node one suffix alone passes is a leaf running to that suffix's end (_end_of).
        self._count = [0]
        self._seq: list[list[int]] = [[]]
        self._start = [0]
        self._end = [0]
        self._above = [0]
        self._parent = [-1]
        self._children: list[dict[int, int]] = [{}]  # by first token; int only: never collected
        self._best = [-1]  # the child to follow; -1 where none or not known yet
        # When the latest suffix through it reached its first token: ties between children go
        # to the most recent text (an edited line's new version).
        self._stamp = [0]
        self._free: list[int] = []  # nodes to reuse
        self._seqs: deque[list[int]] = deque()  # oldest first
        # The newest sequence's suffixes that end inside shared text (longest first): the node
        # each ends at, and its length.
        self._active: list[tuple[int, int]] = []
        self._clock = 0

    @property
    def sequences(self) -> int:
        return len(self._seqs)

    @property
    def newest(self) -> list[int]:
        """The newest sequence's tokens (do not change them)."""
        return self._seqs[-1] if self._seqs else []

    def start(self) -> None:
        """Begin a new sequence; the one before never grows again."""
        self._seqs.append([])
        self._active = []

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the newest sequence."""
        if not self._seqs:
            self.start()
        seq = self._seqs[-1]
        for token in tokens:
            self._append(seq, token)
        self.version += 1

    def _end_of(self, node: int) -> int:
        """Where the node's tokens end in its sequence."""
        if self._count[node] > 1:
            return self._end[node]
        return min(self._start[node] - self._above[node] + self.depth, len(self._seq[node]))

    def _new(self, parent: int, seq: list[int], start: int, above: int, count: int) -> int:
        if self._free:
            node = self._free.pop()
        else:
            node = len(self._count)
            for ints in (self._count, self._start, self._end, self._above, self._parent):
                ints.append(0)
            self._best.append(-1)
            self._stamp.append(0)
            self._seq.append(seq)
            self._children.append({})
        self._seq[node] = seq
        self._count[node], self._start[node], self._end[node] = count, start, start + 1
        self._above[node], self._parent[node], self._stamp[node] = above, parent, self._clock
        return node

    def _release(self, node: int) -> None:
        self._children[node].clear()
        self._best[node] = -1
        self._seq[node] = self._seq[_ROOT]  # not the sequence: it may leave the tree
        self._free.append(node)

    def _raised(self, parent: int, child: int) -> None:
        """child's count rose (or it is new) and its stamp is the latest: it may be the best."""
        best = self._best[parent]
        if best < 0:
            if len(self._children[parent]) == 1:
                self._best[parent] = child
        elif self._count[child] >= self._count[best]:
            self._best[parent] = child

    def _best_child(self, node: int) -> int:
        """The child of highest count, the latest on a tie; -1 for a leaf."""
        best = self._best[node]
        children = self._children[node].values()
        if best < 0 and children:
            count, stamp = self._count, self._stamp
            top = max(map(count.__getitem__, children))
            best = max((c for c in children if count[c] == top), key=stamp.__getitem__)
            self._best[node] = best
        return best

    def _append(self, seq: list[int], token: int) -> None:
        p = len(seq)
        seq.append(token)
        self.tokens += 1
        self._clock += 1
        now, depth = self._clock, self.depth
        count, seqs, start, end = self._count, self._seq, self._start, self._end
        above, parent, children, best, stamp = (
            self._above,
            self._parent,
            self._children,
            self._best,
            self._stamp,
        )
        count[_ROOT] += 1
        kept: list[tuple[int, int]] = []
        for node, m in [*self._active, (_ROOT, 0)]:
            child = children[node].get(token)
            if child is None:
                # Nothing before went on with this token: a leaf, which grows on its own.
                leaf = self._new(node, seq, p, m, 1)
                children[node][token] = leaf
                self._raised(node, leaf)
                continue
            if count[child] > 1:  # _end_of(child), inlined: this loop is the tree's cost
                length = end[child] - start[child]
            else:
                length = min(depth - above[child], len(seqs[child]) - start[child])
            if node != _ROOT and count[node] == count[child] + 1:
                # This suffix alone ends at node and all others go on into child: the boundary
                # moves down a token rather than child splitting (it keeps the tree compressed).
                first = p + 1 - (m + 1 - above[node])
                if length == 1:
                    up = parent[node]
                    children[up][seqs[node][start[node]]] = child
                    if best[up] == node:
                        best[up] = child
                    count[child], stamp[child] = count[node], stamp[node]
                    above[child], parent[child] = above[node], up
                    seqs[child], start[child], end[child] = seq, first, p + 1
                    self._release(node)
                    node = child
                else:
                    seqs[node], start[node], end[node] = seq, first, p + 1
                    start[child] += 1
                    above[child] += 1
                    stamp[child] += 1
                    children[node] = {seqs[child][start[child]]: child}
            elif length == 1:
                count[child] += 1
                seqs[child], start[child], end[child], stamp[child] = seq, p, p + 1, now
                self._raised(node, child)
                node = child
            else:
                # The suffix ends one token into child: child splits there.
                middle = self._new(node, seq, p, above[child], count[child] + 1)
                parent[child] = middle
                start[child] += 1
                above[child] += 1
                stamp[child] += 1
                children[middle][seqs[child][start[child]]] = child
                best[middle] = child
                children[node][token] = middle
                if best[node] == child:
                    best[node] = middle
                else:
                    self._raised(node, middle)
                node = middle
            if m + 1 < depth:
                kept.append((node, m + 1))
        self._active = kept

    def remove_oldest(self) -> int:
        """Remove the oldest sequence; its length."""
        seq = self._seqs.popleft()
        if not self._seqs:
            self._active = []
        count, seqs, start, end = self._count, self._seq, self._start, self._end
        above, parent, children, best, stamp = (
            self._above,
            self._parent,
            self._children,
            self._best,
            self._stamp,
        )
        for begin in range(len(seq)):
            count[_ROOT] -= 1
            node, i, stop = _ROOT, begin, min(begin + self.depth, len(seq))
            while i < stop:
                child = children[node][seq[i]]
                if best[node] == child:
                    best[node] = -1
                if count[child] == 1:
                    del children[node][seq[i]]
                    self._release(child)
                    break
                i += end[child] - start[child]
                count[child] -= 1
                node = child
            if node != _ROOT and len(children[node]) == 1:
                (child,) = children[node].values()
                if count[child] == count[node]:
                    # No suffix ends at node any more: child takes its place.
                    up = parent[node]
                    children[up][seqs[node][start[node]]] = child
                    if best[up] == node:
                        best[up] = child
                    start[child] -= end[node] - start[node]
                    above[child], parent[child], stamp[child] = above[node], up, stamp[node]
                    self._release(node)
        self.tokens -= len(seq)
        self.version += 1
        return len(seq)

    def active(self) -> list[Match]:
        """Where the newest sequence's suffixes that occurred before it end (longest first)."""
        return [(node, self._end[node], m) for node, m in self._active]

    def advance(self, matches: list[Match], token: int) -> list[Match]:
        """Where a context's suffixes occur once `token` is appended to it, from where they
        occurred before (longest first): the tree does not hold the context."""
        seqs, start, children, end_of = self._seq, self._start, self._children, self._end_of
        advanced: list[Match] = []
        for node, pos, m in matches:
            if m + 1 >= self.depth:
                continue  # nothing can follow a match of depth tokens
            if pos < end_of(node):
                if seqs[node][pos] == token:
                    advanced.append((node, pos + 1, m + 1))
            else:
                child = children[node].get(token)
                if child is not None:
                    advanced.append((child, start[child] + 1, m + 1))
        child = children[_ROOT].get(token)
        if child is not None:
            advanced.append((child, start[child] + 1, 1))
        return advanced

    def locate(self, context: Sequence[int]) -> list[Match]:
        """Where the context's suffixes occur (longest first)."""
        matches: list[Match] = []
        for token in context[max(0, len(context) - self.depth + 1) :]:
            matches = self.advance(matches, token)
        return matches

    def occurrences(self, match: Match) -> int:
        """How often the tokens matched occur in the tree."""
        return self._count[match[0]]

    def continuation(
        self, match: Match, limit: int, min_token_prob: float, uncounted: int
    ) -> tuple[list[int], list[float]]:
        """The most frequent continuation of a match, at most `limit` tokens, each with its
        probability (all before it included), while that is at least min_token_prob.
        `uncounted`: occurrences of the match left out (1 where the tree holds the context
        itself, whose occurrence at the match has nothing after it yet)."""
        node, pos, _ = match
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        total = self._count[node] - uncounted
        end = self._end_of(node)
        while len(tokens) < limit:
            if pos < end:
                tokens.append(self._seq[node][pos])
                pos += 1
            else:
                child = self._best_child(node)
                if child < 0:
                    break
                prob *= self._count[child] / total
                if prob < min_token_prob:
                    break
                node, total = child, self._count[child]
                pos, end = self._start[child], self._end_of(child)
                tokens.append(self._seq[node][pos])
                pos += 1
            probs.append(prob)
        return tokens, probs


@dataclass(frozen=True)
class Proposal:
    """A continuation found in a tree."""

    tokens: list[int]
    probs: list[float]  # each token's estimated chance of acceptance, all before it included
    match_length: int  # context tokens matched
    occurrences: int  # how often the matched tokens occurred before
    origin: str  # "prompt" (the request's own context) or "replies" (its tenant's replies)

    @property
    def score(self) -> float:
        """The tokens expected to be accepted: what SuffixDecoding ranks proposals by."""
        return sum(self.probs)


class ReplyTrees:
    """Recent replies, one tree per tenant, at most max_tokens tokens over all tenants."""

    def __init__(self, max_tokens: int, depth: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.depth = depth
        self.tokens = 0  # held now
        self._trees: dict[str, SuffixTree] = {}
        self._order: deque[str] = deque()  # each reply's tenant, oldest first

    @property
    def replies(self) -> int:
        return len(self._order)

    def tree(self, tenant: str) -> SuffixTree | None:
        return self._trees.get(tenant)

    def add(self, tenant: str, reply: Sequence[int]) -> None:
        if self.max_tokens == 0 or not reply:
            return
        tree = self._trees.get(tenant)
        if tree is None:
            tree = self._trees[tenant] = SuffixTree(self.depth)
        tree.start()
        tree.extend(reply[-self.max_tokens :])
        self._order.append(tenant)
        self.tokens += min(len(reply), self.max_tokens)
        while self.tokens > self.max_tokens:
            oldest = self._order.popleft()
            tree = self._trees[oldest]
            self.tokens -= tree.remove_oldest()
            if not tree.sequences:
                del self._trees[oldest]


@dataclass
class _Request:
    tree: SuffixTree  # its own context, from `start` on
    start: int  # the context's tokens before it are not in the tree
    replies: SuffixTree | None = None  # its tenant's tree, as of `version`
    version: int = -1
    matches: list[Match] = field(default_factory=list)  # the context's suffixes in `replies`


class SuffixProposer:
    """Each live request's tree, its tenant's reply tree, and the best continuation of the
    request's context in the two."""

    def __init__(
        self,
        index_tokens: int,
        depth: int = 32,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        context_tokens: int = CONTEXT_TOKENS,
    ) -> None:
        if depth < 2 or max_spec_factor <= 0 or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError("need depth >= 2, max_spec_factor > 0, min_token_prob in [0, 1]")
        if context_tokens < 1:
            raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
        self.depth = depth
        self.context_tokens = context_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.replies = ReplyTrees(index_tokens, depth)
        self._requests: dict[str, _Request] = {}

    def find(
        self,
        request_id: str,
        tenant: str | None,
        all_tokens: Sequence[int],
        max_tokens: int,
        spec_factor: float | None = None,
    ) -> Proposal | None:
        """The continuation of the request's context (prompt and reply so far) expected to have
        the most tokens accepted, at most max_tokens long and `spec_factor` (default
        max_spec_factor) times its match; None where nothing occurred before."""
        factor = self.max_spec_factor if spec_factor is None else spec_factor
        request = self._requests.get(request_id)
        if request is None:
            start = max(0, len(all_tokens) - self.context_tokens)
            request = self._requests[request_id] = _Request(SuffixTree(self.depth), start)
        new = all_tokens[request.start + len(request.tree.newest) :]
        request.tree.extend(new)
        context = request.tree.newest
        replies = self.replies.tree(tenant) if tenant is not None else None
        if replies is None:
            request.matches = []
        elif replies is request.replies and replies.version == request.version:
            for token in new:
                request.matches = replies.advance(request.matches, token)
        else:
            request.matches = replies.locate(context)
        request.replies = replies
        request.version = replies.version if replies is not None else -1
        best: Proposal | None = None
        score = 0.0
        for origin, tree, matches, uncounted in (
            ("prompt", request.tree, request.tree.active(), 1),
            ("replies", replies, request.matches, 0),
        ):
            for match in matches:
                matched = match[2]
                # The paper's adaptive length (the epsilon: 0.29 * 100 is 28.999...).
                limit = min(max_tokens, int(factor * matched + 1e-9))
                if limit <= score:
                    break  # no shorter match can beat it: matches come longest first
                assert tree is not None
                tokens, probs = tree.continuation(match, limit, self.min_token_prob, uncounted)
                if sum(probs) > score:
                    score = sum(probs)
                    found = tree.occurrences(match) - uncounted
                    best = Proposal(tokens, probs, matched, found, origin)
        return best

    def finish(self, request_id: str, tenant: str | None, reply: Sequence[int]) -> None:
        """The request left the engine: its tree goes, its reply joins its tenant's tree."""
        self._requests.pop(request_id, None)
        if tenant is not None:
            self.replies.add(tenant, reply)
