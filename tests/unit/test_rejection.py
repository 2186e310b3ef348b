"""The rejection sampler: greedy rules, statistical losslessness, seeded replay, Triton/torch parity."""

import zlib

import pytest
import torch
from scipy.stats import chisquare

import specmesh.rejection.sampler as rejection
from specmesh.rejection import RejectionInput, RejectionSampler, validate_block
from specmesh.sampling import BatchSamplingParams, SamplingParams, process_logits

GREEDY = SamplingParams(temperature=0.0)
N_SAMPLES = 200_000
# Where the Triton kernel runs: a real GPU where there is one, else its interpreter over CPU tensors
# (tests/support/fixtures.py sets TRITON_INTERPRET=1 there). Both backends run on it when they are compared:
# their random draws come from a generator of that device.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def one_hot_logits(argmaxes, vocab=10, big=100.0):
    logits = torch.full((len(argmaxes), vocab), -big)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = big
    return logits


# ---------------------------------------------------------------- greedy
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_rules(backend):
    s = RejectionSampler(backend, seed=0, device=DEVICE)
    cases = [  # (draft, target argmax per row incl. bonus, expected output)
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all match: + bonus
        ([1, 2, 3], [5, 2, 3, 4], [5]),  # first mismatch: target's token, stop
        ([1, 2, 3], [1, 7, 3, 4], [1, 7]),  # early mismatch
        ([], [6], [6]),  # no draft: plain decode
        ([9], [9, 0], [9, 0]),
    ]
    blocks = [RejectionInput.of(d, GREEDY) for d, _, _ in cases]
    logits = one_hot_logits([t for _, tgt, _ in cases for t in tgt])
    out = s(logits.to(DEVICE), blocks)
    assert out.output_token_ids.shape == (5, 4)
    for b, (_, _, expected) in enumerate(cases):
        assert out.tokens(b) == expected
        assert out.num_accepted[b] == len(expected) - 1
        assert (out.output_token_ids[b, len(expected) :] == -1).all()


def test_greedy_batches_take_the_vectorised_rules():
    """The torch backend answers an all-greedy batch on its own short path: it equals the vectorised rules
    (`rejection_sample_torch` over `prepare`) on random blocks of 0 to 6 tokens with ties in the logits, context
    penalties and log-probabilities asked for; and a breaking draft token still stops the block."""
    from specmesh.sampling import LogitsContext

    gen = torch.Generator().manual_seed(7)
    s = RejectionSampler("torch", seed=0)
    vocab = 40
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias=((3, 2.0),), logprobs=2)
    for trial in range(40):
        blocks, rows = [], []
        for b in range(1 + trial % 5):
            k = int(torch.randint(0, 7, (1,), generator=gen))
            target = torch.randint(0, 6, (k + 1,), generator=gen).tolist()  # few tokens: ties and repeats
            logits = torch.randint(-3, 3, (k + 1, vocab), generator=gen).float()  # integers: ties everywhere
            draft = [t if torch.rand((), generator=gen) < 0.8 else (t + 1) % vocab for t in target[:k]]
            params = penalised if b % 2 else GREEDY
            context = LogitsContext([1, 2, 3, *draft[:2]], 3, draft) if b % 2 else None
            blocks.append(RejectionInput.of(draft, params, context=context))
            rows.append(logits)
        logits = torch.cat(rows)
        fast = s(logits, blocks)
        prep = rejection.prepare(logits, blocks, s.generator)
        ref = rejection.rejection_sample_torch(prep)
        assert torch.equal(fast.output_token_ids, ref)
        assert fast.num_accepted == prep.num_accepted_from(ref)
        assert fast.logprobs == rejection._logprobs(logits, blocks, ref, fast.num_accepted)
    out = s(one_hot_logits([1, 2, 3, 4]), [RejectionInput.of([1, 9, 3], GREEDY)])
    assert out.tokens(0) == [1, 2] and out.num_accepted == [1]


def test_row_argmax_is_torchs():
    """numpy's argmax on a CPU's float32 rows: torch's answers, the first index on ties, -inf and NaN rows too."""
    from specmesh.sampling import row_argmax

    x = torch.randint(-2, 2, (64, 300)).float()
    x[5] = float("-inf")
    x[6, 7] = float("nan")
    x[7, :] = 1.0
    for t in (x, x[:, ::3], x.t().contiguous().t(), x[:0], x.double(), x.bfloat16()):
        got = row_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))


