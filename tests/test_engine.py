"""The speculative decoding loop: greedy equality with the target's own decoding for every drafter,
lossless sampling, one target pass per step, committed-only drafter updates, rollback hygiene and
request validation."""

from __future__ import annotations

import math
import multiprocessing
import threading
from typing import Any

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from reference_engine import first_tokens_distribution, greedy_reference, tiny_transformer
from specdecode.drafters import CachebackDrafter, CombinedDrafter, ModelDrafter, NoDrafter
from specdecode.models import HFCausalLM

import specdecode
from specdecode import GenerationStats, SpeculativeDecoder, generate

V = 61
PROMPT_LENS = [1, 7, 3, 12, 5, 9, 2, 15]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompts_for(batch: int, vocab: int = V, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (PROMPT_LENS[b],), generator=g).tolist() for b in range(batch)]


class Counting:
    """Delegates to a CausalLM and records every forward call's input shape."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[tuple[int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward(self, input_ids, positions, cache, tree_mask=None, output_hidden=None):
        self.calls.append(tuple(input_ids.shape))
        return self.model.forward(input_ids, positions, cache, tree_mask, output_hidden)


def make_drafter(kind: str, draft_model: Any) -> Any:
    if kind == "none":
        return NoDrafter()
    if kind == "cacheback":
        return CachebackDrafter(max_nodes=12, max_depth=5, max_sequences=16)
    if kind == "chain":
        return ModelDrafter(draft_model, mode="chain", k=4)
    if kind == "chain-stop":
        # A confidence floor among the sampling models' top probabilities (0.73 to 0.90 over
        # the test's prompt and its continuations): about a third of the chains end early.
        return ModelDrafter(draft_model, mode="chain", k=4, stop_below=0.85)
    if kind == "tree":
        return ModelDrafter(draft_model, mode="tree", k=3, branch=3, beam=3, max_nodes=10)
    if kind == "combined":
        return CombinedDrafter(
            CachebackDrafter(max_nodes=12, max_depth=5, max_sequences=16),
            ModelDrafter(draft_model, mode="chain", k=4),
        )
    raise AssertionError(kind)


DRAFTERS = ["none", "cacheback", "chain", "tree", "combined"]


@pytest.fixture(scope="module")
def target():
    return tiny_transformer(seed=1)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_transformer(seed=2, layers=1)


@pytest.fixture(scope="module")
def references(target):
    prompts = prompts_for(8)
    return prompts, [greedy_reference(target, p, 16) for p in prompts]


# ---- greedy equality -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_equals_target_for_batches_1_to_8(kind, target, draft_model, references):
    prompts, expected = references
    drafter = make_drafter(kind, draft_model)
    decoder = SpeculativeDecoder(target, drafter)
    for batch in range(1, 9):
        out = decoder.generate(prompts[:batch], max_new_tokens=16, temperature=0.0)
        assert out.sequences == expected[:batch], f"batch {batch}"
        assert out.finish_reasons == ["length"] * batch
        assert out.stats.new_tokens == 16 * batch


def test_drafting_with_the_target_itself_accepts_everything(target, references):
    prompts, expected = references
    out = generate(
        target, prompts, drafter=ModelDrafter(target, k=4), max_new_tokens=16, temperature=0.0
    )
    assert out.sequences == expected
    # Every draft is the target's own argmax: all accepted, 5 tokens per step until the budget.
    assert out.stats.accepted_by_position[:4] == [1.0, 1.0, 1.0, 1.0]
    assert out.stats.tokens_per_step > 3.0


def test_the_draft_model_is_used_and_speeds_up_steps(target, draft_model, references):
    prompts, expected = references
    base = generate(target, prompts, max_new_tokens=16, temperature=0.0)
    spec = generate(
        target,
        prompts,
        drafter=ModelDrafter(target, mode="tree", k=3, branch=2, beam=2, max_nodes=8),
        max_new_tokens=16,
    )
    assert base.sequences == spec.sequences == expected
    assert base.stats.steps == 16 and base.stats.tokens_per_step == 1.0
    assert spec.stats.steps < base.stats.steps


def test_stop_tokens_cut_each_row(target, references):
    prompts, expected = references
    stop = expected[3][5]  # the 6th token of row 3
    out = generate(
        target,
        prompts,
        drafter=CachebackDrafter(max_sequences=8),
        max_new_tokens=16,
        stop_token_ids=[stop],
    )
    for b, seq in enumerate(out.sequences):
        if stop in expected[b]:
            cut = expected[b].index(stop) + 1
            assert seq == expected[b][:cut] and out.finish_reasons[b] == "stop"
        else:
            assert seq == expected[b] and out.finish_reasons[b] == "length"


class FakeTqdm:
    """Stands in for tqdm.tqdm: records what the engine's progress bar does with it."""

    made: list[FakeTqdm] = []

    def __init__(self, total: int, unit: str) -> None:
        self.total, self.n, self.closed, self.refreshed = total, 0, 0, 0
        FakeTqdm.made.append(self)

    def update(self, n: int) -> None:
        self.n += n

    def refresh(self) -> None:
        self.refreshed += 1

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def fake_tqdm(monkeypatch):
    import sys
    import types

    FakeTqdm.made = []
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeTqdm))
    return FakeTqdm.made


def test_progress_bar_ends_full_when_rows_stop_early(target, references, fake_tqdm):
    prompts, expected = references
    stop = expected[0][2]
    out = generate(
        target,
        prompts[:2],
        drafter=CachebackDrafter(max_sequences=2),
        max_new_tokens=16,
        stop_token_ids=[stop],
        progress=True,
    )
    generated = sum(len(seq) for seq in out.sequences)
    assert generated < 2 * 16  # row 0 stopped early
    (bar,) = fake_tqdm
    assert bar.n == generated and bar.total == generated and bar.closed == 1


def test_progress_bar_closes_when_a_step_raises(target, references, fake_tqdm):
    prompts, _ = references

    class Failing(NoDrafter):
        def propose(self, slots):
            raise RuntimeError("drafter failed")

    with pytest.raises(RuntimeError, match="drafter failed"):
        generate(target, prompts[:2], drafter=Failing(), max_new_tokens=8, progress=True)
    (bar,) = fake_tqdm
    assert bar.closed == 1


def test_progress_line_without_tqdm_ends_on_the_tokens_generated(
    target, references, monkeypatch, capsys
):
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    prompts, expected = references
    out = generate(
        target,
        prompts[:1],
        max_new_tokens=16,
        stop_token_ids=[expected[0][2]],
        progress=True,
    )
    err = capsys.readouterr().err
    n = len(out.sequences[0])
    assert n < 16  # stopped early
    assert err.endswith("\n") and err.rstrip().split("\r")[-1].strip() == f"{n}/{n} tokens"


def test_padded_output_and_stats(target, draft_model, references):
    prompts, expected = references
    out = generate(
        target,
        prompts[:3],
        drafter=ModelDrafter(draft_model, k=3),
        max_new_tokens=16,
        stop_token_ids=[expected[0][2]],
    )
    tokens, lengths = out.padded()
    assert tokens.shape == (3, int(lengths.max()))
    for b in range(3):
        assert tokens[b, : lengths[b]].tolist() == out.sequences[b]
        assert bool((tokens[b, lengths[b] :] == -1).all())
    s = out.stats
    assert isinstance(s, GenerationStats)
    assert s.new_tokens == sum(len(x) for x in out.sequences)
    assert s.row_steps >= s.steps >= max(len(x) for x in out.sequences) / 4
    assert 0 < len(s.accepted_by_position) <= 3
    assert all(0.0 <= a <= 1.0 for a in s.accepted_by_position)
    parts = s.draft_time + s.verify_time + s.bookkeeping_time + s.prefill_time
    assert 0 < parts <= s.wall_time and s.tokens_per_second > 0
    assert "tokens/step" in s.summary()


# ---- Hugging Face models -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_hf_greedy_equals_transformers_generate(family, kind):
    from reference_models import gpt2_model, hf_model

    hf = gpt2_model() if family == "gpt2" else hf_model("llama")
    hf_draft = gpt2_model(seed=5) if family == "gpt2" else hf_model("llama", seed=5)
    model = HFCausalLM(hf)
    vocab = model.vocab_size
    prompts = prompts_for(5, vocab, seed=3)
    out = generate(
        model, prompts, drafter=make_drafter(kind, HFCausalLM(hf_draft)), max_new_tokens=10
    )
    for b, prompt in enumerate(prompts):
        ours = greedy_reference(model, prompt, 10)
        ids = torch.tensor([prompt])
        theirs = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.sequences[b] == ours == theirs, f"row {b}"


