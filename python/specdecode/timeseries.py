"""Speculative decoding for time-series forecasters with Gaussian outputs.

Patch-based time-series foundation models (TimesFM, Timer, Moirai and their kind) forecast a
series one *patch* of ``P`` values at a time, each patch conditioned on the ones before it, so a
horizon of ``H`` patches costs ``H`` sequential passes of a large model. Speculative decoding
carries over from tokens to such models (Subbaraman et al., 2025, "Accelerating Time Series
Foundation Models with Speculative Decoding"): a small draft forecaster proposes ``k`` patches,
the target scores all of them in one pass, and a rejection test on the two models' densities keeps
the target's law. Every step, for every unfinished series:

1. **draft**: the draft forecaster draws ``k`` patches one after another, each from its Gaussian
   given the history and the drafts before it;
2. **target pass**: one call of the target over history + drafts gives ``k + 1`` Gaussians;
3. **verify** (:func:`verify_gaussian`): draft ``i`` is accepted with probability
   ``min(1, p_i(x_i) / q_i(x_i))``; the first rejected one is replaced by a *correction* patch
   drawn from the residual ``max(0, p - q)`` (normalised), and a *bonus* patch is drawn from
   ``p_k`` when every draft is accepted;
4. **commit**: the accepted drafts and the correction or bonus patch join the history.

With ``lenience = 1`` each committed patch has exactly the target's distribution given the
patches the target was shown (the lossless variant); ``lenience < 1`` accepts more drafts at the
cost of that exactness (the paper's practical variant). ``method="mean"`` forecasts the models'
means (point forecasts) and accepts a draft patch whose every value lies within ``tolerance``
target standard deviations of the target's mean; ``tolerance = 0`` gives exactly the target's own
mean rollout.

**The forecaster protocol.** A forecaster is a callable ``model(patches) -> (mean, std)``:
``patches`` is a float tensor ``[B, L, P]`` and ``mean``, ``std`` are ``[B, L, P]``, where entry
``t`` is the distribution of patch ``t + 1`` given patches ``0..t`` (causal: it must not depend on
later patches), a Gaussian with diagonal covariance. An optional attribute ``max_patches`` bounds
``L``. :class:`PatchForecaster` is a small causal Transformer that follows it, and
:func:`fit_forecaster` trains one with the Gaussian likelihood, e.g. on :func:`synthetic_series`.
Rows of a batch hold histories of different lengths right-aligned at position 0 and padded on the
right: a causal model's outputs at the valid positions do not see the padding.

**The incremental protocol** (optional, :class:`PatchForecaster` has it): ``model.new_cache(batch,
capacity)`` returns a cache of ``capacity`` window positions per row, and ``model.extend(cache,
patches, rows, positions, counts)`` feeds cache row ``rows[r]`` its new patches
``patches[r, :counts[r]]`` at window positions ``positions[r]`` on, returning the outputs at
those positions as ``model(window)`` would. :func:`forecast` then feeds each model only what its
cache lacks: the step's drafts and the patch committed before them, instead of the whole window
at every call.

Randomness comes from one ``torch.Generator`` (not the counter-based Philox streams of the token
kernels): a forecast is reproducible for a given generator state, batch and draft length.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .engine import _Progress
from .models._checks import check_positive_int

__all__ = [
    "ForecastOutput",
    "ForecastStats",
    "GaussianVerifyOutput",
    "PatchCache",
    "PatchForecaster",
    "distill_forecaster",
    "fit_forecaster",
    "forecast",
    "gaussian_kl",
    "gaussian_log_prob",
    "synthetic_series",
    "verify_gaussian",
    "verify_gaussian_mean",
]

_METHODS = ("sample", "mean")
# Residual candidates tried per pending row in the first round of the correction sampler; each
# later round doubles it, up to _RESIDUAL_ROUND_CAP.
_RESIDUAL_FIRST_ROUND = 16
_RESIDUAL_ROUND_CAP = 8192
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class GaussianVerifyOutput(NamedTuple):
    """What :func:`verify_gaussian` and :func:`verify_gaussian_mean` return.

    Attributes
    ----------
    num_accepted : torch.Tensor
        int64 ``[B]``: accepted draft patches per row, ``0 <= num_accepted <= K``.
    next_patch : torch.Tensor
        ``[B, P]``, the target's dtype: the correction patch at the first rejection, or the bonus
        patch after ``K`` accepted drafts.
    residual_fallbacks : int
        Rows whose correction could not be drawn from the residual within ``max_residual_draws``
        candidates and was drawn from the target's Gaussian instead (see :func:`verify_gaussian`);
        always 0 for :func:`verify_gaussian_mean`.
    """

    num_accepted: torch.Tensor
    next_patch: torch.Tensor
    residual_fallbacks: int


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of a patch under a Gaussian with diagonal covariance, in float64.

    Parameters
    ----------
    x, mean, std : torch.Tensor
        Float ``[..., P]`` (broadcastable to one shape); ``std > 0``.

    Returns
    -------
    torch.Tensor
        float64 ``[...]``: ``sum_j log N(x_j; mean_j, std_j^2)``.
    """
    x64, mean64, std64 = x.double(), mean.double(), std.double()
    z = (x64 - mean64) / std64
    return (-0.5 * z * z - torch.log(std64) - _LOG_SQRT_2PI).sum(-1)


