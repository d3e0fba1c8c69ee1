"""Tests of specdecode.timeseries: Gaussian verification, the forecast loop, the reference model."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats as sps

from specdecode import timeseries as ts

# Significance level of each distribution test: the tests are deterministic (fixed generators),
# so this is the chance that a correct implementation would have been unlucky with the seed.
ALPHA = 1e-3


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class ARForecaster(torch.nn.Module):
    """Every value follows its own AR(1) across patches: ``x[t+1, j] = phi x[t, j] + sigma eps``.

    The forecast law is known in closed form, and a window's length does not change it.
    """

    def __init__(
        self, phi: float, sigma: float, max_patches: int | None = None, delay: float = 0.0
    ) -> None:
        super().__init__()
        self.phi, self.sigma, self.delay = phi, sigma, delay
        if max_patches is not None:
            self.max_patches = max_patches
        self.window_lengths: list[int] = []

    def forward(self, patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.window_lengths.append(patches.shape[1])
        if self.delay:
            time.sleep(self.delay)  # a target that costs far more than its draft
        return self.phi * patches, torch.full_like(patches, self.sigma)


def _normal_cdf(mean: float, std: float):
    return lambda x: sps.norm.cdf(x, loc=mean, scale=std)


def _residual_cdf(p: tuple[float, float], q: tuple[float, float]):
    """CDF of max(0, p - q) normalised, for 1-D Gaussians p, q given as (mean, std)."""
    grid = np.linspace(-15.0, 15.0, 300001)
    density = np.maximum(sps.norm.pdf(grid, *p) - sps.norm.pdf(grid, *q), 0.0)
    cdf = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2 * np.diff(grid))])
    return lambda x: np.interp(x, grid, cdf / cdf[-1]), cdf[-1]


def _chain_inputs(batch, k, patch, p, q, generator, draft_from=None):
    """Drafts drawn from q = (mean, std) and the target Gaussians p = (mean, std) for K + 1."""
    q_mean = torch.full((batch, k, patch), q[0], dtype=torch.float64)
    q_std = torch.full((batch, k, patch), q[1], dtype=torch.float64)
    t_mean = torch.full((batch, k + 1, patch), p[0], dtype=torch.float64)
    t_std = torch.full((batch, k + 1, patch), p[1], dtype=torch.float64)
    draft = q_mean + q_std * torch.randn(q_mean.shape, generator=generator, dtype=torch.float64)
    return draft, q_mean, q_std, t_mean, t_std


# ---- verify_gaussian ---------------------------------------------------------------------------


def test_first_emitted_patch_has_the_target_law_and_the_acceptance_rate_is_one_minus_tv():
    g = _gen(1)
    p, q, batch = (0.0, 1.0), (1.0, 1.5), 40000
    draft, q_mean, q_std, t_mean, t_std = _chain_inputs(batch, 1, 1, p, q, g)
    out = ts.verify_gaussian(draft, q_mean, q_std, t_mean, t_std, generator=g)
    first = torch.where(out.num_accepted[:, None] >= 1, draft[:, 0], out.next_patch)[:, 0]
    assert sps.kstest(first.numpy(), _normal_cdf(*p)).pvalue > ALPHA
    _, tv = _residual_cdf(p, q)
    rate = float((out.num_accepted == 1).double().mean())
    assert abs(rate - (1.0 - tv)) < 4.0 * math.sqrt(tv * (1.0 - tv) / batch)
    assert out.residual_fallbacks == 0


def test_correction_patches_follow_the_residual():
    g = _gen(2)
    p, q = (0.5, 0.8), (-0.5, 1.2)
    draft, q_mean, q_std, t_mean, t_std = _chain_inputs(30000, 1, 1, p, q, g)
    out = ts.verify_gaussian(draft, q_mean, q_std, t_mean, t_std, generator=g)
    corrections = out.next_patch[out.num_accepted == 0, 0].numpy()
    assert corrections.size > 5000
    cdf, _ = _residual_cdf(p, q)
    assert sps.kstest(corrections, cdf).pvalue > ALPHA
    # The target's own law is not the residual's: the test tells them apart.
    assert sps.kstest(corrections, _normal_cdf(*p)).pvalue < 1e-6


def test_every_value_of_a_multivariate_patch_keeps_its_law():
    g = _gen(3)
    batch, k = 30000, 3
    means = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    stds = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    t_mean = means.expand(batch, k + 1, 3).clone()
    t_std = stds.expand(batch, k + 1, 3).clone()
    q_mean, q_std = t_mean[:, :k] + 0.4, t_std[:, :k] * 1.3
    draft = q_mean + q_std * torch.randn(q_mean.shape, generator=g, dtype=torch.float64)
    out = ts.verify_gaussian(draft, q_mean, q_std, t_mean, t_std, generator=g)
    assert 0 < int((out.num_accepted == k).sum()) < batch
    first = torch.where(out.num_accepted[:, None] >= 1, draft[:, 0], out.next_patch)
    for j in range(3):
        cdf = _normal_cdf(float(means[j]), float(stds[j]))
        assert sps.kstest(first[:, j].numpy(), cdf).pvalue > ALPHA


def test_lenience_accepts_more_and_leaves_the_target_law():
    g = _gen(4)
    p, q = (0.0, 1.0), (1.0, 1.5)
    inputs = _chain_inputs(40000, 1, 1, p, q, g)
    exact = ts.verify_gaussian(*inputs, generator=_gen(5))
    lenient = ts.verify_gaussian(*inputs, lenience=0.5, generator=_gen(5))
    assert int(lenient.num_accepted.sum()) > int(exact.num_accepted.sum()) * 1.1
    draft = inputs[0]
    first = torch.where(lenient.num_accepted[:, None] >= 1, draft[:, 0], lenient.next_patch)
    assert sps.kstest(first[:, 0].numpy(), _normal_cdf(*p)).pvalue < 1e-6


def test_equal_draft_and_target_accept_every_draft_and_draw_the_bonus_from_the_last_gaussian():
    g = _gen(6)
    batch, k = 20000, 2
    q_mean = torch.zeros((batch, k, 1), dtype=torch.float64)
    q_std = torch.ones_like(q_mean)
    t_mean = torch.cat([q_mean, torch.full((batch, 1, 1), 3.0, dtype=torch.float64)], 1)
    t_std = torch.cat([q_std, torch.full((batch, 1, 1), 0.5, dtype=torch.float64)], 1)
    draft = torch.randn(q_mean.shape, generator=g, dtype=torch.float64)
    out = ts.verify_gaussian(draft, q_mean, q_std, t_mean, t_std, generator=g)
    assert bool((out.num_accepted == k).all())
    assert sps.kstest(out.next_patch[:, 0].numpy(), _normal_cdf(3.0, 0.5)).pvalue > ALPHA


def test_no_drafts_draw_from_the_target():
    g = _gen(7)
    empty = torch.zeros((5000, 0, 2))
    t_mean, t_std = torch.full((5000, 1, 2), -2.0), torch.full((5000, 1, 2), 0.25)
    out = ts.verify_gaussian(empty, empty, empty, t_mean, t_std, generator=g)
    assert out.num_accepted.tolist() == [0] * 5000
    assert out.next_patch.dtype == torch.float32 and out.next_patch.shape == (5000, 2)
    assert sps.kstest(out.next_patch[:, 1].numpy(), _normal_cdf(-2.0, 0.25)).pvalue > ALPHA


def test_residual_fallbacks_are_counted_only_when_the_draw_budget_runs_out():
    p, q = (0.0, 1.0), (0.3, 1.0)
    inputs = _chain_inputs(20000, 1, 1, p, q, _gen(8))
    tight = ts.verify_gaussian(*inputs, generator=_gen(9), max_residual_draws=1)
    rejected = int((tight.num_accepted == 0).sum())
    assert 0 < tight.residual_fallbacks <= rejected
    assert ts.verify_gaussian(*inputs, generator=_gen(9)).residual_fallbacks == 0


def test_verify_gaussian_is_reproducible_with_a_generator():
    inputs = _chain_inputs(100, 4, 3, (0.0, 1.0), (0.5, 1.0), _gen(10))
    a = ts.verify_gaussian(*inputs, generator=_gen(11))
    b = ts.verify_gaussian(*inputs, generator=_gen(11))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_patch, b.next_patch)


def _bad_verify_inputs():
    good = _chain_inputs(2, 3, 4, (0.0, 1.0), (0.0, 1.0), _gen(0))
    draft, q_mean, q_std, t_mean, t_std = good

    def swap(i, value):
        args = list(good)
        args[i] = value
        return args

    zero_std = q_std.clone()
    zero_std[1, 2, 3] = 0.0
    nan_mean = t_mean.clone()
    nan_mean[0, 0, 0] = math.nan
    return [
        (swap(0, draft[:, :2]), {}, ValueError, "draft"),
        (swap(3, t_mean[:, :3]), {}, ValueError, r"target_mean.*\[B, K \+ 1, P\]"),
        (swap(4, t_std[..., :2]), {}, ValueError, "target_std"),
        (swap(2, zero_std), {}, ValueError, "draft_std.*> 0"),
        (swap(3, nan_mean), {}, ValueError, "target_mean.*finite"),
        (swap(0, draft.to(torch.int64)), {}, TypeError, "draft.*floating"),
        (swap(1, q_mean[0]), {}, ValueError, r"draft_mean.*\[B, K, P\]"),
        (swap(4, t_std.numpy()), {}, TypeError, "target_std.*torch.Tensor"),
        (good, {"lenience": 0.0}, ValueError, "lenience"),
        (good, {"lenience": 1.5}, ValueError, "lenience"),
        (good, {"max_residual_draws": 0}, ValueError, "max_residual_draws"),
    ]


@pytest.mark.parametrize("args, kwargs, error, match", _bad_verify_inputs())
def test_verify_gaussian_rejects_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        ts.verify_gaussian(*args, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verify_gaussian_rejects_mixed_devices():
    draft, q_mean, q_std, t_mean, t_std = _chain_inputs(2, 1, 1, (0.0, 1.0), (0.0, 1.0), _gen(0))
    with pytest.raises(ValueError, match="target_mean: on cuda"):
        ts.verify_gaussian(draft, q_mean, q_std, t_mean.cuda(), t_std)


# ---- verify_gaussian_mean ----------------------------------------------------------------------


def test_mean_verification_keeps_drafts_within_the_tolerance_up_to_the_first_miss():
    target_mean = torch.arange(4.0).repeat(3, 1)[..., None].repeat(1, 1, 2)  # [3, 4, 2]
    target_std = torch.full_like(target_mean, 2.0)
    # Gaps in target standard deviations, per row and draft (both values of a patch alike,
    # except row 2's second draft, whose second value alone misses).
    z = torch.tensor([[0.1, 0.2, 0.25], [0.1, 0.4, 0.0], [0.0, 0.2, 0.2]])[..., None].repeat(
        1, 1, 2
    )
    z[2, 1, 1] = 0.3
    draft_mean = target_mean[:, :3] + z * 2.0
    out = ts.verify_gaussian_mean(draft_mean, target_mean, target_std, tolerance=0.25)
    assert out.num_accepted.tolist() == [3, 1, 1]
    assert torch.equal(out.next_patch, target_mean[[0, 1, 2], [3, 1, 1]])
    exact = ts.verify_gaussian_mean(draft_mean, target_mean, target_std)
    assert exact.num_accepted.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="tolerance"):
        ts.verify_gaussian_mean(draft_mean, target_mean, target_std, tolerance=-0.1)


# ---- forecast ----------------------------------------------------------------------------------


def _ar_context(batch: int, patch: int = 2, length: int = 3) -> torch.Tensor:
    context = torch.zeros((batch, length, patch), dtype=torch.float64)
    context[:, -1] = torch.linspace(-1.0, 1.5, patch, dtype=torch.float64)
    return context


def _assert_ar_law(context, paths, phi, sigma):
    """The forecast paths are the AR(1) chain: every innovation N(0, 1), uncorrelated with the
    value it follows."""
    previous = torch.cat([context[:, -1:], paths[:, :-1]], 1)
    innovations = (paths - phi * previous) / sigma
    n = innovations.shape[0]
    for h in range(paths.shape[1]):
        for j in range(paths.shape[2]):
            e = innovations[:, h, j].numpy()
            assert sps.kstest(e, "norm").pvalue > ALPHA, (h, j)
            if h:
                corr = np.corrcoef(e, previous[:, h, j].numpy())[0, 1]
                assert abs(corr) < 4.0 / math.sqrt(n), (h, j, corr)


def test_speculative_forecast_has_the_target_law():
    target, draft = ARForecaster(0.9, 0.5), ARForecaster(0.5, 0.9)
    context = _ar_context(6000)
    out = ts.forecast(target, context, 8, draft=draft, num_draft=3, generator=_gen(12))
    assert out.forecast.shape == (6000, 8, 2) and out.forecast.dtype == torch.float64
    _assert_ar_law(context, out.forecast, 0.9, 0.5)
    stats = out.stats
    assert stats.patches == 6000 * 8 and stats.residual_fallbacks == 0
    assert 0.2 < stats.acceptance_rate < 0.95
    assert 1.2 < stats.patches_per_step <= 4.0
    assert stats.row_steps < 6000 * 8 and stats.draft_calls <= 3 * stats.steps


def test_lenient_forecast_leaves_the_target_law():
    target, draft = ARForecaster(0.9, 0.5), ARForecaster(0.5, 0.9)
    context = _ar_context(6000)
    exact = ts.forecast(target, context, 8, draft=draft, num_draft=3, generator=_gen(13))
    lenient = ts.forecast(
        target, context, 8, draft=draft, num_draft=3, lenience=0.3, generator=_gen(13)
    )
    assert lenient.stats.acceptance_rate > exact.stats.acceptance_rate + 0.1
    with pytest.raises(AssertionError):
        _assert_ar_law(context, lenient.forecast, 0.9, 0.5)


def test_target_alone_forecasts_one_patch_per_call_with_the_target_law():
    target = ARForecaster(0.9, 0.5)
    context = _ar_context(6000)
    out = ts.forecast(target, context, 6, generator=_gen(14))
    _assert_ar_law(context, out.forecast, 0.9, 0.5)
    assert out.stats.steps == 6 and out.stats.draft_calls == 0
    assert out.stats.patches_per_step == 1.0 and out.stats.acceptance_rate == 0.0


def test_forecast_is_reproducible_with_a_generator():
    target, draft = ARForecaster(0.9, 0.5), ARForecaster(0.7, 0.6)
    context = _ar_context(50)
    a = ts.forecast(target, context, 9, draft=draft, generator=_gen(15)).forecast
    b = ts.forecast(target, context, 9, draft=draft, generator=_gen(15)).forecast
    assert torch.equal(a, b)


def _tiny_forecaster(seed: int, patch: int = 3, max_patches: int = 32) -> ts.PatchForecaster:
    torch.manual_seed(seed)
    model = ts.PatchForecaster(patch, dim=16, num_layers=2, num_heads=2, max_patches=max_patches)
    return model.eval()


def _mean_rollout(model, context: torch.Tensor, horizon: int) -> torch.Tensor:
    """The target's own point forecast: one call per patch on the whole history."""
    history = context
    with torch.no_grad():
        for _ in range(horizon):
            mean, _ = model(history)
            history = torch.cat([history, mean[:, -1:]], 1)
    return history[:, context.shape[1] :]


