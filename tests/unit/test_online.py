"""Online distillation's parts: feedback windows, the trainer, versions, swaps and rollbacks."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from specmesh.domain import TokenLogprob
from specmesh.runtime.batched import BatchedRunner
from specmesh.training.online import OnlineConfig, OnlineDistiller, SessionFeedback, collate
from tests.support.models import tiny_model


def feedback_of(target, ids: list[int], start: int, k: int) -> list[TokenLogprob]:
    """What the verifier sends for tokens ids[start:]: each token's raw log-softmax top-k at its position."""
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    out = []
    for j in range(start, len(ids)):
        top = lp[j - 1].topk(k)
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist()))
        out.append(TokenLogprob(ids[j], float(lp[j - 1, ids[j]]), pairs))
    return out


def test_feedback_windows_line_up_with_the_tokens_they_predict():
    cfg = OnlineConfig(topk=3, window=8)
    got = []
    fb = SessionFeedback([1, 2, 3, 4, 5], cfg, got.append)
    tops = [TokenLogprob(t, -0.1, ((t, -0.1), (t + 1, -2.0), (t + 2, -3.0))) for t in (10, 11, 12, 13)]
    fb.extend([10, 11], tops[:2])
    assert got == []  # not a window's worth yet
    fb.extend([12, 13], tops[2:])
    fb.extend([14, 15, 16, 17], None)  # committed without feedback (a session that did not ask)
    assert len(got) == 1
    w = got[0]
    assert w.tokens.tolist() == [5, 10, 11, 12, 13, 14, 15, 16, 17]  # the last window + 1 tokens
    # Input position p predicts tokens[p + 1]: feedback exactly where a fed-back token is next.
    assert w.mask.tolist() == [True, True, True, True, False, False, False, False]
    for p in range(8):
        if w.mask[p]:
            assert w.top_ids[p, 0] == w.tokens[p + 1]
    batch, teacher, mask = collate([w, w])
    assert batch.shape == (2, 9) and teacher.ids.shape == (2, 8, 3) and mask.sum() == 8


def test_config_is_checked():
    with pytest.raises(ValueError, match="topk"):
        OnlineConfig(topk=21)
    with pytest.raises(ValueError, match="cpu_share"):
        OnlineConfig(cpu_share=0)


def make(tmp_path, **kw):
    torch.manual_seed(0)
    target = tiny_model("llama", seed=1).eval()
    draft = tiny_model("llama", seed=2).eval()
    pool = ThreadPoolExecutor(1)
    swaps = []
    cfg = OnlineConfig(
        topk=8, window=16, min_windows=1, batch_size=4, lr=3e-3, steps_per_version=10, dir=tmp_path, **kw
    )
    d = OnlineDistiller(draft, cfg, lambda fn: pool.submit(fn), lambda v, why: swaps.append((v, why)))
    return target, draft, d, swaps, pool


def continuations(target, sessions: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, prompt + the target's greedy continuation): what a verifier commits."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(sessions):
        prompt = torch.randint(0, 128, (6,), generator=g).tolist()
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(24):
                ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        out.append((prompt, ids))
    return out


def traffic(target, d: OnlineDistiller, sessions: int = 12, seed: int = 0):
    for prompt, ids in continuations(target, sessions, seed):
        fb = d.session(prompt)
        fb.extend(ids[len(prompt) :], feedback_of(target, ids, len(prompt), 8))
        fb.flush()


def agreement(target, draft, seed: int = 7) -> float:
    """How often the draft's argmax is the target's on fresh traffic like the training traffic."""
    hits = total = 0
    for prompt, ids in continuations(target, 6, seed):
        with torch.no_grad():
            guess = draft(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        hits += int((guess[len(prompt) - 1 : -1] == torch.tensor(ids[len(prompt) :])).sum())
        total += len(ids) - len(prompt)
    return hits / total


def test_the_trainer_moves_the_draft_toward_the_target_and_versions_go_live(tmp_path):
    # Pure KL: the tiny random target's argmax is arbitrary, and 60 steps of cross-entropy on it over 12
    # sessions memorise those sessions rather than carry to fresh prompts (agreement stays 0 at the default 0.5).
    target, draft, d, swaps, pool = make(tmp_path, kl_weight=1.0)
    traffic(target, d)
    before = agreement(target, draft)
    runner = BatchedRunner(draft, num_slots=2, max_seq_len=64)  # serves from fused copies of the weights
    seq = runner.new_sequence([5, 6, 7])
    logits_v0 = runner.forward([seq])[0][-1].clone()
    losses = [d.step() for _ in range(60)]
    pool.shutdown(wait=True)
    assert d.updates == 6 and d.serving_version == 6
    assert [v for v, _ in swaps] == [1, 2, 3, 4, 5, 6]
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10])
    assert agreement(target, draft) > before  # the serving model itself changed, in place
    seq.reset_tokens([5, 6, 7])
    assert not torch.allclose(runner.forward([seq])[0][-1], logits_v0)  # and the runner saw it
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == [f"v{i}" for i in range(7)]
    assert json.loads((tmp_path / "v3" / "meta.json").read_text())["parent"] == 2