def _check_float(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")


def _check_shape(name: str, t: torch.Tensor, shape: Sequence[int], layout: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {layout} = {list(shape)}, got {list(t.shape)}")


def _check_std(name: str, std: torch.Tensor) -> None:
    # One host sync per call: the tensors are [B, K, P], small next to a forecaster's pass.
    if std.numel() and not bool(torch.isfinite(std).all() and (std > 0).all()):
        raise ValueError(f"{name}: every standard deviation must be finite and > 0")


def _check_finite(name: str, t: torch.Tensor) -> None:
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: must be finite (found NaN or inf)")


def _check_verify_inputs(
    draft_mean: torch.Tensor, target_mean: torch.Tensor, others: dict[str, torch.Tensor]
) -> tuple[int, int, int]:
    """Common checks of the verify functions; returns (B, K, P)."""
    _check_float("draft_mean", draft_mean)
    _check_float("target_mean", target_mean)
    if draft_mean.dim() != 3:
        raise ValueError(f"draft_mean: expected [B, K, P], got shape {list(draft_mean.shape)}")
    batch, k, patch = draft_mean.shape
    _check_shape("target_mean", target_mean, (batch, k + 1, patch), "[B, K + 1, P]")
    for name, t in others.items():
        _check_float(name, t)
        is_target = name.startswith("target")
        shape = (batch, k + 1, patch) if is_target else (batch, k, patch)
        _check_shape(name, t, shape, "[B, K + 1, P]" if is_target else "[B, K, P]")
    device = draft_mean.device
    for name, t in [("target_mean", target_mean), *others.items()]:
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, but draft_mean is on {device}")
    _check_finite("draft_mean", draft_mean)
    _check_finite("target_mean", target_mean)
    for name, t in others.items():
        if name.endswith("std"):
            _check_std(name, t)
        else:
            _check_finite(name, t)
    return batch, k, patch


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the number of leading True entries of each row of a bool [B, K] tensor."""
    if accept.shape[1] == 0:
        return torch.zeros(accept.shape[0], dtype=torch.int64, device=accept.device)
    return accept.to(torch.int64).cumprod(1).sum(1)


def _draw_gaussian(
    mean: torch.Tensor, std: torch.Tensor, generator: Optional[torch.Generator]
) -> torch.Tensor:
    noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + std * noise


def _sample_residual(
    p_mean: torch.Tensor,
    p_std: torch.Tensor,
    q_mean: torch.Tensor,
    q_std: torch.Tensor,
    generator: Optional[torch.Generator],
    max_draws: int,
) -> tuple[torch.Tensor, int]:
    """Draws one patch per row from ``max(0, p - q)`` normalised; rows ``[R, P]``.

    Rejection sampling from ``p``: a candidate ``y ~ p`` is kept with probability
    ``1 - min(1, q(y) / p(y))``, and the first kept candidate of each row, in draw order, is its
    sample, which then has exactly the residual's law. A candidate is kept with probability
    ``TV(p, q)``, so a row needs ``1 / TV`` candidates on average; rows are drawn in rounds of
    doubling size. A row with no kept candidate after ``max_draws`` gets a draw from ``p``
    instead (counted): that happens with probability ``(1 - TV)^max_draws`` and only after a
    rejection, which itself has probability ``TV``, so it moves the law by at most
    ``max_t t (1 - t)^max_draws <= 1 / (e * max_draws)`` in total variation.
    """
    rows, patch = p_mean.shape
    out = torch.empty_like(p_mean)
    pending = torch.arange(rows, device=p_mean.device)
    drawn, round_size = 0, _RESIDUAL_FIRST_ROUND
    while pending.numel() and drawn < max_draws:
        size = min(round_size, max_draws - drawn)
        mean, std = p_mean[pending, None], p_std[pending, None]
        shape = (pending.numel(), size, patch)
        y = mean + std * torch.randn(
            shape, generator=generator, device=mean.device, dtype=mean.dtype
        )
        log_q_over_p = gaussian_log_prob(y, q_mean[pending, None], q_std[pending, None])
        log_q_over_p = log_q_over_p - gaussian_log_prob(y, mean, std)
        u = torch.rand(
            log_q_over_p.shape, generator=generator, device=y.device, dtype=torch.float64
        )
        kept = u < -torch.expm1(log_q_over_p.clamp(max=0.0))
        found = kept.any(1)
        first = kept.to(torch.int8).argmax(1)
        hit = found.nonzero().squeeze(1)
        out[pending[hit]] = y[hit, first[hit]]
        pending = pending[~found]
        drawn += size
        round_size = min(2 * round_size, _RESIDUAL_ROUND_CAP)
    fallbacks = int(pending.numel())
    if fallbacks:
        out[pending] = _draw_gaussian(p_mean[pending], p_std[pending], generator)
    return out, fallbacks


def verify_gaussian(
    draft: torch.Tensor,
    draft_mean: torch.Tensor,
    draft_std: torch.Tensor,
    target_mean: torch.Tensor,
    target_std: torch.Tensor,
    *,
    lenience: float = 1.0,
    generator: Optional[torch.Generator] = None,
    max_residual_draws: int = 1 << 20,
) -> GaussianVerifyOutput:
    """Verifies a batch of drafted Gaussian patch chains against the target (rejection sampling).

    Draft ``i`` of row ``b`` is accepted with probability ``min(1, p(x) / (lenience * q(x)))``,
    ``p = N(target_mean[b, i], target_std[b, i]^2)``, ``q = N(draft_mean[b, i],
    draft_std[b, i]^2)`` (diagonal); the row keeps its drafts up to the first rejection. At the
    first rejection the correction patch is drawn from ``max(0, p - q)`` normalised; after ``K``
    accepted drafts the bonus patch is drawn from ``p = N(target_mean[b, K], ...)``. With
    ``lenience = 1`` and drafts drawn from ``q`` the emitted patches are distributed exactly as
    ancestral sampling from the target (up to the fallback bound below). Densities are computed
    in float64; drafts held in fp16 or bf16 are rounded draws, whose law is no longer exactly
    ``q``, so keep the drafts in fp32 or fp64 where exactness matters.

    Parameters
    ----------
    draft : torch.Tensor
        Float ``[B, K, P]``: the drafted patches, ``draft[b, i] ~ q`` given the drafts before it.
    draft_mean, draft_std : torch.Tensor
        Float ``[B, K, P]``: the draft forecaster's Gaussians the drafts were drawn from.
    target_mean, target_std : torch.Tensor
        Float ``[B, K + 1, P]``: the target's Gaussians for the patch at each draft position and
        for the one after the last draft (the bonus).
    lenience : float
        In ``(0, 1]``; below 1 it accepts drafts the target finds up to ``1 / lenience`` times less
        likely than the draft does. The emitted law is then no longer the target's.
    generator : torch.Generator, optional
        Source of randomness, on the tensors' device.
    max_residual_draws : int
        Candidates per row the correction sampler may draw before falling back to a draw from
        ``p``; the fallback moves the emitted law by at most ``1 / (e * max_residual_draws)`` in
        total variation (about 3.5e-7 at the default) and is counted in ``residual_fallbacks``.

    Returns
    -------
    GaussianVerifyOutput
        ``num_accepted`` int64 ``[B]``, ``next_patch`` ``[B, P]`` (the target's dtype) and the
        count of residual fallbacks.
    """
    batch, k, patch = _check_verify_inputs(
        draft_mean,
        target_mean,
        {"draft": draft, "draft_std": draft_std, "target_std": target_std},
    )
    if not 0.0 < lenience <= 1.0:
        raise ValueError(f"lenience: expected a value in (0, 1], got {lenience}")
    max_residual_draws = check_positive_int("max_residual_draws", max_residual_draws)
    device = draft.device
    if k:
        log_ratio = gaussian_log_prob(draft, target_mean[:, :k], target_std[:, :k])
        log_ratio = log_ratio - gaussian_log_prob(draft, draft_mean, draft_std)
        u = torch.rand((batch, k), generator=generator, device=device, dtype=torch.float64)
        # u < min(1, ratio / lenience) in log space; u < 1 always, so a ratio >= lenience accepts.
        accept = torch.log(u) < (log_ratio - math.log(lenience)).clamp(max=0.0)
        num_accepted = _accepted_prefix(accept)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    rows = torch.arange(batch, device=device)
    p_mean, p_std = target_mean[rows, num_accepted], target_std[rows, num_accepted]
    next_patch = torch.empty_like(p_mean)
    bonus = (num_accepted == k).nonzero().squeeze(1)
    next_patch[bonus] = _draw_gaussian(p_mean[bonus], p_std[bonus], generator)
    rejected = (num_accepted < k).nonzero().squeeze(1)
    fallbacks = 0
    if rejected.numel():
        at = num_accepted[rejected]
        correction, fallbacks = _sample_residual(
            p_mean[rejected],
            p_std[rejected],
            draft_mean[rejected, at].to(p_mean.dtype),
            draft_std[rejected, at].to(p_mean.dtype),
            generator,
            int(max_residual_draws),
        )
        next_patch[rejected] = correction
    return GaussianVerifyOutput(num_accepted, next_patch, fallbacks)


def verify_gaussian_mean(
    draft_mean: torch.Tensor,
    target_mean: torch.Tensor,
    target_std: torch.Tensor,
    *,
    tolerance: float = 0.0,
) -> GaussianVerifyOutput:
    """Verifies drafted point forecasts (means) against the target's means.

    Draft ``i`` of row ``b`` is accepted when every value lies within ``tolerance`` target
    standard deviations of the target's mean, ``|draft_mean - target_mean| <= tolerance *
    target_std``; the row keeps its drafts up to the first one that does not. The next patch is
    the target's mean at the first rejection, or after the last draft. With ``tolerance = 0`` only
    drafts equal to the target's means are kept, so the emitted patches are exactly the target's
    own mean rollout.

    Parameters
    ----------
    draft_mean : torch.Tensor
        Float ``[B, K, P]``: the drafted patches (the draft forecaster's means).
    target_mean, target_std : torch.Tensor
        Float ``[B, K + 1, P]``: the target's Gaussians at each draft position and after the last.
    tolerance : float
        ``>= 0``, in target standard deviations.

    Returns
    -------
    GaussianVerifyOutput
        ``num_accepted`` int64 ``[B]``, ``next_patch`` ``[B, P]``, ``residual_fallbacks = 0``.
    """
    batch, k, _ = _check_verify_inputs(draft_mean, target_mean, {"target_std": target_std})
    if not (tolerance >= 0.0 and math.isfinite(tolerance)):
        raise ValueError(f"tolerance: expected a finite value >= 0, got {tolerance}")
    gap = (draft_mean.double() - target_mean[:, :k].double()).abs()
    accept = (gap <= tolerance * target_std[:, :k].double()).all(-1)
    num_accepted = _accepted_prefix(accept)
    rows = torch.arange(batch, device=draft_mean.device)
    return GaussianVerifyOutput(num_accepted, target_mean[rows, num_accepted].clone(), 0)


@dataclasses.dataclass
class ForecastStats:
    """What a :func:`forecast` call did.

    Attributes
    ----------
    steps : int
        Target calls (one per step).
    row_steps : int
        Sum over steps of the series still forecasting.
    patches : int
        Patches forecast over all series (the horizon times the batch once the call is done).
    draft_calls : int
        Draft forecaster calls.
    offered_by_position, accepted_counts_by_position : list of int
        Entry ``d - 1``: row-steps whose draft reached depth ``d``, resp. in which the draft patch
        at depth ``d`` was accepted.
    residual_fallbacks : int
        Corrections drawn from the target's Gaussian after ``max_residual_draws`` candidates.
    draft_lengths : list of int
        Patches drafted at each step (``k``).
    draft_time, verify_time, wall_time : float
        Seconds: the draft calls, the target calls plus verification, the whole call.
    """

    steps: int = 0
    row_steps: int = 0
    patches: int = 0
    draft_calls: int = 0
    offered_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_counts_by_position: list[int] = dataclasses.field(default_factory=list)
    residual_fallbacks: int = 0
    draft_lengths: list[int] = dataclasses.field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0

    @property
    def accepted_by_position(self) -> list[float]:
        """Entry ``d - 1``: the fraction of drafts at depth ``d`` that were accepted."""
        return [
            a / o if o else 0.0
            for a, o in zip(self.accepted_counts_by_position, self.offered_by_position)
        ]

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft patches / drafted patches (0.0 when nothing was drafted)."""
        offered = sum(self.offered_by_position)
        return sum(self.accepted_counts_by_position) / offered if offered else 0.0

    @property
    def patches_per_step(self) -> float:
        """Mean patches committed per series per target call (1.0 without a draft)."""
        return self.patches / self.row_steps if self.row_steps else 0.0


class ForecastOutput(NamedTuple):
    """What :func:`forecast` returns.

    Attributes
    ----------
    forecast : torch.Tensor
        ``[B, H, P]``, the context's dtype and device: the forecast patches.
    stats : ForecastStats
    """

    forecast: torch.Tensor
    stats: ForecastStats


def _model_name(model: Any) -> str:
    return type(model).__name__


def _max_patches(model: Any) -> Optional[int]:
    limit = getattr(model, "max_patches", None)
    return None if limit is None else int(limit)


def _check_outputs(
    model: Any, role: str, result: Any, shape: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks that a forecaster returned ``(mean, std)``, each of ``shape``."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = type(result).__name__
        raise ValueError(f"{role} forecaster {_model_name(model)}: expected (mean, std), got {got}")
    mean, std = result
    for name, t in (("mean", mean), ("std", std)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{role} forecaster {_model_name(model)}: {name} must have the input's shape "
                f"[B, L, P] = {list(shape)}, got {got}"
            )
    return mean, std


def _window(
    history: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor, max_context: Optional[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's last ``max_context`` patches before ``ends``, right-padded to one width.

    Returns the window ``[R, W, P]`` and the history index of each row's window position 0.
    Invariant: ``start + W <= history.shape[1]`` for every row (a row whose window starts later
    is at most ``max_context`` wide, one that starts at 0 at most ``max(ends)``), so the gather
    stays in bounds; what a row holds past its own end is padding its causal outputs do not see.
    """
    start = _window_start(ends, max_context)
    width = int((ends - start).max())
    index = start[:, None] + torch.arange(width, device=ends.device)
    return history[rows[:, None], index], start


def _window_start(ends: torch.Tensor, max_context: Optional[int]) -> torch.Tensor:
    """The history index of the first patch a model sees when it is shown the patches before
    ``ends``: the same for the full-window and the incremental calls, so that both condition
    each patch on the same history."""
    return torch.zeros_like(ends) if max_context is None else (ends - max_context).clamp(min=0)


def _span(at: torch.Tensor, count: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model must be shown to predict the patches at ``at + j`` (``j < count``) of rows
    that need none at or after ``stop``.

    Returns the end (exclusive) of the patches to show, ``min(at + count, stop) - 1``, and the
    ``[R, count]`` positions of the outputs that predict them (the output at ``t`` predicts patch
    ``t + 1``), the ones past the end repeating the last: entries for patches at or after
    ``stop`` are placeholders, whatever a verification makes of them is never committed (a row's
    horizon ends before ``stop``). Needs ``at >= 1`` and ``stop >= 2``. Stopping there keeps a
    window from sliding for drafts past a row's horizon, which would move the learned positions
    and, with a cache, cost a whole window's pass.
    """
    end = (at + count).clamp(max=stop) - 1
    wanted = at[:, None] - 1 + torch.arange(count, device=at.device)
    return end, torch.minimum(wanted, end[:, None] - 1)


def _pick(
    mean: torch.Tensor, std: torch.Tensor, index: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries ``index [R, count]`` of each row of two ``[R, W, P]``."""
    rows = torch.arange(index.shape[0], device=index.device)[:, None]
    return mean[rows, index].to(dtype), std[rows, index].to(dtype)


class _WindowCalls:
    """A forecaster shown each row's whole window at every call (the forecaster protocol)."""

    def __init__(self, model: Any, role: str, max_context: Optional[int]) -> None:
        self.model, self.role, self.max_context = model, role, max_context

    def predict(
        self, history: torch.Tensor, rows: torch.Tensor, at: torch.Tensor, count: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Gaussians of the patches at ``at .. at + count - 1``, each given the history
        before it (placeholders from ``stop`` on, see :func:`_span`): two ``[R, count, P]``."""
        end, positions = _span(at, count, stop)
        window, start = _window(history, rows, end, self.max_context)
        mean, std = _check_outputs(self.model, self.role, self.model(window), window.shape)
        return _pick(mean, std, positions - start[:, None], history.dtype)

    def forget(self, rows: torch.Tensor, changed: torch.Tensor) -> None:
        """Nothing is kept between calls."""


def _incremental(model: Any) -> bool:
    """Whether a forecaster offers the incremental protocol (``new_cache`` and ``extend``)."""
    return callable(getattr(model, "new_cache", None)) and callable(getattr(model, "extend", None))


class _CachedCalls:
    """A forecaster run incrementally: each call feeds only the patches its cache lacks.

    Invariant: for every row ``b``, the cache holds the model's state of history positions
    ``start[b] .. start[b] + cached[b] - 1`` at window positions ``0 .. cached[b] - 1``, and
    those history entries have not changed since they were fed (``forget`` drops what a commit
    overwrites). A row whose window start moves (its history outgrew ``max_context``) is fed
    its whole window again: learned positions count from the window's start.
    """

    def __init__(
        self,
        model: Any,
        role: str,
        max_context: Optional[int],
        batch: int,
        capacity: int,
        device: torch.device,
    ) -> None:
        self.model, self.role, self.max_context = model, role, max_context
        self.cache = model.new_cache(batch, capacity)
        self.cached = torch.zeros(batch, dtype=torch.int64, device=device)
        self.start = torch.zeros(batch, dtype=torch.int64, device=device)

    def predict(
        self, history: torch.Tensor, rows: torch.Tensor, at: torch.Tensor, count: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`_WindowCalls.predict`, feeding each row from its first uncached patch."""
        end, positions = _span(at, count, stop)
        start = _window_start(end, self.max_context)
        cached = torch.where(start != self.start[rows], 0, self.cached[rows])
        # The outputs are read from positions[:, 0] on: that patch must be fed.
        first = start + torch.minimum(cached, positions[:, 0] - start)
        counts = end - first
        width = int(counts.max())
        index = (first[:, None] + torch.arange(width, device=at.device)).clamp(
            max=history.shape[1] - 1
        )
        patches = history[rows[:, None], index]
        result = self.model.extend(self.cache, patches, rows, first - start, counts)
        mean, std = _check_outputs(self.model, self.role, result, patches.shape)
        self.start[rows] = start
        self.cached[rows] = end - start
        return _pick(mean, std, positions - first[:, None], history.dtype)

    def forget(self, rows: torch.Tensor, changed: torch.Tensor) -> None:
        """History positions ``changed[r]`` on of each row were overwritten: drop them."""
        self.cached[rows] = torch.minimum(
            self.cached[rows], (changed - self.start[rows]).clamp(min=0)
        )


def _draft_step(
    draft: Any,
    history: torch.Tensor,
    rows: torch.Tensor,
    at: torch.Tensor,
    stop: int,
    method: str,
    generator: Optional[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft patch per row at ``at``: (patch, mean, std), each ``[R, P]``; ``draft`` is a
    :class:`_WindowCalls` or :class:`_CachedCalls`; rows at or past ``stop`` get placeholders."""
    mean, std = draft.predict(history, rows, at, 1, stop)
    mean, std = mean[:, 0], std[:, 0]
    if method == "mean":
        return mean, mean, std
    return _draw_gaussian(mean, std, generator), mean, std


def _check_forecast_args(
    target: Any,
    draft: Any,
    context: Any,
    horizon: int,
    num_draft: int,
    method: str,
    lenience: float,
    tolerance: float,
    max_context: Optional[int],
) -> Optional[int]:
    """Validates :func:`forecast`'s arguments; returns the context window to use."""
    _check_float("context", context)
    if context.dim() != 3 or context.shape[1] < 1 or context.shape[2] < 1:
        raise ValueError(
            f"context: expected [B, L, P] with L >= 1 and P >= 1, got shape {list(context.shape)}"
        )
    _check_finite("context", context)
    check_positive_int("horizon", horizon)
    if method not in _METHODS:
        raise ValueError(f"method: expected one of {_METHODS}, got {method!r}")
    if draft is not None:
        check_positive_int("num_draft", num_draft)
    if method == "mean" and lenience != 1.0:
        raise ValueError("lenience applies to method='sample'; method='mean' uses tolerance")
    if method == "sample" and tolerance != 0.0:
        raise ValueError("tolerance applies to method='mean'; method='sample' uses lenience")
    limits = [
        (name, limit)
        for name, model in (("target", target), ("draft", draft))
        if model is not None and (limit := _max_patches(model)) is not None
    ]
    if max_context is None:
        return min((limit for _, limit in limits), default=None)
    check_positive_int("max_context", max_context)
    for name, limit in limits:
        if int(max_context) > limit:
            raise ValueError(
                f"max_context: {max_context} patches, but the {name} forecaster takes at most "
                f"{limit} (its max_patches)"
            )
    return int(max_context)


def _stack(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The drafts of a step as ``[R, k, P]`` (``k = 0``: an empty tensor shaped like ``like``)."""
    if parts:
        return torch.stack(parts, 1)
    return like.new_zeros((like.shape[0], 0, like.shape[2]))


def _record_acceptance(stats: ForecastStats, k: int, num_accepted: torch.Tensor) -> None:
    while len(stats.offered_by_position) < k:
        stats.offered_by_position.append(0)
        stats.accepted_counts_by_position.append(0)
    counts = torch.bincount(num_accepted, minlength=k + 1).tolist()
    reached = num_accepted.numel()
    for depth in range(k):
        stats.offered_by_position[depth] += num_accepted.numel()
        reached -= counts[depth]
        stats.accepted_counts_by_position[depth] += reached


def _expected_patches(alpha: float, k: int) -> float:
    """Patches a row commits in a step of ``k`` drafts when each draft is accepted with
    probability ``alpha`` independently: ``1 + alpha + ... + alpha^k``."""
    return float(sum(alpha**i for i in range(k + 1)))


def _best_draft_length(
    alpha: float, target_seconds: Union[float, Sequence[float]], draft_seconds: float, k_max: int
) -> int:
    """The ``k`` in ``0..k_max`` that commits the most patches per second: a step costs one
    target call and ``k`` draft calls (the i.i.d. acceptance model of Leviathan et al., 2023);
    ``k = 0`` is the target alone, one patch per call. ``target_seconds`` is one cost for every
    ``k`` or ``k_max + 1`` costs, entry ``k`` the target call (with its verification) after
    ``k`` drafts."""
    if isinstance(target_seconds, (int, float)):
        target_seconds = [float(target_seconds)] * (k_max + 1)
    rates = [
        _expected_patches(alpha, k) / (target_seconds[k] + k * draft_seconds)
        for k in range(k_max + 1)
    ]
    return max(range(len(rates)), key=rates.__getitem__)


def _cost_line(points: dict[int, list[float]], k_max: int) -> list[float]:
    """Mean seconds per call at each ``k`` in ``0..k_max``, from ``{k: [seconds, calls]}``: the
    least-squares line through the measured means (slope >= 0; flat with one ``k`` measured).
    """
    ks = sorted(points)
    means = [points[k][0] / points[k][1] for k in ks]
    if len(ks) == 1:
        return [means[0]] * (k_max + 1)
    k_mean, y_mean = sum(ks) / len(ks), sum(means) / len(means)
    spread = sum((k - k_mean) ** 2 for k in ks)
    slope = max(0.0, sum((k - k_mean) * (y - y_mean) for k, y in zip(ks, means)) / spread)
    floor = min(means) / 2  # a line fitted to noise must not make any call free
    return [max(floor, y_mean + slope * (k - k_mean)) for k in range(k_max + 1)]


class _DraftLength:
    """Chooses each step's draft length from what the steps before measured.

    The acceptance rate is estimated as accepted / tested drafts (a row of ``k`` drafts tests
    ``min(accepted + 1, k)``), with one success and one failure as a prior. The costs are the
    mean seconds per draft call and the target call's seconds (with its verification) as a line
    in ``k``, fitted to the mean at each ``k`` tried: a target on a key/value cache is fed the
    ``k`` drafts and one patch, so its call costs more with more drafts; one shown its whole
    window costs about the same. The first step, which also feeds both models the whole
    context (their caches' prefill), only stands in until later steps are measured. The first
    step drafts ``k_max``. While drafting pays and the target alone has not been measured, the
    next step goes without drafts (the line needs a second point; horizons are short, so once);
    where drafting does not pay (``k = 0`` is best), one step in ``explore_every`` still
    drafts one patch so that the acceptance estimate can recover. Choosing ``k`` from past steps
    keeps a lossless forecast lossless: each step's output law holds given everything before
    it, whatever ``k`` that step used.
    """

    explore_every = 8

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.accepted, self.tested = 1, 2
        self.target_costs: dict[int, list[float]] = {}  # k -> [seconds, calls], after the first
        self.draft_seconds, self.draft_calls = 0.0, 0
        self.first: Optional[tuple[int, float, float]] = None  # k, draft and target seconds
        self.steps_without_draft = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tested

    def choose(self) -> int:
        if self.first is None:
            return self.k_max
        if self.target_costs:
            target = _cost_line(self.target_costs, self.k_max)
        else:
            target = [self.first[2]] * (self.k_max + 1)
        if self.draft_calls:
            draft = self.draft_seconds / self.draft_calls
        else:
            draft = self.first[1] / max(self.first[0], 1)
        k = _best_draft_length(self.acceptance, target, draft, self.k_max)
        if k == 0 and self.steps_without_draft + 1 >= self.explore_every:
            return 1
        if k > 0 and self.target_costs and 0 not in self.target_costs:
            return 0  # the target alone, measured once: the cost line's second point
        return k

    def observe(
        self, k: int, num_accepted: torch.Tensor, draft_seconds: float, target_seconds: float
    ) -> None:
        if k:
            self.accepted += int(num_accepted.sum())
            self.tested += int(torch.clamp(num_accepted + 1, max=k).sum())
            self.steps_without_draft = 0
        else:
            self.steps_without_draft += 1
        if self.first is None:
            self.first = (k, draft_seconds, target_seconds)
            return
        if k:
            self.draft_seconds += draft_seconds
            self.draft_calls += k
        cost = self.target_costs.setdefault(k, [0.0, 0])
        cost[0] += target_seconds
        cost[1] += 1


def forecast(
    target: Any,
    context: torch.Tensor,
    horizon: int,
    *,
    draft: Any = None,
    num_draft: int = 4,
    adaptive: bool = False,
    method: str = "sample",
    lenience: float = 1.0,
    tolerance: float = 0.0,
    max_context: Optional[int] = None,
    num_samples: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    max_residual_draws: int = 1 << 20,
    use_cache: bool = True,
    progress: bool = False,
) -> ForecastOutput:
    """Forecasts ``horizon`` patches per series, speculatively when a draft forecaster is given.

    Parameters
    ----------
    target : forecaster
        The model whose forecast law is kept (see the module docstring for the protocol); put it
        in eval mode first.
    context : torch.Tensor
        Float ``[B, L, P]``: each series' last ``L`` patches of ``P`` values (scaled as the
        forecasters expect).
    horizon : int
        Patches to forecast per series.
    draft : forecaster, optional
        The draft forecaster; None forecasts with the target alone, one call per patch (the
        baseline).
    num_draft : int
        Patches drafted per step (``k``); fewer near the horizon, and at most
        ``max_context - 1``. With ``adaptive``, the most drafted per step.
    adaptive : bool
        Choose each step's ``k`` in ``0..num_draft`` that commits the most patches per second,
        by the i.i.d. acceptance model (``1 + a + ... + a^k`` patches for one target call and
        ``k`` draft calls) with the acceptance rate ``a`` and the call costs measured in this
        call so far (the target's as a line in ``k``: on a cache it is fed the drafts); where no
        drafting pays, one step in 8 still drafts one patch, and while drafting pays, one step
        measures the target alone. Keeps the law of a lossless forecast.
    method : {"sample", "mean"}
        ``"sample"``: sample paths, verified by :func:`verify_gaussian`. ``"mean"``: point
        forecasts (each model's mean), verified by :func:`verify_gaussian_mean`.
    lenience : float
        ``method="sample"`` only, in ``(0, 1]``; 1 keeps the target's law exactly.
    tolerance : float
        ``method="mean"`` only, ``>= 0`` target standard deviations; 0 gives exactly the target's
        mean rollout.
    max_context : int, optional
        The most patches a model call sees (each row's latest ones). Default: the smaller
        ``max_patches`` of the two forecasters, or unbounded. Once a history is longer, one
        target call covers the history's last ``max_context - k`` patches plus the ``k`` drafts,
        so a verified patch is conditioned on ``max_context - k`` to ``max_context`` patches; its
        law is the target's given exactly those. Drafts past a series' horizon (a step drafts
        ``k`` for the series furthest from its end) are not shown to the target: they would
        never be committed.
    num_samples : int, optional
        ``method="sample"`` only: draw ``S = num_samples`` independent paths per series (for
        quantiles and intervals), all in one batch of ``B * S`` rows; the forecast is then
        ``[B, S, horizon, P]``.
    generator : torch.Generator, optional
        Source of randomness (draws, acceptance tests), on the context's device.
    max_residual_draws : int
        As in :func:`verify_gaussian`.
    use_cache : bool
        Run each forecaster that offers the incremental protocol (``new_cache`` and ``extend``,
        as :class:`PatchForecaster` does) on its key/value cache: a call feeds only the patches
        the cache lacks (the correction or bonus patch and the drafts) instead of the whole
        window. The law and the conditioning are those of the full-window calls; the numbers
        agree up to float rounding. False shows every call the whole window (the forecaster
        protocol). The caches hold ``B x window`` positions per forecaster (``B * S`` rows with
        ``num_samples``).
    progress : bool
        Show a progress bar of forecast patches (tqdm if installed, else a line on stderr).

    Returns
    -------
    ForecastOutput
        ``forecast`` ``[B, horizon, P]`` (``[B, S, horizon, P]`` with ``num_samples``; the
        context's dtype and device) and :class:`ForecastStats` (its counts over all rows).
    """
    window = _check_forecast_args(
        target, draft, context, horizon, num_draft, method, lenience, tolerance, max_context
    )
    if num_samples is not None:
        if method != "sample":
            raise ValueError("num_samples applies to method='sample'; a mean forecast is one path")
        check_positive_int("num_samples", num_samples)
        paths = forecast(
            target,
            context.repeat_interleave(int(num_samples), 0),
            horizon,
            draft=draft,
            num_draft=num_draft,
            adaptive=adaptive,
            lenience=lenience,
            max_context=max_context,
            generator=generator,
            max_residual_draws=max_residual_draws,
            use_cache=use_cache,
            progress=progress,
        )
        shape = (context.shape[0], int(num_samples), *paths.forecast.shape[1:])
        return ForecastOutput(paths.forecast.view(shape), paths.stats)
    started = time.perf_counter()
    batch, known, patch = context.shape
    horizon, k_max = int(horizon), (int(num_draft) if draft is not None else 0)
    # Room for the context, the horizon and the drafts of a last step that overshoots it.
    history = context.new_zeros((batch, known + horizon + k_max + 1, patch))
    history[:, :known] = context
    lengths = torch.full((batch,), known, dtype=torch.int64, device=context.device)
    goal = known + horizon
    stats = ForecastStats()
    policy = _DraftLength(k_max) if adaptive and k_max else None
    capacity = history.shape[1] if window is None else min(window, history.shape[1])

    def calls(model: Any, role: str) -> Any:
        if use_cache and _incremental(model):
            return _CachedCalls(model, role, window, batch, capacity, context.device)
        return _WindowCalls(model, role, window)

    target_calls = calls(target, "target")
    draft_calls = calls(draft, "draft") if draft is not None else None
    bar = _Progress(batch * horizon, unit="patch", units="patches") if progress else None
    try:
        with torch.no_grad():
            while True:
                rows = (lengths < goal).nonzero().squeeze(1)
                if not rows.numel():
                    break
                ends = lengths[rows]
                remaining = goal - ends
                # Drafting past the last patch of the longest remaining horizon buys nothing,
                # and a target window must hold the k drafts and the patch before them.
                wanted = policy.choose() if policy is not None else k_max
                k = min(wanted, int(remaining.max()) - 1, k_max if window is None else window - 1)
                tick = time.perf_counter()
                drafts, draft_means, draft_stds = [], [], []
                for depth in range(k):
                    x, mean, std = _draft_step(
                        draft_calls, history, rows, ends + depth, goal, method, generator
                    )
                    history[rows, ends + depth] = x
                    drafts.append(x)
                    draft_means.append(mean)
                    draft_stds.append(std)
                stats.draft_calls += k
                tock = time.perf_counter()
                stats.draft_time += tock - tick
                # The target's Gaussians of the patches at ends .. ends + k (those past a
                # row's horizon are placeholders: never committed).
                target_mean, target_std = target_calls.predict(history, rows, ends, k + 1, goal)
                if method == "mean":
                    out = verify_gaussian_mean(
                        _stack(draft_means, target_mean),
                        target_mean,
                        target_std,
                        tolerance=tolerance,
                    )
                else:
                    out = verify_gaussian(
                        _stack(drafts, target_mean),
                        _stack(draft_means, target_mean),
                        _stack(draft_stds, target_mean),
                        target_mean,
                        target_std,
                        lenience=lenience,
                        generator=generator,
                        max_residual_draws=max_residual_draws,
                    )
                verified = time.perf_counter()
                stats.verify_time += verified - tock
                if policy is not None:
                    policy.observe(k, out.num_accepted, tock - tick, verified - tock)
                stats.draft_lengths.append(k)
                history[rows, ends + out.num_accepted] = out.next_patch
                for model_calls in (target_calls, draft_calls):
                    if model_calls is not None:
                        model_calls.forget(rows, ends + out.num_accepted)
                lengths[rows] = ends + out.num_accepted + 1
                committed = int(torch.minimum(out.num_accepted + 1, remaining).sum())
                stats.steps += 1
                stats.row_steps += rows.numel()
                stats.patches += committed
                stats.residual_fallbacks += out.residual_fallbacks
                _record_acceptance(stats, k, out.num_accepted)
                if bar is not None:
                    bar.update(committed)
    finally:
        if bar is not None:
            bar.close()
    stats.wall_time = time.perf_counter() - started
    return ForecastOutput(history[:, known:goal].clone(), stats)


class PatchForecaster(nn.Module):
    """A small causal Transformer over patches with a Gaussian head (the forecaster protocol).

    Each patch is embedded by a linear map plus a learned position (the index in the window),
    a stack of pre-norm Transformer layers with a causal mask mixes them, and a linear head gives
    the next patch's mean (as an offset from the current patch's last value) and standard
    deviation (``softplus + min_std``).

    Parameters
    ----------
    patch_len : int
        ``P``, values per patch.
    dim, num_layers, num_heads : int
        Width, depth and heads of the Transformer (``dim`` a multiple of ``num_heads``).
    max_patches : int
        The longest window (``L``) the model takes.
    min_std : float
        Floor of the predicted standard deviations.
    """

    def __init__(
        self,
        patch_len: int,
        *,
        dim: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        max_patches: int = 64,
        min_std: float = 1e-3,
    ) -> None:
        super().__init__()
        for name, value in (
            ("patch_len", patch_len),
            ("dim", dim),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("max_patches", max_patches),
        ):
            check_positive_int(name, value)
        if dim % num_heads:
            raise ValueError(f"dim: {dim} is not a multiple of num_heads = {num_heads}")
        if not min_std > 0.0:
            raise ValueError(f"min_std: expected > 0, got {min_std}")
        self.patch_len, self.max_patches, self.min_std = int(patch_len), int(max_patches), min_std
        self.embed = nn.Linear(patch_len, dim)
        self.position = nn.Embedding(max_patches, dim)
        layer = nn.TransformerEncoderLayer(
            dim,
            num_heads,
            4 * dim,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.layers = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 2 * patch_len)

    def forward(self, patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gaussians of the next patch after each position.

        Parameters
        ----------
        patches : torch.Tensor
            Float ``[B, L, P]``, ``1 <= L <= max_patches``.

        Returns
        -------
        mean, std : torch.Tensor
            ``[B, L, P]`` each: entry ``t`` is the distribution of patch ``t + 1``.
        """
        if patches.dim() != 3 or patches.shape[2] != self.patch_len:
            raise ValueError(
                f"patches: expected [B, L, {self.patch_len}], got shape {list(patches.shape)}"
            )
        length = patches.shape[1]
        if not 1 <= length <= self.max_patches:
            raise ValueError(f"patches: L = {length}, expected 1 <= L <= {self.max_patches}")
        h = self.embed(patches) + self.position.weight[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=patches.device)
        h = self.layers(h, mask=mask.to(h.dtype), is_causal=True)
        return self._gaussians(patches, h)

    def _gaussians(
        self, patches: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head: the next patch's mean (an offset from the last value) and std."""
        offset, raw_std = self.head(self.norm(h)).split(self.patch_len, -1)
        return patches[..., -1:] + offset, F.softplus(raw_std) + self.min_std

    def new_cache(self, batch: int, capacity: int) -> PatchCache:
        """An empty key/value cache for :meth:`extend`.

        Parameters
        ----------
        batch : int
            Rows (series) the cache holds.
        capacity : int
            Window positions per row, at most ``max_patches``.

        Returns
        -------
        PatchCache
            Keys and values ``[batch, capacity + 1, num_heads, dim / num_heads]`` per layer (the
            last position takes the padding's writes), in the model's dtype and on its
            device.
        """
        check_positive_int("batch", batch)
        check_positive_int("capacity", capacity)
        if capacity > self.max_patches:
            raise ValueError(
                f"capacity: {capacity}, but the model takes {self.max_patches} patches"
            )
        weight = self.embed.weight
        heads = self._attention(0).num_heads
        shape = (int(batch), int(capacity) + 1, heads, self.dim // heads)
        layers = range(len(self.layers.layers))
        return PatchCache(
            [weight.new_zeros(shape) for _ in layers], [weight.new_zeros(shape) for _ in layers]
        )

    def extend(
        self,
        cache: PatchCache,
        patches: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        counts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feeds new patches of some rows to the cache; the Gaussians after each of them.

        The incremental form of :meth:`forward`: row ``rows[r]`` of the cache holds the keys and
        values of its window positions ``0 .. positions[r] - 1``; its first ``counts[r]``
        patches go to positions ``positions[r]`` on and attend to those and to each other
        causally. What the cache holds at or after a row's ``positions[r] + counts[r]`` is never
        read for its outputs, so a row is cut back by passing a smaller position.

        Parameters
        ----------
        cache : PatchCache
            From :meth:`new_cache`; updated in place.
        patches : torch.Tensor
            Float ``[R, n, P]``: row ``r``'s first ``counts[r]`` entries are its new patches, the
            rest padding.
        rows, positions, counts : torch.Tensor
            int64 ``[R]``: the cache row (distinct), the window position of the first new patch
            and the number of new patches (``1 <= counts <= n``,
            ``positions + counts <= capacity``) of each row.

        Returns
        -------
        mean, std : torch.Tensor
            ``[R, n, P]``: entry ``i < counts[r]`` is the distribution of the patch after new
            patch ``i`` (given the row's window up to it, as :meth:`forward` would give it);
            entries past ``counts[r]`` are meaningless.
        """
        num_rows, width, span, in_order = self._check_extend(
            cache, patches, rows, positions, counts
        )
        device = patches.device
        offsets = torch.arange(width, device=device)
        where = positions[:, None] + offsets  # [R, n] window positions of the new patches
        # Padding takes some position's embedding (its outputs are never read) and writes its
        # keys and values to the scratch slot past the capacity, which no row ever attends to.
        h = self.embed(patches) + self.position.weight[where.clamp(max=self.max_patches - 1)]
        scratch = cache.keys[0].shape[1] - 1
        slots = torch.where(offsets < counts[:, None], where, scratch)
        visible = torch.arange(span, device=device) <= where[..., None]  # causal, [R, n, span]
        for index, (keys, values) in enumerate(zip(cache.keys, cache.values)):
            layer, attention = self.layers.layers[index], self._attention(index)
            heads = attention.num_heads
            qkv = F.linear(layer.norm1(h), attention.in_proj_weight, attention.in_proj_bias)
            q, k, v = qkv.view(num_rows, width, 3, heads, -1).unbind(2)
            keys[rows[:, None], slots] = k
            values[rows[:, None], slots] = v
            # All rows in order (the common case) attend to views; others to gathered copies.
            held_keys = keys[:, :span] if in_order else keys[rows, :span]
            held_values = values[:, :span] if in_order else values[rows, :span]
            mixed = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                held_keys.transpose(1, 2),
                held_values.transpose(1, 2),
                attn_mask=visible[:, None],
            )
            h = h + attention.out_proj(mixed.transpose(1, 2).reshape(num_rows, width, -1))
            h = h + layer.linear2(layer.activation(layer.linear1(layer.norm2(h))))
        return self._gaussians(patches, h)

    @property
    def dim(self) -> int:
        return int(self.embed.out_features)

    def _attention(self, index: int) -> nn.MultiheadAttention:
        return self.layers.layers[index].self_attn

    def _check_extend(
        self,
        cache: Any,
        patches: torch.Tensor,
        rows: Any,
        positions: Any,
        counts: Any,
    ) -> tuple[int, int, int, bool]:
        """Checks :meth:`extend`'s arguments with one read of their values; returns ``R``,
        ``n``, the positions the rows' attention spans and whether ``rows`` is every row of the
        cache in order."""
        if not isinstance(cache, PatchCache) or len(cache.keys) != len(self.layers.layers):
            raise ValueError("cache: expected a PatchCache from this model's new_cache")
        if patches.dim() != 3 or patches.shape[2] != self.patch_len or 0 in patches.shape[:2]:
            raise ValueError(
                f"patches: expected [R, n, {self.patch_len}] with R, n >= 1, "
                f"got shape {list(patches.shape)}"
            )
        num_rows, width = int(patches.shape[0]), int(patches.shape[1])
        batch, capacity = int(cache.keys[0].shape[0]), int(cache.keys[0].shape[1]) - 1
        for name, t in (("rows", rows), ("positions", positions), ("counts", counts)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.shape != (num_rows,):
                raise ValueError(f"{name}: expected an int64 tensor [R] = [{num_rows}]")
            if t.device != patches.device:
                raise ValueError(f"{name}: on {t.device}, patches on {patches.device}")
        ends = positions + counts
        summary = torch.stack(
            [
                (
                    ((rows >= 0) & (rows < batch)).all()
                    & (positions >= 0).all()
                    & ((counts >= 1) & (counts <= width)).all()
                    & (ends <= capacity).all()
                ).long(),
                ends.max(),
                (rows == torch.arange(num_rows, device=rows.device)).all().long(),
            ]
        ).tolist()
        if not summary[0]:
            raise ValueError(
                f"rows, positions, counts: need 0 <= rows < {batch}, positions >= 0, "
                f"1 <= counts <= {width} and positions + counts <= {capacity} (the capacity)"
            )
        return num_rows, width, int(summary[1]), num_rows == batch and bool(summary[2])


class PatchCache(NamedTuple):
    """The key/value cache of a :class:`PatchForecaster` (:meth:`PatchForecaster.new_cache`).

    Attributes
    ----------
    keys, values : list of torch.Tensor
        One ``[B, capacity, num_heads, head_dim]`` per layer: row ``b``'s keys and values at
        each window position.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def synthetic_series(
    num_series: int,
    length: int,
    *,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Random seasonal series for training and benchmarking forecasters offline.

    Each series is a level, a linear trend, two seasonal sines (periods 8-40 and 40-160 steps,
    random amplitudes and phases) and AR(1) noise (coefficient 0.3-0.9, innovation scale
    0.05-0.25), all drawn per series.

    Parameters
    ----------
    num_series, length : int
        ``N`` series of ``T`` values (both ``>= 1``).
    generator : torch.Generator, optional
        A CPU generator; the series are a function of its state.
    dtype : torch.dtype
        Floating dtype of the result.

    Returns
    -------
    torch.Tensor
        ``[N, T]``, on the CPU.
    """
    check_positive_int("num_series", num_series)
    check_positive_int("length", length)
    n, t = int(num_series), int(length)

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand((n, 1), generator=generator, dtype=torch.float64)

    steps = torch.arange(t, dtype=torch.float64)[None]
    series = 0.5 * torch.randn((n, 1), generator=generator, dtype=torch.float64)
    series = series + uniform(-1.0, 1.0) * steps / t
    for (low, high), (a_low, a_high) in (((8.0, 40.0), (0.5, 1.5)), ((40.0, 160.0), (0.2, 0.8))):
        period, phase = uniform(low, high), uniform(0.0, 2.0 * math.pi)
        series = series + uniform(a_low, a_high) * torch.sin(2.0 * math.pi * steps / period + phase)
    phi, scale = uniform(0.3, 0.9), uniform(0.05, 0.25)
    innovations = scale * torch.randn((n, t), generator=generator, dtype=torch.float64)
    noise = torch.empty((n, t), dtype=torch.float64)
    level = torch.zeros((n, 1), dtype=torch.float64)
    for i in range(t):
        level = phi * level + innovations[:, i : i + 1]
        noise[:, i : i + 1] = level
    return (series + noise).to(dtype)


def _check_training_args(model: Any, series: Any, steps: int, batch_size: int) -> tuple[int, int]:
    """Validates a training call; returns (patch_len, window patches including the label)."""
    _check_float("series", series)
    patch = int(getattr(model, "patch_len", 0))
    limit = int(getattr(model, "max_patches", 0))
    if patch < 1 or limit < 1:
        raise ValueError("model: expected patch_len and max_patches attributes >= 1")
    if series.dim() != 2 or series.shape[1] < 2 * patch:
        raise ValueError(
            f"series: expected [N, T] with T >= 2 * patch_len = {2 * patch}, "
            f"got shape {list(series.shape)}"
        )
    check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    _check_finite("series", series)
    return patch, min(limit + 1, series.shape[1] // patch)


def _random_windows(
    data: torch.Tensor, batch: int, span: int, patch: int, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """``batch`` windows of ``span`` patches from random series at random offsets."""
    which = torch.randint(0, data.shape[0], (batch,), generator=generator)
    offset = torch.randint(0, data.shape[1] - span * patch + 1, (batch,), generator=generator)
    index = offset[:, None] + torch.arange(span * patch)
    windows = data[which.to(data.device)[:, None], index.to(data.device)]
    return windows.view(batch, span, patch)


def _train(
    model: nn.Module,
    loss_of: Any,
    series: torch.Tensor,
    steps: int,
    batch_size: int,
    lr: float,
    generator: Optional[torch.Generator],
    progress: bool,
) -> list[float]:
    """The optimisation loop both trainers share: Adam with cosine decay on random windows."""
    patch, span = _check_training_args(model, series, steps, batch_size)
    parameter = next(model.parameters())
    data = series.to(device=parameter.device, dtype=parameter.dtype)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, int(steps))
    losses: list[float] = []
    bar = _Progress(int(steps), unit="step", units="steps") if progress else None
    model.train()
    try:
        for _ in range(int(steps)):
            loss = loss_of(_random_windows(data, int(batch_size), span, patch, generator))
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
    finally:
        model.eval()
        if bar is not None:
            bar.close()
    return losses


def fit_forecaster(
    model: nn.Module,
    series: torch.Tensor,
    *,
    steps: int = 500,
    batch_size: int = 32,
    lr: float = 3e-3,
    generator: Optional[torch.Generator] = None,
    progress: bool = False,
) -> list[float]:
    """Trains a forecaster by the Gaussian likelihood of each next patch, on random windows.

    Each step draws ``batch_size`` windows of ``max_patches + 1`` patches (fewer when the series
    are shorter) from random series at random offsets and minimises the mean negative
    log-likelihood of patches ``1..L`` under the model's outputs at ``0..L-1`` (Adam, cosine
    decay of the learning rate). The model is left in eval mode.

    Parameters
    ----------
    model : nn.Module
        A forecaster with ``patch_len`` and ``max_patches`` attributes (e.g.
        :class:`PatchForecaster`).
    series : torch.Tensor
        Float ``[N, T]``, ``T >= 2 * patch_len``.
    steps, batch_size : int
        Optimiser steps and windows per step (``>= 1``).
    lr : float
        Peak learning rate.
    generator : torch.Generator, optional
        A CPU generator for the windows drawn.
    progress : bool
        Show a progress bar of steps.

    Returns
    -------
    list of float
        The training loss (mean NLL per value, constant terms included) at each step.
    """

    def nll(windows: torch.Tensor) -> torch.Tensor:
        mean, std = model(windows[:, :-1])
        return F.gaussian_nll_loss(mean, windows[:, 1:], std * std, full=True)

    return _train(model, nll, series, steps, batch_size, lr, generator, progress)


def gaussian_kl(
    p_mean: torch.Tensor, p_std: torch.Tensor, q_mean: torch.Tensor, q_std: torch.Tensor
) -> torch.Tensor:
    """KL(p || q) of diagonal Gaussians, per value.

    Parameters
    ----------
    p_mean, p_std, q_mean, q_std : torch.Tensor
        Float, broadcastable to one shape ``[...]``; the standard deviations ``> 0``.

    Returns
    -------
    torch.Tensor
        ``[...]``: ``log(q_std / p_std) + (p_std^2 + (p_mean - q_mean)^2) / (2 q_std^2) - 1/2``.
    """
    ratio = p_std / q_std
    return -torch.log(ratio) + 0.5 * (ratio * ratio + ((p_mean - q_mean) / q_std) ** 2) - 0.5


def distill_forecaster(
    draft: nn.Module,
    target: Any,
    series: torch.Tensor,
    *,
    steps: int = 500,
    batch_size: int = 32,
    lr: float = 3e-3,
    generator: Optional[torch.Generator] = None,
    progress: bool = False,
) -> list[float]:
    """Trains a draft forecaster to match the target's Gaussians (distillation).

    The acceptance of a drafted patch is ``1 - TV(p, q)`` on average, so a draft trained on the
    target's predictions rather than on the data accepts more. Each step draws windows as
    :func:`fit_forecaster` does, runs the target on them without gradients and minimises the
    mean ``KL(p || q)`` per value (:func:`gaussian_kl`) between the target's Gaussians ``p`` and
    the draft's ``q`` at every position. The draft is left in eval mode.

    Parameters
    ----------
    draft : nn.Module
        The forecaster to train, with ``patch_len`` and ``max_patches`` attributes.
    target : forecaster
        The teacher (in eval mode); it must take the draft's windows.
    series : torch.Tensor
        Float ``[N, T]``, ``T >= 2 * patch_len``.
    steps, batch_size, lr, generator, progress
        As in :func:`fit_forecaster`.

    Returns
    -------
    list of float
        The mean KL per value at each step.
    """

    def kl(windows: torch.Tensor) -> torch.Tensor:
        # The last patch of a window is a label for fit_forecaster; here only inputs are needed.
        inputs = windows[:, :-1]
        with torch.no_grad():
            p_mean, p_std = target(inputs)
        q_mean, q_std = draft(inputs)
        return gaussian_kl(p_mean, p_std, q_mean, q_std).mean()

    return _train(draft, kl, series, steps, batch_size, lr, generator, progress)
