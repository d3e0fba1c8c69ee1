"""Tests of specdecode.ops.verify and specdecode.ops.sample.

The statistical tests draw 1e6 outcomes per case (N_DRAWS) through the native op, in batched calls
of up to CHUNK rows (every row its own Philox seed; draft tokens sampled afresh for every block),
and compare the counts with the exact law by a G-test. The significance level of each test is a
family-wise 1e-3 split over all of them (Bonferroni, NUM_STAT_TESTS bounds their number), so a
correct implementation fails a run with probability below 1e-3.
"""

from __future__ import annotations

import math
import os
import re
import sys

import numpy as np
import pytest
import torch
from scipy import stats

import specdecode
from specdecode import _C, ops

sys.path.insert(0, os.path.dirname(__file__))
from conftest import requires_cuda  # noqa: E402
from reference_verify import outcome_distribution, processed_probs  # noqa: E402

NUM_STAT_TESTS = 40  # at least the number of g_test calls in this file (33)
ALPHA = 1e-3 / NUM_STAT_TESTS
N_DRAWS = 1_000_000  # outcomes per statistical case (the issue's number)
CHUNK = 250_000  # rows per native call


def draws(fn, total: int = N_DRAWS, chunk: int = CHUNK):
    """Calls ``fn(base, b)`` for consecutive blocks of ``b`` rows whose seeds are ``base ..
    base + b - 1`` (so that no two draws share a Philox key) and concatenates the results, a
    VerifyResult or SampleResult, field by field."""
    parts = []
    for base in range(0, total, chunk):
        parts.append(fn(base, min(chunk, total - base)))
    return type(parts[0])(*[torch.cat(fields) for fields in zip(*parts)])


def outcome_counts(res) -> dict:
    """Counts of the outcomes (accepted path as a tuple of node indices, final token)."""
    acc = res.num_accepted.long()
    cols = torch.arange(res.path.shape[1])
    nodes = torch.where(cols[None, :] <= acc[:, None], res.path.long(), -1)[:, 1:]
    fin = res.emitted.long().gather(1, acc.unsqueeze(1))
    rows, counts = torch.unique(torch.cat([nodes, fin], 1), dim=0, return_counts=True)
    out = {}
    for r, c in zip(rows.tolist(), counts.tolist()):
        out[(tuple(x for x in r[:-1] if x >= 0), r[-1])] = c
    return out


def g_test(counts: dict, probs: dict, what: str) -> None:
    """G-test of observed counts against exact probabilities (cells with E < 5 pooled)."""
    total = sum(counts.values())
    impossible = [k for k in counts if probs.get(k, 0.0) <= 0.0]
    assert not impossible, f"{what}: outcomes of probability 0 were observed: {impossible[:5]}"
    keys = sorted(probs, key=lambda k: -probs[k])
    obs, exp = [], []
    pool_o, pool_e = 0.0, 0.0
    for k in keys:
        e = probs[k] * total
        if e < 5:
            pool_o += counts.get(k, 0)
            pool_e += e
        else:
            obs.append(counts.get(k, 0))
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    obs_a, exp_a = np.array(obs, float), np.array(exp, float)
    mask = obs_a > 0
    g = 2.0 * float(np.sum(obs_a[mask] * np.log(obs_a[mask] / exp_a[mask])))
    df = max(len(obs) - 1, 1)
    p_value = stats.chi2.sf(g, df)
    assert p_value > ALPHA, f"{what}: G = {g:.1f}, df = {df}, p = {p_value:.2e} < {ALPHA:.1e}"


def count(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def hist(tokens: torch.Tensor, v: int) -> dict:
    c = torch.bincount(tokens.long().flatten(), minlength=v).tolist()
    return {i: n for i, n in enumerate(c) if n}


def rand_dist(gen: torch.Generator, *shape: int, zeros: int = 0) -> torch.Tensor:
    """Random distributions over the last dim (Dirichlet-like), `zeros` entries forced to 0."""
    x = -torch.log(torch.rand(*shape, generator=gen, dtype=torch.float64))
    x = x**1.5
    if zeros:
        idx = torch.rand(*shape, generator=gen).argsort(-1)[..., :zeros]
        x.scatter_(-1, idx, 0.0)
    return x / x.sum(-1, keepdim=True)


def seeds(b: int, base: int = 0) -> torch.Tensor:
    return torch.arange(base, base + b, dtype=torch.int64)


# ---- RNG ---------------------------------------------------------------------------------------


def test_philox_known_answers():
    # Known-answer vectors of Random123 for philox4x32_10.
    counter = np.array(
        [[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]],
        dtype=np.uint32,
    )
    key = np.array([[0, 0], [0xFFFFFFFF] * 2, [0xA4093822, 0x299F31D0]], dtype=np.uint32)
    out = np.zeros((3, 4), dtype=np.uint32)
    _C.philox4x32_10(counter, key, out)
    expected = [
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ]
    assert out.tolist() == expected


# ---- the exp of the logits ---------------------------------------------------------------------
# verify's exp (verify::exp_approx in src/specdecode/verify.h, and its AVX-512 twin in
# src/verify.cc) is its own code so that every backend rounds identically; _C.verify_exp_approx runs
# it with the loops of a chosen instruction set.
ISAS = {0: "baseline", 1: "AVX2", 2: "AVX-512"}


def native_exp(x: np.ndarray, isa: int) -> tuple[np.ndarray, int]:
    out = np.empty_like(x)
    used = _C.verify_exp_approx(x, out, isa)
    return out, used


def exp_inputs() -> np.ndarray:
    """float32 inputs over the exp's whole finite range [-87, 88]: every 1021st bit pattern of
    each sign (every binade, including the subnormals near 0), 2e6 values uniform in value (every
    part of every reduction interval), and the ends."""
    top = int(np.float32(88.0).view(np.uint32))
    bottom = int(np.float32(87.0).view(np.uint32))
    pos = np.arange(0, top + 1, 1021, dtype=np.uint32).view(np.float32)
    neg = -np.arange(1, bottom + 1, 1021, dtype=np.uint32).view(np.float32)
    uniform = np.random.default_rng(3).uniform(-87.0, 88.0, 2_000_000).astype(np.float32)
    ends = np.array([0.0, -0.0, 88.0, -86.99999, np.nextafter(np.float32(-87), 0)], np.float32)
    x = np.concatenate([pos, neg, uniform, ends]).astype(np.float32)
    return x[(x > -87.0) & (x <= 88.0)]


def test_exp_is_within_a_few_ulp_of_exp():
    """The exp's error against numpy's float64 exp, in units in the last place of the float32
    result, over the whole input range that does not flush to 0: at most 6 ulp on every
    instruction set, and at most 3.5 ulp for |x| <= 30, where a row's weights live (the degree-5
    polynomial is good to 7.6e-8 relative; the rest is the one-constant reduction x - n ln2,
    whose error grows with |n|, and rounding)."""
    x = exp_inputs()
    exact = np.exp(x.astype(np.float64))
    _, e = np.frexp(exact)
    ulp = np.ldexp(1.0, e - 24)  # spacing of float32 values in exact's binade
    near = np.abs(x) <= 30.0
    for isa in ISAS:
        y, used = native_exp(x, isa)
        if used != isa:
            continue  # this CPU lacks the instruction set
        assert np.all(np.isfinite(y)) and np.all(y > 0)
        err = np.abs(y.astype(np.float64) - exact) / ulp
        worst = int(np.argmax(err))
        assert err[worst] <= 6.0, (ISAS[isa], float(x[worst]), float(y[worst]), exact[worst])
        assert err[near].max() <= 3.5, (ISAS[isa], float(err[near].max()))


def test_exp_flush_rule_and_exact_points():
    """x <= -87, -inf and NaN give exactly 0 (such tokens count as probability 0); just above
    -87 the result is a normal float; exp(0) is exactly 1 (the weight of a row's most likely
    token); x >= 88 (and +inf) gives the value at 88."""
    above = np.nextafter(np.float32(-87.0), np.float32(0.0))
    x = np.array(
        [
            -87.0,
            -87.5,
            -88.0,
            -100.0,
            -1e30,
            -np.inf,
            np.nan,
            above,
            0.0,
            -0.0,
            88.0,
            89.0,
            1e30,
            np.inf,
        ],
        dtype=np.float32,
    )
    for isa in ISAS:
        y, used = native_exp(x, isa)
        if used != isa:
            continue
        assert np.all(y[:7] == 0.0), ISAS[isa]
        assert y[7] >= np.finfo(np.float32).tiny, ISAS[isa]
        assert y[8] == 1.0 and y[9] == 1.0, ISAS[isa]
        assert np.all(y[11:] == y[10]) and abs(y[10] / np.exp(88.0) - 1.0) < 6 * 2.0**-24, ISAS[isa]


def test_exp_is_bit_identical_across_instruction_sets():
    """The baseline loops (fmaf calls), the AVX2 loops (the shared definition compiled with FMA)
    and the AVX-512 exp (intrinsics) give the same bits for every input, special values and the
    vector loop's masked tail included (the length is not a multiple of 16)."""
    specials = np.array([-np.inf, np.inf, np.nan, -87.0, 88.0, 1e30, -1e30], np.float32)
    x = np.concatenate([exp_inputs(), specials, exp_inputs()[:11]])
    base, used = native_exp(x, 0)
    assert used == 0
    for isa in (1, 2):
        y, used = native_exp(x, isa)
        if used != isa:
            continue
        assert np.array_equal(y.view(np.uint32), base.view(np.uint32)), ISAS[isa]


# ---- sample ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 12, 0.9)],
)
def test_sample_matches_processed_distribution(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    v = 24
    logits = torch.randn(v, generator=gen) * 2
    logits[3] = -math.inf  # a token of probability 0
    rows = logits.expand(CHUNK, v).contiguous()
    res = draws(
        lambda base, b: ops.sample(
            rows[:b], temperature, top_k, top_p, seed=seeds(b, base), offset=7
        )
    )
    assert int(res.status.abs().sum()) == 0
    p = processed_probs(logits, temperature, top_k, top_p)
    g_test(hist(res.tokens, v), dict(enumerate(p.tolist())), f"sample T={temperature}")


# ---- sampling_probs ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 12, 0.9), (0.5, 3, 0.3)],
)
def test_sampling_probs_are_the_processed_distribution(dtype, temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(3)
    # One chunk, and several with a partial last one and chunk maxima far apart.
    one = (torch.randn(4, 40, generator=gen) * 2).to(dtype)
    one[1, 7] = -math.inf
    one[2, :6] = one[2, :6].max()  # ties at the top (top-k / top-p boundaries among them)
    several = torch.stack([spread_logits(gen, 5 * 256 + 37)[0] for _ in range(3)]).to(dtype)
    for rows in (one, several):
        res = ops.sampling_probs(rows, temperature, top_k, top_p)
        assert res.probs.dtype == torch.float32 and res.probs.shape == rows.shape
        assert res.status.tolist() == [0] * rows.shape[0]
        want = processed_probs(rows.float(), temperature, top_k, top_p)
        assert torch.equal(res.probs > 0, want > 0), (temperature, top_k, top_p)
        torch.testing.assert_close(res.probs.double(), want, rtol=2e-5, atol=1e-7)


def test_sampling_probs_per_sequence_parameters_probability_inputs_and_greedy():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 300, generator=gen) * 2
    logits[4, [10, 20]] = 9.0  # tied maxima: the lowest index is the argmax
    temperature = torch.tensor([1.0, 0.6, 0.0, 1.2, 0.0])
    top_k = torch.tensor([0, 7, 0, 40, 0], dtype=torch.int32)
    top_p = torch.tensor([0.95, 1.0, 1.0, 0.5, 1.0])
    res = ops.sampling_probs(logits, temperature, top_k, top_p)
    for b in range(5):
        if temperature[b] == 0:
            want = torch.zeros(300, dtype=torch.float64)
            want[int(logits[b].argmax())] = 1.0
        else:
            want = processed_probs(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b]))
        torch.testing.assert_close(res.probs[b].double(), want, rtol=2e-5, atol=1e-7)
    assert int(res.probs[4].argmax()) == 10
    # Each row is processed alone: a row's result does not depend on its neighbours.
    alone = ops.sampling_probs(logits[3:4], 1.2, 40, 0.5)
    assert torch.equal(alone.probs[0], res.probs[3])
    probs = torch.rand(3, 64, generator=gen)
    probs[:, 5] = 0.0
    got = ops.sampling_probs(probs, 1.0, 0, 0.7, target_is_logits=False)
    want = processed_probs(probs, top_p=0.7, logits=False)
    torch.testing.assert_close(got.probs.double(), want, rtol=2e-5, atol=1e-7)
    # The rows are the law sample() draws from: its tokens lie in their support.
    row = (torch.randn(1, 500, generator=gen) * 3).expand(4000, 500).contiguous()
    draws = ops.sample(row, 0.8, 0, 0.6, seed=torch.arange(4000), offset=0).tokens
    support = ops.sampling_probs(row[:1], 0.8, 0, 0.6).probs[0] > 0
    assert bool(support[draws.long()].all()) and int(support.sum()) < 500


