"""The draft model's sampling distribution: ops.sampling_probs against the former torch.sort path.

``ModelDrafter`` turns its logits into the distribution it samples each draft token from once
per depth (temperature, top-k, top-p). It now calls ``ops.sampling_probs``, the native
processing verify applies to target rows (thresholds searched, no sort). This script times it
against the drafter's former processing, kept below as ``sort_sampling_probs`` (two full
``torch.sort`` calls per row batch, whatever the parameters), in the same run:

1. the processing alone, B rows of V logits, for temperature only, top-p 0.95 and top-k 50
   (torch's and specdecode's threads as given by ``--threads``);
2. sampled generation with the zoo pair's draft model (chain, k = 3), batch 4, the demo's
   prompts, once with each processing (the former one patched into the drafter), arms
   alternating per seed.

    python bench/draft_sampling.py [--vocab 8192 32000 128256] [--rows 1 4 16] [--seeds 3]
        [--threads 1] [--device cpu|cuda] [--skip-generation]

With ``--device cuda`` the processing table runs on the GPU (both arms there, each call
synchronised); the generation table always runs the zoo pair on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from specdecode.cli import DEMO_PROMPTS, load_model
from specdecode.drafters import ModelDrafter

from specdecode import drafters, generate, ops


def sort_sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The former processing (the baseline): top-k and top-p from full descending sorts."""
    x = logits.float()
    rows, vocab = x.shape
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    x = x / safe_t.unsqueeze(1)
    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    kth = torch.sort(x, dim=1, descending=True).values.gather(1, (k.long() - 1).unsqueeze(1))
    x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=1)
    ordered, order = torch.sort(probs, dim=1, descending=True)
    before = torch.cumsum(ordered, dim=1) - ordered
    drop_sorted = before >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter(1, logits.float().argmax(dim=1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), onehot, probs)


def native_sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The drafter's processing now (the measured arm)."""
    return ops.sampling_probs(logits, temperature, top_k, top_p).probs


class FormerOps:
    """``specdecode.ops`` with the former processing as ``sampling_probs``, patched into the
    drafter module for the baseline arm."""

    def __getattr__(self, name: str):
        return getattr(ops, name)

    @staticmethod
    def sampling_probs(logits, temperature, top_k, top_p) -> ops.SamplingProbs:
        probs = sort_sampling_probs(logits, temperature, top_k.long(), top_p)
        return ops.SamplingProbs(probs, torch.zeros(probs.shape[0], dtype=torch.int32))


SETTINGS = {
    "temperature 0.8": dict(temperature=0.8, top_k=0, top_p=1.0),
    "T 0.8, top-p 0.95": dict(temperature=0.8, top_k=0, top_p=0.95),
    "T 0.8, top-k 50": dict(temperature=0.8, top_k=50, top_p=1.0),
}


def best_ms(fn: Callable[..., object], args: tuple, repeats: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn(*args)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def processing_table(
    vocabs: list[int], row_counts: list[int], repeats: int, device: torch.device
) -> None:
    print(f"\n## the processing alone on {device} (min ms of {repeats} calls)\n")
    print("| V | B | setting | torch.sort (former) | ops.sampling_probs | speedup |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for vocab in vocabs:
        for rows in row_counts:
            # Logits of a peaked distribution (a few likely tokens over a long flat tail).
            logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(device)
            for name, s in SETTINGS.items():
                args = (
                    logits,
                    torch.full((rows,), s["temperature"], device=device),
                    torch.full((rows,), s["top_k"], dtype=torch.int64, device=device),
                    torch.full((rows,), s["top_p"], device=device),
                )
                old = best_ms(sort_sampling_probs, args, repeats, device)
                new = best_ms(native_sampling_probs, args, repeats, device)
                print(f"| {vocab} | {rows} | {name} | {old:.3f} | {new:.3f} | {old / new:.1f}x |")


def generation_table(seeds: int, new_tokens: int) -> None:
    loaded = load_model("pycode")
    target, draft, codec = loaded.target, loaded.draft, loaded.codec
    prompts = [codec.encode(t) for t in DEMO_PROMPTS[:4]]
    batch = len(prompts)
    print(
        f"\n## sampled generation: zoo pair 'pycode' (V = {target.vocab_size}), draft model "
        f"chain k = 3, batch {batch}, {new_tokens} new tokens, seeds 0..{seeds - 1}\n"
    )
    print("| setting | tokens/s, torch.sort (former) | tokens/s, new | ratio |")
    print("|---|---|---|---|")
    for name, s in SETTINGS.items():
        rates: dict[str, list[float]] = {"former": [], "new": []}
        for seed in range(seeds):
            for arm, module_ops in (("former", FormerOps()), ("new", ops)):
                drafters.ops = module_ops
                try:
                    t0 = time.perf_counter()
                    out = generate(
                        target,
                        prompts,
                        drafter=ModelDrafter(draft, mode="chain", k=3),
                        max_new_tokens=new_tokens,
                        seed=[seed * batch + b for b in range(batch)],
                        **s,
                    )
                    rates[arm].append(out.stats.new_tokens / (time.perf_counter() - t0))
                finally:
                    drafters.ops = ops
        old, new = statistics.median(rates["former"]), statistics.median(rates["new"])
        print(f"| {name} | {old:.1f} | {new:.1f} | {new / old:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 32000, 128256])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-generation", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# torch {torch.__version__}, {args.threads} CPU thread(s), {name}")
    processing_table(args.vocab, args.rows, args.repeats, device)
    if not args.skip_generation:
        generation_table(args.seeds, args.new)


if __name__ == "__main__":
    main()