@pytest.mark.parametrize("family", ["qwen3", "phi3", "qwen3_moe", "mixtral", "qwen2:yarn"])
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_our_transformer_of_each_family_decodes_as_transformers(family, kind):
    """specdecode's own Transformer loaded from a transformers model of the newer families
    (Qwen3's head norms, Phi-3's fused projections, the two mixture-of-experts ones, YaRN RoPE
    past its pretraining context) as target, a draft of the same family: greedy output equal to
    transformers' argmax continuation, through drafting, tree attention and KV compaction."""
    from reference_models import BASE, YARN_ROPE_SCALING, hf_model
    from specdecode.models import ModelConfig, Transformer

    kind_of, _, variant = family.partition(":")
    extra = {}
    if variant == "yarn":
        extra = {"rope_parameters": {"rope_theta": BASE["rope_theta"], **YARN_ROPE_SCALING}}

    def ours(hf):
        model = Transformer(ModelConfig.from_hf_config(hf.config.to_dict()))
        model.load_state_dict(hf.state_dict())
        return model

    hf = hf_model(kind_of, **extra)
    target, draft = ours(hf), ours(hf_model(kind_of, seed=5, **extra))
    prompts = prompts_for(3, target.vocab_size, seed=6)
    out = generate(target, prompts, drafter=make_drafter(kind, draft), max_new_tokens=12)
    for b, prompt in enumerate(prompts):
        # transformers' argmax continuation, full forward passes (generate's min_new_tokens
        # would forbid the end-of-sequence token these tiny models sometimes pick).
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out.sequences[b] == seq[len(prompt) :], f"row {b}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["cacheback", "chain"])
def test_hf_finished_rows_leave_the_batch(family, kind):
    """With a Hugging Face target, rows that stop early leave its cache too: the target's
    passes run at the batch size of the running rows, and every row is still transformers' own
    greedy continuation, cut at its stop token. (Not GPT-2: the tiny random one repeats one
    token per row, so stop tokens cannot end rows at different times.)"""
    from reference_models import hf_model

    hf = hf_model(family)
    hf_draft = hf_model(family, seed=5)
    model = HFCausalLM(hf)
    prompts = prompts_for(6, model.vocab_size, seed=4)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        expected.append(
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        )
    stop = {expected[1][1], expected[3][4]}
    cuts = [next((i + 1 for i, t in enumerate(row) if t in stop), len(row)) for row in expected]
    assert len(set(cuts)) > 1  # rows end at different times
    # Tokens each row has committed (from on_step) at the time of each target pass.
    committed = [0] * len(prompts)
    seen = []

    class Snapshots(Counting):
        def forward(self, *args, **kwargs):
            seen.append(list(committed))
            return super().forward(*args, **kwargs)

    def on_step(row, tokens):
        committed[row] += len(tokens)

    counted = Snapshots(model)
    out = generate(
        counted,
        prompts,
        drafter=make_drafter(kind, HFCausalLM(hf_draft)),
        max_new_tokens=12,
        stop_token_ids=stop,
        on_step=on_step,
    )
    for b, row in enumerate(expected):
        assert out.sequences[b] == row[: cuts[b]], f"row {b}"
    # Every pass runs exactly the rows that had not finished before it.
    batches = [shape[0] for shape in counted.calls]
    running = [sum(n < len(s) for n, s in zip(snap, out.sequences)) for snap in seen]
    assert batches == running
    assert "stop" in out.finish_reasons and min(batches) < len(prompts)


# ---- sampling is lossless ------------------------------------------------------------------------


