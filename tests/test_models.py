"""ModelConfig, Transformer.forward_train and the Hugging Face checkpoint layout."""

from __future__ import annotations

import json
import math

import pytest
import torch
from reference_models import (
    BASE,
    LLAMA3_ROPE_SCALING,
    YARN_ROPE_SCALING,
    hf_config,
    hf_logits,
    hf_model,
    randomize,
    transformers,
)
from specdecode.models import ModelConfig, Transformer

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral"]
DENSE = ["llama", "qwen2", "qwen3", "mistral", "phi3"]


def family_overrides(family: str) -> dict:
    """What a ModelConfig of the family needs beyond BASE (Qwen2's biases, the experts)."""
    if family == "qwen2":
        return {"attention_bias": True}
    if family in ("qwen3_moe", "mixtral"):
        return {"num_experts": 4, "num_experts_per_tok": 2}
    return {}


LLAMA3 = LLAMA3_ROPE_SCALING
YARN = YARN_ROPE_SCALING
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": LLAMA3,
    "yarn": YARN,
}


def tiny_config(**overrides) -> ModelConfig:
    kwargs = dict(BASE)
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# ---- ModelConfig ---------------------------------------------------------------------------


def test_config_defaults():
    c = ModelConfig(
        vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4,
    )  # fmt: skip
    assert c.num_key_value_heads == 4
    assert c.head_dim == 16
    assert c.num_groups == 1
    assert c.max_length == c.max_position_embeddings


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"num_key_value_heads": 3}, ValueError, "num_key_value_heads"),
        ({"model_type": "gpt2"}, ValueError, "model_type"),
        ({"rope_scaling": {"rope_type": "su", "factor": 4.0}}, ValueError, "'su'"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, TypeError, "factor"),
        ({"rope_scaling": {**YARN, "beta_fast": 1.0}}, ValueError, "beta_fast must exceed"),
        ({"rope_scaling": {**YARN, "beta_slow": -1.0}}, ValueError, "beta_slow"),
        ({"rope_scaling": {**YARN, "truncate": 1}}, TypeError, "truncate"),
        ({"rope_scaling": {**YARN, "attention_factor": 0.0}}, ValueError, "attention_factor"),
        ({"rope_scaling": {**YARN, "factor": "8"}}, TypeError, "factor"),
        ({"rope_scaling": {"rope_type": "yarn", "mscale": "1"}}, TypeError, "mscale"),
        (
            {"rope_scaling": {**YARN, "original_max_position_embeddings": 32.0}},
            TypeError,
            "original_max_position_embeddings",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, TypeError, "factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, ValueError, "factor"),
        ({"rope_scaling": "linear"}, TypeError, "rope_scaling"),
        ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, ValueError, "high_freq_factor"),
        ({"rope_scaling": {**LLAMA3, "low_freq_factor": None}}, TypeError, "low_freq_factor"),
        (
            {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0}},
            ValueError,
            "original_max_position_embeddings",
        ),
        ({"rope_scaling": {**LLAMA3, "partial_rotary_factor": 0.5}}, ValueError, "partial"),
        ({"vocab_size": 0}, ValueError, "vocab_size"),
        ({"hidden_size": 130, "num_attention_heads": 4}, ValueError, "head_dim"),
        ({"head_dim": 63}, ValueError, "head_dim"),
        ({"rms_norm_eps": -1.0}, ValueError, "rms_norm_eps"),
        ({"vocab_size": 10.0}, TypeError, "vocab_size"),
        ({"model_type": "qwen2", "attention_bias": False}, ValueError, "attention_bias"),
        ({"model_type": "mistral", "attention_bias": True}, ValueError, "attention_bias"),
        ({"eos_token_id": [2, -1]}, ValueError, "eos_token_id"),
        ({"pad_token_id": -2}, ValueError, "pad_token_id"),
        ({"bos_token_id": -1}, ValueError, "bos_token_id"),
    ],
)
def test_config_rejects(overrides, error, match):
    with pytest.raises(error, match=match):
        tiny_config(**overrides)


