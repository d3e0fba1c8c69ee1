"""The configuration of a Llama-style decoder, and its translation to/from Hugging Face config.json.

One :class:`ModelConfig` describes the seven families :class:`~specdecode.models.Transformer`
implements. They share one architecture (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention,
tied or untied embeddings) and differ only in details that the config states explicitly:

* ``llama``: optional biases on q/k/v **and** o projections (``attention_bias``).
* ``qwen2``: q/k/v biases always, no o bias (``attention_bias`` must be True).
* ``qwen3``: an RMSNorm over each head of q and of k before RoPE (``q_norm`` / ``k_norm``, one
  weight of ``head_dim`` each, shared by the heads); optional biases on q/k/v and o, as Llama.
* ``phi3``: Llama's layers with q/k/v fused into one ``qkv_proj`` and gate/up into one
  ``gate_up_proj`` in the checkpoint, no biases, Mistral's window; LongRoPE (its 128k-context
  models) within the pretraining context.
* ``qwen3_moe``: Qwen3 with sparse mixture-of-experts MLPs (``num_experts`` SwiGLU experts of
  width ``moe_intermediate_size``, ``num_experts_per_tok`` chosen per token by a softmax router,
  their weights renormalised where ``norm_topk_prob``), dense on ``mlp_only_layers`` and off
  the ``decoder_sparse_step`` grid.
* ``mixtral``: Mistral with sparse MLPs (``block_sparse_moe``: experts ``w1`` / ``w3`` / ``w2``,
  the top-k router weights always renormalised).
* ``mistral``: no biases; a sliding attention window.

A sliding window ``W`` is honoured by refusing longer sequences: while every sequence is at most
``W`` tokens long, windowed attention equals full causal attention, so the model is exact where it
runs at all and raises instead of silently diverging beyond that.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional, Union

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral")
# The families whose MLPs are mixtures of experts.
MOE_TYPES = ("qwen3_moe", "mixtral")
# RoPE variants besides plain RoPE, all position-independent rescalings of the frequencies (YaRN
# and LongRoPE also scale cos and sin). Dynamic NTK and LongRoPE change their frequencies with the
# longest position of a forward pass once it passes a length (max_position_embeddings, resp. the
# pretraining context); below it they are fixed, and a model refuses to go past it (a verify pass
# over draft tokens then rotates them as plain decoding would).
ROPE_SCALINGS = ("linear", "dynamic", "llama3", "yarn", "longrope")
# The rope types whose pretraining context (original_max_position_embeddings) transformers takes
# from a top-level key of config.json over the one inside the scaling dict.
_ROPE_WITH_CONTEXT = ("llama3", "yarn", "longrope")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# Fields that from_hf_config derives itself instead of copying from the dict.
_DERIVED_FIELDS = frozenset(
    {
        "model_type",
        "rope_theta",
        "rope_scaling",
        "sliding_window",
        "num_experts",
        "partial_rotary_factor",
    }
)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")


def _check_float(name: str, value: Any, positive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} ({value!r})")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}: expected a finite float > 0, got {value}")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times (1 when not stretched);
    the paper's 0.1 ln(s) + 1, in transformers' order of operations."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_context(scaling: dict, max_position_embeddings: int) -> int:
    """The pretraining context of a llama3 / YaRN / LongRoPE scaling; max_position_embeddings
    when absent, as transformers does."""
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        original = max_position_embeddings
    _check_int("rope_scaling['original_max_position_embeddings']", original, 1)
    return original


def _llama3_scaling(scaling: dict, out: dict, max_position_embeddings: int) -> None:
    for key in ("low_freq_factor", "high_freq_factor"):
        _check_float(f"rope_scaling[{key!r}]", scaling.get(key))
        out[key] = float(scaling[key])
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(
            "rope_scaling: high_freq_factor must exceed low_freq_factor, got "
            f"{out['high_freq_factor']} and {out['low_freq_factor']}"
        )
    out["original_max_position_embeddings"] = _rope_context(scaling, max_position_embeddings)


def _yarn_scaling(scaling: dict, out: dict, max_position_embeddings: int) -> None:
    """YaRN (Qwen2.5 / Qwen3's long-context setting) with every default of transformers made
    explicit: beta_fast 32, beta_slow 1, truncate True, and the attention factor derived from
    factor (and mscale / mscale_all_dim where both are given) unless stated."""
    original = _rope_context(scaling, max_position_embeddings)
    out["original_max_position_embeddings"] = original
    if "factor" not in out:  # no factor: the ratio of the two contexts (DeepSeek's configs)
        out["factor"] = max_position_embeddings / original
    factor = out["factor"]
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        value = scaling.get(key)
        if value is None:
            value = default
        _check_float(f"rope_scaling[{key!r}]", value)
        out[key] = float(value)
    if out["beta_fast"] <= out["beta_slow"]:
        raise ValueError(
            "rope_scaling: beta_fast must exceed beta_slow, got "
            f"{out['beta_fast']} and {out['beta_slow']}"
        )
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise TypeError(f"rope_scaling['truncate']: expected a bool, got {truncate!r}")
    out["truncate"] = truncate
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all)):
            if value is not None:
                _check_float(f"rope_scaling[{key!r}]", value, positive=False)
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    _check_float("rope_scaling['attention_factor']", attention)
    out["attention_factor"] = float(attention)


def _longrope_scaling(scaling: dict, out: dict, max_position_embeddings: int, d: int) -> None:
    """LongRoPE (Phi-3's 128k-context models): per-frequency divisors, ``short_factor`` within the
    pretraining context ``original_max_position_embeddings`` (all this model computes) and
    ``long_factor`` past it, each ``d / 2`` numbers (``d``: the rotated dims of a head); cos
    and sin scaled by the attention factor, by default sqrt(1 + ln f / ln n) for the stretch
    f = max_position_embeddings / n."""
    original = _rope_context(scaling, max_position_embeddings)
    out["original_max_position_embeddings"] = original
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, (list, tuple)):
            raise TypeError(f"rope_scaling[{key!r}]: expected a list of {d // 2} numbers")
        if len(factors) != d // 2:
            raise ValueError(
                f"rope_scaling[{key!r}]: expected head_dim / 2 = {d // 2} numbers, got "
                f"{len(factors)}"
            )
        for value in factors:
            _check_float(f"rope_scaling[{key!r}][i]", value)
        out[key] = [float(v) for v in factors]
    if "factor" not in out:
        out["factor"] = max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        f = out["factor"]
        attention = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(original))
    _check_float("rope_scaling['attention_factor']", attention)
    out["attention_factor"] = float(attention)


def _rope_scaling(
    scaling: Any, max_position_embeddings: int, d: int, partial_rotary_factor: float = 1.0
) -> Optional[dict]:
    """``rope_scaling`` in the one form a ModelConfig keeps (None for plain RoPE).

    Takes the transformers 4 spelling (``type``) and the 5 one (``rope_type``, as in
    ``rope_parameters``, whose ``rope_theta`` is read elsewhere). ``llama3`` and ``yarn`` without
    ``original_max_position_embeddings`` take ``max_position_embeddings``, as transformers does;
    ``yarn``'s optional parameters are stored with their values (see _yarn_scaling), as are
    ``longrope``'s (``d``: the rotated dims per head, which its factor lists must match).
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling: expected a dict or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    # The rotated fraction of each head (transformers 5 keeps it in rope_parameters, whatever the
    # type) is ModelConfig.partial_rotary_factor: a scaling dict must not disagree with it.
    partial = scaling.get("partial_rotary_factor")
    if partial is not None and partial != partial_rotary_factor:
        raise ValueError(
            f"rope_scaling: partial_rotary_factor {partial} differs from the config's "
            f"{partial_rotary_factor}"
        )
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALINGS:
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is not supported (plain RoPE, "
            f"{', '.join(repr(t) for t in ROPE_SCALINGS)}): got {scaling!r}"
        )
    out: dict[str, Any] = {"rope_type": rope_type}
    if rope_type not in ("yarn", "longrope") or scaling.get("factor") is not None:
        _check_float("rope_scaling['factor']", scaling.get("factor"))
        out["factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        _llama3_scaling(scaling, out, max_position_embeddings)
    elif rope_type == "yarn":
        _yarn_scaling(scaling, out, max_position_embeddings)
    elif rope_type == "longrope":
        _longrope_scaling(scaling, out, max_position_embeddings, d)
    return out


def _token_ids(name: str, value: Any) -> None:
    if value is None:
        return
    ids = value if isinstance(value, (list, tuple)) else [value]
    for v in ids:
        _check_int(name, v, 0)


@dataclasses.dataclass
class ModelConfig:
    """Hyperparameters of a Llama / Qwen2 / Qwen3 / Mistral / Phi-3 style decoder (dense or with
    mixture-of-experts MLPs: Qwen3-MoE, Mixtral), named as in Hugging Face.

    Attributes
    ----------
    vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads : int
        The usual sizes; ``hidden_size`` is the residual width, ``intermediate_size`` the SwiGLU
        width.
    num_key_value_heads : int, optional
        KV heads for grouped-query attention; defaults to ``num_attention_heads``; must divide it.
    head_dim : int, optional
        Per-head width; defaults to ``hidden_size // num_attention_heads``. Must be even (RoPE).
    rms_norm_eps : float
        Epsilon of every RMSNorm.
    rope_theta : float
        RoPE base.
    rope_scaling : dict, optional
        None for plain RoPE, else a rescaling of its frequencies, as in transformers:
        ``{"rope_type": "linear", "factor": f}`` (every frequency divided by ``f``) or
        ``{"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
        "original_max_position_embeddings": n}`` (Llama 3.1-3.3: wavelengths above ``n / lo``
        divided by ``f``, below ``n / hi`` kept, blended between) or ``{"rope_type": "yarn",
        "factor": f, "original_max_position_embeddings": n, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": True, "attention_factor": a}`` (YaRN, Qwen2.5 / Qwen3's long-context setting:
        frequencies that turn fewer than ``beta_slow`` times over ``n`` positions divided by
        ``f``, more than ``beta_fast`` times kept, ramped between; cos and sin multiplied by
        ``a``, by default ``0.1 ln f + 1``; optional parameters left out take transformers'
        defaults and are stored with them) or ``{"rope_type": "dynamic", "factor": f}`` (dynamic
        NTK: plain RoPE up to ``max_position_embeddings``, the longest sequence a model takes,
        beyond which it would rescale) or ``{"rope_type": "longrope", "short_factor": [...],
        "long_factor": [...], "original_max_position_embeddings": n, "factor": f,
        "attention_factor": a}`` (Phi-3's LongRoPE: frequency i divided by ``short_factor[i]``,
        cos and sin times ``a``; the model's length stops at ``n``, past which transformers
        switches a whole pass to ``long_factor``).
    max_position_embeddings : int
        The longest sequence (prompt + generation) a KV cache may hold.
    tie_word_embeddings : bool
        ``lm_head.weight`` is ``model.embed_tokens.weight``.
    attention_bias : bool
        Biases on the q/k/v projections (for ``llama``, ``qwen3`` and ``qwen3_moe`` also on o).
        Always True for ``qwen2``, always False for ``mistral``, ``phi3`` and ``mixtral``.
    model_type : str
        One of :data:`MODEL_TYPES` (``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"mistral"``,
        ``"phi3"``, ``"qwen3_moe"``, ``"mixtral"``; see the module doc); decides the Hugging Face
        class on export and the family's details (q/k norms, fused projections, experts).
    bos_token_id, eos_token_id, pad_token_id : int or list of int, optional
        Special token ids (``eos_token_id`` may be a list; ``pad_token_id`` -1 means none, as
        some Llama exports write it).
    sliding_window : int, optional
        Mistral/Qwen2 attention window; sequences longer than it are refused (see module doc).
    initializer_range : float
        Standard deviation of the normal initialisation of a freshly built model.
    partial_rotary_factor : float
        The fraction of each head that RoPE rotates (its first ``rotary_dim`` dims, the rest
        passed through): 1 but for Phi-3-style models such as Phi-4-mini (0.75).
    num_experts : int, optional
        Experts per sparse MLP (``qwen3_moe``, ``mixtral``; transformers also spells it
        ``num_local_experts``); None for the dense families.
    num_experts_per_tok : int
        Experts each token is routed to (the router's top-k).
    moe_intermediate_size : int, optional
        Width of each expert; defaults to ``intermediate_size`` (Mixtral's experts are as wide as
        its dense MLP would be; Qwen3-MoE's dense layers keep ``intermediate_size``).
    norm_topk_prob : bool
        Whether the top-k router probabilities are renormalised to sum to one (always for
        ``mixtral``).
    decoder_sparse_step, mlp_only_layers : int, list of int
        Qwen3-MoE: layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0`` and ``i``
        is not in ``mlp_only_layers``; the other layers have a dense MLP.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, list[int]]] = None
    pad_token_id: Optional[int] = None
    sliding_window: Optional[int] = None
    initializer_range: float = 0.02
    partial_rotary_factor: float = 1.0
    num_experts: Optional[int] = None
    num_experts_per_tok: int = 2
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            _check_int(name, getattr(self, name), 1)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type: expected one of {', '.join(MODEL_TYPES)}, got {self.model_type!r}"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _check_int("num_key_value_heads", self.num_key_value_heads, 1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads = {self.num_attention_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"head_dim: not given, and hidden_size = {self.hidden_size} is not a multiple "
                    f"of num_attention_heads = {self.num_attention_heads}"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_int("head_dim", self.head_dim, 2)
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        _check_float("rms_norm_eps", self.rms_norm_eps)
        _check_float("rope_theta", self.rope_theta)
        _check_float("initializer_range", self.initializer_range)
        _check_float("partial_rotary_factor", self.partial_rotary_factor)
        if self.partial_rotary_factor > 1.0:
            raise ValueError(
                f"partial_rotary_factor: expected a fraction in (0, 1], got "
                f"{self.partial_rotary_factor}"
            )
        if self.partial_rotary_factor != 1.0:
            if self.model_type != "phi3":
                raise ValueError(
                    f"partial_rotary_factor: {self.model_type} rotates whole heads; RoPE on "
                    "part of each head is Phi-3's (Phi-4-mini)"
                )
            if self.rotary_dim < 2 or self.rotary_dim % 2:
                raise ValueError(
                    f"partial_rotary_factor: rotates {self.rotary_dim} of {self.head_dim} dims "
                    "per head; RoPE needs an even number >= 2"
                )
        self.rope_scaling = _rope_scaling(
            self.rope_scaling,
            self.max_position_embeddings,
            self.rotary_dim,
            self.partial_rotary_factor,
        )
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("attention_bias: Qwen2 always has q/k/v biases; it must be True")
        if self.model_type in ("phi3", "mixtral") and self.attention_bias:
            raise ValueError(f"attention_bias: {self.model_type} has no attention biases")
        if self.model_type == "mistral" and self.attention_bias:
            raise ValueError("attention_bias: Mistral has no attention biases; it must be False")
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, 1)
        if self.bos_token_id is not None:
            _check_int("bos_token_id", self.bos_token_id, 0)
        if self.pad_token_id is not None:
            # -1 is how some Llama exports say "no pad token"; the model never reads it.
            _check_int("pad_token_id", self.pad_token_id, -1)
        _token_ids("eos_token_id", self.eos_token_id)
        if isinstance(self.eos_token_id, tuple):
            self.eos_token_id = list(self.eos_token_id)
        self._check_experts()

    def _check_experts(self) -> None:
        if self.model_type not in MOE_TYPES:
            if self.num_experts is not None:
                raise ValueError(
                    f"num_experts: model_type {self.model_type!r} has dense MLPs; experts need "
                    f"one of {', '.join(MOE_TYPES)}"
                )
            return
        if self.num_experts is None:
            raise ValueError(f"num_experts: model_type {self.model_type!r} needs it")
        _check_int("num_experts", self.num_experts, 1)
        _check_int("num_experts_per_tok", self.num_experts_per_tok, 1)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: {self.num_experts_per_tok} exceeds num_experts = "
                f"{self.num_experts}"
            )
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        _check_int("moe_intermediate_size", self.moe_intermediate_size, 1)
        _check_int("decoder_sparse_step", self.decoder_sparse_step, 1)
        if not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob: expected a bool, got {self.norm_topk_prob!r}")
        if self.model_type == "mixtral" and not self.norm_topk_prob:
            raise ValueError("norm_topk_prob: Mixtral always renormalises; it must be True")
        if self.model_type == "mixtral" and (self.decoder_sparse_step != 1 or self.mlp_only_layers):
            raise ValueError("decoder_sparse_step / mlp_only_layers: every Mixtral layer is sparse")
        if not isinstance(self.mlp_only_layers, (list, tuple)):
            raise TypeError(f"mlp_only_layers: expected a list, got {self.mlp_only_layers!r}")
        self.mlp_only_layers = list(self.mlp_only_layers)
        for i in self.mlp_only_layers:
            _check_int("mlp_only_layers[i]", i, 0)
            if i >= self.num_hidden_layers:
                raise ValueError(
                    f"mlp_only_layers: layer {i} does not exist ({self.num_hidden_layers} layers)"
                )

    # ---- derived sizes ----------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def o_bias(self) -> bool:
        """Whether o_proj has a bias (Llama, Qwen3, Qwen3-MoE with attention_bias only)."""
        return self.attention_bias and self.model_type in ("llama", "qwen3", "qwen3_moe")

    @property
    def qk_norm(self) -> bool:
        """Whether each head of q and of k is RMS-normalised before RoPE (Qwen3, Qwen3-MoE)."""
        return self.model_type in ("qwen3", "qwen3_moe")

    def sparse_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has a mixture-of-experts MLP."""
        return (
            self.num_experts is not None
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def max_length(self) -> int:
        """The longest sequence this model computes exactly: ``max_position_embeddings``, the
        ``sliding_window`` if smaller (see the module doc), and LongRoPE's pretraining context
        (past it the frequencies switch to ``long_factor`` for a whole forward pass)."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        if self.rope_scaling and self.rope_scaling["rope_type"] == "longrope":
            limit = min(limit, self.rope_scaling["original_max_position_embeddings"])
        return limit

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones): ``head_dim`` times
        ``partial_rotary_factor``, as transformers rounds it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def fused_projections(self) -> bool:
        """Whether the checkpoint fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
        (Phi-3)."""
        return self.model_type == "phi3"

    @property
    def eos_token_ids(self) -> list[int]:
        """``eos_token_id`` as a (possibly empty) list."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    # ---- Hugging Face config.json -----------------------------------------------------------

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` dict of a Llama, Qwen2, Qwen3 or Mistral model.

        Both the transformers 4 spelling (``rope_theta``, ``rope_scaling``) and the transformers 5
        one (``rope_parameters``) are accepted. Keys that do not affect the forward pass are
        ignored.

        Raises
        ------
        ValueError
            An unsupported model type, activation, MLP bias, RoPE scaling (LongRoPE), a RoPE
            scaling parameter out of range, or a missing size.
        TypeError
            ``hf`` is not a dict, or a size or RoPE scaling parameter has the wrong type (a
            ``llama3`` scaling without ``low_freq_factor``, say).
        """
        if not isinstance(hf, dict):
            raise TypeError(f"hf: expected a dict (a parsed config.json), got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type: unsupported {model_type!r}; Transformer implements "
                f"{', '.join(MODEL_TYPES)} (wrap other transformers models with HFCausalLM)"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {act!r}")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias: MLP biases are not supported")

        rope_theta = hf.get("rope_theta")
        scaling = hf.get("rope_scaling")
        params = hf.get("rope_parameters")
        if params is not None:
            # transformers 5: the RoPE base and its scaling in one dict (which it may mirror
            # into rope_scaling); it wins over the transformers 4 keys.
            if not isinstance(params, dict):
                raise ValueError(f"rope_parameters: expected a dict, got {params!r}")
            rope_theta = params.get("rope_theta", rope_theta)
            scaling = params
        elif scaling is not None and not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling: expected a dict, got {scaling!r}")
        if rope_theta is None:
            rope_theta = 10000.0
        if (
            isinstance(scaling, dict)
            and scaling.get("rope_type", scaling.get("type")) in _ROPE_WITH_CONTEXT
            and hf.get("original_max_position_embeddings") is not None
        ):
            # A top-level pretraining context wins over the scaling's own, as in transformers
            # (Phi-3 style exports write it there).
            scaling = {
                **scaling,
                "original_max_position_embeddings": hf["original_max_position_embeddings"],
            }

        sliding_window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and (
            not hf.get("use_sliding_window", False)
            or hf.get("max_window_layers", 0) >= hf.get("num_hidden_layers", 0)
        ):
            sliding_window = None
        if model_type == "llama":
            sliding_window = None
        # The rotated fraction of each head: rope_parameters' (transformers 5) over the top-level
        # key, as transformers reads it.
        partial = hf.get("partial_rotary_factor")
        if isinstance(scaling, dict) and scaling.get("partial_rotary_factor") is not None:
            partial = scaling["partial_rotary_factor"]
        if partial is None:
            partial = 1.0

        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in hf
        ]
        if missing:
            raise ValueError(f"hf: config.json lacks {', '.join(missing)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        # Keys outside the dataclass (dtype, use_cache, dropout, ...) don't affect the forward pass.
        kwargs = {k: v for k, v in hf.items() if k in fields and k not in _DERIVED_FIELDS}
        if model_type == "qwen2":
            kwargs["attention_bias"] = True
        elif model_type in ("mistral", "mixtral", "phi3"):
            kwargs["attention_bias"] = False
        if model_type in MOE_TYPES:
            experts = hf.get("num_experts", hf.get("num_local_experts"))
            kwargs["num_experts"] = experts
            if model_type == "mixtral":
                kwargs["norm_topk_prob"] = True  # Mixtral's router always renormalises
            else:
                # transformers' defaults for these differ from any real checkpoint's (8 experts
                # per token, width 768): a config.json must state them.
                lacking = [
                    k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in hf
                ]
                if lacking:
                    raise ValueError(f"hf: config.json lacks {', '.join(lacking)}")
                kwargs.setdefault("norm_topk_prob", False)  # transformers' default
        if model_type not in ("qwen3_moe",):
            for key in ("decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size"):
                kwargs.pop(key, None)
        if model_type not in MOE_TYPES:
            for key in ("num_experts_per_tok", "norm_topk_prob"):
                kwargs.pop(key, None)
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)
        return cls(
            model_type=model_type,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,  # normalised (or refused) by __post_init__
            partial_rotary_factor=partial,
            sliding_window=sliding_window,
            **kwargs,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers loads as Llama/Qwen2/Qwen3/MistralForCausalLM.

        Written so that transformers 4.4x-4.5x (``rope_theta``) and 5.x (``rope_parameters``)
        both read it.
        """
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": {
                **(self.rope_scaling or {"rope_type": "default"}),
                "rope_theta": self.rope_theta,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }
        if self.model_type == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            if self.model_type != "qwen2":
                hf["attention_bias"] = self.attention_bias
            hf["use_sliding_window"] = self.sliding_window is not None
            hf["sliding_window"] = self.sliding_window
            # Every layer slides when a window is set: the conservative reading of a window.
            hf["max_window_layers"] = (
                0 if self.sliding_window is not None else self.num_hidden_layers
            )
        elif self.model_type in ("mistral", "mixtral", "phi3"):
            hf["sliding_window"] = self.sliding_window
        if self.partial_rotary_factor != 1.0:
            hf["partial_rotary_factor"] = self.partial_rotary_factor
            hf["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        if self.model_type == "phi3" and self.rope_scaling:
            original = self.rope_scaling.get("original_max_position_embeddings")
            if original is not None:  # Phi-3 keeps its pretraining context at the top level
                hf["original_max_position_embeddings"] = original
        if self.model_type == "qwen3_moe":
            hf.update(
                num_experts=self.num_experts,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        elif self.model_type == "mixtral":
            hf["num_local_experts"] = self.num_experts
        if self.model_type in MOE_TYPES:
            hf["num_experts_per_tok"] = self.num_experts_per_tok
        return hf

    @classmethod
    def from_json_file(cls, path: Union[str, os.PathLike]) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` file (see :meth:`from_hf_config`)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_config(json.load(f))

    def to_json_file(self, path: Union[str, os.PathLike], **extra: Any) -> None:
        """Writes :meth:`to_hf_config` (plus ``extra`` keys, e.g. ``torch_dtype``) as JSON."""
        hf = self.to_hf_config()
        hf.update(extra)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
            f.write("\n")