def test_mean_forecast_with_tolerance_zero_is_the_target_rollout():
    target, draft = _tiny_forecaster(0), _tiny_forecaster(1)
    context = torch.randn((5, 4, 3), generator=_gen(16))
    expected = _mean_rollout(target, context, 11)
    out = ts.forecast(target, context, 11, draft=draft, num_draft=3, method="mean")
    torch.testing.assert_close(out.forecast, expected, rtol=1e-5, atol=1e-5)
    assert out.stats.acceptance_rate == 0.0 and out.stats.steps == 11


def test_self_drafted_mean_forecast_accepts_every_draft_in_the_target_positions():
    target = _tiny_forecaster(0)
    context = torch.randn((4, 5, 3), generator=_gen(17))
    expected = _mean_rollout(target, context, 10)
    # A draft with the target's weights; tolerance 1e-3 absorbs the last bits that a longer
    # window's matmuls may change.
    out = ts.forecast(target, context, 10, draft=target, num_draft=3, method="mean", tolerance=1e-3)
    torch.testing.assert_close(out.forecast, expected, rtol=1e-5, atol=1e-5)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.steps == 3  # 4 + 4 + 2 patches
    assert out.stats.offered_by_position == [12, 8, 8]


def test_mean_forecast_keeps_every_patch_within_the_tolerance_of_the_target_mean():
    target, draft = ARForecaster(0.9, 0.5), ARForecaster(0.85, 0.5)
    context = torch.randn((64, 2, 2), generator=_gen(18), dtype=torch.float64) * 3.0
    out = ts.forecast(target, context, 12, draft=draft, num_draft=4, method="mean", tolerance=0.2)
    assert out.stats.acceptance_rate > 0.1
    history = torch.cat([context, out.forecast], 1)
    mean, std = target(history)
    gap = (history[:, 2:] - mean[:, 1:-1]).abs()
    assert bool((gap <= 0.2 * std[:, 1:-1] + 1e-12).all())
    exact = ts.forecast(target, context, 12, draft=draft, method="mean")
    assert not torch.equal(exact.forecast, out.forecast)


