"""A/B of two builds of tree_attention in alternating processes, caches cold before each call.

Each build is a folder holding an installed ``specdecode`` (``pip install --target DIR .``; an
empty string is the package installed in the environment). Every round runs one process per
build, base first; a process times each case's ``ops.tree_attention`` call 15 times, each after
writing a 96 MiB buffer (so the KV comes from DRAM, as in a model's forward where every layer's
cache is a different one), and prints the minimum in ms. Alternating processes spread the load of
other processes on a shared machine over both builds alike; compare medians over rounds.

    python bench/attention_ab.py --rounds 6 --base "" --new /tmp/side_new
    python bench/attention_ab.py --new /tmp/side_new --cases bf16:1:4096:4 fp32:1:512:1
    python bench/attention_ab.py --new /tmp/side_new --cases fp32:1:200:4:16:16:64

Cases: chains of T tree nodes after a prefix of S keys, Hq 32, Hkv 8, D 128 (GQA 4) unless a
case names its own heads and head dim; the default list below, or ``--cases DTYPE:B:S:T ...``
(``DTYPE:B:S:T:HQ:HKV:D`` for other heads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

DTYPES = ("bf16", "fp32", "fp16")
HQ, HKV, D = 32, 8, 128
Case = tuple[str, int, int, int, int, int, int]  # (dtype, B, S, T, Hq, Hkv, D)
CASES: list[Case] = [
    ("bf16", 8, 4096, 1, HQ, HKV, D),
    ("bf16", 1, 16384, 1, HQ, HKV, D),
    ("bf16", 1, 4096, 1, HQ, HKV, D),
    ("fp32", 8, 4096, 1, HQ, HKV, D),
    ("fp32", 1, 16384, 1, HQ, HKV, D),
    ("fp16", 8, 4096, 1, HQ, HKV, D),
    ("bf16", 8, 4096, 2, HQ, HKV, D),
    ("fp32", 8, 4096, 2, HQ, HKV, D),
    ("bf16", 8, 4096, 4, HQ, HKV, D),
]


def case_name(case: Case) -> str:
    dtype, b, s, t, hq, hkv, d = case
    heads = "" if (hq, hkv, d) == (HQ, HKV, D) else f" Hq{hq} Hkv{hkv} D{d}"
    return f"{dtype} B{b} S{s} T{t}{heads}"


def parse_case(text: str) -> Case:
    """``"bf16:1:4096:4"`` -> ``("bf16", 1, 4096, 4, 32, 8, 128)``; ``"fp32:1:200:4:16:16:64"``
    names the heads and head dim too."""
    parts = text.split(":")
    if len(parts) not in (4, 7) or parts[0] not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"expected DTYPE:B:S:T or DTYPE:B:S:T:HQ:HKV:D with DTYPE one of {DTYPES}, got {text!r}"
        )
    try:
        b, s, t, hq, hkv, d = (
            int(x) for x in parts[1:] + [str(HQ), str(HKV), str(D)][: 7 - len(parts)]
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"B, S, T, HQ, HKV and D must be integers, got {text!r}"
        ) from None
    if b < 1 or s < 0 or t < 1:
        raise argparse.ArgumentTypeError(f"need B >= 1, S >= 0, T >= 1, got {text!r}")
    if hkv < 1 or d < 1 or hq < hkv or hq % hkv:
        raise argparse.ArgumentTypeError(
            f"need HKV >= 1, D >= 1 and HQ a multiple of HKV, got {text!r}"
        )
    return parts[0], b, s, t, hq, hkv, d


def case_arg(case: Case) -> str:
    return ":".join(str(x) for x in case)


def time_cases(calls: int, cases: list[Case]) -> list[float]:
    """Min ms of ``calls`` cold-cache calls per case, in this process."""
    import torch

    from specdecode import ops

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    torch.manual_seed(0)
    flush = torch.empty(96 << 20, dtype=torch.uint8)
    out = []
    for dtype, b, s, t, hq, hkv, d in cases:
        dt = dtypes[dtype]
        q = torch.randn(b, t, hq, d, dtype=dt)
        k = torch.randn(b, s + t, hkv, d, dtype=dt)
        v = torch.randn(b, s + t, hkv, d, dtype=dt)
        prefix = torch.full((b,), s, dtype=torch.int32)
        ops.tree_attention(q, k, v, prefix)
        best = float("inf")
        for _ in range(calls):
            flush.add_(1)
            t0 = time.perf_counter()
            ops.tree_attention(q, k, v, prefix)
            best = min(best, time.perf_counter() - t0)
        out.append(best * 1e3)
    return out


def run_build(path: str, calls: int, cases: list[Case]) -> list[float]:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path
    else:
        env.pop("PYTHONPATH", None)
    # From a neutral folder, so that a source tree in the working directory is never imported.
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", str(calls)]
        + ["--cases"]
        + [case_arg(c) for c in cases],
        env=env,
        cwd=os.path.dirname(os.path.abspath(os.sep)),
        capture_output=True,
        text=True,
        check=True,
    )
    return [float(x) for x in proc.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--base", default="", help="folder of the base build ('' = installed)")
    parser.add_argument("--new", required=False, help="folder of the new build")
    parser.add_argument(
        "--cases",
        nargs="+",
        type=parse_case,
        default=CASES,
        metavar="DTYPE:B:S:T[:HQ:HKV:D]",
        help="cases to time instead of the default list, e.g. bf16:1:4096:4 or "
        "fp32:1:200:4:16:16:64",
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = args.cases
    if args.child is not None:
        print(" ".join(f"{x:.3f}" for x in time_cases(args.child, cases)), flush=True)
        return
    if args.new is None:
        parser.error("--new is required")
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be at least 1")
    print("cases: " + " | ".join(case_name(c) for c in cases))
    results: dict[str, list[list[float]]] = {"base": [], "new": []}
    for _ in range(args.rounds):
        for label, path in (("base", args.base), ("new", args.new)):
            times = run_build(path, args.calls, cases)
            results[label].append(times)
            print(f"{label}: " + " ".join(f"{x:.3f}" for x in times), flush=True)
    print("\n| case | base median (min) | new median (min) | new / base (medians) |")
    print("|---|---|---|---|")
    for i, case in enumerate(cases):
        base = [r[i] for r in results["base"]]
        new = [r[i] for r in results["new"]]
        ratio = statistics.median(new) / statistics.median(base)
        print(
            f"| {case_name(case)} | {statistics.median(base):.3f} ({min(base):.3f}) | "
            f"{statistics.median(new):.3f} ({min(new):.3f}) | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