def chi_square_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled into one."""
    n = float(counts.sum())
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:  # the pool itself is too small: merge it into the smallest kept cell
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        j = int(torch.argmin(exp))
        obs[j] += counts[~big].sum()
        exp[j] += expected[~big].sum()
    return float(((obs - exp) ** 2 / exp).sum()), int(obs.numel()) - 1


SAMPLE_V = 3
DRAWS = 16000


class OddRowsSilent:
    """A drafter whose odd rows get no draft (the root alone): with a CombinedDrafter around it,
    every step where the even rows have drafts mixes its deterministic trees with the fallback's
    sampled chains in one batch. Counts those steps, and those among them where an even row's
    tree branches (a node with two children: deterministic siblings beside sampled rows)."""

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        self.mixed_steps = 0
        self.branching_mixed_steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.drafter, name)

    def propose(self, slots):
        tree = self.drafter.propose(slots)
        num = tree.num_nodes.clone()
        num[1::2] = 1
        mixed = len(slots) > 1 and bool((num[0::2] > 1).any())
        self.mixed_steps += int(mixed)
        if mixed:
            parents = tree.parents[0::2].numpy()
            valid = np.arange(parents.shape[1])[None, :] < num[0::2].numpy()[:, None]
            branching = any(
                np.bincount(row[ok & (row >= 0)]).max(initial=0) >= 2
                for row, ok in zip(parents, valid)
            )
            self.branching_mixed_steps += int(branching)
        return type(tree)(tree.tokens, tree.parents, num)


class FixedBranches:
    """Proposes one deterministic tree with siblings for every sequence: the root's children 0
    and 1, then 2 under the first and 0 under the second."""

    def start(self, slots, prompts):
        pass

    def observe(self, slots, committed):
        pass

    def release(self, slots):
        pass

    def propose(self, slots):
        b = len(slots)
        tokens = torch.tensor([[0, 0, 1, 2, 0]] * b, dtype=torch.int32)
        parents = torch.tensor([[-1, 0, 0, 1, 2]] * b, dtype=torch.int32)
        return specdecode.ops.DraftTree(tokens, parents, torch.full((b,), 5, dtype=torch.int32))


@pytest.fixture(scope="module")
def sampling_models():
    target = tiny_transformer(seed=11, vocab_size=SAMPLE_V, std=0.15, layers=1, max_length=16)
    draft = tiny_transformer(seed=12, vocab_size=SAMPLE_V, std=0.15, layers=1, max_length=16)
    prompt = [1, 0, 2]
    return target, draft, prompt, first_tokens_distribution(target, prompt)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "none",
        "chain",
        "chain-stop",
        "chain-stop-self",
        "tree",
        "cacheback",
        "combined",
        "combined-branching",
        "specformer",
        "specformer-tree",
        "specformer-root",
        "edge",
        "chain:block",
        "chain-stop:block",
        "combined:block",
        "specformer:block",
    ],
)
def test_sampling_matches_the_target_distribution(kind, sampling_models):
    """Joint law of the first three tokens vs the exact target law (chi-square), and the test
    demonstrably detects a 1% shift of probability mass with these many draws. The combined
    drafters' steps mix rows of both drafters: deterministic drafts (n-gram trees cut to their
    first paths, or whole trees with siblings) verified through draft_deterministic beside the
    draft model's sampled chains. A ":block" kind verifies with method="block" (block
    verification of the sampled chains, "exact" for the deterministic rows)."""
    target, draft, prompt, probs = sampling_models
    kind, _, method = kind.partition(":")
    if kind == "chain-stop-self":
        # The target drafting for itself under a confidence floor among its top probabilities
        # (0.47 to 0.73 here; the prompt's 0.73 above it): a floor that read the drawn token's
        # probability instead of the largest would under-draw the unlikely tokens by far.
        drafter = ModelDrafter(target, mode="chain", k=3, stop_below=0.6)
    elif kind == "cacheback":
        drafter = CachebackDrafter(max_nodes=8, max_depth=3, max_sequences=4000)
    elif kind.startswith("combined"):
        primary = (
            FixedBranches()
            if kind == "combined-branching"
            else CachebackDrafter(max_nodes=8, max_depth=3, max_sequences=4000)
        )
        # Branching trees are kept whole in mixed steps (mixed_steps="tree"); the n-gram case
        # takes the default, its rows cut to their first root paths there.
        drafter = CombinedDrafter(
            OddRowsSilent(primary),
            ModelDrafter(draft, mode="chain", k=3),
            mixed_steps="tree" if kind == "combined-branching" else "path",
        )
    elif kind.startswith("specformer"):
        # An untrained (random) head: its slots' distributions are the target's in nothing, so
        # many drafts are rejected and the correction draws are exercised; the tree's children
        # are deterministic, the chain's sampled from the slots.
        from specdecode.specformer import SpecFormerDrafter, SpecFormerHead

        torch.manual_seed(3)
        head = SpecFormerHead.for_target(target, 3, root_aware=kind.endswith("root")).eval()
        if head.root_aware:
            with torch.no_grad():
                head.root_proj.weight.normal_(0.0, 0.2)
        mode = "tree" if kind.endswith("tree") else "chain"
        drafter = SpecFormerDrafter(head, target, mode=mode, branch=2, max_nodes=6)
    elif kind == "edge":
        # Two draft workers behind one server (specdecode.edge): a sampling draft model and an
        # n-gram drafter, so every batch mixes sampled and deterministic rows from the wire.
        from specdecode.edge import RemoteDrafter, serve_drafter

        conns = []
        for part in (
            ModelDrafter(draft, mode="chain", k=3),
            CachebackDrafter(max_nodes=8, max_depth=3, max_sequences=4000),
        ):
            server_end, worker_end = multiprocessing.Pipe()
            threading.Thread(target=serve_drafter, args=(worker_end, part), daemon=True).start()
            conns.append(server_end)
        drafter = RemoteDrafter(conns)
    else:
        drafter = make_drafter(kind, draft)
    counts = torch.zeros(SAMPLE_V**3, dtype=torch.float64)
    per_call = 4000
    for call in range(DRAWS // per_call):
        seeds = [call * per_call + b for b in range(per_call)]
        out = generate(
            target,
            [prompt] * per_call,
            drafter=drafter,
            max_new_tokens=3,
            temperature=1.0,
            seed=seeds,
            method=method or "exact",
        )
        seqs = torch.tensor(out.sequences)
        index = seqs[:, 0] * SAMPLE_V**2 + seqs[:, 1] * SAMPLE_V + seqs[:, 2]
        counts += torch.bincount(index, minlength=SAMPLE_V**3).double()
    if kind == "edge":
        drafter.close()
        assert drafter.stats.rounds[0] > 0 and drafter.stats.rounds[1] > 0
    if kind.startswith("combined"):
        assert drafter.primary.mixed_steps >= 2, drafter.primary.mixed_steps
    if kind == "combined-branching":
        assert drafter.primary.branching_mixed_steps >= 2, drafter.primary.branching_mixed_steps
    stat, dof = chi_square(counts, probs)
    assert chi_square_sf(stat, dof) > 1e-3, (stat, dof)
    # Power: 1% of the probability mass moved from the likeliest cell to a typical (median)
    # cell must be detected. Its noncentrality n * sum((p' - p)^2 / p) is large enough that the
    # statistic exceeds the 1e-3 critical value with probability > 0.99, and these counts do.
    order = torch.argsort(probs, descending=True)
    shifted = probs.clone()
    shifted[order[0]] -= 0.01
    shifted[order[len(order) // 2]] += 0.01
    noncentrality = DRAWS * float(((shifted - probs) ** 2 / probs).sum())
    assert noncentrality > 60, noncentrality
    stat_shift, dof_shift = chi_square(counts, shifted)
    assert chi_square_sf(stat_shift, dof_shift) < 1e-3, (stat_shift, dof_shift)


def test_seeds_reproduce_rows_independently_of_the_batch(target, draft_model):
    prompts = prompts_for(4)
    kwargs = dict(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95)
    full = generate(
        target, prompts, drafter=ModelDrafter(draft_model), seed=[7, 8, 9, 10], **kwargs
    )
    alone = generate(target, prompts[2:3], drafter=ModelDrafter(draft_model), seed=[9], **kwargs)
    assert full.sequences[2] == alone.sequences[0]
    again = generate(
        target, prompts, drafter=ModelDrafter(draft_model), seed=[7, 8, 9, 10], **kwargs
    )
    assert again.sequences == full.sequences


@pytest.mark.parametrize("kind", ["none", "cacheback", "tree", "combined-tree", "combined-path"])
def test_seeds_reproduce_rows_of_every_drafter_independently_of_the_batch(
    kind, target, draft_model
):
    """The promise of ``seed`` (a list): without a budget, with drafters whose drafts of a row
    depend on that row alone (CombinedDrafter in both modes: "path" cuts a row's tree by its own
    temperature) and far from the max length, a row's sampled tokens are those it gets alone,
    whatever its neighbours."""
    if kind.startswith("combined"):
        drafter = CombinedDrafter(
            CachebackDrafter(max_nodes=12, max_depth=5, max_sequences=16),
            ModelDrafter(draft_model, mode="chain", k=4),
            mixed_steps=kind.split("-")[1],
        )
    else:
        drafter = make_drafter(kind, draft_model)
    # Repetitive prompts give the n-gram tables drafts, with branches, beside silent rows.
    prompts = [[5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6], [40, 3, 17, 29, 51], [2], [5, 6, 5, 6, 5]]
    per_row = dict(temperature=[1.0, 0.7, 0.0, 1.3], top_k=[0, 20, 0, 5], seed=[7, 8, 9, 10])
    decoder = SpeculativeDecoder(target, drafter)
    full = decoder.generate(prompts, max_new_tokens=12, top_p=0.95, **per_row)
    for b in range(len(prompts)):
        row = {name: values[b : b + 1] for name, values in per_row.items()}
        alone = decoder.generate(prompts[b : b + 1], max_new_tokens=12, top_p=0.95, **row)
        assert alone.sequences[0] == full.sequences[b], f"row {b}"


def test_a_top_k_beyond_the_vocabulary_is_off(target):
    """top_k >= vocab_size keeps every token (verify's rule), even one past int32."""
    prompts = prompts_for(2)
    kwargs = dict(max_new_tokens=6, temperature=1.0, seed=[3, 4])
    off = generate(target, prompts, **kwargs).sequences
    for k in (V, V + 1, 2**31, 2**40):
        assert generate(target, prompts, top_k=k, **kwargs).sequences == off, k
    drafted = [
        generate(target, prompts, drafter=ModelDrafter(target, k=3), top_k=k, **kwargs).sequences
        for k in (0, 2**40)
    ]
    assert drafted[0] == drafted[1]


# ---- structure of a step -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DRAFTERS)
def test_one_target_forward_per_step(kind, target, draft_model, references):
    prompts, expected = references
    counted = Counting(target)
    out = generate(counted, prompts, drafter=make_drafter(kind, draft_model), max_new_tokens=16)
    assert out.sequences == expected
    # One prefill pass, then exactly one pass over the trees per step.
    assert len(counted.calls) == 1 + out.stats.steps
    assert counted.calls[0] == (8, max(len(p) for p in prompts) - 1)


class Recording:
    """Wraps a drafter and records everything the engine hands it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.observed: dict[int, list[int]] = {}
        self.proposed_roots: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start(self, slots, prompts):
        for s, p in zip(slots, prompts):
            self.observed[int(s)] = list(p)
        self.inner.start(slots, prompts)

    def propose(self, slots):
        tree = self.inner.propose(slots)
        self.proposed_roots.append([int(x) for x in tree.tokens[:, 0]])
        for i, s in enumerate(slots):
            assert int(tree.tokens[i, 0]) == self.observed[int(s)][-1]
        return tree

    def observe(self, slots, committed):
        for s, c in zip(slots, committed):
            self.observed[int(s)] += [int(x) for x in c]
        self.inner.observe(slots, committed)

    def release(self, slots):
        self.inner.release(slots)


@pytest.mark.parametrize("kind", ["chain", "tree", "cacheback"])
def test_drafter_sees_only_committed_tokens(kind, target, draft_model):
    prompts = prompts_for(6)
    drafter = Recording(make_drafter(kind, draft_model))
    out = generate(target, prompts, drafter=drafter, max_new_tokens=14, temperature=0.8, seed=3)
    for b, prompt in enumerate(prompts):
        full = prompt + out.sequences[b]
        seen = drafter.observed[b]
        # Everything observed is the committed sequence, in order; only the final step's
        # commit (after which the row finished and was released) may be missing.
        assert seen == full[: len(seen)]
        assert len(full) - len(seen) <= 5
    if kind != "cacheback":
        assert drafter.inner._seq == {}  # every slot released at the end


class Garbage:
    """A drafter proposing wide trees of random tokens: nearly everything gets rolled back."""

    vocab_size = V

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(0)
        self.roots: dict[int, int] = {}

    def start(self, slots, prompts):
        for s, p in zip(slots, prompts):
            self.roots[s] = int(p[-1])

    def propose(self, slots):
        n = 9
        parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 4, 5]] * len(slots), dtype=torch.int32)
        tokens = torch.randint(0, V, (len(slots), n), generator=self.gen, dtype=torch.int32)
        tokens[:, 0] = torch.tensor([self.roots[s] for s in slots], dtype=torch.int32)
        return specdecode.ops.DraftTree(
            tokens, parents, torch.full((len(slots),), n, dtype=torch.int32)
        )

    def observe(self, slots, committed):
        for s, c in zip(slots, committed):
            self.roots[s] = int(c[-1])

    def release(self, slots):
        pass


def test_rolled_back_entries_never_leak(target, references, monkeypatch):
    prompts, expected = references
    out = generate(target, prompts, drafter=Garbage(), max_new_tokens=16)
    assert out.sequences == expected

    # The detector works: if acceptance kept more of the tree in the cache than the accepted
    # path, rejected drafts would leak into later steps and change the output.
    def keep_one_rejected(self, state, cache, result, active):
        # Keeps the accepted path and one rejected child of its last node (still a path of the
        # scored tree, as compact requires): one node more than the accepted path.
        accepted = result.num_accepted.cpu().long()
        n = cache._tree_size
        paths, keep = [], []
        for b, words in enumerate(cache._tree_mask.cpu().tolist()):
            seen = [{j for j in range(n) if words[i][j // 32] >> (j % 32) & 1} for i in range(n)]
            path = result.path[b, : int(accepted[b]) + 1].tolist()
            last = path[-1]
            path += [j for j in range(last + 1, n) if seen[j] == seen[last] | {j}][:1]
            paths.append(path + [-1] * (n - len(path)))
            keep.append(len(path))
        cache.compact(torch.tensor(paths, dtype=torch.int32), torch.tensor(keep, dtype=torch.int32))
        return accepted

    monkeypatch.setattr(SpeculativeDecoder, "_accept", keep_one_rejected)
    leaky = generate(target, prompts, drafter=Garbage(), max_new_tokens=16)
    assert leaky.sequences != expected


# ---- bad requests --------------------------------------------------------------------------------


def test_bad_requests_raise_before_any_work(target, draft_model):
    counted = Counting(target)
    drafter = ModelDrafter(draft_model)
    decoder = SpeculativeDecoder(counted, drafter)
    cases = [
        ([[3, 4], []], {}, ValueError, "prompt 1 is empty"),
        ([[3, V]], {}, ValueError, "outside the target's vocabulary"),
        ([[3, -1]], {}, ValueError, "outside the target's vocabulary"),
        ([[3] * 200], {"max_new_tokens": 57}, ValueError, "max length"),
        ([], {}, ValueError, "non-empty"),
        ([1, 2, 3], {}, TypeError, "list of prompts"),
        ([[3]], {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ([[3]], {"temperature": -1.0}, ValueError, "temperature"),
        ([[3]], {"top_p": 0.0}, ValueError, "top_p"),
        ([[3], [4]], {"seed": [1]}, ValueError, "seed"),
        ([[3]], {"stop_token_ids": [V + 5]}, ValueError, "stop_token_ids"),
        ([[3]], {"stop_token_ids": torch.tensor([V])}, ValueError, "stop_token_ids"),
        ([[3], [4]], {"seed": 2**63 - 1}, ValueError, "seed: row 1's seed"),
        ([[3]], {"seed": [2**70]}, ValueError, "seed"),
    ]
    for prompts, kwargs, exc, match in cases:
        kwargs = {"max_new_tokens": 4, **kwargs}
        with pytest.raises(exc, match=match):
            decoder.generate(prompts, **kwargs)
    assert counted.calls == [] and drafter._seq == {}
    other = tiny_transformer(seed=3, vocab_size=V + 1, layers=1)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(target, ModelDrafter(other))
    with pytest.raises(ValueError, match="drafter's 2 sequence slots"):
        generate(
            target, prompts_for(3), drafter=CachebackDrafter(max_sequences=2), max_new_tokens=2
        )
    with pytest.raises(ValueError, match="method"):
        SpeculativeDecoder(target, method="nope")
    with pytest.raises(ValueError, match="judge: method='block'"):
        SpeculativeDecoder(target, method="block", judge=object())
    with pytest.raises(ValueError, match="eps: method='block' does not use it"):
        SpeculativeDecoder(target, method="block", eps=0.1)
    with pytest.raises(TypeError, match="drafter"):
        SpeculativeDecoder(target, object())


def test_prompts_as_a_tensor_or_numpy_array(target):
    prompts = prompts_for(3)
    width = min(len(p) for p in prompts)
    rows = [p[:width] for p in prompts]
    expected = generate(target, rows, max_new_tokens=5).sequences
    assert generate(target, torch.tensor(rows), max_new_tokens=5).sequences == expected
    assert generate(target, np.array(rows, dtype=np.int32), max_new_tokens=5).sequences == expected
    with pytest.raises(ValueError, match=r"expected a \[B, T\] array"):
        generate(target, np.array(rows[0]), max_new_tokens=5)
    with pytest.raises(TypeError, match="expected token ids"):
        generate(target, np.array(rows, dtype=np.float32), max_new_tokens=5)


class BadSampledDrafter(FixedBranches):
    """Proposes a sampled chain with the draft distributions or flags given at construction."""

    def __init__(self, probs_shape=None, deterministic=None):
        self.probs_shape, self.deterministic = probs_shape, deterministic

    def propose(self, slots):
        from specdecode.drafters import SampledDraftTree

        b = len(slots)
        tokens = torch.tensor([[0, 1, 2]] * b, dtype=torch.int32)
        parents = torch.tensor([[-1, 0, 1]] * b, dtype=torch.int32)
        probs = torch.full(self.probs_shape or (b, 3, V), 1.0 / V)
        flags = self.deterministic(b) if self.deterministic else None
        num = torch.full((b,), 3, dtype=torch.int32)
        return SampledDraftTree(tokens, parents, num, probs, flags)


def test_bad_sampled_proposals_raise(target):
    cases = [
        (BadSampledDrafter(probs_shape=(2, 3, V + 1)), "draft_probs has shape"),
        (BadSampledDrafter(deterministic=lambda b: torch.ones(b + 1, dtype=torch.bool)), "bool"),
        (BadSampledDrafter(deterministic=lambda b: torch.ones(b)), "draft_deterministic"),
    ]
    for drafter, match in cases:
        with pytest.raises(ValueError, match=match):
            generate(target, prompts_for(2), drafter=drafter, max_new_tokens=3, temperature=1.0)
    # Well-formed flags run: every row flagged deterministic verifies as a plain chain.
    good = BadSampledDrafter(deterministic=lambda b: torch.ones(b, dtype=torch.bool))
    out = generate(target, prompts_for(2), drafter=good, max_new_tokens=3, temperature=1.0)
    assert all(len(s) == 3 for s in out.sequences)


def test_numpy_scalars_tensors_and_a_single_stop_id_are_taken(target, references):
    """Arguments as they come from numpy, torch or a tokenizer's eos_token_id (an int)."""
    prompts, want = references
    stop = want[0][3]
    cut = want[0][: want[0].index(stop) + 1]
    for stops in (stop, np.int64(stop), torch.tensor([stop]), np.array([stop])):
        out = generate(target, prompts[:1], max_new_tokens=np.int64(16), stop_token_ids=stops)
        assert out.sequences == [cut]
    out = generate(
        target, prompts[:2], max_new_tokens=4, temperature=np.float32(1.0), seed=np.int64(5)
    )
    again = generate(target, prompts[:2], max_new_tokens=4, temperature=1.0, seed=5)
    assert out.sequences == again.sequences


def test_generation_runs_to_the_models_max_length():
    small = tiny_transformer(seed=1, max_length=24)
    prompts = [[1, 2, 3], [4] * 8]
    out = generate(small, prompts, drafter=ModelDrafter(small, k=6), max_new_tokens=16)
    assert out.sequences == [greedy_reference(small, p, 16) for p in prompts]


def test_lossy_method_runs_and_is_exposed(target, draft_model):
    out = generate(
        target,
        prompts_for(2),
        drafter=ModelDrafter(draft_model),
        max_new_tokens=8,
        method="typical",
        temperature=1.0,
        seed=1,
    )
    assert [len(s) for s in out.sequences] == [8, 8]
    assert math.isfinite(out.stats.tokens_per_second)


@pytest.mark.parametrize(
    "method,options",
    [
        ("relaxed", {"eps": 0.2}),
        ("relaxed", {"eps": 0.0, "correction": "target"}),
        ("topk_accept", {"topk_accept": 3}),
        ("typical", {"eps": 0.05, "alpha": 0.2}),
    ],
)
def test_generate_takes_the_lossy_methods_options(method, options, target, draft_model, references):
    """generate() passes the options on; at temperature 0 every method verifies greedily."""
    prompts, want = references
    prompts, want = prompts[:2], [w[:8] for w in want[:2]]
    drafter = ModelDrafter(draft_model)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=8, method=method, **options)
    assert out.sequences == want
    sampled = generate(
        target,
        prompts,
        drafter=drafter,
        max_new_tokens=8,
        method=method,
        temperature=1.0,
        seed=3,
        **options,
    )
    assert [len(s) for s in sampled.sequences] == [8, 8]