def test_a_version_worse_than_its_predecessor_is_rolled_back(tmp_path):
    target, draft, d, swaps, pool = make(tmp_path, rollback_window=40, rollback_margin=0.05)
    traffic(target, d, sessions=4)
    for _ in range(40):  # v0 serves: 50 % acceptance
        d.record_round(0, 4, 2)
    v0_weights = {k: t.clone() for k, t in draft.state_dict().items()}
    for _ in range(10):
        d.step()
    pool.submit(lambda: None).result()
    assert d.serving_version == 1
    for _ in range(5):  # 20 drafted at 25 %: not yet judged
        d.record_round(1, 4, 1)
    assert d.rollbacks == 0
    for _ in range(5):
        d.record_round(1, 4, 1)
    pool.submit(lambda: None).result()
    assert d.rollbacks == 1 and d.serving_version == 0
    assert swaps[-1] == (0, "rollback")
    for k, t in draft.state_dict().items():
        torch.testing.assert_close(t, v0_weights[k])
    d.step()  # the trainer restarts from v0's weights
    for k, t in d.student.state_dict().items():
        assert (t - v0_weights[k]).abs().max() < 0.05
    pool.shutdown(wait=True)
    meta = json.loads((tmp_path / "v1" / "meta.json").read_text())
    assert meta["rolled_back"] is True and meta["acceptance"] == pytest.approx(0.25)


def test_a_good_version_is_kept(tmp_path):
    target, draft, d, swaps, pool = make(tmp_path, rollback_window=40)
    traffic(target, d, sessions=4)
    for _ in range(40):
        d.record_round(0, 4, 2)
    for _ in range(10):
        d.step()
    pool.submit(lambda: None).result()
    for _ in range(40):
        d.record_round(1, 4, 3)
    pool.shutdown(wait=True)
    assert d.rollbacks == 0 and d.serving_version == 1
    assert d.acceptance_by_version()[1] == (160, 120)


def test_a_dip_within_prompt_noise_is_not_rolled_back(tmp_path):
    """Acceptance varies by ~0.03 between windows of the same draft; the default margin (0.05) lets that
    pass, and a drop past it still rolls back."""
    target, draft, d, swaps, pool = make(tmp_path, rollback_window=100)
    traffic(target, d, sessions=4)
    for _ in range(25):
        d.record_round(0, 4, 2)  # 0.50
    for _ in range(10):
        d.step()
    pool.submit(lambda: None).result()
    for _ in range(23):
        d.record_round(1, 4, 2)
    d.record_round(1, 4, 0)
    d.record_round(1, 4, 0)  # its first 100 drafted tokens: 0.46, 0.04 below v0
    assert d.rollbacks == 0 and d.serving_version == 1
    for _ in range(10):
        d.step()
    pool.submit(lambda: None).result()
    assert d.serving_version == 2
    for _ in range(25):
        d.record_round(2, 4, 1)  # 0.25 against v1's 0.46
    pool.shutdown(wait=True)
    assert d.rollbacks == 1 and d.serving_version == 1


# ---------------------------------------------------------------- rehearsal
def rehearsal_of(target, sessions: int, seed: int, k: int = 8):
    """A rehearsal set from the target's own continuations (what specmesh.training.rehearsal writes)."""
    from specmesh.training.rehearsal import build

    return build(target, [ids for _, ids in continuations(target, sessions, seed)], k, seed=seed)


