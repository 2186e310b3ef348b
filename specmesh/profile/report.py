"""The optimization report: report.md, report.html (the same content) and small PNG plots beside them, plus
report.json (the findings as data, for scripts and tests)."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path

from specmesh.profile.analysis import BUDGET_PARTS, K_RANGE, KV_FULL, Findings, suffix_share

COLORS = {
    "drafting": "#e4803a",
    "network": "#8c6bb1",
    "verify queue": "#b7a5d6",
    "verify forward": "#3b75af",
    "sampling": "#7fb3d5",
    "other": "#a0a0a0",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=80)
    _plt().close(fig)
    return name


def plot_budget(f: Findings, out: Path) -> str | None:
    rows = [s for s in f.summaries if s.budget]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.2, 1.4 + 0.45 * len(rows)))
    labels = [f"{s.concurrency} stream(s)" if s.speculative else "target-only (per token)" for s in rows]
    left = [0.0] * len(rows)
    for part in BUDGET_PARTS:
        widths = [s.budget.get(part, 0.0) * 1e3 for s in rows]
        ax.barh(labels, widths, left=left, color=COLORS[part], label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("ms per round")
    ax.set_title("A round's time budget")
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.1 / len(rows)), frameon=False)
    return _save(fig, out, "round_budget.png")


def plot_acceptance(f: Findings, out: Path) -> str | None:
    acc = f.acceptance
    if not acc.drafted:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    pos = list(range(1, len(acc.drafted) + 1))
    ax.bar(pos, acc.cumulative, color="#3b75af", label="accepted up to here (P_i)")
    ax.plot(pos, acc.conditional, "o-", color="#e4803a", label="given the ones before (conditional)")
    ax.axhline(acc.alpha, color="#555", ls="--", lw=1, label=f"pooled α = {acc.alpha:.2f}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(pos)
    ax.set_title("Acceptance per position")
    ax.legend(fontsize=7)
    return _save(fig, out, "acceptance_per_position.png")


def plot_speedup(f: Findings, out: Path) -> str | None:
    m = f.model
    if m is None:
        return None
    single = min((s for s in f.summaries if s.speculative and s.budget), key=lambda s: s.concurrency)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ks = list(K_RANGE)
    ax.plot(ks, [m.speedup(k) for k in ks], "-", color="#3b75af", label="model (measured α and costs)")
    best = m.best_k()
    ax.plot([best], [m.speedup(best)], "*", ms=14, color="#2a9d4b", label=f"best K = {best}")
    measured = single.stream_rate / m.baseline_rate if m.baseline_rate else 0.0
    ax.plot([single.mean_k], [measured], "o", ms=8, color="#d62728", label=f"measured (mean K {single.mean_k:.1f})")
    if f.configured_k:
        ax.axvline(f.configured_k, color="#999", ls=":", lw=1, label=f"configured K = {f.configured_k}")
    ax.axhline(1.0, color="#555", lw=0.8)
    ax.set_xlabel("K (draft tokens per block)")
    ax.set_ylabel("speedup vs target-only")
    ax.set_title(f"Theoretical speedup vs K (1 stream, cost ratio {m.cost_ratio:.2f})")
    ax.legend(fontsize=7)
    return _save(fig, out, "speedup_vs_k.png")


def plot_batches(f: Findings, out: Path) -> str | None:
    rows = [s for s in f.summaries if s.speculative]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [s.verify_batch for s in rows], 0.4, color="#3b75af", label="verify (blocks)")
    ax.bar([i + 0.2 for i in x], [s.draft_batch for s in rows], 0.4, color="#e4803a", label="draft (sessions)")
    ax.plot(x, [s.concurrency for s in rows], "k_", ms=30, label="streams")
    ax.set_xticks(x, [f"{s.concurrency} streams" for s in rows])
    ax.set_ylabel("mean batch size")
    ax.set_title("Batch sizes per concurrency")
    ax.legend(fontsize=7)
    return _save(fig, out, "batch_sizes.png")


def plot_busy(f: Findings, out: Path) -> str | None:
    rows = [s for s in f.summaries if s.speculative and (s.busy or s.cpu)]
    if not rows:
        return None
    plt = _plt()
    names = sorted({n for s in rows for n in s.busy})
    procs = sorted({n for s in rows for n in s.cpu})
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.0))
    x = list(range(len(rows)))
    width = 0.8 / max(1, len(names))
    for j, n in enumerate(names):
        axes[0].bar(
            [i + j * width - 0.4 + width / 2 for i in x], [s.busy.get(n, 0) * 100 for s in rows], width, label=n
        )
    axes[0].axhline(85, color="#d62728", ls=":", lw=1)
    axes[0].set_xticks(x, [str(s.concurrency) for s in rows])
    axes[0].set_xlabel("streams")
    axes[0].set_ylabel("% of wall time")
    axes[0].set_title("Model thread busy", fontsize=10)
    if names:
        axes[0].legend(fontsize=7)
    width = 0.8 / max(1, len(procs))
    for j, n in enumerate(procs):
        axes[1].bar([i + j * width - 0.4 + width / 2 for i in x], [s.cpu.get(n, 0) for s in rows], width, label=n)
    if f.cores:
        axes[1].axhline(f.cores, color="#d62728", ls=":", lw=1, label=f"{f.cores} cores")
    axes[1].set_xticks(x, [str(s.concurrency) for s in rows])
    axes[1].set_xlabel("streams")
    axes[1].set_ylabel("CPU cores used")
    axes[1].set_title("Process CPU", fontsize=10)
    axes[1].legend(fontsize=7)
    return _save(fig, out, "utilization.png")


def plot_throughput(f: Findings, out: Path) -> str | None:
    rows = [s for s in f.summaries if s.speculative and s.requests]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.plot([s.concurrency for s in rows], [s.throughput for s in rows], "o-", color="#3b75af", label="speculative")
    base = next((s for s in f.summaries if not s.speculative and s.requests), None)
    if base is not None:
        ax.axhline(base.throughput, color="#555", ls="--", lw=1, label="target-only, 1 stream")
    ax.set_xscale("log", base=2)
    ax.set_xticks([s.concurrency for s in rows], [str(s.concurrency) for s in rows])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s (all streams)")
    ax.set_title("Throughput")
    ax.legend(fontsize=7)
    return _save(fig, out, "throughput.png")


PLOTS = (plot_budget, plot_acceptance, plot_speedup, plot_batches, plot_busy, plot_throughput)


# --- text ---------------------------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def sections(f: Findings, plots: dict[str, str]) -> list[tuple[str, list[str], str | None]]:
    """(title, markdown lines, plot file) per section, shared by report.md and report.html."""
    rec = f.record or {}
    plan = rec.get("plan") or {}
    spec = [s for s in f.summaries if s.speculative]
    base = next((s for s in f.summaries if not s.speculative and s.requests), None)
    out: list[tuple[str, list[str], str | None]] = []
    setup = [
        f"- stack: {rec.get('url', '(given by URL)')}, model `{rec.get('model', '?')}`",
    ]
    if plan:
        draft = "n-gram (prompt lookup)" if plan.get("algorithm") == "ngram" else f"`{plan.get('draft')}`"
        setup.append(
            f"- target `{plan.get('target')}`, draft {draft}, K ceiling {f.configured_k}, "
            f"{plan.get('verify_replicas')} verify / {plan.get('draft_replicas')} draft replica(s), "
            f"device {plan.get('device') or 'default'}"
        )
    if f.cores:
        setup.append(f"- {f.cores} CPU cores on the stack's machine")
    setup.append(
        "- phases: "
        + ", ".join(
            f"{s.name} ({s.requests} requests, {s.wall:.0f} s"
            + (f", {s.target_only_requests} decoded target-only by the stack" if s.target_only_requests else "")
            + (f", {s.handed_off_requests} probes handed back" if s.handed_off_requests else "")
            + (f", {s.errors} failed)" if s.errors else ")")
            for s in f.summaries
        )
    )
    out.append(("Set-up", setup, None))
    bottleneck = [f"**Bottleneck: {f.bottleneck}** — {f.bottleneck_text}."]
    if f.sensitivity:
        bottleneck.append(
            "What a part twice as fast would give one stream (model, at the best K): "
            + ", ".join(f"{k} {v * 100:+.0f} %" for k, v in sorted(f.sensitivity.items(), key=lambda kv: -kv[1]))
            + "."
        )
    out.append(("Bottleneck", bottleneck, None))
    recs = []
    for i, r in enumerate(f.recommendations, 1):
        recs.append(f"{i}. **{r.title}: {r.gain_text}.** {r.why}.")
        recs.append(f"   `{r.command}`")
    if not recs:
        recs.append("Nothing to change: no measured limit that a flag would move by more than 2 %.")
    out.append(("Recommendations (ranked by expected gain)", recs, None))
    budget = ["| phase | " + " | ".join(BUDGET_PARTS) + " | round (ms) |", "|---" * (len(BUDGET_PARTS) + 2) + "|"]
    for s in f.summaries:
        if s.budget:
            label = f"{s.concurrency} stream(s)" if s.speculative else "target-only, per token"
            parts = " | ".join(_ms(s.budget.get(p, 0.0)) for p in BUDGET_PARTS)
            budget.append(f"| {label} | {parts} | {_ms(sum(s.budget.values()))} |")
    budget.append("")
    budget.append(
        "Milliseconds per round. drafting: the draft service drafting the block (and drafting ahead); network: "
        "the round trip to the verify service and its gRPC handling; verify queue: the block's wait for its "
        "batch; verify forward: the batched target forward; sampling: rejection sampling and commit; other: "
        "the request's time outside its rounds (prefill, gateway, HTTP) spread over its rounds."
    )
    out.append(("A round's time budget", budget, plots.get("round_budget.png")))
    acc = f.acceptance
    lines = []
    if acc.drafted:
        lines.append("| position | " + " | ".join(str(i + 1) for i in range(len(acc.drafted))) + " |")
        lines.append("|---" * (len(acc.drafted) + 1) + "|")
        lines.append("| accepted up to here | " + " | ".join(f"{v:.2f}" for v in acc.cumulative) + " |")
        lines.append("| given the ones before | " + " | ".join(f"{v:.2f}" for v in acc.conditional) + " |")
        lines.append("| rounds | " + " | ".join(f"{v:.0f}" for v in acc.drafted) + " |")
        lines.append("")
    if spec:
        lines.append(
            "Mean accepted length (1 + accepted / drafts): "
            + ", ".join(f"{s.mean_accepted_length:.2f} at {s.concurrency} stream(s)" for s in spec if s.drafts)
            + "."
        )
    out.append(("Acceptance per position", lines, plots.get("acceptance_per_position.png")))
    m = f.model
    if m is not None:
        single = min((s for s in spec if s.budget), key=lambda s: s.concurrency)
        measured = single.stream_rate / m.baseline_rate if m.baseline_rate else 0.0
        best = m.best_k()
        lines = [
            f"- measured α (pooled per-token acceptance): **{acc.alpha:.3f}**",
            f"- draft time per token {_ms(m.t_draft)} ms; verify forward {_ms(m.a)} ms + {_ms(m.b)} ms per position "
            f"(fit over the target-only and speculative runs); cost ratio c = draft token / one-position target "
            f"forward = **{m.cost_ratio:.2f}**",
            f"- per round besides: {_ms(m.overhead)} ms (network, queueing, sampling); per request outside its "
            f"rounds: {_ms(m.fixed)} ms",
            f"- one stream: {single.stream_rate:.1f} tokens/s speculative at mean K {single.mean_k:.1f}"
            + (f", {m.baseline_rate:.1f} tokens/s target-only" if base is not None else " (baseline modelled)")
            + f": measured speedup **{measured:.2f}x**, model {m.speedup(single.mean_k):.2f}x at that K",
            f"- best K by the model: **{best}** ({m.speedup(best):.2f}x)",
        ]
        out.append(("α, cost ratio and the speedup against K", lines, plots.get("speedup_vs_k.png")))
    rows = ["| streams | tokens/s | latency (s) | verify batch | draft batch | model busy | CPU (cores) |"]
    rows.append("|---|---|---|---|---|---|---|")
    for s in f.summaries:
        busy = ", ".join(f"{n} {v * 100:.0f} %" for n, v in sorted(s.busy.items()))
        cpu = ", ".join(f"{n} {v:.2f}" for n, v in sorted(s.cpu.items()))
        label = str(s.concurrency) + ("" if s.speculative else " (target-only)")
        rows.append(
            f"| {label} | {s.throughput:.1f} | {s.mean_latency:.2f} | {s.verify_batch:.2f} | {s.draft_batch:.2f} "
            f"| {busy or '-'} | {cpu or '-'} |"
        )
    out.append(("Batches and utilisation per concurrency", rows, plots.get("batch_sizes.png")))
    out.append(("", [], plots.get("utilization.png")))
    out.append(("", [], plots.get("throughput.png")))
    kv = kv_lines(f)
    if kv:
        out.append(("KV cache", kv, None))
    step = cpu_step_lines(f)
    if step:
        out.append(("The verify forward on the CPU, by phase", step, None))
    methods = method_lines(f)
    if methods:
        out.append(("Drafts by method", methods, None))
    method = [
        "Each phase ran its streams back to back for its share of --duration; every service's /metrics was read "
        "just before and after it, so each number is that phase's own. Model busy: the share of wall time a "
        "service's model thread spent in forwards. The speedup model and its assumptions are in "
        "specmesh/profile/analysis.py; gains are estimates from it with the measured inputs.",
        *[f"- {n}" for n in f.notes],
    ]
    out.append(("Method", method, None))
    return out


def method_lines(f: Findings) -> list[str]:
    """Draft and accepted tokens by the method that drafted them, and the suffix trees' share of the accepted
    (none when one method drafted everything)."""
    spec = [s for s in f.summaries if s.speculative and s.by_method]
    if not any(len(s.by_method) > 1 or "suffix" in s.by_method for s in spec):
        return []
    names = sorted({m for s in spec for m in s.by_method})
    head = " | ".join(f"{m} drafted / accepted" for m in names)
    rows = [f"| streams | {head} | suffix share of accepted |", "|---|" + "---|" * (len(names) + 1)]
    for s in spec:
        cells = " | ".join(
            f"{s.by_method[m][0]:.0f} / {s.by_method[m][1]:.0f}" if m in s.by_method else "-" for m in names
        )
        share = suffix_share(s)
        rows.append(f"| {s.concurrency} | {cells} | {'-' if share is None else f'{share * 100:.0f} %'} |")
    return rows


def cpu_step_lines(f: Findings) -> list[str]:
    """The verify replicas' fused CPU forward split by its own clock, per phase (none where it did not run)."""
    rows = [s for s in f.summaries if s.cpu_step_calls and s.cpu_step_shares]
    if not rows:
        return []
    names = list(rows[0].cpu_step)
    lines = [
        "| phase | forwards | ms each | " + " | ".join(names) + " |",
        "|---" * (len(names) + 3) + "|",
    ]
    for s in rows:
        shares = s.cpu_step_shares
        ms = 1e3 * sum(s.cpu_step.values()) / s.cpu_step_calls
        cells = " | ".join(f"{shares.get(n, 0.0) * 100:.0f} %" for n in names)
        lines.append(f"| {s.name} | {s.cpu_step_calls:.0f} | {ms:.2f} | {cells} |")
    lines.append("")
    lines.append(
        "The verify service's fused CPU forward (a decode step, a verify batch, short prefill chunks) timed by its "
        "own clock: the layers' matrix products, attention (reading every sequence's keys and values), the norms "
        "and sums between products, the threads' wait at the barriers between them, the logits (the LM head). "
        "The products are bound by the weights' read at a step's few rows and by the CPU's arithmetic at a "
        "batch's many; attention by its KV's read, which --kv-cache-dtype bfloat16 halves; a large barrier wait "
        "means the threads do not have their cores to themselves."
    )
    return lines