@pytest.mark.parametrize(
    "method,options,match",
    [
        ("relaxed", {}, "eps"),
        ("relaxed", {"eps": -1.0}, "eps"),
        ("relaxed", {"eps": 0.1, "correction": "nope"}, "correction"),
        ("topk_accept", {}, "topk_accept"),
        ("topk_accept", {"topk_accept": 0}, "topk_accept"),
        ("typical", {"eps": 2.0}, "eps"),
        ("exact", {"eps": 0.1}, "eps: method='exact' does not use it"),
        ("typical", {"topk_accept": 2}, "topk_accept"),
    ],
)
def test_lossy_options_are_checked_before_any_work(method, options, match, target):
    counted = Counting(target)
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(counted, method=method, **options)
    with pytest.raises(ValueError, match=match):
        generate(counted, prompts_for(1), max_new_tokens=2, method=method, **options)
    assert counted.calls == []


def test_package_exports():
    for name in ("models", "drafters", "engine", "generate", "SpeculativeDecoder"):
        assert hasattr(specdecode, name) and name in specdecode.__all__


# ---- adaptive node budget ------------------------------------------------------------------------

from specdecode.engine import AdaptiveBudget  # noqa: E402


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_adaptive_budget_keeps_greedy_identity(batch, target, references):
    prompts, expected = references
    budget = AdaptiveBudget((1, 2, 4, 8, 12), explore_every=3)
    drafter = CachebackDrafter(max_nodes=12, max_depth=8, max_sequences=16)
    out = SpeculativeDecoder(target, drafter, budget=budget).generate(
        prompts[:batch], max_new_tokens=16, temperature=0.0
    )
    assert out.sequences == expected[:batch]
    assert len(out.stats.node_budgets) == out.stats.steps
    assert set(out.stats.node_budgets) <= {1, 2, 4, 8, 12}
    # The first step explores the largest budget; the estimates then cover every candidate.
    assert out.stats.node_budgets[0] == 12
    assert set(budget.expected_tokens) == {1, 2, 4, 8, 12}
    assert all(1.0 <= v <= 13.0 for v in budget.expected_tokens.values())