def test_a_rehearsal_set_round_trips_and_fits_any_topk(tmp_path):
    from specmesh.training.online import RehearsalSet

    target = tiny_model("llama", seed=1).eval()
    r = rehearsal_of(target, 3, seed=4, k=5)
    ids = continuations(target, 3, 4)[0][1]
    with torch.no_grad():
        argmax = target(input_ids=torch.tensor([ids[:-1]])).logits[0].argmax(-1)
    assert torch.equal(r.top_ids[0, :, 0], argmax)  # position p: the target's top token after ids[:p + 1]
    r.save(tmp_path / RehearsalSet.FILE)
    back = RehearsalSet.load(tmp_path / RehearsalSet.FILE)
    assert torch.equal(back.tokens, r.tokens) and torch.equal(back.top_ids, r.top_ids)
    torch.testing.assert_close(back.top_logprobs, r.top_logprobs, atol=2e-2, rtol=1e-3)  # stored fp16
    wide, narrow = back.sample(2, topk=8), back.sample(2, topk=3)
    assert wide[0].top_ids.shape == (29, 8) and (wide[0].top_logprobs[:, 5:] == -1e4).all()
    assert narrow[0].top_ids.shape == (29, 3) and narrow[0].mask.all()
    with pytest.raises(ValueError, match="no top_logprobs"):
        from safetensors.torch import save_file

        save_file({"tokens": r.tokens.int(), "top_ids": r.top_ids.int()}, str(tmp_path / "bad.safetensors"))
        RehearsalSet.load(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="rehearsal set"):
        RehearsalSet(r.tokens, r.top_ids[:, :-1], r.top_logprobs[:, :-1])


def test_each_batch_takes_its_share_from_the_rehearsal_set(tmp_path, monkeypatch):
    import specmesh.training.online as online

    target = tiny_model("llama", seed=1).eval()
    r = rehearsal_of(target, 4, seed=9)
    r.save(tmp_path / "r.safetensors")
    _, _, d, _, pool = make(tmp_path / "v", rehearsal=tmp_path / "r.safetensors", rehearsal_share=0.5)
    traffic(target, d, sessions=4)
    seen = []
    real = online.collate
    monkeypatch.setattr(online, "collate", lambda ws: seen.append(ws) or real(ws))
    d.step()
    pool.shutdown(wait=True)
    rehearsed = [w for w in seen[0] if any(torch.equal(w.tokens, t) for t in r.tokens)]
    assert len(seen[0]) == 4 and len(rehearsed) == 2


def test_rehearsal_keeps_the_draft_on_its_original_domain(tmp_path):
    """Trained on one domain's traffic, the draft drifts on another it agreed with; rehearsing the other
    domain's windows (as the shipped set does for the standard library) holds it there."""
    target = tiny_model("llama", seed=1).eval()
    r = rehearsal_of(target, 8, seed=21)
    r.save(tmp_path / "r.safetensors")
    kept = {}
    for share in (0.0, 0.5):
        kw = {"rehearsal": tmp_path / "r.safetensors", "rehearsal_share": share} if share else {}
        _, draft, d, _, pool = make(tmp_path / f"v{share}", **kw)
        draft.load_state_dict(target.state_dict())  # a draft distilled perfectly on the original domain
        d.student.load_state_dict(target.state_dict())
        # the live traffic: another model's continuations, a domain the target does not speak
        other = tiny_model("llama", seed=5).eval()
        for prompt, ids in continuations(other, 8, seed=3):
            fb = d.session(prompt)
            fb.extend(ids[len(prompt) :], feedback_of(other, ids, len(prompt), 8))
            fb.flush()
        for _ in range(40):
            d.step()
        pool.shutdown(wait=True)
        kept[share] = agreement(target, draft, seed=22)  # fresh sessions of the original domain
    assert kept[0.5] > kept[0.0] + 0.05, kept


def test_the_rehearsal_builder_writes_a_set_the_service_finds(tmp_path):
    """`python -m specmesh.training.rehearsal` on the demo target, and `--online-distill-rehearsal auto`
    finding the file beside the draft (or nothing, or refusing a missing file)."""
    from draft_service.engine import DraftConfig
    from draft_service.online import online_config
    from specmesh.training import rehearsal
    from specmesh.training.online import RehearsalSet

    demo = Path(__file__).resolve().parents[2] / "models" / "demo"
    rehearsal.main(["--target", str(demo / "target"), "--draft", str(tmp_path), "--windows", "3", "--window", "16"])
    r = RehearsalSet.load(tmp_path / RehearsalSet.FILE)
    assert r.tokens.shape == (3, 17) and r.top_ids.shape == (3, 16, 8) and r.max_id < 8192
    assert (r.top_logprobs[:, :, 0] >= r.top_logprobs[:, :, 1]).all()  # the target's top-k, best first

    def cfg(path, setting):
        return DraftConfig(model_path=str(path), online_distill=True, online_distill_rehearsal=setting)

    assert online_config(cfg(tmp_path, "auto")).rehearsal == tmp_path / RehearsalSet.FILE
    assert online_config(cfg(tmp_path / "elsewhere", "auto")).rehearsal is None
    assert online_config(cfg(tmp_path, "none")).rehearsal is None
    with pytest.raises(ValueError, match="--online-distill-rehearsal"):
        cfg(tmp_path, str(tmp_path / "missing.safetensors"))
    assert (demo / "draft" / RehearsalSet.FILE).is_file()  # the demo draft ships its set


