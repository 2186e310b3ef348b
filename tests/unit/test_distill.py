"""Draft distillation: the loss, the offline teacher cache, resume, evaluation and the CLI, on tiny models.

The target is a 2-layer x 64 Llama over a 300-token byte-level BPE, both trained here for a few seconds on
the `json` package of the standard library, so its next-token distributions have structure a draft can
learn (a random target's do not, in a few dozen steps).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.training import distill as D
from specmesh.training.corpus import TokenWindows, encode_texts, load_texts, stdlib_root
from specmesh.training.train_target import llama_config, lm_loss, train_tokenizer
from specmesh.training.trainer import CHECKPOINT, TrainConfig

SEQ, BATCH, TOPK = 32, 8, 64
CORPUS = str(stdlib_root() / "json" / "*.py")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread, and far slower when threads contend for busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A briefly trained tiny target saved to disk, its tokenizer, and train / held-out token streams."""
    from specmesh.training.trainer import train

    root = tmp_path_factory.mktemp("distill")
    texts = load_texts([CORPUS])
    assert len(texts) >= 3, "the json package of the standard library should have several files"
    tokenizer = train_tokenizer(texts, 300)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(llama_config(tokenizer, 2, 64, 128, 4, 256))
    windows = TokenWindows(encode_texts(tokenizer, texts, tokenizer.eos_token_id), SEQ, BATCH, seed=1)
    train(
        target,
        lambda step: (lm_loss(target, windows.batch(step)), 1),
        TrainConfig(steps=200, lr=1e-2, warmup=5, checkpoint_every=10**6, out_dir=root / "target_work"),
    )
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    train_texts, heldout_texts = D.split_heldout(texts)
    streams = D.token_streams(tokenizer, train_texts, heldout_texts, root / "tokens")
    return {
        "root": root,
        "target_dir": target_dir,
        "target": target,
        "tokenizer": tokenizer,
        "train": TokenWindows(streams["train"], SEQ, BATCH, seed=0),
        "heldout": TokenWindows(streams["heldout"], SEQ, BATCH, seed=0),
        "streams": streams,
    }


def fresh_draft(tiny, seed: int = 0):
    torch.manual_seed(seed)
    return D.new_draft(tiny["target"], tiny["tokenizer"], layers=1, hidden=32, intermediate=64, heads=2)


def cfg(out_dir: Path, steps: int) -> TrainConfig:
    return TrainConfig(steps=steps, lr=1e-2, warmup=5, checkpoint_every=10**6, out_dir=out_dir)


def test_distillation_lowers_heldout_kl_and_beats_data_only(tiny, tmp_path):
    target, heldout = tiny["target"], tiny["heldout"]
    teacher = D.online_teacher(target, TOPK, 1.0)
    before = D.heldout_metrics(target, fresh_draft(tiny), heldout)

    distilled = fresh_draft(tiny)
    D.distill(distilled, tiny["train"], teacher, cfg(tmp_path / "kd", 40), kl_weight=0.9)
    after = D.heldout_metrics(target, distilled, heldout)

    baseline = fresh_draft(tiny)
    D.distill(baseline, tiny["train"], None, cfg(tmp_path / "ce", 40), kl_weight=0.0)
    data_only = D.heldout_metrics(target, baseline, heldout)

    assert after["kl_to_target"] < 0.5 * before["kl_to_target"], (before, after)
    assert after["greedy_agreement"] > before["greedy_agreement"] + 0.1, (before, after)
    # Same steps, same batches: learning the target's distribution gets closer to it than learning the corpus.
    assert after["kl_to_target"] < 0.95 * data_only["kl_to_target"], (after, data_only)


