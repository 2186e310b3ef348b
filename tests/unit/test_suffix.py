"""Suffix drafting: the tree against brute-force counts, proposals against Arctic's loop over every match
length (a plain reference written from its definition), the global trees' FIFO bound and tenant scopes."""

import asyncio
import random
from array import array

import pytest

from specmesh.drafters import Algorithm, SuffixCache, SuffixDrafter, SuffixParams, make_drafter
from specmesh.drafters.suffix import NO_CHILD, STALE, SuffixTree
from specmesh.engine import SpeculativeEngine
from specmesh.errors import InvalidArgument
from specmesh.sampling import SamplingParams
from tests.support.models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


# --- the reference: counts by scanning, Arctic's speculate by its definition ---------------------------------
def count_of(seqs, s, depth):
    """Windows of `depth` tokens (or fewer, at a sequence's end) that begin with s."""
    if len(s) > depth:
        return 0
    return sum(1 for q in seqs for i in range(len(q) - len(s) + 1) if q[i : i + len(s)] == s)


def tree_count(tree, s):
    if not s:
        return tree._count[0]
    at = tree.match(array("i", s))
    return tree._count[at[0]] if at else 0


def reference_choice(nexts):
    """The most frequent continuation; among equal counts the smallest token (the choice depends on the
    text alone: Arctic's is arbitrary)."""
    return min(nexts, key=lambda t: (-nexts[t], t))


def reference_follow(seqs, depth, s, max_tokens, min_prob):
    tokens, probs, prob, cur = [], [], 1.0, list(s)
    while len(tokens) < max_tokens and len(cur) < depth:
        nexts = {}
        for q in seqs:
            for i in range(len(q) - len(cur)):
                if q[i : i + len(cur)] == cur:
                    nexts[q[i + len(cur)]] = nexts.get(q[i + len(cur)], 0) + 1
        if not nexts:
            break
        t = reference_choice(nexts)
        prob *= nexts[t] / count_of(seqs, cur, depth)
        if prob < min_prob:
            break
        tokens.append(t)
        probs.append(prob)
        cur.append(t)
    return tokens, probs


def reference_speculate(seqs, depth, pattern, cap, factor, offset, min_prob):
    """Arctic's SuffixTree::speculate: every match length m = 1 .. len(pattern) - 1 in turn, at most
    min(cap, factor x m + offset) tokens each, the best score kept (>=: ties to the longer match)."""
    pattern = pattern[-depth:]
    best = ([], 0.0, 0)
    for m in range(1, len(pattern)):
        if count_of(seqs, pattern[-m:], depth) == 0:
            break
        most = max(0, min(cap, int(m * factor + offset + 1e-6)))
        tokens, probs = reference_follow(seqs, depth, pattern[-m:], most, min_prob)
        score = 0.0
        for p in probs:
            score += p
        if score >= best[1]:
            best = (tokens, score, m)
    return best


def check_tree(tree, seqs, depth, alphabet, rng):
    subs = {tuple(q[i:j]) for q in seqs for i in range(len(q)) for j in range(i + 1, min(len(q), i + depth) + 1)}
    for s in subs:
        assert tree_count(tree, list(s)) == count_of(seqs, list(s), depth), s
    for _ in range(30):
        s = [rng.choice(alphabet) for _ in range(rng.randint(1, depth + 2))]
        assert tree_count(tree, s) == count_of(seqs, s, depth), s
    assert tree._count[0] == sum(len(q) for q in seqs)
    for n in set(range(len(tree._count))) - set(tree._free):
        ch, h = tree._children[n], tree._head[n]
        if ch is None:
            assert h == NO_CHILD
            continue
        for t, c in ch.items():
            assert tree._parent[c] == n and tree._first(c) == t and 0 < tree._count[c] <= tree._count[n]
        if n and h != STALE:
            assert h == ch[reference_choice({t: tree._count[c] for t, c in ch.items()})]


def random_args(rng):
    return rng.randint(0, 10), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 1.0]), rng.choice([0.0, 0.1, 0.4])


