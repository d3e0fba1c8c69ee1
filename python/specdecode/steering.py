"""Steered drafters: the target's hidden states steer a pretrained draft model (SD²).

A pretrained draft model generalises well but drifts from the target; a draft head that reads the
target's hidden states (EAGLE, Medusa) follows it closely but is weak on its own. SD² (Berdoz,
Rheinboldt and Wattenhofer, "Steering Pretrained Drafters during Speculative Decoding", AAAI 2026)
keeps the draft model and adds one linear map: after each verify pass, the target's hidden states
at the last accepted node (low, middle and high layers) become a *steering vector* that is added
to the draft model's residual stream after each of its layers while it drafts the next round. The
draft model stays frozen; only the map is trained, by distillation from the target on real text.

The engine does the wiring (:class:`~specdecode.engine.SpeculativeDecoder` asks the target for the
layers in :attr:`DraftSteering.target_layers` and hands the drafter the states at each row's last
accepted node); :class:`~specdecode.drafters.ModelDrafter` takes ``steering=``. Verification is
unchanged, so decoding stays lossless: steering moves acceptance, never the output distribution.

The round rule, shared by training and decoding: the round whose root (the last committed token)
sits at position ``a`` is steered by the vector of the target's states at position ``a - 1`` (the
node whose distribution gave the root), and every token the draft model feeds in that round, its
catch-up and its drafts, takes that vector; K/V kept from earlier rounds keep theirs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from ._distill import (
    check_hidden,
    check_layers,
    check_training,
    check_windows,
    divergence,
    rms,
    target_pass,
    train,
)

__all__ = [
    "DraftSteering",
    "SteeringFit",
    "default_target_layers",
    "fit_steering",
    "round_sources",
    "steering_divergence",
]

_FORMAT = "specdecode.DraftSteering/1"
_DEFAULT_RANK = 256


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """SD²'s low, middle and high states of an ``L``-layer target: the outputs of layers
    ``round(L / 3)`` and ``round(2 L / 3)`` and the final norm's output (index ``L``), deduplicated
    (indices as ``output_hidden`` takes them)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers: expected an int >= 1, got {num_layers!r}")
    picks = (max(1, round(num_layers / 3)), max(1, round(2 * num_layers / 3)), num_layers)
    return tuple(sorted(set(picks)))