def test_a_rehearsal_set_of_another_vocabulary_is_refused(tmp_path):
    from specmesh.training.online import RehearsalSet

    ids = torch.full((2, 5, 3), 500)  # the tiny draft's vocabulary is 128
    RehearsalSet(torch.zeros((2, 6), dtype=torch.long), ids, torch.zeros((2, 5, 3))).save(tmp_path / "r.safetensors")
    with pytest.raises(ValueError, match="outside the draft's vocabulary"):
        make(tmp_path / "v", rehearsal=tmp_path / "r.safetensors")


def test_the_kl_weight_flag_reaches_the_trainer_and_is_checked(tmp_path, capsys):
    from draft_service.__main__ import parse_args
    from draft_service.online import online_config

    draft = str(Path(__file__).resolve().parents[2] / "models" / "demo" / "draft")
    config, _ = parse_args(["--model-path", draft, "--online-distill", "--online-distill-kl-weight", "0.25"])
    assert online_config(config).kl_weight == 0.25
    with pytest.raises(SystemExit):
        parse_args(["--model-path", draft, "--online-distill", "--online-distill-kl-weight", "1.5"])
    assert "kl_weight must be in [0, 1]" in capsys.readouterr().err


def test_the_trainer_s_duty_follows_the_model_s_share_of_drafting(tmp_path):
    import asyncio

    from draft_service.online import OnlineLoop
    from specmesh.domain import DraftBlock, Verdict
    from specmesh.sampling import SamplingParams

    _, draft, _, _, pool = make(tmp_path)
    loop = OnlineLoop(draft, OnlineConfig(topk=8, cpu_share=0.4, min_share_factor=0.25), pool)
    d = loop.distiller
    assert d.model_share == 1.0 and d.duty == pytest.approx(0.4)  # no block yet: a model drafting alone

    class Inner:  # what the verify replica answers: every drafted token accepted
        async def start(self, prompt_ids, params):
            pass

        async def submit(self, proposal):
            return Verdict([*proposal.token_ids, 1], proposal.k, proposal.k, None)

    async def serve(methods: list[str]) -> None:
        v = loop.wrap(Inner())
        await v.start([1, 2, 3], SamplingParams())
        for m in methods:
            await v.submit(DraftBlock([5, 6, 7, 8], method=m))

    # The trees draft three blocks in four: the model's share is a quarter, and so is the trainer's duty.
    asyncio.run(serve(["suffix", "suffix", "suffix", "model"] * 50))
    assert d.model_share == pytest.approx(0.25, abs=0.01)
    assert d.duty == pytest.approx(0.4 * 0.25, abs=0.005)
    # Only the model's blocks judge a weight version.
    assert d.acceptance_by_version()[0] == (4 * 50, 4 * 50)
    # The trees drafting everything: the floor keeps a quarter of the share.
    asyncio.run(serve(["suffix"] * 5000))
    assert d.model_share < 0.01 and d.duty == pytest.approx(0.4 * 0.25)
    with pytest.raises(ValueError, match="min_share_factor"):
        OnlineConfig(min_share_factor=0)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread nice values are read from Linux's /proc")
def test_the_trainer_thread_runs_at_the_lowest_priority_and_serving_threads_keep_theirs(tmp_path):
    """Its duty bounds its share of a core; at nice 19 that share comes from time the serving threads leave idle."""
    import threading
    import time

    from specmesh.training.online import TRAINER_NICE

    def nice(tid: int) -> int:
        # /proc/<pid>/task/<tid>/stat: the 19th field is the nice value (after the parenthesised name).
        return int(Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])

    target, _, d, _, pool = make(tmp_path)
    traffic(target, d, sessions=2)
    mine = nice(threading.get_native_id())
    d.start()
    try:
        deadline = time.monotonic() + 10
        while d.steps == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.steps > 0  # the thread ran
        assert d._thread is not None and d._thread.native_id is not None
        assert nice(d._thread.native_id) == TRAINER_NICE
        assert nice(threading.get_native_id()) == mine
    finally:
        d.stop()
        pool.shutdown(wait=True)
