"""Tiny random Hugging Face models for the model-layer tests (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch

transformers = __import__("pytest").importorskip(
    "transformers", reason="transformers is needed for parity tests (pip install .[test])"
)

# head_dim 64 so that the inference path runs on ops.tree_attention (it supports 64..256).
BASE = dict(
    vocab_size=101,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=1000.0,
    bos_token_id=1,
    eos_token_id=2,
)


# Llama 3.1's RoPE scaling with a pretraining context of 32 tokens, so that the head dim of 64
# (wavelengths about 6 to 5000 at BASE's rope_theta) falls into all three of its bands: kept (below
# 32 / 4), blended, stretched (above 32 / 1).
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


# YaRN (Qwen2.5 / Qwen3's long-context setting) stretching the same 32-token context 8 times, to
# BASE's max_position_embeddings of 256 (transformers warns when the two disagree), in the
# explicit form a ModelConfig keeps. Over 32 positions the head dim of 64 has frequency index 0
# turning more than beta_fast times (kept), indices 1-7 on the ramp, 8-31 interpolated.
YARN_ROPE_SCALING = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": True,
    "attention_factor": 1.25,
}


# The mixture-of-experts families: 4 experts, 2 per token (Qwen3-MoE's experts narrower than its
# dense MLP, with the renormalised router of Qwen3-30B-A3B's config).
MOE_EXPERTS = {
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def hf_config(model_type: str, **overrides: Any):
    """A transformers config object of the given family."""
    kwargs = dict(BASE)
    kwargs.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "phi3": transformers.Phi3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
    }[model_type]
    if model_type in ("mistral", "mixtral"):
        kwargs.setdefault("sliding_window", None)
    if model_type == "phi3":  # Phi3Config's pad id (32000) lies outside BASE's vocabulary
        kwargs.setdefault("pad_token_id", None)
    if model_type in ("qwen3", "qwen3_moe"):  # head_dim defaults to 128 whatever the sizes
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if model_type in MOE_EXPERTS:
        for key, value in MOE_EXPERTS[model_type].items():
            kwargs.setdefault(key, value)
    return cls(**kwargs)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> torch.nn.Module:
    """Weights far from the tiny default init, so that every term matters to the logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("ln_f.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen) * (4.0 if p.dim() == 1 else 1.0))
    return model


def hf_model(model_type: str, seed: int = 0, **overrides: Any):
    """A randomised transformers causal LM in eval mode with the eager/sdpa attention."""
    torch.manual_seed(seed)
    config = hf_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    randomize(model, seed)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def gpt2_model(seed: int = 0, **overrides: Any):
    kwargs = dict(
        vocab_size=101,
        n_embd=64,
        n_layer=2,
        n_head=2,
        n_positions=128,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs))
    randomize(model, seed)
    return model.eval()


@torch.no_grad()
def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The full-sequence logits transformers computes itself."""
    return model(input_ids=input_ids, use_cache=False).logits