def test_adaptive_budget_follows_the_cost():
    # Measured acceptance: budget n accepts n - 1 tokens half of the time.
    def steps(budget: AdaptiveBudget, cost_free_after: int) -> list[int]:
        chosen = []
        for _ in range(cost_free_after):
            n = budget.choose(None, _FakeCache(1), rows=1, limit=16)
            chosen.append(n)
            path = torch.arange(n, dtype=torch.int32).unsqueeze(0)
            budget.observe(path, torch.tensor([n - 1]), torch.tensor([0]), n)
        return chosen

    cheap_nodes = AdaptiveBudget((1, 4, 16), explore_every=100, cost=lambda b, n: 1.0)
    assert steps(cheap_nodes, 5)[1:] == [16] * 4
    dear_nodes = AdaptiveBudget((1, 4, 16), explore_every=100, cost=lambda b, n: float(n**2))
    assert steps(dear_nodes, 5)[1:] == [1] * 4
    explore = AdaptiveBudget((1, 4, 16), explore_every=2, cost=lambda b, n: float(n**2))
    assert steps(explore, 6) == [16, 1, 16, 1, 16, 1]


def test_adaptive_budget_counterfactual_acceptance():
    budget = AdaptiveBudget((1, 3, 6, 9), decay=0.5, cost=lambda b, n: 1.0)
    # Row 0 accepted nodes 2, 5 and 7 (path 0 -> 2 -> 5 -> 7); row 1 nothing; row 2 is not running.
    path = torch.tensor([[0, 2, 5, 7], [0, -1, -1, -1], [0, 1, 2, 3]], dtype=torch.int32)
    budget.observe(path, torch.tensor([3, 0, 3]), torch.tensor([0, 1]), 9)
    # Within the first 1, 3, 6, 9 nodes row 0 keeps 0, 1, 2, 3 accepted tokens, row 1 none.
    assert budget.expected_tokens == {1: 1.0, 3: 1.5, 6: 2.0, 9: 2.5}
    # A step at budget 3 updates only the budgets it can speak for (moving average, decay 0.5).
    budget.observe(path[:1], torch.tensor([1]), torch.tensor([0]), 3)
    assert budget.expected_tokens == {1: 1.0, 3: 1.75, 6: 2.0, 9: 2.5}


def test_adaptive_budget_rejects_bad_arguments(target):
    with pytest.raises(TypeError, match="candidates"):
        AdaptiveBudget([])
    with pytest.raises(ValueError, match="candidates"):
        AdaptiveBudget((0, 4))
    with pytest.raises(ValueError, match="explore_every"):
        AdaptiveBudget(explore_every=0)
    with pytest.raises(ValueError, match="decay"):
        AdaptiveBudget(decay=1.0)
    with pytest.raises(TypeError, match="cost"):
        AdaptiveBudget(cost=3)
    with pytest.raises(TypeError, match="budget"):
        SpeculativeDecoder(target, NoDrafter(), budget=8)


def test_adaptive_budget_measures_costs_on_the_live_cache(target, references):
    prompts, expected = references
    budget = AdaptiveBudget((1, 4, 8), explore_every=4)
    drafter = CachebackDrafter(max_nodes=8, max_depth=6, max_sequences=4)
    out = SpeculativeDecoder(target, drafter, budget=budget).generate(
        prompts[:2], max_new_tokens=16, temperature=0.0
    )
    # The timing passes were rolled back: the output is the target's own.
    assert out.sequences == expected[:2]
    costs = engine_module._MEASURED_COSTS[target][2]
    # (Other tests' batches shrink to 2 rows as their sequences finish and add their sizes.)
    assert {1, 4, 8} <= set(costs) and all(c > 0 for c in costs.values())


class _FakeCache:
    def __init__(self, batch: int) -> None:
        self.batch_size = batch


import specdecode.engine as engine_module  # noqa: E402


def test_stats_totals_match_the_per_position_counts(target, draft_model, references):
    prompts, _ = references
    out = generate(target, prompts[:3], drafter=ModelDrafter(draft_model, k=3), max_new_tokens=12)
    s = out.stats
    assert s.offered_depth == sum(s.offered_by_position) > 0
    assert s.accepted_tokens == sum(s.accepted_counts_by_position)
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.offered_depth)
    for rate, a, o in zip(
        s.accepted_by_position, s.accepted_counts_by_position, s.offered_by_position
    ):
        assert rate == pytest.approx(a / o if o else 0.0)
    # Every token beyond one per row-step is an accepted draft.
    assert s.new_tokens - s.row_steps <= s.accepted_tokens


# ---- per-row, cost-aware budgets; finished rows leave the cache ----------------------------------

from specdecode.engine import CostAwareBudget  # noqa: E402


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_cost_aware_budget_keeps_greedy_identity(batch, target, references):
    prompts, expected = references
    counted = Counting(target)
    budget = CostAwareBudget()
    drafter = CachebackDrafter(max_nodes=12, max_depth=8, max_sequences=16, chain=True)
    out = SpeculativeDecoder(counted, drafter, budget=budget).generate(
        prompts[:batch], max_new_tokens=16, temperature=0.0
    )
    assert out.sequences == expected[:batch]
    assert len(out.stats.node_budgets) == out.stats.steps
    assert all(1 <= n <= 12 for n in out.stats.node_budgets)


