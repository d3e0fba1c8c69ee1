"""Where the time of each GPU op goes: its kernels against the host work around them.

For a few cases of ``ops.verify``, ``ops.sample``, ``ops.sampling_probs`` and
``ops.tree_attention`` on a CUDA device, prints one line per case: the wall time of one call
(synchronised, median of ``--repeats``), the GPU time of the kernels it launched and their count
(from ``torch.profiler``), and the host-side share (wall minus kernel time: argument checks,
allocations, launches and any wait for the device). Then, per case, the kernels by GPU time.

    python bench/gpu_profile.py [--repeats 50] [--out FILE] [--only SUBSTRING]
    python bench/gpu_profile.py --attention-splits [--out FILE]

``--attention-splits`` instead sweeps the KV split count of the CUDA tree attention (the
flash-decoding split that ``_num_splits`` picks) over decoding and tree cases: kernel time per
split count, and the count the heuristic picks, for tuning that heuristic.

Needs a GPU and a CUDA build of specdecode; bench/gpu_session.sh runs it in its bench phase.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from specdecode._ops import attention as attention_module
from torch.profiler import ProfilerActivity, profile

from specdecode import ops

DEVICE = torch.device("cuda")


def wall_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def kernels(fn: Callable[[], object], repeats: int) -> tuple[float, int, list[tuple[str, float]]]:
    """GPU milliseconds and kernel launches per call, and the per-call kernels by GPU time."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    launches = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.time_range.elapsed_us()
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + us
        launches += 1
    total_ms = sum(per_kernel.values()) / repeats / 1e3
    ranked = sorted(
        ((name, us / repeats / 1e3) for name, us in per_kernel.items()), key=lambda x: -x[1]
    )
    return total_ms, launches // repeats, ranked


def verify_case(b: int, n: int, v: int, logits: bool, with_q: bool) -> Callable[[], object]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    target = torch.randn(b, n, v, device=DEVICE, generator=g) * 3
    if not logits:
        target = torch.softmax(target, -1)
    q = torch.softmax(torch.randn(b, n, v, device=DEVICE, generator=g) * 3, -1) if with_q else None
    tokens = torch.randint(0, v, (b, n), device=DEVICE, generator=g, dtype=torch.int32)
    seed = torch.arange(b, device=DEVICE)
    return lambda: ops.verify(
        target, tokens, draft_probs=q, seed=seed, offset=1, target_is_logits=logits
    )


def sample_case(b: int, v: int, top_k: int, top_p: float) -> Callable[[], object]:
    logits = torch.randn(b, v, device=DEVICE) * 3
    return lambda: ops.sample(logits, 0.8, top_k, top_p, seed=0, offset=1)


def probs_case(b: int, v: int, top_k: int, top_p: float) -> Callable[[], object]:
    logits = torch.randn(b, v, device=DEVICE) * 3
    return lambda: ops.sampling_probs(logits, 0.8, top_k, top_p)


def attention_case(
    b: int, s: int, t: int, dtype: torch.dtype, in_cache: bool = False
) -> Callable[[], object]:
    hq, hkv, d = 32, 8, 128
    q = torch.randn(b, t, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, s + t, hkv, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, s + t, hkv, d, device=DEVICE, dtype=dtype)
    lens = torch.full((b,), s, dtype=torch.int32, device=DEVICE)
    mask = None
    if t > 1:
        parents = ops.chain_parents(b, t - 1).to(torch.int32).to(DEVICE)
        mask = ops.tree_info(parents).mask
    if in_cache:
        # What a model calls: the same kernels without the read of the status (no wait).
        return lambda: attention_module.tree_attention_in_cache(q, k, v, lens, mask, d**-0.5)
    return lambda: ops.tree_attention(q, k, v, lens, mask)


def cases() -> list[tuple[str, Callable[[], Callable[[], object]]]]:
    out = []
    for b in (1, 8, 64):
        for logits in (True, False):
            kind = "logits" if logits else "probs"
            out.append(
                (
                    f"verify chain k=4 B={b} V=128256 {kind}",
                    lambda b=b, lg=logits: verify_case(b, 5, 128256, lg, True),
                )
            )
    out.append(
        (
            "verify chain k=4 B=8 V=128256 logits, no q",
            lambda: verify_case(8, 5, 128256, True, False),
        )
    )
    for b in (1, 64):
        for top_k, top_p in ((0, 1.0), (50, 1.0), (0, 0.95)):
            out.append(
                (
                    f"sample B={b} V=128256 top_k={top_k} top_p={top_p}",
                    lambda b=b, k=top_k, p=top_p: sample_case(b, 128256, k, p),
                )
            )
            out.append(
                (
                    f"sampling_probs B={b} V=128256 top_k={top_k} top_p={top_p}",
                    lambda b=b, k=top_k, p=top_p: probs_case(b, 128256, k, p),
                )
            )
    for b in (1, 8):
        for s in (512, 4096):
            for t in (1, 4, 16, 64):
                for dtype in (torch.float32, torch.bfloat16):
                    name = f"tree_attention B={b} S={s} T={t} {str(dtype)[6:]}"
                    out.append((name, lambda b=b, s=s, t=t, dt=dtype: attention_case(b, s, t, dt)))
    for dtype in (torch.float32, torch.bfloat16):
        out.append(
            (
                f"tree_attention_in_cache B=8 S=4096 T=1 {str(dtype)[6:]}",
                lambda dt=dtype: attention_case(8, 4096, 1, dt, in_cache=True),
            )
        )
    return out


