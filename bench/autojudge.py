"""AutoJudge on the shipped pycode pair: mine mismatches, fit a judge, decode HumanEval prompts.

    python bench/autojudge.py [--train 100] [--max-new 64] [--cache DIR]

1. Mining (:func:`specdecode.judge.mine_important_tokens`) on the first ``--train`` HumanEval
   prompts, with :func:`specdecode.judge.same_python_code` on the decoded completions as the task
   check (a swap is unimportant when the completion stays the same program).
2. A :class:`specdecode.judge.TokenJudge` per ridge penalty, fitted on the mismatches of 80 % of
   those prompts; the penalty with the best held-out AUC is kept, and its threshold calibrated on
   the other 20 % for each ``--recalls`` value (held-out recall of important mismatches). Beside
   it, the same calibration of a judge on one feature, the target's log-probability gap between
   its argmax and the draft token (a training-free rule: what the learned judge adds).
3. Decoding of the remaining HumanEval prompts (never mined) at each batch size: the target
   alone, lossless greedy speculative decoding with the draft model (chains of ``--k``), the
   same with each judge, and with a judge of threshold 0 (it accepts nothing: the overhead of
   the judge's path). Reported: tokens per second and its ratio to the target alone and to
   lossless speculative decoding (medians of ``--repeats`` interleaved runs), tokens per step,
   judge-accepted tokens, and the quality: the fraction of completions that are still the
   target's program (``same_python_code`` against the target's greedy completion) and that are
   identical.

Everything runs offline on the shipped weights; ``--cache DIR`` keeps the mined mismatches.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from specdecode.benchmark import humaneval_prompts
from specdecode.drafters import ModelDrafter, NoDrafter
from specdecode.engine import SpeculativeDecoder
from specdecode.judge import MinedMismatches, TokenJudge, mine_important_tokens, same_python_code

from specdecode import zoo


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--train", type=int, default=100, help="HumanEval prompts mined (the rest: eval)"
    )
    ap.add_argument("--eval", type=int, default=64, help="held-out prompts decoded")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per completion")
    ap.add_argument("--k", type=int, default=4, help="draft chain length")
    ap.add_argument("--recalls", default="0.99,0.95,0.9,0.8", help="held-out recalls of the judges")
    ap.add_argument("--l2", default="0.01,0.1,1,10", help="ridge penalties tried")
    ap.add_argument("--batches", default="1,8", help="batch sizes decoded")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=None, help="directory for the mined mismatches")
    return ap.parse_args()


def auc(scores: torch.Tensor, important: torch.Tensor) -> float:
    pos, neg = scores[important], scores[~important]
    return float((pos[:, None] > neg[None, :]).double().mean())


def mined(args, target, draft, tok, prompts) -> MinedMismatches:
    path = None
    if args.cache is not None:
        args.cache.mkdir(parents=True, exist_ok=True)
        path = args.cache / f"mined_{args.train}_{args.max_new}.pt"
        if path.is_file():
            return torch.load(path, weights_only=False)

    def equivalent(prompt, reference, candidate):
        return same_python_code(tok.decode(reference), tok.decode(candidate))

    t0 = time.perf_counter()
    out = mine_important_tokens(
        target, draft, prompts, equivalent, max_new_tokens=args.max_new, progress=True
    )
    print(f"mining: {out.summary()} in {time.perf_counter() - t0:.1f} s")
    if path is not None:
        torch.save(out, path)
    return out


def gap_only(fit_set: MinedMismatches) -> TokenJudge:
    """A judge on one feature, the target's log-probability gap between its argmax and the draft
    token (a training-free rule: accept the tokens the target nearly chose), as a TokenJudge over
    the full width so that the engine runs it as it runs the others."""
    width = fit_set.features.shape[1]
    column = width - 2  # [h_parent, h_node, log p, gap, entropy]
    one = TokenJudge.fit(fit_set.features[:, [column]], fit_set.important)
    weight, mean, scale = torch.zeros(width), torch.zeros(width), torch.ones(width)
    weight[column], mean[column], scale[column] = one.weight[0], one.mean[0], one.scale[0]
    return TokenJudge(weight, one.bias, mean, scale, one.threshold)


def fit_judges(args, data: MinedMismatches) -> dict[str, TokenJudge]:
    n = len(data.references)
    fit_set, held = data.select(range(int(0.8 * n))), data.select(range(int(0.8 * n), n))
    print(f"fit on {fit_set.summary()}; calibrate on {held.summary()}")
    best = None
    for l2 in (float(v) for v in args.l2.split(",")):
        judge = TokenJudge.fit(fit_set.features, fit_set.important, l2=l2)
        a = auc(judge.importance(held.features), held.important)
        print(f"  l2 {l2:g}: held-out AUC {a:.3f}")
        if best is None or a > best[0]:
            best = (a, l2, judge)
    _, l2, judge = best
    gap = gap_only(fit_set)
    print(f"  gap only: held-out AUC {auc(gap.importance(held.features), held.important):.3f}")
    judges = {}
    for recall in (float(v) for v in args.recalls.split(",")):
        for name, base in ((f"judge r={recall}", judge), (f"gap only r={recall}", gap)):
            scores = base.importance(held.features)
            j = base.with_threshold(
                base.threshold_for_recall(held.features, held.important, recall)
            )
            allowed = scores < j.threshold
            print(
                f"  {name}: threshold {j.threshold:.3f}, held-out: accepts "
                f"{float(allowed[~held.important].double().mean()):.1%} of the unimportant, "
                f"{float(allowed[held.important].double().mean()):.1%} of the important"
            )
            judges[name] = j
    print(f"  (the judge's ridge penalty: l2 {l2:g})")
    return judges


def run(target, drafter, judge, prompts, batch, max_new):
    dec = SpeculativeDecoder(target, drafter, method="greedy", judge=judge, max_nodes=16)
    out, steps, judged, t0 = [], 0, 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        r = dec.generate(prompts[i : i + batch], max_new_tokens=max_new, temperature=0.0)
        out.extend(r.sequences)
        steps += r.stats.row_steps
        judged += r.stats.judge_accepted
    return out, time.perf_counter() - t0, steps, judged


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = zoo.load("pycode")
    texts = humaneval_prompts(args.train + args.eval)
    prompts = [tok.encode(t, bos=True) for t in texts]
    train, evaluation = prompts[: args.train], prompts[args.train :]
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads; {len(train)} mined prompts, {len(evaluation)} eval prompts, "
        f"{args.max_new} new tokens, k = {args.k}"
    )
    judges = fit_judges(args, mined(args, target, draft, tok, train))

    for batch in (int(b) for b in args.batches.split(",")):
        configs = [("target alone", NoDrafter(), None), ("greedy SD", "draft", None)]
        # Threshold 0 accepts nothing: the output of greedy SD, at the cost of the judge's path
        # (the hidden state, the features, the classifier), its overhead.
        off = next(iter(judges.values())).with_threshold(0.0)
        configs += [("judge, threshold 0", "draft", off)]
        configs += [(name, "draft", j) for name, j in judges.items()]
        times = {name: [] for name, _, _ in configs}
        results = {}
        run(target, ModelDrafter(draft, k=args.k, sample=False), None, evaluation[:batch], batch, 8)
        for _ in range(args.repeats):
            for name, drafter, judge in configs:
                d = ModelDrafter(draft, k=args.k, sample=False) if drafter == "draft" else drafter
                out, seconds, steps, judged = run(target, d, judge, evaluation, batch, args.max_new)
                times[name].append(seconds)
                results[name] = (out, steps, judged)
        reference = results["target alone"][0]
        base = statistics.median(times["target alone"])
        sd = statistics.median(times["greedy SD"])
        print(f"\nB = {batch} (median of {args.repeats})")
        print(
            "| decoder | tok/s | vs target | vs greedy SD | tokens/step | judged/token "
            "| same program | identical |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, _, _ in configs:
            out, steps, judged = results[name]
            tokens = sum(len(s) for s in out)
            t = statistics.median(times[name])
            same = sum(
                same_python_code(tok.decode(r), tok.decode(o)) for r, o in zip(reference, out)
            )
            identical = sum(r == o for r, o in zip(reference, out))
            print(
                f"| {name} | {tokens / t:.0f} | {base / t:.2f}x | {sd / t:.2f}x "
                f"| {tokens / steps:.2f} | {judged / tokens:.3f} "
                f"| {same / len(out):.1%} | {identical / len(out):.1%} |"
            )


if __name__ == "__main__":
    main()
