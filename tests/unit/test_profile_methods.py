"""The profiler's drafts by method: the draft service's per-method counters read into each phase, the suffix
trees' share of accepted tokens in the report, and advice on the suffix settings from their acceptance."""

from specmesh.profile.analysis import analyze, suffix_share
from specmesh.profile.collect import Endpoint, Phase, Result, Sample
from specmesh.profile.report import sections

DRAFT = [Endpoint("draft-0", "draft", "http://d0/metrics")]


def draft_page(**by_method: tuple[int, int]) -> Sample:
    page: Sample = {}
    for method, (drafted, accepted) in by_method.items():
        page[("specmesh_draft_spec_draft_tokens_total", (("method", method),))] = drafted
        page[("specmesh_draft_spec_accepted_tokens_total", (("method", method),))] = accepted
    return page


def phase(after: Sample, before: Sample | None = None) -> Phase:
    results = [Result(1.0, 16, {"rounds": 4, "drafts": 4, "drafted": 16, "accepted": 8})] * 8
    return Phase(
        "4 streams",
        4,
        True,
        wall=2.0,
        results=results,
        before={"draft-0": before or {}},
        after={"draft-0": after},
        peak={},
        sent=8,
    )


def test_the_phase_splits_drafts_by_method_and_the_report_shows_the_suffix_share():
    p = phase(draft_page(model=(300, 150), suffix=(200, 150)), draft_page(model=(100, 50), suffix=(0, 0)))
    f = analyze([p], DRAFT, {})
    s = f.summaries[0]
    assert s.by_method == {"model": (200, 100), "suffix": (200, 150)}
    assert suffix_share(s) == 0.6
    titles = {title: lines for title, lines, _ in sections(f, {})}
    assert "Drafts by method" in titles
    assert titles["Drafts by method"][-1] == "| 4 | 200 / 100 | 200 / 150 | 60 % |"
    assert not [r for r in f.recommendations if r.kind == "suffix"]  # 75 % accepted: nothing to change


def test_rejected_suffix_proposals_get_advice_and_one_method_gets_no_section():
    f = analyze([phase(draft_page(model=(100, 60), suffix=(400, 40)))], DRAFT, {})
    (rec,) = [r for r in f.recommendations if r.kind == "suffix"]
    assert "--suffix-decoding-min-token-prob" in rec.command and "10 %" in rec.why
    f = analyze([phase(draft_page(suffix=(400, 390)))], DRAFT, {})
    (rec,) = [r for r in f.recommendations if r.kind == "suffix"]
    assert "--suffix-decoding-max-spec-factor" in rec.command
    f = analyze([phase(draft_page(model=(400, 200)))], DRAFT, {})
    assert "Drafts by method" not in [title for title, _, _ in sections(f, {})]
    assert suffix_share(f.summaries[0]) is None