class DraftSteering(nn.Module):
    """The steering map: target hidden states -> one vector per draft layer.

    Parameters
    ----------
    target_hidden_size : int
        The target's hidden size ``Ht``.
    target_layers : sequence of int
        The target's hidden-state indices to read (as ``output_hidden`` takes them: ``i`` = the
        output of layer ``i``, ``L`` = the final norm's output), ``S`` of them, distinct, ``>= 0``.
    draft_hidden_size : int
        The draft model's hidden size ``Hd``.
    draft_layers : int
        The draft model's layer count ``Ld``: one vector per layer.
    rank : int, optional
        Factorise ``W`` as ``U · D`` through ``rank`` dimensions (``D``: ``[rank, S·Ht]``, random;
        ``U``: ``[Ld·Hd, rank]``, zero). None (default) factorises at rank 256 only where that
        is smaller than both sides of ``W``: a full map is ``S·Ht x Ld·Hd`` (0.2M weights for
        the zoo pair, but 400M for a 32-layer 4096-wide target over a 16-layer 2048-wide draft,
        where rank 256 keeps 11.5M). ``rank = 0`` never factorises.

    Notes
    -----
    ``vectors = W · concat(rms(h_1), ..., rms(h_S)) + b`` reshaped to ``[Ld, Hd]``, with ``W``
    (or ``U``) and ``b`` zero at construction: an untrained map steers by exactly nothing, so a
    drafter with it drafts what it drafts without.
    """

    def __init__(
        self,
        target_hidden_size: int,
        target_layers: Sequence[int],
        draft_hidden_size: int,
        draft_layers: int,
        rank: Optional[int] = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("target_hidden_size", target_hidden_size),
            ("draft_hidden_size", draft_hidden_size),
            ("draft_layers", draft_layers),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        layers = check_layers(target_layers)
        self.target_layers = layers
        self.target_hidden_size = target_hidden_size
        self.draft_hidden_size = draft_hidden_size
        self.draft_layers = draft_layers
        features, outputs = len(layers) * target_hidden_size, draft_layers * draft_hidden_size
        if rank is None:
            rank = _DEFAULT_RANK if _DEFAULT_RANK < min(features, outputs) else 0
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank: expected an int >= 0 or None, got {rank!r}")
        self.rank = rank
        # down: the factorised map's first half (random, so that gradients reach proj at once).
        self.down: Optional[nn.Linear] = None
        if rank:
            self.down = nn.Linear(features, rank, bias=False)
            with torch.no_grad():  # a fixed draw: the same map for the same sizes
                generator = torch.Generator().manual_seed(0)
                self.down.weight.normal_(0.0, features**-0.5, generator=generator)
        self.proj = nn.Linear(rank or features, outputs)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.bias.zero_()

    @classmethod
    def for_models(
        cls,
        target: Any,
        draft: Any,
        target_layers: Optional[Sequence[int]] = None,
        rank: Optional[int] = None,
    ) -> DraftSteering:
        """An untrained map sized for ``target`` and ``draft`` (models with a ``config`` holding
        ``hidden_size`` and ``num_hidden_layers``, as :class:`~specdecode.models.Transformer`);
        ``target_layers`` defaults to :func:`default_target_layers`, ``rank`` as the
        constructor's."""
        tc, dc = _config(target, "target"), _config(draft, "draft")
        layers = default_target_layers(tc.num_hidden_layers) if target_layers is None else None
        if target_layers is not None:
            layers = tuple(target_layers)
            bad = [
                i for i in layers if not isinstance(i, int) or not 0 <= i <= tc.num_hidden_layers
            ]
            if bad:
                raise ValueError(
                    f"target_layers: {bad} outside the target's hidden states "
                    f"[0, {tc.num_hidden_layers}]"
                )
        return cls(tc.hidden_size, layers, dc.hidden_size, dc.num_hidden_layers, rank=rank)

    def forward(self, hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """Steering vectors from the target's states.

        Parameters
        ----------
        hidden : sequence of torch.Tensor
            One floating tensor ``[..., Ht]`` per index of :attr:`target_layers`, in that order,
            all of one shape.

        Returns
        -------
        torch.Tensor
            float32 ``[..., Ld, Hd]`` on the map's device.
        """
        check_hidden(hidden, self.target_layers, self.target_hidden_size)
        device = self.proj.weight.device
        feats = torch.cat([rms(h.to(device, torch.float32)) for h in hidden], dim=-1)
        out = self.proj(feats if self.down is None else self.down(feats))
        return out.view(*hidden[0].shape[:-1], self.draft_layers, self.draft_hidden_size)

    def save(self, path: Union[str, Path], dtype: torch.dtype = torch.float32) -> None:
        """Writes the map to one safetensors file (its sizes and layers in the metadata), its
        weights rounded to ``dtype`` (float32, float16 or bfloat16; :meth:`load` reads them back
        as float32)."""
        from .models.io import write_tensor_file

        meta = {
            "format": _FORMAT,
            "target_layers": ",".join(str(i) for i in self.target_layers),
            "target_hidden_size": str(self.target_hidden_size),
            "draft_hidden_size": str(self.draft_hidden_size),
            "draft_layers": str(self.draft_layers),
            "rank": str(self.rank),
        }
        tensors = {"weight": self.proj.weight, "bias": self.proj.bias}
        if self.down is not None:
            tensors["down"] = self.down.weight
        write_tensor_file(path, tensors, meta, dtype)

    @classmethod
    def load(cls, path: Union[str, Path]) -> DraftSteering:
        """Reads a map written by :meth:`save` (float32, on the CPU).

        Raises
        ------
        FileNotFoundError
            If ``path`` does not exist.
        ValueError
            If the file is not a saved map.
        """
        from .models.io import read_tensor_file

        meta, tensors = read_tensor_file(path, "steering")
        rank = int(meta.get("rank", "0")) if meta.get("rank", "0").isdigit() else -1
        names = {"weight", "bias"} | ({"down"} if rank > 0 else set())
        if meta.get("format") != _FORMAT or set(tensors) != names:
            raise ValueError(f"path: {path} does not hold a DraftSteering (format {_FORMAT})")
        try:
            steering = cls(
                int(meta["target_hidden_size"]),
                tuple(int(i) for i in meta["target_layers"].split(",")),
                int(meta["draft_hidden_size"]),
                int(meta["draft_layers"]),
                rank=rank,
            )
            with torch.no_grad():
                steering.proj.weight.copy_(tensors["weight"].float())
                steering.proj.bias.copy_(tensors["bias"].float())
                if steering.down is not None:
                    steering.down.weight.copy_(tensors["down"].float())
        except (KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"path: {path} holds an inconsistent DraftSteering ({e})") from e
        return steering


def _config(model: Any, name: str) -> Any:
    config = getattr(model, "config", None)
    if not (hasattr(config, "hidden_size") and hasattr(config, "num_hidden_layers")):
        raise TypeError(
            f"{name}: expected a model with config.hidden_size and config.num_hidden_layers "
            f"(specdecode.models.Transformer), got {type(model).__name__}"
        )
    return config


# ---- training ----------------------------------------------------------------------------------


def round_sources(length: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """A random split of one sequence into drafting rounds, as decoding would meet them.

    Position ``t`` of a ``length``-token sequence is fed in some round; returns, per position,
    the target position whose states steer that round (the round rule of the module docstring),
    and where the loss starts. The first round is a prompt of ``P`` tokens (``2 <= P <=
    length / 2``) fed with its root at ``P - 1`` and steered from ``P - 2``; each later round
    holds its root and the drafts accepted after it, ``1 .. k`` positions.

    Returns
    -------
    (torch.Tensor, int)
        int64 ``[length]`` source positions (the prompt's all ``P - 2``, as its catch-up takes
        one vector; a later position's the one before its round's root), and ``P - 1``, the
        first position whose prediction a draft uses (the first root's).
    """
    if length < 4:
        raise ValueError(f"length: expected at least 4 tokens, got {length}")
    prompt = int(torch.randint(2, length // 2 + 1, (1,), generator=generator))
    sources = torch.empty(length, dtype=torch.int64)
    sources[:prompt] = prompt - 2
    start = prompt
    while start < length:
        size = int(torch.randint(1, k + 1, (1,), generator=generator))
        sources[start : start + size] = start - 1
        start += size
    return sources, prompt - 1


def _steered_log_probs(
    draft: Any,
    steering: Optional[DraftSteering],
    windows: torch.Tensor,
    hidden: list[torch.Tensor],
    sources: torch.Tensor,
) -> torch.Tensor:
    """The draft model's log-probabilities ``[B, T, V]`` with each position steered from its
    round's source position (``sources`` int64 ``[B, T]``); unsteered when ``steering`` is None."""
    steer = None
    if steering is not None:
        index = sources.to(hidden[0].device).unsqueeze(-1).expand(-1, -1, hidden[0].shape[-1])
        picked = [h.gather(1, index) for h in hidden]
        steer = steering(picked).to(draft.device)
    logits = draft.forward_train(windows.to(draft.device), steer=steer)
    return torch.log_softmax(logits.float(), dim=-1)


def _split(windows: torch.Tensor, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources ``[B, T]`` and loss mask ``[B, T]`` of a batch, one random split per row."""
    g = torch.Generator().manual_seed(seed)
    sources, mask = [], []
    length = windows.shape[1]
    for _ in range(windows.shape[0]):
        src, first = round_sources(length, k, g)
        sources.append(src)
        mask.append(torch.arange(length) >= first)
    return torch.stack(sources), torch.stack(mask)


def _module(draft: Any) -> torch.nn.Module:
    """The torch module that holds a draft model's weights: the model itself
    (:class:`~specdecode.models.Transformer`) or the one a wrapper holds as ``model``
    (:class:`~specdecode.models.HFCausalLM`)."""
    if isinstance(draft, torch.nn.Module):
        return draft
    inner = getattr(draft, "model", None)
    if isinstance(inner, torch.nn.Module):
        return inner
    raise TypeError(f"draft: no torch module holds the weights of {type(draft).__name__}")


def _check_pair(target: Any, draft: Any, k: int) -> None:
    for name, model in (("target", target), ("draft", draft)):
        if not callable(getattr(model, "forward_train", None)) and name == "draft":
            raise TypeError(
                "draft: expected a model with forward_train(input_ids, steer=) "
                f"(specdecode.models.Transformer or HFCausalLM), got {type(model).__name__}"
            )
        if not callable(getattr(model, "new_cache", None)):
            raise TypeError(f"{name}: expected a CausalLM (specdecode.models)")
    if int(target.vocab_size) != int(draft.vocab_size):
        raise ValueError(
            f"draft: vocabulary of {draft.vocab_size} tokens, the target's has {target.vocab_size}"
        )
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise ValueError(f"k: expected an int in [1, 64], got {k!r}")


@dataclasses.dataclass(frozen=True)
class SteeringFit:
    """What :func:`fit_steering` returns.

    Attributes
    ----------
    steering : DraftSteering
        The trained map (float32, on the draft model's device).
    losses : list of float
        The training loss (mean KL(target || steered draft), nats) of each step.
    held_out : dict
        With ``held_out`` windows: ``{"kl_unsteered", "kl_steered", "agreement_unsteered",
        "agreement_steered"}`` over the positions a draft would use (see
        :func:`steering_divergence`); empty otherwise.
    """

    steering: DraftSteering
    losses: list[float]
    held_out: dict[str, float]


def fit_steering(
    target: Any,
    draft: Any,
    windows: torch.Tensor,
    *,
    k: int = 4,
    steps: int = 300,
    batch_size: int = 8,
    lr: float = 2e-3,
    target_layers: Optional[Sequence[int]] = None,
    rank: Optional[int] = None,
    held_out: Optional[torch.Tensor] = None,
    seed: int = 0,
    progress: bool = False,
) -> SteeringFit:
    """Trains a :class:`DraftSteering` for ``draft`` from ``target`` by distillation.

    Each step takes ``batch_size`` windows (cycling through ``windows`` in an order drawn from
    ``seed``), splits each into drafting rounds (:func:`round_sources`), steers every position of
    the frozen draft model from its round's source position in the target, and minimises the mean
    KL divergence from the target's next-token distribution to the steered draft's over the
    positions a draft would use. Only the map learns (Adam; ``lr`` warmed up linearly over the
    first tenth of the steps, then cosine-decayed).

    Parameters
    ----------
    target, draft : specdecode.models.Transformer
        The target and the draft model; one vocabulary. Neither is changed.
    windows : torch.Tensor
        int64 ``[N, T]`` token windows of real text, ``T >= 4``, ``T`` within both models' max
        length.
    k : int
        The draft depth the rounds are drawn for (``1 .. 64``).
    steps, batch_size : int
        Optimiser steps and windows per step.
    lr : float
        Peak learning rate.
    target_layers : sequence of int, optional
        The target's states to read (default :func:`default_target_layers`).
    rank : int, optional
        The map's factorisation (:class:`DraftSteering`; default: full where that is small).
    held_out : torch.Tensor, optional
        int64 ``[M, T']`` windows scored before and after training (:attr:`SteeringFit.held_out`).
    seed : int
        Seeds the window order and the round splits.
    progress : bool
        A progress bar over the steps.

    Returns
    -------
    SteeringFit
    """
    _check_pair(target, draft, k)
    windows = check_windows(windows, "windows", int(target.vocab_size))
    if held_out is not None:
        held_out = check_windows(held_out, "held_out", int(target.vocab_size))
    check_training(steps, batch_size, lr)
    steering = DraftSteering.for_models(target, draft, target_layers, rank).to(draft.device)
    report: dict[str, float] = {}
    if held_out is not None:
        kl, agree = steering_divergence(target, draft, None, held_out, k=k, seed=seed)
        report["kl_unsteered"], report["agreement_unsteered"] = kl, agree
    weights = _module(draft)
    was_training = weights.training
    frozen = [p.requires_grad for p in weights.parameters()]
    for p in weights.parameters():
        p.requires_grad_(False)

    def loss_of(batch: torch.Tensor, step: int) -> torch.Tensor:
        target_logp, hidden = target_pass(target, batch, steering.target_layers)
        sources, mask = _split(batch, k, seed * 1_000_003 + step)
        draft_logp = _steered_log_probs(draft, steering, batch, hidden, sources)
        return divergence(target_logp, draft_logp, mask)[0]

    try:
        weights.eval()
        losses = train(
            list(steering.parameters()),
            windows,
            loss_of,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            progress=progress,
        )
    finally:
        for p, flag in zip(weights.parameters(), frozen):
            p.requires_grad_(flag)
        weights.train(was_training)
    steering.eval()
    if held_out is not None:
        kl, agree = steering_divergence(target, draft, steering, held_out, k=k, seed=seed)
        report["kl_steered"], report["agreement_steered"] = kl, agree
    return SteeringFit(steering, losses, report)


@torch.no_grad()
def steering_divergence(
    target: Any,
    draft: Any,
    steering: Optional[DraftSteering],
    windows: torch.Tensor,
    *,
    k: int = 4,
    seed: int = 0,
    batch_size: int = 8,
) -> tuple[float, float]:
    """How far the (steered) draft model is from the target on ``windows``.

    Each window is split into rounds as in training (:func:`round_sources`, drawn from
    ``seed``: the same splits for every ``steering``, so two maps compare on equal terms); over
    the positions a draft would use, returns the mean KL(target || draft) in nats and the greedy
    agreement (the fraction of positions where both argmaxes match). ``steering=None``: the
    draft model alone.
    """
    _check_pair(target, draft, k)
    windows = check_windows(windows, "windows", int(target.vocab_size))
    layers = steering.target_layers if steering is not None else (int(target.num_hidden_layers),)
    kl_sum = agree_sum = count = 0.0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i : i + batch_size]
        target_logp, hidden = target_pass(target, batch, layers)
        sources, mask = _split(batch, k, seed * 7_919 + i)
        draft_logp = _steered_log_probs(draft, steering, batch, hidden, sources)
        kl, agree = divergence(target_logp, draft_logp, mask)
        n = float(mask.sum())
        kl_sum += float(kl) * n
        agree_sum += float(agree) * n
        count += n
    return kl_sum / count, agree_sum / count
