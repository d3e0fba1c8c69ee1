"""Our kernels right after a torch op: specdecode's own thread pool against torch's OpenMP team.

In a model our kernels run right after one of torch's parallel ops (the projections before
attention, the LM head before verification), and torch's OpenMP threads keep spinning for a while
after each of its parallel regions. This measures what that costs on each of the two backends of
``specdecode.set_threading``:

* ``pool``   -- specdecode's own thread pool (helpers sleep between calls);
* ``openmp`` -- the team of the OpenMP runtime torch loaded (the default, ``"auto"``).

Kernel rows: each call is timed alone, right after one of two preceding steps, in the same
process, the backends alternating every round:

* ``after matmul`` -- ``torch.mm`` of [64, 2048] x [2048, 2048] fp32 (torch's threads then spin);
* ``after copy``   -- a single-threaded numpy copy of 32 MiB (no torch threads; it evicts the
  caches about as much).

Cases: ``tree_attention`` decoding (B in {1, 8}, S = 4096, T in {1, 4}, Hq=32, Hkv=8, D=128, fp32
and bf16) and ``verify`` on issue 4's goal row (chain k=4, B=64, V=128256, fp32 logits) and at
B=1. The table gives the median per-call time of each backend and pool / openmp.

``--e2e``: the bundled target generating greedily (8 HumanEval prompts, batch 8, attention
"auto", torch on all its threads) with no drafter and with the Cacheback drafter, passes
alternating between the backends; tokens/s (median of the passes) and whether the outputs match.

    flock /tmp/specdecode-bench.lock python bench/bench_threading.py [--rounds 5] [--e2e]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch

import specdecode
from specdecode import ops

BACKENDS = ("pool", "openmp")


def attention_case(b: int, s: int, t: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(b * 7 + t)
    q = torch.randn(b, t, 32, 128, generator=gen).to(dtype)
    k = torch.randn(b, s, 8, 128, generator=gen).to(dtype)
    v = torch.randn(b, s, 8, 128, generator=gen).to(dtype)
    lens = torch.full((b,), s - t, dtype=torch.int32)
    return lambda: ops.tree_attention(q, k, v, lens)


def verify_case(b: int, k: int, v: int):
    gen = torch.Generator().manual_seed(b + k)
    logits = torch.randn(b, k + 1, v, generator=gen) * 3
    q = torch.softmax(torch.randn(b, k + 1, v, generator=gen) * 3, -1)
    tokens = torch.randint(0, v, (b, k + 1), generator=gen)
    seed = torch.arange(b)
    return lambda: ops.verify(logits, tokens, draft_probs=q, seed=seed, offset=1)


def kernel_rows(rounds: int, calls: int) -> list[str]:
    a, w = torch.randn(64, 2048), torch.randn(2048, 2048)
    src, dst = np.ones(8 << 20, np.float32), np.zeros(8 << 20, np.float32)
    befores = {"after matmul": lambda: torch.mm(a, w), "after copy": lambda: np.copyto(dst, src)}
    cases = {}
    for b in (1, 8):
        for t in (1, 4):
            for dtype in (torch.float32, torch.bfloat16):
                name = f"tree_attention B={b} S=4096 T={t} {str(dtype)[6:]}"
                cases[name] = attention_case(b, 4096, t, dtype)
    cases["verify B=64 k=4 V=128256 logits"] = verify_case(64, 4, 128256)
    cases["verify B=1 k=4 V=128256 logits"] = verify_case(1, 4, 128256)
    lines = [
        "| case | before | pool ms | openmp ms | pool / openmp |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name, op in cases.items():
        for before_name, before in befores.items():
            times: dict[str, list[float]] = {m: [] for m in BACKENDS}
            for _ in range(rounds):
                for mode in BACKENDS:
                    specdecode.set_threading(mode)
                    op()
                    for _ in range(calls):
                        before()
                        t0 = time.perf_counter()
                        op()
                        times[mode].append(time.perf_counter() - t0)
            med = {m: statistics.median(times[m]) * 1e3 for m in BACKENDS}
            line = (
                f"| {name} | {before_name} | {med['pool']:.3f} | {med['openmp']:.3f} | "
                f"{med['pool'] / med['openmp']:.2f}x |"
            )
            print(line, flush=True)
            lines.append(line)
    specdecode.set_threading("auto")
    return lines


def e2e_rows(passes: int, new_tokens: int) -> list[str]:
    from specdecode.drafters import CachebackDrafter, NoDrafter
    from specdecode.engine import CostAwareBudget, SpeculativeDecoder

    from specdecode import benchmark

    config = benchmark.BenchConfig(datasets=("humaneval",), hf=False)
    models = benchmark.load_models(config, hf=False)
    target = models.ours_target
    target.attention = "auto"
    keep = min(config.max_prompt_tokens, int(target.max_length) - new_tokens)
    prompts = [models.tokenizer.encode(p)[-keep:] for p in benchmark.humaneval_prompts(8)]

    def one_pass(method: str) -> tuple[float, list]:
        if method == "cacheback":
            drafter = CachebackDrafter(max_sequences=8, chain=True, max_nodes=17, max_depth=16)
            decoder = SpeculativeDecoder(target, drafter, budget=CostAwareBudget())
        else:
            decoder = SpeculativeDecoder(target, NoDrafter())
        t0 = time.perf_counter()
        out = decoder.generate(prompts, max_new_tokens=new_tokens, temperature=0.0)
        return time.perf_counter() - t0, out.sequences

    lines = [
        f"torch threads {torch.get_num_threads()}, batch 8, {new_tokens} new tokens, greedy",
        "",
        "| drafter | pool tok/s | openmp tok/s | openmp / pool | same outputs |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for method in ("none", "cacheback"):
        speeds: dict[str, list[float]] = {m: [] for m in BACKENDS}
        outputs: dict[str, list] = {}
        for rep in range(passes + 1):  # pass 0 of each backend is the warm-up
            for mode in BACKENDS:
                specdecode.set_threading(mode)
                seconds, out = one_pass(method)
                outputs.setdefault(mode, out)
                if rep:
                    speeds[mode].append(len(prompts) * new_tokens / seconds)
        med = {m: statistics.median(speeds[m]) for m in BACKENDS}
        same = outputs["pool"] == outputs["openmp"]
        line = (
            f"| {method} | {med['pool']:.1f} | {med['openmp']:.1f} | "
            f"{med['openmp'] / med['pool']:.2f}x | {same} |"
        )
        print(line, flush=True)
        lines.append(line)
    specdecode.set_threading("auto")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each kernel row")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per round and backend")
    parser.add_argument("--e2e", action="store_true", help="also the end-to-end generation rows")
    parser.add_argument("--passes", type=int, default=3, help="timed passes per e2e backend")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    specdecode.set_threading("openmp")  # fails here, not in the middle, without torch's OpenMP
    print(
        f"# bench_threading: {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"specdecode {specdecode.__version__}, {specdecode.get_threading()['runtime']}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        flush=True,
    )
    kernel_rows(args.rounds, args.calls)
    if args.e2e:
        print()
        e2e_rows(args.passes, args.new_tokens)


if __name__ == "__main__":
    main()
