"""Quick end-to-end benchmark of the decoding loop on random Llama-style models (CPU).

Baseline: ``NoDrafter`` (plain autoregressive decoding through the same loop), measured in the
same run. Random models say nothing about real acceptance rates: the "self" drafter (the target
drafting for itself, every draft accepted) bounds what a perfect drafter gains at this model size,
the independent random draft model shows the loop's cost when almost nothing is accepted.

    flock /tmp/specdecode-bench.lock python bench/engine_step.py [--batch 4] [--new 64]
"""

from __future__ import annotations

import argparse
import time

import torch
from specdecode.drafters import CachebackDrafter, ModelDrafter, NoDrafter
from specdecode.models import ModelConfig, Transformer

from specdecode import generate


def model(seed: int, layers: int, hidden: int, vocab: int) -> Transformer:
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
    )
    torch.manual_seed(seed)
    return Transformer(config).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    vocab = 4096
    target = model(1, layers=8, hidden=512, vocab=vocab)
    draft = model(2, layers=1, hidden=256, vocab=vocab)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=g).tolist()] * args.batch
    drafters = {
        "none (baseline)": lambda: NoDrafter(),
        "cacheback": lambda: CachebackDrafter(max_sequences=args.batch),
        "model chain k=4 (random draft)": lambda: ModelDrafter(draft, k=4),
        "model chain k=4 (self)": lambda: ModelDrafter(target, k=4),
        "model tree 16 nodes (self)": lambda: ModelDrafter(
            target, mode="tree", k=4, branch=2, beam=2, max_nodes=16
        ),
    }
    rows = []
    base = None
    for name, make in drafters.items():
        best = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = generate(target, prompts, drafter=make(), max_new_tokens=args.new)
            wall = time.perf_counter() - t0
            if best is None or wall < best[0]:
                best = (wall, out.stats)
        wall, s = best
        base = base or wall
        rows.append((name, wall, s))
    print(f"batch {args.batch}, prompt {args.prompt}, new {args.new}, threads {args.threads}")
    print("| drafter | tokens/step | tokens/s | speedup vs none | draft s | verify s | other s |")
    print("|---|---|---|---|---|---|---|")
    for name, wall, s in rows:
        print(
            f"| {name} | {s.tokens_per_step:.2f} | {s.new_tokens / wall:.1f} | "
            f"{base / wall:.2f}x | {s.draft_time:.3f} | {s.verify_time:.3f} | "
            f"{s.bookkeeping_time + s.prefill_time:.3f} |"
        )


if __name__ == "__main__":
    main()