def test_truncated_kl_with_the_whole_vocabulary_is_the_true_kl(tiny):
    target, draft = tiny["target"], fresh_draft(tiny)
    batch = tiny["train"].batch(3)
    vocab = D.vocab_width(target)
    targets = D.teacher_targets(target, batch[:, :-1], vocab, 1.0)
    kl = D.distill_loss(draft, batch, targets, kl_weight=1.0).kl.item()
    with torch.no_grad():
        logp = torch.log_softmax(target(input_ids=batch[:, :-1]).logits.float(), -1)
        logq = torch.log_softmax(draft(input_ids=batch[:, :-1]).logits.float(), -1)
    true_kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    assert kl == pytest.approx(true_kl, rel=2e-3, abs=1e-3)  # float16 log-probs
    assert true_kl > 0.1  # a fresh draft is far from the target: the comparison means something

    mixed = D.distill_loss(draft, batch, targets, kl_weight=0.25)
    assert mixed.loss.item() == pytest.approx(0.25 * mixed.kl.item() + 0.75 * mixed.ce.item(), rel=1e-6)

    # The cross-entropy on other labels (tokens the target chose, as online distillation commits them): its
    # second choice, which can never be the data's token wherever a trained target's argmax already is
    choice = targets.ids[..., 1].long()
    data = batch[:, 1:]
    assert (choice != data).float().mean() > 0.5  # other labels at most positions: the two CEs read other tokens
    on_choice = D.distill_loss(draft, batch, targets, kl_weight=0.25, labels=choice)

    def ce(labels: torch.Tensor) -> float:
        # A fresh draft is close to uniform, so CE on any labels is close to log V: each is checked against its
        # own labels' CE, not against the other's value.
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(logq.reshape(-1, logq.size(-1)), labels.reshape(-1)).item()

    assert on_choice.ce.item() == pytest.approx(ce(choice), rel=1e-4)
    assert mixed.ce.item() == pytest.approx(ce(data), rel=1e-4)
    assert on_choice.kl.item() == pytest.approx(mixed.kl.item(), rel=1e-6)
    # Labels the draft itself rates highest: a cross-entropy that ignored `labels` could not come out lower.
    own = logq.argmax(-1)
    on_own = D.distill_loss(draft, batch, targets, kl_weight=0.25, labels=own)
    assert on_own.ce.item() == pytest.approx(ce(own), rel=1e-4) and on_own.ce.item() < mixed.ce.item() - 0.01


