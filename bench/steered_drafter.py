"""SD² steering on the shipped pycode pair: the draft model with and without the target's steering.

    python bench/steered_drafter.py [--steering FILE] [--prompts 64] [--max-new 64]
        [--batch 1 16] [--k 4 8] [--repeats 3]

Decodes HumanEval prompts (never part of the pair's or the map's training text: out of
distribution for both) with the draft model's chains (:class:`specdecode.drafters.ModelDrafter`),
once plain and once steered by the map (default: the pair's shipped one, ``zoo.load_steering``),
greedy and sampled (temperature 1, the same seeds for both), at each batch size and draft depth.
Reported per setting: tokens per step and acceptance rate of both, tokens per second of both
(medians of ``--repeats`` interleaved runs) and their ratio, and, greedy, whether the outputs are
identical (they must be: steering moves acceptance only). Also the map's held-out divergence on
the pair's held-out corpus split (KL(target || draft) and greedy agreement, unsteered and steered).

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
from specdecode.steering import DraftSteering, steering_divergence
from specdecode.zoo.corpus import Corpus

from specdecode import zoo


def held_out_windows(tokenizer, seq: int, count: int) -> torch.Tensor:
    ids: list[int] = []
    for text in Corpus.collect().texts(heldout=True):
        ids.extend(tokenizer.encode(text, bos=True, eos=True))
        if len(ids) >= seq * count:
            break
    n = min(len(ids) // seq, count)
    return torch.tensor(ids[: n * seq]).view(n, seq)


def run(target, draft, steering, prompts, batch, k, temperature, max_new):
    """One pass over ``prompts`` in batches of ``batch``: (seconds, stats sums, sequences)."""
    new = steps = accepted = offered = 0
    sequences = []
    seconds = 0.0
    for i in range(0, len(prompts), batch):
        drafter = ModelDrafter(draft, k=k, steering=steering)
        decoder = SpeculativeDecoder(target, drafter)
        t0 = time.perf_counter()
        out = decoder.generate(
            prompts[i : i + batch], max_new_tokens=max_new, temperature=temperature, seed=1234 + i
        )
        seconds += time.perf_counter() - t0
        s = out.stats
        new, steps = new + s.new_tokens, steps + s.row_steps
        accepted, offered = accepted + s.accepted_tokens, offered + s.offered_depth
        sequences += out.sequences
    return seconds, (new, steps, accepted, offered), sequences


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steering", default=None, help="a saved map (default: the shipped one)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--k", type=int, nargs="+", default=[4, 8])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = zoo.load("pycode")
    steering = (
        zoo.load_steering("pycode") if args.steering is None else DraftSteering.load(args.steering)
    )
    texts = humaneval_prompts(164)[-args.prompts :]
    prompts = [tok.encode(t, bos=True) for t in texts]
    print(
        f"# steered_drafter: {len(prompts)} HumanEval prompts (the last ones), {args.max_new} new "
        f"tokens, chains; {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, {args.threads} thread(s), {time.strftime('%Y-%m-%d %H:%M')}"
    )
    windows = held_out_windows(tok, 256, 48)
    for k in sorted(set(args.k)):
        kl0, a0 = steering_divergence(target, draft, None, windows, k=k)
        kl1, a1 = steering_divergence(target, draft, steering, windows, k=k)
        print(
            f"held-out corpus, rounds of k={k}: KL {kl0:.4f} -> {kl1:.4f} nats, greedy "
            f"agreement {a0:.4f} -> {a1:.4f}"
        )
    run(target, draft, steering, prompts[:2], 2, 4, 0.0, 8)  # warm-up
    print(
        "| batch | k | temperature | tokens/step plain | steered | acceptance plain | steered "
        "| tok/s plain | steered | speed ratio | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        for k in args.k:
            for temperature in args.temperatures:
                times = {"plain": [], "steered": []}
                sums, outs = {}, {}
                for _ in range(args.repeats):
                    for name, s in (("plain", None), ("steered", steering)):
                        sec, st, seqs = run(
                            target, draft, s, prompts, batch, k, temperature, args.max_new
                        )
                        times[name].append(sec)
                        sums[name], outs[name] = st, seqs
                tps = {n: sums[n][0] / statistics.median(times[n]) for n in times}
                per_step = {n: sums[n][0] / sums[n][1] for n in sums}
                acc = {n: sums[n][2] / max(sums[n][3], 1) for n in sums}
                same = "yes" if outs["plain"] == outs["steered"] else "no"
                if temperature > 0:
                    same = "n/a (sampled)"
                print(
                    f"| {batch} | {k} | {temperature:g} | {per_step['plain']:.3f} | "
                    f"{per_step['steered']:.3f} | {acc['plain']:.3f} | {acc['steered']:.3f} | "
                    f"{tps['plain']:.1f} | {tps['steered']:.1f} | "
                    f"{tps['steered'] / tps['plain']:.3f} | {same} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