def test_sampling_probs_flag_bad_rows_and_refuse_bad_input():
    rows = torch.randn(3, 50)
    rows[0, 4] = float("nan")
    rows[1] = -math.inf
    res = ops.sampling_probs(rows, 0.8)
    assert res.status.tolist() == [ops.STATUS_NON_FINITE, ops.STATUS_ZERO_MASS, 0]
    assert not bool(res.probs[:2].any()) and abs(float(res.probs[2].sum()) - 1) < 1e-5
    with pytest.raises(ValueError, match="logits: expected 2 dimensions"):
        ops.sampling_probs(torch.randn(50))
    with pytest.raises(TypeError, match="logits: expected float32"):
        ops.sampling_probs(torch.zeros(2, 50, dtype=torch.int64))
    with pytest.raises(ValueError, match="vocabulary size"):
        ops.sampling_probs(torch.zeros(1, ops.MAX_VOCAB + 1))
    with pytest.raises(ValueError, match="top_p"):
        ops.sampling_probs(rows, 1.0, 0, 0.0)
    with pytest.raises(ValueError, match="top_k"):
        ops.sampling_probs(rows, 1.0, -1)
    with pytest.raises(ValueError, match="temperature: expected a scalar or shape"):
        ops.sampling_probs(rows, torch.ones(2))
    with pytest.raises(ValueError, match="temperature: with probability inputs"):
        ops.sampling_probs(torch.rand(2, 50), 0.5, target_is_logits=False)
    torch.library.opcheck(
        torch.ops.specdecode.sampling_probs.default,
        (torch.randn(2, 30), torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2), True),
    )


def spread_logits(gen: torch.Generator, v: int) -> tuple[torch.Tensor, list[int]]:
    """Logits over a vocabulary of several chunks (kChunk = 256 tokens) whose mass sits in
    tokens of different chunks, with chunk maxima far apart (so every chunk has its own local
    max m_c and scale g_c = exp(m_c - M)), and -inf elsewhere (so the outcome table is small)."""
    support = [0, 3, 200, 255, 256, 300, 511, 512, 700, 767, 768, 1023, 1024, v - 1]
    logits = torch.full((v,), -math.inf)
    logits[support] = torch.randn(len(support), generator=gen) * 2
    logits[[200, 255]] -= 3.0  # chunk 0's max is below the row's by several units
    logits[[512, 700, 767]] += 2.5
    logits[300] = -30.0  # about e^-30 of the max: never drawn, but not weight 0
    return logits, support


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.85)])
def test_sample_over_several_chunks_matches_processed_distribution(temperature, top_p):
    """The weights of a logits row are defined chunk by chunk (each chunk's exps taken against
    its own max, then scaled by exp(m_c - M)); the draws must still follow softmax(logits / T)
    with the top-p cut, which a vocabulary of one chunk would not show."""
    gen = torch.Generator().manual_seed(21)
    v = 5 * 256 + 37  # a partial last chunk
    logits, _ = spread_logits(gen, v)
    block = 50_000
    rows = logits.expand(block, v).contiguous()
    res = draws(
        lambda base, b: ops.sample(rows[:b], temperature, 0, top_p, seed=seeds(b, base), offset=2),
        chunk=block,
    )
    assert int(res.status.abs().sum()) == 0
    p = processed_probs(logits, temperature, 0, top_p)
    g_test(hist(res.tokens, v), dict(enumerate(p.tolist())), f"sample chunks T={temperature}")


@pytest.mark.slow
def test_chain_over_several_chunks_first_token_is_target_distributed():
    """A one-draft chain with q over a vocabulary of several chunks: the acceptance ratio
    p(x) / q(x) and the residual max(p - q, 0) use the chunk-scaled weights, and the first
    emitted token must be distributed as p."""
    gen = torch.Generator().manual_seed(22)
    v = 5 * 256 + 37
    logits, support = spread_logits(gen, v)
    p = torch.softmax(logits.double(), -1)
    q = torch.zeros(v, dtype=torch.float64)
    q[support] = torch.rand(len(support), generator=gen, dtype=torch.float64)
    q[[3, 1024]] = 0.0  # drafts never proposed there
    q[5] = 0.3  # a proposal the target gives probability 0: always rejected
    q = q / q.sum()
    block = 50_000
    target = torch.stack([logits, logits]).expand(block, 2, v).contiguous()
    draft = q.float().expand(block, 2, v).contiguous()

    def run(base: int, m: int):
        tokens = torch.zeros(m, 2, dtype=torch.int64)
        tokens[:, 1] = torch.multinomial(q.expand(m, v), 1, generator=gen)[:, 0]
        return ops.verify(target[:m], tokens, draft_probs=draft[:m], seed=seeds(m, base), offset=4)

    res = draws(run, chunk=block)
    assert int(res.status.abs().sum()) == 0
    g_test(hist(res.emitted[:, 0], v), dict(enumerate(p.tolist())), "chain over chunks")
    alpha = float(torch.minimum(p, q).sum())
    mean = float(res.num_accepted.double().mean())
    assert abs(mean - alpha) < 6 / math.sqrt(N_DRAWS), (mean, alpha)


def test_sample_probability_inputs_and_greedy():
    gen = torch.Generator().manual_seed(2)
    v = 16
    probs = rand_dist(gen, v, zeros=4).float()
    rows = probs.expand(CHUNK, v).contiguous()
    res = draws(
        lambda base, b: ops.sample(rows[:b], seed=seeds(b, base), offset=0, target_is_logits=False)
    )
    g_test(
        hist(res.tokens, v),
        dict(enumerate(processed_probs(probs, logits=False).tolist())),
        "sample probs",
    )
    logits = torch.randn(5, 1000, generator=gen)
    greedy = ops.sample(logits, 0.0, seed=0, offset=0).tokens
    assert torch.equal(greedy.long(), logits.argmax(-1))


# ---- exact: losslessness -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("with_q", [True, False])
def test_chain_first_token_is_target_distributed(k, with_q):
    gen = torch.Generator().manual_seed(10 + k)
    v, b = 12, N_DRAWS
    p = rand_dist(gen, k + 1, v, zeros=2)
    q = rand_dist(gen, k + 1, v, zeros=3)
    draft = q.float().expand(CHUNK, k + 1, v).contiguous() if with_q else None
    target = torch.log(p).float().expand(CHUNK, k + 1, v).contiguous()

    def block(base: int, m: int):
        tokens = torch.zeros(m, k + 1, dtype=torch.int64)
        if with_q:
            for i in range(k):
                tokens[:, i + 1] = torch.multinomial(q[i].expand(m, v), 1, generator=gen)[:, 0]
        else:
            # Deterministic drafts: arbitrary tokens (not sampled from any q).
            tokens[:, 1:] = torch.randint(0, v, (m, k), generator=gen)
        return ops.verify(
            target[:m],
            tokens,
            draft_probs=None if draft is None else draft[:m],
            seed=seeds(m, base),
            offset=3,
        )

    res = draws(block)
    assert int(res.status.abs().sum()) == 0
    first = res.emitted[:, 0]
    g_test(hist(first, v), dict(enumerate(p[0].tolist())), f"chain k={k} q={with_q}")
    if with_q:
        # Mean accepted = sum over positions j of prod_{i<=j} alpha_i, alpha = sum min(p, q).
        alpha = torch.minimum(p, q).sum(-1)[:k]
        theory = float(torch.cumprod(alpha, 0).sum())
        mean = float(res.num_accepted.double().mean())
        assert abs(mean - theory) < 6 * k / math.sqrt(b), (mean, theory)