def test_config_takes_pad_token_id_minus_one():
    """Some Llama exports write pad_token_id -1 for "none"; it loads and round-trips."""
    ours = tiny_config(pad_token_id=-1)
    assert ModelConfig.from_hf_config(json.loads(json.dumps(ours.to_hf_config()))) == ours


@pytest.mark.parametrize("family", FAMILIES)
def test_config_hf_roundtrip(family):
    ours = tiny_config(model_type=family, tie_word_embeddings=True, **family_overrides(family))
    hf = ours.to_hf_config()
    assert hf["architectures"] == [
        {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM",
            "phi3": "Phi3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "mixtral": "MixtralForCausalLM",
        }[family]
    ]
    assert ModelConfig.from_hf_config(json.loads(json.dumps(hf))) == ours
    # transformers reads the same numbers back.
    theirs = transformers.AutoConfig.for_model(**hf)
    assert theirs.model_type == family
    assert theirs.num_key_value_heads == ours.num_key_value_heads
    assert theirs.rope_parameters["rope_theta"] == ours.rope_theta
    assert ModelConfig.from_hf_config(theirs.to_dict()) == ours


def test_config_from_transformers_configs():
    for family in FAMILIES:
        c = ModelConfig.from_hf_config(hf_config(family).to_dict())
        assert c.model_type == family
        assert c.attention_bias == (family == "qwen2")
        assert c.rope_theta == BASE["rope_theta"]
        assert c.head_dim == 64
    # The transformers 4 spelling of RoPE.
    legacy = hf_config("llama").to_dict()
    legacy.pop("rope_parameters")
    legacy.update(rope_theta=123.0, rope_scaling=None)
    assert ModelConfig.from_hf_config(legacy).rope_theta == 123.0
    # A Mistral window is kept: the model refuses sequences longer than it.
    c = ModelConfig.from_hf_config(hf_config("mistral", sliding_window=64).to_dict())
    assert c.sliding_window == 64 and c.max_length == 64


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e4}}, "'ntk'"),
        ({"rope_parameters": "llama3"}, "rope_parameters"),
        ({"rope_parameters": None, "rope_scaling": {"type": "su", "factor": 2.0}}, "'su'"),
        ({"rope_parameters": None, "rope_scaling": [2.0]}, "rope_scaling"),
    ],
)
def test_config_from_hf_rejects_unsupported(change, match):
    hf = hf_config("llama").to_dict()
    hf.update(change)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(hf)


def test_config_rope_scaling_forms():
    """Both transformers spellings read into one normalised dict; llama3 without a pretraining
    context takes max_position_embeddings (as transformers does); 'default' is plain RoPE."""
    c = tiny_config(rope_scaling={"type": "linear", "factor": 2})
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    partial = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    c = tiny_config(rope_scaling=partial)
    assert c.rope_scaling["original_max_position_embeddings"] == BASE["max_position_embeddings"]
    assert tiny_config(rope_scaling={"rope_type": "default"}).rope_scaling is None
    legacy = hf_config("llama").to_dict()
    legacy.pop("rope_parameters")
    legacy.update(rope_theta=500.0, rope_scaling={"type": "linear", "factor": 3.0})
    c = ModelConfig.from_hf_config(legacy)
    assert (c.rope_theta, c.rope_scaling) == (500.0, {"rope_type": "linear", "factor": 3.0})


def test_config_yarn_defaults():
    """YaRN's optional parameters take transformers' defaults, stored: the pretraining context
    max_position_embeddings, betas 32 and 1, truncated ramp, attention factor 0.1 ln(factor) + 1
    (or the ratio of the two mscale corrections where both are given); no factor is the ratio of
    the two contexts."""
    c = tiny_config(rope_scaling={"type": "yarn", "factor": 4})
    assert c.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": BASE["max_position_embeddings"],
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": True,
        "attention_factor": pytest.approx(1 + 0.1 * math.log(4), abs=1e-15),
    }
    c = tiny_config(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 64})
    assert c.rope_scaling["factor"] == BASE["max_position_embeddings"] / 64
    mscales = {"mscale": 1.0, "mscale_all_dim": 0.5}
    c = tiny_config(rope_scaling={"rope_type": "yarn", "factor": 8.0, **mscales})
    expected = (1 + 0.1 * math.log(8)) / (1 + 0.05 * math.log(8))
    assert c.rope_scaling["attention_factor"] == pytest.approx(expected, abs=1e-15)
    assert "mscale" not in c.rope_scaling
    # A context not stretched: no correction.
    c = tiny_config(rope_scaling={"rope_type": "yarn", "factor": 1.0})
    assert c.rope_scaling["attention_factor"] == 1.0