def test_self_drafted_sample_forecast_accepts_every_draft():
    target = ARForecaster(0.8, 0.3)
    out = ts.forecast(target, _ar_context(20), 7, draft=target, num_draft=4, generator=_gen(19))
    assert out.stats.acceptance_rate == 1.0 and out.stats.steps == 2
    assert out.stats.patches == 20 * 7


def test_forecast_windows_stay_within_max_context():
    target, draft = ARForecaster(0.9, 0.5, max_patches=8), ARForecaster(0.8, 0.5, max_patches=10)
    context = torch.randn((6, 6, 2), generator=_gen(20), dtype=torch.float64)
    out = ts.forecast(target, context, 20, draft=draft, num_draft=3, method="mean", tolerance=0.5)
    assert max(target.window_lengths + draft.window_lengths) == 8
    # An AR(1) forecaster reads only the last patch, so windowing cannot change its forecast.
    unbounded = ts.forecast(
        ARForecaster(0.9, 0.5),
        context,
        20,
        draft=ARForecaster(0.8, 0.5),
        method="mean",
        num_draft=3,
        tolerance=0.5,
    )
    torch.testing.assert_close(out.forecast, unbounded.forecast, rtol=0, atol=0)
    target.window_lengths.clear()
    ts.forecast(target, context, 5, max_context=4, generator=_gen(0))
    assert max(target.window_lengths) == 4
    # A window of 3 holds at most 2 drafts after the patch they follow.
    target.window_lengths.clear()
    short = ts.forecast(target, context, 9, draft=draft, num_draft=4, max_context=3)
    assert max(target.window_lengths) == 3
    assert short.stats.draft_calls <= 2 * short.stats.steps
    assert len(short.stats.offered_by_position) == 2
    assert short.forecast.shape == (6, 9, 2)
    with pytest.raises(ValueError, match="max_context.*target forecaster takes at most 8"):
        ts.forecast(target, context, 5, max_context=9)