def markov_tables(gen: torch.Generator, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = rand_dist(gen, v, v, zeros=2)
    q = rand_dist(gen, v, v, zeros=2)
    # The draft must be able to propose what the target likes, at least sometimes.
    q = 0.7 * q + 0.3 * p
    return p, q


def commit_emitted(res, out: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """Appends each row's emitted tokens to ``out`` [B, W] from column ``filled[row]`` on (as far
    as W goes), advances ``filled`` and returns each row's last emitted token (its next root)."""
    m = res.num_emitted.long()
    rows = torch.arange(out.shape[0])
    for j in range(res.emitted.shape[1]):
        take = (j < m) & (filled + j < out.shape[1])
        out[rows[take], (filled + j)[take]] = res.emitted[take, j].long()
    filled += m
    return res.emitted.long().gather(1, (m - 1).unsqueeze(1)).squeeze(1)


def g_test_three_tokens(out: torch.Tensor, p_tab: torch.Tensor, what: str) -> None:
    """G-test of the first three tokens of every row of ``out`` against the target's Markov law
    p(x1|0) p(x2|x1) p(x3|x2)."""
    v = p_tab.shape[0]
    codes = (out[:, 0] * v + out[:, 1]) * v + out[:, 2]
    probs = {}
    for a in range(v):
        for c in range(v):
            for d in range(v):
                pr = float(p_tab[0, a] * p_tab[a, c] * p_tab[c, d])
                if pr > 0:
                    probs[(a * v + c) * v + d] = pr
    g_test(hist(codes, v**3), probs, what)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_joint_of_three_emitted_tokens_with_context(shape):
    """Several verify steps per row; the first three generated tokens must follow the target's
    Markov chain p(x1|x0) p(x2|x1) p(x3|x2) exactly, with context-dependent p and q."""
    gen = torch.Generator().manual_seed(20)
    v, b, want = 6, N_DRAWS, 3
    p_tab, q_tab = markov_tables(gen, v)
    if shape == "chain":
        parents = None
        n = 3
    else:
        # Root with two children sampled from q without replacement, each with one child.
        parents = torch.tensor([-1, 0, 0, 1, 2], dtype=torch.int32).expand(b, 5).contiguous()
        n = 5
    out = torch.full((b, want + n), -1, dtype=torch.int64)
    filled = torch.zeros(b, dtype=torch.int64)
    ctx = torch.zeros(b, dtype=torch.int64)
    for step in range(want):
        tokens = torch.zeros(b, n, dtype=torch.int64)
        tokens[:, 0] = ctx
        if shape == "chain":
            for i in range(1, n):
                tokens[:, i] = torch.multinomial(q_tab[tokens[:, i - 1]], 1, generator=gen)[:, 0]
        else:
            pair = torch.multinomial(q_tab[ctx], 2, replacement=False, generator=gen)
            tokens[:, 1:3] = pair
            for i in (3, 4):
                parent = tokens[:, i - 2]
                tokens[:, i] = torch.multinomial(q_tab[parent], 1, generator=gen)[:, 0]
        target = torch.log(p_tab[tokens]).float()
        draft = q_tab[tokens].float()
        res = draws(
            lambda base, m, t=target, tk=tokens, d=draft, s=step: ops.verify(
                t[base : base + m],
                tk[base : base + m],
                parents=None if parents is None else parents[:m],
                draft_probs=d[base : base + m],
                seed=seeds(m, s * b + base),
                offset=s,
            )
        )
        ctx = commit_emitted(res, out, filled)
    assert bool((filled >= want).all())
    g_test_three_tokens(out, p_tab, f"joint of 3 tokens ({shape})")


TREES = {
    "siblings3": [-1, 0, 0, 0],
    "wide_deep": [-1, 0, 0, 1, 1, 2, 3],
    "chain_with_branch": [-1, 0, 1, 1, 2, 3],
}


@pytest.mark.slow
@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("with_q", [True, False])
def test_tree_outcomes_match_enumeration(tree, with_q):
    """The law of (accepted path, final token) for fixed draft tokens equals the enumeration."""
    gen = torch.Generator().manual_seed(30 + len(TREES[tree]))
    parents_list = TREES[tree]
    n, v, b = len(parents_list), 8, CHUNK
    p = rand_dist(gen, n, v, zeros=1)
    q = rand_dist(gen, n, v, zeros=1)
    # Distinct sibling tokens (as sampling without replacement gives), and one duplicate-free
    # token of probability 0 under p somewhere to exercise the rejections.
    tokens = [0]
    for i in range(1, n):
        parent = parents_list[i]
        used = {tokens[j] for j in range(1, i) if parents_list[j] == parent}
        choices = [t for t in range(v) if t not in used and (not with_q or q[parent, t] > 0)]
        tokens.append(choices[int(torch.randint(0, len(choices), (1,), generator=gen))])
    target = torch.log(p).float().expand(b, n, v).contiguous()
    draft = q.float().expand(b, n, v).contiguous() if with_q else None
    parents = torch.tensor(parents_list, dtype=torch.int32).expand(b, n).contiguous()
    tok = torch.tensor(tokens, dtype=torch.int32).expand(b, n).contiguous()
    res = draws(
        lambda base, m: ops.verify(
            target[:m],
            tok[:m],
            parents=parents[:m],
            draft_probs=None if draft is None else draft[:m],
            seed=seeds(m, base),
            offset=11,
        )
    )
    assert int(res.status.abs().sum()) == 0
    law = outcome_distribution(p, tokens, parents=parents_list, q_rows=q if with_q else None)
    assert abs(sum(law.values()) - 1) < 1e-9
    g_test(outcome_counts(res), law, f"tree {tree} q={with_q}")


def test_tree_siblings_first_token_lossless():
    """Siblings sampled from q without replacement; first emitted token ~ p."""
    gen = torch.Generator().manual_seed(40)
    v, b, m = 10, CHUNK, 3
    p = rand_dist(gen, m + 1, v, zeros=2)
    q = rand_dist(gen, m + 1, v)
    parents = torch.tensor([-1] + [0] * m, dtype=torch.int32).expand(b, m + 1).contiguous()
    target = torch.log(p).float().expand(b, m + 1, v).contiguous()
    draft = q.float().expand(b, m + 1, v).contiguous()

    def block(base: int, rows: int):
        tokens = torch.zeros(rows, m + 1, dtype=torch.int64)
        tokens[:, 1:] = torch.multinomial(q[0].expand(rows, v), m, replacement=False, generator=gen)
        return ops.verify(
            target[:rows],
            tokens,
            parents=parents[:rows],
            draft_probs=draft[:rows],
            seed=seeds(rows, base),
            offset=5,
        )

    res = draws(block)
    g_test(hist(res.emitted[:, 0], v), dict(enumerate(p[0].tolist())), "siblings first token")


# ---- block verification ------------------------------------------------------------------------

BLOCK_CHAINS = {
    # (drafts g, vocabulary, zeros per row, whether a draft of target probability 0 ends p early,
    # seed); the seeds give draft tokens whose block law is far from the token-by-token one, with
    # and without the processing (total variation 0.71-0.76 for the longer chains; a one-draft
    # block is the same rule as token by token, accepted here with probability 0.56 / 0.49).
    "one": (1, 6, 1, False, 304),
    "three": (3, 8, 1, False, 324),
    "five_dead_end": (5, 6, 2, True, 329),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BLOCK_CHAINS))
@pytest.mark.parametrize("processing", [{}, {"temperature": 0.7, "top_p": 0.9}])
def test_block_outcomes_match_enumeration(case, processing):
    """The law of (accepted drafts, final token) of a sampled chain under method="block" equals
    block verification's closed form, for fixed draft tokens; with temperature and top-p the
    closed form reads the processed target rows."""
    g, v, zeros, dead_end, seed = BLOCK_CHAINS[case]
    gen = torch.Generator().manual_seed(seed)
    n, b = g + 1, CHUNK
    logits = torch.log(rand_dist(gen, n, v, zeros=zeros))
    q = rand_dist(gen, n, v, zeros=zeros)
    p = processed_probs(logits, **processing)
    # Tokens the draft could have sampled (q > 0), the last one of p = 0 in the dead-end case.
    tokens = [0]
    for j in range(g):
        likely = [t for t in range(v) if q[j, t] > 0 and (p[j, t] > 0) != (dead_end and j == g - 2)]
        tokens.append(likely[int(torch.randint(0, len(likely), (1,), generator=gen))])
    target = logits.float().expand(b, n, v).contiguous()
    draft = q.float().expand(b, n, v).contiguous()
    tok = torch.tensor(tokens, dtype=torch.int32).expand(b, n).contiguous()
    res = draws(
        lambda base, m: ops.verify(
            target[:m],
            tok[:m],
            draft_probs=draft[:m],
            seed=seeds(m, base),
            offset=7,
            method="block",
            **processing,
        )
    )
    assert int(res.status.abs().sum()) == 0
    law = outcome_distribution(p, tokens, q_rows=q, method="block")
    assert abs(sum(law.values()) - 1) < 1e-9
    if dead_end:
        # p_j = 0 past the draft of probability 0: nothing after it is ever kept.
        assert max(len(path) for path, _ in law) <= g - 2
        assert int(res.num_accepted.max()) <= g - 2
    g_test(outcome_counts(res), law, f"block {case} {processing}")


def _sampled_chains(gen, q_tab, ctx, n, stop_token=None):
    """Chains of n - 1 drafts sampled from the Markov draft q_tab after each row's context token;
    with stop_token, a row's chain ends after its first draft equal to it (num_nodes): a length
    the drafter chose from its own drafts."""
    b = ctx.shape[0]
    tokens = torch.zeros(b, n, dtype=torch.int64)
    tokens[:, 0] = ctx
    for i in range(1, n):
        tokens[:, i] = torch.multinomial(q_tab[tokens[:, i - 1]], 1, generator=gen)[:, 0]
    num_nodes = torch.full((b,), n, dtype=torch.int32)
    if stop_token is not None:
        hit = tokens[:, 1:] == stop_token
        first = torch.where(hit.any(1), hit.int().argmax(1) + 2, n)
        num_nodes = first.to(torch.int32)
    return tokens, num_nodes


@pytest.mark.slow
@pytest.mark.parametrize("stop_token", [None, 0])
def test_block_is_lossless_over_steps_and_accepts_more(stop_token):
    """Several block-verified steps per row: the first three emitted tokens follow the target's
    Markov chain exactly, also when the drafter ends a chain at a token of its choosing. On the
    same drafts, block verification keeps more drafts per step than token-by-token ("exact")."""
    gen = torch.Generator().manual_seed(310)
    v, b, want, n = 6, N_DRAWS, 3, 4
    p_tab, q_tab = markov_tables(gen, v)
    out = torch.full((b, want + n), -1, dtype=torch.int64)
    filled = torch.zeros(b, dtype=torch.int64)
    ctx = torch.zeros(b, dtype=torch.int64)
    accepted = {"block": 0, "exact": 0}
    for step in range(want):
        tokens, num_nodes = _sampled_chains(gen, q_tab, ctx, n, stop_token)
        target = torch.log(p_tab[tokens]).float()
        draft = q_tab[tokens].float()
        results = {}
        for method in ("block", "exact"):
            results[method] = draws(
                lambda base, m, s=step, meth=method, t=target, tk=tokens, nn=num_nodes, d=draft: (
                    ops.verify(
                        t[base : base + m],
                        tk[base : base + m],
                        num_nodes=nn[base : base + m],
                        draft_probs=d[base : base + m],
                        seed=seeds(m, s * b + base),
                        offset=s,
                        method=meth,
                    )
                )
            )
            accepted[method] += int(results[method].num_accepted.sum())
        res = results["block"]
        assert int(res.status.abs().sum()) == 0
        ctx = commit_emitted(res, out, filled)
    assert bool((filled >= want).all())
    g_test_three_tokens(out, p_tab, f"block joint of 3 tokens (stop {stop_token})")
    # On 3-draft chains of this pair block verification keeps about 12 % more drafts per step
    # (measured on 2e5 rows: 1.124 against 0.999, 32 standard errors apart); at 1e6 rows per
    # step a 2 % margin leaves the gap some 60 standard errors to spare.
    assert accepted["block"] > 1.02 * accepted["exact"], accepted


def test_block_equals_exact_off_sampled_chains():
    """method="block" changes only sampled chains: deterministic drafts, rows flagged in
    draft_deterministic and branching trees are verified exactly as by method="exact", token for
    token; a chain given through parents is the chain without them; greedy rows are greedy."""
    gen = torch.Generator().manual_seed(320)
    b, n, v = 24, 5, 300
    logits = torch.randn(b, n, v, generator=gen) * 2
    q = torch.softmax(torch.randn(b, n, v, generator=gen) * 2, -1)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    tokens[:, 1] = logits[:, 0].argmax(-1)
    tree = torch.tensor([-1, 0, 0, 1, 2], dtype=torch.int32).expand(b, n).contiguous()
    chain = torch.tensor([-1, 0, 1, 2, 3], dtype=torch.int32).expand(b, n).contiguous()
    flagged = torch.arange(b) % 2 == 0
    kw = dict(seed=seeds(b), offset=5, top_p=0.95)

    def same(x, y):
        for name, a, c in zip(x._fields, x, y):
            assert torch.equal(a, c), name

    same(ops.verify(logits, tokens, method="block", **kw), ops.verify(logits, tokens, **kw))
    same(
        ops.verify(logits, tokens, parents=tree, draft_probs=q, method="block", **kw),
        ops.verify(logits, tokens, parents=tree, draft_probs=q, **kw),
    )
    # Flagged rows: deterministic (as "exact"); the others sampled chains (block).
    mixed = ops.verify(
        logits, tokens, draft_probs=q, draft_deterministic=flagged, method="block", **kw
    )
    same_rows = ops.verify(logits, tokens, **kw)
    block_rows = ops.verify(logits, tokens, draft_probs=q, method="block", **kw)
    for name, x, det, blk in zip(mixed._fields, mixed, same_rows, block_rows):
        assert torch.equal(x[flagged], det[flagged]), name
        assert torch.equal(x[~flagged], blk[~flagged]), name
    num_nodes = torch.randint(1, n + 1, (b,), generator=gen, dtype=torch.int32)
    same(
        ops.verify(
            logits, tokens, parents=chain, num_nodes=num_nodes, draft_probs=q, method="block", **kw
        ),
        ops.verify(logits, tokens, num_nodes=num_nodes, draft_probs=q, method="block", **kw),
    )
    cold = dict(kw, temperature=torch.where(flagged, 0.0, 1.0))
    greedy = ops.verify(logits, tokens, draft_probs=q, method="block", **cold)
    plain = ops.verify(logits, tokens, draft_probs=q, method="greedy", **kw)
    assert torch.equal(greedy.emitted[flagged], plain.emitted[flagged])
    # Where "block" and "exact" both keep a whole chain, the bonus token is the same draw.
    high = torch.softmax(logits, -1)
    chain_tokens = torch.zeros(b, n, dtype=torch.int64)
    for j in range(1, n):
        chain_tokens[:, j] = high[:, j - 1].argmax(-1)
    both = [
        ops.verify(logits, chain_tokens, draft_probs=high, method=m, **kw)
        for m in ("block", "exact")
    ]
    full = (both[0].num_accepted == n - 1) & (both[1].num_accepted == n - 1)
    assert bool(full.any())
    assert torch.equal(both[0].emitted[full], both[1].emitted[full])


def test_block_bad_rows_and_refusals():
    """A bad target or draft row met by the block walk ends the sequence with its status and
    no final token; allow= is refused (a block is judged whole)."""
    b, n, v = 3, 4, 10
    logits = torch.zeros(b, n, v)
    q = torch.full((b, n, v), 0.1)
    tokens = torch.ones(b, n, dtype=torch.int32)
    logits[0, 2, 3] = math.nan  # row 2 is read: p stays 1 along a chain where p = q
    q[1, 1, 1] = math.nan  # the draft's q(x) at node 1
    res = ops.verify(logits, tokens, draft_probs=q, method="block", seed=seeds(b), offset=0)
    assert res.status.tolist() == [ops.STATUS_NON_FINITE, ops.STATUS_BAD_DRAFT, 0]
    assert res.num_emitted[:2].tolist() == res.num_accepted[:2].tolist()
    # p = q everywhere: every h is 1, so the whole chain is kept and the bonus drawn.
    assert res.num_accepted[2] == n - 1 and res.num_emitted[2] == n
    with pytest.raises(ValueError, match="allow: method='block'"):
        ops.verify(
            logits,
            tokens,
            draft_probs=q,
            method="block",
            allow=torch.ones(b, n, dtype=torch.bool),
            seed=0,
            offset=0,
        )


# ---- lossy modes -------------------------------------------------------------------------------


@pytest.mark.parametrize("correction", ["residual", "target"])
def test_relaxed_acceptance_and_total_variation(correction):
    gen = torch.Generator().manual_seed(50)
    v, b, eps = 10, N_DRAWS, 0.2
    p = rand_dist(gen, 2, v, zeros=2)
    q = rand_dist(gen, 2, v)
    target = torch.log(p).float().expand(CHUNK, 2, v).contiguous()
    draft = q.float().expand(CHUNK, 2, v).contiguous()

    def block(base: int, m: int):
        tokens = torch.zeros(m, 2, dtype=torch.int64)
        tokens[:, 1] = torch.multinomial(q[0].expand(m, v), 1, generator=gen)[:, 0]
        return ops.verify(
            target[:m],
            tokens,
            draft_probs=draft[:m],
            seed=seeds(m, base),
            offset=0,
            method="relaxed",
            eps=eps,
            correction=correction,
        )

    res = draws(block)
    p0, q0 = p[0], q[0]
    accepted_mass = torch.minimum(q0, p0 + eps * q0)  # P(accept and emit y)
    rate = float(accepted_mass.sum())
    measured = float(res.num_accepted.double().mean())
    assert abs(measured - rate) < 6 * 0.5 / math.sqrt(b), (measured, rate)
    reject = 1 - rate
    corr = torch.clamp(p0 - q0, min=0) if correction == "residual" else p0
    law = accepted_mass + reject * corr / corr.sum()
    g_test(hist(res.emitted[:, 0], v), dict(enumerate(law.tolist())), f"relaxed {correction}")
    tv = 0.5 * float((law - p0).abs().sum())
    if correction == "residual":
        # Decoding-OPT: the loss is only the irreducible over-acceptance.
        assert tv == pytest.approx(float(torch.clamp(accepted_mass - p0, min=0).sum()), abs=1e-9)
    empirical = torch.bincount(res.emitted[:, 0].long(), minlength=v).double() / b
    assert abs(0.5 * float((empirical - p0).abs().sum()) - tv) < 0.01


@pytest.mark.slow
def test_relaxed_outcomes_match_enumeration_on_a_tree():
    gen = torch.Generator().manual_seed(51)
    parents_list = [-1, 0, 0, 1]
    n, v, b = 4, 8, CHUNK
    p = rand_dist(gen, n, v)
    q = rand_dist(gen, n, v)
    tokens = [0, 2, 5, 1]
    target = torch.log(p).float().expand(b, n, v).contiguous()
    tok = torch.tensor(tokens).expand(b, n).contiguous()
    parents = torch.tensor(parents_list, dtype=torch.int32).expand(b, n).contiguous()
    draft = q.float().expand(b, n, v).contiguous()
    res = draws(
        lambda base, m: ops.verify(
            target[:m],
            tok[:m],
            parents=parents[:m],
            draft_probs=draft[:m],
            seed=seeds(m, base),
            offset=2,
            method="relaxed",
            eps=0.1,
        )
    )
    law = outcome_distribution(p, tokens, parents=parents_list, q_rows=q, method="relaxed", eps=0.1)
    g_test(outcome_counts(res), law, "relaxed tree")


@pytest.mark.parametrize("v", [50, 3001])
def test_typical_acceptance_rule(v):
    # V = 3001: twelve chunks with their own scales g_c, the entropy summed from the cached
    # weights of the row.
    gen = torch.Generator().manual_seed(60)
    b, n = 400, 4
    logits = torch.randn(b, n, v, generator=gen) * 3
    tokens = torch.randint(0, v, (b, n), generator=gen)
    eps, alpha = 0.09, 0.3
    res = ops.verify(
        logits,
        tokens,
        seed=seeds(b),
        offset=0,
        method="typical",
        eps=eps,
        alpha=alpha,
        temperature=0.8,
    )
    p = processed_probs(logits, 0.8)
    h = -(p * torch.log(torch.where(p > 0, p, 1))).sum(-1)
    thr = torch.minimum(torch.full_like(h, eps), alpha * torch.exp(-h))
    ok = p.gather(-1, tokens[:, 1:].unsqueeze(-1).long()).squeeze(-1) > thr[:, :-1]
    expected = torch.cumprod(ok.int(), 1).sum(1)
    # Probabilities within float rounding of the threshold may go either way.
    margin = (p.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1) - thr[:, :-1]).abs()
    close = (margin < 1e-5).any(1)
    assert torch.equal(res.num_accepted[~close].long(), expected[~close].long())


