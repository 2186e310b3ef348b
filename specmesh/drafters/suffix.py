"""Suffix drafting (vLLM's `suffix` method, Arctic Inference's SuffixDecoding): no model, no probabilities.

Each generation keeps a suffix tree over its own prompt and output (its *local* tree), extended as tokens
commit. Each draft replica keeps *global* trees over the outputs of its recent generations, one per
prefix-cache scope (tenant and `cache_salt`: the draft request's `cache_scope`), so that one tenant's text
never shapes another's drafts (a faster or more-accepted answer would reveal it). The global trees together
hold at most `suffix_decoding_max_cached_requests` generations, evicted first in, first out. As in vLLM they
hold outputs, not prompts: a prompt is in its own request's local tree already, a conversation re-sends
its history with every turn (indexed each time it would count once per turn), and prompts are most of the
tokens. Each output is led by its prompt's last max_tree_depth - 1 tokens, though, so that a context ending
as that prompt did matches into the output from its first token (vLLM's trees find an output's start only
once a few of its tokens are committed). Unlike vLLM an output joins its scope's tree when its generation
ends, not token by token: a session keeps its context's match state in the tree from round to round, valid
while the tree is unchanged.

A proposal matches the longest suffix of the context, up to `suffix_decoding_max_tree_depth` tokens, and
follows the most frequent continuation, as Arctic's `SuffixTree.speculate` does: for every match length m
(1 .. depth - 1) it walks from the matched node to the most frequent child, a token's estimated
probability being the product of count(child) / count(node) along the way, and stops at
min(K, floor(max_spec_factor x m + max_spec_offset)) tokens or where that probability falls under
`min_token_prob`. A draft's score is the sum of its tokens' probabilities; the best score wins (ties: the
longer match), the local tree's draft winning a tie with the global tree's. vLLM exposes no offset: it is
Arctic's `max_spec_offset`, which vLLM leaves at 0, as here. Proposals are point masses (the verifier
accepts x with probability p(x), else samples p without x), so the output is exactly the target's.

The tree is Arctic's structure: a suffix tree of bounded depth with path compression (a node is a run of
tokens kept as a reference into one sequence that holds them, so a sequence costs O(length) nodes, not
O(length x depth)), a count per node (the windows of `depth` tokens that pass through it) and the most
frequent child of each node kept up to date, so that a walk never scans a node's children. Written here
in Python rather than taken from PyPI: `arctic-inference` ships no wheel for this platform past 0.0.4 (which
has no suffix tree), and its sdist builds CUDA custom ops with torch>=2.10 from PyPI in an isolated build
(another, CUDA, torch beside the pinned 2.13.0 CPU one) plus cmake, ninja and nanobind, and registers a vLLM
plugin; a C++ toolchain in the image for one data structure is not worth it when the Python tree proposes
in tens of microseconds (bench/suffix_cost.py). Nodes live in parallel arrays indexed by node id rather
than as objects: a few tens of bytes each, and nothing for the garbage collector to walk.

What differs from Arctic is mechanics, not answers (tests/unit/test_suffix.py checks proposals against its
loop over every match length): the match lengths are tried in order of the most they could score (the
tokens they may propose times the probability of the first) and the search stops once none can beat the
best; where the context's last m tokens end comes from a match state kept from round to round (the local
tree's own windows, the global tree's state advanced by each commit), not from a walk per m; a window alone
in its leaf is not visited per token (its leaf grows with its sequence); and a node keeps reading the array
of a sequence evicted since (alive while referenced, 4 bytes a token) where Arctic re-points it.
"""

from __future__ import annotations

import bisect
import math
import sys
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from specmesh.domain import DraftBlock
from specmesh.errors import InvalidArgument
from specmesh.sampling import SamplingParams

MatchState = tuple[list[int], list[int]]  # (nodes, idxs): see SuffixTree.advance
NO_CHILD = -1  # head of a node without children
STALE = -2  # head of a node whose most frequent child must be found again (a count fell)


@dataclass(frozen=True)
class SuffixParams:
    """vLLM's suffix decoding settings, its names and defaults (its `speculative_config` keys, flags of the
    draft service), and Arctic's offset."""

    max_tree_depth: int = 24  # the match plus its continuation, in tokens
    max_cached_requests: int = 10_000  # generations in the global trees (0: no global tree)
    max_spec_factor: float = 1.0  # at most factor x match length (+ offset) tokens per proposal
    min_token_prob: float = 0.1  # stop where the continuation's estimated probability falls below it
    max_spec_offset: float = 0.0  # Arctic's; vLLM does not set it
    # How a refusal names a parameter, from its vLLM name (suffix_decoding_...): a flag, a request field.
    flag: Callable[[str], str] = field(default=lambda name: name, compare=False, repr=False)

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """vLLM's bounds (InvalidArgument, a ValueError, naming the parameter)."""
        flag = lambda name: self.flag("suffix_decoding_" + name)
        if self.max_tree_depth < 1:
            raise InvalidArgument(f"{flag('max_tree_depth')} must be >= 1, got {self.max_tree_depth}")
        if self.max_cached_requests < 0:
            raise InvalidArgument(f"{flag('max_cached_requests')} must be >= 0, got {self.max_cached_requests}")
        if not (math.isfinite(self.max_spec_factor) and self.max_spec_factor >= 0):
            raise InvalidArgument(f"{flag('max_spec_factor')} must be a number >= 0, got {self.max_spec_factor}")
        if not 0 <= self.min_token_prob <= 1:
            raise InvalidArgument(f"{flag('min_token_prob')} must be in [0, 1], got {self.min_token_prob}")
        if not math.isfinite(self.max_spec_offset):
            raise InvalidArgument(f"{flag('max_spec_offset')} must be a number, got {self.max_spec_offset}")