def test_config_top_level_pretraining_context_wins():
    """A config.json with original_max_position_embeddings at the top level (Phi-3 style) uses
    it over the scaling's own, as transformers does."""
    for scaling in (LLAMA3, YARN):
        hf = hf_config("llama").to_dict()
        hf["rope_parameters"] = {**scaling, "rope_theta": BASE["rope_theta"]}
        hf["original_max_position_embeddings"] = 64
        c = ModelConfig.from_hf_config(hf)
        assert c.rope_scaling["original_max_position_embeddings"] == 64
        hf.pop("rope_parameters")
        hf.update(rope_theta=BASE["rope_theta"], rope_scaling=dict(scaling))
        assert ModelConfig.from_hf_config(hf) == c


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_config_rope_scaling_roundtrip(scaling):
    ours = tiny_config(rope_scaling=ROPE_SCALINGS[scaling])
    hf = ours.to_hf_config()
    assert ModelConfig.from_hf_config(json.loads(json.dumps(hf))) == ours
    theirs = transformers.AutoConfig.for_model(**hf)
    assert theirs.rope_parameters["rope_type"] == scaling
    assert theirs.rope_parameters["factor"] == ours.rope_scaling["factor"]
    assert ModelConfig.from_hf_config(theirs.to_dict()) == ours


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_scaled_rope_checkpoint_has_transformers_logits(tmp_path, scaling):
    """A Llama checkpoint with scaled RoPE (Llama 3.1-3.3 write llama3) loads with the logits
    transformers computes, over positions past the pretraining context; and ours loads there."""
    rope = {**ROPE_SCALINGS[scaling], "rope_theta": BASE["rope_theta"]}
    theirs = hf_model("llama", rope_parameters=rope)
    theirs.save_pretrained(tmp_path / "theirs")
    ours = Transformer.from_pretrained(tmp_path / "theirs")
    assert ours.config.rope_scaling == ROPE_SCALINGS[scaling]
    # Dynamic NTK: up to the model's whole length, where it is plain RoPE in transformers too.
    ids = _ids(2, BASE["max_position_embeddings"] if scaling == "dynamic" else 90, seed=7)
    expected = hf_logits(theirs, ids)
    torch.testing.assert_close(ours.forward_train(ids), expected, rtol=1e-4, atol=1e-4)
    # The scaling matters to these logits: plain RoPE gives others (dynamic NTK: the same).
    gap = _plain_rope_gap(ours, "llama", ids, expected)
    assert gap < 1e-4 if scaling == "dynamic" else gap > 0.05
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    torch.testing.assert_close(hf_logits(again, ids), expected, rtol=1e-4, atol=1e-4)