@pytest.mark.parametrize("v", [40, 3001])
def test_topk_accept_rule(v):
    gen = torch.Generator().manual_seed(61)
    b, n, k = 400, 5, 3
    logits = torch.randn(b, n, v, generator=gen)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    # Half the drafts among the target's k + 2 most likely tokens, so that both sides of the
    # rank boundary are tried often.
    near = logits[:, :-1].topk(k + 2, -1).indices
    pick = torch.randint(0, k + 2, (b, n - 1, 1), generator=gen)
    tokens[:, 1:] = torch.where(
        torch.rand(b, n - 1, generator=gen) < 0.5,
        near.gather(-1, pick).squeeze(-1),
        tokens[:, 1:],
    )
    res = ops.verify(logits, tokens, seed=seeds(b), offset=0, method="topk_accept", topk_accept=k)
    rank = (logits[:, :-1] > logits[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1))).sum(-1)
    expected = torch.cumprod((rank < k).int(), 1).sum(1)
    assert torch.equal(res.num_accepted.long(), expected.long())
    ok = res.emitted[:, : n - 1] == tokens[:, 1:]
    assert bool(ok[torch.arange(n - 1) < res.num_accepted.unsqueeze(1)].all())


def test_allow_accepts_regardless():
    gen = torch.Generator().manual_seed(62)
    b, n, v = 64, 5, 30
    logits = torch.randn(b, n, v, generator=gen)
    logits[:, :, 7] = -math.inf
    tokens = torch.full((b, n), 7)
    allow = torch.zeros(b, n, dtype=torch.bool)
    allow[:, 1:3] = True
    res = ops.verify(logits, tokens, allow=allow, seed=seeds(b), offset=0)
    assert bool((res.num_accepted == 2).all())
    assert bool((res.emitted[:, :2] == 7).all()) and bool((res.emitted[:, 2] != 7).all())


def test_greedy_allow_prefers_the_argmax_child_over_an_allowed_sibling():
    # Root with three children: an allowed mismatch, the argmax, another allowed mismatch; the
    # argmax child has an allowed mismatch below it. Greedy takes the argmax child, then the
    # allowed grandchild; without an argmax child the first allowed sibling is taken.
    v = 12
    logits = torch.zeros(2, 5, v)
    logits[:, :, 5] = 4.0  # the argmax everywhere
    parents = torch.tensor([[-1, 0, 0, 0, 2], [-1, 0, 0, 0, 2]], dtype=torch.int32)
    tokens = torch.tensor([[0, 3, 5, 4, 9], [0, 3, 6, 4, 9]])
    allow = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.bool)
    res = ops.verify(
        logits, tokens, parents=parents, allow=allow, temperature=0.0, seed=0, offset=0
    )
    assert res.path[0].tolist() == [0, 2, 4] and res.emitted[0].tolist() == [5, 9, 5]
    assert res.path[1].tolist()[:2] == [0, 2] and res.num_accepted.tolist() == [2, 1]
    assert res.emitted[1, :2].tolist() == [6, 5]


# ---- greedy ------------------------------------------------------------------------------------


def greedy_walk(logits: torch.Tensor, tokens: list[int], parents: list[int]) -> list[int]:
    out, node = [], 0
    while True:
        a = int(torch.argmax(logits[node]))
        kids = [c for c in range(node + 1, len(parents)) if parents[c] == node]
        nxt = next((c for c in kids if tokens[c] == a), None)
        out.append(a)
        if nxt is None:
            return out
        node = nxt


def test_greedy_equals_argmax_walk():
    gen = torch.Generator().manual_seed(70)
    b, n, v = 300, 12, 6
    parents = torch.zeros(b, n, dtype=torch.int32)
    parents[:, 0] = -1
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (b,), generator=gen)
    logits = torch.randn(b, n, v, generator=gen)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    for method, temp in (("greedy", 1.0), ("exact", 0.0)):
        res = ops.verify(
            logits, tokens, parents=parents, seed=0, offset=0, method=method, temperature=temp
        )
        for r in range(b):
            want = greedy_walk(logits[r], tokens[r].tolist(), parents[r].tolist())
            got = res.emitted[r, : res.num_emitted[r]].tolist()
            assert got == want, (method, r)


# ---- edge cases, determinism -------------------------------------------------------------------


def test_zero_probabilities_never_emitted_and_p_zero_rejects():
    gen = torch.Generator().manual_seed(80)
    b, n, v = 20_000, 3, 16
    logits = torch.randn(b, n, v, generator=gen)
    logits[:, :, :8] = -math.inf
    tokens = torch.randint(0, 8, (b, n), generator=gen)  # drafts the target never emits
    q = torch.zeros(b, n, v)
    q.scatter_(2, tokens.roll(-1, 1).unsqueeze(-1), 1.0)
    for draft in (None, q):
        res = ops.verify(logits, tokens, draft_probs=draft, seed=seeds(b), offset=0)
        assert bool((res.num_accepted == 0).all())
        assert bool((res.emitted[:, 0] >= 8).all())
    # q(x) = 0 with p(x) > 0: documented as always accepted.
    tokens2 = torch.randint(8, v, (b, n), generator=gen)
    res = ops.verify(logits, tokens2, draft_probs=torch.zeros(b, n, v), seed=seeds(b), offset=0)
    assert bool((res.num_accepted == n - 1).all())


def test_non_finite_and_zero_rows_set_status():
    b, n, v = 6, 4, 10
    logits = torch.zeros(b, n, v)
    tokens = torch.ones(b, n, dtype=torch.int32)
    allow = torch.ones(b, n, dtype=torch.bool)
    logits[0, 0, 3] = math.nan
    logits[1, 2, 3] = math.inf
    logits[2, 1, :] = -math.inf
    logits[3, 3, 0] = math.nan  # the leaf row
    res = ops.verify(logits, tokens, allow=allow, seed=0, offset=0)
    assert res.status.tolist() == [1, 1, 2, 1, 0, 0]
    assert res.num_emitted.tolist() == [0, 2, 1, 3, 4, 4]
    assert res.num_accepted.tolist() == [0, 2, 1, 3, 3, 3]
    valid = res.emitted >= 0
    assert bool((res.emitted[valid] < v).all())
    probs = torch.full((2, 2, v), 0.1)
    probs[0, 0, 2] = -0.1
    q = torch.full((2, 2, v), 0.1)
    q[1, 0, 1] = math.nan
    res = ops.verify(probs, tokens[:2, :2], draft_probs=q, target_is_logits=False, seed=0, offset=0)
    assert res.status.tolist() == [ops.STATUS_NON_FINITE, ops.STATUS_BAD_DRAFT]
    s = ops.sample(torch.full((2, v), -math.inf), seed=0, offset=0)
    assert s.status.tolist() == [2, 2] and s.tokens.tolist() == [-1, -1]
    # Whole chunks of 256 (the vector loops): +inf and NaN inside a chunk, with and without a
    # temperature, and a row whose -inf chunks are fine.
    v = 1024
    logits = torch.randn(6, 2, v, generator=torch.Generator().manual_seed(4))
    logits[0, 0, 300] = math.inf
    logits[1, 1, 700] = math.nan
    logits[2, 0, 256:768] = -math.inf
    logits[3, 0, 255] = math.inf
    logits[3, 0, 256] = -math.inf
    logits[4, 1, 1023] = math.inf
    tokens = torch.ones(6, 2, dtype=torch.int32)
    allow = torch.ones(6, 2, dtype=torch.bool)
    for temperature in (1.0, 0.7):
        res = ops.verify(logits, tokens, allow=allow, temperature=temperature, seed=0, offset=0)
        assert res.status.tolist() == [1, 1, 0, 1, 1, 0]


@pytest.mark.parametrize("v", [10, 1024])
def test_probability_rows_whose_sum_overflows_set_status(v):
    """Finite entries whose float32 sum passes 3.4e38 cannot be drawn from: flagged, not drawn
    against an infinite total. Large entries with a finite sum are a valid row."""
    probs = torch.zeros(3, 2, v)
    probs[:, :, :4] = torch.tensor([1e38, 3e38, 2e38, 1e37])  # sum 6.1e38: overflows
    probs[1, 0, 1] = 0.0  # 1.1e38 in all: valid
    probs[2, 0, :4] = torch.tensor([0, 3e38, 0, 0])  # accepts token 1, then meets the overflow
    tokens = torch.tensor([[0, 1]] * 3, dtype=torch.int32)
    res = ops.verify(probs, tokens, target_is_logits=False, seed=0, offset=0)
    assert res.status.tolist() == [ops.STATUS_NON_FINITE, 0, ops.STATUS_NON_FINITE]
    assert res.num_emitted.tolist()[0] == 0 and res.num_emitted.tolist()[2] == 1
    assert res.emitted[2, 0].item() == 1
    first = probs[:, 0].contiguous()
    sp = ops.sampling_probs(first, 1.0, target_is_logits=False)
    assert sp.status.tolist() == [ops.STATUS_NON_FINITE, 0, 0]
    torch.testing.assert_close(sp.probs[1, :4], torch.tensor([1e38, 0, 2e38, 1e37]) / 3.1e38)
    # Top-k that leaves a finite sum is a valid row; greedy reads only the argmax.
    assert ops.sampling_probs(first[:1], 1.0, 2, target_is_logits=False).status.tolist() == [
        ops.STATUS_NON_FINITE
    ]
    assert ops.sampling_probs(first[:1], 1.0, 1, target_is_logits=False).status.tolist() == [0]
    greedy = ops.verify(probs, tokens, target_is_logits=False, temperature=0.0, seed=0, offset=0)
    assert greedy.status.tolist() == [0, 0, 0]


def test_padding_and_variable_lengths():
    b, n, v = 3, 5, 10
    logits = torch.randn(b, n, v)
    tokens = torch.tensor([[0, 1, -1, -1, -1], [0, 1, 2, -1, -1], [0, 1, 2, 3, 4]])
    allow = torch.ones(b, n, dtype=torch.bool)
    res = ops.verify(
        logits,
        tokens,
        num_nodes=torch.tensor([2, 3, 5], dtype=torch.int32),
        allow=allow,
        seed=0,
        offset=0,
    )
    assert res.num_accepted.tolist() == [1, 2, 4]
    assert res.path[0].tolist() == [0, 1, -1, -1, -1]
    parents = torch.tensor(
        [[-1, 0, 0, -1, -1], [-1, 0, 1, 2, -1], [-1, 0, 0, 1, 1]], dtype=torch.int32
    )
    tokens = torch.tensor([[0, 1, 2, -1, -1], [0, 1, 2, 3, -1], [0, 1, 2, 3, 4]])
    res = ops.verify(logits, tokens, parents=parents, allow=allow, seed=0, offset=0)
    assert res.emitted.shape == (3, 4)  # max depth 3
    assert res.num_accepted.tolist() == [1, 3, 2]
    assert res.path[2].tolist() == [0, 1, 3, -1]


