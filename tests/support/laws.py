"""Sampled output against the target's own law: a tiny target whose law is wide enough to sample, the
services that sample it speculatively, its exact law over the first tokens, and chi-square checks (of whole
generations, and of one round of the rejection sampler)."""

import torch
from scipy.stats import chisquare

from tests.support.models import noisy_copy, tiny_model

LAW_VOCAB = 8
LAW_PROMPT = [1, 2, 3]


def law_target():
    """A tiny target over LAW_VOCAB tokens whose logits are flat enough (init_range 0.5) that every cell of
    the joint law of two tokens can be tested from a few thousand samples."""
    return tiny_model("llama", vocab=LAW_VOCAB, hidden=32, seed=21, init_range=0.5)


def sampling_services(target, noise: float, steps: int, **draft_kw):
    """(verify, draft): a verify service on `target` and a draft service on a noisy copy of it (seed 3) that
    sends the top 4 of its distribution, `steps` draft tokens a block (not adapted), so that the draft is
    right often but not always. The caller stops both."""
    from tests.support.services import start_draft, start_verify

    verify = start_verify(target)
    draft = start_draft(
        noisy_copy(target, noise, seed=3),
        verify.address,
        draft_topk=4,
        adaptive=False,
        speculative_num_steps=steps,
        **draft_kw,
    )
    return verify, draft


def next_token_law(target, ids: list[int]) -> torch.Tensor:
    """The target's distribution (float64) of the token after `ids`, at temperature 1."""
    with torch.no_grad():
        return torch.softmax(target(input_ids=torch.tensor([ids])).logits[0, -1], -1).double()


def two_token_law(target, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(p1, joint): the law of the first token after `prompt` and the [V, V] joint law p1(a) p2(b | a) of
    the first two."""
    p1 = next_token_law(target, prompt)
    p2 = torch.stack([next_token_law(target, prompt + [a]) for a in range(p1.numel())])
    return p1, p1[:, None] * p2


def pooled_chisquare(counts: torch.Tensor, law: torch.Tensor, n: int) -> float:
    """The chi-square p-value of `counts` (of n samples) against `law`: the cells expected fewer than 5
    times are pooled into one bin (chi-square needs expected counts >= 5)."""
    law = law.reshape(-1)
    big = law * n >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]) if (~big).any() else counts
    exp = (torch.cat([law[big], law[~big].sum()[None]]) if (~big).any() else law) * n
    return chisquare(obs.numpy(), (exp / exp.sum() * n).numpy()).pvalue


def first_two_counts(runs, vocab: int = LAW_VOCAB) -> torch.Tensor:
    """How often each pair of first two tokens came out, flat ([vocab * vocab]), over `runs`: (tokens, chunks)."""
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for tokens, _ in runs:
        counts[tokens[0] * vocab + tokens[1]] += 1
    return counts


def assert_first_two_tokens_law(out, p0: torch.Tensor, q0: torch.Tensor, law_after) -> torch.Tensor:
    """One round of the rejection sampler over n trials (`out`: its output), the first draft token from q0
    each time: the first emitted token follows p0, and over the trials that accepted their first draft a,
    the token emitted after it follows min(p0, q0)(a) law_after(a) (chi-square each; a cell the law never
    gives is never seen). Returns the first token's counts."""
    vocab = p0.numel()
    first, second = out.output_token_ids[:, 0], out.output_token_ids[:, 1]
    # Over the trials that accepted x_1 = a (probability min(p0, q0)(a)), the token emitted at position 1 is
    # drawn from row 1 under the context + a.
    reached = torch.tensor(out.num_accepted) >= 1
    cells = first[reached] * vocab + second[reached]
    counts = torch.bincount(cells, minlength=vocab * vocab).double()
    accepted_law = torch.minimum(p0, q0.double())
    expected = torch.stack([accepted_law[a] * law_after(a) for a in range(vocab)]).reshape(-1)
    assert counts[expected == 0].sum() == 0
    big = expected * counts.sum() / expected.sum() >= 5
    exp = expected[big] / expected[big].sum() * counts[big].sum()
    assert chisquare(counts[big].numpy(), exp.numpy()).pvalue > 1e-3
    c0 = torch.bincount(first, minlength=vocab).double()
    support = p0 > 0
    assert c0[~support].sum() == 0
    n = first.numel()
    assert chisquare(c0[support].numpy(), (p0[support] / p0[support].sum() * n).numpy()).pvalue > 1e-3
    return c0