def test_dynamic_ntk_refuses_positions_past_its_plain_range():
    """Past max_position_embeddings dynamic NTK would rescale: a position there raises instead
    of silently using plain RoPE (the cache limits every sequence to the range)."""
    ours = Transformer(tiny_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    cache = ours.new_cache(1)
    limit = BASE["max_position_embeddings"]
    with pytest.raises(ValueError, match="dynamic NTK"):
        ours(torch.tensor([[5]]), torch.tensor([[limit]]), cache)
    logits = ours(torch.tensor([[5]]), torch.tensor([[limit - 1]]), cache)
    assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"mscale": 1.0, "mscale_all_dim": 0.5},
        {"attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
        {"original_max_position_embeddings": None, "top_level_context": 64},
    ],
    ids=["defaults", "mscales", "explicit", "top-level-context"],
)
def test_yarn_checkpoint_has_transformers_logits(tmp_path, options):
    """Qwen2 checkpoints with YaRN in the forms its exports take (defaults left out, DeepSeek's
    mscale pair, every parameter given, the pretraining context at the top level) give the
    logits transformers computes, well past the pretraining context."""
    options = dict(options)
    top_level = options.pop("top_level_context", None)
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
    rope = {k: v for k, v in {**rope, **options}.items() if v is not None}
    extra = {} if top_level is None else {"original_max_position_embeddings": top_level}
    theirs = hf_model("qwen2", rope_parameters={**rope, "rope_theta": BASE["rope_theta"]}, **extra)
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    assert ours.config.rope_scaling["original_max_position_embeddings"] == (top_level or 32)
    ids = _ids(2, 90, seed=11)
    expected = hf_logits(theirs, ids)
    torch.testing.assert_close(ours.forward_train(ids), expected, rtol=1e-4, atol=1e-4)


def test_config_from_hf_missing_size():
    hf = hf_config("llama").to_dict()
    del hf["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_config(hf)


# ---- parameter layout ----------------------------------------------------------------------


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_is_hf_layout(family, tied):
    ours = Transformer(
        ModelConfig.from_hf_config(hf_config(family, tie_word_embeddings=tied).to_dict())
    )
    theirs = hf_model(family, tie_word_embeddings=tied)
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    theirs_shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert ours_shapes == theirs_shapes
    if tied:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_state_dict_is_the_checkpoint_layout(tmp_path, family):
    """Every tensor of a sparse model under the name and shape its Hugging Face checkpoints
    use (experts one by one: Qwen3-MoE's mlp.experts.N.gate_proj, Mixtral's
    block_sparse_moe.experts.N.w1; transformers fuses them in memory only)."""
    from safetensors import safe_open

    hf_model(family, mlp_only_layers=[0] if family == "qwen3_moe" else []).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    ours = Transformer(ModelConfig.from_json_file(tmp_path / "config.json"))
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    names = "mlp.experts.3.up_proj" if family == "qwen3_moe" else "block_sparse_moe.experts.3.w3"
    assert f"model.layers.1.{names}.weight" in theirs
    if family == "qwen3_moe":  # layer 0 is dense (mlp_only_layers)
        assert "model.layers.0.mlp.up_proj.weight" in theirs


@pytest.mark.parametrize(
    "family, renormalise", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)]
)
def test_moe_routing_matches_transformers(tmp_path, family, renormalise):
    """Logits equal to transformers' with every token routed to 2 of 4 experts, both router
    normalisations (Mixtral always renormalises), on forward_train and the cached path; the
    routing matters (another top k gives other logits)."""
    extra = {"norm_topk_prob": renormalise} if family == "qwen3_moe" else {}
    theirs = hf_model(family, **extra)
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    assert ours.config.norm_topk_prob == renormalise
    # transformers' own state_dict (experts fused into [E, ...] tensors) loads to the same.
    fused = Transformer(ours.config)
    fused.load_state_dict(theirs.state_dict())
    for key, value in ours.state_dict().items():
        assert torch.equal(value, fused.state_dict()[key]), key
    ids = _ids(2, 30, seed=4)
    expected = hf_logits(theirs, ids)
    _assert_both_paths_give(ours, ids, expected)
    for layer in ours.model.layers:
        layer.feed_forward.top_k = 1
    assert float((ours.forward_train(ids) - expected).detach().abs().max()) > 0.05