def test_a_transformer_forecast_with_a_window_keeps_the_rollout_while_histories_fit():
    target, draft = _tiny_forecaster(2, max_patches=12), _tiny_forecaster(3, max_patches=12)
    context = torch.randn((3, 4, 3), generator=_gen(21))
    # 4 + 8 patches fit the window, so every call sees the whole history.
    out = ts.forecast(target, context, 8, draft=draft, num_draft=2, method="mean")
    torch.testing.assert_close(
        out.forecast, _mean_rollout(target, context, 8), rtol=1e-5, atol=1e-5
    )


def test_forecast_stops_every_series_at_the_horizon():
    target = ARForecaster(0.8, 0.3)
    out = ts.forecast(target, _ar_context(3), 5, draft=target, num_draft=4, method="mean")
    assert out.forecast.shape == (3, 5, 2)
    assert out.stats.steps == 1 and out.stats.patches == 15
    expected = _ar_context(3)[:, -1:] * 0.8 ** torch.arange(1, 6, dtype=torch.float64)[:, None]
    torch.testing.assert_close(out.forecast, expected)


def test_forecast_counts_residual_fallbacks():
    target, draft = ARForecaster(0.9, 0.5), ARForecaster(0.85, 0.5)
    out = ts.forecast(
        target, _ar_context(2000), 4, draft=draft, generator=_gen(22), max_residual_draws=1
    )
    assert out.stats.residual_fallbacks > 0


class _WrongShape(torch.nn.Module):
    def forward(self, patches):
        return patches[:, :-1], patches[:, :-1].abs() + 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"context": torch.zeros((2, 3))}, ValueError, r"context.*\[B, L, P\]"),
        ({"context": torch.zeros((2, 0, 2))}, ValueError, "context"),
        ({"context": torch.zeros((2, 3, 2), dtype=torch.int32)}, TypeError, "context"),
        ({"horizon": 0}, ValueError, "horizon"),
        ({"horizon": 2.5}, TypeError, "horizon: expected an int"),
        ({"method": "greedy"}, ValueError, "method"),
        ({"tolerance": 0.5}, ValueError, "tolerance applies to method='mean'"),
        ({"method": "mean", "lenience": 0.5}, ValueError, "lenience applies"),
        ({"draft": ARForecaster(0.5, 1.0), "num_draft": 0}, ValueError, "num_draft"),
        ({"max_context": 0}, ValueError, "max_context"),
        ({"target": _WrongShape()}, ValueError, "target forecaster _WrongShape: mean"),
        ({"draft": _WrongShape()}, ValueError, "draft forecaster _WrongShape: mean"),
        ({"target": lambda x: x}, ValueError, r"expected \(mean, std\)"),
    ],
)
def test_forecast_rejects_bad_input(kwargs, error, match):
    args = {"target": ARForecaster(0.9, 1.0), "context": torch.zeros((2, 3, 2)), "horizon": 4}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ts.forecast(args.pop("target"), args.pop("context"), args.pop("horizon"), **args)