# ---------------------------------------------------------------- statistics
def check_distribution(samples: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(chi-square p-value, total variation) of integer samples against distribution p."""
    counts = torch.bincount(samples, minlength=p.numel()).double()
    n = counts.sum().item()
    assert counts[p == 0].sum() == 0, "a token with zero target probability was emitted"
    support = p > 0
    expected = p[support].double()
    if int(support.sum()) == 1:  # a point mass: all samples on it (checked above) is a perfect fit
        return 1.0, 0.5 * (counts / n - p.double()).abs().sum().item()
    pval = chisquare(counts[support].numpy(), (expected / expected.sum() * n).numpy()).pvalue
    tv = 0.5 * (counts / n - p.double()).abs().sum().item()
    return float(pval), tv


def run_round(sampler, logits, q, params, n, sparse_support=None, send_q=True, gen_seed=0):
    """n independent one-round trials with a context-free draft q [K, V] and target logits [K+1, V]."""
    k, vocab = q.shape
    g = torch.Generator().manual_seed(gen_seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.contiguous() if k else torch.zeros(n, 0)
    if sparse_support is not None:  # q restricted to the given support ids per position
        q_ids = sparse_support
    else:
        q_ids = torch.arange(vocab).expand(k, vocab)
    q_probs = q.gather(1, q_ids)
    blocks = [
        RejectionInput.of(row, params, q_ids if send_q else None, q_probs if send_q else None)
        for row in drafts.tolist()
    ]
    out = sampler(logits.repeat(n, 1), blocks)
    return out.output_token_ids, torch.tensor(out.num_accepted)


def processed(logits, params):
    k1 = logits.size(0)
    return process_logits(logits, BatchSamplingParams.from_params([params], [k1]))


def random_dist(vocab, gen, support=None):
    w = torch.rand(vocab, generator=gen) + 0.05
    if support is not None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[support] = True
        w = w * mask
    return w / w.sum()


def make_case(name, vocab=8, k=3, seed=0):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    support, send_q = None, True
    if name == "random":
        q = torch.stack([random_dist(vocab, g) for _ in range(k)])
    elif name == "q_equals_p":
        q = processed(logits, params)[:k]
    elif name == "disjoint":
        logits[:, vocab // 2 :] = float("-inf")  # p on the lower half, q on the upper half
        q = torch.stack([random_dist(vocab, g, list(range(vocab // 2, vocab))) for _ in range(k)])
    elif name == "sparse":
        support = torch.stack([torch.randperm(vocab, generator=g)[:3] for _ in range(k)])
        q = torch.zeros(k, vocab).scatter_(1, support, torch.rand(k, 3, generator=g) + 0.1)
        q = q / q.sum(1, keepdim=True)
    elif name == "no_q":
        q = torch.stack([random_dist(vocab, g) for _ in range(k)])
        send_q = False
    elif name == "processed":  # temperature, top-k and top-p on the target side
        params = SamplingParams(temperature=0.7, top_k=5, top_p=0.85)
        q = torch.stack([random_dist(vocab, g) for _ in range(k)])
    else:
        raise ValueError(name)
    return logits, q, params, support, send_q


def emitted_position_checks(out, num_accepted, p):
    """For each emitted position j: tokens of trials that reached j, against p_j."""
    results = []
    for j in range(out.size(1)):
        reached = num_accepted >= j
        if int(reached.sum()) < 50_000:  # too few trials reach j for a TV bound of 0.01
            continue
        results.append((j, int(reached.sum()), *check_distribution(out[reached, j], p[j])))
    return results


@pytest.mark.parametrize("case", ["random", "q_equals_p", "disjoint", "sparse", "no_q", "processed"])
def test_lossless_statistically(case):
    logits, q, params, support, send_q = make_case(case)
    p = processed(logits, params)
    out, num_accepted = run_round(RejectionSampler("torch", seed=1), logits, q, params, N_SAMPLES, support, send_q)
    results = emitted_position_checks(out, num_accepted, p)
    assert results and results[0][0] == 0 and results[0][1] == N_SAMPLES
    for j, n, pval, tv in results:
        assert pval > 1e-3 and tv < 0.01, f"{case}: position {j} (n={n}) p-value {pval:.2e} TV {tv:.4f}"
    if case == "q_equals_p":
        assert (num_accepted == q.size(0)).all()  # nothing is ever rejected when q == p
    if case == "disjoint":
        assert (num_accepted == 0).all()


def test_broken_sampler_fails_the_same_check(monkeypatch):
    """Skipping the residual correction (recovering from p instead of max(p - q, 0)) must be caught."""
    monkeypatch.setattr(rejection, "_write_residual", lambda *a: None)
    logits, q, params, support, send_q = make_case("random")
    p = processed(logits, params)
    out, num_accepted = run_round(RejectionSampler("torch", seed=1), logits, q, params, N_SAMPLES)
    results = emitted_position_checks(out, num_accepted, p)
    assert any(pval < 1e-3 or tv >= 0.01 for _, _, pval, tv in results), results


def test_no_zero_probability_token_when_the_residual_vanishes():
    """p one-hot on token 5; q sent slightly over-normalised (within tolerance) on the same token."""
    vocab, n = 10, 20_000
    logits = torch.randn(2, vocab)
    logits[0, 5] = 50.0
    params = SamplingParams(temperature=1.0, top_k=1)
    blocks = [RejectionInput.of([5], params, torch.tensor([[5]]), torch.tensor([[1.0009]])) for _ in range(n)]
    out = RejectionSampler("torch", seed=0)(logits.repeat(n, 1), blocks)
    assert (out.output_token_ids[:, 0] == 5).all()
    # and a rejection forced by rounding (u just below 1, p(x)/q(x) a hair under 1) still emits from p
    probs = torch.softmax(torch.randn(vocab), 0)
    q_ids = torch.arange(vocab)[None]
    block = RejectionInput.of([3], SamplingParams(temperature=1.0), q_ids, (probs * 1.0000005)[None])
    prep = rejection.prepare(torch.stack([probs.log(), probs.log()]), [block], torch.Generator().manual_seed(0))
    prep.uniforms.fill_(1 - 1e-12)
    tok = rejection.rejection_sample_torch(prep)[0, 0]
    assert probs[tok] > 0 and prep.residual_probs[0].amax() > 0


def test_mixed_batch_each_request_gets_its_own_distribution():
    """Interleaved requests with different K, q shapes and parameters (and greedy rows) in one batch."""
    la, qa, pa, sa, _ = make_case("random", k=3)
    lb, qb, pb, sb, _ = make_case("processed", k=2)
    lg = torch.randn(2, 8)
    n = 100_000
    ga, gb = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    xa = torch.multinomial(qa, n, replacement=True, generator=ga).T.tolist()
    xb = torch.multinomial(qb, n, replacement=True, generator=gb).T.tolist()
    ids_a = torch.arange(8).expand(3, 8)
    blocks, rows = [], []
    for i in range(n):
        blocks.append(RejectionInput.of(xa[i], pa, ids_a, qa))
        blocks.append(RejectionInput.of(xb[i], pb))  # no q: point masses
        blocks.append(RejectionInput.of([int(lg[0].argmax())], GREEDY))
        rows += [la, lb, lg]
    out = RejectionSampler("torch", seed=2)(torch.cat(rows), blocks)
    toks = out.output_token_ids
    for group, logits, params in ((0, la, pa), (1, lb, pb)):
        pval, tv = check_distribution(toks[group::3, 0], processed(logits, params)[0])
        assert pval > 1e-3 and tv < 0.01, (group, pval, tv)
    assert (toks[2::3, :2] == torch.tensor([int(lg[0].argmax()), int(lg[1].argmax())])).all()


# ---------------------------------------------------------------- seeded replay
def test_seeded_requests_replay_whatever_their_batch():
    vocab, k = 50, 4
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, seed=1234)
    draft = torch.randint(0, vocab, (k,), generator=g).tolist()
    logits_seeded = torch.randn(k + 1, vocab, generator=g)
    seen = set()
    for trial in range(20):
        others = [
            RejectionInput.of(torch.randint(0, vocab, (j,)).tolist(), SamplingParams(temperature=0.9))
            for j in range(trial % 3)
        ]
        blocks = others + [RejectionInput.of(draft, params, generator=torch.Generator().manual_seed(params.seed))]
        rows = torch.cat([torch.randn(sum(b.k + 1 for b in others), vocab), logits_seeded])
        out = RejectionSampler("torch")(rows, blocks)  # fresh unseeded shared stream each time
        seen.add(tuple(out.tokens(len(others))))
    assert len(seen) == 1
    # a different seed gives different results (across several draws)
    outs = {
        tuple(
            RejectionSampler("torch")(
                logits_seeded, [RejectionInput.of(draft, params, generator=torch.Generator().manual_seed(s))]
            ).tokens(0)
        )
        for s in range(10)
    }
    assert len(outs) > 1


# ---------------------------------------------------------------- parity
def random_batch(gen, vocab, n_req=16, max_k=6, device="cpu"):
    blocks = []
    for i in range(n_req):
        k = int(torch.randint(0, max_k + 1, (1,), generator=gen))
        kind = i % 4
        params = [
            GREEDY,
            SamplingParams(temperature=0.8),
            SamplingParams(temperature=1.2, top_k=20, top_p=0.9),
            SamplingParams(temperature=1.0, seed=i),
        ][kind]
        draft = torch.randint(0, vocab, (k,), generator=gen).tolist()
        q_ids = q_probs = None
        if kind in (1, 3) and k:
            s = 5
            perms = [torch.randperm(vocab, generator=gen) for _ in range(k)]
            q_ids = torch.stack([torch.cat([torch.tensor([x]), p[p != x][: s - 1]]) for x, p in zip(draft, perms)])
            q_probs = torch.rand(q_ids.shape, generator=gen) + 0.01
            q_probs = q_probs / q_probs.sum(1, keepdim=True)
        gen_i = torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None
        blocks.append(RejectionInput.of(draft, params, q_ids, q_probs, gen_i))
    rows = sum(b.k + 1 for b in blocks)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    # make some greedy drafts match the target so acceptance paths are exercised
    r = 0
    for b in blocks:
        for i, x in enumerate(b.token_ids):
            if torch.rand(1, generator=gen) < 0.6:
                logits[r + i, x] += 20
        r += b.k + 1
    return logits, blocks


def clone_blocks(blocks, device="cpu"):
    return [
        RejectionInput.of(
            b.token_ids,
            b.params,
            b.q_ids,
            b.q_probs,
            torch.Generator(device).manual_seed(b.params.seed) if b.params.seed is not None else None,
        )
        for b in blocks
    ]


@pytest.mark.parametrize("vocab", [37, 2500])
def test_triton_matches_torch(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(3):
        logits, blocks = random_batch(gen, vocab)
        outs = []
        for backend in ("torch", "triton"):
            out = RejectionSampler(backend, seed=trial, device=DEVICE)(logits.to(DEVICE), clone_blocks(blocks, DEVICE))
            outs.append((out.output_token_ids, out.num_accepted))
        assert torch.equal(outs[0][0], outs[1][0]), (outs[0][0], outs[1][0])
        assert outs[0][1] == outs[1][1]
        assert any(n > 0 for n in outs[0][1])  # some acceptances happened


def test_triton_handles_all_empty_drafts():
    logits = torch.randn(3, 40)
    blocks = [
        RejectionInput.of([], SamplingParams(temperature=1.0)),
        RejectionInput.of([], GREEDY),
        RejectionInput.of([], SamplingParams(temperature=0.5)),
    ]
    a = RejectionSampler("torch", seed=5, device=DEVICE)(logits.to(DEVICE), clone_blocks(blocks, DEVICE))
    b = RejectionSampler("triton", seed=5, device=DEVICE)(logits.to(DEVICE), clone_blocks(blocks, DEVICE))
    assert torch.equal(a.output_token_ids, b.output_token_ids)
    assert a.tokens(1) == [int(logits[1].argmax())]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_on_cuda_bf16_no_recompile_per_k():
    from specmesh.rejection.triton_kernel import _rejection_kernel

    gen = torch.Generator().manual_seed(0)
    for trial, max_k in enumerate((2, 5, 8)):
        logits, blocks = random_batch(gen, 4096, max_k=max_k, device="cuda")
        logits = logits.to(torch.bfloat16).cuda()
        a = RejectionSampler("torch", seed=trial, device="cuda")(logits, clone_blocks(blocks, "cuda"))
        b = RejectionSampler("triton", seed=trial, device="cuda")(logits, clone_blocks(blocks, "cuda"))
        assert torch.equal(a.output_token_ids, b.output_token_ids)
        assert any(n > 0 for n in a.num_accepted)
    assert len(_rejection_kernel.device_caches[0][0]) == 1  # one compiled variant for every K


def test_triton_on_cpu_tensors_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        RejectionSampler("triton", device="cpu")
    RejectionSampler("torch", device="cpu")


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "block, message",
    [
        (RejectionInput.of([1, 2, 99], GREEDY), "out of range"),
        (RejectionInput.of([-1], GREEDY), "out of range"),
        (RejectionInput.of(list(range(40)), GREEDY), "limit"),
        (RejectionInput.of([1], GREEDY, torch.tensor([[1, 2]]), None), "both"),
        (RejectionInput.of([1], GREEDY, torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.6]])), "sum to 1"),
        (RejectionInput.of([1], GREEDY, torch.tensor([[1, 1]]), torch.tensor([[0.5, 0.5]])), "repeat"),
        (RejectionInput.of([1], GREEDY, torch.tensor([[1, 80]]), torch.tensor([[0.5, 0.5]])), "out of range"),
        (RejectionInput.of([1], GREEDY, torch.tensor([[1, 2]]), torch.tensor([[float("nan"), 1.0]])), "finite"),
        (RejectionInput.of([1, 2], GREEDY, torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]])), "K=2"),
        (RejectionInput.of([3], GREEDY, torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]])), "support"),
        (RejectionInput.of([1], GREEDY, torch.tensor([[1, 2]]), torch.tensor([[0.0, 1.0]])), "support"),
    ],
)
def test_validate_block_rejects_bad_input(block, message):
    with pytest.raises(ValueError, match=message):
        validate_block(block, vocab_size=50)


def test_validate_block_accepts_good_input():
    validate_block(
        RejectionInput.of([1, 3], GREEDY, torch.tensor([[1, -1], [2, 3]]), torch.tensor([[1.0, 0.0], [0.4, 0.6]])), 50
    )
