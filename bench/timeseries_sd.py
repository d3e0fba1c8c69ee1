"""Speculative forecasting of Gaussian patch forecasters against the target alone.

Trains a target and a draft :class:`specdecode.timeseries.PatchForecaster` on synthetic seasonal
series (``synthetic_series``; nothing is downloaded), then forecasts held-out series with the
target alone (one target call per patch, the baseline) and speculatively (``forecast`` with the
draft), each with the models run on their key/value caches (``use_cache=True``, the default) and
shown their whole windows at every call (``use_cache=False``), all in the same run, and prints
the wall time ratios, the acceptance, the patches per target call and the forecast error against
the held-out truth for each case.

    python bench/timeseries_sd.py [--train-steps 800] [--repeats 5] [--out FILE] [--cache DIR]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from scipy import stats as sps

from specdecode import timeseries as ts

PATCH = 8
CONTEXT = 48
HORIZON = 16
SERIES = 16  # held-out series timed at every batch size


def train(args: argparse.Namespace) -> tuple[ts.PatchForecaster, ts.PatchForecaster, float]:
    """The target trained on the data; the draft trained on the data, then distilled from the
    target (its acceptance is what a draft is for). ``--cache DIR`` keeps the weights."""
    series = ts.synthetic_series(512, 1024, generator=seeded(0))
    torch.manual_seed(0)
    target = ts.PatchForecaster(PATCH, dim=256, num_layers=4, num_heads=8, max_patches=64)
    draft = ts.PatchForecaster(PATCH, dim=64, num_layers=2, num_heads=2, max_patches=64)
    cached = Path(args.cache or "", f"timeseries_sd_{args.train_steps}.pt")
    if args.cache and cached.exists():
        weights = torch.load(cached)
        target.load_state_dict(weights["target"])
        draft.load_state_dict(weights["draft"])
        return target.eval(), draft.eval(), float(weights["seconds"])
    started = time.perf_counter()
    common = {"batch_size": 32, "progress": args.progress}
    ts.fit_forecaster(
        target, series, steps=args.train_steps, lr=1e-3, generator=seeded(1), **common
    )
    ts.fit_forecaster(draft, series, steps=args.train_steps // 2, generator=seeded(2), **common)
    ts.distill_forecaster(
        draft, target, series, steps=2 * args.train_steps, lr=2e-3, generator=seeded(3), **common
    )
    seconds = time.perf_counter() - started
    if args.cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        state = {"target": target.state_dict(), "draft": draft.state_dict(), "seconds": seconds}
        torch.save(state, cached)
    return target, draft, seconds


def heldout(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context [B, CONTEXT, PATCH] and truth [B, HORIZON, PATCH] from unseen series."""
    series = ts.synthetic_series(batch, (CONTEXT + HORIZON) * PATCH, generator=seeded(99))
    patches = series.view(batch, CONTEXT + HORIZON, PATCH)
    return patches[:, :CONTEXT].contiguous(), patches[:, CONTEXT:].contiguous()


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def label(method: str, options: dict) -> str:
    return method + "".join(f", {key} {value}" for key, value in options.items())