def _longrope(head_dim: int = 64, seed: int = 0) -> dict:
    """A LongRoPE scaling with random per-frequency divisors (short 1-4, long 1-21)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "rope_type": "longrope",
        "short_factor": (1 + 3 * torch.rand(head_dim // 2, generator=g)).tolist(),
        "long_factor": (1 + 20 * torch.rand(head_dim // 2, generator=g)).tolist(),
    }


def test_phi3_longrope_within_its_pretraining_context(tmp_path):
    """Phi-3's 128k-context scaling (LongRoPE, the pretraining context at the top level of
    config.json): logits equal to transformers' up to that context, where the short factors and
    the attention factor sqrt(1 + ln(f) / ln(n)) apply; the model's length stops there (past it
    transformers switches every position of a pass to the long factors)."""
    rope = {**_longrope(), "rope_theta": BASE["rope_theta"]}
    theirs = hf_model("phi3", rope_parameters=rope, original_max_position_embeddings=64)
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    scaling = ours.config.rope_scaling
    assert scaling["original_max_position_embeddings"] == 64 and scaling["factor"] == 4.0
    assert scaling["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
    assert ours.config.max_length == 64 and ours.new_cache(1).max_length == 64
    ids = _ids(2, 64, seed=12)
    expected = hf_logits(theirs, ids)
    _assert_both_paths_give(ours, ids, expected)
    assert _plain_rope_gap(ours, "phi3", ids, expected) > 0.05
    with pytest.raises(ValueError, match="LongRoPE"):
        ours(torch.tensor([[3]]), torch.tensor([[64]]), ours.new_cache(1))
    # And back: transformers reads our checkpoint with the same scaling.
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    torch.testing.assert_close(hf_logits(again, ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"short_factor": [1.0] * 31}, ValueError, "short_factor"),
        ({"long_factor": None}, TypeError, "long_factor"),
        ({"short_factor": [0.0] * 32}, ValueError, "short_factor"),
        ({"attention_factor": -1.0}, ValueError, "attention_factor"),
    ],
)
def test_longrope_config_errors(change, error, match):
    with pytest.raises(error, match=match):
        tiny_config(model_type="phi3", rope_scaling={**_longrope(), **change})


@pytest.mark.parametrize("partial", [0.5, 0.75])
@pytest.mark.parametrize("longrope", [False, True])
def test_phi3_partial_rotary_matches_transformers(tmp_path, partial, longrope):
    """RoPE on the first part of each head (Phi-4-mini: 0.75 with LongRoPE), the rest passed
    through: logits equal to transformers' on both paths, full RoPE's differ, and transformers
    reads our checkpoint back with the same logits."""
    rot = int(BASE["hidden_size"] // BASE["num_attention_heads"] * partial)
    rope = {"rope_type": "default", "rope_theta": BASE["rope_theta"]}
    extra = {}
    if longrope:
        rope.update(_longrope(rot))
        extra["original_max_position_embeddings"] = 64
    rope["partial_rotary_factor"] = partial
    theirs = hf_model("phi3", rope_parameters=rope, **extra)
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    assert (ours.config.partial_rotary_factor, ours.config.rotary_dim) == (partial, rot)
    ids = _ids(2, 50, seed=13)
    expected = hf_logits(theirs, ids)
    _assert_both_paths_give(ours, ids, expected)
    assert _plain_rope_gap(ours, "phi3", ids, expected) > 0.05
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    torch.testing.assert_close(hf_logits(again, ids), expected, rtol=1e-4, atol=1e-4)


def test_partial_rotary_factor_errors():
    """Only Phi-3-style models rotate part of a head; the rotated dims must be even; a scaling
    dict that states another fraction than the config's is refused."""
    with pytest.raises(ValueError, match="whole heads"):
        tiny_config(partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="even"):
        tiny_config(model_type="phi3", partial_rotary_factor=0.3)  # 19 of 64 dims
    with pytest.raises(ValueError, match="fraction"):
        tiny_config(model_type="phi3", partial_rotary_factor=1.5)
    with pytest.raises(ValueError, match="differs"):
        tiny_config(
            model_type="phi3",
            partial_rotary_factor=0.5,
            rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.75},
        )
    hf = hf_config("llama").to_dict()
    hf["partial_rotary_factor"] = 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf_config(hf)