def split_sweep(
    repeats: int,
    counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
    batches: tuple[int, ...] = (1, 8, 32),
    trees: tuple[int, ...] = (1, 4, 16, 64),
) -> list[str]:
    """Kernel ms of tree_attention per KV split count (the heuristic's pick marked *)."""
    heuristic = attention_module._num_splits
    lines = [
        "| case | heuristic | " + " | ".join(f"{n} splits" for n in counts) + " |",
        "|---|---|" + "---|" * len(counts),
    ]
    print("\n".join(lines), flush=True)
    for b in batches:
        for s in (512, 4096, 16384):
            for t in trees:
                for dtype in dtypes:
                    if b * s > 8 * 16384:
                        continue
                    fn = attention_case(b, s, t, dtype)
                    q = torch.empty(b, t, 32, 128, device=DEVICE, dtype=dtype)
                    pick = heuristic(q, torch.empty(b, s + t, 8, 128, device=DEVICE, dtype=dtype))
                    cells = []
                    for n in counts:
                        attention_module._num_splits = lambda q, k, n=n: n
                        try:
                            ms = kernels(fn, repeats)[0]
                        finally:
                            attention_module._num_splits = heuristic
                        cells.append(f"{ms:.4f}" + ("*" if n == pick else ""))
                    name = f"B={b} S={s} T={t} {str(dtype)[6:]}"
                    line = f"| {name} | {pick} | " + " | ".join(cells) + " |"
                    print(line, flush=True)
                    lines.append(line)
                    del fn
                    torch.cuda.empty_cache()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument(
        "--attention-splits",
        action="store_true",
        help="sweep tree_attention's KV split count instead of profiling the ops",
    )
    ap.add_argument("--only", default="", help="profile only the cases whose name contains this")
    ap.add_argument(
        "--split-counts",
        default="1,2,4,8,16,32,64",
        help="with --attention-splits: the split counts to time, comma-separated",
    )
    ap.add_argument(
        "--dtypes",
        default="bfloat16,float32",
        help="with --attention-splits: the dtypes, comma-separated torch names",
    )
    ap.add_argument(
        "--batches", default="1,8,32", help="with --attention-splits: B, comma-separated"
    )
    ap.add_argument(
        "--trees", default="1,4,16,64", help="with --attention-splits: T, comma-separated"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile.py needs a GPU")
    if args.attention_splits:
        lines = [f"# {torch.cuda.get_device_name(0)}: tree_attention kernel ms by KV splits", ""]
        counts = tuple(int(n) for n in args.split_counts.split(","))
        dtypes = tuple(getattr(torch, name) for name in args.dtypes.split(","))
        batches = tuple(int(n) for n in args.batches.split(","))
        trees = tuple(int(n) for n in args.trees.split(","))
        lines += split_sweep(args.repeats, counts, dtypes, batches, trees)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return
    lines = [
        f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        "",
        "| case | wall ms | kernel ms | kernels/call | host ms | top kernel (ms) |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    details = []
    for name, make in cases():
        if args.only not in name:
            continue
        fn = make()
        wall = wall_ms(fn, args.repeats)
        gpu, launches, ranked = kernels(fn, args.repeats)
        top = f"{ranked[0][0][:60]} ({ranked[0][1]:.3f})" if ranked else "-"
        line = f"| {name} | {wall:.3f} | {gpu:.3f} | {launches} | {wall - gpu:.3f} | {top} |"
        print(line, flush=True)
        lines.append(line)
        details.append(f"\n{name}:")
        details += [f"  {ms:8.4f} ms  {kname[:110]}" for kname, ms in ranked[:6]]
        del fn
        torch.cuda.empty_cache()
    print("\n".join(details), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines + details) + "\n")


if __name__ == "__main__":
    main()
