"""SGLang's own frontend language, from the real `sglang` package (in a side env: tests.support.sglang_env),
runs unchanged against the gateway over real services on loopback: `RuntimeEndpoint`, an `@sgl.function`
with `sgl.user` / `sgl.assistant` / `sgl.gen`, streaming through `text_iter`, and `sgl.select`, whose choice
must be the one the target's own log-probabilities make."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support import sglang_env
from tests.support.models import ROOT, demo_target, demo_tokenizer, greedy_decoder, target_log_softmax
from tests.support.services import speculative_gateway

CLIENT = ROOT / "tests" / "support" / "sglang_frontend_client.py"


@pytest.fixture(scope="module")
def side_python() -> Path:
    try:
        return sglang_env.python()
    except sglang_env.SideEnvError as e:
        pytest.fail(
            f"the side virtualenv with sglang=={sglang_env.SGLANG_VERSION} could not be built at "
            f"{sglang_env.ENV_DIR} (the first build needs PyPI): {e}"
        )


def test_sglang_frontend_runs_unchanged_against_the_gateway(side_python):
    # The client starts first: its `import sglang` (torch, transformers) overlaps the services' start.
    client = subprocess.Popen(
        [str(side_python), str(CLIENT), "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    tokenizer = demo_tokenizer()
    # The tokenizer's EOS is the model's, as in a real checkpoint: a grammar's end is that (special) token.
    target = demo_target(tokenizer, tokenizer_eos=True)
    # The design document's program asks for ~130 + 1,024 tokens: a context as long as the demo target's.
    target.config.max_position_embeddings = 2048
    with speculative_gateway(target, tokenizer) as gw:
        try:
            stdout, stderr = client.communicate(gw.base_url + "\n", timeout=300)
        finally:
            client.kill()
    assert client.returncode == 0, f"the sglang frontend program failed:\n{stderr[-4000:]}"
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["model"] == "demo"

    # sgl.gen: the target's greedy continuation of the prompt the frontend built (its chat template).
    answer = out["answer"]
    assert out["text"].endswith(answer + "\n") and "USER:" in out["text"]
    prompt = out["text"][: -len(answer) - 1]
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    want = greedy_decoder(target, tokenizer)(ids, 12)
    assert answer == want.text and answer
    meta = out["answer_meta"]
    assert meta["completion_tokens"] == len(want.token_ids) and meta["prompt_tokens"] == len(ids)
    assert meta["spec_verify_ct"] >= 1 and meta["finish_reason"]["type"] in ("length", "stop")

    # Streaming through text_iter: the same answer (how many pieces it comes in depends on how fast the
    # frontend's reader thread keeps up; that the events are incremental is checked in test_sglang_api).
    assert "".join(out["stream_pieces"]) == out["stream_answer"] == answer

    # The design document's program: ~130 prompt tokens + up to 1,024 new ones, blocking and streaming (the
    # model's whole context is every session's, so it is no longer refused).
    meta = out["analysis_meta"]
    assert out["analysis"] and meta["prompt_tokens"] > 120, meta
    assert 0 < meta["completion_tokens"] <= 1024 and meta["finish_reason"]["type"] in ("length", "stop")
    assert out["analysis_stream"] and "".join(out["analysis_stream_pieces"]) == out["analysis_stream"]

    # sgl.gen with dtype=int and with a regex: the output is in the grammar.
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", out["number"]), out["number"]
    assert out["flag"] in ("yes", "no")

    # sgl.select: each choice's log-probabilities are the target's, and the choice is their best mean.
    sel, scores = out["select"], out["select_meta"]
    means = []
    for choice, entries in zip(sel["choices"], scores["input_token_logprobs"]):
        full = tokenizer(sel["prefix"] + choice, add_special_tokens=False)["input_ids"]
        ref = target_log_softmax(target, full)
        skip = len(full) - len(entries)
        assert skip >= 1 and [e[1] for e in entries] == full[skip:]
        for j, (lp, tid, _) in enumerate(entries):
            assert lp == pytest.approx(ref[skip + j - 1, tid].item(), abs=1e-4)
        means.append(sum(e[0] for e in entries) / len(entries))
    assert scores["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-4)
    assert sel["choice"] == sel["choices"][max(range(len(means)), key=means.__getitem__)]

    assert out["server_info"]["served_model_name"] == "demo"