def kv_lines(f: Findings) -> list[str]:
    """The KV section: the verify replicas' block pool per phase (none without one)."""
    rows = [(s, s.kv) for s in f.summaries if s.kv is not None]
    if not rows:
        return []
    lines = [
        "| phase | blocks used (peak) | shared (peak) | cached / free (end) | usage (peak) | preemptions "
        "| prefix-cache hits | the prompts could hit | evictions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s, k in rows:
        hit = f"{k.hit_rate * 100:.0f} % of {k.prefix_queries:.0f} tokens" if k.hit_rate is not None else "-"
        could = f"{k.expected_hit_rate * 100:.0f} %" if k.expected_hit_rate is not None else "-"
        lines.append(
            f"| {s.name} | {k.used_peak:.0f} of {k.num_blocks:.0f} | {k.shared_peak:.0f} "
            f"| {k.cached:.0f} / {k.free:.0f} | {k.usage_peak * 100:.0f} % | {k.preemptions:.0f} | {hit} | {could} "
            f"| {k.evictions:.0f} |"
        )
    k = rows[0][1]
    lines.append("")
    lines.append(
        f"Blocks of {k.block_size} tokens over {k.replicas} verify replica(s). used: held by sessions (shared ones "
        "once); shared: held by two sessions or more (a prefix computed once); cached: held by none but findable "
        "by content, taken when no free block is left (an eviction); peaks as sampled during the phase. "
        "Preemptions: sessions whose blocks were taken back when none was left, to be recomputed. Prefix-cache "
        "hits: prompt tokens (whole blocks) whose KV was found; the prompts could hit: the share of the phase's "
        "prompt text that a prompt sent before it began with too (a repeat, or a shared prefix), in characters."
    )
    full = [(s, k) for s, k in rows if k.usage_peak >= KV_FULL and not k.preemptions]
    if full:
        s, k = full[-1]
        lines.append(
            f"- at {s.concurrency} stream(s) the blocks were {k.usage_peak * 100:.0f} % in use at the peak with no "
            "preemption yet: more load will preempt sessions"
        )
    return lines


def write(f: Findings, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    for draw in PLOTS:
        name = draw(f, out)
        if name:
            plots[name] = name
    parts = sections(f, plots)
    md = ["# specmesh profile: optimization report", ""]
    for title, lines, plot in parts:
        if title:
            md += [f"## {title}", ""]
        md += lines
        if plot:
            md += ["", f"![{plot}]({plot})"]
        md.append("")
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(_html(parts))
    data = {
        "bottleneck": f.bottleneck,
        "bottleneck_text": f.bottleneck_text,
        "sensitivity": f.sensitivity,
        "configured_k": f.configured_k,
        "best_k": f.model.best_k() if f.model else None,
        "alpha": f.acceptance.alpha,
        "cost_ratio": f.model.cost_ratio if f.model else None,
        "acceptance_per_position": f.acceptance.cumulative,
        "recommendations": [
            {"title": r.title, "kind": r.kind, "gain": r.gain, "why": r.why, "command": r.command}
            for r in f.recommendations
        ],
        "phases": [
            {
                "name": s.name,
                "concurrency": s.concurrency,
                "speculative": s.speculative,
                "requests": s.requests,
                "target_only_requests": s.target_only_requests,
                "handed_off_requests": s.handed_off_requests,
                "throughput": s.throughput,
                "budget_seconds": s.budget,
                "verify_batch": s.verify_batch,
                "draft_batch": s.draft_batch,
                "busy": s.busy,
                "cpu": s.cpu,
                "kv": None if s.kv is None else {**asdict(s.kv), "hit_rate": s.kv.hit_rate},
                "cpu_step_seconds": s.cpu_step,
                "cpu_step_calls": s.cpu_step_calls,
            }
            for s in f.summaries
        ],
        "plots": sorted(plots),
    }
    (out / "report.json").write_text(json.dumps(data, indent=2))
    return {"md": out / "report.md", "html": out / "report.html", "json": out / "report.json"}


def _inline(text: str) -> str:
    """Markdown's **bold** and `code` in one line of escaped HTML."""
    import re

    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def _html(parts) -> str:
    body = []
    for title, lines, plot in parts:
        if title:
            body.append(f"<h2>{html.escape(title)}</h2>")
        table: list[list[str]] = []
        items: list[str] = []
        for line in [*lines, ""]:
            if line.startswith("|"):
                if not set(line) <= set("|-"):
                    table.append([c.strip() for c in line.strip("|").split("|")])
                continue
            if table:
                head, *rest = table
                body.append(
                    "<table><tr>"
                    + "".join(f"<th>{_inline(c)}</th>" for c in head)
                    + "</tr>"
                    + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rest)
                    + "</table>"
                )
                table = []
            if line[:1].isdigit() and ". " in line[:4]:
                items.append(f"<li>{_inline(line.split('. ', 1)[1])}")
            elif line.startswith("   `") and items:
                items[-1] += f"<pre>{html.escape(line.strip().strip('`'))}</pre></li>"
            elif line.startswith("- "):
                body.append(f"<p class='item'>{_inline(line[2:])}</p>")
            elif line:
                body.append(f"<p>{_inline(line)}</p>")
        if items:
            body.append("<ol class='recs'>" + "".join(items) + "</ol>")
        if plot:
            body.append(f"<figure><img src='{html.escape(plot)}' alt='{html.escape(plot)}'></figure>")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>specmesh profile</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }}
h1 {{ font-size: 1.5rem; }} h2 {{ font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }}
table {{ border-collapse: collapse; font-size: 0.85rem; }} td, th {{ border: 1px solid #ccc; padding: 0.2rem 0.5rem; }}
pre {{ background: #f4f4f4; padding: 0.4rem; white-space: pre-wrap; font-size: 0.8rem; }}
ol.recs li {{ margin-bottom: 0.8rem; }} p.item {{ margin: 0.2rem 0; }}
img {{ max-width: 100%; border: 1px solid #eee; }} img.missing {{ outline: 3px solid #d62728; }}
</style></head>
<body data-plots="loading">
<h1>specmesh profile: optimization report</h1>
{chr(10).join(body)}
<script>
// Marks each plot that failed to load (outlined in red), and counts on <body> the plots that did load.
window.addEventListener("load", () => {{
  const imgs = [...document.images];
  imgs.filter(i => !i.naturalWidth).forEach(i => i.classList.add("missing"));
  document.body.dataset.plots = imgs.filter(i => i.naturalWidth > 0).length + "/" + imgs.length;
}});
</script>
</body></html>
"""
