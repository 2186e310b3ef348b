"""bench.prefix_share's prompts (exact lengths, one shared prefix, nothing shared between the bursts) and its
KV figures from the verify service's metrics (null without a block pool)."""

from __future__ import annotations

from bench.prefix_share import kv_figures, make_prompts
from tests.support.models import demo_tokenizer

M = (("model_name", "demo"),)


def blocks(used, free, cached, shared, queries=0, hits=0, preemptions=0):
    page = {
        ("specmesh_verify_kv_block_size", ()): 16.0,
        ("vllm:kv_cache_usage_perc", M): used / (used + free + cached),
        ("vllm:prefix_cache_queries_total", M): float(queries),
        ("vllm:prefix_cache_hits_total", M): float(hits),
        ("vllm:num_preemptions_total", M): float(preemptions),
        ("specmesh_verify_kv_block_evictions_total", ()): 0.0,
    }
    for state, n in (("used", used), ("free", free), ("cached", cached), ("shared", shared)):
        page[("specmesh_verify_kv_blocks", (("state", state),))] = float(n)
    return page


def test_the_bursts_prompts_have_their_lengths_and_share_only_the_prefix():
    p = make_prompts(demo_tokenizer(), sessions=6, prefix=200, suffix=20)
    shared, unshared, (warm,) = p["shared"], p["unshared"], p["warm"]
    assert len(shared) == len(unshared) == 6 and all(len(x) == 220 for x in shared + unshared + [warm])
    assert all(x[:200] == shared[0][:200] for x in shared)
    assert len({tuple(x[200:]) for x in shared}) == 6  # a suffix each
    # no two of the unshared prompts (nor the warm-up) start with the same 16-token block, nor like the shared ones
    firsts = {tuple(x[:16]) for x in [*unshared, warm, shared[0]]}
    assert len(firsts) == 8


def test_kv_figures_are_the_bursts_differences_and_peaks_and_null_without_blocks():
    before = blocks(0, 90, 10, 0, queries=100, hits=20)
    peak = blocks(70, 30, 0, 12)
    after = blocks(2, 40, 58, 0, queries=900, hits=660, preemptions=1)
    k = kv_figures(before, after, peak)
    assert k["block_pool"] and k["block_size"] == 16 and k["blocks_total"] == 100
    assert (k["blocks_used_peak"], k["blocks_shared_peak"], k["blocks_used_end"]) == (70, 12, 2)
    assert (k["prefix_cache_query_tokens"], k["prefix_cache_hit_tokens"], k["prefix_cache_hit_rate"]) == (800, 640, 0.8)
    assert k["preemptions"] == 1 and k["kv_usage_peak"] == 0.7
    slots = {("vllm:kv_cache_usage_perc", M): 0.25, ("vllm:num_preemptions_total", M): 0.0}
    k = kv_figures(slots, slots, {})
    assert not k["block_pool"] and k["blocks_used_peak"] is None and k["prefix_cache_hit_tokens"] is None
    assert k["kv_usage_peak"] == 0.25 and k["preemptions"] == 0