def test_forecast_progress_bar_counts_patches(capsys):
    ts.forecast(ARForecaster(0.9, 0.5), _ar_context(2), 3, progress=True, generator=_gen(0))
    assert "patch" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forecast_runs_on_cuda():
    target, draft = _tiny_forecaster(0).cuda(), _tiny_forecaster(1).cuda()
    context = torch.randn((4, 5, 3), generator=_gen(23)).cuda()
    out = ts.forecast(target, context, 6, draft=draft, generator=torch.Generator("cuda"))
    assert out.forecast.device.type == "cuda" and bool(torch.isfinite(out.forecast).all())
    mean = ts.forecast(target, context, 6, draft=draft, method="mean").forecast
    torch.testing.assert_close(mean, _mean_rollout(target, context, 6), rtol=1e-4, atol=1e-4)


# ---- PatchForecaster, fit_forecaster, synthetic_series -----------------------------------------


def test_patch_forecaster_is_causal_and_shaped():
    model = _tiny_forecaster(4, patch=4, max_patches=10)
    x = torch.randn((2, 7, 4), generator=_gen(24))
    mean, std = model(x)
    assert mean.shape == std.shape == (2, 7, 4) and bool((std >= model.min_std).all())
    changed = x.clone()
    changed[:, 4:] += 5.0
    mean2, std2 = model(changed)
    torch.testing.assert_close(mean2[:, :4], mean[:, :4])
    torch.testing.assert_close(std2[:, :4], std[:, :4])
    assert not torch.allclose(mean2[:, 4:], mean[:, 4:])
    # Without gradients torch takes its fused encoder path, which must keep the mask too.
    with torch.no_grad():
        fused, _ = model(x)
        fused2, _ = model(changed)
    torch.testing.assert_close(fused, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused2[:, :4], fused[:, :4])
    with pytest.raises(ValueError, match="L = 11"):
        model(torch.zeros((1, 11, 4)))
    with pytest.raises(ValueError, match=r"\[B, L, 4\]"):
        model(torch.zeros((1, 3, 5)))
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ts.PatchForecaster(4, dim=10, num_heads=4)


def _feed_in_chunks(model, cache, x, rows, generator, start=None):
    """Feeds ``x`` [R, L, P] to cache rows ``rows`` in random ragged chunks through ``extend``
    (from window position ``start``, default 0); the outputs at every fed position."""
    num_rows, length, _ = x.shape
    position = torch.zeros(num_rows, dtype=torch.int64) if start is None else start.clone()
    mean, std = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    with torch.no_grad():
        while bool((position < length).any()):
            live = (position < length).nonzero().squeeze(1)
            counts = torch.randint(1, 5, (live.numel(),), generator=generator)
            counts = counts.minimum(length - position[live])
            index = (position[live][:, None] + torch.arange(int(counts.max()))).clamp(
                max=length - 1
            )
            m, s = model.extend(cache, x[live[:, None], index], rows[live], position[live], counts)
            for j, r in enumerate(live.tolist()):
                at, c = int(position[r]), int(counts[j])
                mean[r, at : at + c], std[r, at : at + c] = m[j, :c], s[j, :c]
            position[live] += counts
    return mean, std


def test_extend_matches_forward_in_ragged_chunks_and_after_a_cut_back():
    model = _tiny_forecaster(5, patch=3, max_patches=12)
    x = torch.randn((4, 12, 3), generator=_gen(40))
    with torch.no_grad():
        want_mean, want_std = model(x)
    cache = model.new_cache(6, 12)
    assert len(cache.keys) == 2 and cache.keys[0].shape == (6, 12 + 1, 2, 8)  # + scratch slot
    rows = torch.tensor([5, 0, 2, 3])  # cache rows in another order than the batch
    mean, std = _feed_in_chunks(model, cache, x, rows, _gen(41))
    torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std, want_std, rtol=1e-5, atol=1e-5)
    # Every row of a cache in order: the attention reads the cache in place.
    mean, std = _feed_in_chunks(model, model.new_cache(4, 12), x, torch.arange(4), _gen(41))
    torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-5)
    # Cut each row back to its own position and feed other patches from there: the outputs are
    # those of the changed series, whatever the cache held past the cut.
    cut = torch.tensor([0, 3, 7, 11])
    changed = x.clone()
    for r, at in enumerate(cut.tolist()):
        changed[r, at:] = torch.randn((12 - at, 3), generator=_gen(42 + r))
    with torch.no_grad():
        want_mean, _ = model(changed)
    mean, _ = _feed_in_chunks(model, cache, changed, rows, _gen(46), start=cut)
    for r, at in enumerate(cut.tolist()):
        torch.testing.assert_close(mean[r, at:], want_mean[r, at:], rtol=1e-5, atol=1e-5)