@pytest.mark.parametrize("seed", range(6))
def test_the_tree_counts_every_window_and_proposes_as_arctic(seed):
    """Sequences appended a few tokens at a time and interleaved, closed, removed oldest first (as the global
    trees evict): after every change the counts of every substring up to the depth are exact, every head is
    a most frequent child, and proposals (by a walk per match length, from a match state, from an open
    sequence's own windows) equal the reference's."""
    rng = random.Random(seed)
    for _ in range(12):
        depth, alphabet = rng.choice([1, 2, 3, 4, 6, 8]), list(range(rng.choice([2, 3, 5])))
        tree, seqs, order, open_ = SuffixTree(depth), {}, [], []
        for step in range(rng.randint(10, 80)):
            r = rng.random()
            if r < 0.15 or not open_:
                sid = step
                seqs[sid] = []
                open_.append(sid)
                order.append(sid)
            elif r < 0.25 and len(order) > 1:
                victim = order.pop(0)
                tree.remove(victim)
                seqs.pop(victim)
                if victim in open_:
                    open_.remove(victim)
            elif r < 0.3:
                tree.close(open_.pop(rng.randrange(len(open_))))
            else:
                sid = rng.choice(open_)
                sources = [q for q in seqs.values() if q]
                if sources and rng.random() < 0.4:  # repeat earlier text: shared paths, splits, fusions
                    q = rng.choice(sources)
                    tokens = q[rng.randrange(len(q)) :][: rng.randint(1, 40)]
                else:
                    tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 4))]
                tree.extend(sid, tokens)
                seqs[sid].extend(tokens)
            live = [q for q in seqs.values() if q]
            if step % 4 == 0:
                check_tree(tree, live, depth, alphabet, rng)
        live = [q for q in seqs.values() if q]
        check_tree(tree, live, depth, alphabet, rng)
        for _ in range(8):
            text = [rng.choice(alphabet) for _ in range(rng.randint(0, 12))]
            if live and rng.random() < 0.6:
                q = rng.choice(live)
                j = rng.randint(1, len(q))
                text = q[max(0, j - rng.randint(1, 12)) : j] + text[: rng.randint(0, 2)]
            args = random_args(rng)
            expected = reference_speculate(live, depth, text, *args)
            walked = tree.speculate(text, *args)
            nodes, idxs = tree.advance(([], []), text)
            stated = tree.propose(nodes, idxs, min(len(nodes), min(depth, len(text)) - 1), *args)
            for got in (walked, stated):
                assert (got.token_ids, got.score, got.match_len) == expected
        for sid in open_:
            if len(seqs[sid]) >= 2:
                own = tree.open_nodes(sid, min(depth, len(seqs[sid])) - 1)  # Arctic tries m < the pattern's
                got = tree.propose(own, None, len(own), 8, 1.0, 0.0, 0.1)
                assert (got.token_ids, got.score, got.match_len) == reference_speculate(
                    live, depth, seqs[sid], 8, 1.0, 0.0, 0.1
                )


def test_a_proposal_follows_the_most_frequent_continuation_and_stops_where_it_gets_unlikely():
    tree = SuffixTree(24)
    tree.extend(0, [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 9, 1, 2, 3, 4, 5, 9])
    tree.close(0)
    # "1 2 3" is followed by 4 three times out of 3; then 5 twice, 6 once: 5 (2/3), 9 (2/3)
    d = tree.speculate([7, 1, 2, 3], max_spec_tokens=8)
    assert d.token_ids == [4, 5, 9, 1, 2, 3][: len(d.token_ids)] and d.token_ids[:3] == [4, 5, 9]
    assert d.probs[:3] == pytest.approx([1.0, 2 / 3, 2 / 3])
    assert d.match_len == 3 and d.score == pytest.approx(sum(d.probs))
    # at most factor x match length tokens (a match of 3 tokens: 3), and the cap
    assert tree.speculate([7, 1, 2, 3], max_spec_tokens=2).token_ids == [4, 5]
    assert len(tree.speculate([7, 1, 2, 3], 8, max_spec_factor=1.0).token_ids) <= 3
    # min_token_prob 0.7 stops before the 2/3 branch
    assert tree.speculate([7, 1, 2, 3], 8, min_token_prob=0.7).token_ids == [4]
    assert tree.speculate([42, 43], 8).token_ids == []  # nothing matches


def test_a_long_context_builds_and_proposes_from_its_own_windows():
    """The local tree's text is the context itself: a proposal reads its nodes off the open windows, and
    agrees with a walk per match length; a context repeating itself is continued."""
    rng = random.Random(3)
    block = [rng.randrange(500) for _ in range(300)]
    text = block + [rng.randrange(500) for _ in range(2000)] + block[:150]
    tree = SuffixTree(24)
    for i in range(0, len(text), 37):
        tree.extend(0, text[i : i + 37])
    nodes = tree.open_nodes(0)
    assert len(nodes) == 23
    own = tree.propose(nodes, None, len(nodes), 16)
    walked = tree.speculate(text[-24:], 16)
    assert (own.token_ids, own.score, own.match_len) == (walked.token_ids, walked.score, walked.match_len)
    assert own.token_ids == block[150 : 150 + own.k] and own.k >= 8


