"""Autoregressive tokens/s of the bundled target with PyTorch attention vs ops.tree_attention.

    flock /tmp/specdecode-bench.lock python bench/e2e_attention_ab.py [--repeats 3]

Same workload as the autoregressive rows of ``specdecode bench`` (the first 8 HumanEval prompts,
cut to their last 192 tokens, 128 greedy new tokens, ``NoDrafter``, torch on 1 thread), at batch 1
and 8, once with ``target.attention = "torch"`` (dense masked SDPA, the baseline) and once with
``"auto"`` (the kernel where it applies), in the same process. Passes alternate between the two
settings so that a change in machine load hits both; each setting gets a warm-up pass and then
``--repeats`` timed passes, of which the median is reported. Also checks that both settings
generate the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from specdecode.drafters import NoDrafter
from specdecode.engine import SpeculativeDecoder

from specdecode import benchmark


def one_pass(target, prompts: list[list[int]], batch: int, new: int) -> tuple[float, list]:
    """Seconds and generated sequences of one pass over all prompts in chunks of ``batch``."""
    outputs: list = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        out = SpeculativeDecoder(target, NoDrafter()).generate(
            prompts[i : i + batch], max_new_tokens=new, temperature=0.0
        )
        outputs.extend(out.sequences)
    return time.perf_counter() - t0, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--hf", action="store_true", help="also transformers' b1 rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = benchmark.BenchConfig(datasets=("humaneval",), hf=args.hf)
    models = benchmark.load_models(config, hf=args.hf)
    target = models.ours_target
    keep = min(config.max_prompt_tokens, int(target.max_length) - args.max_new_tokens)
    texts = benchmark.humaneval_prompts(args.num_prompts)
    prompts = [models.tokenizer.encode(t)[-keep:] for t in texts]
    print(f"prompt tokens: {[len(p) for p in prompts]}")
    hf_best, hf_ref = 0.0, None
    if args.hf:
        for method in ("autoregressive", "prompt lookup"):
            speeds, (_, outs, _, _) = benchmark._median_runs(
                lambda m=method: benchmark._run_hf(
                    models, m, prompts, 0.0, args.max_new_tokens, config.seed
                ),
                args.repeats,
            )
            hf_ref = hf_ref or outs
            med = statistics.median(speeds)
            hf_best = max(hf_best, med)
            runs = [round(x, 1) for x in speeds]
            print(f"transformers {method} b1: {med:.1f} tok/s; passes {runs}")
    modes = ("torch", "auto")
    for batch in [int(b) for b in args.batches.split(",")]:
        speeds: dict[str, list[float]] = {m: [] for m in modes}
        outputs: dict[str, list] = {}
        for rep in range(args.repeats + 1):  # pass 0 of each mode is the warm-up
            for mode in modes:
                target.attention = mode
                seconds, out = one_pass(target, prompts, batch, args.max_new_tokens)
                if rep == 0:
                    outputs[mode] = out
                else:
                    speeds[mode].append(len(prompts) * args.max_new_tokens / seconds)
        same = sum(a == b for a, b in zip(outputs["torch"], outputs["auto"]))
        same_hf = benchmark.count_identical(outputs["auto"], hf_ref) if hf_ref else None
        med = {m: statistics.median(speeds[m]) for m in modes}
        runs = ", ".join(f"{m}: {[round(s, 1) for s in speeds[m]]}" for m in modes)
        print(
            f"batch {batch}: torch {med['torch']:.1f} tok/s, auto (kernel) {med['auto']:.1f} "
            f"tok/s, ratio {med['auto'] / med['torch']:.2f}x; identical {same}/{len(prompts)}; "
            f"passes {runs}"
        )
        if hf_best:
            print(
                f"batch {batch}: over transformers' best b1 ({hf_best:.1f} tok/s): torch "
                f"{med['torch'] / hf_best:.2f}x, auto {med['auto'] / hf_best:.2f}x; auto output = "
                f"transformers AR on {same_hf}/{len(prompts)}"
            )


if __name__ == "__main__":
    main()
