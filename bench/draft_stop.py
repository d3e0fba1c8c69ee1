"""The draft model's confidence floor (``ModelDrafter(stop_below=p)``) on the zoo pair.

    python bench/draft_stop.py [--rounds 3] [--k 4 6] [--floors 0.2 0.4 0.6 0.8]

Decodes the demo's five Python prompts (greedy, batch 1 and batch 5, 64 new tokens, 1 torch
thread) with a draft-model chain of depth ``k`` without a floor and with each floor, and
autoregressively as the baseline; every configuration runs once per round, in turn, so all see
the same machine load, and the table keeps each one's best round. Every run's tokens are checked
against the autoregressive ones (greedy decoding is lossless with or without a floor).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from specdecode.cli import DEMO_PROMPTS
from specdecode.drafters import ModelDrafter, NoDrafter
from specdecode.zoo import load

from specdecode import generate


def run(target, prompts, drafter, batch):
    """(seconds, output) of decoding ``prompts`` ``batch`` at a time."""
    t0 = time.perf_counter()
    sequences, steps, drafted, accepted = [], 0, 0, 0
    for i in range(0, len(prompts), batch):
        out = generate(target, prompts[i : i + batch], drafter=drafter(), max_new_tokens=64)
        sequences += out.sequences
        steps += out.stats.row_steps
        drafted += sum(out.stats.offered_by_position)
        accepted += out.stats.accepted_tokens
    return time.perf_counter() - t0, sequences, steps, drafted, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 6])
    parser.add_argument("--floors", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 5])
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft, tok = load("pycode")
    prompts = [tok.encode(t) for t in DEMO_PROMPTS]
    configs = [("autoregressive", None, None, NoDrafter)]
    for k in args.k:
        for floor in [None, *args.floors]:
            configs.append(
                (
                    f"chain k={k}" + ("" if floor is None else f", stop_below={floor}"),
                    k,
                    floor,
                    lambda k=k, floor=floor: ModelDrafter(draft, k=k, stop_below=floor),
                )
            )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cpu = platform.processor() or platform.machine()
    print(f"# {when}, {cpu}, torch {torch.__version__}, 1 thread, {args.rounds} rounds")
    for batch in args.batch:
        best = {name: float("inf") for name, *_ in configs}
        stats = {}
        want = None
        for _ in range(args.rounds):
            for name, _, _, make in configs:
                seconds, seqs, steps, drafted, accepted = run(target, prompts, make, batch)
                if want is None:
                    want = seqs
                assert seqs == want, f"{name}: output differs from autoregressive decoding"
                best[name] = min(best[name], seconds)
                stats[name] = (steps, drafted, accepted, sum(len(s) for s in seqs))
        base = best["autoregressive"]
        print(f"\n## batch {batch}\n")
        print("| drafter | tokens/s | tokens/step | drafted/step | accepted/drafted | speedup |")
        print("|---|---|---|---|---|---|")
        for name, *_ in configs:
            steps, drafted, accepted, tokens = stats[name]
            rate = accepted / drafted if drafted else float("nan")
            print(
                f"| {name} | {tokens / best[name]:.1f} | {tokens / steps:.2f} | "
                f"{drafted / steps:.2f} | {rate:.2f} | {base / best[name]:.2f}x |"
            )


if __name__ == "__main__":
    main()