def test_bad_parameters_are_refused_naming_them():
    for kw, name in [
        (dict(max_tree_depth=0), "suffix_decoding_max_tree_depth"),
        (dict(max_cached_requests=-1), "suffix_decoding_max_cached_requests"),
        (dict(max_spec_factor=-0.5), "suffix_decoding_max_spec_factor"),
        (dict(max_spec_factor=float("nan")), "suffix_decoding_max_spec_factor"),
        (dict(min_token_prob=1.5), "suffix_decoding_min_token_prob"),
    ]:
        with pytest.raises(InvalidArgument, match=name):
            SuffixParams(**kw)
    with pytest.raises(InvalidArgument, match="--suffix-decoding-max-tree-depth must be >= 1"):
        SuffixParams(max_tree_depth=0, flag=lambda n: "--" + n.replace("_", "-"))
    assert SuffixParams() == SuffixParams(24, 10_000, 1.0, 0.1)  # vLLM's defaults


def drafter(cache, scope, prompt, seed=None):
    d = SuffixDrafter(cache, scope)
    asyncio.run(d.start(list(prompt), SamplingParams(temperature=0.0, max_tokens=8, seed=seed)))
    return d


def test_the_global_trees_keep_the_latest_generations_first_in_first_out():
    cache = SuffixCache(SuffixParams(max_cached_requests=3))
    outputs = [[100 * (g + 1) + i for i in range(40)] for g in range(5)]
    for out in outputs:
        asyncio.run(drafter(cache, "", [1, 2]).finish(out))
    assert cache.cached_requests == 3 and cache.evicted == 2
    tree = cache.tree("")
    assert tree is not None and tree.sequences == 3
    for g, out in enumerate(outputs):  # a context ending in a generation's text is continued only if cached
        proposal = drafter(cache, "", [7, *out[:10]]).speculate(8)
        assert proposal.token_ids == (out[10:18] if g >= 2 else [])
        assert proposal.source == ("global" if g >= 2 else "")
    # its memory goes with the evicted
    full = cache.nbytes()
    for out in outputs[:3]:
        cache.add("", [x + 7 for x in out])
    assert cache.cached_requests == 3 and cache.nbytes() < 1.5 * full
    off = SuffixCache(SuffixParams(max_cached_requests=0))
    asyncio.run(drafter(off, "", [1, 2]).finish(outputs[0]))
    assert off.cached_requests == 0 and off.tree("") is None


def test_a_context_ending_as_a_cached_generations_prompt_did_is_continued_from_its_first_token():
    """An output joins the global tree led by its prompt's last max_tree_depth - 1 tokens (no more of it), so
    the same request sent again is drafted from its first round; without them a walk finds nothing until a few
    of the output's tokens are committed."""
    cache = SuffixCache()
    prompt, out = list(range(10, 60)), list(range(200, 240))
    asyncio.run(drafter(cache, "", prompt).finish(out))
    assert cache.tokens() == 23 + len(out)
    again = drafter(cache, "", [1, *prompt[-30:]])
    proposal = again.speculate(12)
    assert proposal.token_ids == out[:12] and proposal.source == "global"
    assert drafter(cache, "", [1, *prompt[:20]]).speculate(12).token_ids == []  # an earlier part: not held


def test_one_tenants_generations_never_shape_anothers_drafts():
    cache = SuffixCache()
    secret = list(range(300, 340))
    asyncio.run(drafter(cache, "tenant-a", [1]).finish(secret))
    asyncio.run(drafter(cache, "tenant-a/salt", [1]).finish([5, 6, 7, 8]))
    for scope in ("tenant-b", "", "tenant-a/other-salt"):
        d = drafter(cache, scope, [9, *secret[:12]])
        assert d.speculate(16).token_ids == []  # the secret's continuation is someone else's
        d.commit(secret[12:14])
        assert d.speculate(16).token_ids == []
    assert drafter(cache, "tenant-a", [9, *secret[:12]]).speculate(16).token_ids == secret[12:24]
    assert cache.scopes == 2


