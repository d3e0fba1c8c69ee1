"""Tests of specdecode.judge: AutoJudge's features, classifier, mismatch mining and decoding."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from reference_engine import greedy_reference, tiny_transformer
from specdecode.drafters import ModelDrafter
from specdecode.judge import (
    MinedMismatches,
    TokenJudge,
    judge_features,
    mine_important_tokens,
    python_code_tokens,
    same_python_code,
)

from specdecode import SpeculativeDecoder, ops

V = 61
H = 64  # the tiny models' hidden size
F = 2 * H + 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_transformer(seed=1)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_transformer(seed=2, layers=1)


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1, 6, 3, 9, 4, 2, 7, 5]
    return [torch.randint(0, V, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


# ---- features ----------------------------------------------------------------------------------


def random_tree(batch: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random trees in the tree format (parents before children, -1 root / padding)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, n), -1, dtype=torch.int32)
    for b in range(batch):
        nodes = int(torch.randint(1, n + 1, (1,), generator=g))
        for i in range(1, nodes):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=g))
    tokens = torch.randint(0, V, (batch, n), generator=g, dtype=torch.int32)
    return tokens, parents


def test_features_read_the_parent_row_and_the_node_row():
    g = torch.Generator().manual_seed(3)
    tokens, parents = random_tree(3, 9, seed=4)
    hidden = torch.randn(3, 9, 5, generator=g)
    logits = 3 * torch.randn(3, 9, V, generator=g)
    logits[0, 0, 7] = -math.inf  # a probability-0 token keeps the features finite
    tokens[0, 1], parents[0, 1] = 7, 0
    f = judge_features(hidden, logits, tokens, parents)
    assert f.shape == (3, 9, 2 * 5 + 3) and f.dtype == torch.float32
    assert torch.isfinite(f).all()
    logp = torch.log_softmax(logits.double(), dim=-1)
    for b in range(3):
        for i in range(9):
            p = int(parents[b, i])
            if p < 0:
                assert (f[b, i] == 0).all()
                continue
            assert torch.equal(f[b, i, :5], hidden[b, p])
            assert torch.equal(f[b, i, 5:10], hidden[b, i])
            lp = max(float(logp[b, p, int(tokens[b, i])]), -100.0)
            entropy = -float(
                torch.where(logp[b, p].isinf(), 0.0, logp[b, p].exp() * logp[b, p]).sum()
            )
            assert float(f[b, i, 10]) == pytest.approx(lp, abs=1e-4)
            assert float(f[b, i, 11]) == pytest.approx(float(logp[b, p].max()) - lp, abs=1e-4)
            assert float(f[b, i, 12]) == pytest.approx(entropy, abs=1e-4)
    assert float(f[0, 1, 10]) == -100.0


def test_features_reject_shapes_that_disagree():
    hidden, logits = torch.zeros(2, 4, 3), torch.zeros(2, 4, V)
    tokens, parents = torch.zeros(2, 4, dtype=torch.int32), torch.full((2, 4), -1)
    with pytest.raises(ValueError, match="hidden, logits"):
        judge_features(hidden[0], logits, tokens, parents)
    with pytest.raises(ValueError, match="logits"):
        judge_features(hidden, logits[:, :3], tokens, parents)
    with pytest.raises(ValueError, match="parents"):
        judge_features(hidden, logits, tokens, parents[:, :3])


# ---- the classifier ----------------------------------------------------------------------------


def separable(m: int = 600, f: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels from a noisy linear rule on features of very different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, f, generator=g) * torch.logspace(-2, 3, f)
    score = x[:, 0] / 0.01 - x[:, 3] / 10 + 0.3 * torch.randn(m, generator=g)
    return x, score > 0.8


def test_fit_learns_a_linear_rule_and_the_threshold_keeps_the_recall():
    x, y = separable()
    judge = TokenJudge.fit(x, y, recall=0.9)
    s = judge.importance(x)
    # The importance ranks the classes apart (AUC near 1).
    auc = (s[y][:, None] > s[~y][None, :]).double().mean()
    assert auc > 0.97
    kept = (s[y] >= judge.threshold).double().mean()
    assert kept >= 0.9
    # As permissive as the recall allows: the lowest important score above the threshold is the
    # largest threshold that keeps the recall (the next one up loses it), and the threshold makes
    # the same decisions on the set while staying clear of every score.
    above = torch.sort(s[y]).values
    largest = float(above[above > judge.threshold][0])
    nxt = float(above[above > largest][0])
    assert (s[y] >= largest).double().mean() >= 0.9 > (s[y] >= nxt).double().mean()
    assert torch.equal(s < judge.threshold, s < largest)
    assert (s - judge.threshold).abs().min() > 0
    # recall 1 accepts no important mismatch of the set.
    strict = judge.with_threshold(judge.threshold_for_recall(x, y, 1.0))
    assert not (strict.importance(x)[y] < strict.threshold).any()


def test_fit_rejects_bad_input():
    x, y = separable(50)
    with pytest.raises(ValueError, match="both classes"):
        TokenJudge.fit(x, torch.zeros(50, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        TokenJudge.fit(x, y.long())
    with pytest.raises(ValueError, match=r"\[M\]"):
        TokenJudge.fit(x, y[:10])
    with pytest.raises(ValueError, match="recall"):
        TokenJudge.fit(x, y, recall=0.0)
    with pytest.raises(ValueError, match="l2"):
        TokenJudge.fit(x, y, l2=-1.0)
    bad = x.clone()
    bad[3, 2] = math.nan
    with pytest.raises(ValueError, match="finite"):
        TokenJudge.fit(bad, y)
    with pytest.raises(ValueError, match=r"\[M, F\]"):
        TokenJudge.fit(x[0], y)


def test_importance_checks_the_feature_width():
    x, y = separable(80)
    judge = TokenJudge.fit(x, y)
    with pytest.raises(ValueError, match="F = 6"):
        judge.importance(torch.zeros(3, 5))
    with pytest.raises(TypeError, match="float"):
        judge.importance(torch.zeros(3, 6, dtype=torch.int64))


def test_constructor_checks_its_parameters():
    w = torch.ones(4)
    with pytest.raises(ValueError, match="scale"):
        TokenJudge(w, 0.0, torch.zeros(4), torch.zeros(4), 0.5)
    with pytest.raises(ValueError, match="mean"):
        TokenJudge(w, 0.0, torch.zeros(3), torch.ones(4), 0.5)
    with pytest.raises(ValueError, match="threshold"):
        TokenJudge(w, 0.0, torch.zeros(4), torch.ones(4), -0.1)
    with pytest.raises(ValueError, match="bias"):
        TokenJudge(w, math.inf, torch.zeros(4), torch.ones(4), 0.5)


def test_save_and_load_round_trip(tmp_path):
    x, y = separable(200)
    judge = TokenJudge.fit(x, y, recall=0.8)
    path = tmp_path / "judge.safetensors"
    judge.save(path)
    back = TokenJudge.load(path)
    assert back.threshold == judge.threshold and back.bias == judge.bias
    assert torch.equal(back.importance(x), judge.importance(x))
    inf = judge.with_threshold(math.inf)
    inf.save(path)
    assert TokenJudge.load(path).threshold == math.inf
    with pytest.raises(FileNotFoundError):
        TokenJudge.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        TokenJudge.load(tmp_path / "junk")
    from safetensors.torch import save_file

    save_file({"weight": torch.ones(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="TokenJudge"):
        TokenJudge.load(tmp_path / "other.safetensors")


def test_allow_masks_the_root_and_padding():
    g = torch.Generator().manual_seed(5)
    tokens, parents = random_tree(4, 7, seed=6)
    hidden, logits = torch.randn(4, 7, H, generator=g), torch.randn(4, 7, V, generator=g)
    weight = torch.randn(F, generator=g)
    judge = TokenJudge(weight, 0.0, torch.zeros(F), torch.ones(F), 0.5)
    allow = judge.allow(hidden, logits, tokens, parents)
    assert allow.dtype == torch.bool and allow.shape == (4, 7)
    expected = judge.importance(judge_features(hidden, logits, tokens, parents)) < 0.5
    assert torch.equal(allow, expected & (parents >= 0))
    assert not judge.with_threshold(0.0).allow(hidden, logits, tokens, parents).any()
    everything = judge.with_threshold(math.inf).allow(hidden, logits, tokens, parents)
    assert torch.equal(everything, parents >= 0)
    with pytest.raises(ValueError, match="hidden size 32"):
        judge.allow(hidden[..., :32], logits, tokens, parents)


# ---- mining ------------------------------------------------------------------------------------


class Recorder:
    """An ``equivalent`` check that records its calls and answers by a fixed rule."""

    def __init__(self, rule) -> None:
        self.rule = rule
        self.calls: list[tuple[list[int], list[int], list[int], bool]] = []

    def __call__(self, prompt, reference, candidate):
        verdict = bool(self.rule(prompt, reference, candidate))
        self.calls.append((prompt, reference, candidate, verdict))
        return verdict


def test_every_mismatch_important_keeps_the_target_responses(target, draft_model):
    prompts = prompts_for(5)
    check = Recorder(lambda *a: False)
    mined = mine_important_tokens(target, draft_model, prompts, check, max_new_tokens=12)
    for p, ref, resp in zip(prompts, mined.references, mined.responses):
        assert ref == greedy_reference(target, p, 12)
        assert resp == ref
    assert len(mined.mismatches) == len(check.calls) > 0
    assert mined.important.all() and mined.important_fraction == 1.0
    # Every position where the draft disagrees with the response is labelled, in order.
    for i, p in enumerate(prompts):
        mine = [m for m in mined.mismatches if m.prompt == i]
        ref = mined.references[i]
        expected = []
        for pos in range(12):
            d = greedy_reference(draft_model, p + ref[:pos], 1)[0]
            if d != ref[pos]:
                expected.append((pos, ref[pos], d))
        assert [(m.position, m.target_token, m.draft_token) for m in mine] == expected


def test_every_mismatch_unimportant_follows_the_draft(target, draft_model):
    prompts = prompts_for(4, seed=1)
    mined = mine_important_tokens(
        target, draft_model, prompts, lambda *a: True, max_new_tokens=10, batch_size=3
    )
    assert not mined.important.any() and len(mined.mismatches) > 0
    # Each swap is kept, and the search re-reads the new response: at the end the draft agrees
    # with every token, i.e. the response is the draft model's own greedy response.
    for p, resp in zip(prompts, mined.responses):
        assert resp == greedy_reference(draft_model, p, 10)


def test_candidates_are_the_response_the_draft_token_and_the_target_continuation(
    target, draft_model
):
    prompts = prompts_for(6, seed=2)
    # An arbitrary but fixed verdict: unimportant when the candidate's token sum is even.
    check = Recorder(lambda prompt, ref, cand: sum(cand) % 2 == 0)
    mined = mine_important_tokens(target, draft_model, prompts, check, max_new_tokens=10)
    assert len(check.calls) == len(mined.mismatches)
    assert 0 < mined.important_fraction < 1
    responses = {}
    for (prompt, ref, cand, verdict), m in zip(check.calls, mined.mismatches):
        i = m.prompt
        assert prompt == prompts[i] and ref == mined.references[i]
        current = responses.get(i, mined.references[i])
        assert cand[: m.position] == current[: m.position]
        assert current[m.position] == m.target_token != m.draft_token == cand[m.position]
        head = prompt + cand[: m.position + 1]
        assert cand[m.position + 1 :] == greedy_reference(target, head, 10 - m.position - 1)
        assert m.important == (not verdict)
        if verdict:
            responses[i] = cand
    for i, resp in enumerate(mined.responses):
        assert resp == responses.get(i, mined.references[i])


def test_mined_features_are_those_of_the_verify_pass(target, draft_model):
    prompts = prompts_for(3, seed=3)
    check = Recorder(lambda *a: False)
    mined = mine_important_tokens(target, draft_model, prompts, check, max_new_tokens=8)
    assert mined.features.shape == (len(mined.mismatches), F)
    for k in (0, len(mined.mismatches) // 2, len(mined.mismatches) - 1):
        m = mined.mismatches[k]
        seq = prompts[m.prompt] + mined.references[m.prompt][: m.position] + [m.draft_token]
        ids = torch.tensor([seq])
        cache = target.new_cache(1, len(seq))
        logits, (hidden,) = target.forward(
            ids, torch.arange(len(seq))[None], cache, output_hidden=[-1]
        )
        n = len(seq) - 1
        tokens = torch.tensor([[0, m.draft_token]])
        f = judge_features(hidden[:, n - 1 :], logits[:, n - 1 :], tokens, torch.tensor([[-1, 0]]))
        torch.testing.assert_close(mined.features[k], f[0, 1], atol=1e-4, rtol=1e-4)


def test_mining_limits_stops_and_selection(target, draft_model):
    prompts = prompts_for(4, seed=4)
    mined = mine_important_tokens(
        target, draft_model, prompts, lambda *a: False, max_new_tokens=12, max_mismatches=2
    )
    for i in range(4):
        assert len([m for m in mined.mismatches if m.prompt == i]) <= 2
    some = mined.select([1, 3])
    assert isinstance(some, MinedMismatches)
    assert {m.prompt for m in some.mismatches} <= {1, 3}
    assert len(some.mismatches) == some.features.shape[0] == some.important.numel()
    # A stop token ends the references and the candidates.
    stop = mined.references[0][3]
    check = Recorder(lambda *a: True)
    stopped = mine_important_tokens(
        target, draft_model, prompts[:1], check, max_new_tokens=12, stop_token_ids=[stop]
    )
    ref = stopped.references[0]
    assert ref[-1] == stop and stop not in ref[:-1]
    for _, _, cand, _ in check.calls:
        assert stop not in cand[:-1]


def test_mining_rejects_bad_input(target, draft_model):
    other_vocab = tiny_transformer(seed=3, vocab_size=V + 1)
    ok = prompts_for(2)
    with pytest.raises(ValueError, match="vocabulary"):
        mine_important_tokens(target, other_vocab, ok, lambda *a: True, max_new_tokens=4)
    with pytest.raises(TypeError, match="callable"):
        mine_important_tokens(target, draft_model, ok, None, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        mine_important_tokens(target, draft_model, [[1], []], lambda *a: True, max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        mine_important_tokens(target, draft_model, [[V]], lambda *a: True, max_new_tokens=4)
    with pytest.raises(TypeError, match="list of prompts"):
        mine_important_tokens(target, draft_model, [1, 2], lambda *a: True, max_new_tokens=4)
    with pytest.raises(ValueError, match="max length"):
        mine_important_tokens(target, draft_model, ok, lambda *a: True, max_new_tokens=1000)
    with pytest.raises(TypeError):
        mine_important_tokens(target, draft_model, ok, lambda *a: True, max_new_tokens=4.0)
    with pytest.raises(TypeError, match="CausalLM"):
        mine_important_tokens(object(), draft_model, ok, lambda *a: True, max_new_tokens=4)


def test_mining_shows_progress(target, draft_model, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name == "tqdm":
            raise ImportError("tqdm hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    mine_important_tokens(
        target, draft_model, prompts_for(2), lambda *a: False, max_new_tokens=6, progress=True
    )
    err = capsys.readouterr().err
    assert "12/12 positions" in err and err.endswith("\n")


# ---- decoding with a judge -----------------------------------------------------------------------


class ConstantJudge:
    """Allows every node (``True``) or none (``False``); records what the engine passed."""

    def __init__(self, value: bool) -> None:
        self.value = value
        self.shapes: list[tuple[Any, ...]] = []

    def allow(self, hidden, logits, tokens, parents):
        self.shapes.append((tuple(hidden.shape), tuple(logits.shape), tuple(tokens.shape)))
        return (parents >= 0) & self.value


def decode(target, draft_model, prompts, judge, k=4, **kw):
    dec = SpeculativeDecoder(
        target, ModelDrafter(draft_model, k=k, sample=False), method="greedy", judge=judge, **kw
    )
    return dec.generate(prompts, max_new_tokens=16, temperature=0.0)


def test_a_judge_that_allows_nothing_is_lossless(target, draft_model):
    prompts = prompts_for(5, seed=5)
    judge = ConstantJudge(False)
    out = decode(target, draft_model, prompts, judge)
    assert out.sequences == [greedy_reference(target, p, 16) for p in prompts]
    assert out.stats.judge_accepted == 0
    assert judge.shapes and all(h[2] == H for h, _, _ in judge.shapes)


def test_a_judge_that_allows_everything_accepts_the_whole_draft(target, draft_model):
    prompts = prompts_for(4, seed=6)
    out = decode(target, draft_model, prompts, ConstantJudge(True))
    plain = decode(target, draft_model, prompts, None)
    assert out.stats.accepted_tokens == out.stats.offered_depth
    assert out.stats.judge_accepted > 0
    assert plain.stats.judge_accepted == 0
    assert out.stats.steps < plain.stats.steps
    # Each step commits the draft's greedy chain and the target's bonus token after it.
    for p, seq in zip(prompts, out.sequences):
        pos, ctx = 0, list(p)
        while pos < 15:
            chain = greedy_reference(draft_model, ctx, min(4, 15 - pos))
            bonus = greedy_reference(target, ctx + chain, 1)
            step = chain + bonus
            assert seq[pos : pos + len(step)] == step[: 16 - pos]
            ctx += step
            pos += len(step)


def test_the_judge_accepted_count_is_the_mismatches_on_the_path(target, draft_model):
    prompts = prompts_for(3, seed=7)
    g = torch.Generator().manual_seed(0)
    judge = TokenJudge(torch.randn(F, generator=g), 0.0, torch.zeros(F), torch.ones(F), 0.5)
    out = decode(target, draft_model, prompts, judge, k=3)
    # Replay: every committed token either is the target's greedy choice after the committed
    # prefix, or a draft token the judge let through (counted).
    mismatches = 0
    for p, seq in zip(prompts, out.sequences):
        for i, tok in enumerate(seq):
            if tok != greedy_reference(target, p + seq[:i], 1)[0]:
                mismatches += 1
    assert mismatches == out.stats.judge_accepted


def test_a_judge_with_tree_drafts(target, draft_model):
    prompts = prompts_for(4, seed=12)

    def tree_decode(judge):
        drafter = ModelDrafter(draft_model, mode="tree", k=3, branch=2, beam=2, max_nodes=8)
        dec = SpeculativeDecoder(target, drafter, method="greedy", judge=judge)
        return dec.generate(prompts, max_new_tokens=16, temperature=0.0)

    assert tree_decode(ConstantJudge(False)).sequences == [
        greedy_reference(target, p, 16) for p in prompts
    ]
    everything, plain = tree_decode(ConstantJudge(True)), tree_decode(None)
    # Every step walks down to a leaf (of the first branch where no child is the argmax), so
    # steps are longer; the count is of mismatches only.
    assert everything.stats.tokens_per_step > plain.stats.tokens_per_step
    assert 0 < everything.stats.judge_accepted <= everything.stats.accepted_tokens


def test_tokens_the_target_agrees_with_are_not_counted_as_judged(target):
    # The target drafting for itself: every draft token is the argmax, nothing is a mismatch.
    out = decode(target, target, prompts_for(3, seed=9), ConstantJudge(True))
    assert out.stats.accepted_tokens > 0 and out.stats.judge_accepted == 0


def test_a_fitted_judge_decodes_in_batches(target, draft_model):
    prompts = prompts_for(8, seed=8)
    mined = mine_important_tokens(
        target, draft_model, prompts, lambda p, r, c: sum(c) % 3 != 0, max_new_tokens=12
    )
    judge = TokenJudge.fit(mined.features, mined.important, recall=0.8)
    batched = decode(target, draft_model, prompts, judge)
    single = [decode(target, draft_model, [p], judge).sequences[0] for p in prompts]
    assert batched.sequences == single
    assert all(len(s) == 16 for s in batched.sequences)


def test_the_engine_checks_the_judge(target, draft_model):
    with pytest.raises(TypeError, match="allow"):
        SpeculativeDecoder(target, judge=object())

    class WrongShape:
        def allow(self, hidden, logits, tokens, parents):
            return torch.ones(tokens.shape[0], dtype=torch.bool)

    with pytest.raises(ValueError, match="allow\\(\\) returned"):
        decode(target, draft_model, prompts_for(2), WrongShape())
    alien = TokenJudge(torch.ones(7), 0.0, torch.zeros(7), torch.ones(7), 0.5)
    with pytest.raises(ValueError, match="hidden size 64"):
        decode(target, draft_model, prompts_for(2), alien)


def test_allow_reaches_verify_as_the_judge_computed_it(target, draft_model, monkeypatch):
    seen = []
    real = ops.verify

    def spy(*args, **kwargs):
        seen.append(kwargs.get("allow"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "verify", spy)
    decode(target, draft_model, prompts_for(2), ConstantJudge(True))
    assert seen and all(a is not None and a.dtype == torch.bool for a in seen)
    seen.clear()
    decode(target, draft_model, prompts_for(2), None)
    assert seen and all(a is None for a in seen)


# ---- the code check ------------------------------------------------------------------------------


def test_python_code_tokens_drop_comments_docstrings_and_the_cut_line():
    a = 'def f(x):\n    """Adds one."""\n    # a comment\n\n    return x + 1\n    retu'
    b = 'def f(x):\n    """Something else entirely."""\n    return x + 1  # note\n'
    assert python_code_tokens(a) == python_code_tokens(b)
    assert "<docstring>" in python_code_tokens(a)
    assert python_code_tokens("x = (1,\n     2)\n") == python_code_tokens("x = (1, 2)\n")
    # Indentation is part of the program.
    assert python_code_tokens("if a:\n    b\nc\n") != python_code_tokens("if a:\n    b\n    c\n")
    # An unterminated docstring at the cut ends the tokens quietly.
    assert python_code_tokens('x = 1\n"""open\nstill\n') == ["x", "=", "1", "NEWLINE"]
    with pytest.raises(TypeError):
        python_code_tokens(b"x = 1\n")