def test_extend_and_new_cache_reject_bad_input():
    model = _tiny_forecaster(5, patch=3, max_patches=12)
    cache = model.new_cache(2, 8)
    one = torch.ones(1, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    patches = torch.zeros((1, 2, 3))
    with pytest.raises(ValueError, match="capacity: 13"):
        model.new_cache(2, 13)
    with pytest.raises(ValueError, match="batch"):
        model.new_cache(0, 8)
    with pytest.raises(ValueError, match="PatchCache from this model"):
        model.extend(
            _tiny_forecaster(6, max_patches=12).new_cache(2, 8)._replace(keys=[]),
            patches,
            zero,
            zero,
            one,
        )
    with pytest.raises(ValueError, match=r"patches: expected \[R, n, 3\]"):
        model.extend(cache, torch.zeros((1, 0, 3)), zero, zero, one)
    with pytest.raises(ValueError, match="counts: expected an int64 tensor"):
        model.extend(cache, patches, zero, zero, one.int())
    bad = [
        (torch.tensor([2]), zero, one),  # no such cache row
        (zero, torch.tensor([-1]), one),
        (zero, zero, torch.tensor([3])),  # more than n = 2
        (zero, torch.tensor([7]), torch.tensor([2])),  # past the capacity
    ]
    for rows, positions, counts in bad:
        with pytest.raises(ValueError, match="positions \\+ counts <= 8"):
            model.extend(cache, patches, rows, positions, counts)


class _CountingForecaster(ts.PatchForecaster):
    """A PatchForecaster that counts the patches fed to ``extend`` and shown to ``forward``, and
    the rows that ``extend`` starts from window position 0."""

    def __init__(self, seed: int, max_patches: int = 32) -> None:
        torch.manual_seed(seed)
        super().__init__(3, dim=16, num_layers=2, num_heads=2, max_patches=max_patches)
        self.eval()
        self.fed = self.shown = self.fresh_rows = 0

    def forward(self, patches):
        self.shown += patches.shape[0] * patches.shape[1]
        return super().forward(patches)

    def extend(self, cache, patches, rows, positions, counts):
        self.fed += int(counts.sum())
        self.fresh_rows += int((positions == 0).sum())
        return super().extend(cache, patches, rows, positions, counts)


def test_a_cached_forecast_feeds_each_patch_once_until_the_window_moves():
    context = torch.randn((3, 5, 3), generator=_gen(47))
    target = _CountingForecaster(9)
    ts.forecast(target, context, 7, method="mean")
    assert (target.fed, target.shown) == (3 * (5 + 6), 0)
    # A window of 6: the calls for patches 7 .. 11 see a window that starts later each time, so
    # each row is fed its whole window again (learned positions count from the window start).
    target.fed = 0
    ts.forecast(target, context, 7, method="mean", max_context=6)
    assert target.fed == 3 * (5 + 1 + 5 * 6)
    target.fed = 0
    ts.forecast(target, context, 7, method="mean", use_cache=False)
    assert target.fed == 0 and target.shown == 3 * sum(range(5, 12))


def test_drafts_past_a_horizon_do_not_move_a_window_that_holds_it():
    # Rows fall out of step (different acceptances); a step drafts k for the row furthest from
    # its horizon, so the others draft past theirs. Those drafts are never committed and must
    # not slide a window of exactly context + horizon patches: each row's caches start once.
    target, draft, context = _close_pair(_CountingForecaster, max_patches=15)
    out = ts.forecast(target, context, 11, draft=draft, num_draft=4, generator=_gen(51))
    assert 0.2 < out.stats.acceptance_rate < 0.9 and len(set(out.stats.draft_lengths)) > 1
    assert (target.fresh_rows, draft.fresh_rows) == (6, 6)


def _close_pair(
    make: Any = _tiny_forecaster, max_patches: int = 16
) -> tuple[ts.PatchForecaster, ts.PatchForecaster, torch.Tensor]:
    """A random target, a draft near it (accepted often, not always) and a context [6, 4, 3]."""
    target, draft = make(10, max_patches=max_patches), make(11, max_patches=max_patches)
    with torch.no_grad():
        for ours, theirs in zip(draft.parameters(), target.parameters()):
            ours.copy_(theirs + 0.05 * torch.randn(theirs.shape, generator=_gen(48)))
    return target, draft, torch.randn((6, 4, 3), generator=_gen(49))


@pytest.mark.parametrize(
    "options",
    [
        {"method": "mean", "tolerance": 0.5, "num_draft": 3},
        {"method": "mean", "tolerance": 0.5, "num_draft": 3, "max_context": 7},
        {"method": "sample", "num_draft": 3},
        {"method": "sample", "num_draft": 2, "max_context": 9},
        {"method": "sample", "num_draft": 4, "lenience": 0.5, "num_samples": 2},
    ],
    ids=["mean", "mean-window", "sample", "sample-window", "sample-lenient"],
)
def test_a_cached_forecast_is_the_full_window_forecast(options):
    # Rows accept different numbers of drafts, so both models' caches are cut back by
    # different amounts per row and step; a cache that kept a rejected draft would change the
    # acceptance and the forecast.
    target, draft, context = _close_pair()
    runs = [
        ts.forecast(
            target, context, 11, draft=draft, generator=_gen(50), use_cache=cache, **options
        )
        for cache in (True, False)
    ]
    torch.testing.assert_close(runs[0].forecast, runs[1].forecast, rtol=1e-4, atol=1e-4)
    assert 0.0 < runs[0].stats.acceptance_rate < 1.0
    for field in ("steps", "offered_by_position", "accepted_counts_by_position", "draft_lengths"):
        assert getattr(runs[0].stats, field) == getattr(runs[1].stats, field), field


def test_a_cached_draft_forgets_what_steps_without_it_overwrote(monkeypatch):
    # Steps without drafts (the adaptive choice k = 0) leave the draft's cache behind the
    # history; the patches those steps commit replace rejected drafts the cache still holds.
    target, draft, context = _close_pair()
    runs = []
    for cache in (True, False):
        schedule = iter([0, 3, 0, 0, 2, 0, 3] * 4)
        monkeypatch.setattr(ts, "_best_draft_length", lambda *args, s=schedule: next(s))
        out = ts.forecast(
            target,
            context,
            11,
            draft=draft,
            num_draft=3,
            adaptive=True,
            method="mean",
            tolerance=0.5,
            use_cache=cache,
        )
        runs.append(out)
    assert 0 in runs[0].stats.draft_lengths and 0.0 < runs[0].stats.acceptance_rate < 1.0
    assert runs[0].stats.draft_lengths == runs[1].stats.draft_lengths
    assert runs[0].stats.accepted_counts_by_position == runs[1].stats.accepted_counts_by_position
    torch.testing.assert_close(runs[0].forecast, runs[1].forecast, rtol=1e-4, atol=1e-4)


def test_fit_forecaster_learns_synthetic_series():
    series = ts.synthetic_series(64, 256, generator=_gen(25))
    model = _tiny_forecaster(5, patch=4, max_patches=16).train()
    losses = ts.fit_forecaster(model, series, steps=80, batch_size=16, lr=1e-2, generator=_gen(26))
    assert len(losses) == 80 and not model.training
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.2
    with pytest.raises(ValueError, match="T >= 2 \\* patch_len"):
        ts.fit_forecaster(model, series[:, :7], steps=1)
    with pytest.raises(ValueError, match="patch_len and max_patches"):
        ts.fit_forecaster(torch.nn.Linear(2, 2), series, steps=1)


def test_synthetic_series_are_reproducible_and_vary():
    a = ts.synthetic_series(8, 100, generator=_gen(27))
    b = ts.synthetic_series(8, 100, generator=_gen(27))
    c = ts.synthetic_series(8, 100, generator=_gen(28))
    assert a.shape == (8, 100) and a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, c) and bool(torch.isfinite(a).all())
    assert float(a.std(1).min()) > 0.1
    with pytest.raises(ValueError, match="num_series"):
        ts.synthetic_series(0, 10)