def test_same_seed_same_tokens_permutation_and_threads():
    gen = torch.Generator().manual_seed(90)
    b, n, v = 64, 6, 300
    logits = torch.randn(b, n, v, generator=gen)
    q = torch.softmax(torch.randn(b, n, v, generator=gen), -1)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    seed = torch.randint(0, 2**40, (b,), generator=gen)
    offset = torch.randint(0, 2**40, (b,), generator=gen)
    kw = dict(top_k=50, top_p=0.9, temperature=0.8)
    a = ops.verify(logits, tokens, draft_probs=q, seed=seed, offset=offset, **kw)
    c = ops.verify(logits, tokens, draft_probs=q, seed=seed, offset=offset, **kw)
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    perm = torch.randperm(b, generator=gen)
    d = ops.verify(
        logits[perm], tokens[perm], draft_probs=q[perm], seed=seed[perm], offset=offset[perm], **kw
    )
    for x, y in zip(a, d):
        assert torch.equal(x[perm], y)
    mode = specdecode.get_threading()["mode"]
    try:
        specdecode.set_num_threads(1)
        e = ops.verify(logits, tokens, draft_probs=q, seed=seed, offset=offset, **kw)
        specdecode.set_num_threads(3)
        specdecode.set_threading("pool")  # `a` ran on torch's OpenMP team where it has one
        g = ops.verify(logits, tokens, draft_probs=q, seed=seed, offset=offset, **kw)
    finally:
        specdecode.set_num_threads(0)
        specdecode.set_threading(mode)
    for x, y, z in zip(a, e, g):
        assert torch.equal(x, y)
        assert torch.equal(x, z)
    f = ops.verify(logits, tokens, draft_probs=q, seed=seed, offset=offset + 1, **kw)
    assert not torch.equal(a.emitted, f.emitted)


_ISA_SCRIPT = """
import sys, torch
from specdecode import ops
outs = []
# V = 3001 ends in a partial chunk; V = 4352 is 17 whole chunks (the vector loops only).
for v in (3001, 4352):
    g = torch.Generator().manual_seed(5)
    b, n = 16, 5
    logits = torch.randn(b, n, v, generator=g) * 3
    logits[0, 0, ::3] = -float("inf")  # weights that are exactly 0
    logits[1, 0, :] = 50.0  # ties everywhere: the argmax is the first index
    logits[2, 1, :40] = -100.0  # below the exp's flush threshold
    # Chunks far below the row's max: their scales g_c = exp(m_c - M) are tiny or flush to 0.
    logits[7, 0, :512] -= 60.0
    logits[7, 0, 512:768] -= 100.0
    logits[8, 0, 256:512] = -float("inf")  # a chunk with no mass at all
    q = torch.softmax(torch.randn(b, n, v, generator=g) * 2, -1)
    q[3, 0, 7] = 0.0
    tokens = torch.randint(0, v, (b, n), generator=g)
    tokens[4, 1] = int(logits[4, 0].argmax())  # likely accepted: the walk goes deeper
    parents = torch.tensor([-1, 0, 0, 1, 2], dtype=torch.int32).expand(b, n).contiguous()
    fan = torch.tensor([-1, 0, 0, 0, 0], dtype=torch.int32).expand(b, n).contiguous()
    probs = torch.softmax(logits, -1)
    probs[5, 0, 100:200] = 0.0
    bad = logits.clone()
    bad[6, 0, 9] = float("nan")
    bad[9, 0, 300] = float("inf")  # inside a whole chunk
    bad[10, 1, 257] = float("nan")
    # Probability rows with values outside [0, FLT_MAX] inside whole chunks; -0.0 is valid.
    badp = probs.clone()
    badp[11, 0, 300] = -1e-3
    badp[12, 0, 600] = -0.0
    badp[13, 0, 700] = float("inf")
    badp[14, 1, 800] = float("nan")
    badp[15, 0, 900] = -1e-40  # a negative denormal
    cases = [
        (logits, dict(draft_probs=q)),
        (logits, dict(parents=parents, draft_probs=q, top_k=40, top_p=0.8)),
        # Sibling levels >= 1 (a tree node's later sampled children), unmasked and masked.
        (logits, dict(parents=parents, draft_probs=q)),
        (logits, dict(parents=parents, draft_probs=q, temperature=0.7)),
        (logits, dict(parents=fan, draft_probs=q)),  # up to 4 levels at the root
        (logits, dict(parents=fan, draft_probs=q, top_p=0.9)),
        (probs, dict(target_is_logits=False, parents=parents, draft_probs=q)),
        (probs, dict(target_is_logits=False, parents=parents, draft_probs=q, top_k=60)),
        (logits, dict(temperature=0.6)),
        # Deterministic siblings: the correction without the tried tokens (MaskedWeight).
        (logits, dict(parents=parents)),
        (logits, dict(parents=fan, top_p=0.9)),
        (probs, dict(target_is_logits=False, parents=fan)),
        (logits, dict(draft_probs=q, top_p=0.9)),  # top-p after the one-pass scan
        (logits, dict(temperature=0.0)),
        (logits, dict(method="typical")),
        (probs, dict(target_is_logits=False, draft_probs=q)),
        (probs, dict(target_is_logits=False, draft_probs=q, top_k=100)),
        (probs, dict(target_is_logits=False, draft_probs=q, top_p=0.9)),
        (logits.bfloat16(), dict(draft_probs=q.bfloat16())),
        (probs.bfloat16(), dict(target_is_logits=False, draft_probs=q.bfloat16())),
        (logits.half(), dict(draft_probs=q.half())),
        (logits, dict(draft_probs=q.bfloat16())),
        (logits, dict(draft_probs=q, method="block")),
        (logits, dict(draft_probs=torch.softmax(logits * 0.8, -1), method="block", top_p=0.9)),
        (probs, dict(target_is_logits=False, draft_probs=q, method="block", top_k=60)),
        (logits.bfloat16(), dict(draft_probs=q.bfloat16(), method="block")),
        (bad, dict(draft_probs=q)),
        (badp, dict(target_is_logits=False, draft_probs=q)),
    ]
    for t, kw in cases:
        r = ops.verify(t, tokens, seed=torch.arange(b), offset=1, **kw)
        outs.append(torch.cat([r.emitted.flatten(), r.path.flatten(), r.num_emitted, r.status]))
torch.save(torch.cat(outs), sys.argv[1])
"""


def test_cpu_isa_paths_agree(tmp_path):
    """The baseline, AVX2 and AVX-512 row loops (capped with SPECDECODE_CPU_ISA; "auto" is the
    widest this CPU has) must give identical tokens, as the GPU must."""
    import subprocess

    results = []
    for isa in ("baseline", "avx2", "auto"):
        env = dict(os.environ, SPECDECODE_CPU_ISA=isa)
        out = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(out)], env=env, check=True)
        results.append(torch.load(out))
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], results[2])
    # The last case's status flags: rows 11, 13, 14 (at its node 1) and 15 are flagged, 12 is not.
    status = results[2][-16:]
    assert [bool(s) for s in status[11:16].tolist()] == [True, False, True, True, True]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_equal_float_of_the_same_values(dtype):
    gen = torch.Generator().manual_seed(91)
    b, n, v = 32, 4, 1000
    logits = torch.randn(b, n, v, generator=gen).to(dtype)
    q = torch.softmax(torch.randn(b, n, v, generator=gen), -1).to(dtype)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    a = ops.verify(logits, tokens, draft_probs=q, seed=seeds(b), offset=0, top_k=100)
    c = ops.verify(
        logits.float(), tokens, draft_probs=q.float(), seed=seeds(b), offset=0, top_k=100
    )
    for x, y in zip(a, c):
        assert torch.equal(x, y)


@pytest.mark.parametrize("v", [32000, 128256, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_vocabulary_smoke(v, dtype):
    gen = torch.Generator().manual_seed(v)
    b, k = 2, 3
    logits = (torch.randn(b, k + 1, v, generator=gen) * 4).to(dtype)
    q = torch.softmax(torch.randn(b, k + 1, v, generator=gen) * 4, -1).to(dtype)
    tokens = torch.randint(0, v, (b, k + 1), generator=gen)
    tokens[:, 1] = logits[:, 0].float().argmax(-1)
    res = ops.verify(logits, tokens, draft_probs=q, seed=seeds(b), offset=0, top_k=40, top_p=0.95)
    assert int(res.status.abs().sum()) == 0
    assert bool(((res.emitted >= -1) & (res.emitted < v)).all())
    greedy = ops.verify(logits, tokens, seed=0, offset=0, method="greedy")
    assert greedy.num_accepted.tolist() == [
        1
        + int(logits[r, 1].float().argmax() == tokens[r, 2])
        * (1 + int(logits[r, 2].float().argmax() == tokens[r, 3]))
        for r in range(b)
    ]
    s = ops.sample(logits[:, 0].contiguous(), 0.7, 50, 0.9, seed=seeds(b), offset=1)
    kth = logits[:, 0].float().topk(50, -1).values[:, -1]
    chosen = logits[:, 0].float().gather(1, s.tokens.long().unsqueeze(1)).squeeze(1)
    assert bool((chosen >= kth).all())


# ---- validation --------------------------------------------------------------------------------


def test_validation_errors_name_the_argument():
    logits = torch.randn(2, 3, 10)
    tokens = torch.ones(2, 3, dtype=torch.int32)
    good = dict(seed=0, offset=0)
    cases = [
        (dict(target=logits.double()), TypeError, "target"),
        (dict(target=logits[:, :, ::2]), ValueError, "target"),
        (dict(target=torch.randn(2, 10)), ValueError, "target"),
        (dict(tokens=tokens.float()), TypeError, "tokens"),
        (dict(tokens=torch.ones(2, 4, dtype=torch.int32)), ValueError, "tokens"),
        (dict(tokens=torch.full((2, 3), 10)), ValueError, "tokens"),
        (dict(parents=torch.tensor([[-1, 0, 2], [-1, 0, 1]])), ValueError, "parents"),
        (dict(draft_probs=torch.rand(2, 3, 11)), ValueError, "draft_probs"),
        (dict(draft_probs=torch.rand(2, 3, 10).double()), TypeError, "draft_probs"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=torch.tensor([1.0, float("nan")])), ValueError, "temperature"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(top_k=1.5), TypeError, "top_k"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=torch.ones(3)), ValueError, "top_p"),
        (dict(seed=torch.zeros(2)), TypeError, "seed"),
        (dict(num_nodes=torch.tensor([0, 3], dtype=torch.int32)), ValueError, "num_nodes"),
        (dict(method="fast"), ValueError, "method"),
        (dict(method="relaxed"), ValueError, "eps"),
        (dict(method="topk_accept"), ValueError, "topk_accept"),
        (dict(allow=torch.ones(2, 3)), TypeError, "allow"),
        (dict(max_depth=0), ValueError, "max_depth"),
        (dict(target_is_logits=False, temperature=0.5), ValueError, "temperature"),
    ]
    for change, exc, name in cases:
        kw = dict(good)
        kw.update(change)
        t = kw.pop("target", logits)
        tok = kw.pop("tokens", tokens)
        if "target_is_logits" in kw:
            t = torch.rand(2, 3, 10)
        with pytest.raises(exc, match=name):
            ops.verify(t, tok, **kw)
    with pytest.raises(ValueError, match="logits"):
        ops.sample(torch.randn(3, 0), seed=0, offset=0)


def tree_limit_cases():
    """(target, tokens, parents, max_depth) of rows that break a limit only off most walks: 70
    children under the root (MAX_SIBLINGS is 64) and a chain of depth 3 with max_depth 1."""
    k = 70
    wide = (
        torch.zeros(1, k + 1, 80),
        torch.cat([torch.zeros(1, 1), torch.arange(k)[None]], 1).int(),
        torch.tensor([[-1] + [0] * k], dtype=torch.int32),
        None,
    )
    deep = (torch.zeros(1, 4, 2), torch.tensor([[0, 1, 1, 1]], dtype=torch.int32), None, 1)
    return wide, deep


def test_tree_limits_are_checked_whole_not_where_the_walk_goes():
    """Whether a row is refused depends on its tree, not on the seed: the walk used to flag a
    limit only where its draws reached it. Greedy rows keep no tried siblings: no limit there."""
    (t, tok, par, _), (ct, ctok, _, depth) = tree_limit_cases()
    for seed in range(6):
        with pytest.raises(ValueError, match="children"):
            ops.verify(t, tok, parents=par, seed=seed, offset=0, temperature=1.0)
        r = ops.verify(t, tok, parents=par, seed=seed, offset=0, temperature=1.0, check=False)
        assert r.status.tolist() == [128] and r.num_emitted.tolist() == [0]
        with pytest.raises(ValueError, match="max_depth"):
            ops.verify(ct, ctok, seed=seed, offset=0, max_depth=depth, temperature=1.0)
    assert ops.verify(t, tok, parents=par, seed=0, offset=0, temperature=0.0).status.tolist() == [0]
    assert ops.verify(t, tok, parents=par, seed=0, offset=0, method="typical").status.tolist() == [
        0
    ]


