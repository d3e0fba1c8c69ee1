"""A Hugging Face target at batch 8 whose rows stop at different times: tokens/s of
``specdecode.generate`` when finished rows leave the target's cache (``HFCache.keep_rows``)
against the same loop with that method hidden (every finished row then stays in each later
pass, as before the method existed), in alternating runs of one process.

The target is a tiny random transformers Llama (no download); stop tokens are picked from its
own greedy output so that the rows end after about 7 to 96 tokens. Every run's outputs are
checked against the full greedy output cut at the stop tokens.

    python bench/hf_finished_rows.py [--threads 1] [--rounds 6] [--new 96]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from specdecode.drafters import CachebackDrafter
from specdecode.models import HFCausalLM
from specdecode.models.hf import HFCache

from specdecode import generate

PROMPT_LENS = (8, 30, 12, 50, 5, 20, 40, 16)
# Where each row should stop (None: it runs to the token budget).
STOP_AT = (6, 14, 24, 34, 46, 60, 76, None)


def tiny_llama(seed: int) -> HFCausalLM:
    """A 4-layer random Llama whose greedy outputs vary (scaled weights, non-unit norms)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if "norm" in name else 0.08
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    return HFCausalLM(model.eval())


def drafter() -> CachebackDrafter:
    return CachebackDrafter(max_nodes=12, max_depth=5, max_sequences=16)


def cut_lengths(full: list[list[int]], stop: set[int]) -> list[int]:
    return [next((i + 1 for i, t in enumerate(row) if t in stop), len(row)) for row in full]


def pick_stop_tokens(full: list[list[int]], new: int) -> set[int]:
    """Tokens that end row b near STOP_AT[b] without cutting another row before 6 tokens."""
    stop: set[int] = set()
    for b, pos in enumerate(STOP_AT):
        if pos is None or pos >= new:
            continue
        for p in range(pos, new):
            trial = stop | {full[b][p]}
            cuts = cut_lengths(full, trial)
            if cuts[b] == p + 1 and min(cuts) >= min(pos, 6):
                stop = trial
                break
    return stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new", type=int, default=96, help="max new tokens per row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = tiny_llama(0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    full = generate(target, prompts, drafter=drafter(), max_new_tokens=args.new).sequences
    stop = pick_stop_tokens(full, args.new)
    cuts = cut_lengths(full, stop)
    print(f"# rows stop after {cuts} tokens; torch threads {torch.get_num_threads()}")

    keep_rows = HFCache.keep_rows

    def run(drop_finished: bool) -> tuple[float, int]:
        if not drop_finished:
            del HFCache.keep_rows  # the engine then keeps finished rows in the batch
        try:
            t0 = time.perf_counter()
            out = generate(
                target, prompts, drafter=drafter(), max_new_tokens=args.new, stop_token_ids=stop
            )
            seconds = time.perf_counter() - t0
        finally:
            HFCache.keep_rows = keep_rows
        assert [len(s) for s in out.sequences] == cuts
        assert all(s == f[: len(s)] for s, f in zip(out.sequences, full))
        return sum(cuts) / seconds, out.stats.steps

    run(True), run(False)  # first-call costs
    tps: dict[str, list[float]] = {"kept": [], "dropped": []}
    for r in range(args.rounds):
        order = ("kept", "dropped") if r % 2 == 0 else ("dropped", "kept")
        for arm in order:
            rate, steps = run(arm == "dropped")
            tps[arm].append(rate)
        print(
            f"round {r}: finished rows kept {tps['kept'][-1]:7.1f} tok/s, dropped "
            f"{tps['dropped'][-1]:7.1f} tok/s ({steps} steps)",
            flush=True,
        )
    for arm, xs in tps.items():
        low, high = min(xs), max(xs)
        print(f"{arm}: median {statistics.median(xs):.1f} tok/s (min {low:.1f}, max {high:.1f})")
    ratios = [d / k for d, k in zip(tps["dropped"], tps["kept"])]
    print(
        "dropped / kept per round: "
        + " ".join(f"{x:.2f}" for x in ratios)
        + f" (median {statistics.median(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