@pytest.mark.parametrize("ragged", [True, False])
def test_chain_pays_is_allocates_verdict_on_a_chain(ragged):
    """The engine's check before a proposal gives allocate's answer for the same chain, and
    leaves the same prediction of the pass behind."""
    rng = np.random.default_rng(7)
    curve = engine_module._CostCurve(
        1, [(1, 3.6e-3), (2, 4.9e-3), (4, 4.4e-3), (17, 7e-3)], 0.0, ragged
    )
    seen = set()
    for _ in range(200):
        budget = CostAwareBudget(decay=0.9)
        budget._curve = curve
        budget._overhead = float(rng.uniform(0.0, 2e-3))
        rate = float(rng.uniform(0.0, 1.0))  # this trial's acceptance of each draft token
        for _ in range(int(rng.integers(0, 40))):
            offered = int(rng.integers(0, 9))
            accepted = 0
            while accepted < offered and rng.uniform() < rate:
                accepted += 1
            budget.observe([0], [offered], [accepted])
        nodes = int(rng.integers(2, 18))
        chain = np.arange(nodes)[None, :]
        limits = budget.allocate(None, _FakeCache(1), [0], np.array([nodes]), chain, ragged, 17)
        predicted = budget._last_prediction
        pays = budget.chain_pays(None, _FakeCache(1), 0, nodes, ragged, 17)
        assert pays == (int(limits[0]) > 1)
        assert budget._last_prediction == predicted
        seen.add(pays)
    assert seen == {True, False}


class _Spying(CachebackDrafter):
    """A Cacheback drafter that records the slots of every proposal and what it observed."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.proposed: list[list[int]] = []
        self.observed: list[int] = []

    def propose(self, slots):
        self.proposed.append(list(slots))
        return super().propose(slots)

    def observe(self, slots, committed):
        self.observed.extend(int(t) for row in committed for t in row)
        return super().observe(slots, committed)


@pytest.mark.parametrize(
    "chain, batch, cost, proposes",
    [
        (True, 1, lambda b, m, t: float(m) ** 3, "never"),  # no chain can pay
        (True, 1, lambda b, m, t: 1.0, "drafting"),  # free nodes: asked whenever a draft fits
        (False, 1, lambda b, m, t: float(m) ** 3, "always"),  # trees
        (True, 2, lambda b, m, t: float(m) ** 3, "always"),  # batch > 1
    ],
)
def test_the_drafter_is_not_asked_for_a_chain_no_budget_would_score(
    chain, batch, cost, proposes, target, references
):
    prompts, expected = references
    drafter = _Spying(max_nodes=8, max_depth=6, max_sequences=batch, chain=chain)
    assert drafter.proposes_chains is chain
    steps: list[list[int]] = []
    out = SpeculativeDecoder(target, drafter, budget=CostAwareBudget(cost=cost)).generate(
        prompts[:batch],
        max_new_tokens=16,
        temperature=0.0,
        on_step=lambda b, row: steps.append(row) if b == 0 else None,
    )
    assert out.sequences == expected[:batch]
    asked = len(drafter.proposed)
    if proposes == "never":
        assert asked == 0 and out.stats.node_budgets == [1] * out.stats.steps
    elif proposes == "always":
        assert asked == out.stats.steps
    else:
        # Every step but possibly the last, where the token budget may leave no room for a draft.
        assert asked >= max(out.stats.steps - 1, 1)
        assert asked >= sum(1 for n in out.stats.node_budgets if n > 1) > 0
    if batch == 1:
        # The n-gram tables still see every committed token but the last step's (the row has
        # finished then).
        assert drafter.observed == [t for row in steps[:-1] for t in row]


def test_cost_aware_budget_follows_the_cost():
    """Free nodes: every drafted node is scored; dear nodes: roots only; in between the row that
    accepts more keeps more of its draft."""
    rows, n = [0, 1], 9
    depth = torch.arange(n).expand(2, n)
    num_nodes = torch.tensor([n, n])

    def allocate(budget):
        return budget.allocate(None, _FakeCache(2), rows, num_nodes, depth, True).tolist()

    free = CostAwareBudget(cost=lambda b, m, t: 1.0)
    assert allocate(free) == [n, n]
    dear = CostAwareBudget(cost=lambda b, m, t: float(m) ** 3)
    assert allocate(dear) == [1, 1]
    linear = CostAwareBudget(cost=lambda b, m, t: 1.0 + 0.1 * m, decay=0.9)
    for _ in range(20):
        # Row 0 accepts its whole draft, row 1 nothing.
        linear.observe(rows, [n - 1, n - 1], [n - 1, 0])
    assert linear.row_rate(0) > 0.9 > 0.1 > linear.row_rate(1)
    limits = allocate(linear)
    assert limits[0] > limits[1] == 1
    # Only existing nodes are scored: a short draft is never padded up.
    short = free.allocate(None, _FakeCache(2), rows, torch.tensor([3, 1]), depth, True)
    assert short.tolist() == [3, 1] and short.dtype == torch.int32


def test_cost_aware_budget_counts_conditional_acceptance():
    budget = CostAwareBudget(decay=0.5, prior=0.5, prior_weight=1.0, cost=lambda b, m, t: 1.0)
    # Row 0 offered depth 4 and accepted 2: depths 1, 2 accepted, depth 3 rejected, 4 unseen.
    budget.observe([0], [4], [2])
    # Each depth's prior is the estimate of the depth above (depth 1: `prior`).
    rates = budget._rates(4)
    assert rates[1] == pytest.approx((1 + 0.5) / 2)
    assert rates[2] == pytest.approx((1 + rates[1]) / 2)
    assert rates[3] == pytest.approx((0 + rates[2]) / 2)
    assert rates[4] == pytest.approx(rates[3])  # unseen: the depth above's estimate
    # The gains of a chain: first-token rate times the conditional rates along the path.
    gains = budget.expected_gains([0], torch.arange(5).unsqueeze(0))
    r0 = budget.row_rate(0)
    assert gains[0, 0] == 0.0 and gains[0, 1] == pytest.approx(r0)
    assert gains[0, 3] == pytest.approx(r0 * rates[2] * rates[3])
    # Decay: the counts fade back to the prior (exploration of depths that were cut).
    for _ in range(30):
        budget.observe([0], [0], [0])
    assert budget._rates(3)[3] == pytest.approx(0.5, abs=1e-6)


def test_cost_aware_budget_does_not_promise_unseen_depths_beyond_the_seen_ones():
    """A depth is observed only after the one above was accepted and offered, so the deep depths
    of a budget that kept its drafts short stay unseen. Their estimates follow the depths above:
    a long chain is not scored on the strength of the prior alone."""
    cost = lambda b, m, t: 1.0 + 0.1 * (m - 1)  # noqa: E731 (a node costs a tenth of the pass)
    budget = CostAwareBudget(decay=0.95, cost=cost)
    for step in range(60):
        # One draft token offered per step, accepted three steps in ten.
        budget.observe([0], [1], [int(step % 10 < 3)])
    rates = budget._rates(8)
    assert 0.2 < rates[1] < 0.4
    assert rates[2:].tolist() == pytest.approx([rates[1]] * 7)
    depth = np.arange(9)[None, :]
    limits = budget.allocate(None, _FakeCache(1), [0], np.array([9]), depth, True)
    # One node adds about 0.3 tokens for a tenth of a pass; with the unseen depths at the prior
    # (0.7) a chain of three would look best.
    assert limits.tolist() == [2]


def test_cost_aware_budget_scales_the_curve_to_the_measured_passes():
    """Passes that take twice the calibrated time (a busier machine) double the predictions."""
    budget = CostAwareBudget()
    budget._curve = engine_module._CostCurve(1, [(1, 1e-3), (2, 1.5e-3), (8, 3e-3)], 0.0, True)
    depth = np.arange(4)[None, :]
    for _ in range(100):
        budget.allocate(None, _FakeCache(1), [0], np.array([4]), depth, True)
        predicted_by_the_curve = budget._last_prediction / budget._scale
        budget.observe([0], [0], [0], forward_seconds=2.0 * predicted_by_the_curve)
    assert budget._scale == pytest.approx(2.0, rel=1e-3)
    assert budget._predict(1, 8, 8) == pytest.approx(6e-3, rel=1e-3)


def test_cost_aware_budget_rejects_bad_arguments(target):
    with pytest.raises(ValueError, match="decay"):
        CostAwareBudget(decay=1.0)
    with pytest.raises(ValueError, match="prior"):
        CostAwareBudget(prior=0.0)
    with pytest.raises(ValueError, match="prior_weight"):
        CostAwareBudget(prior_weight=0)
    with pytest.raises(TypeError, match="decay"):
        CostAwareBudget(decay="0.5")
    with pytest.raises(TypeError, match="cost"):
        CostAwareBudget(cost=3)


def test_cost_aware_budget_calibrates_on_the_live_cache(target, references):
    prompts, expected = references
    budget = CostAwareBudget()
    drafter = CachebackDrafter(max_nodes=8, max_depth=6, max_sequences=4, chain=True)
    out = SpeculativeDecoder(target, drafter, budget=budget).generate(
        prompts[:3], max_new_tokens=16, temperature=0.0
    )
    # The timing passes were rolled back: the output is the target's own.
    assert out.sequences == expected[:3]
    curve = engine_module._COST_CURVES[target][3]
    assert curve.ragged and curve.points[-1][0] == 3 * 8
    sizes = [m for m, _ in curve.points]
    costs = [c for _, c in curve.points]
    assert sizes == sorted(sizes) and all(c > 0 for c in costs)
    assert costs == sorted(costs)  # made monotone against timing noise
    assert curve(24, 8) >= curve(3, 1) > 0
    grid = [(1, 1), (2, 8), (3, 1), (7, 3), (24, 8), (40, 14)]  # inside, padded, beyond the last
    many = curve.many(np.array([m for m, _ in grid]), np.array([t for _, t in grid]))
    assert many.tolist() == pytest.approx([curve(m, t) for m, t in grid])


def test_finished_rows_leave_the_batch(target, references):
    """Rows that stop early are dropped from the cache: later passes run on fewer rows, and the
    outputs are still the target's own."""
    prompts, expected = references
    stop = {expected[1][2], expected[4][5]}
    counted = Counting(target)
    out = generate(
        counted,
        prompts,
        drafter=CachebackDrafter(max_nodes=6, max_depth=4, max_sequences=8),
        max_new_tokens=16,
        stop_token_ids=stop,
    )
    for b, row in enumerate(expected):
        cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        assert out.sequences[b] == row[:cut]
    batches = [shape[0] for shape in counted.calls[1:]]
    assert batches == sorted(batches, reverse=True)
    finished_early = sum(1 for r in out.finish_reasons if r == "stop")
    assert finished_early >= 1 and batches[-1] <= 8 - finished_early


