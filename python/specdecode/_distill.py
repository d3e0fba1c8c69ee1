"""Pieces shared by the modules that distil a small trained part from a frozen target on real text
(:mod:`specdecode.steering`'s map, :mod:`specdecode.specformer`'s head): reading the target over
whole windows, checking windows and layer lists, the divergence they minimise, and the optimiser
loop with its learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMS normalisation over the last dim: the target's layers differ in scale by
    orders of magnitude, and a part reading several of them should see each at unit scale."""
    return F.rms_norm(x, (x.shape[-1],), eps=1e-6)


def check_layers(target_layers: Any) -> tuple[int, ...]:
    """``target_layers`` as a tuple of distinct hidden-state indices ``>= 0`` (as
    ``output_hidden`` takes them), or a clear error."""
    if isinstance(target_layers, (str, bytes)) or not isinstance(
        target_layers, (list, tuple, range)
    ):
        raise TypeError(
            f"target_layers: expected a sequence of ints, got {type(target_layers).__name__}"
        )
    layers = tuple(target_layers)
    if (
        not layers
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
        or len(set(layers)) != len(layers)
    ):
        raise ValueError(
            f"target_layers: expected distinct hidden-state indices >= 0, got {layers!r}"
        )
    return layers


def check_hidden(hidden: Sequence[torch.Tensor], layers: Sequence[int], size: int) -> None:
    """Checks the target states a trained part reads: one floating ``[..., size]`` tensor per
    index of ``layers``, all of one shape."""
    if len(hidden) != len(layers):
        raise ValueError(
            f"hidden: expected {len(layers)} states (target_layers {tuple(layers)}), "
            f"got {len(hidden)}"
        )
    shape = hidden[0].shape
    for i, h in enumerate(hidden):
        if not isinstance(h, torch.Tensor) or not h.dtype.is_floating_point:
            raise TypeError(f"hidden[{i}]: expected a floating torch.Tensor")
        if h.shape != shape or h.shape[-1] != size:
            raise ValueError(
                f"hidden[{i}]: expected shape [..., {size}] like hidden[0] {list(shape)}, "
                f"got {list(h.shape)}"
            )


def check_windows(windows: Any, name: str, vocab: int, min_length: int = 4) -> torch.Tensor:
    """int64 ``[N, T]`` token windows, ``T >= min_length``, ids inside the vocabulary."""
    if not isinstance(windows, torch.Tensor) or windows.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected an int64 or int32 torch.Tensor [N, T]")
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < min_length:
        raise ValueError(
            f"{name}: expected shape [N >= 1, T >= {min_length}] (token windows), "
            f"got {list(windows.shape)}"
        )
    if int(windows.min()) < 0 or int(windows.max()) >= vocab:
        raise ValueError(f"{name}: token ids outside the vocabulary [0, {vocab})")
    return windows.long()


def check_training(steps: Any, batch_size: Any, lr: Any) -> None:
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr: expected a finite float > 0, got {lr!r}")


@torch.no_grad()
def target_pass(
    target: Any, windows: torch.Tensor, layers: Sequence[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The target's log-probabilities ``[B, T, V]`` and its states at ``layers`` over whole
    windows (a cache-less causal pass; float32)."""
    cache = target.new_cache(windows.shape[0], windows.shape[1])
    positions = torch.arange(windows.shape[1]).expand_as(windows)
    device = target.device
    logits, hidden = target.forward(
        windows.to(device), positions.to(device), cache, output_hidden=list(layers)
    )
    return torch.log_softmax(logits.float(), dim=-1), [h.float() for h in hidden]


def divergence(
    target_logp: torch.Tensor, draft_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean KL(target || draft) and greedy agreement over the rows selected by ``mask`` (log-probs
    ``[..., V]``, mask ``[...]``)."""
    draft_logp = draft_logp.to(target_logp.device)
    kl = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)
    agree = (target_logp.argmax(-1) == draft_logp.argmax(-1)).float()
    m = mask.to(kl.device).float()
    count = m.sum().clamp_min(1.0)
    return (kl * m).sum() / count, (agree * m).sum() / count


def learning_rate(peak: float, step: int, steps: int) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine decay to zero. The warm-up
    matters: Adam's first steps move every weight by about the learning rate whatever its
    gradient, and a part fed hundreds of unit-scale features would then throw its output far off
    before the moments are estimated."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(
    parameters: Sequence[torch.nn.Parameter],
    windows: torch.Tensor,
    loss_of: Callable[[torch.Tensor, int], torch.Tensor],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool,
) -> list[float]:
    """Adam over ``parameters`` for ``steps`` steps, each on ``batch_size`` windows (cycling
    through ``windows`` in an order drawn from ``seed``) with the loss ``loss_of(batch, step)``;
    ``lr`` on :func:`learning_rate`'s schedule. Returns each step's loss."""
    opt = torch.optim.Adam(parameters, lr=lr)
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed))
    losses: list[float] = []
    bar = None
    if progress:
        from .engine import _Progress

        bar = _Progress(steps, unit="step", units="steps")
    try:
        for step in range(steps):
            picks = [int(order[(step * batch_size + i) % len(order)]) for i in range(batch_size)]
            loss = loss_of(windows[picks], step)
            for group in opt.param_groups:
                group["lr"] = learning_rate(lr, step, steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return losses