def test_qwen3_moe_config_json_defaults():
    """A Qwen3-MoE config.json without norm_topk_prob reads it as transformers does (False); one
    without its experts' width or count per token is refused (transformers' defaults, 768 and 8,
    fit no small checkpoint)."""
    hf = hf_config("qwen3_moe").to_dict()
    hf.pop("norm_topk_prob")
    assert ModelConfig.from_hf_config(hf).norm_topk_prob is False
    for key in ("moe_intermediate_size", "num_experts_per_tok"):
        broken = dict(hf)
        broken.pop(key)
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_hf_config(broken)


def test_moe_config_errors():
    with pytest.raises(ValueError, match="num_experts"):
        tiny_config(model_type="mixtral")
    with pytest.raises(ValueError, match="dense"):
        tiny_config(num_experts=4)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_config(model_type="qwen3_moe", num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="renormalises"):
        tiny_config(model_type="mixtral", num_experts=4, norm_topk_prob=False)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        tiny_config(model_type="qwen3_moe", num_experts=4, mlp_only_layers=[5])
    with pytest.raises(TypeError, match="num_experts"):
        tiny_config(model_type="qwen3_moe", num_experts=4.0)
    c = tiny_config(model_type="qwen3_moe", num_experts=4, decoder_sparse_step=2)
    assert [c.sparse_layer(i) for i in range(2)] == [False, True]
    assert c.moe_intermediate_size == BASE["intermediate_size"]


def test_init_matches_hf_scheme():
    model = Transformer(tiny_config(initializer_range=0.05, attention_bias=True))
    q = model.model.layers[0].self_attn.q_proj
    assert abs(float(q.weight.detach().std()) - 0.05) < 0.01
    assert torch.count_nonzero(q.bias) == 0
    assert torch.equal(model.model.norm.weight, torch.ones(BASE["hidden_size"]))


# ---- forward_train parity with transformers ------------------------------------------------


def _plain_rope_gap(model: Transformer, family: str, ids: torch.Tensor, expected: torch.Tensor):
    """The largest logit gap to ``expected`` of ``model``'s weights under plain, whole-head RoPE
    (the family's default config): how much the model's RoPE variant matters to them."""
    plain = Transformer(ModelConfig.from_hf_config(hf_config(family).to_dict()))
    plain.load_state_dict(model.state_dict())
    return float((plain.forward_train(ids) - expected).detach().abs().max())


def _assert_both_paths_give(model: Transformer, ids: torch.Tensor, expected: torch.Tensor):
    """forward_train and the cached inference path (one prefill pass) both give ``expected``."""
    torch.testing.assert_close(model.forward_train(ids), expected, rtol=1e-4, atol=1e-4)
    cache = model.new_cache(ids.shape[0])
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    torch.testing.assert_close(model(ids, positions, cache), expected, rtol=1e-4, atol=1e-4)