def test_padding_of_short_drafts_is_not_computed(target, references, monkeypatch):
    """The engine tells the target how many nodes of each row are real (num_nodes), and
    finished rows still in the cache score none."""
    prompts, expected = references
    seen = []
    original = type(target).forward

    def spy(self, ids, positions, cache, tree_mask=None, output_hidden=None, *, num_nodes=None):
        seen.append(None if num_nodes is None else num_nodes.clone())
        return original(self, ids, positions, cache, tree_mask, output_hidden, num_nodes=num_nodes)

    monkeypatch.setattr(type(target), "forward", spy)
    out = generate(
        target, prompts, drafter=CachebackDrafter(max_nodes=6, max_sequences=8), max_new_tokens=16
    )
    assert out.sequences == expected
    assert seen[0].tolist() == [len(p) - 1 for p in prompts]  # ragged prefill
    assert all(s is not None and int(s.min()) >= 1 for s in seen[1:])


# ---- robust calibration of the cost curve -------------------------------------------------------


def test_fit_line_recovers_a_line_and_ignores_a_slow_point():
    exact = [(m, 2.0 + 0.5 * m) for m in (1, 2, 4, 8, 16, 17)]
    assert [c for _, c in engine_module._fit_line(exact)] == pytest.approx([c for _, c in exact])
    # One size timed during a burst of load (noise only adds time): the line does not move.
    noisy = list(exact)
    noisy[2] = (4, 40.0)
    fitted = engine_module._fit_line(noisy)
    assert [m for m, _ in fitted] == [m for m, _ in exact]
    assert [c for _, c in fitted] == pytest.approx([c for _, c in exact])
    # Falling times (noise at the small sizes) give a flat curve, never a falling one.
    falling = engine_module._fit_line([(1, 5.0), (2, 4.0), (4, 3.0), (8, 2.0)])
    costs = [c for _, c in falling]
    assert costs == sorted(costs) and all(c > 0 for c in costs)
    assert engine_module._fit_line([(3, 1.5)]) == [(3, 1.5)]


def test_fit_curve_keeps_the_one_token_pass_apart():
    """One token runs matrix-vector products, which can cost far less than the line through the
    batched passes says: its measured time stays, capped at the line so the curve never falls."""
    batched = [(m, 5.0 + 0.2 * m) for m in (2, 4, 8, 16, 17)]
    curve = engine_module._fit_curve([(1, 3.6), *batched])
    assert [m for m, _ in curve] == [1, 2, 4, 8, 16, 17]
    assert curve[0][1] == pytest.approx(3.6)
    assert [c for _, c in curve[1:]] == pytest.approx([c for _, c in batched])
    # Fitted with the others (the old curve), the plain step came out at the line's 5.2.
    assert engine_module._fit_line([(1, 3.6), *batched])[0][1] == pytest.approx(5.2)
    # A one-token pass dearer than the line (noise, or no matrix-vector path) is capped.
    assert engine_module._fit_curve([(1, 9.0), *batched])[0][1] == pytest.approx(5.4)
    # Without a one-token pass, or with too few points for a line apart: the plain line.
    assert engine_module._fit_curve(batched) == engine_module._fit_line(batched)
    two = [(1, 3.0), (2, 4.0)]
    assert engine_module._fit_curve(two) == engine_module._fit_line(two)


def test_cost_aware_budget_scores_no_draft_that_a_cheap_plain_step_beats():
    """With the plain step's own cost, a draft accepted one time in ten is not worth a pass of
    two or more tokens (the line would have priced the plain step at its batched cost)."""
    batched = [(m, 5.0 + 0.2 * m) for m in (2, 4, 8, 16, 17)]
    depth = torch.arange(17).unsqueeze(0)

    def limit(points):
        budget = CostAwareBudget(decay=0.9)
        budget._curve = engine_module._CostCurve(1, points, 0.0, True)
        for step in range(40):
            budget.observe([0], [16], [1 if step % 10 == 0 else 0])
        return int(budget.allocate(None, _FakeCache(1), [0], torch.tensor([17]), depth, True)[0])

    assert limit(engine_module._fit_curve([(1, 3.6), *batched])) == 1
    assert limit(engine_module._fit_line([(1, 3.6), *batched])) > 1


class _SleepyTarget:
    """A stand-in target whose pass takes ``a + b * real tokens`` seconds, plus a burst of
    ``burst`` seconds on the calls listed in ``slow`` (a busy machine)."""

    device = torch.device("cpu")

    def __init__(self, a: float, b: float, burst: float, slow: set) -> None:
        self.a, self.b, self.burst, self.slow = a, b, burst, slow
        self.calls: list[int] = []

    def forward(self, tokens, positions, cache, tree_mask=None, *, num_nodes=None):
        import time

        self.calls.append(int(num_nodes.sum()))
        extra = self.burst if len(self.calls) - 1 in self.slow else 0.0
        time.sleep(self.a + self.b * int(num_nodes.sum()) + extra)
        cache.lengths = cache.lengths + tokens.shape[1]


class _LengthsCache:
    def __init__(self, batch: int, length: int, max_length: int) -> None:
        self.batch_size = batch
        self.max_length = max_length
        self.lengths = torch.full((batch,), length, dtype=torch.int64)
        self.truncations = 0

    def truncate(self, lengths) -> None:
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64).clone()
        self.truncations += 1


