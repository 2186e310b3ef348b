"""Logits processing (temperature, top-k, top-p, greedy), parameter validation, stop rules."""

import numpy as np
import pytest
import torch

from specmesh.sampling import BatchSamplingParams, SamplingParams, StopChecker, process_logits


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """A plain, per-row numpy statement of the rules."""
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1
        return out
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.size, dtype=bool)
    k = top_k if top_k > 0 else z.size
    keep[order[:k]] = True
    zk = np.where(keep, z, -np.inf)
    p = np.exp(zk - zk.max())
    p /= p.sum()
    if top_p < 1:
        mass = 0.0
        keep2 = np.zeros(z.size, dtype=bool)
        for i in order:
            if not keep[i] or mass >= top_p:
                break
            keep2[i] = True
            mass += p[i]
        zk = np.where(keep2, z, -np.inf)
        p = np.exp(zk - zk.max())
        p /= p.sum()
    return p


def test_process_logits_matches_reference_per_row():
    g = torch.Generator().manual_seed(0)
    settings = [
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (1.3, 5, 1.0),
        (1.0, 0, 0.7),
        (0.8, 10, 0.9),
        (0.0, 0, 1.0),
        (2.0, 1, 1.0),
        (1.0, 0, 0.01),
    ]
    logits = torch.randn(len(settings), 40, generator=g) * 2
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in settings]
    got = process_logits(logits, BatchSamplingParams.from_params(params, [1] * len(params)))
    for row, (t, k, p) in enumerate(settings):
        np.testing.assert_allclose(got[row].numpy(), reference(logits[row].double().numpy(), t, k, p), atol=1e-6)
        assert got[row].sum().item() == pytest.approx(1.0, abs=1e-5)


def test_rows_of_one_request_share_its_parameters():
    sp = BatchSamplingParams.from_params([SamplingParams(temperature=0.0), SamplingParams(top_k=3)], [2, 3])
    assert sp.temperature.tolist() == [0, 0, 1, 1, 1] and sp.top_k.tolist() == [0, 0, 3, 3, 3]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2**63), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=-3), "seed"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(3, 70)), "stop_token_ids"),
    ],
)
def test_validate(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw).validate(vocab_size=64)


def decode(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_checker_rules():
    s = StopChecker(SamplingParams(max_tokens=5), eos_token_ids=frozenset({9}))
    assert s.extend([1, 2]) == 2 and not s.finished
    assert s.extend([3, 4, 5, 6]) == 3 and s.finish_reason == "length" and s.token_ids == [1, 2, 3, 4, 5]
    s = StopChecker(SamplingParams(max_tokens=50), eos_token_ids=frozenset({9}))
    assert s.extend([1, 9, 2]) == 2 and s.finish_reason == "stop"
    s = StopChecker(SamplingParams(max_tokens=50, ignore_eos=True, stop_token_ids=(4,)), eos_token_ids=frozenset({9}))
    assert s.extend([1, 9, 2, 4, 5]) == 4 and s.token_ids == [1, 9, 2, 4]
    s = StopChecker(SamplingParams(max_tokens=50, stop=("cd",)), decode=decode)
    s.extend([0, 1])
    assert not s.finished
    s.extend([2, 3, 4])
    assert s.finish_reason == "stop" and s.token_ids == [0, 1, 2, 3] and s.text() == "ab"
    s = StopChecker(SamplingParams(max_tokens=50, stop=("bc",)), decode=decode)  # spans two extend calls
    s.extend([0, 1])
    assert not s.finished
    assert s.extend([2, 3]) == 1 and s.text() == "a" and s.finish_reason == "stop"
    s = StopChecker(SamplingParams(max_tokens=50), eos_token_ids=frozenset({7, 8}))  # several EOS ids
    assert s.extend([1, 8, 2]) == 2 and s.finish_reason == "stop"


def test_tiny_temperature_is_greedy_not_nan():
    params = SamplingParams(temperature=1e-39).validate(10)
    assert params.greedy
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    probs = process_logits(logits, BatchSamplingParams.from_params([params], [1]))
    assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0]]
