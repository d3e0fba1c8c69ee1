"""Block verification (``method="block"``) against token-by-token verification (``"exact"``).

    python bench/block_verify.py [--prompts 64] [--max-new 64] [--batch 1 8] [--k 3 5 8]
        [--temperatures 1.0 0.7] [--repeats 2] [--op-vocab 32000 128256] [--op-batch 1 16]
        [--noise 0.6] [--skip-generation] [--skip-op]

Two tables, both methods in the same run:

1. Sampled decoding of HumanEval prompts (out of the pair's training text) with the shipped
   pycode pair and the draft model's sampled chains (:class:`specdecode.drafters.ModelDrafter`,
   depth k), once per method with the same seeds, the methods alternating within each repeat.
   Reported: tokens per step and drafts kept per step of each, tokens per second (median of the
   repeats) and the ratio block / exact. Both are lossless, so the tokens differ only as two
   draws of the same law do.
2. The op alone: ``ops.verify`` on chains of k drafts sampled from a draft distribution near
   the target's (draft logits = target logits + Gaussian noise), B sequences, vocabulary V; time
   per call (median of 20) and drafts kept per sequence for each method. Block verification
   reads every row of the chain up to its first p_j = 0 and takes one more pass per row (the
   residual mass r_j), where token-by-token verification stops at its first rejection.

Everything runs offline on the shipped weights.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from specdecode.benchmark import humaneval_prompts
from specdecode.drafters import ModelDrafter
from specdecode.engine import SpeculativeDecoder

from specdecode import ops, zoo

METHODS = ("exact", "block")


def decode(target, draft, prompts, batch, k, temperature, max_new, method):
    """One pass over ``prompts`` in batches of ``batch``: (seconds, new tokens, row steps,
    accepted drafts)."""
    seconds = 0.0
    new = steps = accepted = 0
    for i in range(0, len(prompts), batch):
        decoder = SpeculativeDecoder(target, ModelDrafter(draft, k=k), method=method)
        t0 = time.perf_counter()
        out = decoder.generate(
            prompts[i : i + batch], max_new_tokens=max_new, temperature=temperature, seed=777 + i
        )
        seconds += time.perf_counter() - t0
        s = out.stats
        new, steps, accepted = new + s.new_tokens, steps + s.row_steps, accepted + s.accepted_tokens
    return seconds, new, steps, accepted


def generation_table(args) -> None:
    target, draft, tok = zoo.load("pycode")
    texts = humaneval_prompts(164)[-args.prompts :]
    prompts = [tok.encode(t, bos=True) for t in texts]
    print(
        f"\n## sampled decoding: {len(prompts)} HumanEval prompts (the last ones), "
        f"{args.max_new} new tokens, pycode pair, draft-model chains"
    )
    decode(target, draft, prompts[:2], 2, 3, 1.0, 8, "block")  # warm-up
    print(
        "| batch | k | temperature | tokens/step exact | block | kept/step exact | block "
        "| tok/s exact | block | speed block/exact |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        for k in args.k:
            for temperature in args.temperatures:
                times = {m: [] for m in METHODS}
                sums = {}
                for r in range(args.repeats):
                    order = METHODS if r % 2 == 0 else METHODS[::-1]
                    for method in order:
                        sec, new, steps, acc = decode(
                            target, draft, prompts, batch, k, temperature, args.max_new, method
                        )
                        times[method].append(sec)
                        sums[method] = (new, steps, acc)
                tps = {m: sums[m][0] / statistics.median(times[m]) for m in METHODS}
                per_step = {m: sums[m][0] / sums[m][1] for m in METHODS}
                kept = {m: sums[m][2] / sums[m][1] for m in METHODS}
                print(
                    f"| {batch} | {k} | {temperature:g} | {per_step['exact']:.3f} | "
                    f"{per_step['block']:.3f} | {kept['exact']:.3f} | {kept['block']:.3f} | "
                    f"{tps['exact']:.1f} | {tps['block']:.1f} | "
                    f"{tps['block'] / tps['exact']:.3f} |",
                    flush=True,
                )


def chains(batch: int, k: int, vocab: int, noise: float, gen: torch.Generator):
    """(target logits [B, k+1, V], draft probabilities [B, k+1, V], tokens [B, k+1]): drafts
    sampled from the draft rows, which are the target's logits plus Gaussian noise."""
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 3
    q = torch.softmax(logits + noise * torch.randn(batch, k + 1, vocab, generator=gen), -1)
    tokens = torch.zeros(batch, k + 1, dtype=torch.int64)
    tokens[:, 1:] = torch.multinomial(q[:, :k].reshape(-1, vocab), 1, generator=gen).view(batch, k)
    return logits, q, tokens


def op_table(args) -> None:
    print(
        f"\n## ops.verify alone: chains of k drafts from draft rows = target logits + N(0, "
        f"{args.noise:g}) noise, temperature 1, median of {args.calls} calls"
    )
    print("| B | k | V | exact us | block us | block/exact time | kept exact | kept block |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(5)
    for vocab in args.op_vocab:
        for batch in args.op_batch:
            for k in args.k:
                logits, q, tokens = chains(batch, k, vocab, args.noise, gen)
                us, kept = {}, {}
                for method in METHODS:
                    times, acc = [], []
                    for call in range(args.calls + 2):
                        seed = torch.arange(batch, dtype=torch.int64) + 1000 * call
                        t0 = time.perf_counter()
                        res = ops.verify(
                            logits, tokens, draft_probs=q, seed=seed, offset=0, method=method
                        )
                        if call >= 2:
                            times.append(time.perf_counter() - t0)
                            acc.append(float(res.num_accepted.double().mean()))
                    us[method] = statistics.median(times) * 1e6
                    kept[method] = statistics.fmean(acc)
                print(
                    f"| {batch} | {k} | {vocab} | {us['exact']:.0f} | {us['block']:.0f} | "
                    f"{us['block'] / us['exact']:.2f} | {kept['exact']:.3f} | "
                    f"{kept['block']:.3f} |",
                    flush=True,
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, nargs="+", default=[3, 5, 8])
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--op-vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--op-batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--noise", type=float, default=0.6)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-generation", action="store_true")
    p.add_argument("--skip-op", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"# block_verify: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} torch thread(s), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    if not args.skip_op:
        op_table(args)
    if not args.skip_generation:
        generation_table(args)


if __name__ == "__main__":
    main()