def _ids(batch: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, BASE["vocab_size"], (batch, t), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_hf_checkpoint_loads_with_same_logits(tmp_path, family, tied):
    theirs = hf_model(family, tie_word_embeddings=tied)
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    assert ours.config.model_type == family
    ids = _ids(3, 17)
    expected = hf_logits(theirs, ids)
    got = ours.forward_train(ids)
    assert got.shape == (3, 17, BASE["vocab_size"])
    assert float(expected.abs().max()) > 1.0  # the random weights make the logits non-trivial
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_our_checkpoint_loads_in_transformers(tmp_path, family, tied):
    overrides = family_overrides(family)
    ours = randomize(
        Transformer(tiny_config(model_type=family, tie_word_embeddings=tied, **overrides)), seed=3
    )
    ours.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["config.json", "model.safetensors"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == ours.config.to_hf_config()["architectures"][0]
    ids = _ids(2, 21, seed=5)
    torch.testing.assert_close(
        ours.forward_train(ids).detach(), hf_logits(theirs, ids), rtol=1e-4, atol=1e-4
    )
    # And back: the round trip keeps every tensor.
    again = Transformer.from_pretrained(tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


@pytest.mark.parametrize("bias", [False, True])
def test_qwen3_head_norms_with_a_head_dim_of_its_own(tmp_path, bias):
    """Qwen3 as published: head_dim * heads != hidden_size (0.6B: 16 x 128 over 1024), q_norm /
    k_norm on every head before RoPE, GQA; with attention_bias also an o bias, as transformers
    builds it. Same logits on both paths, and the norms matter to them."""
    sizes = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=bias)
    theirs = hf_model("qwen3", **sizes)
    assert (theirs.model.layers[0].self_attn.o_proj.bias is not None) == bias
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    assert (ours.config.head_dim, ours.config.o_bias) == (64, bias)
    ids = _ids(2, 40, seed=9)
    expected = hf_logits(theirs, ids)
    _assert_both_paths_give(ours, ids, expected)
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.k_norm.weight.fill_(1.0)
    assert float((ours.forward_train(ids) - expected).detach().abs().max()) > 0.05


def test_llama_attention_bias_and_gqa_groups(tmp_path):
    theirs = hf_model(
        "llama", attention_bias=True, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    )
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    assert ours.model.layers[0].self_attn.o_proj.bias is not None
    ids = _ids(2, 9)
    torch.testing.assert_close(
        ours.forward_train(ids), hf_logits(theirs, ids), rtol=1e-4, atol=1e-4
    )


def test_forward_train_is_differentiable():
    model = Transformer(tiny_config())
    ids = _ids(2, 8)
    logits = model.forward_train(ids)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert float(model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum()) > 0


def test_forward_train_is_causal():
    model = Transformer(tiny_config())
    ids = _ids(1, 12)
    changed = ids.clone()
    changed[0, 7] = (changed[0, 7] + 1) % BASE["vocab_size"]
    a, b = model.forward_train(ids), model.forward_train(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_bf16_matches_transformers(tmp_path):
    theirs = hf_model("llama")
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    ids = _ids(2, 10)
    theirs = theirs.to(torch.bfloat16)
    got, expected = ours.forward_train(ids), hf_logits(theirs, ids)
    assert got.dtype == torch.bfloat16
    # bf16 rounding differs with the order of operations; a few ulps of the logits' scale.
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0.03 * scale)


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (torch.tensor([[1, 2, 101]]), ValueError, "outside the vocabulary"),
        (torch.tensor([[-1, 2]]), ValueError, "outside the vocabulary"),
        (torch.tensor([1, 2]), ValueError, r"\[B, T\]"),
        (torch.tensor([[1.0, 2.0]]), TypeError, "integer"),
        (torch.zeros(1, 257, dtype=torch.int64), ValueError, "max length"),
        ([[1, 2]], TypeError, "torch.Tensor"),
    ],
)
def test_forward_train_rejects_bad_input(ids, error, match):
    model = Transformer(tiny_config())
    with pytest.raises(error, match=match):
        model.forward_train(ids)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(tmp_path)
    hf_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        Transformer.from_pretrained(tmp_path)
    cfg["num_hidden_layers"] = 2
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        Transformer.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        Transformer.from_pretrained(tmp_path)


def test_from_pretrained_dtype(tmp_path):
    """The default is the stored embedding's dtype; a given dtype must be a float of 16 bits or
    more (a string failed as a device name, float8 loaded and failed in the first forward)."""
    from safetensors.torch import load_file, save_file

    Transformer(tiny_config()).to(torch.bfloat16).save_pretrained(tmp_path)
    assert Transformer.from_pretrained(tmp_path).dtype == torch.bfloat16
    assert Transformer.from_pretrained(tmp_path, dtype=torch.float32).dtype == torch.float32
    for bad in ("bfloat16", torch.int8, torch.float8_e4m3fn, torch.complex64):
        with pytest.raises(TypeError, match="dtype: expected a floating-point"):
            Transformer.from_pretrained(tmp_path, dtype=bad)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int8)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(TypeError, match="dtype: the checkpoint stores model.embed_tokens.weight"):
        Transformer.from_pretrained(tmp_path)
    assert Transformer.from_pretrained(tmp_path, dtype=torch.float16).dtype == torch.float16


def test_gpt2_checkpoint_is_refused(tmp_path):
    from reference_models import gpt2_model

    gpt2_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="HFCausalLM"):
        Transformer.from_pretrained(tmp_path)