def test_public_names_are_exported_and_documented():
    import specdecode

    assert "timeseries" in specdecode.__all__ and specdecode.timeseries is ts
    for name in ts.__all__:
        doc = getattr(ts, name).__doc__ or ""
        assert any(part in doc for part in ("Parameters", "Attributes", "Returns")), name


def test_gaussian_kl_is_the_kl_divergence():
    g = _gen(29)
    p_mean, q_mean = torch.randn(50, generator=g), torch.randn(50, generator=g)
    p_std, q_std = torch.rand(50, generator=g) + 0.1, torch.rand(50, generator=g) + 0.1
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(p_mean, p_std), torch.distributions.Normal(q_mean, q_std)
    )
    torch.testing.assert_close(ts.gaussian_kl(p_mean, p_std, q_mean, q_std), expected)


def test_distilled_draft_matches_the_target_and_is_accepted_more():
    series = ts.synthetic_series(32, 128, generator=_gen(30))
    target = ARForecaster(0.9, 0.3)
    draft = _tiny_forecaster(6, patch=4, max_patches=8)
    context = series[:, :32].reshape(-1, 8, 4)[:, :6].contiguous()
    before = ts.forecast(target, context, 6, draft=draft, num_draft=2, generator=_gen(31))
    losses = ts.distill_forecaster(
        draft, target, series, steps=60, batch_size=16, lr=1e-2, generator=_gen(32)
    )
    assert len(losses) == 60 and not draft.training
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    after = ts.forecast(target, context, 6, draft=draft, num_draft=2, generator=_gen(31))
    assert after.stats.acceptance_rate > before.stats.acceptance_rate + 0.2
    with pytest.raises(ValueError, match="steps: expected an int >= 1"):
        ts.distill_forecaster(draft, target, series, steps=0)


def _target_z_scores(target, context: torch.Tensor, paths: torch.Tensor) -> np.ndarray:
    """Each forecast value standardised by the target's Gaussian given the forecast before it:
    i.i.d. N(0, 1) exactly when the paths follow the target's law."""
    history = torch.cat([context, paths], 1)
    with torch.no_grad():
        mean, std = target(history)
    known = context.shape[1]
    z = (history[:, known:] - mean[:, known - 1 : -1]) / std[:, known - 1 : -1]
    return z.flatten().numpy()


def test_speculative_forecast_of_a_transformer_has_the_target_law():
    # Random Transformers: the law check needs no training, and their Gaussians differ enough
    # that many drafts are rejected and rows run out of step (ragged windows).
    target, draft = _tiny_forecaster(7), _tiny_forecaster(8)
    context = torch.randn((2000, 5, 3), generator=_gen(33))
    out = ts.forecast(target, context, 6, draft=draft, num_draft=3, generator=_gen(34))
    assert 0.05 < out.stats.acceptance_rate < 0.95
    assert sps.kstest(_target_z_scores(target, context, out.forecast), "norm").pvalue > ALPHA
    lenient = ts.forecast(
        target, context, 6, draft=draft, num_draft=3, lenience=0.2, generator=_gen(34)
    )
    assert sps.kstest(_target_z_scores(target, context, lenient.forecast), "norm").pvalue < 1e-6


def test_best_draft_length_maximises_patches_per_second():
    assert ts._expected_patches(1.0, 3) == 4.0
    assert ts._expected_patches(0.5, 2) == 1.75
    # a = 0.5, target 1 s, draft 0.1 s: k = 1, 2, 3 commit 1.36, 1.46, 1.44 patches per second.
    assert ts._best_draft_length(0.5, 1.0, 0.1, 6) == 2
    assert ts._best_draft_length(0.99, 1.0, 0.01, 6) == 6
    assert ts._best_draft_length(0.05, 1.0, 0.01, 6) == 1
    # Drafting that costs more than it commits: the target alone.
    assert ts._best_draft_length(0.9, 1.0, 2.0, 6) == 0
    assert ts._best_draft_length(0.01, 1.0, 0.1, 6) == 0


