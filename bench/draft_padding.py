"""The draft model's passes over a batch whose rows finish at different times: seconds spent
drafting (``GenerationStats.draft_time``) and tokens/s of ``specdecode.generate``.

``ModelDrafter`` feeds every row of its cache in each pass; rows it does not draft for (finished
sequences, rows another drafter serves) get a padding token. With a model that takes
``num_nodes`` the drafter marks that padding, so it is not computed. Run this script once per
build to compare two builds (alternate them; the figures are per process):

    python bench/draft_padding.py [--rounds 3] [--new 96]

The zoo pair's target drafts for itself (a chain of 3; every draft is accepted, so the steps are
the same in every build), batch 10 (the demo's five prompts twice), stop tokens taken from the
greedy output so that rows end after different numbers of tokens.
"""

from __future__ import annotations

import argparse
import time

import torch
from specdecode.cli import DEMO_PROMPTS, load_model
from specdecode.drafters import ModelDrafter

from specdecode import generate

# Positions (in rows 0..4) whose tokens become stop tokens.
STOP_AT = (8, 20, 35, 50, 70)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=96, help="max new tokens per row")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("pycode")
    target, codec = loaded.target, loaded.codec
    prompts = [codec.encode(t) for t in DEMO_PROMPTS] * 2

    def drafter() -> ModelDrafter:
        return ModelDrafter(target, mode="chain", k=3)

    full = generate(target, prompts, drafter=drafter(), max_new_tokens=args.new).sequences

    def cuts_for(stop: set[int]) -> list[int]:
        return [next((i + 1 for i, t in enumerate(r) if t in stop), len(r)) for r in full]

    stop: set[int] = set()
    for b, pos in enumerate(STOP_AT):
        if pos < len(full[b]) and min(cuts_for(stop | {full[b][pos]})) >= 6:
            stop.add(full[b][pos])
    cuts = cuts_for(stop)
    best = None
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        out = generate(
            target, prompts, drafter=drafter(), max_new_tokens=args.new, stop_token_ids=stop
        )
        seconds = time.perf_counter() - t0
        assert [len(s) for s in out.sequences] == cuts
        if best is None or seconds < best[0]:
            best = (seconds, out.stats)
    seconds, stats = best
    print(
        f"rows stop after {cuts} tokens; best of {args.rounds}: {sum(cuts) / seconds:.1f} tok/s, "
        f"draft {stats.draft_time:.3f} s, verify {stats.verify_time:.3f} s, {stats.steps} steps"
    )


if __name__ == "__main__":
    main()