@dataclass
class SuffixDraft:
    """One proposal: the tokens, each one's estimated probability (the product of the continuation's
    frequencies up to it), their sum (the score proposals are ranked by), the match length it continues,
    and which tree it came from ("local", "global" or "" for none)."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""

    @property
    def k(self) -> int:
        return len(self.token_ids)

    def past_first(self) -> SuffixDraft:
        """The proposal after its first token, given that token: each probability divided by the first's
        (a chained block's, whose first token is the bonus token it assumes; see `chained_block`)."""
        first = self.probs[0] if self.probs and self.probs[0] > 0 else 1.0
        probs = [p / first for p in self.probs[1:]]
        return SuffixDraft(self.token_ids[1:], probs, sum(probs), self.match_len + 1, self.source)


def _dict_bytes(n: int) -> int:
    """What CPython allocates for a dict of n int keys grown one insertion at a time (the table doubles)."""
    return _DICT_SIZES[n] if n < len(_DICT_SIZES) else _DICT_SIZES[-1] * (1 << max(0, (n // 5).bit_length() - 5))


def _dict_sizes(upto: int = 160) -> list[int]:
    sizes, d = [0], {}
    for i in range(upto):
        d[i] = i
        sizes.append(sys.getsizeof(d))
    return sizes


_DICT_SIZES = _dict_sizes()


class _Open:
    """A sequence's open windows, each named by the position it began at: `nodes[ws - first]` is the node
    the window that began at ws ends in (the oldest first: one closes and one opens per token), `busy` the
    windows visited per token, oldest first."""

    __slots__ = ("busy", "first", "nodes")

    def __init__(self) -> None:
        self.busy: list[int] = []
        self.first = 0
        self.nodes: list[int] = []


class SuffixTree:
    """A suffix tree of bounded depth over sequences of token ids, with counts: every window of up to
    `max_depth` tokens of every sequence is a path from the root, a node's count is the windows that pass
    through or end in it. `append` / `extend` add a sequence's tokens (a sequence is open for more until
    `close`), `remove` takes a whole sequence out, `speculate` (a walk per match length) and `propose` (from
    a match state) propose.

    Node i: `_length[i]` tokens, read from `_ref[i][_start[i] : _start[i] + _length[i]]` (an occurrence of
    the node's whole path, so a shorter or longer run of the same path can be read from the same array);
    `_children[i]` maps a child's first token to the child (None: a leaf); `_head[i]` is its most frequent
    child (ties: the smallest first token, so that the choice depends on the text alone), NO_CHILD, or
    STALE. Node 0 is the root."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = max_depth
        self._count: list[int] = [0]
        self._length: list[int] = [0]
        self._parent = array("i", [-1])
        self._ref: list[array | None] = [None]
        self._start = array("i", [0])
        self._children: list[dict[int, int] | None] = [None]
        self._head = array("i", [NO_CHILD])
        self._free: list[int] = []
        self._seqs: dict[int, array] = {}
        self._open: dict[int, _Open] = {}  # the open windows of each sequence that may grow
        self._lazy: dict[int, tuple[int, int]] = {}  # a lazy window's leaf -> (its sequence, where it began)
        self._dict_bytes = 0  # children maps, as their sizes grew (an estimate: removals do not shrink one)
        self.version = 0  # changes with every change of the tree: match states are valid for one version
        self._retired: list[weakref.ref[array]] = []  # removed sequences, alive while nodes read them

    # --- size ------------------------------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        return len(self._count) - len(self._free)

    @property
    def tokens(self) -> int:
        """Tokens of the sequences held."""
        return sum(len(s) for s in self._seqs.values())

    @property
    def sequences(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def sequence(self, seq_id: int) -> array:
        """The tokens of sequence `seq_id` so far (the tree's own array: not to be changed)."""
        return self._seqs.get(seq_id) or array("i")

    def nbytes(self) -> int:
        """Memory the tree holds: per node slot its arrays and list entries (8-byte pointers, 4-byte ints),
        the children maps, the sequences' tokens (those of removed sequences that nodes still read
        included), the open windows. Small ints (counts, lengths below 257) are CPython's shared objects."""
        slots = len(self._count)
        per_slot = 8 + 8 + 4 + 8 + 4 + 8 + 4  # count, length, parent, ref, start, children, head
        seqs = sum(s.buffer_info()[1] * s.itemsize + 64 for s in self._seqs.values())
        self._retired = [r for r in self._retired if r() is not None]
        retired = sum(s.buffer_info()[1] * s.itemsize + 64 for r in self._retired if (s := r()) is not None)
        windows = sum(400 + 16 * len(w.nodes) for w in self._open.values()) + 100 * len(self._lazy)
        return slots * per_slot + 8 * len(self._free) + self._dict_bytes + seqs + retired + windows

    # --- building ------------------------------------------------------------------------------------------
    def _new_node(self, parent: int, ref: array, start: int, length: int, count: int) -> int:
        if self._free:
            n = self._free.pop()
            self._count[n], self._length[n], self._parent[n] = count, length, parent
            self._ref[n], self._start[n], self._children[n], self._head[n] = ref, start, None, NO_CHILD
            return n
        self._count.append(count)
        self._length.append(length)
        self._parent.append(parent)
        self._ref.append(ref)
        self._start.append(start)
        self._children.append(None)
        self._head.append(NO_CHILD)
        return len(self._count) - 1

    def _free_node(self, n: int) -> None:
        ch = self._children[n]
        if ch is not None:
            self._dict_bytes -= _dict_bytes(len(ch))
        self._children[n] = None
        self._ref[n] = None  # a removed sequence's array is freed once no node reads it
        self._count[n] = 0
        self._free.append(n)

    def _add_child(self, n: int, token: int, c: int) -> None:
        ch = self._children[n]
        if ch is None:
            self._children[n] = {token: c}
            self._dict_bytes += _dict_bytes(1)
        else:
            size = len(ch)
            ch[token] = c
            self._dict_bytes += _dict_bytes(size + 1) - _dict_bytes(size)

    def append(self, seq_id: int, token: int) -> None:
        self.extend(seq_id, (token,))

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `seq_id` (a new one if unknown). Each token opens a window, grows every
        open window of the sequence by one and closes the one that reaches the depth.

        A window alone in a leaf (most of them: a long window of new text occurs once) is *lazy*: its leaf
        grows by every token of its sequence without being visited, its length brought up to date at the end
        of the call, when the window closes, or when another window reaches the leaf (which makes it
        *busy* again). Only busy windows are visited per token; Arctic visits every window."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = array("i")
            self._open[seq_id] = _Open()
        state = self._open.get(seq_id)
        if state is None:
            raise ValueError(f"sequence {seq_id} is closed")
        self.version += 1
        busy, wnodes, lazy = state.busy, state.nodes, self._lazy
        count, length, parent, ref, start = self._count, self._length, self._parent, self._ref, self._start
        children, head, depth = self._children, self._head, self.max_depth
        for token in tokens:
            pos = len(seq)
            seq.append(token)
            count[0] += 1
            closing = pos - depth  # the window that began `depth` tokens ago is complete
            if closing >= state.first and wnodes:
                n = wnodes[0]
                del wnodes[0]
                state.first += 1
                if lazy.pop(n, None) is not None:
                    length[n] = closing + depth - start[n]
                else:
                    del busy[0]  # the oldest busy window
            w0 = state.first  # where the oldest open window began
            wnodes.append(0)
            busy.append(pos)
            still: list[int] = []
            for ws in busy:
                n = wnodes[ws - w0]
                ch = children[n]
                c = ch.get(token, -1) if ch is not None else -1
                if c >= 0 and count[c] == 1 and c in lazy:  # another window's private leaf: wake it
                    self._wake(c, seq_id, still)
                if c < 0:
                    if n and count[n] == 1:
                        # A leaf that only this window reaches (other counts fell): it grows by the token.
                        length[n] += 1
                        ref[n], start[n] = seq, pos - length[n] + 1
                        lazy[n] = (seq_id, ws)
                        continue
                    c = self._new_node(n, seq, pos, 1, 1)
                    self._add_child(n, token, c)
                    h = head[n]
                    if h == NO_CHILD or (h >= 0 and count[h] == 1 and token < ref[h][start[h]]):  # type: ignore[index]
                        head[n] = c
                    wnodes[ws - w0] = c
                    lazy[c] = (seq_id, ws)
                    continue
                if n and count[n] == count[c] + 1:
                    # This window alone ends at n; every other one through n goes on into c, its only child.
                    if length[c] == 1:  # n and c become one node (c's id, n's place)
                        p = parent[n]
                        count[c] += 1
                        length[c] = length[n] + 1
                        ref[c], start[c] = seq, pos - length[c] + 1
                        parent[c] = p
                        children[p][seq[start[c]]] = c  # type: ignore[index]  # p has n as a child
                        if head[p] == n:
                            head[p] = c
                        children[n] = None  # its one entry moved to p's map
                        self._dict_bytes -= _dict_bytes(1)
                        self._free_node(n)
                        wnodes[ws - w0] = c
                    else:  # n takes c's first token
                        length[n] += 1
                        ref[n], start[n] = seq, pos - length[n] + 1
                        length[c] -= 1
                        start[c] += 1
                        first = ref[c][start[c]]  # type: ignore[index]  # a live node reads an array
                        if first != token:
                            del ch[token]  # type: ignore[union-attr]  # c is n's child
                            ch[first] = c  # type: ignore[index]
                elif length[c] == 1:  # the window steps into c
                    count[c] += 1
                    ref[c], start[c] = seq, pos
                    h = head[n]
                    if (
                        h >= 0
                        and h != c
                        and (
                            count[c] > count[h] or (count[c] == count[h] and token < ref[h][start[h]])  # type: ignore[index]
                        )
                    ):
                        head[n] = c
                    wnodes[ws - w0] = c
                else:  # c splits after its first token, which the window takes
                    m = self._new_node(n, seq, pos, 1, count[c] + 1)
                    length[c] -= 1
                    start[c] += 1
                    parent[c] = m
                    children[m] = {ref[c][start[c]]: c}  # type: ignore[index]
                    self._dict_bytes += _dict_bytes(1)
                    head[m] = c
                    ch[token] = m  # type: ignore[index]
                    h = head[n]
                    if h == c or (
                        h >= 0 and (count[m] > count[h] or (count[m] == count[h] and token < ref[h][start[h]]))  # type: ignore[index]
                    ):
                        head[n] = m
                    wnodes[ws - w0] = m
                still.append(ws)
            busy[:] = still
        end = len(seq)
        for n in wnodes:  # the lazy leaves, up to date for readers
            if n in lazy:
                length[n] = end - start[n]

    def _wake(self, leaf: int, current: int, still: list[int]) -> None:
        """A lazy window's leaf is reached by another window: its length up to date (the leaf ends where its
        sequence does, this token included if it is the current one), the window busy again (`still`: the
        current sequence's busy windows so far, in order)."""
        owner, ws = self._lazy.pop(leaf)
        ref = self._ref[leaf]
        assert ref is not None  # a lazy leaf reads its sequence
        self._length[leaf] = len(ref) - self._start[leaf]
        bisect.insort(still if owner == current else self._open[owner].busy, ws)

    def close(self, seq_id: int) -> None:
        """No more tokens for `seq_id`: forget its open windows (the sequence stays until removed)."""
        state = self._open.pop(seq_id, None)
        if state is not None:
            for n in state.nodes:
                self._lazy.pop(n, None)

    def remove(self, seq_id: int) -> None:
        """Take sequence `seq_id` out: every window of it, its counts, the nodes only it reached."""
        self.close(seq_id)
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self.version += 1
        self._retired.append(weakref.ref(seq))
        if len(self._retired) > 2 * len(self._seqs) + 64:  # forget the freed ones now and then
            self._retired = [r for r in self._retired if r() is not None]
        count, length, parent, start, children, head = (
            self._count,
            self._length,
            self._parent,
            self._start,
            self._children,
            self._head,
        )
        size, depth = len(seq), self.max_depth
        for i in range(size):
            count[0] -= 1
            n, pos, end = 0, i, min(size, i + depth)
            while pos < end:
                token = seq[pos]
                ch = children[n]
                assert ch is not None  # every window of a held sequence is a path
                c = ch[token]
                count[c] -= 1
                if count[c] == 0:
                    del ch[token]
                    self._dict_bytes -= _dict_bytes(len(ch) + 1) - _dict_bytes(len(ch))
                    if not ch:
                        children[n] = None
                        self._dict_bytes -= _dict_bytes(0)
                        head[n] = NO_CHILD
                    elif head[n] == c:
                        head[n] = STALE
                    self._free_subtree(c)
                    break
                if head[n] == c and n:  # a sibling may now be the most frequent (the root's is never read)
                    head[n] = STALE
                pos += length[c]
                n = c
            # The window ended at n: if no other window ends there, n and its only child are one run.
            ch = children[n]
            if n and ch is not None and len(ch) == 1:
                (c,) = ch.values()
                if count[c] == count[n]:
                    p = parent[n]
                    length[c] += length[n]
                    start[c] -= length[n]
                    parent[c] = p
                    children[p][self._first(n)] = c  # type: ignore[index]  # p has n as a child
                    if head[p] == n:
                        head[p] = c
                    children[n] = None
                    self._dict_bytes -= _dict_bytes(1)
                    self._free_node(n)

    def _free_subtree(self, n: int) -> None:
        stack = [n]
        while stack:
            m = stack.pop()
            ch = self._children[m]
            if ch is not None:
                stack.extend(ch.values())
            self._free_node(m)

    def _first(self, n: int) -> int:
        return self._ref[n][self._start[n]]  # type: ignore[index]  # a live node reads an array

    def _best_child(self, n: int) -> int:
        """n's most frequent child (found again if a count fell since)."""
        h = self._head[n]
        if h == STALE:
            ch = self._children[n]
            assert ch is not None  # a node without children has NO_CHILD
            count = self._count
            h = max(ch.items(), key=lambda tc: (count[tc[1]], -tc[0]))[1]
            self._head[n] = h
        return h

    # --- proposing ----------------------------------------------------------------------------------------
    def match(self, pattern: array, begin: int = 0) -> tuple[int, int] | None:
        """Where `pattern[begin:]` (an array of token ids) ends in the tree, (node, tokens of that node
        matched), or None. A node's run is compared as one slice."""
        length, ref, start, children = self._length, self._ref, self._start, self._children
        n, i, end, take = 0, begin, len(pattern), 0
        while i < end:
            ch = children[n]
            if ch is None:
                return None
            n = ch.get(pattern[i], -1)
            if n < 0:
                return None
            take = min(length[n], end - i)
            if take > 1:
                s = start[n] + 1
                if ref[n][s : s + take - 1] != pattern[i + 1 : i + take]:  # type: ignore[index]
                    return None
            i += take
        return n, take

    def follow(
        self, n: int, idx: int, max_tokens: int, min_prob: float, need: float = -1.0, tie: bool = False
    ) -> tuple[list[int], list[float], float] | None:
        """The most frequent continuation from `idx` tokens into node n: (tokens, probabilities, score); None
        as soon as it cannot score more than `need` (or as much, with `tie`): a probability only falls along
        the way, so the rest can add at most the current one per token left."""
        length, ref, start, count = self._length, self._ref, self._start, self._count
        tokens: list[int] = []
        probs: list[float] = []
        prob, score = 1.0, 0.0
        while len(tokens) < max_tokens and prob >= min_prob:
            run = length[n] - idx
            if run > 0:
                take = min(run, max_tokens - len(tokens))
                base = start[n] + idx
                tokens.extend(ref[n][base : base + take])  # type: ignore[index]  # a live node reads an array
                probs.extend([prob] * take)
                for _ in range(take):  # added one by one, as a token at a time would be
                    score += prob
                idx += take
            else:
                c = self._head[n]
                if c == NO_CHILD:
                    break
                if c == STALE:
                    c = self._best_child(n)
                prob *= count[c] / count[n]
                n, idx = c, 0
                if prob >= min_prob and not _may_reach(score, prob, max_tokens - len(tokens), need, tie):
                    return None
        return tokens, probs, score

    def step(self, at: tuple[int, int], token: int) -> tuple[int, int] | None:
        """The position one token further than `at` (node, tokens of it matched), or None."""
        n, idx = at
        if idx < self._length[n]:
            return (n, idx + 1) if self._ref[n][self._start[n] + idx] == token else None  # type: ignore[index]
        ch = self._children[n]
        c = ch.get(token, -1) if ch is not None else -1
        return (c, 1) if c >= 0 else None

    def advance(self, state: MatchState, tokens: Iterable[int]) -> MatchState:
        """A match state fed `tokens`. A match state is (nodes, idxs): the last m tokens of the text fed so far
        end `idxs[m - 1]` tokens into node `nodes[m - 1]`, for every m up to the longest match (a suffix of a
        match matches: they are 1 .. M), at most depth - 1; it is valid for the tree's `version` it was fed
        against. (`step` per position, written out: this runs for every committed token.)"""
        length, ref, start, children = self._length, self._ref, self._start, self._children
        limit = self.max_depth - 2  # positions that can grow by one more token
        root = children[0]
        nodes, idxs = state
        for token in tokens:
            c = root.get(token, -1) if root is not None else -1
            if c < 0:
                nodes, idxs = [], []
                continue
            grown, into = [c], [1]
            for j in range(min(len(nodes), limit)):
                n, idx = nodes[j], idxs[j]
                if idx < length[n]:
                    if ref[n][start[n] + idx] != token:  # type: ignore[index]  # a live node reads an array
                        break
                    grown.append(n)
                    into.append(idx + 1)
                else:
                    ch = children[n]
                    c = ch.get(token, -1) if ch is not None else -1
                    if c < 0:
                        break
                    grown.append(c)
                    into.append(1)
            nodes, idxs = grown, into
        return nodes, idxs

    def open_nodes(self, seq_id: int, longest: int | None = None) -> list[int]:
        """An open sequence's own match state, read off its open windows (its last m tokens end at the end
        of the node its window of length m does) without a walk: the nodes for m up to `longest` (default:
        every open window)."""
        state = self._open.get(seq_id)
        if state is None:
            return []
        wnodes = state.nodes
        most = min(self.max_depth - 1, len(wnodes))
        if longest is not None:
            most = min(most, longest)
        return wnodes[: -most - 1 : -1] if most > 0 else []

    def open_state(self, seq_id: int) -> MatchState:
        """`open_nodes` as a match state (for `advance`)."""
        nodes, length = self.open_nodes(seq_id), self._length
        return nodes, [length[n] for n in nodes]

    def speculate(
        self,
        pattern: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        beat: float = -1.0,
    ) -> SuffixDraft:
        """Arctic's proposal for the context whose last tokens are `pattern` (its `SuffixTree.speculate`):
        the pattern's match state by a walk per match length tried, then `propose`."""
        depth = self.max_depth
        if len(pattern) > depth:
            pattern = pattern[len(pattern) - depth :]
        if not isinstance(pattern, array):
            pattern = array("i", pattern)
        size = len(pattern)
        if size < 2 or len(self._count) == 1:
            return SuffixDraft()
        # The longest match, by bisection: the match lengths that match are exactly 1 .. M.
        found: dict[int, tuple[int, int]] = {}
        lo, hi = 0, size - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            got = self.match(pattern, size - mid)
            if got is None:
                hi = mid - 1
            else:
                found[mid] = got
                lo = mid

        state = []
        for m in range(1, lo + 1):
            got = found.get(m) or self.match(pattern, size - m)
            assert got is not None  # every m up to the longest matches
            state.append(got)
        nodes, idxs = [n for n, _ in state], [i for _, i in state]
        return self.propose(nodes, idxs, lo, max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, beat)

    def propose(
        self,
        nodes: Sequence[int],
        idxs: Sequence[int] | None,
        longest: int,
        max_spec_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        beat: float = -1.0,
    ) -> SuffixDraft:
        """The best continuation over match lengths m = 1 .. `longest`, the context's last m tokens ending
        `idxs[m - 1]` tokens into node `nodes[m - 1]` (a match state; `idxs` None: at the nodes' ends): the
        highest score, ties to the longer match, exactly as Arctic's loop over every m (at most min(cap,
        factor x m + offset) tokens each, and the depth left).

        Without a continuation per m: match lengths of equal count have the same occurrences (every occurrence
        of the shorter extends to the longer), so the same continuation, each as far as its bound lets it
        (the most frequent child is chosen by count and token, never by node): one walk from the match
        length of the largest bound answers all of them. A group scores at most that bound times the
        probability of its first token (no later one is likelier); groups are taken largest bound first and
        walked unless their ceiling cannot beat the best, until no bound can. `beat`: only a draft scoring
        above it is wanted (another tree's), so nothing that cannot is walked (the answer is then exact only
        if its score is above it)."""
        if longest < 1:
            return SuffixDraft()
        count, length, head = self._count, self._length, self._head
        table = _bounds(longest, self.max_depth, max_spec_tokens, max_spec_factor, max_spec_offset)
        bounds, peak = table.bounds, table.peak
        fewer = [-count[n] for n in nodes[:longest]]  # by m - 1, never falling: occurrences, negated
        groups = []
        lo = 0
        while lo < longest:
            hi = bisect.bisect_right(fewer, fewer[lo], lo)  # m = lo + 1 .. hi: one count
            chosen = peak[lo][hi]  # the largest bound, the longest m on a tie
            groups.append((bounds[chosen], hi, chosen, lo))
            lo = hi
        groups.sort(reverse=True)  # the largest bound first, then the longer matches
        best: SuffixDraft | None = None
        best_score, best_m = 0.0, longest
        for bound, hi, chosen, lo in groups:
            need = best_score if best_score > beat else beat
            if bound <= 0 or bound < need - 1e-9 * (1.0 + abs(need)):
                break  # no group from here on can reach the best
            n = nodes[chosen - 1]
            idx = idxs[chosen - 1] if idxs is not None else length[n]
            if idx < length[n]:
                first = 1.0
            else:
                c = head[n]
                if c == STALE:
                    c = self._best_child(n)
                if c < 0:
                    continue
                first = count[c] / count[n]
                if first < min_token_prob:
                    continue
            # A shorter match must beat the best, a longer one may tie it; `beat` must be beaten.
            tie = hi > best_m and best_score > beat
            rough = first * bound
            if rough < need - 1e-9 * (1.0 + abs(need)) or not _may_reach(0.0, first, bound, need, tie):
                continue
            found = self.follow(n, idx, bound, min_token_prob, need, tie)
            if found is None:
                continue
            tokens, probs, score = found
            # Every m of the group proposes this continuation cut at its bound: the group's best is the whole
            # of it, from the longest m whose bound takes all of it.
            m = table.longest_reaching(len(tokens), lo, hi)
            if score > best_score or (score == best_score and m > best_m):
                best = SuffixDraft(tokens, probs, score, m)
                best_score, best_m = score, m
        return best if best is not None else SuffixDraft(match_len=longest)  # Arctic's answer for no draft


def _may_reach(score: float, prob: float, tokens: int, need: float, tie: bool) -> bool:
    """Whether a proposal at `score` that goes on with at most `tokens` tokens, none likelier than `prob`,
    can end above `need` (or at it, with `tie`). Its ceiling is `tokens` tokens of `prob` added one at a time
    as a score is: rounding is monotonic, so no such proposal ends higher, and the comparison is exact. The
    product decides unless it is within rounding of `need`."""
    rough = score + prob * tokens
    if abs(rough - need) > 1e-9 * (1.0 + abs(need)):
        return rough > need
    for _ in range(tokens):
        score += prob
    return score > need or (tie and score == need)


class _Bounds:
    """For match lengths m = 1 .. longest: `bounds[m]`, the most tokens a match of m tokens may propose,
    min(cap, factor x m + offset with Arctic's rounding, depth - m) and never below 0; `peak[lo][hi]`, the m in
    lo + 1 .. hi of the largest bound (the longest on a tie). The bound rises with m, then falls."""

    def __init__(self, longest: int, depth: int, cap: int, factor: float, offset: float):
        self.bounds = [0] + [
            max(0, min(cap, int(m * factor + offset + 1e-6), depth - m)) for m in range(1, longest + 1)
        ]
        b = self.bounds
        self.peak = [
            [max(range(hi, lo, -1), key=b.__getitem__) if hi > lo else 0 for hi in range(longest + 1)]
            for lo in range(longest + 1)
        ]

    def longest_reaching(self, tokens: int, lo: int, hi: int) -> int:
        """The longest m in lo + 1 .. hi whose bound is at least `tokens` (there is one: the group's peak)."""
        b = self.bounds
        m = hi
        while b[m] < tokens:
            m -= 1
        return m


_BOUNDS: dict[tuple, _Bounds] = {}


def _bounds(longest: int, depth: int, cap: int, factor: float, offset: float) -> _Bounds:
    key = (longest, depth, cap, factor, offset)
    table = _BOUNDS.get(key)
    if table is None:
        table = _Bounds(longest, depth, cap, factor, offset)
        if len(_BOUNDS) < 4096:
            _BOUNDS[key] = table
    return table


class _Scope:
    """One tenant's (prefix-cache scope's) global tree, and how many of the cached generations are its."""

    def __init__(self, depth: int):
        self.tree = SuffixTree(depth)
        self.members = 0


class SuffixCache:
    """A draft replica's global trees: the outputs of its recent generations, one tree per prefix-cache
    scope, at most `max_cached_requests` generations in all, evicted first in, first out. A generation's
    output joins when it ends (`add`)."""

    # Output tokens added between two yields to the event loop (`aadd`).
    CHUNK = 1024

    def __init__(self, params: SuffixParams | None = None):
        self.params = params or SuffixParams()
        self._scopes: dict[str, _Scope] = {}
        self._fifo: OrderedDict[int, str] = OrderedDict()  # generation id -> its scope, oldest first
        self._next_id = 0
        self.evicted = 0  # generations evicted since start
        self.added_tokens = 0
        # Proposals made with these trees, and their tokens, by the tree they came from ("" for none).
        self.proposals = {"local": 0, "global": 0, "": 0}
        self.proposed_tokens = {"local": 0, "global": 0}

    @property
    def enabled(self) -> bool:
        return self.params.max_cached_requests > 0

    @property
    def cached_requests(self) -> int:
        return len(self._fifo)

    @property
    def scopes(self) -> int:
        return len(self._scopes)

    def tree(self, scope: str) -> SuffixTree | None:
        s = self._scopes.get(scope)
        return s.tree if s is not None else None

    def nbytes(self) -> int:
        """The global trees' memory, and the queue that orders their generations."""
        return sum(s.tree.nbytes() for s in self._scopes.values()) + 100 * len(self._fifo)

    def tokens(self) -> int:
        return sum(s.tree.tokens for s in self._scopes.values())

    def add(self, scope: str, tokens: Sequence[int]) -> None:
        """A finished generation's output, into `scope`'s tree (evicting the oldest past the bound)."""
        gid = self._open(scope, tokens)
        if gid is not None:
            self._tree_of(gid).extend(gid, tokens)
            self._close(gid)

    async def aadd(self, scope: str, tokens: Sequence[int]) -> None:
        """`add`, yielding to the event loop between chunks of a long output."""
        import asyncio

        gid = self._open(scope, tokens)
        if gid is None:
            return
        for i in range(0, len(tokens), self.CHUNK):
            if i:
                await asyncio.sleep(0)
            if gid not in self._fifo:  # evicted meanwhile by a burst of later generations
                return
            self._tree_of(gid).extend(gid, tokens[i : i + self.CHUNK])
        self._close(gid)

    def _open(self, scope: str, tokens: Sequence[int]) -> int | None:
        if not self.enabled or not tokens:
            return None
        gid = self._next_id
        self._next_id += 1
        s = self._scopes.get(scope)
        if s is None:
            s = self._scopes[scope] = _Scope(self.params.max_tree_depth)
        s.members += 1
        self._fifo[gid] = scope
        self.added_tokens += len(tokens)
        while len(self._fifo) > self.params.max_cached_requests:
            self._evict()
        return gid

    def _tree_of(self, gid: int) -> SuffixTree:
        return self._scopes[self._fifo[gid]].tree

    def _close(self, gid: int) -> None:
        if gid in self._fifo:
            self._tree_of(gid).close(gid)

    def _evict(self) -> None:
        gid, scope = self._fifo.popitem(last=False)
        s = self._scopes[scope]
        s.tree.remove(gid)
        s.members -= 1
        self.evicted += 1
        if not s.members:
            del self._scopes[scope]


LOCAL_SEQ = 0  # the local tree's one sequence


def _beats_a_step(draft: SuffixDraft, round_s: Callable[[int, int], float | None] | None) -> bool:
    """Whether a block of the trees promises at least a target-only step's tokens per second (1 + score for
    its round, by `round_s`, the policy's model of a round's time by positions verified; True unmodelled)."""
    if round_s is None:
        return True
    t_block, t_step = round_s(draft.k + 1, 0), round_s(1, 0)
    return not (t_block and t_step and (1.0 + draft.score) / t_block < 1.0 / t_step)


class SuffixDrafter:
    """One generation's suffix drafting: its local tree over prompt + output, and its scope's global tree
    in `cache` (None: local only), which gets the output when the generation ends (`finish`). A seeded
    request drafts from its local tree only: the verifier's random draws follow the drafts, and a replay must
    draw the same, whatever other traffic taught the global tree.

    The context's match state in the global tree (where each of its last m tokens end) is kept between
    rounds, advanced by the committed tokens, and found again only when the tree changed.

    `speculate` is the proposal with what a caller choosing among drafters needs (the match length and
    the estimated probability of each token); `propose` is the Drafter interface."""

    # Prompt tokens added to the local tree between two yields to the event loop: a long prompt's tree is
    # built without holding up the other sessions for long.
    BUILD_CHUNK = 1024

    def __init__(self, cache: SuffixCache | None = None, scope: str = "", params: SuffixParams | None = None):
        self.cache = cache
        self.scope = scope
        self.params = params or (cache.params if cache is not None else SuffixParams())
        self.local = SuffixTree(self.params.max_tree_depth)
        self.prompt_tokens = 0
        self.use_global = False
        # Most tokens in a block of `free_block` (the verifier's limit, or the request's K); 0: the round's K.
        self.cap = 0
        self._gtree: SuffixTree | None = None  # the global tree the match state was fed against
        self._gversion = -1
        self._gstate: MatchState = ([], [])

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        import asyncio

        self.local = SuffixTree(self.params.max_tree_depth)
        self.prompt_tokens = len(prompt_ids)
        for i in range(0, len(prompt_ids), self.BUILD_CHUNK):
            if i:
                await asyncio.sleep(0)
            self.local.extend(LOCAL_SEQ, prompt_ids[i : i + self.BUILD_CHUNK])
        self.use_global = self.cache is not None and self.cache.enabled and params.seed is None
        self._gtree = None

    def _global(self) -> tuple[SuffixTree, MatchState] | None:
        """The scope's global tree and the context's match state in it (None: no tree to draft from)."""
        tree = self.cache.tree(self.scope) if self.use_global and self.cache is not None else None
        if tree is None or tree.nodes == 1:
            return None
        if tree is not self._gtree or tree.version != self._gversion:
            context = self.local.sequence(LOCAL_SEQ)
            self._gstate = tree.advance(([], []), context[-self.params.max_tree_depth :])
            self._gtree, self._gversion = tree, tree.version
        return tree, self._gstate

    def speculate(self, k: int, after: Sequence[int] = ()) -> SuffixDraft:
        """The best proposal of at most k tokens after the context + `after` (tokens assumed, not committed),
        from the local tree and the scope's global tree (which must score higher to win, as in vLLM)."""
        p = self.params
        args = (k, p.max_spec_factor, p.max_spec_offset, p.min_token_prob)
        # Arctic tries match lengths below the pattern's (the context's last max_tree_depth tokens).
        most = min(p.max_tree_depth, len(self.local.sequence(LOCAL_SEQ)) + len(after)) - 1
        if after:
            nodes, idxs = self.local.advance(self.local.open_state(LOCAL_SEQ), after)
            local = self.local.propose(nodes, idxs, min(most, len(nodes)), *args)
        else:
            own = self.local.open_nodes(LOCAL_SEQ, most)
            local = self.local.propose(own, None, len(own), *args)
        local.source = "local" if local.token_ids else ""
        found = self._global()
        if found is None:
            return local
        tree, state = found
        if after:
            state = tree.advance(state, after)
        nodes, idxs = state
        glob = tree.propose(nodes, idxs, min(most, len(nodes)), *args, beat=local.score)
        if glob.score > local.score:
            glob.source = "global"
            return glob
        return local

    async def propose(
        self, k: int, after: Sequence[int] = (), should_stop: Callable[[], bool] | None = None
    ) -> DraftBlock:
        draft = self.speculate(k, after)
        self.count(draft)
        return DraftBlock(draft.token_ids)

    def free_block(
        self, k: int, budget: int, round_s: Callable[[int, int], float | None] | None = None
    ) -> DraftBlock | None:
        """The trees' block for the next round, up to `cap` (and `budget`) tokens, whatever the policy's K (0
        included): it costs no draft forward, so the loop asks for it every round and sends it whole (as the
        hybrid's). None without a proposal, or when by `round_s` (the policy's model of a round's time by the
        positions verified) its expected tokens, 1 + score, per second fall below a target-only step's."""
        cap = min(self.cap or k, budget)
        draft = self.speculate(cap) if cap > 0 else None
        if draft is None or not draft.token_ids or not _beats_a_step(draft, round_s):
            return None
        self.count(draft)
        return DraftBlock(draft.token_ids, method="suffix")

    def guess_after(self, after: Sequence[int], cap: int) -> tuple[int, SuffixDraft] | None:
        """The trees' next token after the context + `after` (the bonus token of a round that takes `after`
        whole) and their proposal of up to `cap` tokens past it, its probabilities given that token; None
        where they guess no such pair."""
        if cap <= 0:
            return None
        guess = self.speculate(cap + 1, after)
        return (guess.token_ids[0], guess.past_first()) if guess.k >= 2 else None

    def chained_block(
        self, after: Sequence[int], k: int, budget: int, round_s: Callable[[int, int], float | None] | None = None
    ) -> tuple[DraftBlock, int] | None:
        """The block for the round after the one verifying `after` (a block in flight), drafted as if that
        round took it whole and ended with the trees' next token, and that token: sent before the verdict
        (VerifyRequest.chained_after), it is verified as soon as the verdict is out when the guess holds. None
        where the trees guess no bonus token and block, or where the block would not be sent after the
        verdict either (`free_block`'s rule, its probabilities given the guess)."""
        found = self.guess_after(after, min(self.cap or k, budget))
        if found is None or not _beats_a_step(found[1], round_s):
            return None
        self.count(found[1])
        return DraftBlock(found[1].token_ids, method="suffix"), found[0]

    def count(self, draft: SuffixDraft) -> None:
        """A proposal that was sent, in the replica's counts by source tree."""
        if self.cache is not None:
            self.cache.proposals[draft.source] += 1
            if draft.source:
                self.cache.proposed_tokens[draft.source] += draft.k

    def commit(self, tokens: list[int]) -> None:
        self.local.extend(LOCAL_SEQ, tokens)
        tree = self._gtree
        if tree is not None and tree.version == self._gversion:
            self._gstate = tree.advance(self._gstate, tokens)

    async def finish(self, output_ids: Sequence[int]) -> None:
        """The generation ended with `output_ids`: they join the scope's global tree (not a seeded one's),
        led by the prompt's last max_tree_depth - 1 tokens, so that a context ending as this prompt did
        matches into the output from its first token (a request sent again, an agent's step that repeats its
        predecessor's last words); without them an output's start is found only once a few of its tokens
        are committed, and the first rounds are the model's."""
        if self.use_global and self.cache is not None:
            lead = max(0, self.prompt_tokens - (self.params.max_tree_depth - 1))
            context = self.local.sequence(LOCAL_SEQ)[lead : self.prompt_tokens]
            await self.cache.aadd(self.scope, [*context, *output_ids])
        self.use_global = False