def accuracy(target, draft, cases, num_draft) -> list[str]:
    """Mean absolute error of the forecasts against the held-out truth, over 256 series."""
    context, truth = heldout(256)
    lines = [
        "",
        f"Forecast error over 256 held-out series (mean absolute error per value; the series' "
        f"values have a standard deviation of {float(truth.std()):.2f}):",
        "",
        "| method | target alone | target alone, other draws | "
        + " | ".join(f"speculative, k = {k}" for k in num_draft)
        + " |",
        "|---|---|---|" + "---|" * len(num_draft),
    ]
    for method, options in cases:
        # The target alone twice, with other random draws: the spread a sample path's error has
        # without any change of law.
        row = []
        for seed in (7, 8):
            alone = ts.forecast(target, context, HORIZON, method=method, generator=seeded(seed))
            row.append(f"{float((alone.forecast - truth).abs().mean()):.3f}")
        for k in num_draft:
            spec = ts.forecast(
                target,
                context,
                HORIZON,
                draft=draft,
                num_draft=k,
                method=method,
                generator=seeded(7),
                **options,
            )
            row.append(f"{float((spec.forecast - truth).abs().mean()):.3f}")
        lines.append(f"| {label(method, options)} | " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    return lines + law_check(target, draft, context, num_draft)


def law_check(target, draft, context, num_draft) -> list[str]:
    """The sample paths standardised by the target's Gaussian given the path before each value:
    i.i.d. N(0, 1) exactly when the paths follow the target's law (a KS test over all values)."""

    def z_scores(paths: torch.Tensor) -> torch.Tensor:
        history = torch.cat([context, paths], 1)
        with torch.no_grad():
            mean, std = target(history)
        known = context.shape[1]
        return ((history[:, known:] - mean[:, known - 1 : -1]) / std[:, known - 1 : -1]).flatten()

    lines = [
        "",
        "Law check on the same 256 series (each value of a sample path standardised by the "
        "target's Gaussian given the path before it; N(0, 1) under the target's law):",
        "",
        "| sampling | z std | KS p-value |",
        "|---|---|---|",
    ]
    runs = [("target alone", {})]
    for k in num_draft:
        runs += [(f"speculative, k = {k}", {"draft": draft, "num_draft": k})]
        runs += [
            (
                f"speculative, k = {k}, lenience 0.5",
                {"draft": draft, "num_draft": k, "lenience": 0.5},
            )
        ]
    for name, options in runs:
        out = ts.forecast(target, context, HORIZON, generator=seeded(11), **options)
        z = z_scores(out.forecast)
        pvalue = sps.kstest(z.numpy(), "norm").pvalue
        lines.append(f"| {name} | {float(z.std()):.4f} | {pvalue:.3g} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-steps", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-draft", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--cache", help="directory to keep the trained weights in between runs")
    args = parser.parse_args()

    target, draft, train_s = train(args)
    target_params = sum(p.numel() for p in target.parameters())
    draft_params = sum(p.numel() for p in draft.parameters())
    lines = [
        f"# timeseries_sd: {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; target "
        f"{target_params / 1e3:.0f}k parameters, draft {draft_params / 1e3:.0f}k, "
        f"trained {args.train_steps} steps (draft: {args.train_steps // 2} on the data, "
        f"{2 * args.train_steps} distilled) "
        f"({train_s:.0f} s); context {CONTEXT} patches of {PATCH}, horizon {HORIZON}; the times "
        f"forecast {SERIES} held-out series, B at a time; best of {args.repeats}",
        "",
        "Times: full = every call shown the whole window (use_cache=False), cached = the key/"
        "value caches (use_cache=True). Speedups: speculative against the target alone with the "
        "same calls; last column the cached speculative forecast against the full-window target "
        "alone.",
        "",
        "| B | method | k | alone, full | alone, cached | speculative, full "
        "| speculative, cached | speedup, full | speedup, cached | cached spec / full alone "
        "| acceptance | patches/call |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = [
        ("sample", {}),
        ("sample", {"lenience": 0.5}),
        ("mean", {}),
        ("mean", {"tolerance": 0.5}),
    ]
    # Fixed draft lengths, and the adaptive choice of up to the longest of them.
    settings = [(str(k), {"num_draft": k}) for k in args.num_draft]
    settings += [
        (f"auto <= {max(args.num_draft)}", {"num_draft": max(args.num_draft), "adaptive": True})
    ]
    contexts, _ = heldout(SERIES)
    for batch in args.batches:
        # The same SERIES series at every batch size, in SERIES // batch calls: acceptance
        # differs much from series to series, so one series alone would say little.
        groups = contexts.split(batch)
        for method, options in cases:
            for k, drafting in settings:
                # (use_cache, speculative) -> seconds of each repeat; the last run's stats (the
                # cached speculative one) give the acceptance. The four alternate so that drift
                # on the machine hits all alike.
                times: dict[tuple[bool, bool], list[float]] = {}
                for _ in range(args.repeats):
                    for use_cache in (False, True):
                        for speculative in (False, True):
                            extra = {"draft": draft, **drafting, **options} if speculative else {}
                            started = time.perf_counter()
                            specs = [
                                ts.forecast(
                                    target,
                                    context,
                                    HORIZON,
                                    method=method,
                                    generator=seeded(5),
                                    use_cache=use_cache,
                                    **extra,
                                ).stats
                                for context in groups
                            ]
                            seconds = time.perf_counter() - started
                            times.setdefault((use_cache, speculative), []).append(seconds)
                best = {case: min(seconds) for case, seconds in times.items()}
                offered = sum(sum(s.offered_by_position) for s in specs)
                accepted = sum(sum(s.accepted_counts_by_position) for s in specs)
                per_call = sum(s.patches for s in specs) / sum(s.row_steps for s in specs)
                order = [(False, False), (True, False), (False, True), (True, True)]
                cells = [f"{best[case] * 1e3:.1f} ms" for case in order]
                cells += [
                    f"{best[(False, False)] / best[(False, True)]:.2f}x",
                    f"{best[(True, False)] / best[(True, True)]:.2f}x",
                    f"{best[(False, False)] / best[(True, True)]:.2f}x",
                ]
                lines.append(
                    f"| {batch} | {label(method, options)} | {k} | "
                    + " | ".join(cells)
                    + f" | {accepted / max(offered, 1):.2f} | {per_call:.2f} |"
                )
                print(lines[-1], flush=True)
    lines += accuracy(target, draft, cases, args.num_draft)
    text = "\n".join(lines)
    print()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
