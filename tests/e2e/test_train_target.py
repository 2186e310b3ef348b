"""The demo tokenizer + target trainer through its CLI: split, tokenizer, training, interruption and resume."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.training import train_target
from specmesh.training.corpus import stdlib_files, stdlib_root
from specmesh.training.trainer import CHECKPOINT

ROOT = stdlib_root() / "ctypes"  # a small package with one held-out file under this root
TINY = [
    "--stdlib-root",
    str(ROOT),
    "--vocab-size",
    "400",
    "--layers",
    "1",
    "--hidden",
    "32",
    "--intermediate",
    "64",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--steps",
    "6",
    "--warmup",
    "2",
    "--checkpoint-every",
    "3",
    "--lr",
    "3e-3",
    "--autocast",
    "none",
    "--threads",
    "1",
]


def weights(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_split_is_fixed_and_disjoint():
    train, heldout = stdlib_files(ROOT)
    assert heldout and train and not set(train) & set(heldout)
    assert stdlib_files(ROOT) == (train, heldout)  # same order, same split, every time


def test_train_interrupt_resume_equals_uninterrupted(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    train_target.main(TINY + ["--work-dir", str(whole / "work"), "--out", str(whole / "out")])
    train_target.main(TINY + ["--work-dir", str(split / "work"), "--out", str(split / "out"), "--stop-after", "3"])
    assert not (split / "out").exists()  # interrupted: checkpoint only, nothing exported
    assert torch.load(split / "work" / CHECKPOINT, weights_only=True)["step"] == 3
    train_target.main(TINY + ["--work-dir", str(split / "work"), "--out", str(split / "out"), "--resume"])
    a, b = weights(whole / "out"), weights(split / "out")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-3, rtol=0)  # fp16 export of equal fp32 weights
    report = json.loads((split / "out" / "train_report.json").read_text())
    assert report["steps"] == 6 and report["steps_this_run"] == 3  # really resumed at step 3
    assert 0 < report["heldout_loss"] < 10
    tok = AutoTokenizer.from_pretrained(split / "out")
    text = "import ctypes\nx = ctypes.c_int(3)\n"
    assert tok.decode(tok(text)["input_ids"]) == text and len(tok) == 400