def test_same_python_code_compares_as_far_as_both_go():
    ref = "a = 1\nb = 2\nc = 3\nd = 4\n"
    assert same_python_code(ref, "a = 1  # one\nb = 2\nc = 3\n")
    assert not same_python_code(ref, "a = 1\nb = 5\nc = 3\nd = 4\n")
    # A candidate that turns the rest into comments does not pass for free.
    assert not same_python_code(ref, "a = 1\n# b = 2\n# c = 3\n# d = 4\n")
    assert same_python_code(ref, "a = 1\n# b\n", coverage=0.0)
    with pytest.raises(ValueError, match="coverage"):
        same_python_code(ref, ref, coverage=1.5)


@requires_cuda
def test_features_on_the_gpu_match_the_cpu():
    g = torch.Generator().manual_seed(9)
    tokens, parents = random_tree(2, 12, seed=10)
    hidden, logits = torch.randn(2, 12, 8, generator=g), torch.randn(2, 12, V, generator=g)
    cpu = judge_features(hidden, logits, tokens, parents)
    gpu = judge_features(hidden.cuda(), logits.cuda(), tokens.cuda(), parents.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-5)
    judge = TokenJudge(
        torch.randn(2 * 8 + 3, generator=g), 0.1, torch.zeros(19), torch.ones(19), 0.5
    )
    assert torch.equal(
        judge.allow(hidden.cuda(), logits.cuda(), tokens.cuda(), parents.cuda()).cpu(),
        judge.allow(hidden, logits, tokens, parents),
    )