def test_calibration_interleaves_rounds_and_survives_bursts():
    """Every size is timed once per round (a burst hits one round of several sizes, not all the
    passes of one), every pass is rolled back, and the calibrated line is the target's cost
    although several passes ran during bursts."""
    rng = np.random.default_rng(0)
    shapes = 6 + 2  # sizes 1, 2, 4, 8, 16 and 17 real tokens, then the two padding shapes
    total = shapes * engine_module._CALIBRATION_ROUNDS
    slow = set(rng.choice(total, size=total // 4, replace=False).tolist())
    target = _SleepyTarget(a=2e-3, b=2e-4, burst=2e-2, slow=slow)
    cache = _LengthsCache(1, 10, 100)
    curve = engine_module._calibrate(target, cache, 17, True)
    assert len(target.calls) == total and cache.truncations == total
    assert cache.lengths.tolist() == [10]
    # Round r times the sizes in order: the calls repeat one round's pattern.
    first = target.calls[:shapes]
    assert first[:6] == [1, 2, 4, 8, 16, 17]
    assert target.calls == first * engine_module._CALIBRATION_ROUNDS
    sizes = [m for m, _ in curve.points]
    costs = np.array([c for _, c in curve.points])
    assert sizes == [1, 2, 4, 8, 16, 17]
    slope = (costs[-1] - costs[0]) / 16
    # Sleeping overshoots by a roughly constant amount on a busy machine; the slope is what the
    # budget's choice depends on, and a burst (20 ms) on any used point would swamp it.
    assert 1e-4 < slope < 4e-4
    assert 2e-3 <= costs[0] < 8e-3


def _random_trees(rng: np.random.Generator, batch: int, width: int) -> tuple[np.ndarray, ...]:
    """Random valid trees in the tree format: parents before children, -1 padding at the end."""
    parents = np.full((batch, width), -1, dtype=np.int32)
    tokens = np.full((batch, width), -1, dtype=np.int32)
    num = rng.integers(1, width + 1, size=batch).astype(np.int32)
    for b in range(batch):
        for i in range(1, int(num[b])):
            parents[b, i] = rng.integers(0, i)
        tokens[b, : num[b]] = rng.integers(0, V, size=int(num[b]))
    return tokens, parents, num


@pytest.mark.parametrize("seed", range(6))
def test_prune_keeps_the_ancestor_closed_prefix_and_renumbers(seed):
    from specdecode.engine import _prune

    rng = np.random.default_rng(seed)
    batch, width = 5, 12
    tokens, parents, num = _random_trees(rng, batch, width)
    depth = specdecode.ops.tree_info(parents).depth.numpy()
    random_depths = rng.integers(0, 6, size=batch).astype(np.int32)
    per_row = rng.integers(0, width + 2, size=batch)
    probs = torch.rand((batch, width, 4), generator=torch.Generator().manual_seed(seed))
    # The last two keep only the roots (by nodes, then by depth), the budget's usual choice at low
    # acceptance.
    for node_limit, depth_limit in (
        (per_row, random_depths),
        (torch.from_numpy(per_row), random_depths),
        (int(per_row[0]), random_depths),
        (width, random_depths),
        (np.minimum(per_row, 1), random_depths),
        (width, np.zeros(batch, dtype=np.int32)),
    ):
        # numpy and torch inputs give the same trees
        for as_torch in (False, True):
            args = (tokens, parents, num, probs, depth_limit, node_limit)
            if as_torch:
                args = tuple(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args)
            tree = _prune(*args)
            limits = np.broadcast_to(np.asarray(node_limit), (batch,))
            for b in range(batch):
                kept = [
                    i
                    for i in range(width)
                    if i < num[b]
                    and 0 <= depth[b, i] <= depth_limit[b]
                    and i < max(int(limits[b]), 1)
                ]
                n = len(kept)
                assert int(tree.num_nodes[b]) == n
                assert tree.tokens[b, :n].tolist() == tokens[b, kept].tolist()
                assert (tree.tokens[b, n:] == -1).all()
                want_parents = [-1] + [kept.index(int(parents[b, i])) for i in kept[1:]]
                assert tree.parents[b, :n].tolist() == want_parents
                assert (tree.parents[b, n:] == -1).all()
                assert tree.depth[b, :n].tolist() == depth[b, kept].tolist()
                if tree.draft_probs is not None:
                    torch.testing.assert_close(tree.draft_probs[b, :n], probs[b, kept])
            info = specdecode.ops.tree_info(tree.parents.contiguous())
            assert tree.mask.dtype == info.mask.dtype and torch.equal(info.mask, tree.mask)
            assert tree.depth.dtype == torch.int32 and torch.equal(info.depth, tree.depth)
            assert torch.equal(info.num_nodes, tree.num_nodes)
            assert tree.tokens.dtype == tree.parents.dtype == torch.int32


@pytest.mark.parametrize("budget", [None, "cost"])
def test_finished_rows_kept_in_the_cache_get_root_only_trees(
    target, references, monkeypatch, budget
):
    """With a cache that keeps finished rows (as one without keep_rows does), the running rows
    of different lengths get their drafts, the finished ones a root-only tree, and the outputs
    are still the target's own."""
    from specdecode.engine import CostAwareBudget

    prompts, expected = references
    stop = {expected[1][2], expected[4][5]}
    monkeypatch.setattr(SpeculativeDecoder, "_drop_finished", lambda self, state, cache: None)
    trees = []
    original = SpeculativeDecoder._draft

    def spy(self, state, cache, act, budget, per_row=None):
        tree = original(self, state, cache, act, budget, per_row)
        trees.append((list(act), len(state.rows), tree))
        return tree

    monkeypatch.setattr(SpeculativeDecoder, "_draft", spy)
    decoder = SpeculativeDecoder(
        target,
        CachebackDrafter(max_nodes=6, max_depth=4, max_sequences=8),
        budget=CostAwareBudget(cost=lambda b, m, t: 1.0 + 0.05 * m) if budget else None,
    )
    out = decoder.generate(prompts, max_new_tokens=16, stop_token_ids=stop)
    for b, row in enumerate(expected):
        cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        assert out.sequences[b] == row[:cut]
    partial = [(act, rows, tree) for act, rows, tree in trees if len(act) < rows]
    assert partial  # some steps ran with finished rows in the cache
    for act, rows, tree in partial:
        assert tree.tokens.shape[0] == rows == 8
        for i in range(rows):
            if i not in act:
                assert int(tree.num_nodes[i]) == 1
                assert tree.tokens[i, 1:].eq(-1).all()


# ---- on a GPU ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_models():
    """The target and draft fixtures' models, built afresh on the GPU (a model that ran on the
    CPU holds packed CPU weights, which deepcopy cannot copy)."""
    return tiny_transformer(seed=1).to("cuda"), tiny_transformer(seed=2, layers=1).to("cuda")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("kind", DRAFTERS)
def test_cuda_greedy_equals_the_targets_own_decoding(kind, cuda_models, references):
    """The whole loop with the models on a GPU (tree attention, compaction and verify on CUDA):
    each drafter's greedy output is the target's own greedy decoding on that GPU, for batches of
    1 and 8 rows of different lengths."""
    prompts, _ = references
    gpu_target, gpu_draft = cuda_models
    for batch in (1, 8):
        plain = generate(gpu_target, prompts[:batch], max_new_tokens=16, temperature=0.0)
        out = SpeculativeDecoder(gpu_target, make_drafter(kind, gpu_draft)).generate(
            prompts[:batch], max_new_tokens=16, temperature=0.0
        )
        assert out.sequences == plain.sequences, f"batch {batch}"
        assert out.stats.new_tokens == 16 * batch


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("kind", ["chain", "combined"])
def test_cuda_sampling_equals_the_cpu_run(kind, target, draft_model, cuda_models):
    """Sampled generation on a GPU draws the CPU run's tokens: verify's and the draft's
    randomness are keyed by (seed, offset, node), not by device. The models' logits differ by
    float rounding between the devices, which could flip a draw only when a uniform falls within
    about 1e-6 of a boundary (odds near 1e-4 over this run's draws); seeds make it repeatable."""
    prompts = prompts_for(4)
    kwargs = dict(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95, seed=[7, 8, 9, 10])
    cpu = generate(target, prompts, drafter=make_drafter(kind, draft_model), **kwargs)
    gpu_target, gpu_draft = cuda_models
    gpu = generate(gpu_target, prompts, drafter=make_drafter(kind, gpu_draft), **kwargs)
    assert gpu.sequences == cpu.sequences
    assert gpu.stats.steps == cpu.stats.steps
    again = generate(gpu_target, prompts, drafter=make_drafter(kind, gpu_draft), **kwargs)
    assert again.sequences == gpu.sequences