@pytest.mark.parametrize("batch", [1, 64, 65, 300])
def test_per_sequence_values_are_checked_at_every_batch_size(batch):
    """The range checks of the per-sequence parameters take Python numbers for a few rows and
    numpy for many: both refuse a NaN or an out-of-range value anywhere in the batch."""
    logits = torch.randn(batch, 1, 12)
    tokens = torch.zeros(batch, 1, dtype=torch.int32)
    last = batch - 1
    for name, good, bad_values in (
        ("temperature", torch.ones(batch), (float("nan"), -0.5, float("inf"))),
        ("top_p", torch.full((batch,), 0.9), (float("nan"), 0.0, 1.5)),
        ("top_k", torch.zeros(batch, dtype=torch.int64), (-1,)),
    ):
        ops.sample(logits[:, 0], **{name: good}, seed=0, offset=0)
        for value in bad_values:
            wrong = good.clone()
            wrong[last] = value
            with pytest.raises(ValueError, match=name):
                ops.verify(logits, tokens, **{name: wrong}, seed=0, offset=0)


def test_numpy_inputs_and_int32_seeds():
    logits = np.random.default_rng(0).standard_normal((3, 2, 20)).astype(np.float32)
    tokens = np.ones((3, 2), dtype=np.int64)
    a = ops.verify(logits, tokens, seed=np.arange(3, dtype=np.int32), offset=5)
    b = ops.verify(
        torch.from_numpy(logits),
        torch.from_numpy(tokens),
        seed=torch.arange(3),
        offset=torch.full((3,), 5),
    )
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("big_endian", [True, False])
def test_numpy_dtypes_torch_cannot_read_are_type_errors(big_endian):
    """A big-endian or object numpy array raised torch.from_numpy's own ValueError/TypeError,
    which named neither the argument nor the dtypes it takes."""
    logits = np.random.default_rng(0).standard_normal((2, 3, 10)).astype(np.float32)
    tokens = np.ones((2, 3), dtype=np.int64)

    def bad(a):
        return a.astype(a.dtype.newbyteorder(">") if big_endian else object)

    def got(a):
        if not big_endian:
            return "object"
        return re.escape(f"{bad(a).dtype.str} ({a.dtype.name} in non-native byte order)")

    floats = "float32, float16 or bfloat16"
    cases = [
        ("target", dict(target=bad(logits)), floats, got(logits)),
        ("tokens", dict(tokens=bad(tokens)), "int32 or int64", got(tokens)),
        ("draft_probs", dict(draft_probs=bad(logits)), floats, got(logits)),
        ("seed", dict(seed=bad(np.arange(2))), "an int32 or int64 array", got(np.arange(2))),
        ("top_p", dict(top_p=bad(np.ones(2, np.float32))), "a float array", got(logits)),
    ]
    if not big_endian:  # uint8 has no byte order
        cases.append(
            ("allow", dict(allow=bad(np.ones((2, 3), np.uint8))), r"bool \(or uint8\)", "object")
        )
    for name, change, expected, dtype_text in cases:
        kw = dict(target=logits, tokens=tokens, seed=0, offset=0, temperature=1.0)
        kw.update(change)
        message = f"{name}: expected {expected}, got a numpy array of dtype {dtype_text}"
        with pytest.raises(TypeError, match=message):
            ops.verify(kw.pop("target"), kw.pop("tokens"), **kw)
    message = f"logits: expected {floats}, got a numpy array of dtype {got(logits)}"
    with pytest.raises(TypeError, match=message):
        ops.sample(bad(logits[:, 0]), seed=0, offset=0)
    with pytest.raises(TypeError, match=message):
        ops.sampling_probs(bad(logits[:, 0]))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"tokens": [[0, 1, True]]}, "tokens"),
        ({"parents": [[-1, 0, True]]}, "parents"),
        ({"top_k": [5, np.True_]}, "top_k"),
        ({"temperature": [1.0, True]}, "temperature"),
        ({"seed": [0, False]}, "seed"),
    ],
)
def test_lists_holding_bools_are_refused(kwargs, name):
    """torch.tensor([0, True]) is int64 with True as 1; a bool is refused, as a scalar one is."""
    args = {"tokens": [[0, 1, 2]] * 2, "seed": 0, "offset": 0, **kwargs}
    logits = torch.zeros(2, 3, 8)
    with pytest.raises(TypeError, match=f"{name}: expected numbers, got a list holding a bool"):
        ops.verify(logits, args.pop("tokens"), **args)


def test_lists_convert_by_their_values_as_the_tensor_path_would():
    """A list is converted by the values it holds: its numpy scalars used to decide the dtype,
    so a target list of numpy float64s was refused (float64) and token lists of numpy int8 /
    uint8 scalars too, while the same values as Python numbers passed."""
    logits = torch.randn(2, 3, 10)
    tokens = [[0, 1, 2], [0, 3, 4]]
    want = ops.verify(logits, torch.tensor(tokens), seed=[1, 2], offset=0, temperature=0.5)
    as_float64 = [[[np.float64(v) for v in row] for row in b] for b in logits.tolist()]
    for target, toks in (
        (logits.tolist(), tokens),
        (as_float64, tokens),
        (logits, [[np.uint8(t) for t in row] for row in tokens]),
        (logits, [[0, np.int8(1), 2], [0, np.int16(3), np.int64(4)]]),
    ):
        got = ops.verify(target, toks, seed=[1, 2], offset=0, temperature=[0.5, np.float32(0.5)])
        for x, y in zip(want, got):
            assert torch.equal(x, y)
    # An empty list is an empty array of the argument's kind (torch would make it float32).
    empty = ops.verify(
        torch.zeros(0, 3, 10), torch.zeros(0, 3, dtype=torch.int32), seed=[], offset=[], top_k=[]
    )
    assert empty.emitted.shape == (0, 3)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        # As a float tensor is refused for token ids, so is a float in a list of them.
        (
            {"tokens": [[0, 1.0, 2], [0, 3, 4]]},
            TypeError,
            "tokens: expected int32 or int64, got a list holding a float",
        ),
        (
            {"tokens": [[0, np.float64(1), 2], [0, 3, 4]]},
            TypeError,
            "tokens: expected int32 or int64, got a list holding a float",
        ),
        (
            {"parents": [[-1, 0, 1.0], [-1, 0, 1]]},
            TypeError,
            "parents: expected int32 or int64, got a list holding a float",
        ),
        (
            {"seed": [0.0, 1.0]},
            TypeError,
            "seed: expected an int32 or int64 array, got a list holding a float",
        ),
        (
            {"num_nodes": [1.0, 2]},
            TypeError,
            "num_nodes: expected an int32 or int64 array, got a list holding a float",
        ),
        # As an int tensor is refused for logits and probabilities, so is a list of only ints.
        (
            {"target": [[[0] * 9 + [1]] * 3] * 2},
            TypeError,
            r"target: expected float32, float16 or bfloat16, got a list of ints \(write 1.0",
        ),
        (
            {"draft_probs": [[[0] * 9 + [1]] * 3] * 2},
            TypeError,
            "draft_probs: expected float32, float16 or bfloat16, got a list of ints",
        ),
        # A bool among floats was a silent 1.0.
        (
            {"target": [[[0.5] * 9 + [True]] * 3] * 2},
            TypeError,
            "target: expected numbers, got a list holding a bool",
        ),
        # None in a list was a RuntimeError from torch that named no argument.
        (
            {"tokens": [[0, None, 2], [0, 3, 4]]},
            ValueError,
            "tokens: cannot make an array from the given list",
        ),
        ({"seed": [np.uint64(1), 2]}, ValueError, "seed: cannot make an array from the given list"),
        (
            {"tokens": [[0, 1j, 2], [0, 3, 4]]},
            TypeError,
            "tokens: expected int32 or int64, got a list holding a complex",
        ),
    ],
)
def test_list_kind_errors(kwargs, error, message):
    args = {"target": torch.randn(2, 3, 10), "tokens": [[0, 1, 2], [0, 3, 4]], "seed": 0}
    args.update(kwargs)
    if "draft_probs" in args:
        args["temperature"] = 1.0
    with pytest.raises(error, match=message):
        ops.verify(args.pop("target"), args.pop("tokens"), offset=0, **args)


def test_sample_and_sampling_probs_take_float_lists_only():
    logits = [[0.5, 1.0, 2.0], [1.0, 0.0, 0.0]]
    want = ops.sample(torch.tensor(logits), seed=0, offset=0)
    got = ops.sample([[np.float64(v) for v in row] for row in logits], seed=0, offset=0)
    assert torch.equal(want.tokens, got.tokens)
    with pytest.raises(
        TypeError, match="logits: expected float32, float16 or bfloat16, got a list of ints"
    ):
        ops.sample([[0, 1, 2]], seed=0, offset=0)
    with pytest.raises(
        TypeError, match="logits: expected float32, float16 or bfloat16, got a list of ints"
    ):
        ops.sampling_probs([[0, 1, 2]], target_is_logits=False)


