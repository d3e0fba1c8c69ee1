"""A Llama-style decoder on specdecode's ops, in the Hugging Face parameter layout.

Parameter names are exactly those of transformers' ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` / ``MistralForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``), so
``state_dict()`` is the content of their ``model.safetensors`` (minus ``lm_head.weight`` when the
embeddings are tied, as transformers saves it).

Two forward paths share every layer:

* :meth:`Transformer.forward_train`: a plain differentiable causal LM over whole sequences
  (``scaled_dot_product_attention(is_causal=True)``), for training.
* :meth:`Transformer.forward`: incremental inference over a static :class:`KVCache` with
  explicit positions and an optional tree mask, attention through
  :func:`specdecode.ops.tree_attention` (the :class:`~specdecode.models.CausalLM` protocol).
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .._ops.attention import tree_attention_in_cache
from ._checks import (
    check_float_dtype,
    check_hidden_indices,
    check_num_nodes,
    check_positive_int,
    check_steer,
    check_tokens,
    check_tree_mask,
)
from .cache import KVCache
from .config import ModelConfig
from .io import CONFIG_NAME, dtype_name, load_state_dict, read_config, save_state_dict

PathLike = Union[str, os.PathLike]

# attention(layer index, q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]) -> [B,T,Hq,D]
_AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(config: ModelConfig, device: Optional[torch.device] = None) -> torch.Tensor:
    """The RoPE frequencies of a config, float32 ``[R / 2]`` for the ``R = config.rotary_dim``
    rotated dims of a head: ``rope_theta ** (-2i / R)``, rescaled by ``config.rope_scaling``
    (linear, Llama 3's by wavelength, YaRN's by turns, LongRoPE's short factors; dynamic NTK's is
    plain RoPE within the model's length), in float32 and in the order of operations transformers
    uses, so that the angles match its to the last bit."""
    d = config.rotary_dim
    steps = torch.arange(0, d, 2, dtype=torch.float32, device=device) / d
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config.rope_theta**steps, d, config.rope_theta, scaling)
    if scaling is not None and scaling["rope_type"] == "longrope":
        # The short factors: all a model computes (ModelConfig.max_length stops at the
        # pretraining context, past which transformers switches to the long ones).
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (short * config.rope_theta**steps)
    inv_freq = 1.0 / (config.rope_theta**steps)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "dynamic":
        # Dynamic NTK changes the base only for sequences past max_position_embeddings, which
        # forward_train and every cache refuse (ModelConfig.max_length): plain RoPE here.
        return inv_freq
    # llama3: measured against the pretraining context n, wavelengths longer than n / low are
    # stretched by `factor`, shorter than n / high kept, and those between blended linearly in
    # n / wavelength (the blend is 0 at n / low and 1 at n / high, so the bands join).
    n = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    blend = (n / wavelen - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen > n / low, inv_freq / factor, inv_freq)
    between = (wavelen >= n / high) & (wavelen <= n / low)
    return torch.where(between, blended, scaled)


def _yarn_dim(turns: float, d: int, base: float, context: int) -> float:
    """The (fractional) frequency index whose wave turns ``turns`` times over ``context``
    positions: index i turns context / (2 pi base^(2i / d)) times."""
    return (d * math.log(context / (turns * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(pos_freqs: torch.Tensor, d: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequency indices below the one turning ``beta_fast`` times over the pretraining
    context keep their frequency (extrapolated), those above the one turning ``beta_slow`` times
    are divided by ``factor`` (interpolated), linearly ramped between (over whole indices where
    ``truncate``). pos_freqs: float32 ``base ** (2i / d)``, ``[d / 2]``."""
    context = scaling["original_max_position_embeddings"]
    low = _yarn_dim(scaling["beta_fast"], d, base, context)
    high = _yarn_dim(scaling["beta_slow"], d, base, context)
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:  # a ramp of zero width: transformers widens it by 0.001
        high += 0.001
    ramp = (torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)
    keep = (1 - torch.clamp(ramp, 0, 1)).to(pos_freqs.device)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (scaling["factor"] * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep


def _rope_attention_factor(config: ModelConfig) -> float:
    """The factor on cos and sin (so on every attention logit squared): YaRN's and LongRoPE's,
    else 1."""
    scaling = config.rope_scaling
    if scaling and scaling["rope_type"] in ("yarn", "longrope"):
        return scaling["attention_factor"]
    return 1.0


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, D]``; cos/sin ``[B, T, R]`` (non-interleaved halves, the HF convention):
    the first ``R`` dims of each head rotated, the others (partial RoPE) passed through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos.unsqueeze(2) + _rotate_half(x) * sin.unsqueeze(2)
    rot = x[..., :r]
    rot = rot * cos.unsqueeze(2) + _rotate_half(rot) * sin.unsqueeze(2)
    return torch.cat((rot, x[..., r:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        if config.fused_projections:  # Phi-3: one qkv_proj, rows q, then k, then v
            self.qkv_proj = nn.Linear(h, (self.num_heads + 2 * self.num_kv_heads) * d, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.attention_bias)
            self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
            self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_bias)
        # Qwen3: each head of q and k RMS-normalised (one weight shared by the heads) before RoPE.
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: _AttentionFn,
        layer: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)
        out = attend(layer, q, k, v)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, width: Optional[int] = None) -> None:
        super().__init__()
        h, m = config.hidden_size, width or config.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=False)
        self.up_proj = nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) weights, ``[out, in]``."""
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight


class FusedMLP(nn.Module):
    """The SwiGLU MLP with gate and up in one ``gate_up_proj`` (Phi-3's layout: gate rows first)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, m = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MixtralExpert(nn.Module):
    """A Mixtral expert: the SwiGLU MLP under Mixtral's names (w1 gate, w3 up, w2 down)."""

    def __init__(self, config: ModelConfig, width: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.w1 = nn.Linear(h, width, bias=False)
        self.w2 = nn.Linear(width, h, bias=False)
        self.w3 = nn.Linear(h, width, bias=False)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w1.weight, self.w3.weight, self.w2.weight


_ExpertWeights = Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for tokens ``x`` ``[M, H]``: (weights ``[M, k]`` in x's dtype,
    experts int64 ``[M, k]``). Softmax over all experts in float32, then the top k, their
    probabilities renormalised to sum to one where ``renormalise`` (transformers' order)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def _moe_mlp(
    x: torch.Tensor, router: torch.Tensor, experts: _ExpertWeights, top_k: int, renormalise: bool
) -> torch.Tensor:
    """A sparse MLP over tokens ``x`` ``[M, H]`` -> ``[M, H]``: each token's output is the sum of
    its ``top_k`` experts' SwiGLU outputs times their router weights. Each expert runs once, on
    the tokens routed to it (in expert order, as transformers sums them). One implementation
    for the training path (:class:`SparseMoE`, differentiable) and the inference path."""
    weights, chosen = _route(x, router, top_k, renormalise)
    out = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():
        token, slot = torch.where(chosen == e)
        gate, up, down = experts[e]
        h = x[token]
        y = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (Qwen3-MoE's ``mlp``, Mixtral's ``block_sparse_moe``): the
    router ``gate`` (``[num_experts, H]``, no bias) and the experts, see :func:`_moe_mlp`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.num_experts is not None and config.moe_intermediate_size is not None
        width = config.moe_intermediate_size
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        expert = MixtralExpert if config.model_type == "mixtral" else MLP
        self.experts = nn.ModuleList(expert(config, width) for _ in range(config.num_experts))
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [e.weights() for e in self.experts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = _moe_mlp(flat, self.gate.weight, self.expert_weights(), self.top_k, self.renormalise)
        return out.view_as(x)


# Each expert's (gate, up, down) weight names in the checkpoints of a sparse family.
_EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def _split_fused_experts(config: ModelConfig, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with transformers 5's in-memory experts (``layers.N.mlp.experts.gate_up_proj``
    ``[E, 2 I, H]``, gate rows first, and ``...experts.down_proj`` ``[E, H, I]``, with the router
    at ``...mlp.gate.weight`` for Mixtral too) written as the checkpoints' per-expert tensors.
    Other keys pass through; a state already in the checkpoint layout comes back equal."""
    out = dict(state)
    if config.num_experts is None:
        return out
    gate_name, up_name, down_name = _EXPERT_NAMES[config.model_type]
    block = "block_sparse_moe" if config.model_type == "mixtral" else "mlp"
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.mlp.", f"model.layers.{i}.{block}."
        if src + "experts.gate_up_proj" not in out or not config.sparse_layer(i):
            continue
        gate_up = out.pop(src + "experts.gate_up_proj")
        down = out.pop(src + "experts.down_proj")
        width = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{dst}experts.{e}.{gate_name}.weight"] = gate_up[e, :width]
            out[f"{dst}experts.{e}.{up_name}.weight"] = gate_up[e, width:]
            out[f"{dst}experts.{e}.{down_name}.weight"] = down[e]
        if src != dst and src + "gate.weight" in out:
            out[dst + "gate.weight"] = out.pop(src + "gate.weight")
    return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The feed-forward block under its Hugging Face name: Mixtral's sparse MLP is
        # `block_sparse_moe`, every other one `mlp`.
        ff: nn.Module
        if config.sparse_layer(index):
            ff = SparseMoE(config)
        else:
            ff = FusedMLP(config) if config.fused_projections else MLP(config)
        self._ff_name = "block_sparse_moe" if config.model_type == "mixtral" else "mlp"
        setattr(self, self._ff_name, ff)

    @property
    def feed_forward(self) -> nn.Module:
        """The MLP block: an :class:`MLP`, a :class:`FusedMLP` or a :class:`SparseMoE`."""
        return getattr(self, self._ff_name)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: _AttentionFn,
        layer: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, layer)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The ``model.`` prefix of the Hugging Face layout."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B, H * groups, S, D]``, query head h reading KV head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _tree_bits(tree_mask: torch.Tensor, t: int) -> torch.Tensor:
    """bool ``[B, T, T]`` from the uint32 ancestor bitmask."""
    words = tree_mask.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    j = torch.arange(t, device=tree_mask.device)
    return ((words[:, :, j // 32] >> (j % 32)) & 1).bool()


class _LayerWeights(NamedTuple):
    """One decoder layer's inference weights: transposed (``[in, out]``, contiguous) and with the
    projections that read the same input fused."""

    ln1: torch.Tensor  # [H]
    qkv_t: torch.Tensor  # [H, (Hq + 2 Hkv) D]: q_proj, k_proj, v_proj columns side by side
    qkv_b: Optional[torch.Tensor]  # [(Hq + 2 Hkv) D] or None
    # [Hq + Hkv, D]: q_norm's weight for each q head, then k_norm's for each k head (Qwen3), or
    # None: one RMSNorm call normalises the q and k heads of the fused product together.
    qk_norm: Optional[torch.Tensor]
    o_t: torch.Tensor  # [Hq D, H]
    o_b: Optional[torch.Tensor]
    ln2: torch.Tensor
    # A dense MLP: gate_up_t [H, 2 M] (gate_proj columns, then up_proj columns), down_t [M, H],
    # gate/up prepacked for oneDNN (_pack_weight) or None. A sparse one leaves them None.
    gate_up_t: Optional[torch.Tensor]
    down_t: Optional[torch.Tensor]
    gate_up_p: Optional[torch.Tensor]
    # A sparse MLP (:class:`SparseMoE`): its module, whose weights _moe_mlp reads as they are.
    moe: Optional[SparseMoE] = None


def _mlp_weights(m: nn.Module) -> dict[str, Any]:
    """The MLP fields of a layer's :class:`_LayerWeights`: a dense MLP fused and transposed, a
    sparse one kept as its module (its experts run on a few tokens each)."""
    if isinstance(m, SparseMoE):
        return {"gate_up_t": None, "down_t": None, "gate_up_p": None, "moe": m}
    if isinstance(m, FusedMLP):
        gate_up = m.gate_up_proj.weight
    else:
        gate_up = torch.cat((m.gate_proj.weight, m.up_proj.weight))
    return {
        "gate_up_t": _t(gate_up),
        "down_t": _t(m.down_proj.weight),
        "gate_up_p": _pack_weight(gate_up),
    }


def _onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prepacked oneDNN products can be used: float32 on a CPU build with oneDNN."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def _pack_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
    """``w`` (``[out, in]``, float32, CPU) reordered once for oneDNN, or None where oneDNN is not
    usable or does not reproduce ``x @ w.T`` on a probe (then callers keep ``torch.mm``).

    Why: ``torch.mm(x, w_t)`` with a few rows (a draft tree's 2 to 64 tokens) goes through a
    BLAS gemm that repacks the whole weight on every call. For the output head of a small
    model (``[hidden, vocab]``, megabytes) that repacking costs more than the arithmetic: on a
    2-vCPU AMD EPYC at 17 rows x ``[256, 8192]``, 2.5 ms against 1.0 ms with a weight packed
    once (``bench/RESULTS.md``, ``## e2e``). A single row goes through a matrix-vector
    product that reads the weight as it is, so it keeps ``torch.mm`` (see :func:`_mm_rows`).
    """
    if not _onednn_usable(w.device, w.dtype):
        return None
    w = w.detach().contiguous()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        probe = torch.linspace(-1.0, 1.0, 3 * w.shape[1], dtype=w.dtype).view(3, w.shape[1])
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [None], "")
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    want = torch.mm(probe, w.t())
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        return None
    return packed


def _mm_rows(x: torch.Tensor, w_t: torch.Tensor, packed: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ w_t`` (``x`` float ``[M, in]``, ``w_t`` ``[in, out]``): through the prepacked oneDNN
    weight when there is one and ``M >= 2``, else ``torch.mm``. Both compute the same product;
    they may differ in the last bits of float32 rounding (another summation order), as any two
    BLAS kernels do."""
    if packed is None or x.shape[0] < 2:
        return torch.mm(x, w_t)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [None], "")


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.detach().t().contiguous()


class _InferenceWeights:
    """Inference copies of a :class:`Transformer`'s parameters and its RoPE tables.

    The parameters keep the Hugging Face layout (``q_proj``, ``k_proj``, ... as separate
    ``nn.Linear`` with ``[out, in]`` weights), which ``state_dict`` / ``save_pretrained`` /
    ``from_pretrained`` and training use. :meth:`Transformer.forward` reads these copies instead:

    * q/k/v and gate/up are fused, so a layer costs 4 matrix products instead of 7;
    * every weight is stored transposed, ``[in, out]`` contiguous: on the CPU, ``x @ w_t`` with
      few rows streams the weight once, while ``F.linear``'s ``[out, in]`` layout was measured
      at 1.2x to 2x slower for 1 to 16 rows on this project's small models (see
      ``bench/RESULTS.md``, ``## e2e``);
    * RoPE cos/sin are tables over every position, indexed instead of recomputed;
    * the head and the gate/up products (the widest) are also kept prepacked for oneDNN
      (:func:`_pack_weight`), used for passes of two or more tokens (:func:`_mm_rows`).

    The copies cost one more copy of the weights in memory. Invariant: they equal the parameters
    they were built from. :meth:`matches` compares the storage and version counter of every
    parameter (an in-place update, ``load_state_dict`` or an optimizer step bumps the version;
    ``.to()`` changes the storage), and :meth:`Transformer._apply` drops the copies outright; the
    model rebuilds them on the next forward pass when either says they are stale. Writing
    through ``param.data`` bypasses the version counter and is not seen; update parameters in
    place under ``torch.no_grad()`` (as optimizers and ``load_state_dict`` do) instead.
    """

    def __init__(self, model: Transformer) -> None:
        self.params = list(model.parameters())
        self.key = self._key()
        cfg = model.config
        with torch.no_grad():
            self.layers = [self._fuse(layer) for layer in model.model.layers]
            self.norm = model.model.norm.weight.detach()
            self.embed = model.model.embed_tokens.weight.detach()
            self.head_t = _t(model.lm_head.weight)
            # The head and gate/up products are the widest of a pass: prepacked for oneDNN
            # (None where it is not usable). The narrower ones gain nothing (measured).
            self.head_p = _pack_weight(model.lm_head.weight)
            # RoPE tables for every position the model supports (max_length), computed exactly as
            # _rope does (float32 angles from integer positions, then cast), so indexing them
            # gives the same numbers. sin_signed has its first half negated: rotate_half(x) * sin
            # equals swap_halves(x) * sin_signed bit for bit (negation is exact).
            positions = torch.arange(cfg.max_length, device=self.embed.device)
            cos, sin = model._rope(positions, self.embed.dtype)
            half = cfg.rotary_dim // 2
            self.cos = cos
            self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    @staticmethod
    def _fuse(layer: DecoderLayer) -> _LayerWeights:
        a, m = layer.self_attn, layer.feed_forward
        qkv_b = None
        if hasattr(a, "qkv_proj"):
            qkv = a.qkv_proj.weight
        else:
            qkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
            if a.q_proj.bias is not None:
                qkv_b = torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)).detach()
        qk_norm = None
        if a.q_norm is not None:
            qk_norm = torch.cat(
                (
                    a.q_norm.weight.detach().expand(a.num_heads, -1),
                    a.k_norm.weight.detach().expand(a.num_kv_heads, -1),
                )
            )
        return _LayerWeights(
            ln1=layer.input_layernorm.weight.detach(),
            qkv_t=_t(qkv),
            qkv_b=qkv_b,
            qk_norm=qk_norm,
            o_t=_t(a.o_proj.weight),
            o_b=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
            ln2=layer.post_attention_layernorm.weight.detach(),
            **_mlp_weights(m),
        )

    def _key(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in self.params)

    def matches(self) -> bool:
        return self._key() == self.key


def _mm(x: torch.Tensor, w_t: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = torch.mm(x, w_t)
    return out if bias is None else out + bias


def _unpack(
    x: torch.Tensor, sel: Optional[torch.Tensor], n: int, pad: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``[M, C]`` rows of the real tokens -> ``[n, C]`` with zeros at the padding tokens.

    ``pad``: the flat indices not in ``sel`` (padding). With it only those rows are zeroed and
    the rest written once; the logits of a batch of trees are megabytes, so filling all of them
    with zeros first was a visible share of a ragged batch-8 pass."""
    if sel is None:
        return x
    if pad is None:
        out = torch.zeros((n, x.shape[1]), dtype=x.dtype, device=x.device)
        return out.index_copy_(0, sel, x)
    out = torch.empty((n, x.shape[1]), dtype=x.dtype, device=x.device)
    out.index_copy_(0, sel, x)
    return out.index_fill_(0, pad, 0)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s arithmetic without the module call and, in float32, without casts."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _chunk_steer(steer: Optional[torch.Tensor], start: int, step: int) -> Optional[torch.Tensor]:
    """The part of a checked ``steer`` (``[B, 1 or T, L, H]``) that tokens
    ``[start, start + step)`` take, in a shape :meth:`Transformer.forward` accepts."""
    if steer is None:
        return None
    if steer.shape[1] == 1:  # one vector per row serves every chunk
        return steer[:, 0]
    return steer[:, start : start + step]


class Transformer(nn.Module):
    """Llama / Qwen2 / Qwen3 / Mistral / Phi-3 style decoder (RMSNorm, RoPE, SwiGLU, GQA), dense
    or with mixture-of-experts MLPs (Qwen3-MoE, Mixtral).

    Parameters
    ----------
    config : ModelConfig
        The architecture. The model is built in float32 on the CPU with the Hugging Face
        initialisation (normal(0, ``initializer_range``) weights, zero biases, unit norms); use
        ``.to(device, dtype)`` to move it.

    Attributes
    ----------
    attention : str
        ``"auto"`` (default): ``ops.tree_attention`` when it supports the head dim, dtype and
        device, else the PyTorch implementation; ``"ops"`` forces the kernel (errors where it
        does not apply); ``"torch"`` forces PyTorch (a dense masked SDPA; the reference).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention = "auto"
        self._fast: Optional[_InferenceWeights] = None
        self.reset_parameters()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # .to() / .float() / .cuda() replace parameter storage: the fused copies are stale.
        self._fast = None
        return super()._apply(fn, recurse)

    def _inference_weights(self) -> _InferenceWeights:
        fast = self._fast
        if fast is None or not fast.matches():
            fast = self._fast = _InferenceWeights(self)
        return fast

    # ---- construction ------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Hugging Face's initialisation: N(0, initializer_range), zero biases, unit norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_hidden_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_length(self) -> int:
        return self.config.max_length

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ---- shared pieces -------------------------------------------------------------------------

    def _rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in float32 from integer positions, then cast: the transformers computation. The
        # frequencies are recomputed (not a buffer) so that .to(dtype) can never round them.
        scaling = self.config.rope_scaling
        if scaling and scaling["rope_type"] in ("dynamic", "longrope") and positions.numel():
            # Past this length the frequencies depend on each forward pass's longest position.
            name, limit = "dynamic NTK", self.config.max_position_embeddings
            if scaling["rope_type"] == "longrope":
                name, limit = "LongRoPE", scaling["original_max_position_embeddings"]
            if int(positions.max()) >= limit:
                raise ValueError(
                    f"positions: {name} RoPE changes its frequencies past position {limit}, "
                    f"which this model does not implement; got position {int(positions.max())}"
                )
        inv_freq = _rope_inv_freq(self.config, positions.device)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        factor = _rope_attention_factor(self.config)
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype), sin.to(dtype)

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: _AttentionFn,
        hidden_indices: Sequence[int] = (),
        steer: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        wanted = set(hidden_indices)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in wanted:
            hidden[0] = x
        last = len(self.model.layers)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attend, i)
            if steer is not None:  # [B, 1 or T, L, H]: after the layer's MLP, as the cache path
                x = x + steer[:, :, i].to(x.dtype)
            if i + 1 in wanted and i + 1 < last:
                hidden[i + 1] = x
        x = self.model.norm(x)
        # As in transformers, the last hidden state is the final norm's output (what lm_head reads).
        if last in wanted:
            hidden[last] = x
        logits = self.lm_head(x)
        return logits, [hidden[i] for i in hidden_indices]

    # ---- training path -----------------------------------------------------------------------

    def forward_train(
        self, input_ids: torch.Tensor, steer: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Causal LM over whole sequences (differentiable; no cache).

        Parameters
        ----------
        input_ids : torch.Tensor
            integer ``[B, T]``, ids in ``[0, vocab_size)``, ``1 <= T <= max_length``; token
            ``t`` sits at position ``t``.
        steer : torch.Tensor, optional
            floating ``[B, L, hidden_size]`` or ``[B, T, L, hidden_size]`` (``L`` =
            ``num_hidden_layers``): vectors added to the residual stream after each layer (its
            MLP's output), one per row or one per token, as :meth:`forward` takes them
            (:mod:`specdecode.steering`). Gradients flow into it.

        Returns
        -------
        torch.Tensor
            logits ``[B, T, vocab_size]`` in the model's dtype; ``logits[:, t]`` predicts token
            ``t + 1``.
        """
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids: expected a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape [B, T], got {list(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.config.max_length:
            raise ValueError(
                f"input_ids: {t} tokens exceed the model's max length {self.config.max_length}"
            )
        positions = torch.arange(t, device=input_ids.device).expand(input_ids.shape[0], t)
        input_ids, positions = check_tokens(
            input_ids, positions, self.vocab_size, input_ids.shape[0], self.device
        )
        steer = check_steer(
            steer,
            input_ids.shape[0],
            t,
            self.config.num_hidden_layers,
            self.config.hidden_size,
            self.device,
        )
        groups = self.config.num_groups

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            out = F.scaled_dot_product_attention(
                q, _repeat_kv(k, groups), _repeat_kv(v, groups), is_causal=True
            )
            return out.transpose(1, 2)

        logits, _ = self._run(input_ids, positions, attend, steer=steer)
        return logits

    # ---- inference path ----------------------------------------------------------------------

    def new_cache(
        self,
        batch_size: int,
        max_length: Optional[int] = None,
        *,
        dtype: Optional[torch.dtype] = None,
        device: Union[torch.device, str, None] = None,
    ) -> KVCache:
        """A static KV cache for ``batch_size`` rows of up to ``max_length`` tokens.

        ``max_length`` defaults to the model's max length (``max_position_embeddings``, or the
        sliding window if smaller) and may not exceed it. The cache takes the model's dtype and
        device unless given; a given ``dtype`` must be a floating-point one (the K/V are stored
        rounded to it).
        """
        batch_size = check_positive_int("batch_size", batch_size)
        limit = self.config.max_length
        if max_length is None:
            max_length = limit
        max_length = check_positive_int("max_length", max_length)
        if max_length > limit:
            raise ValueError(
                f"max_length: {max_length} exceeds the model's max length {limit} "
                "(max_position_embeddings / sliding_window)"
            )
        return KVCache(
            self.config.num_hidden_layers,
            batch_size,
            max_length,
            self.config.num_key_value_heads,
            self.config.head_dim,
            dtype=dtype or self.dtype,
            device=device if device is not None else self.device,
        )

    def _use_kernel(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
        if self.attention == "torch":
            return False
        supported = (
            head_dim in ops.HEAD_DIMS
            and dtype in (torch.float32, torch.float16, torch.bfloat16)
            and (device.type == "cpu" or specdecode_has_cuda())
        )
        if self.attention == "ops":
            if not supported:
                raise ValueError(
                    f"attention='ops': tree_attention does not support head_dim {head_dim} "
                    f"(supported {ops.HEAD_DIMS}), dtype {dtype} or device {device}"
                )
            return True
        if self.attention != "auto":
            raise ValueError(
                f"attention: expected 'auto', 'ops' or 'torch', got {self.attention!r}"
            )
        return supported

    @torch.no_grad()
    def head_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head over residual-stream states, as the cached forward applies
        them (its packed weights: faster than ``lm_head(model.norm(x))`` for a few rows).

        Parameters
        ----------
        states : torch.Tensor
            Floating ``[..., H]`` states before the final norm (e.g. a draft head's outputs).

        Returns
        -------
        torch.Tensor
            ``[..., V]`` logits in the model's dtype (no autograd).
        """
        if states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"states: expected [..., {self.config.hidden_size}], got {list(states.shape)}"
            )
        fast = self._inference_weights()
        x = _rms_norm(
            states.reshape(-1, states.shape[-1]).to(self.dtype), fast.norm, self.config.rms_norm_eps
        )
        return _mm_rows(x, fast.head_t, fast.head_p).view(*states.shape[:-1], -1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        tree_mask: Optional[torch.Tensor] = None,
        output_hidden: Optional[Sequence[int]] = None,
        *,
        num_nodes: Optional[torch.Tensor] = None,
        steer: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """Scores ``T`` new tokens per row over the cache and appends their K/V to it.

        Parameters
        ----------
        input_ids : torch.Tensor
            integer ``[B, T]``, ids in ``[0, vocab_size)``, on the model's device.
        positions : torch.Tensor
            integer ``[B, T]``, ``>= 0``: RoPE position of each token (``lengths[b] + t`` for a
            chain, ``lengths[b] + depth`` for a tree).
        cache : KVCache
            From :meth:`new_cache`, ``B`` rows; the new tokens go to slots
            ``[lengths[b], lengths[b] + T)`` (which must fit) and ``lengths`` grows by ``T``.
        tree_mask : torch.Tensor, optional
            uint32 ``[B, T, ceil(T / 32)]`` from :func:`specdecode.ops.tree_info`: token ``i``
            attends to the whole cached prefix and to the new tokens whose bit is set in row
            ``i``. None: a causal chain (token ``i`` sees new tokens ``0..i``).
        output_hidden : sequence of int, optional
            Hidden states to return, indexed as transformers' ``hidden_states``: 0 = embeddings,
            ``i`` = output of layer ``i``, ``L`` = the final norm's output (what ``lm_head``
            reads); negative indices count from ``L + 1``.
        num_nodes : torch.Tensor, optional
            integer ``[B]`` on the CPU, values in ``[0, T]``: only the first ``num_nodes[b]``
            tokens of row ``b`` are real; the rest are padding (a ragged batch of trees or
            chains). Padding tokens are not computed: their logits and hidden states are zeros
            and their cache slots are left as they were (they still count in ``lengths``, as
            every one of the ``T`` slots does, and are dropped by ``compact``/``truncate``).
            The real tokens of a row must not attend to its padding (true of every
            ``tree_info`` mask and of a causal chain, where padding comes last). Every matrix
            product then runs over the real tokens only, so rows of different sizes cost what
            they hold, not ``B * T``. None: every token is real.
        steer : torch.Tensor, optional
            floating ``[B, L, hidden_size]`` (one vector per row, for all its tokens) or
            ``[B, T, L, hidden_size]`` (one per token), ``L`` = ``num_hidden_layers``, on the
            model's device: ``steer[b, ..., i]`` is added to the residual stream after layer
            ``i`` (to its MLP's output), so it also shapes the K/V of later layers that the cache
            keeps. A steered drafter's vectors (:mod:`specdecode.steering`); zeros change
            nothing. None: no steering.

        Returns
        -------
        torch.Tensor or (torch.Tensor, tuple of torch.Tensor)
            logits ``[B, T, vocab_size]``; with ``output_hidden`` also the hidden states
            ``[B, T, hidden_size]`` in the requested order.

        Raises
        ------
        TypeError, ValueError
            Wrong types/shapes/devices, token ids outside the vocabulary, negative positions, a
            malformed mask, or no room left in the cache; the cache is unchanged then.
        """
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"cache: expected a KVCache (from new_cache), got {type(cache).__name__}"
            )
        if cache.num_layers != self.config.num_hidden_layers or cache.k.shape[3:] != (
            self.config.num_key_value_heads,
            self.config.head_dim,
        ):
            raise ValueError("cache: its layer count or head shape does not match this model")
        if cache.device != self.device:
            raise ValueError(f"cache: on {cache.device}, the model on {self.device}")
        input_ids, positions = check_tokens(
            input_ids, positions, self.vocab_size, cache.batch_size, self.device
        )
        batch, t = input_ids.shape
        check_tree_mask(tree_mask, batch, t, self.device)
        if tree_mask is not None:
            tree_mask = tree_mask.contiguous()
            if t > ops.MAX_TREE_NODES and self._use_kernel(
                self.config.head_dim, cache.dtype, self.device
            ):
                raise ValueError(
                    f"tree_mask: ops.tree_attention scores at most {ops.MAX_TREE_NODES} tree "
                    f"nodes, got T = {t} (a longer causal chain takes no mask and runs in chunks; "
                    "attention='torch' takes any T)"
                )
        wanted = check_hidden_indices(output_hidden, self.config.num_hidden_layers)
        real = check_num_nodes(num_nodes, batch, t)
        steer = check_steer(
            steer,
            batch,
            t,
            self.config.num_hidden_layers,
            self.config.hidden_size,
            self.device,
        )
        slots = cache._begin(t)
        if tree_mask is None and t > ops.MAX_TREE_NODES:
            return self._forward_chunked(input_ids, positions, cache, output_hidden, real, steer)
        with torch.no_grad():
            logits, hidden = self._run_cached(
                input_ids, positions, cache, slots, tree_mask, wanted, real, steer
            )
        cache._commit(t, tree_mask, real)
        if output_hidden is None:
            return logits
        return logits, tuple(hidden)

    def _run_cached(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        tree_mask: Optional[torch.Tensor],
        wanted: Sequence[int],
        real: Optional[torch.Tensor] = None,
        steer: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The inference forward over validated input: :meth:`_run`'s arithmetic on the fused
        weights of :class:`_InferenceWeights`, with as few tensor ops per layer as possible
        (this loop is the whole cost of a decoding step for a small model).

        ``real`` (int64 ``[B]``, from :func:`check_num_nodes`): real tokens per row; the
        token-wise work (embedding, norms, projections, MLP, head) then runs over the packed
        real tokens only, and only attention sees the padded ``[B, T]`` layout. ``steer``
        (``[B, 1 or T, L, H]``, from :func:`check_steer`) is added after each layer."""
        cfg = self.config
        fast = self._inference_weights()
        batch, t = input_ids.shape
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = hq * d, hkv * d
        eps = cfg.rms_norm_eps
        n = batch * t
        sel = None  # flat indices (b * T + i) of the real tokens, when some are padding
        pad = None  # the other flat indices (padding tokens)
        if real is not None:
            is_real = (torch.arange(t).unsqueeze(0) < real.unsqueeze(1)).reshape(n)
            sel = torch.nonzero(is_real).squeeze(1).to(input_ids.device)
            pad = torch.nonzero(~is_real).squeeze(1).to(input_ids.device)
        # Rows are (sequence, token) pairs flattened: every matrix product is one 2-D mm.
        flat_ids = input_ids.reshape(n)
        flat_pos = positions.reshape(n)
        if sel is not None:
            flat_ids, flat_pos = flat_ids[sel], flat_pos[sel]
        m_rows = flat_ids.shape[0]
        x = F.embedding(flat_ids, fast.embed)
        if m_rows and int(flat_pos.max()) < fast.cos.shape[0]:
            cos = fast.cos[flat_pos].unsqueeze(1)  # [M, 1, D]
            sin = fast.sin_signed[flat_pos].unsqueeze(1)
        else:  # positions beyond max_position_embeddings: computed, as _run does
            cos, sin = self._rope(flat_pos, x.dtype)
            r2 = cfg.rotary_dim // 2
            sin = torch.cat((-sin[:, :r2], sin[:, r2:]), dim=-1).unsqueeze(1)
            cos = cos.unsqueeze(1)
        rot, half = cfg.rotary_dim, cfg.rotary_dim // 2
        prefix = cache.lengths
        host = cache._host_lengths
        # Every row at the same length (always at batch 1): the new K/V go to one slice.
        start = None
        if sel is None and (batch == 1 or bool((host == host[0]).all())):
            start = int(host[0])
        rows, kv_slots = None, slots
        if start is None:
            rows = torch.arange(batch, device=x.device).unsqueeze(1).expand(batch, t)
            if sel is not None:
                rows, kv_slots = rows.reshape(n)[sel], slots.reshape(n)[sel]
        # The kernel runs in the cache's dtype (the model's unless new_cache was given another).
        use_kernel = self._use_kernel(d, cache.k[0].dtype, x.device)
        scale = 1.0 / math.sqrt(d)
        if not use_kernel:
            allowed = self._dense_mask(prefix, slots, tree_mask, t)
            # A row that sees nothing (a padding node over an empty prefix) must yield 0, as the
            # kernel does; SDPA would give NaN there. Only possible when some prefix is empty.
            empty_rows = None if int(host.min()) > 0 else allowed.any(-1)[:, :, None, None]
            mask = allowed.unsqueeze(1)
            s = allowed.shape[-1]
        # Padded queries of the attention call (packed mode): padding rows stay zero.
        q_full = None
        if sel is not None:
            q_full = torch.zeros((n, hq, d), dtype=x.dtype, device=x.device)
        if steer is not None:  # one [L, H] block per token row, packed as x is
            steer = steer.to(x.dtype).expand(batch, t, -1, -1).reshape(n, *steer.shape[2:])
            if sel is not None:
                steer = steer.index_select(0, sel)
        wanted_set = set(wanted)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in wanted_set:
            hidden[0] = x
        last = len(fast.layers)
        for i, w in enumerate(fast.layers):
            qkv = _mm(_rms_norm(x, w.ln1, eps), w.qkv_t, w.qkv_b)
            # RoPE on q and k together: x * cos + rotate_half(x) * sin (see _InferenceWeights).
            qk = qkv[:, : q_size + kv_size].view(m_rows, hq + hkv, d)
            if w.qk_norm is not None:
                qk = _rms_norm(qk, w.qk_norm, eps)
            if rot == d:
                qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin
            else:  # partial RoPE: the first rot dims of each head only
                part = qk[..., :rot]
                part = part * cos + torch.cat((part[..., half:], part[..., :half]), dim=-1) * sin
                qk = torch.cat((part, qk[..., rot:]), dim=-1)
            k_cache, v_cache = cache.k[i], cache.v[i]
            if sel is None:
                q = qk[:, :hq].view(batch, t, hq, d)
                k = qk[:, hq:].view(batch, t, hkv, d)
                v = qkv[:, q_size + kv_size :].view(batch, t, hkv, d)
            else:
                q_full.index_copy_(0, sel, qk[:, :hq])
                q = q_full.view(batch, t, hq, d)
                k = qk[:, hq:]
                v = qkv[:, q_size + kv_size :].view(m_rows, hkv, d)
            if start is not None:
                k_cache[:, start : start + t] = k
                v_cache[:, start : start + t] = v
            else:
                k_cache[rows, kv_slots] = k.to(k_cache.dtype)
                v_cache[rows, kv_slots] = v.to(v_cache.dtype)
            if use_kernel:
                # cache._begin checked every row's room on the host: no status read per layer.
                out = tree_attention_in_cache(
                    q.to(k_cache.dtype).contiguous(), k_cache, v_cache, prefix, tree_mask, scale
                ).to(q.dtype)
            else:
                keys, values = k_cache[:, :s], v_cache[:, :s]
                if keys.dtype != q.dtype:  # a cache kept in another dtype than the model
                    keys, values = keys.to(q.dtype), values.to(q.dtype)
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    keys.transpose(1, 2),
                    values.transpose(1, 2),
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=hq != hkv,
                ).transpose(1, 2)
                if empty_rows is not None:
                    out = torch.where(empty_rows, out, torch.zeros_like(out))
            out = out.reshape(n, q_size)
            if sel is not None:
                out = out.index_select(0, sel)
            x = x + _mm(out, w.o_t, w.o_b)
            if w.moe is not None:
                moe = w.moe
                x = x + _moe_mlp(
                    _rms_norm(x, w.ln2, eps),
                    moe.gate.weight,
                    moe.expert_weights(),
                    moe.top_k,
                    moe.renormalise,
                )
            else:
                gate_up = _mm_rows(_rms_norm(x, w.ln2, eps), w.gate_up_t, w.gate_up_p)
                m = gate_up.shape[1] // 2
                x = x + torch.mm(F.silu(gate_up[:, :m]) * gate_up[:, m:], w.down_t)
            if steer is not None:
                x = x + steer[:, i]
            if i + 1 in wanted_set and i + 1 < last:
                hidden[i + 1] = x
        x = _rms_norm(x, fast.norm, eps)
        if last in wanted_set:
            hidden[last] = x
        logits = _mm_rows(x, fast.head_t, fast.head_p)
        return _unpack(logits, sel, n, pad).view(batch, t, -1), [
            _unpack(hidden[i], sel, n, pad).view(batch, t, -1) for i in wanted
        ]

    def _forward_chunked(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        output_hidden: Optional[Sequence[int]],
        real: Optional[torch.Tensor] = None,
        steer: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """A causal chain longer than tree_attention's 1024 query rows, in consecutive chunks.

        Each chunk attends to the cache (which already holds the earlier chunks) plus itself
        causally, which is exactly the attention of the whole chain. Validation was done on the
        whole input, so no chunk fails a check after an earlier one was committed; if one fails
        otherwise (out of memory), the committed chunks are rolled back. With ``real``
        (real tokens per row, a prefix of each row), chunk ``[i, i + step)`` holds
        ``clamp(real - i, 0, step)`` of them.
        """
        start = cache.lengths.clone()
        step = ops.MAX_TREE_NODES
        parts = []
        try:
            for i in range(0, input_ids.shape[1], step):
                chunk = input_ids[:, i : i + step]
                parts.append(
                    self.forward(
                        chunk,
                        positions[:, i : i + step],
                        cache,
                        output_hidden=output_hidden,
                        num_nodes=None if real is None else (real - i).clamp(0, chunk.shape[1]),
                        steer=_chunk_steer(steer, i, step),
                    )
                )
        except BaseException:
            # A later chunk failed (out of memory, an interrupt): the earlier ones were
            # committed; roll them back so that the cache is as it was.
            cache.truncate(start)
            raise
        # The whole chain is the block that compact() refers to, not just its last chunk.
        cache._tree_start = start
        cache._tree_size = input_ids.shape[1]
        cache._tree_mask = None
        cache._tree_real = real
        if output_hidden is None:
            return torch.cat(parts, dim=1)
        logits = torch.cat([p[0] for p in parts], dim=1)
        hidden = tuple(torch.cat(h, dim=1) for h in zip(*(p[1] for p in parts)))
        return logits, hidden

    @staticmethod
    def _dense_mask(
        prefix: torch.Tensor, slots: torch.Tensor, tree_mask: Optional[torch.Tensor], t: int
    ) -> torch.Tensor:
        """bool ``[B, T, S]`` over cache slots ``0 .. max(prefix) + T - 1``."""
        batch = prefix.shape[0]
        s = int(slots.max()) + 1
        device = prefix.device
        allowed = torch.arange(s, device=device).view(1, 1, s) < prefix.view(batch, 1, 1).long()
        allowed = allowed.expand(batch, t, s).clone()
        if tree_mask is None:
            visible = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(batch, t, t)
        else:
            visible = _tree_bits(tree_mask, t)
        allowed.scatter_(2, slots.unsqueeze(1).expand(batch, t, t), visible)
        return allowed

    # ---- Hugging Face checkpoints ------------------------------------------------------------

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ):  # type: ignore[override]
        """:meth:`torch.nn.Module.load_state_dict`, also taking a transformers 5 sparse model's
        own ``state_dict()`` (its experts fused into ``[E, ...]`` tensors; see
        :func:`_split_fused_experts`) as well as the per-expert checkpoint layout."""
        state = _split_fused_experts(self.config, state_dict)
        return super().load_state_dict(state, strict=strict, assign=assign)

    def save_pretrained(self, directory: PathLike) -> None:
        """Writes ``config.json`` and ``model.safetensors`` in the Hugging Face layout.

        transformers loads the directory with ``AutoModelForCausalLM.from_pretrained`` as the
        class of ``config.model_type``. With tied embeddings ``lm_head.weight`` is not written
        (transformers ties it on load).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_state_dict(state, directory)
        # transformers 4 reads torch_dtype, transformers 5 dtype.
        name = dtype_name(self.dtype)
        self.config.to_json_file(directory / CONFIG_NAME, torch_dtype=name, dtype=name)

    @classmethod
    def from_pretrained(
        cls,
        directory: PathLike,
        *,
        dtype: Optional[torch.dtype] = None,
        device: Union[torch.device, str, None] = None,
    ) -> Transformer:
        """Loads a local Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Qwen3-MoE / Mixtral checkpoint
        (config.json + safetensors).

        Parameters
        ----------
        directory : str or os.PathLike
            Holds ``config.json`` and ``model.safetensors`` (or a sharded
            ``model.safetensors.index.json``).
        dtype : torch.dtype, optional
            Parameter dtype, a floating-point one of 16 bits or more. Default: the dtype in which
            the checkpoint stores ``model.embed_tokens.weight``; every tensor is cast to it (a
            checkpoint normally stores all of them in one dtype; ``config.json``'s ``dtype`` /
            ``torch_dtype`` is not read).
        device : torch.device or str, optional
            Where to put the model (default CPU).

        Raises
        ------
        FileNotFoundError
            A file is missing.
        TypeError
            ``dtype`` is not a floating-point torch dtype of 16 bits or more, or it is None and
            the checkpoint's embedding is not stored in one.
        ValueError
            An unsupported config, or tensors missing, unexpected or of the wrong shape.
        """
        if dtype is not None:
            check_float_dtype("dtype", dtype, min_bits=16)
        config = ModelConfig.from_hf_config(read_config(directory))
        tensors = _split_fused_experts(config, load_state_dict(directory))
        model = cls(config)
        expected = model.state_dict()
        if config.tie_word_embeddings:
            # Tied checkpoints normally omit lm_head; if present it must be the embedding.
            head = tensors.pop("lm_head.weight", None)
            expected.pop("lm_head.weight")
            embed = tensors.get("model.embed_tokens.weight")
            if head is not None and embed is not None and not torch.equal(head, embed):
                raise ValueError(
                    "lm_head.weight differs from model.embed_tokens.weight, but the config says "
                    "tie_word_embeddings=True"
                )
        # Older checkpoints stored the RoPE table; it is recomputed from the config.
        for key in [k for k in tensors if k.endswith("rotary_emb.inv_freq")]:
            del tensors[key]
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"directory: checkpoint does not match the config: missing {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''}"
            )
        for key, value in tensors.items():
            if tuple(value.shape) != tuple(expected[key].shape):
                raise ValueError(
                    f"directory: tensor {key} has shape {list(value.shape)}, the config implies "
                    f"{list(expected[key].shape)}"
                )
        if dtype is None:
            stored = tensors["model.embed_tokens.weight"].dtype
            if not stored.is_floating_point or stored.itemsize < 2:
                raise TypeError(
                    f"dtype: the checkpoint stores model.embed_tokens.weight as {stored}; pass "
                    "dtype= (a floating-point torch dtype of 16 bits or more)"
                )
            dtype = stored
        model.to(dtype)
        model.load_state_dict(tensors, strict=not config.tie_word_embeddings)
        if device is not None:
            model.to(device)
        return model


@functools.cache
def specdecode_has_cuda() -> bool:
    from .._info import info

    return bool(info()["cuda"]["compiled"])
