"""SpecFormer: a draft head that drafts a whole chain in one pass from the target's hidden states.

Autoregressive drafters (a draft model, EAGLE's head) run one pass per draft token, and widen the
draft into big trees to make up for their misses; at large batch the target has little idle
compute left to verify such trees. SpecFormer (Shi, Li, Zhang, Qi, Liu and Zhao, "Scaling LLM
Speculative Decoding: Non-Autoregressive Forecasting in Large-Batch Scenarios", AAAI 2026) drafts
``k`` tokens at once with a small head that mixes both kinds of attention:

* **unidirectional** (the context block): the target's states at a few layers, normalised and
  projected to one feature per position, go through one causal self-attention layer over the
  whole sequence (with its own KV cache), so the head reads the entire context as an
  autoregressive model does;
* **bidirectional** (the draft block): the context output at the last accepted node is expanded
  into ``k`` slot states (one linear map with a bias per slot), which attend to each other without
  a mask and pass a SwiGLU MLP; the target's own final norm and LM head turn slot ``i`` into the
  distribution of the token ``i + 2`` positions after that node, in parallel, with no
  position-dependent parameters beyond the expansion.

Round rule: the verify pass that accepts ``m`` drafts gives the target's states at the round's
root and its accepted drafts (``m + 1`` positions), which extend the head's context; the context
output at the last of them (the node whose distribution gave the bonus or correction token, the
next round's root) makes the next round's ``k`` drafts, for the ``k`` positions after that root.
So drafting costs one small head step per round, done right after verification; the root itself
is not an input (the head predicts past it, as Medusa's heads do).

``SpecFormerHead(root_aware=True)`` goes beyond the paper: the slots also read the root token
(through the target's input embedding), so the first slot drafts the token right after a known
one. :class:`SpecFormerHead` is the head, :func:`fit_specformer` trains it by distillation from a
frozen target on real text (per slot, KL from the target's distribution at the slot's position),
:class:`SpecFormerDrafter` drafts with it (chains, sampled losslessly or greedy, or a tree of the
slots' most likely tokens); the engine hands it the target's states
(:class:`~specdecode.engine.SpeculativeDecoder`, the ``target_states = "path"`` protocol of
:mod:`specdecode.drafters`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from ._distill import (
    check_hidden,
    check_layers,
    check_training,
    check_windows,
    divergence,
    target_pass,
    train,
)
from .drafters import (
    SampledDraftTree,
    SlotSampling,
    _draft_seed,
    _new_slots,
    _open_slots,
    _token_rows,
)
from .models.transformer import MLP, RMSNorm, _apply_rope, _mm_rows, _pack_weight
from .ops import DraftTree

__all__ = [
    "SpecFormerDrafter",
    "SpecFormerFit",
    "SpecFormerHead",
    "fit_specformer",
    "specformer_agreement",
]

_FORMAT = "specdecode.SpecFormerHead/1"
_EPS = 1e-6


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected {lo} to {hi}, got {value}")
    return value


class SpecFormerHead(nn.Module):
    """The SpecFormer draft head (see the module docstring).

    Parameters
    ----------
    target_hidden_size : int
        The target's hidden size ``H`` (the head works at that width: its slot states go through
        the target's final norm and LM head).
    target_layers : sequence of int
        The target's hidden-state indices to read (as ``output_hidden`` takes them), ``S`` of
        them, distinct, ``>= 0``.
    k : int
        Draft slots, the longest chain one step drafts (``1 .. 64``).
    num_heads : int
        Attention heads of both blocks; ``H / num_heads`` must be even (RoPE).
    intermediate_size : int, optional
        The draft block's MLP width (default ``3 H``).
    rope_theta : float
        RoPE base of the context block (positions are the sequence's).
    root_aware : bool
        An extension beyond the paper (False: the paper's head): the slots also read the
        round's root token (the bonus or correction token the verify pass just produced),
        through the target's input embedding, RMS-normalised and projected (zero at first)
        onto the context output before the expansion. Slot 1 then drafts the token right after
        a token it knows, as an autoregressive drafter does; the head's step moves from
        :meth:`SpecFormerDrafter.follow` to :meth:`SpecFormerDrafter.propose` (the root is
        known only once the step's tokens are committed).

    Notes
    -----
    Per position: ``x = down(concat(norm_s(h_s)))`` ``[H]``; the context block
    ``c = x + attn_causal(norm(x))`` (RoPE); the draft block ``z = expand(norm(c))`` ``[k, H]``,
    ``z = z + attn_full(norm(z))``, ``z = z + mlp(norm(z))``; logits ``lm_head(final_norm(z))``
    with the target's modules. Only the context block keeps state between rounds (its K/V).
    """

    def __init__(
        self,
        target_hidden_size: int,
        target_layers: Sequence[int],
        k: int = 4,
        *,
        num_heads: int = 8,
        intermediate_size: Optional[int] = None,
        rope_theta: float = 10000.0,
        root_aware: bool = False,
    ) -> None:
        super().__init__()
        h = _check_int("target_hidden_size", target_hidden_size, 2, 1 << 16)
        self.k = _check_int("k", k, 1, 64)
        heads = _check_int("num_heads", num_heads, 1, h)
        if h % heads or (h // heads) % 2:
            raise ValueError(
                f"num_heads: the hidden size {h} must split into {heads} heads of an even size"
            )
        width = 3 * h if intermediate_size is None else intermediate_size
        width = _check_int("intermediate_size", width, 1, 1 << 20)
        if not (isinstance(rope_theta, (int, float)) and math.isfinite(rope_theta)) or (
            rope_theta <= 1
        ):
            raise ValueError(f"rope_theta: expected a finite float > 1, got {rope_theta!r}")
        self.target_layers = check_layers(target_layers)
        self.target_hidden_size = h
        self.num_heads = heads
        self.head_dim = h // heads
        self.intermediate_size = width
        self.rope_theta = float(rope_theta)
        self.input_norms = nn.ModuleList(RMSNorm(h, _EPS) for _ in self.target_layers)
        self.down = nn.Linear(len(self.target_layers) * h, h, bias=False)
        self.context_norm = RMSNorm(h, _EPS)
        self.context_qkv = nn.Linear(h, 3 * h, bias=False)
        self.context_out = nn.Linear(h, h, bias=False)
        self.expand_norm = RMSNorm(h, _EPS)
        # The bias is each slot's learned embedding: the only thing that tells slots apart
        # before the draft block (which has no positions).
        self.expand = nn.Linear(h, self.k * h)
        self.draft_norm = RMSNorm(h, _EPS)
        self.draft_qkv = nn.Linear(h, 3 * h, bias=False)
        self.draft_out = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h, _EPS)
        self.mlp = MLP(SimpleNamespace(hidden_size=h, intermediate_size=width))
        self.root_aware = bool(root_aware)
        if self.root_aware:
            self.root_norm = RMSNorm(h, _EPS)
            self.root_proj = nn.Linear(h, h, bias=False)
            with torch.no_grad():  # an untrained projection adds nothing: the paper's head
                self.root_proj.weight.zero_()
        self._inv_freq: Optional[torch.Tensor] = None  # RoPE frequencies, made on first use
        # Per linear layer: (weight's (data_ptr, version), weight transposed, oneDNN-packed
        # weight or None), for inference (see _linear).
        self._fast: dict[int, tuple[tuple[int, int], torch.Tensor, Optional[torch.Tensor]]] = {}

    @classmethod
    def for_target(
        cls,
        target: Any,
        k: int = 4,
        target_layers: Optional[Sequence[int]] = None,
        **kwargs: Any,
    ) -> SpecFormerHead:
        """An untrained head sized for ``target`` (a model with ``config.hidden_size`` and
        ``config.num_hidden_layers``): ``target_layers`` defaults to the low, middle and high
        states of :func:`specdecode.steering.default_target_layers`, ``num_heads`` to the
        target's attention heads where they split the hidden size evenly."""
        from .steering import default_target_layers

        config = _target_config(target)
        count = int(config.num_hidden_layers)
        layers = default_target_layers(count) if target_layers is None else tuple(target_layers)
        bad = [i for i in layers if not isinstance(i, int) or not 0 <= i <= count]
        if bad:
            raise ValueError(
                f"target_layers: {bad} outside the target's hidden states [0, {count}]"
            )
        if "num_heads" not in kwargs:
            heads = int(getattr(config, "num_attention_heads", 0) or 0)
            size = int(config.hidden_size)
            kwargs["num_heads"] = (
                heads if heads and size % heads == 0 and (size // heads) % 2 == 0 else 1
            )
        return cls(int(config.hidden_size), layers, k, **kwargs)

    # ---- the blocks ----------------------------------------------------------------------------

    def _linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)``; without autograd through a weight packed once (the model layer's
        :func:`~specdecode.models.transformer._pack_weight`): a drafting step multiplies a few
        rows, where ``torch.mm`` would repack the whole weight on every call. Rebuilt when the
        weight changes (its version counter)."""
        if torch.is_grad_enabled() or x.device.type != "cpu":
            return layer(x)
        w = layer.weight
        key = (w.data_ptr(), w._version)
        entry = self._fast.get(id(layer))
        if entry is None or entry[0] != key:
            entry = (key, w.detach().t().contiguous(), _pack_weight(w))
            self._fast[id(layer)] = entry
        y = _mm_rows(x.reshape(-1, x.shape[-1]), entry[1], entry[2])
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp  # SwiGLU, as MLP.forward, through _linear
        return self._linear(
            m.down_proj, F.silu(self._linear(m.gate_proj, x)) * self._linear(m.up_proj, x)
        )

    def features(self, hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """The head's input per position: ``[..., H]`` float32 from one ``[..., H]`` target state
        per index of :attr:`target_layers`."""
        check_hidden(hidden, self.target_layers, self.target_hidden_size)
        device = self.down.weight.device
        parts = [norm(h.to(device, torch.float32)) for norm, h in zip(self.input_norms, hidden)]
        return self._linear(self.down, torch.cat(parts, dim=-1))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        inv_freq = self._inv_freq
        if inv_freq is None or inv_freq.device != positions.device:
            steps = torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d
            inv_freq = self._inv_freq = 1.0 / self.rope_theta**steps
        angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def context_kv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The context block's queries, keys and values of features ``x`` ``[B, T, H]`` at
        ``positions`` int64 ``[B, T]``: each ``[B, T, heads, H / heads]``, q and k rotated."""
        b, t, _ = x.shape
        q, k, v = self._linear(self.context_qkv, self.context_norm(x)).chunk(3, dim=-1)
        shape = (b, t, self.num_heads, self.head_dim)
        cos, sin = self._rope(positions)
        return (
            _apply_rope(q.reshape(shape), cos, sin),
            _apply_rope(k.reshape(shape), cos, sin),
            v.reshape(shape),
        )

    def context_attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The context block's output ``x + out(attention)`` ``[B, Tq, H]``: queries ``q``
        ``[B, Tq, heads, D]`` over keys / values ``[B, S, heads, D]``; ``mask`` bool
        ``[B, Tq, S]`` (True: attended), None for a causal window (``Tq == S``)."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=None if mask is None else mask.unsqueeze(1),
            is_causal=mask is None,
        )
        b, t = x.shape[:2]
        return x + self._linear(self.context_out, out.transpose(1, 2).reshape(b, t, -1))

    def context(self, x: torch.Tensor) -> torch.Tensor:
        """The context block over whole windows of features ``[B, T, H]`` from position 0."""
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        q, k, v = self.context_kv(x, positions)
        return self.context_attend(x, q, k, v, None)

    def slots(self, c: torch.Tensor, roots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The draft block: context outputs ``[..., H]`` -> slot states ``[..., k, H]``;
        ``roots`` ``[..., H]``: the roots' input embeddings (a root-aware head only)."""
        if self.root_aware != (roots is not None):
            raise ValueError(
                "roots: a root-aware head needs the roots' embeddings, another head takes none"
            )
        if roots is not None:
            c = c + self._linear(self.root_proj, self.root_norm(roots.to(c.dtype)))
        lead = c.shape[:-1]
        h = self.target_hidden_size
        z = self._linear(self.expand, self.expand_norm(c)).reshape(-1, self.k, h)
        n = z.shape[0]
        q, kk, v = self._linear(self.draft_qkv, self.draft_norm(z)).chunk(3, dim=-1)
        split = (n, self.k, self.num_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.reshape(split).transpose(1, 2),
            kk.reshape(split).transpose(1, 2),
            v.reshape(split).transpose(1, 2),
        )
        z = z + self._linear(self.draft_out, out.transpose(1, 2).reshape(n, self.k, h))
        z = z + self._mlp(self.mlp_norm(z))
        return z.reshape(*lead, self.k, h)

    def forward(
        self, hidden: Sequence[torch.Tensor], roots: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Slot states at every position of whole windows.

        Parameters
        ----------
        hidden : sequence of torch.Tensor
            One floating ``[B, T, H]`` target state per index of :attr:`target_layers`, the
            windows starting at position 0.
        roots : torch.Tensor, optional
            A root-aware head: ``[B, T, H]``, at position ``t`` the input embedding of token
            ``t + 1`` (the root of the round drafted from ``t``).

        Returns
        -------
        torch.Tensor
            float32 ``[B, T, k, H]``: slot ``i`` at position ``t`` stands for token ``t + 2 + i``
            (feed it to the target's final norm and LM head).
        """
        return self.slots(self.context(self.features(hidden)), roots)

    # ---- files ---------------------------------------------------------------------------------

    def save(self, path: Union[str, Path], dtype: torch.dtype = torch.float32) -> None:
        """Writes the head to one safetensors file (its sizes in the metadata), its weights
        rounded to ``dtype`` (float32, float16 or bfloat16; :meth:`load` reads float32)."""
        from .models.io import write_tensor_file

        meta = {
            "format": _FORMAT,
            "target_layers": ",".join(str(i) for i in self.target_layers),
            "target_hidden_size": str(self.target_hidden_size),
            "k": str(self.k),
            "num_heads": str(self.num_heads),
            "intermediate_size": str(self.intermediate_size),
            "rope_theta": repr(self.rope_theta),
            "root_aware": "1" if self.root_aware else "0",
        }
        write_tensor_file(path, self.state_dict(), meta, dtype)

    @classmethod
    def load(cls, path: Union[str, Path]) -> SpecFormerHead:
        """Reads a head written by :meth:`save` (float32, on the CPU).

        Raises
        ------
        FileNotFoundError
            If ``path`` does not exist.
        ValueError
            If the file is not a saved head.
        """
        from .models.io import read_tensor_file

        meta, tensors = read_tensor_file(path, "SpecFormer head")
        if meta.get("format") != _FORMAT:
            raise ValueError(f"path: {path} does not hold a SpecFormerHead (format {_FORMAT})")
        try:
            head = cls(
                int(meta["target_hidden_size"]),
                tuple(int(i) for i in meta["target_layers"].split(",")),
                int(meta["k"]),
                num_heads=int(meta["num_heads"]),
                intermediate_size=int(meta["intermediate_size"]),
                rope_theta=float(meta["rope_theta"]),
                root_aware=meta.get("root_aware", "0") == "1",
            )
            head.load_state_dict({n: t.float() for n, t in tensors.items()}, strict=True)
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"path: {path} holds an inconsistent SpecFormerHead ({e})") from e
        return head


def _target_config(target: Any) -> Any:
    """The target's config (``hidden_size``, ``num_hidden_layers``): its own, or that of the
    transformers model inside :class:`~specdecode.models.HFCausalLM`."""
    for config in (
        getattr(target, "config", None),
        getattr(getattr(target, "model", None), "config", None),
    ):
        if hasattr(config, "hidden_size") and hasattr(config, "num_hidden_layers"):
            return config
    raise TypeError(
        f"target: expected a model with config.hidden_size and config.num_hidden_layers "
        f"(specdecode.models.Transformer or HFCausalLM), got {type(target).__name__}"
    )


def output_layers(target: Any) -> tuple[nn.Module, nn.Module]:
    """The target's final norm and LM head (the modules SpecFormer's slot states go through):
    those of :class:`~specdecode.models.Transformer`, or of the transformers model inside
    :class:`~specdecode.models.HFCausalLM` (its base model's ``norm``)."""
    inner = getattr(target, "model", None)
    norm = getattr(inner, "norm", None)
    head = getattr(target, "lm_head", None)
    if norm is None or head is None:  # a transformers model wrapped by HFCausalLM
        base = getattr(inner, "base_model", None)
        norm = getattr(base, "norm", None)
        get = getattr(inner, "get_output_embeddings", None)
        head = get() if callable(get) else None
    if not isinstance(norm, nn.Module) or not isinstance(head, nn.Module):
        raise TypeError(
            f"target: found no final norm and LM head in {type(target).__name__} (SpecFormer "
            "needs specdecode.models.Transformer or a transformers model with model.norm)"
        )
    return norm, head


def input_embeddings(target: Any) -> nn.Module:
    """The target's input embedding (a root-aware head reads the root through it)."""
    inner = getattr(target, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if embed is None:
        get = getattr(inner, "get_input_embeddings", None)
        embed = get() if callable(get) else None
    if not isinstance(embed, nn.Module):
        raise TypeError(f"target: found no input embedding in {type(target).__name__}")
    return embed


def slot_logits(z: torch.Tensor, norm: nn.Module, head: nn.Module) -> torch.Tensor:
    """The target's logits of slot states ``z`` ``[..., k, H]`` -> ``[..., k, V]`` (the target's
    final norm and LM head, in their dtype)."""
    dtype = getattr(getattr(head, "weight", None), "dtype", z.dtype)
    return head(norm(z.to(dtype)))


# ---- training ----------------------------------------------------------------------------------


def _slot_positions(length: int, k: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct positions ``t`` of a ``length``-token window whose ``k`` slot targets
    (the target's distributions at ``t + 1 .. t + k``) all lie inside it, sorted."""
    last = length - 1 - k  # t + k <= length - 1
    if last < 0:
        raise ValueError(f"windows: {length} tokens hold no position with {k} slot targets")
    picks = torch.randperm(last + 1, generator=generator)[: min(count, last + 1)]
    return picks.sort().values


def _slot_log_probs(
    head: SpecFormerHead,
    target: Any,
    windows: torch.Tensor,
    hidden: list[torch.Tensor],
    positions: torch.Tensor,
) -> torch.Tensor:
    """The head's log-probabilities ``[B, P, k, V]`` at ``positions`` int64 ``[P]`` of whole
    ``windows`` (the context block runs over all of them; the draft block at the picks only; a
    root-aware head reads token ``t + 1`` at ``t``)."""
    norm, lm_head = output_layers(target)
    c = head.context(head.features(hidden))
    picks = positions.to(c.device)
    roots = None
    if head.root_aware:
        with torch.no_grad():
            ids = windows[:, positions + 1].to(target.device)
            roots = input_embeddings(target)(ids).float()
    z = head.slots(c[:, picks], roots)
    return torch.log_softmax(slot_logits(z, norm, lm_head).float(), dim=-1)


def _slot_targets(target_logp: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The target's log-probabilities ``[B, P, k, V]`` each slot learns: slot ``i`` at ``t``
    stands for the token after position ``t + 1 + i``."""
    index = positions.unsqueeze(1) + 1 + torch.arange(k).unsqueeze(0)  # [P, k]
    return target_logp[:, index.to(target_logp.device)]


@dataclasses.dataclass(frozen=True)
class SpecFormerFit:
    """What :func:`fit_specformer` returns.

    Attributes
    ----------
    head : SpecFormerHead
        The trained head (float32, on the target's device, in eval mode).
    losses : list of float
        The training loss (mean KL(target || slot) over slots and picked positions, nats) of
        each step.
    held_out : dict
        With ``held_out`` windows: ``{"kl", "agreement", "kl_by_slot", "agreement_by_slot"}``
        of the trained head (:func:`specformer_agreement`); empty otherwise.
    """

    head: SpecFormerHead
    losses: list[float]
    held_out: dict[str, Any]


def fit_specformer(
    target: Any,
    windows: torch.Tensor,
    *,
    k: int = 4,
    steps: int = 600,
    batch_size: int = 8,
    positions_per_window: int = 64,
    lr: float = 1e-3,
    target_layers: Optional[Sequence[int]] = None,
    num_heads: Optional[int] = None,
    intermediate_size: Optional[int] = None,
    root_aware: bool = False,
    held_out: Optional[torch.Tensor] = None,
    seed: int = 0,
    progress: bool = False,
) -> SpecFormerFit:
    """Trains a :class:`SpecFormerHead` for ``target`` by distillation on real text.

    Each step takes ``batch_size`` windows (cycling through ``windows`` in an order drawn from
    ``seed``), reads the frozen target's states and next-token distributions over them, runs the
    head's context block over every position and its draft block at ``positions_per_window``
    random positions, and minimises the mean over slots of KL(target at ``t + 1 + i`` || slot
    ``i`` at ``t``). Adam with ``lr`` warmed up over the first tenth of the steps, then
    cosine-decayed. The target is not changed.

    Parameters
    ----------
    target : specdecode.models.Transformer
        The target (``forward(..., output_hidden=)``, a final norm and an LM head).
    windows : torch.Tensor
        int64 ``[N, T]`` token windows of real text, ``T >= k + 2``, within the target's length.
    k : int
        Draft slots (``1 .. 64``).
    steps, batch_size : int
        Optimiser steps and windows per step.
    positions_per_window : int
        Positions per window that train the draft block.
    lr : float
        Peak learning rate.
    target_layers : sequence of int, optional
        The target's states to read (default: low, middle and high, as SD²'s).
    num_heads, intermediate_size : int, optional
        The head's sizes (defaults: :meth:`SpecFormerHead.for_target`).
    root_aware : bool
        Train a root-aware head (:class:`SpecFormerHead`; at ``t`` it reads token ``t + 1``).
    held_out : torch.Tensor, optional
        int64 ``[M, T']`` windows scored after training (:attr:`SpecFormerFit.held_out`).
    seed : int
        Seeds the initial weights, the window order and the positions.
    progress : bool
        A progress bar over the steps.

    Returns
    -------
    SpecFormerFit
    """
    output_layers(target)  # a clear error before any work
    if root_aware:
        input_embeddings(target)
    _check_int("k", k, 1, 64)
    vocab = int(target.vocab_size)
    windows = check_windows(windows, "windows", vocab, min_length=k + 2)
    if held_out is not None:
        held_out = check_windows(held_out, "held_out", vocab, min_length=k + 2)
    check_training(steps, batch_size, lr)
    _check_int("positions_per_window", positions_per_window, 1, 1 << 20)
    extra: dict[str, Any] = {"root_aware": bool(root_aware)}
    if num_heads is not None:
        extra["num_heads"] = num_heads
    if intermediate_size is not None:
        extra["intermediate_size"] = intermediate_size
    # The initial weights come from `seed` without touching the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = SpecFormerHead.for_target(target, k, target_layers, **extra).to(target.device)
    frozen = [p.requires_grad for p in target.parameters()]
    was_training = target.training

    def loss_of(batch: torch.Tensor, step: int) -> torch.Tensor:
        target_logp, hidden = target_pass(target, batch, head.target_layers)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        positions = _slot_positions(batch.shape[1], k, positions_per_window, g)
        head_logp = _slot_log_probs(head, target, batch, hidden, positions)
        wanted = _slot_targets(target_logp, positions, k)
        return divergence(wanted, head_logp, torch.ones(wanted.shape[:-1], dtype=torch.bool))[0]

    try:
        target.eval()
        for p in target.parameters():
            p.requires_grad_(False)
        head.train()
        losses = train(
            list(head.parameters()),
            windows,
            loss_of,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            progress=progress,
        )
    finally:
        for p, flag in zip(target.parameters(), frozen):
            p.requires_grad_(flag)
        target.train(was_training)
    head.eval()
    report = specformer_agreement(target, head, held_out) if held_out is not None else {}
    return SpecFormerFit(head, losses, report)


@torch.no_grad()
def specformer_agreement(
    target: Any,
    head: SpecFormerHead,
    windows: torch.Tensor,
    *,
    batch_size: int = 8,
) -> dict[str, Any]:
    """How close the head's slots are to the target on ``windows`` (every position with all its
    slot targets inside the window).

    Returns
    -------
    dict
        ``"kl"`` (mean KL(target || slot) in nats) and ``"agreement"`` (the fraction of slot
        predictions whose argmax is the target's), each over all slots, and per slot as lists
        ``"kl_by_slot"``, ``"agreement_by_slot"`` (slot ``i`` drafts the ``i + 1``-th token).
    """
    windows = check_windows(windows, "windows", int(target.vocab_size), min_length=head.k + 2)
    k = head.k
    kl_sum = torch.zeros(k, dtype=torch.float64)
    agree_sum = torch.zeros(k, dtype=torch.float64)
    count = 0
    positions = torch.arange(windows.shape[1] - 1 - k + 1)
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i : i + batch_size]
        target_logp, hidden = target_pass(target, batch, head.target_layers)
        head_logp = _slot_log_probs(head, target, batch, hidden, positions)
        wanted = _slot_targets(target_logp, positions, k)
        kl = (wanted.exp() * (wanted - head_logp)).sum(-1)  # [B, P, k]
        agree = (wanted.argmax(-1) == head_logp.argmax(-1)).double()
        kl_sum += kl.double().sum((0, 1)).cpu()
        agree_sum += agree.sum((0, 1)).cpu()
        count += kl.shape[0] * kl.shape[1]
    kl_by = (kl_sum / count).tolist()
    agree_by = (agree_sum / count).tolist()
    return {
        "kl": float(sum(kl_by) / k),
        "agreement": float(sum(agree_by) / k),
        "kl_by_slot": kl_by,
        "agreement_by_slot": agree_by,
    }


# ---- the drafter -------------------------------------------------------------------------------


class SpecFormerDrafter(SlotSampling):
    """Drafts with a :class:`SpecFormerHead` over the target's hidden states.

    Parameters
    ----------
    head : SpecFormerHead
        A trained head for ``target`` (moved to the target's device, eval mode).
    target : CausalLM
        The target the engine verifies with: its final norm and LM head turn slot states into
        distributions (:class:`~specdecode.models.Transformer`, or
        :class:`~specdecode.models.HFCausalLM` over a model with ``model.norm``).
    mode : str
        ``"chain"``: one draft token per slot, ``k`` of them. ``"tree"``: the ``max_nodes - 1``
        most likely paths through the slots' ``branch`` most likely tokens (a slot's distribution
        does not depend on the tokens before it, so a node's score is the sum of its path's
        log-probabilities).
    k : int, optional
        Chain depth / tree depth limit (default: the head's slots; at most that).
    sample : bool
        Chain mode: sample each slot's token from its distribution processed with the sequence's
        temperature / top-k / top-p (as verify processes the target's) and return it as
        ``draft_probs``, which keeps verification lossless; False drafts the argmax. Tree
        children are always the top tokens (deterministic, verified losslessly).
    branch, max_nodes : int
        Tree mode: tokens per slot and nodes per tree (root included, ``2 .. 1024``).
    max_length : int, optional
        Positions per sequence the head's context holds (default: the target's max length); a
        sequence past it drafts nothing.

    Notes
    -----
    The engine (``target_states = "path"``) calls :meth:`follow` after each verify pass with the
    target's states at each running row's root and accepted drafts, and after the prefill with
    those of the prompt but its last token; the head's step for the next round runs there, so
    :meth:`propose` only reads (``proposes_chains`` in chain mode). A root-aware head's draft
    block runs in :meth:`propose`, once the root is known (still without side effects). A slot
    whose head output is not for its current root (a one-token prompt's first round) drafts
    nothing.
    """

    target_states = "path"

    def __init__(
        self,
        head: SpecFormerHead,
        target: Any,
        *,
        mode: str = "chain",
        k: Optional[int] = None,
        sample: bool = True,
        branch: int = 4,
        max_nodes: int = 16,
        max_length: Optional[int] = None,
    ) -> None:
        if not isinstance(head, SpecFormerHead):
            raise TypeError(f"head: expected a SpecFormerHead, got {type(head).__name__}")
        if mode not in ("chain", "tree"):
            raise ValueError(f"mode: expected 'chain' or 'tree', got {mode!r}")
        self._norm, self._lm_head = output_layers(target)
        # specdecode's Transformer applies its final norm and LM head with packed weights
        # (several times faster for the k rows of a step than the modules).
        self._head_logits = getattr(target, "head_logits", None)
        size = _target_config(target).hidden_size
        if int(size) != head.target_hidden_size:
            raise ValueError(
                f"head: made for a target of hidden size {head.target_hidden_size}, this one's "
                f"is {size}"
            )
        count = getattr(target, "num_hidden_layers", None)
        if count is not None and max(head.target_layers) > int(count):
            raise ValueError(
                f"head: reads target states {head.target_layers}, the target has 0 .. {count}"
            )
        self.k = head.k if k is None else _check_int("k", k, 1, head.k)
        self.branch = _check_int("branch", branch, 1, 64)
        self.max_nodes = (
            self.k + 1 if mode == "chain" else _check_int("max_nodes", max_nodes, 2, 1024)
        )
        self.mode = mode
        self.sample = bool(sample)
        self.proposes_chains = mode == "chain"
        self.device = target.device
        self.head = head.to(self.device).eval()
        limit = int(target.max_length)
        self.max_length = (
            limit if max_length is None else _check_int("max_length", max_length, 2, limit)
        )
        self._vocab = int(target.vocab_size)
        shape = (0, 0, head.num_heads, head.head_dim)
        self._keys = torch.zeros(shape, device=self.device)  # [rows, capacity, heads, D]
        self._values = torch.zeros(shape, device=self.device)
        self._length: dict[int, int] = {}  # positions each open slot's context holds
        self._seq: dict[int, list[int]] = {}
        # Per slot: the slot logits [k, V] (float32, CPU) for the round whose root sits at
        # position `_made_for` (the context's length when they were made); a root-aware head
        # keeps the context output [H] there instead and makes the logits in propose.
        self._logits: dict[int, torch.Tensor] = {}
        self._embed = input_embeddings(target) if head.root_aware else None
        self._made_for: dict[int, int] = {}
        self._init_sampling()

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_sequences(self) -> int:
        return 1 << 20

    @property
    def target_hidden(self) -> tuple[int, ...]:
        """The target's hidden-state indices :meth:`follow` reads."""
        return tuple(self.head.target_layers)

    @property
    def target_hidden_size(self) -> int:
        return self.head.target_hidden_size

    # ---- protocol ------------------------------------------------------------------------------

    def start(self, slots: Sequence[int], prompts: Sequence[Any]) -> None:
        """Opens slots with their prompts (the head reads their states in :meth:`follow`)."""
        slots_l, rows = _new_slots(slots, prompts, self._seq.__contains__, self._vocab)
        for slot, row in zip(slots_l, rows):
            self._seq[slot] = row.tolist()
            self._length[slot] = 0
            self._reset_sampling(slot)

    def observe(self, slots: Sequence[int], committed: Sequence[Any]) -> None:
        """Appends each slot's committed tokens (its next root is the last of them)."""
        slots_l = _open_slots(slots, self._seq.__contains__)
        rows = _token_rows(committed, "committed", len(slots_l))
        for slot, row in zip(slots_l, rows):
            self._seq[slot].extend(row.tolist())

    def release(self, slots: Sequence[int]) -> None:
        for slot in _open_slots(slots, self._seq.__contains__):
            del self._seq[slot]
            for table in (self._length, self._logits, self._made_for):
                table.pop(slot, None)

    # ---- reading the target --------------------------------------------------------------------

    def _room(self, rows: int, length: int) -> None:
        """Grows the context K/V to ``rows`` rows and ``length`` positions (doubling)."""
        have_rows, have_len = self._keys.shape[:2]
        if rows <= have_rows and length <= have_len:
            return
        new_rows = max(rows, have_rows)
        new_len = min(self.max_length, max(length, 2 * have_len, 64))
        shape = (new_rows, new_len, self.head.num_heads, self.head.head_dim)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            grown = torch.zeros(shape, device=self.device)
            grown[: old.shape[0], : old.shape[1]] = old
            setattr(self, name, grown)

    @torch.no_grad()
    def follow(
        self, slots: Sequence[int], hidden: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> None:
        """Extends each slot's context with the target's states and makes its next drafts.

        Parameters
        ----------
        slots : sequence of int
            Open slots, ``n`` of them.
        hidden : sequence of torch.Tensor
            One floating ``[n, P, H]`` tensor per index of :attr:`target_hidden`, in that
            order: row ``i`` holds the target's states at the next ``lengths[i]`` positions of
            slot ``slots[i]``'s sequence (the prompt but its last token after the prefill; the
            root and the accepted drafts after a verify pass), the rest padding.
        lengths : sequence of int
            ``[n]``, each in ``1 .. P``.
        """
        slots_l = _open_slots(slots, self._seq.__contains__)
        n = len(slots_l)
        if not n:
            return
        if any(h.dim() != 3 or h.shape[0] != n for h in hidden):
            raise ValueError(
                f"hidden: expected [{n}, P, H] per target layer, got "
                f"{[list(h.shape) for h in hidden]}"
            )
        width = int(hidden[0].shape[1]) if hidden else 0
        count = torch.as_tensor(np.asarray(lengths, dtype=np.int64).reshape(-1))
        if count.numel() != n or bool((count < 1).any()) or bool((count > width).any()):
            raise ValueError(f"lengths: expected {n} counts in 1 .. {width}, got {count.tolist()}")
        start = torch.tensor([self._length[s] for s in slots_l], dtype=torch.int64)
        end = start + count
        fits = end <= self.max_length
        for i in torch.nonzero(~fits).squeeze(1).tolist():
            # Past the context's length: this sequence drafts nothing more.
            self._length[slots_l[i]] = self.max_length + 1
            self._logits.pop(slots_l[i], None)
        keep = torch.nonzero(fits).squeeze(1)
        if keep.numel() == 0:
            return
        slots_k = [slots_l[i] for i in keep.tolist()]
        start, end, count = start[keep], end[keep], count[keep]
        dev = self.device
        pick = keep.to(hidden[0].device)
        x = self.head.features([h[pick] for h in hidden])  # [R, P, H]
        positions = start.unsqueeze(1) + torch.arange(width).unsqueeze(0)
        q, k, v = self.head.context_kv(x, positions.to(dev))
        self._room(max(slots_k) + 1, int(end.max()))
        # The new positions' K/V into each slot's rows; padding beyond `count` is not written.
        rr, jj = torch.nonzero(torch.arange(width).unsqueeze(0) < count.unsqueeze(1), as_tuple=True)
        rows_t = torch.tensor(slots_k, dtype=torch.int64)
        self._keys[rows_t[rr].to(dev), (start[rr] + jj).to(dev)] = k[rr.to(dev), jj.to(dev)]
        self._values[rows_t[rr].to(dev), (start[rr] + jj).to(dev)] = v[rr.to(dev), jj.to(dev)]
        # Only the last new position's output is read: the node whose distribution gave the
        # next root.
        last = (count - 1).to(dev)
        r = torch.arange(len(slots_k), device=dev)
        span = int(end.max())
        mask = (torch.arange(span).unsqueeze(0) < end.unsqueeze(1)).unsqueeze(1)
        c = self.head.context_attend(
            x[r, last].unsqueeze(1),
            q[r, last].unsqueeze(1),
            self._keys[rows_t.to(dev), :span],
            self._values[rows_t.to(dev), :span],
            mask.to(dev),
        )[:, 0]
        # A root-aware head waits for the root (propose); the paper's drafts right away.
        made = c if self.head.root_aware else self._slot_logits(c, None)
        for i, slot in enumerate(slots_k):
            self._length[slot] = int(end[i])
            self._logits[slot] = made[i]
            self._made_for[slot] = int(end[i])

    @torch.no_grad()
    def _slot_logits(self, c: torch.Tensor, roots: Optional[torch.Tensor]) -> torch.Tensor:
        """float32 CPU ``[R, k, V]`` from context outputs ``[R, H]`` (and root ids ``[R]``)."""
        embedded = None if roots is None else self._embed(roots.to(self.device))
        z = self.head.slots(c, embedded)
        if self._head_logits is not None:
            return self._head_logits(z).float().cpu()
        return slot_logits(z, self._norm, self._lm_head).float().cpu()

    # ---- drafting ------------------------------------------------------------------------------

    def _ready(self, slot: int) -> bool:
        """Whether the slot's stored slot logits are for its current root."""
        return slot in self._logits and self._made_for[slot] == len(self._seq[slot]) - 1

    def propose(self, slots: Sequence[int]) -> Union[DraftTree, SampledDraftTree]:
        """Drafts a chain or a tree per slot from its stored slot logits (see the class
        docstring)."""
        slots_l = _open_slots(slots, self._seq.__contains__)
        if not slots_l:
            empty = torch.zeros((0, 1), dtype=torch.int32)
            return DraftTree(empty, empty.clone(), torch.zeros(0, dtype=torch.int32))
        if self.mode == "chain":
            return self._propose_chain(slots_l)
        return self._propose_tree(slots_l)

    def _stacked(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot logits ``[B, k, V]`` (zeros where not ready) and readiness bool ``[B]``."""
        ready = torch.tensor([self._ready(s) for s in slots], dtype=torch.bool)
        logits = torch.zeros((len(slots), self.k, self._vocab), dtype=torch.float32)
        for i, s in enumerate(slots):
            if ready[i] and not self.head.root_aware:
                logits[i] = self._logits[s][: self.k]
        if self.head.root_aware and bool(ready.any()):
            rows = torch.nonzero(ready).squeeze(1)
            c = torch.stack([self._logits[slots[i]] for i in rows.tolist()])
            roots = torch.tensor([self._seq[slots[i]][-1] for i in rows.tolist()])
            logits[rows] = self._slot_logits(c, roots)[:, : self.k]
        return logits, ready

    def _propose_chain(self, slots: list[int]) -> Union[DraftTree, SampledDraftTree]:
        batch, depth = len(slots), self.k
        logits, ready = self._stacked(slots)
        t, top_k, top_p, seed = self._sampling(slots)
        sampled = self.sample and bool((t > 0).any())
        tokens = torch.full((batch, depth + 1), -1, dtype=torch.int32)
        tokens[:, 0] = torch.tensor([self._seq[s][-1] for s in slots], dtype=torch.int32)
        probs = torch.zeros((batch, depth + 1, self._vocab)) if sampled else None
        lengths = torch.where(ready, depth, 0).to(torch.int32)
        # Offsets: the committed length, as the verifier's; one Philox key per slot.
        offset = torch.tensor([len(self._seq[s]) for s in slots], dtype=torch.int64)
        for d in range(depth):
            if not bool((lengths > d).any()):
                break
            if sampled:
                q = ops.sampling_probs(logits[:, d].contiguous(), t, top_k, top_p).probs
                nxt = ops.sample(
                    q, 1.0, seed=_draft_seed(seed, d), offset=offset, target_is_logits=False
                ).tokens
                probs[:, d] = q
                # A row whose processed distribution is bad draws -1: its chain ends there.
                lengths[(nxt < 0) & (lengths > d)] = d
            else:
                nxt = logits[:, d].argmax(dim=1).to(torch.int32)
            tokens[:, d + 1] = torch.where(lengths > d, nxt, -1)
        parents = ops.chain_parents(batch, depth).to(torch.int32)
        if probs is None:
            return DraftTree(tokens, parents, lengths + 1)
        return SampledDraftTree(tokens, parents, lengths + 1, probs)

    def _propose_tree(self, slots: list[int]) -> DraftTree:
        logits, ready = self._stacked(slots)
        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, min(self.branch, self._vocab), dim=-1)  # [B, k, branch]
        values, indices = top.values.tolist(), top.indices.tolist()
        rows: list[tuple[list[int], list[int]]] = []
        for b, slot in enumerate(slots):
            toks, pars = [self._seq[slot][-1]], [-1]
            if ready[b]:
                self._best_paths(values[b], indices[b], toks, pars)
            rows.append((toks, pars))
        width = max(len(t) for t, _ in rows)
        tokens = torch.full((len(slots), width), -1, dtype=torch.int32)
        parents = torch.full((len(slots), width), -1, dtype=torch.int32)
        for b, (toks, pars) in enumerate(rows):
            tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
            parents[b, : len(pars)] = torch.tensor(pars, dtype=torch.int32)
        return DraftTree(
            tokens, parents, torch.tensor([len(t) for t, _ in rows], dtype=torch.int32)
        )

    def _best_paths(
        self, values: list[list[float]], indices: list[list[int]], toks: list[int], pars: list[int]
    ) -> None:
        """Appends the ``max_nodes - 1`` best nodes below the root (best first). A child scores
        no more than its parent, so taking nodes best-first keeps the set ancestor-closed and
        puts each parent before its children."""
        # Heap entries: (-score, depth, tie, parent node index, choice at that depth).
        heap = [(-values[0][j], 1, j, 0, j) for j in range(len(values[0]))]
        heapq.heapify(heap)
        tie = len(heap)
        while heap and len(toks) < self.max_nodes:
            neg, depth, _, parent, j = heapq.heappop(heap)
            toks.append(indices[depth - 1][j])
            pars.append(parent)
            node = len(toks) - 1
            if depth < self.k:
                for c in range(len(values[depth])):
                    heapq.heappush(heap, (neg - values[depth][c], depth + 1, tie, node, c))
                    tie += 1