class _Producer:
    """A DLPack producer that is neither torch nor numpy (and has no __dlpack_device__)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)


def test_other_dlpack_producers():
    logits = np.random.default_rng(1).standard_normal((3, 2, 20)).astype(np.float32)
    tokens = np.ones((3, 2), dtype=np.int64)
    a = ops.verify(logits, tokens, seed=3, offset=5)
    b = ops.verify(_Producer(logits), _Producer(tokens), seed=3, offset=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---- torch.compile -----------------------------------------------------------------------------


def test_torch_compile_aot_eager_matches_eager():
    gen = torch.Generator().manual_seed(100)
    logits = torch.randn(4, 3, 50, generator=gen)
    tokens = torch.randint(0, 50, (4, 3), generator=gen)
    seed = torch.arange(4)

    def step(x, t, s):
        r = ops.verify(x, t, seed=s, offset=9, top_k=10)
        return r.emitted, r.num_emitted

    compiled = torch.compile(step, backend="aot_eager")
    got = compiled(logits, tokens, seed)
    want = step(logits, tokens, seed)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def draft_rows(x):
        return ops.sampling_probs(x * 2, 0.7, 10, 0.9).probs

    rows = logits[:, 0].contiguous()
    assert torch.equal(torch.compile(draft_rows, backend="aot_eager")(rows), draft_rows(rows))


def test_custom_op_opcheck():
    gen = torch.Generator().manual_seed(101)
    b, n, v = 2, 3, 20
    args = (
        torch.randn(b, n, v, generator=gen),
        torch.randint(0, v, (b, n), generator=gen, dtype=torch.int32),
        None,
        None,
        torch.softmax(torch.randn(b, n, v, generator=gen), -1),
        torch.tensor([True, False]),  # draft_deterministic
        None,
        torch.ones(b),
        torch.zeros(b, dtype=torch.int32),
        torch.ones(b),
        torch.arange(b),
        torch.zeros(b, dtype=torch.int64),
        True,
        0,
        0.0,
        0.0,
        0,
        False,
        n - 1,
        True,
    )
    torch.library.opcheck(torch.ops.specdecode.verify.default, args)


# ---- the final draw's phases (the CUDA split, run on the CPU) ----------------------------------


def test_canonical_chunk_sums_lane_by_lane_equal_the_whole():
    """The CUDA kernels of the final draw take a chunk's canonical sum with one thread per lane
    (src/specdecode/verify.h, chunk_lane_sum and combine_lanes); it must be chunk_sum's number
    bit for bit, on values whose sums depend on the order of the additions."""
    gen = torch.Generator().manual_seed(7)
    for v in (1, 7, 8, 9, 255, 256, 257, 1000, 4352):
        values = torch.randn(v, generator=gen) * torch.exp(torch.randn(v, generator=gen) * 8)
        values[::5] = values[::5].abs() * 1e-30
        chunks = -(-v // 256)
        whole = torch.empty(chunks)
        lanes = torch.empty(chunks)
        _C.canonical_chunk_sums(values, whole, False)
        _C.canonical_chunk_sums(values, lanes, True)
        assert torch.equal(whole.view(torch.int32), lanes.view(torch.int32)), v
    # The order matters on these values: a plain running sum differs from the canonical one.
    values = torch.randn(4352, generator=gen) * torch.exp(torch.randn(4352, generator=gen) * 8)
    whole = torch.empty(17)
    _C.canonical_chunk_sums(values, whole, False)
    running = [float(np.cumsum(values[c * 256 : (c + 1) * 256].numpy())[-1]) for c in range(17)]
    assert any(np.float32(r) != w for r, w in zip(running, whole.tolist()))
    with pytest.raises(ValueError, match="out"):
        _C.canonical_chunk_sums(values, torch.empty(3), True)


def final_draw_cases(v: int) -> list:
    """(target, tokens, kwargs) covering every kind of final draw: bonus from a leaf, corrections
    from the residual at level 0 and deeper, from p_L when a residual is empty, from the row
    without the tried tokens, from p itself, greedy, and a NaN in q found by the final residual."""
    gen = torch.Generator().manual_seed(v)
    b, n = 12, 5
    logits = torch.randn(b, n, v, generator=gen) * 3
    logits[0, 0, ::3] = -float("inf")
    if v > 512:
        logits[1, 0, :256] -= 60.0  # a chunk whose scale g_c is tiny
        logits[2, 0, 256:512] = -float("inf")  # a chunk with no mass
    q = torch.softmax(torch.randn(b, n, v, generator=gen) * 2, -1)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    tokens[3, 1] = int(logits[3, 0].argmax())  # likely accepted: a deeper stop
    probs = torch.softmax(logits, -1)
    chain_parents = None
    tree = torch.tensor([-1, 0, 0, 0, 1], dtype=torch.int32).expand(b, n).contiguous()
    allow = torch.zeros(b, n, dtype=torch.bool)
    allow[4:6] = True  # these rows reach the leaf: the bonus token
    ones = torch.ones(b, n, v)  # q >= p everywhere: every residual is empty
    bad_q = q.clone()
    bad_q[6, 0, v // 2] = float("nan")
    bad_logits = logits.clone()
    bad_logits[6, 0, tokens[6, 1]] = -float("inf")  # p(x) = 0: rejected, then the NaN is met
    # Chains of each row's most likely tokens, and a draft a little flatter than the target.
    likely = torch.zeros(b, n, dtype=torch.int64)
    likely[:, 1:] = logits[:, :-1].argmax(-1)
    near = torch.softmax(logits * 0.8, -1)
    chain = torch.arange(-1, n - 1, dtype=torch.int32).expand(b, n).contiguous()
    lens = (torch.arange(b, dtype=torch.int32) % n) + 1
    return [
        (logits, tokens, dict(draft_probs=q)),
        (logits, tokens, dict(draft_probs=q, top_k=40, top_p=0.8, temperature=0.7)),
        (logits, tokens, dict(draft_probs=q, parents=tree)),
        (logits, tokens, dict(parents=tree)),
        (logits, tokens, dict(parents=chain_parents, top_p=0.9)),
        (logits, tokens, dict(draft_probs=q, allow=allow)),
        (logits, tokens, dict(parents=tree, allow=allow, top_k=7)),
        (logits, tokens, dict(method="typical", parents=tree)),
        (logits, tokens, dict(method="topk_accept", topk_accept=3)),
        (logits, tokens, dict(method="greedy")),
        (logits, tokens, dict(draft_probs=q, method="relaxed", eps=0.3)),
        (logits, tokens, dict(draft_probs=q, method="relaxed", eps=0.3, correction="target")),
        (probs, tokens, dict(target_is_logits=False, draft_probs=q)),
        (probs, tokens, dict(target_is_logits=False, draft_probs=ones)),
        (probs, tokens, dict(target_is_logits=False, draft_probs=ones, parents=tree)),
        (probs, tokens, dict(target_is_logits=False, parents=tree)),
        (logits.bfloat16(), tokens, dict(draft_probs=q.bfloat16(), parents=tree)),
        (logits.half(), tokens, dict(draft_probs=q.half())),
        # Block verification: random chains (early p = 0), chains of likely drafts (every tau,
        # corrections from scaled residuals at every node), q >= p (empty residuals: h = 0 and
        # the correction from p itself), chains given through parents with variable lengths.
        (logits, tokens, dict(draft_probs=q, method="block")),
        (logits, likely, dict(draft_probs=near, method="block", top_p=0.9, temperature=0.8)),
        (logits, likely, dict(draft_probs=near, method="block", parents=chain, num_nodes=lens)),
        (probs, likely, dict(target_is_logits=False, draft_probs=ones, method="block")),
        (logits.bfloat16(), likely, dict(draft_probs=near.bfloat16(), method="block")),
        (bad_logits, tokens, dict(draft_probs=bad_q)),
    ]


@pytest.mark.parametrize("v", [50, 3001, 4352])
def test_final_draw_in_slices_equals_one_pass(monkeypatch, v):
    """The CUDA backend takes the final draw's chunk sums in slices of the vocabulary (one thread
    block each, eight threads per chunk) and picks in a third kernel. The CPU runs the same
    phase functions with the same lane-by-lane arithmetic when asked (_CPU_FINAL_SLICES); every
    slice count must give the tokens of the production path, which takes them in one pass."""
    from specdecode._ops import verify as verify_module

    b = 12
    cases = final_draw_cases(v)
    for i, (target, tokens, kw) in enumerate(cases):
        monkeypatch.setattr(verify_module, "_CPU_FINAL_SLICES", 0)
        want = ops.verify(target, tokens, seed=seeds(b), offset=i, **kw)
        if i == len(cases) - 1:
            # The NaN in q is met by the final residual's sums (phase 2), flagged in phase 3.
            assert int(want.status[6]) & ops.STATUS_BAD_DRAFT
            assert int(want.num_emitted[6]) == int(want.num_accepted[6])
        for slices in (1, 2, 3, 7, 64, 2048):
            monkeypatch.setattr(verify_module, "_CPU_FINAL_SLICES", slices)
            got = ops.verify(target, tokens, seed=seeds(b), offset=i, **kw)
            for x, y in zip(want, got):
                assert torch.equal(x, y), (v, i, slices, kw.keys())
    for slices in (0, 5):
        monkeypatch.setattr(verify_module, "_CPU_FINAL_SLICES", slices)
        logits = torch.randn(7, 1, v, generator=torch.Generator().manual_seed(3))
        s = ops.sample(logits[:, 0], 0.9, 0, 0.95, seed=seeds(7), offset=2)
        if slices == 0:
            first = s.tokens
        else:
            assert torch.equal(first, s.tokens)
    monkeypatch.setattr(verify_module, "_CPU_FINAL_SLICES", -1)
    with pytest.raises(ValueError, match="final_slices"):
        ops.verify(torch.randn(1, 2, v), torch.zeros(1, 2, dtype=torch.int32), seed=0, offset=0)


@pytest.mark.parametrize("v", [3001, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_keeps_exactly_the_k_largest(v, dtype):
    """The CPU selects the k-th largest logit among the values above a bound from block maxima
    (src/verify_cpu_exec.inc, kth_largest). Rows: k tokens on top with a tie at the k-th value,
    every other token only a little lower, so a threshold one value too low admits tokens that
    would be drawn and one too high drops kept tokens that would be missed."""
    gen = torch.Generator().manual_seed(v + 7)
    b = 512
    for k in (1, 7, 50, 600, 1000):
        row = torch.full((v,), -0.7)
        row += torch.rand(v, generator=gen) * 0.01
        top = torch.randperm(v, generator=gen)[: k + 1]
        row[top] = (torch.rand(k + 1, generator=gen) * 0.01).sort(descending=True).values
        row[top[k]] = row[top[k - 1]]  # a tie at the k-th value: both are kept
        row = row.to(dtype)
        kth = row.float().topk(k).values[-1]
        allowed = row.float() >= kth
        x = row.expand(b, v).contiguous()
        got = ops.sample(x, top_k=k, seed=seeds(b), offset=1).tokens.long()
        assert bool(allowed[got].all()), k
        if int(allowed.sum()) <= 8:
            assert set(got.tolist()) == set(torch.nonzero(allowed).flatten().tolist()), k
        # As the first row of a chain, through verify (the walk's prepare_row).
        probs = torch.softmax(row.float(), -1).expand(64, v).contiguous()
        res = ops.sample(probs, top_k=k, seed=seeds(64), offset=2, target_is_logits=False)
        assert bool(allowed[res.tokens.long()].all()), k


def top_p_rows(v: int) -> dict:
    """Rows of several shapes for the top-p search: flat, a few heavy tokens, a power law, ties
    at the threshold, a chunk whose scale underflows, and all mass on one token."""
    gen = torch.Generator().manual_seed(v)
    flat = torch.randn(v, generator=gen) * 3
    peaky = torch.randn(v, generator=gen) * 3
    peaky[torch.randperm(v, generator=gen)[:12]] += 25
    ranks = torch.randperm(v, generator=gen).float() + 1
    zipf = -1.1 * torch.log(ranks) + torch.randn(v, generator=gen) * 0.3
    ties = torch.randint(0, 4, (v,), generator=gen).float()
    far = torch.randn(v, generator=gen) * 2
    far[: v // 2] -= 70.0
    one = torch.full((v,), -1e4)
    one[v // 3] = 0.0
    return dict(flat=flat, peaky=peaky, zipf=zipf, ties=ties, far=far, one=one)


def nucleus_row(v: int, seed: int, top_k: int = 0) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(probabilities [v], top_p, the nucleus as a bool [v]) for a row whose top-p boundary is
    sharp: 8 heavy tokens, 24 middle tokens of about 1.5 % each (jittered, so that they differ in
    their low bits and the search must tell them apart), the rest light; top_p lands half-way
    between two middle tokens' cumulative masses, so the nucleus (the tokens of weight >= the
    threshold of the definition: the largest t whose kept mass is >= top_p of the mass after
    top-k) is clear of rounding.
    """
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(v, generator=gen, dtype=torch.float64) * 2e-6
    order = torch.randperm(v, generator=gen)
    heavy, middle = order[:8], order[8:32]
    p[heavy] = 0.05 * (1 + 0.2 * torch.rand(8, generator=gen, dtype=torch.float64))
    p[middle] = 0.015 * (1 + 0.05 * torch.rand(24, generator=gen, dtype=torch.float64))
    p = (p / p.sum()).float()
    desc = torch.sort(p.double(), descending=True).values
    cum = torch.cumsum(desc, 0)
    k = 8 + 13  # the nucleus ends at the 14th middle token
    top_p = float((cum[k - 1] + cum[k]) / 2 / cum[(top_k or v) - 1])
    return p, top_p, p >= desc[k].float()


@pytest.mark.parametrize("v", [3001, 20000])
@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("top_k", [0, 28])
def test_top_p_keeps_exactly_the_nucleus(v, logits, top_k):
    """Every token of the nucleus is drawn and no other: a top-p threshold off by one weight
    would drop a middle token (about 30 expected draws of 1024) or add one. The nucleus comes from
    the definition in float64 here, independent of the native search."""
    b = 1024
    for seed in range(2):
        p, top_p, nucleus = nucleus_row(v, seed, top_k)
        row = torch.log(p) if logits else p
        x = row.expand(b, v).contiguous()
        got = ops.sample(
            x,
            top_k=top_k,
            top_p=top_p,
            seed=seeds(b, 17 * seed),
            offset=0,
            target_is_logits=logits,
        ).tokens.long()
        drawn = torch.zeros(v, dtype=torch.bool)
        drawn[got] = True
        assert torch.equal(drawn, nucleus), (v, logits, top_k, seed)


@pytest.mark.parametrize("v", [16, 3001])
def test_one_hot_draft_distributions_verify_as_deterministic_drafts(v):
    """A chain verified with the one-hot law of each node's child as draft_probs makes, seed for
    seed, the accept / reject decisions of the same chain verified as deterministic drafts:
    accept x when u < p(x) (u q(x) < p(x) with q(x) = 1). The correction is drawn from the same
    law (max(p - q, 0) is p with x zeroed) by the same uniform, but the two paths form its
    cumulative sums in different units (normalised residuals against raw weights), so a uniform
    within rounding of a boundary between two tokens picks the neighbour: 17 rows in about
    255,000 corrections over 40 seeds on x86, and this test's seeds under another torch's
    randn on aarch64 (session 27). Such rows are allowed, a few per batch, and must still avoid x.
    (A batch mixing such drafts with sampled ones says so directly with draft_deterministic,
    which gives the deterministic path's tokens exactly.)"""
    gen = torch.Generator().manual_seed(v)
    b, n = 2048, 4
    for kw in (dict(), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8)):
        rows = torch.randn(8, n, v, generator=gen) * 2
        chain = torch.randint(0, v, (8, n), generator=gen)
        # Each draft made likely (more so from row to row), so that every depth is reached.
        for i in range(n - 1):
            rows[torch.arange(8), i, chain[:, i + 1]] += 8.0 + torch.arange(8) / 2
        target = rows.repeat(b // 8, 1, 1).contiguous()
        tokens = chain.repeat(b // 8, 1).to(torch.int32).contiguous()
        q = torch.zeros(b, n, v)
        for i in range(n - 1):
            q[torch.arange(b), i, tokens[:, i + 1].long()] = 1.0
        s = seeds(b)
        plain = ops.verify(target, tokens, seed=s, offset=3, **kw)
        one_hot = ops.verify(target, tokens, draft_probs=q, seed=s, offset=3, **kw)
        for name in ("num_accepted", "num_emitted", "path", "status"):
            assert torch.equal(getattr(plain, name), getattr(one_hot, name)), (name, kw)
        last = plain.num_emitted.long() - 1
        rows = torch.arange(b)
        differ = plain.emitted[rows, last] != one_hot.emitted[rows, last]
        # Everything before the correction or bonus token is the accepted path, equal above.
        assert torch.equal(plain.emitted[~differ], one_hot.emitted[~differ]), kw
        assert int(differ.sum()) <= 4, (int(differ.sum()), kw)
        # Only a correction (a rejection, not a bonus) can differ, and neither side emits the
        # rejected draft token.
        assert bool((plain.num_accepted[differ] < n - 1).all()), kw
        rejected = tokens[rows, plain.num_accepted.long().clamp(max=n - 2) + 1]
        for res in (plain, one_hot):
            assert bool((res.emitted[rows, last][differ] != rejected[differ]).all()), kw
        assert int(plain.num_accepted.max()) == n - 1, kw


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(temperature=0.7, top_k=9),
        dict(top_p=0.8),
        dict(method="relaxed", eps=0.3),
        dict(method="greedy"),
        dict(method="typical"),
    ],
)
def test_draft_deterministic_rows_verify_as_without_draft_probs(kw):
    """A batch mixing sampled and deterministic drafts (CombinedDrafter's): each sequence flagged
    in draft_deterministic gives, seed for seed, what it gives verified with draft_probs=None,
    trees with deterministic siblings included, though its draft rows are NaN (never read: no
    status); every other sequence what it gives with the draft rows."""
    gen = torch.Generator().manual_seed(41)
    b, n, v = 64, 7, 40
    target = torch.randn(b, n, v, generator=gen) * 2
    tokens = torch.randint(0, v, (b, n), generator=gen).to(torch.int32)
    # Make the drafts likely so that the walks go deep and meet several siblings.
    for i in range(1, n):
        target[torch.arange(b), (i - 1) // 2, tokens[:, i].long()] += 2.5
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 2], dtype=torch.int32).expand(b, n).contiguous()
    q = torch.softmax(torch.randn(b, n, v, generator=gen) * 2, -1)
    flagged = torch.rand(b, generator=gen) < 0.5
    q_mixed = q.clone()
    q_mixed[flagged] = float("nan")
    s = seeds(b)
    mixed = ops.verify(
        target,
        tokens,
        parents=parents,
        draft_probs=q_mixed,
        draft_deterministic=flagged,
        seed=s,
        offset=5,
        **kw,
    )
    plain = ops.verify(target, tokens, parents=parents, seed=s, offset=5, **kw)
    sampled = ops.verify(target, tokens, parents=parents, draft_probs=q, seed=s, offset=5, **kw)
    assert int(mixed.status.abs().sum()) == 0
    for name, x, p_, q_ in zip(mixed._fields, mixed, plain, sampled):
        assert torch.equal(x[flagged], p_[flagged]), (name, kw)
        assert torch.equal(x[~flagged], q_[~flagged]), (name, kw)
    if kw.get("method", "exact") in ("exact", "relaxed"):
        # The two laws differ, so some sequence must tell a reading of q from the deterministic
        # rule (else this test could not catch the flag being ignored or misapplied).
        assert not torch.equal(plain.emitted, sampled.emitted)
    # A scalar flags every sequence; uint8 works as bool.
    every = ops.verify(
        target,
        tokens,
        parents=parents,
        draft_probs=q_mixed,
        draft_deterministic=True,
        seed=s,
        offset=5,
        **kw,
    )
    as_uint8 = ops.verify(
        target,
        tokens,
        parents=parents,
        draft_probs=q_mixed,
        draft_deterministic=flagged.to(torch.uint8),
        seed=s,
        offset=5,
        **kw,
    )
    for x, p_ in zip(every, plain):
        assert torch.equal(x, p_)
    for x, y in zip(mixed, as_uint8):
        assert torch.equal(x, y)