def test_offline_cache_gives_the_online_loss_and_refuses_other_settings(tiny, tmp_path):
    target, windows = tiny["target"], tiny["train"]
    online = D.online_teacher(target, TOPK, 1.0)
    settings = D.TeacherCache.settings(target, tiny["streams"]["train"], windows, TOPK, 1.0, autocast=False)
    cache = D.TeacherCache(tmp_path / "cache", settings)
    assert cache.build(online, windows, 4, "cpu") == 4
    assert D.TeacherCache(tmp_path / "cache", settings).build(online, windows, 4, "cpu") == 0  # reused
    assert cache.build(online, windows, 6, "cpu") == 2  # a longer run computes only its extra steps

    draft = fresh_draft(tiny)
    batch = windows.batch(2)
    cached, fresh = cache.load(2), online(2, batch[:, :-1])
    assert torch.equal(cached.ids, fresh.ids) and torch.equal(cached.logprobs, fresh.logprobs)
    loss_online = D.distill_loss(draft, batch, fresh, 0.9).loss.item()
    loss_offline = D.distill_loss(draft, batch, cached, 0.9).loss.item()
    assert loss_offline == pytest.approx(loss_online, abs=1e-4)

    # Whole runs agree too: the offline run trains on exactly the online run's numbers.
    a, b = fresh_draft(tiny), fresh_draft(tiny)
    losses_online = D.distill(a, windows, online, cfg(tmp_path / "on", 6), 0.9)
    losses_offline = D.distill(b, windows, cache.teacher(), cfg(tmp_path / "off", 6), 0.9)
    assert losses_offline == pytest.approx(losses_online, abs=1e-4)

    other_seq = TokenWindows(windows.stream, SEQ // 2, BATCH, seed=0)
    for bad in (
        D.TeacherCache.settings(target, windows.stream, other_seq, TOPK, 1.0, autocast=False),
        D.TeacherCache.settings(target, windows.stream, windows, TOPK, 2.0, autocast=False),
        D.TeacherCache.settings(draft, windows.stream, windows, TOPK, 1.0, autocast=False),  # another model
    ):
        with pytest.raises(D.CacheMismatch, match="other settings"):
            D.TeacherCache(tmp_path / "cache", bad)


def test_resume_reproduces_an_uninterrupted_run(tiny, tmp_path):
    teacher = D.online_teacher(tiny["target"], TOPK, 1.0)
    init = fresh_draft(tiny, seed=3)
    n = 10

    whole = copy.deepcopy(init)
    losses_whole = D.distill(whole, tiny["train"], teacher, cfg(tmp_path / "whole", n), 0.9)

    first = copy.deepcopy(init)
    losses_first = D.distill(first, tiny["train"], teacher, cfg(tmp_path / "split", n), 0.9, stop_after=n // 2)
    state = torch.load(tmp_path / "split" / CHECKPOINT, weights_only=True)
    assert state["step"] == n // 2
    adam = next(iter(state["optimizer"]["state"].values()))
    assert int(adam["step"]) == n // 2 and adam["exp_avg_sq"].abs().sum() > 0

    second = copy.deepcopy(init)  # a new process: initial weights, checkpoint restores the rest
    losses_second = D.distill(second, tiny["train"], teacher, cfg(tmp_path / "split", n), 0.9, resume=True)
    assert len(losses_first) == len(losses_second) == n // 2  # the second call started at step n/2
    assert losses_first + losses_second == pytest.approx(losses_whole, abs=1e-5)
    for (name, p), q in zip(whole.named_parameters(), second.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4, msg=name)
    # And the run did move the weights, so the comparison above is not trivially true.
    assert not torch.allclose(whole.model.embed_tokens.weight, init.model.embed_tokens.weight, atol=1e-3)


def test_a_draft_equal_to_the_target_is_perfect(tiny):
    target = tiny["target"]
    report = D.evaluate(target, copy.deepcopy(target), tiny["streams"]["heldout"], SEQ, BATCH, n_prompts=2)
    assert report["greedy_agreement"] == 1.0
    assert report["kl_to_target"] == pytest.approx(0.0, abs=1e-5)
    assert report["expected_accepted_length"]["4"] == 5.0
    measured = report["measured"]
    assert measured["k"] == 4 and measured["prompts"] == 2
    assert measured["acceptance_rate"] == 1.0
    # 64 tokens in rounds of 5; only a round cut short by max_tokens is shorter.
    assert measured["mean_accepted_length"] > 4.5


def test_cli_end_to_end(tiny, tmp_path):
    out, cache = tmp_path / "draft", tmp_path / "cache"

    def flags(seq_len: int = 32, work: str = "work") -> list[str]:
        return [
            "--target",
            str(tiny["target_dir"]),
            "--corpus",
            CORPUS,
            "--work-dir",
            str(tmp_path / work),
            "--cache-dir",
            str(cache),
            "--batch-size",
            "4",
            "--seq-len",
            str(seq_len),
            "--warmup",
            "2",
            "--lr",
            "1e-2",
            "--draft-layers",
            "1",
            "--draft-hidden",
            "32",
            "--draft-intermediate",
            "64",
            "--draft-heads",
            "2",
            "--eval-prompts",
            "2",
            "--eval-tokens",
            "512",
        ]

    common = flags()
    result = D.main(common + ["--out", str(out), "--steps", "6", "--checkpoint-every", "3"])

    assert result["train"]["steps_this_run"] == 6 and result["train"]["teacher"].startswith("offline")
    assert len(list(cache.glob("step_*.pt"))) == 6
    draft = AutoModelForCausalLM.from_pretrained(out)
    assert next(draft.parameters()).dtype == torch.float16
    assert D.vocab_width(draft) == D.vocab_width(tiny["target"])
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tiny["tokenizer"].get_vocab()

    report = json.loads((out / "eval.json").read_text())
    assert report == json.loads(json.dumps(result["eval"]))
    assert 0.0 <= report["greedy_agreement"] <= 1.0 and report["kl_to_target"] > 0
    expected = [report["expected_accepted_length"][str(k)] for k in range(1, 9)]
    assert expected == sorted(expected) and 1.0 <= expected[0] <= 2.0
    assert 1.0 <= report["measured"]["mean_accepted_length"] <= 5.0

    again = D.main(common + ["--out", str(out), "--eval-only", "--no-measure"])
    assert "measured" not in again["eval"] and again["train"] is None
    assert again["eval"]["greedy_agreement"] == pytest.approx(report["greedy_agreement"], abs=0.05)  # fp16 reload

    with pytest.raises(SystemExit, match="other settings"):  # the cache was built for --seq-len 32
        D.main(flags(seq_len=16, work="work2") + ["--out", str(tmp_path / "d2"), "--steps", "6"])
    with pytest.raises(SystemExit, match="other settings"):  # --resume must not silently change the run
        D.main(common + ["--out", str(out), "--steps", "6", "--lr", "5e-3", "--resume"])


def test_mismatched_vocabularies_are_refused(tiny):
    cfg_other = llama_config(tiny["tokenizer"], 1, 32, 64, 2, 256)
    cfg_other.vocab_size = 400
    other = AutoModelForCausalLM.from_config(cfg_other)
    with pytest.raises(ValueError, match="vocabulary"):
        D.check_pair(tiny["target"], other, tiny["tokenizer"])
