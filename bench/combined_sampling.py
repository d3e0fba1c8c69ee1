"""Sampling with Cacheback and a draft model combined, on a batch: what a Cacheback row keeps in
a step that mixes it with the draft model's sampled rows (``CombinedDrafter(mixed_steps=...)``).

At temperature > 0 the draft model samples its chains, so a step whose batch mixes n-gram rows
with draft-model rows is verified with draft distributions, the n-gram rows flagged in
``draft_deterministic``. ``mixed_steps="path"`` cuts each n-gram row of a sampling sequence to
its tree's first root path (in every step, so that a row's drafts do not depend on the batch),
``"tree"`` keeps the whole tree. Both are lossless; they differ in how many tokens a
step accepts and in how many tokens the target's forward pass scores. Cacheback alone and the
draft model alone are measured in the same run.

The zoo pair's target and draft (no download), the demo's Python prompts as one batch, several
seeds per arm (sampling: outputs differ from arm to arm, only their law is the same):

    python bench/combined_sampling.py [--prompts 4] [--new 96] [--seeds 3] [--temperature 0.8]
        [--budget none|cost-aware]
"""

from __future__ import annotations

import argparse
import time

import torch
from specdecode.cli import DEMO_PROMPTS, load_model
from specdecode.drafters import CachebackDrafter, CombinedDrafter, ModelDrafter
from specdecode.engine import CostAwareBudget

from specdecode import generate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="pycode")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument(
        "--budget",
        choices=("none", "cost-aware"),
        default="none",
        help="the engine's tree-size policy: whole drafts up to max_nodes, or CostAwareBudget",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    target, draft, codec = loaded.target, loaded.draft, loaded.codec
    prompts = [codec.encode(t) for t in DEMO_PROMPTS[: args.prompts]]
    batch = len(prompts)

    def combined(mixed_steps: str) -> CombinedDrafter:
        return CombinedDrafter(
            CachebackDrafter(max_sequences=batch),
            ModelDrafter(draft, mode="chain", k=args.k),
            mixed_steps=mixed_steps,
        )

    arms = {
        "Cacheback": lambda: CachebackDrafter(max_sequences=batch),
        f"draft model (chain, k={args.k})": lambda: ModelDrafter(draft, mode="chain", k=args.k),
        'combined, mixed_steps="path"': lambda: combined("path"),
        'combined, mixed_steps="tree"': lambda: combined("tree"),
    }
    generate(target, prompts[:1], drafter=combined("tree"), max_new_tokens=4, temperature=0.0)
    print(
        f"zoo pair {args.model!r}, batch {batch}, {args.new} new tokens, temperature "
        f"{args.temperature}, seeds 0..{args.seeds - 1}, budget {args.budget}, 1 torch thread"
    )
    print(f"{'drafter':<44} {'tokens/step':>11} {'tokens/s':>9} {'fallback steps':>15}")
    # Seeds outer, arms inner: machine load spreads over the arms alike.
    totals = {name: [0, 0, 0.0, 0] for name in arms}
    for seed in range(args.seeds):
        for name, make in arms.items():
            drafter = make()
            t0 = time.perf_counter()
            out = generate(
                target,
                prompts,
                drafter=drafter,
                max_new_tokens=args.new,
                temperature=args.temperature,
                seed=[seed * batch + b for b in range(batch)],
                budget=CostAwareBudget() if args.budget == "cost-aware" else None,
            )
            seconds = time.perf_counter() - t0
            tot = totals[name]
            tot[0] += out.stats.new_tokens
            tot[1] += out.stats.row_steps
            tot[2] += seconds
            tot[3] += getattr(drafter, "counts", {}).get("fallback", 0)
    for name, (tokens, steps, seconds, fallback) in totals.items():
        fb = f"{fallback} of {steps}" if "combined" in name else "-"
        print(f"{name:<44} {tokens / steps:>11.2f} {tokens / seconds:>9.1f} {fb:>15}")


if __name__ == "__main__":
    main()
