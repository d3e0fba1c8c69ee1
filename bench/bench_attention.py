"""Benchmark of specdecode.ops.tree_attention against PyTorch baselines, on one machine, one run.

For every case (B, prefix S, tree T, dtype; Hq=32, Hkv=8, D=128, a causal-chain mask over the
T tree nodes) it times, best of N:

* ``ours``  -- specdecode.ops.tree_attention (prefix dense + masked tree, LSE merge);
* ``sdpa``  -- torch.nn.functional.scaled_dot_product_attention with the equivalent dense
  boolean mask [B, 1, T, S + T] and ``enable_gqa=True``;
* ``naive`` -- matmul -> masked_fill -> softmax -> matmul with the KV heads repeated for GQA.

It also measures, in the same run, the machine's read bandwidth (``sum`` over a 512 MiB fp32
tensor with the same thread count) and a practical peak per dtype (a square matmul, 2048 on the
CPU and 4096 on a GPU; for bf16 the faster of the bf16 and the fp32 matmul: on a CPU with
AVX512_BF16 the bf16 kernels multiply bf16 pairs, as torch's bf16 matmul does, and elsewhere they
widen to fp32), and reports GB/s of KV that must be read (2 * B * (S + T) * Hkv * D * itemsize)
and FLOP/s (4 * B * T * Hq * (S + T) * D) against them. The memory-bound rows also give the KV
GB/s the op would reach computing at the matmul's rate ("compute-bound at"): where that is
below 60 % of the read bandwidth, the issue's T <= 4 goal is out of reach of any kernel that does
the op's arithmetic, on that machine. For the memory-bound cases (T <= 4) the bandwidth is
measured again interleaved with the op (alternating calls, best of each), so both see the same
load from other processes on a shared machine; the "% bw" column uses that figure. A pure read of
the op's own K and V tensors (torch ``sum``) is timed in the same rotation and reported next to
it: the ceiling for those exact buffers.

Run under the shared lock so benchmarks never overlap:
    flock /tmp/specdecode-bench.lock python bench/bench_attention.py [--quick] [--device cuda]
        [--isa amx | avx512bf16 | avx512 | avx2 | generic]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.nn.functional as F

import specdecode
from specdecode import ops

HQ, HKV, D = 32, 8, 128


def best_time(fn, min_reps: int = 3, budget_s: float = 1.0, sync=None) -> float:
    fn()
    if sync:
        sync()
    best = float("inf")
    start = time.perf_counter()
    reps = 0
    while reps < min_reps or (time.perf_counter() - start < budget_s and reps < 50):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


PAUSE_S = 0.0  # --pause-ms


def best_alternating(fns, reps: int = 12, sync=None) -> list[float]:
    """Best times of several functions run in turn, so all see the same machine load.

    Each call runs right after the previous function's, as in a model: torch's OpenMP threads are
    still spinning after its parallel region, and specdecode's kernels run on that same team
    (``specdecode.get_threading()``). With ``--pause-ms`` each timed call starts after a pause
    instead, the way this bench ran while the kernels had only a pool of their own (which shared
    the cores with those spinning threads); on a VM a call after a pause pays the wake-up of idle
    cores, about 0.5 ms at B = 1, S = 512 here.
    """
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if PAUSE_S:
                time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def best_pair(fn_a, fn_b, reps: int = 12, sync=None) -> tuple[float, float]:
    """Best times of two functions run alternately (see best_alternating)."""
    best_a, best_b = best_alternating([fn_a, fn_b], reps=reps, sync=sync)
    return best_a, best_b


def kv_read(k: torch.Tensor, v: torch.Tensor):
    """A pure read of exactly the op's KV bytes: the same two tensors (two streams, the same
    pages) summed by torch with the same thread count. Not the kernel's exact split of the work
    between threads, but the same memory; its GB/s is a ceiling measured on the same buffers."""
    return lambda: (k.sum(), v.sum())


def machine_figures(device: torch.device, sync) -> tuple[float, dict[torch.dtype, float]]:
    """(read GB/s, matmul GFLOP/s by dtype) measured now. Each dtype's rows are reported against
    its own peak: bf16's is the faster of the bf16 matmul (tensor cores on a GPU, vdpbf16ps on a
    CPU with AVX512_BF16, where the bf16 kernels multiply bf16 pairs too) and the fp32 one (a CPU
    without it, where torch's bf16 matmul and the bf16 kernels widen to fp32)."""
    x = torch.empty(128 * 1024 * 1024, dtype=torch.float32, device=device).uniform_()
    bw = x.numel() * 4 / best_time(x.sum, sync=sync) / 1e9
    n = 4096 if device.type == "cuda" else 2048
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        peaks[dtype] = 2 * n**3 / best_time(lambda a=a, b=b: a @ b, sync=sync) / 1e9
    peaks[torch.bfloat16] = max(peaks[torch.bfloat16], peaks[torch.float32])
    return bw, peaks


def make(batch: int, s: int, t: int, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, t, HQ, D, generator=gen).to(dtype).to(device)
    k = torch.randn(batch, s + t, HKV, D, generator=gen).to(dtype).to(device)
    v = torch.randn(batch, s + t, HKV, D, generator=gen).to(dtype).to(device)
    lens = torch.full((batch,), s, dtype=torch.int32, device=device)
    mask = torch.ones(batch, 1, t, s + t, dtype=torch.bool, device=device)
    mask[..., s:] = torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))
    return q, k, v, lens, mask