def test_numpy_labels_are_refused_with_a_clear_type_error():
    x, y = separable(60)
    with pytest.raises(TypeError, match="bool"):
        TokenJudge.fit(x, np.asarray(y, dtype=np.int64))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_judge_runs_on_hugging_face_models(family):
    from reference_models import gpt2_model, hf_model
    from specdecode.models import HFCausalLM

    hf = gpt2_model() if family == "gpt2" else hf_model("llama")
    hf_draft = gpt2_model(seed=5) if family == "gpt2" else hf_model("llama", seed=5)
    model, draft = HFCausalLM(hf), HFCausalLM(hf_draft)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in (3, 6)]
    nothing = decode(model, draft, prompts, ConstantJudge(False))
    assert nothing.sequences == [greedy_reference(model, p, 16) for p in prompts]
    everything = decode(model, draft, prompts, ConstantJudge(True))
    assert everything.stats.accepted_tokens == everything.stats.offered_depth
    # Mining reads the same hidden states through the adapter.
    mined = mine_important_tokens(model, draft, prompts, lambda *a: False, max_new_tokens=6)
    width = 2 * hf.config.hidden_size + 3
    assert mined.features.shape[1] == width and len(mined.mismatches) > 0


def test_final_numbers():
    from specdecode.judge import final_number, same_final_number

    assert final_number("so 12 + 30 = 42.\n#### 1,234") == 1234
    assert final_number("The answer is -3.50 dollars.") == final_number("-3.5")
    assert final_number("no digits here") is None
    assert same_final_number("... = 72", "we get 72.0")
    assert not same_final_number("... = 72", "we get 27")
    assert same_final_number("none", "still none") and not same_final_number("none", "1")
    with pytest.raises(TypeError):
        final_number(72)
