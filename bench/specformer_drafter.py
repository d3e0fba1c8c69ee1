"""SpecFormer on the shipped pycode pair: its draft heads against the draft model and no drafter.

    python bench/specformer_drafter.py [--head FILE ...] [--prompts 64] [--max-new 64]
        [--batch 1 16] [--temperatures 0 1] [--repeats 3]

Decodes HumanEval prompts (never part of the pair's or the head's training text) with, per batch
size and temperature: no drafter (autoregressive, the baseline), the pair's draft model (chains of
k=4, :class:`specdecode.drafters.ModelDrafter`), and each SpecFormer head (default: the pair's
shipped ones, ``zoo.load_specformer``: the paper's and the root-aware one) drafting chains of its k
slots in one step, and its tree (the 7 best paths through its slots' top 3 tokens). Reported per
drafter: tokens per step, tokens per second (median of ``--repeats`` interleaved runs), the speed
ratio against autoregressive decoding measured in the same run, the share of wall time spent
drafting, and, greedy, whether the output is identical to the autoregressive one (it must be: every
drafter here is lossless). Also each head's held-out divergence and greedy agreement per slot on the
pair's held-out corpus split.

Everything runs offline on the shipped weights.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from specdecode.benchmark import humaneval_prompts
from specdecode.drafters import ModelDrafter, NoDrafter
from specdecode.engine import SpeculativeDecoder
from specdecode.specformer import SpecFormerDrafter, SpecFormerHead, specformer_agreement
from steered_drafter import held_out_windows  # bench/ is the script's directory

from specdecode import zoo


def run(target, make, prompts, batch, temperature, max_new):
    """One pass over ``prompts`` in batches of ``batch``: (seconds, sums, sequences)."""
    new = steps = 0
    draft_time = 0.0
    sequences = []
    seconds = 0.0
    for i in range(0, len(prompts), batch):
        decoder = SpeculativeDecoder(target, make())
        t0 = time.perf_counter()
        out = decoder.generate(
            prompts[i : i + batch], max_new_tokens=max_new, temperature=temperature, seed=1234 + i
        )
        seconds += time.perf_counter() - t0
        new, steps = new + out.stats.new_tokens, steps + out.stats.row_steps
        draft_time += out.stats.draft_time
        sequences += out.sequences
    return seconds, (new, steps, draft_time), sequences


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--head", action="append", default=None, help="a saved head (default: the shipped ones)"
    )
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = zoo.load("pycode")
    if args.head is None:
        heads = [zoo.load_specformer("pycode", root_aware=r) for r in (False, True)]
    else:
        heads = [SpecFormerHead.load(f) for f in args.head]
    texts = humaneval_prompts(164)[-args.prompts :]
    prompts = [tok.encode(t, bos=True) for t in texts]
    print(
        f"# specformer_drafter: {len(prompts)} HumanEval prompts (the last ones), {args.max_new} "
        f"new tokens; {len(heads)} head(s); "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} thread(s), {time.strftime('%Y-%m-%d %H:%M')}"
    )
    windows = held_out_windows(tok, 256, 48)
    drafters = {
        "autoregressive": lambda: NoDrafter(),
        "draft model (chain, k=4)": lambda: ModelDrafter(draft, k=4),
    }
    for head in heads:
        kind = "root-aware" if head.root_aware else "paper's"
        r = specformer_agreement(target, head, windows)
        print(
            f"{kind} head (k={head.k}, layers {head.target_layers}), held-out corpus: "
            f"KL(target || slot) {r['kl']:.4f} nats, greedy agreement {r['agreement']:.4f}; "
            "by slot: "
            + ", ".join(f"{a:.4f}" for a in r["agreement_by_slot"])
            + " (KL "
            + ", ".join(f"{x:.3f}" for x in r["kl_by_slot"])
            + ")"
        )
        drafters[f"SpecFormer {kind} (chain, k={head.k})"] = lambda head=head: SpecFormerDrafter(
            head, target
        )
        drafters[f"SpecFormer {kind} (tree, 8 nodes)"] = lambda head=head: SpecFormerDrafter(
            head, target, mode="tree", branch=3, max_nodes=8
        )
    for make in drafters.values():  # warm-up
        run(target, make, prompts[:2], 2, 0.0, 8)
    print(
        "| batch | temperature | drafter | tokens/step | tok/s | vs autoregressive "
        "| drafting share | identical |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        for temperature in args.temperatures:
            times = {name: [] for name in drafters}
            sums, outs = {}, {}
            for _ in range(args.repeats):
                for name, make in drafters.items():
                    sec, st, seqs = run(target, make, prompts, batch, temperature, args.max_new)
                    times[name].append(sec)
                    sums[name], outs[name] = st, seqs
            tps = {n: sums[n][0] / statistics.median(times[n]) for n in drafters}
            for name in drafters:
                same = "yes" if outs[name] == outs["autoregressive"] else "NO"
                if temperature > 0:
                    same = "n/a (sampled)"
                share = sums[name][2] / statistics.median(times[name])
                print(
                    f"| {batch} | {temperature:g} | {name} | {sums[name][0] / sums[name][1]:.3f} "
                    f"| {tps[name]:.1f} | {tps[name] / tps['autoregressive']:.3f}x "
                    f"| {share:.1%} | {same} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