def naive(q, k, v, mask):
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, vh).transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="B=1 and T in {1, 64} only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument(
        "--trees",
        type=int,
        nargs="+",
        default=None,
        help="tree sizes T of the main table (default 1 4 16 64; --quick: 1 64), "
        "e.g. --trees 1 2 4 for the memory-bound rows only",
    )
    parser.add_argument(
        "--decode-sweep",
        action="store_true",
        help="only T=1 for B in {1, 2, 4, 8} and S in {4096, 16384}: KV GB/s against the read "
        "bandwidth measured interleaved (S=16384 does not fit any cache)",
    )
    parser.add_argument(
        "--isa",
        default="",
        help="CPU kernels to run: amx, avx512bf16, avx512, avx2 or generic (default: the widest "
        "this CPU has), to measure a narrower instruction set on a wider machine",
    )
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=0.0,
        help="pause before each timed call of the alternating rows (default none: back to back)",
    )
    args = parser.parse_args()
    global PAUSE_S
    PAUSE_S = args.pause_ms / 1e3
    if args.isa and not specdecode._C.set_attention_isa(args.isa):
        parser.error(f"--isa {args.isa}: not available on this CPU or build")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    threads = specdecode.get_num_threads()
    torch.set_num_threads(threads)

    bw, peaks = machine_figures(device, sync)
    probe = torch.empty(64 * 1024 * 1024, dtype=torch.float32, device=device).uniform_()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(
        f"# specdecode {specdecode.__version__}, torch {torch.__version__}, threads {threads} "
        f"({specdecode.get_threading()['backend']}), pause {args.pause_ms:g} ms"
    )
    if device.type == "cpu":
        print(f"# CPU path: {specdecode._C.attention_isa()}")
    else:
        print(f"# GPU: {torch.cuda.get_device_name(device)}")
    print(
        f"# measured read bandwidth {bw:.1f} GB/s, fp32 matmul {peaks[torch.float32]:.0f} GFLOP/s"
        f", bf16 peak {peaks[torch.bfloat16]:.0f} GFLOP/s (the faster of its bf16 and fp32 matmul)"
    )
    print()
    if args.decode_sweep:
        print(
            "| B | S | dtype | ours ms | ours GB/s | read GB/s (interleaved) | % "
            "| KV-read GB/s (interleaved) | % of KV read |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for dtype in (torch.float32, torch.bfloat16):
            for s in (4096, 16384):
                for batch in (1, 2, 4, 8):
                    print(decode_case(batch, s, dtype, device, sync, probe), flush=True)
        return
    print(
        "| B | S | T | dtype | ours ms | sdpa ms | naive ms | vs sdpa | vs naive "
        "| ours GB/s (% of read bw GB/s) | ours GFLOP/s (% matmul) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    batches = [1] if args.quick else [1, 8]
    trees = args.trees or ([1, 64] if args.quick else [1, 4, 16, 64])
    for dtype in (torch.float32, torch.bfloat16):
        for batch in batches:
            for s in (512, 4096):
                for t in trees:
                    row = run_case(batch, s, t, dtype, device, sync, probe, bw, peaks[dtype], args)
                    print(row, flush=True)


def decode_case(batch, s, dtype, device, sync, probe) -> str:
    q, k, v, lens, _ = make(batch, s, 1, dtype, device)
    t_ours, t_sum, t_kv = best_alternating(
        [lambda: ops.tree_attention(q, k, v, lens), probe.sum, kv_read(k, v)], sync=sync
    )
    bw = probe.numel() * 4 / t_sum / 1e9
    kv_bytes = 2 * k.numel() * k.element_size()
    gbs = kv_bytes / t_ours / 1e9
    kv_bw = kv_bytes / t_kv / 1e9
    name = str(dtype).replace("torch.", "")
    return (
        f"| {batch} | {s} | {name} | {t_ours * 1e3:.3f} | {gbs:.1f} | {bw:.1f} | "
        f"{100 * gbs / bw:.0f}% | {kv_bw:.1f} | {100 * gbs / kv_bw:.0f}% |"
    )


def run_case(batch, s, t, dtype, device, sync, probe, bw, peak, args) -> str:
    q, k, v, lens, mask = make(batch, s, t, dtype, device)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def ours():
        return ops.tree_attention(q, k, v, lens)

    def sdpa():
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)

    t_ours = best_time(ours, sync=sync)
    t_sdpa = best_time(sdpa, sync=sync)
    t_naive = float("nan")
    if not args.no_naive:
        t_naive = best_time(lambda: naive(q, k, v, mask), sync=sync)
    kv_bytes = 2 * k.numel() * k.element_size()
    flops = 4 * batch * t * HQ * (s + t) * D
    case_bw = bw
    kv_col = ""
    if t <= 4:
        # The memory-bound rows: both ops timed in the same alternation with the probe (each
        # call after another function's memory traffic), not back to back with themselves.
        t_ours, t_sdpa, t_sum, t_kv = best_alternating(
            [ours, sdpa, probe.sum, kv_read(k, v)], sync=sync
        )
        case_bw = probe.numel() * 4 / t_sum / 1e9
        # At the matmul's rate the op's FLOPs take flops / peak seconds: the KV GB/s that allows.
        bound = kv_bytes / (flops / (peak * 1e9)) / 1e9
        kv_col = f" (KV read {kv_bytes / t_kv / 1e9:.1f}; compute-bound at {bound:.1f})"
    gbs = kv_bytes / t_ours / 1e9
    gfl = flops / t_ours / 1e9
    name = str(dtype).replace("torch.", "")
    return (
        f"| {batch} | {s} | {t} | {name} | {t_ours * 1e3:.3f} | {t_sdpa * 1e3:.3f} | "
        f"{t_naive * 1e3:.3f} | {t_sdpa / t_ours:.2f}x | {t_naive / t_ours:.2f}x | "
        f"{gbs:.1f} ({100 * gbs / case_bw:.0f}% of {case_bw:.1f}){kv_col} | "
        f"{gfl:.1f} ({100 * gfl / peak:.0f}%) |"
    )


if __name__ == "__main__":
    main()