def test_a_seeded_request_drafts_from_its_own_tokens_only():
    """A seeded request must replay exactly, whatever other traffic taught the global tree since."""
    cache = SuffixCache()
    cache.add("", list(range(50, 90)))
    assert drafter(cache, "", [1, *range(50, 60)]).speculate(8).source == "global"
    seeded = drafter(cache, "", [1, *range(50, 60)], seed=3)
    assert seeded.speculate(8).token_ids == []
    asyncio.run(seeded.finish(list(range(200, 240))))  # nor does its output join the global tree
    assert cache.cached_requests == 1


def test_drafting_ahead_proposes_as_a_walk_over_the_context_and_the_tokens_assumed():
    """propose(after=...) (pipelined drafting: `after` is assumed, not committed) answers what walks over
    context + after give in each tree, the local tree's winning a tie; and after a commit, the kept match
    state answers what a walk does."""
    rng = random.Random(5)
    cache = SuffixCache()
    base = [rng.randrange(60) for _ in range(400)]
    for g in range(20):
        cache.add("", base[g * 15 : g * 15 + 60])
    tree = cache.tree("")
    sources = set()
    for _ in range(40):
        start = rng.randrange(300)
        prompt = base[start : start + rng.randint(5, 40)] + [rng.randrange(60)] * rng.randint(0, 1)
        ahead = base[start + 3 : start + 3 + rng.randint(1, 6)]
        d = drafter(cache, "", prompt)
        d.speculate(4)  # the match state is made now, and then kept
        got = d.speculate(10, after=ahead)
        text = prompt + ahead
        local = d.local.speculate(text, 10)
        glob = tree.speculate(text, 10)
        want = glob if glob.score > local.score else local
        assert (got.token_ids, got.score, got.match_len) == (want.token_ids, want.score, want.match_len)
        if rng.random() < 0.5:  # the tree changes under the kept match state: it is found again
            cache.add("", base[start + 2 : start + 50])
            glob = tree.speculate(text, 10)
        d.commit(ahead)
        got = d.speculate(10)
        local = d.local.speculate(text, 10)
        want = glob if glob.score > local.score else local
        assert (got.token_ids, got.score, got.match_len) == (want.token_ids, want.score, want.match_len)
        sources.add(got.source)
    assert sources >= {"local", "global"}


def test_the_registry_and_the_in_process_engine_draft_by_suffix():
    assert Algorithm.parse("suffix") is Algorithm.SUFFIX and not Algorithm.SUFFIX.needs_model
    assert [a.method for a in Algorithm] == ["model", "ngram", "suffix"]
    assert isinstance(make_drafter("suffix"), SuffixDrafter)
    target = tiny_model("llama", vocab=64, seed=8)
    engine = SpeculativeEngine.from_models(target)
    drafted = 0
    for p in [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8, 9, 7], [5] * 6, [11, 3, 40, 2]]:
        base = engine.generate(p, GREEDY, num_speculative_tokens=0)
        suffix = engine.generate(p, GREEDY, num_speculative_tokens=6, algorithm="suffix")
        assert suffix.token_ids == base.token_ids
        drafted += suffix.stats.drafted
    assert drafted > 0  # a tiny model's greedy output loops: its own output is there to copy


def test_a_free_block_runs_to_the_cap_whatever_the_round_s_k_unless_a_step_pays_more():
    """The loop asks the trees every round (K = 0 included): their block goes up to `cap` (the verifier's
    limit), or the round's K without a cap, and is withheld when the round model says a target-only step
    commits more tokens per second than the block's expected 1 + score."""
    cache = SuffixCache()
    cache.add("", list(range(50, 90)))
    d = drafter(cache, "", [1, *range(50, 60)])
    assert d.free_block(4, 100).token_ids == list(range(60, 64))  # no cap: the round's K
    d.cap = 8
    assert d.free_block(0, 100).token_ids == list(range(60, 68))
    assert d.free_block(0, 5).token_ids == list(range(60, 65))  # the request's budget
    assert d.free_block(4, 100, lambda rows, _ctx: 0.01 + 0.001 * rows).token_ids == list(range(60, 68))  # cheap rows
    assert d.free_block(4, 100, lambda rows, _ctx: 0.01 if rows == 1 else 1.0) is None  # a step pays more
    assert drafter(cache, "", [1, 2, 3]).free_block(4, 100) is None  # no match