def test_draft_deterministic_refuses_bad_input():
    target = torch.randn(3, 2, 10)
    tokens = torch.ones(3, 2, dtype=torch.int32)
    q = torch.full((3, 2, 10), 0.1)
    with pytest.raises(ValueError, match="draft_deterministic: only meaningful with draft_probs"):
        ops.verify(
            target, tokens, draft_deterministic=torch.ones(3, dtype=torch.bool), seed=0, offset=0
        )
    with pytest.raises(ValueError, match=r"draft_deterministic: expected a bool or shape \[B\]"):
        ops.verify(
            target,
            tokens,
            draft_probs=q,
            draft_deterministic=torch.ones(2, dtype=torch.bool),
            seed=0,
            offset=0,
        )
    with pytest.raises(TypeError, match="draft_deterministic: expected bool"):
        ops.verify(
            target, tokens, draft_probs=q, draft_deterministic=torch.ones(3), seed=0, offset=0
        )
    with pytest.raises(TypeError, match="draft_deterministic: expected"):
        ops.verify(target, tokens, draft_probs=q, draft_deterministic=1, seed=0, offset=0)


def threshold_of_definition(w: np.ndarray, wanted: float) -> float:
    """The largest weight t whose mass of weights >= t is at least `wanted`, in float64."""
    desc = np.sort(w.astype(np.float64))[::-1]
    return float(desc[int(np.searchsorted(np.cumsum(desc), wanted))])


@pytest.mark.parametrize("v", [3001, 128256])
def test_top_p_histograms_cut_the_kernels_passes(v):
    """The CUDA kernel's top-p search takes its first tries from histograms of the weights
    (verify::top_p_locate), counted here by _C.top_p_search_work (the kernel's steps on one CPU
    thread). With and without them the search must end on the definition's threshold (top_p set
    half-way between two cumulative masses, clear of rounding), and with them it must take fewer
    passes over the row (tries + histograms, each a block-wide pass and barriers on the GPU): a
    dozen at most where the settling search alone takes 20 to 32, and on flat rows of a large
    vocabulary fewer chunk reads too (under 6 reads of the row against 6 to 28;
    bench/top_p_work.py has the counts). A row whose largest weight holds `wanted` takes none."""
    chunks = -(-v // 256)
    for name, x in top_p_rows(v).items():
        w = torch.exp(x - x.max()).numpy()
        desc = np.sort(w.astype(np.float64))[::-1]
        cum = np.cumsum(desc)
        for top_p in (0.3, 0.9, 0.97):
            k = int(np.searchsorted(cum, top_p * cum[-1]))
            k = min(max(k, 1), v - 1)
            wanted = (cum[k - 1] + cum[k]) / 2
            want = threshold_of_definition(w, wanted)
            got = {}
            for histograms in (False, True):
                bits, tries, passes, reads = _C.top_p_search_work(w, wanted, histograms)
                got[histograms] = (tries + passes, reads)
                t = float(np.array([bits], dtype=np.uint32).view(np.float32)[0])
                assert t == want, (name, top_p, histograms, t, want)
                assert histograms or passes == 0
            if desc[0] >= wanted:
                # The largest weight alone holds `wanted`: no pass at all.
                assert got[True] == (0, 0), (name, top_p)
                continue
            (plain_passes, plain_reads), (hist_passes, hist_reads) = got[False], got[True]
            # kTopPLevels histograms and a few tries at the edges of the buckets they name.
            assert hist_passes <= 12, (name, top_p, got)
            if plain_passes >= 20:
                assert 3 * hist_passes <= plain_passes, (name, top_p, got)
            if v == 128256 and top_p >= 0.9 and name in ("flat", "zipf", "ties", "far"):
                assert hist_reads < 6 * chunks <= plain_reads, (name, top_p, got)


def test_top_p_search_work_refuses_bad_rows():
    w = np.ones(300, dtype=np.float32)
    for bad, match in (
        (np.array([1.0, -1.0], dtype=np.float32), "finite values >= 0"),
        (np.array([1.0, np.nan], dtype=np.float32), "finite values >= 0"),
        (np.array([1.0, np.inf], dtype=np.float32), "finite values >= 0"),
        (np.zeros(5, dtype=np.float32), "at least one value > 0"),
        (np.zeros(0, dtype=np.float32), "1 <= V"),
    ):
        with pytest.raises(ValueError, match=match):
            _C.top_p_search_work(bad, 0.5, True)
    for wanted in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="wanted"):
            _C.top_p_search_work(w, wanted, True)
    with pytest.raises(TypeError):
        _C.top_p_search_work(w.astype(np.float64), 0.5, True)


@pytest.mark.parametrize("v", [50, 3001, 128256])
def test_top_p_cached_tries_equal_the_shared_tries(monkeypatch, v):
    """The CPU's top-p search tries each threshold on the row's cached local weights in vector
    loops; the CUDA kernels take the shared verify::top_p_chunk_trial, exps included (which
    _CPU_FINAL_SLICES >= 1 runs on the CPU). Both must find the same threshold: with another the
    kept mass and every draw would change, which 256 seeds per row would show. (That threshold is
    the definition's: test_top_p_keeps_exactly_the_nucleus.)"""
    from specdecode._ops import verify as verify_module

    b = 256
    for name, row in top_p_rows(v).items():
        for kw in (
            dict(top_p=0.5),
            dict(top_p=0.9),
            dict(top_p=0.97, temperature=0.8),
            dict(top_p=0.9, top_k=40),
            dict(top_p=0.3, target_is_logits=False),
        ):
            x = row.expand(b, v).contiguous()
            if not kw.get("target_is_logits", True):
                x = torch.softmax(row, -1).expand(b, v).contiguous()
            got = []
            for slices in (0, 1):
                monkeypatch.setattr(verify_module, "_CPU_FINAL_SLICES", slices)
                got.append(ops.sample(x, seed=seeds(b), offset=3, **kw).tokens)
            assert torch.equal(got[0], got[1]), (name, kw)
            # A chain over the same rows: the top-p search of every row on the walk.
            tokens = torch.randint(0, v, (4, 3), generator=torch.Generator().manual_seed(1))
            t3 = x[:12].reshape(4, 3, v)
            res = []
            for slices in (0, 1):
                monkeypatch.setattr(verify_module, "_CPU_FINAL_SLICES", slices)
                res.append(ops.verify(t3, tokens, seed=seeds(4), offset=5, **kw))
            for a, c in zip(*res):
                assert torch.equal(a, c), (name, kw)


# ---- CUDA --------------------------------------------------------------------------------------


def backend_parity_cases(gen: torch.Generator, v: int, b: int, n: int, dtype: torch.dtype):
    """(logits, tokens, kwargs list) that a second backend must verify with the CPU's tokens:
    every method, draft kind and filter, trees, leaves reached through ``allow`` (the bonus
    token), q = 1 everywhere (every residual empty) and a NaN in q met by the final residual's
    sums. Shared by the GPU test below and tests/test_cuda_emu.py."""
    logits = (torch.randn(b, n, v, generator=gen) * 3).to(dtype)
    q = torch.softmax(torch.randn(b, n, v, generator=gen) * 3, -1).to(dtype)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    parents = torch.tensor([-1, 0, 0] + list(range(1, n - 2)), dtype=torch.int32)
    parents = parents.expand(b, n).contiguous()
    allow = torch.zeros(b, n, dtype=torch.bool)
    allow[: (b + 1) // 2] = True  # these rows reach a leaf: the bonus token
    bad_q = q.clone()
    bad_q[0, 0, v // 2] = float("nan")  # met by the final residual's sums
    deterministic = torch.arange(b) % 3 == 1
    mixed_q = q.clone()
    mixed_q[deterministic] = float("nan")
    near = torch.softmax(logits.float() * 0.8, -1).to(dtype)
    cases = [
        dict(),
        dict(draft_probs=q),
        dict(draft_probs=q, parents=parents, top_k=20, top_p=0.9, temperature=0.7),
        dict(parents=parents, method="typical"),
        dict(method="greedy"),
        dict(draft_probs=q, method="relaxed", eps=0.2),
        dict(draft_probs=q, method="relaxed", eps=0.2, correction="target"),
        dict(parents=parents, top_p=0.9),
        dict(parents=parents, allow=allow),
        dict(draft_probs=torch.ones_like(q), parents=parents),
        dict(draft_probs=bad_q),
        dict(draft_probs=q, temperature=torch.linspace(0.0, 1.5, b)),  # greedy rows among them
        # Sampled and deterministic trees in one batch; the deterministic rows' q is never read.
        dict(draft_probs=mixed_q, draft_deterministic=deterministic, parents=parents),
        # Block verification: chains (and the tree's rows verified as "exact"), a chain of
        # likely drafts with a flatter draft, empty residuals, the NaN met by a residual.
        dict(draft_probs=q, method="block"),
        dict(draft_probs=q, parents=parents, method="block"),
        dict(draft_probs=near, method="block", top_k=20, top_p=0.9, temperature=0.7),
        dict(draft_probs=torch.ones_like(q), method="block"),
        dict(draft_probs=bad_q, method="block"),
    ]
    return logits, tokens, cases


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu_token_for_token(dtype):
    gen = torch.Generator().manual_seed(110)
    # Small batches with large vocabularies take the final draw's sums in many slices (several
    # blocks per sequence); V = 151936 and 50257 end in a partial chunk.
    for v, b, n in ((50, 256, 6), (32000, 8, 5), (151936, 2, 4), (128256, 1, 5), (50257, 3, 6)):
        logits, tokens, cases = backend_parity_cases(gen, v, b, n, dtype)
        for kw in cases:
            cpu = ops.verify(logits, tokens, seed=seeds(b), offset=3, **kw)
            kw_gpu = {k: (x.cuda() if isinstance(x, torch.Tensor) else x) for k, x in kw.items()}
            gpu = ops.verify(logits.cuda(), tokens.cuda(), seed=seeds(b).cuda(), offset=3, **kw_gpu)
            for x, y in zip(cpu, gpu):
                assert torch.equal(x, y.cpu()), (v, kw.keys())
        row = logits[:, 0].contiguous()  # sample takes contiguous [B, V] rows
        s_cpu = ops.sample(row, 0.8, 30, 0.95, seed=seeds(b), offset=1)
        s_gpu = ops.sample(row.cuda(), 0.8, 30, 0.95, seed=seeds(b).cuda(), offset=1)
        assert torch.equal(s_cpu.tokens, s_gpu.tokens.cpu())
        for args in ((0.8, 30, 0.95), (1.0, 0, 1.0), (0.0, 0, 1.0), (0.6, 0, 0.9)):
            p_cpu = ops.sampling_probs(row, *args)
            p_gpu = ops.sampling_probs(row.cuda(), *args)
            assert torch.equal(p_cpu.probs, p_gpu.probs.cpu()), (v, args)
            assert torch.equal(p_cpu.status, p_gpu.status.cpu())
