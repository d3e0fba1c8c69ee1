"""Where the T <= 2 rows of tree attention lose time: the same op with its KV in L2, in L3 and in
DRAM, on one thread and on two.

    python bench/attention_residency.py [--rounds 3]

If the GB/s of a row barely changes from L3 to DRAM, the kernel is bound by its arithmetic
there, not by the read; the L2 row is the kernel's compute rate with the data close. Hq = 32,
Hkv = 8, D = 128 (the issue's shapes), B = 1; S = 256 (1 MiB of fp32 KV: L2), 2048 (8 MiB: L3)
and 32768 (128 MiB: DRAM). Every case runs in turn within a round, best of the rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import best_alternating, make  # noqa: E402

from specdecode import _C, ops  # noqa: E402

PLACES = {"L2": 256, "L3": 2048, "DRAM": 32768}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {when}, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"# tree_attention CPU path: {_C.attention_isa()}")
    print("\n| threads | dtype | T | L2 GB/s | L3 GB/s | DRAM GB/s | ns per KV head and key (L2) |")
    print("|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for t in (1, 2):
                fns, sizes = [], []
                for s in PLACES.values():
                    q, k, v, lens, _ = make(1, s, t, dtype, torch.device("cpu"))
                    reps = max(1, 4096 // s)

                    def call(q=q, k=k, v=v, lens=lens, reps=reps):
                        for _ in range(reps):
                            ops.tree_attention(q, k, v, lens)

                    fns.append(call)
                    sizes.append((2 * k.numel() * k.element_size() * reps, s * 8 * reps))
                best = [float("inf")] * len(fns)
                for _ in range(args.rounds):
                    for i, b in enumerate(best_alternating(fns, reps=6)):
                        best[i] = min(best[i], b)
                rates = [nbytes / sec / 1e9 for (nbytes, _), sec in zip(sizes, best)]
                ns_l2 = best[0] / sizes[0][1] * 1e9 * threads
                name = str(dtype).replace("torch.", "")
                print(
                    f"| {threads} | {name} | {t} | {rates[0]:.1f} | {rates[1]:.1f} | "
                    f"{rates[2]:.1f} | {ns_l2:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