def test_adaptive_draft_length_follows_the_acceptance_and_keeps_the_law():
    target = ARForecaster(0.9, 0.5)
    context = _ar_context(6000)
    slow = ARForecaster(0.9, 0.5, delay=0.02)
    good = ts.forecast(slow, context, 8, draft=target, num_draft=4, adaptive=True)
    assert good.stats.draft_lengths == [4, 2]  # 5 patches, then the 3 left
    poor = ts.forecast(
        target,
        context,
        8,
        draft=ARForecaster(-0.9, 0.2),
        num_draft=4,
        adaptive=True,
        generator=_gen(35),
    )
    assert poor.stats.acceptance_rate < 0.05
    assert poor.stats.draft_lengths[0] == 4 and max(poor.stats.draft_lengths[1:]) <= 1
    # A draft that is never accepted: after the first step the target forecasts alone, with one
    # exploring draft every 8 steps.
    never = ts.forecast(
        target,
        context[:64],
        40,
        draft=ARForecaster(0.8, 0.5),
        num_draft=3,
        method="mean",
        adaptive=True,
    )
    lengths = never.stats.draft_lengths
    assert lengths[0] == 3 and never.stats.acceptance_rate == 0.0
    assert lengths[1:] == ([0] * 7 + [1]) * (len(lengths[1:]) // 8) + [0] * (len(lengths[1:]) % 8)
    torch.testing.assert_close(
        never.forecast, ts.forecast(target, context[:64], 40, method="mean").forecast
    )
    mixed = ts.forecast(
        target,
        context,
        8,
        draft=ARForecaster(0.5, 0.9),
        num_draft=4,
        adaptive=True,
        generator=_gen(36),
    )
    _assert_ar_law(context, mixed.forecast, 0.9, 0.5)
    assert len(mixed.stats.draft_lengths) == mixed.stats.steps


class _FedCostAR(ARForecaster):
    """An AR(1) forecaster on the incremental protocol whose call sleeps ``base`` seconds plus
    ``per_patch`` per patch fed (the widest row's): the cost of a target on a key/value cache,
    which grows with the drafts it verifies."""

    def __init__(self, phi: float, sigma: float, base: float, per_patch: float) -> None:
        super().__init__(phi, sigma)
        self.base, self.per_patch = base, per_patch

    def new_cache(self, batch: int, capacity: int) -> None:
        return None  # an AR(1) forecast needs no state

    def extend(self, cache, patches, rows, positions, counts):
        time.sleep(self.base + self.per_patch * patches.shape[1])
        return self.phi * patches, torch.full_like(patches, self.sigma)


def test_adaptive_draft_length_prices_the_drafts_a_cached_target_is_fed():
    def adaptive(base: float, per_patch: float, draft: ARForecaster, seed: int) -> ts.ForecastStats:
        target = _FedCostAR(0.9, 0.5, base=base, per_patch=per_patch)
        return ts.forecast(
            target,
            _ar_context(8),
            30,
            draft=draft,
            num_draft=4,
            adaptive=True,
            generator=_gen(seed),
        ).stats

    # A call after k drafts costs 0.5 + 5 (k + 1) ms. With under half the drafts accepted the
    # target alone is cheapest per patch (5.5 ms against 7 ms or more at k >= 1), which a cost
    # flat in k (the mean call, 25.5 ms at k = 4) would miss.
    half = adaptive(0.0005, 0.005, ARForecaster(0.4, 0.8), 37)
    lengths = half.draft_lengths
    assert 0.1 < half.acceptance_rate < 0.6
    assert lengths[:3] == [4, 4, 0]  # the first step, one measured, then the target alone
    assert sum(k > 1 for k in lengths[3:]) <= 2 and 2 * lengths[3:].count(0) >= len(lengths) - 3
    # Calls of 10 + 2 (k + 1) ms and a draft that is always accepted: 5 patches for 20 ms at
    # k = 4 beat 12 ms per patch alone, so it keeps drafting, with one step that measures the
    # target alone.
    every = adaptive(0.01, 0.002, ARForecaster(0.9, 0.5), 38)
    assert every.acceptance_rate == 1.0
    assert every.draft_lengths[:3] == [4, 4, 0] and every.draft_lengths.count(0) == 1


def test_num_samples_draws_independent_paths_per_series():
    target, draft = ARForecaster(0.9, 0.5), ARForecaster(0.5, 0.9)
    context = _ar_context(3)
    context[1, -1] += 4.0
    out = ts.forecast(target, context, 5, draft=draft, num_samples=2000, generator=_gen(37))
    assert out.forecast.shape == (3, 2000, 5, 2) and out.stats.patches == 3 * 2000 * 5
    # Each series' paths follow its own context: the AR law per series.
    for b in range(3):
        _assert_ar_law(context[b : b + 1].expand(2000, -1, -1), out.forecast[b], 0.9, 0.5)
    assert not torch.equal(out.forecast[0, 0], out.forecast[0, 1])
    with pytest.raises(ValueError, match="num_samples applies"):
        ts.forecast(target, context, 5, method="mean", num_samples=2)
    with pytest.raises(ValueError, match="num_samples: expected an int >= 1"):
        ts.forecast(target, context, 5, num_samples=0)
