"""Replay-oracle benchmark of Cacheback n-gram drafting against prompt-lookup baselines.

The true continuation of real text plays the target: every step each method drafts, the longest
draft path that matches the true next tokens is accepted plus one bonus token (what a greedy
target would emit), and the drafter is updated with the committed tokens. Reported per method:
tokens per step (accepted + 1) and microseconds per sequence per step (draft + update).

Text no one here wrote: the Python standard library's own sources (code) and license texts,
READMEs and package descriptions shipped in the system's site-packages and /usr/share
(prose), tokenized with a sentencepiece model trained here on that text.

Methods:
  cacheback        specdecode.ops.NGramCache, batched native draft + update (tree and chain)
  hf-pld           Hugging Face transformers' PromptLookupCandidateGenerator (one sequence a call)
  numpy-suffix     our own numpy longest-suffix-match proposer, the method vLLM's n-gram proposer
                   uses (not vLLM's code)
  python-ref       our pure-Python OrderedDict reference of the Cacheback cache (tests/)

Usage: python bench/ngram_replay.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import platform
import sys
import sysconfig
import time

import numpy as np
import torch
from specdecode.drafters import longest_accepted_path
from specdecode.ops import DraftTree, NGramCache

import specdecode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from reference_ngram import RefNGramCache  # noqa: E402

CACHE_DIR = os.environ.get(
    "SPECDECODE_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "specdecode-bench")
)
VOCAB = 8000

# ---------------------------------------------------------------------------------------------
# Corpus and tokenizer


def _read(path: str, limit: int = 1 << 20) -> str:
    try:
        with open(path, encoding="utf-8", errors="strict") as f:
            return f.read(limit)
    except (UnicodeDecodeError, OSError):
        return ""


def code_files() -> list[str]:
    std = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(std, "**", "*.py"), recursive=True))
    return [f for f in files if "site-packages" not in f and f"{os.sep}test" not in f]


def prose_files() -> list[str]:
    roots = [sysconfig.get_paths()["stdlib"] + "/site-packages", "/usr/share/common-licenses"]
    out = []
    for root in roots:
        for f in sorted(glob.glob(os.path.join(root, "**", "*"), recursive=True)):
            base = os.path.basename(f)
            if "specdecode" in f or not os.path.isfile(f):
                continue
            if (
                base.endswith((".txt", ".md", ".rst"))
                or base.startswith(
                    ("LICENSE", "README", "COPYING", "METADATA", "NOTICE", "AUTHORS")
                )
                or root.endswith("common-licenses")
            ):
                out.append(f)
    return out


def load_corpus(kind: str, max_chars: int) -> list[str]:
    files = code_files() if kind == "code" else prose_files()
    docs, total = [], 0
    for f in files:
        text = _read(f)
        if len(text) < 200:
            continue
        docs.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return docs


def tokenizer():
    import sentencepiece as spm

    os.makedirs(CACHE_DIR, exist_ok=True)
    prefix = os.path.join(CACHE_DIR, f"spm{VOCAB}")
    if not os.path.exists(prefix + ".model"):
        lines = []
        for kind in ("code", "prose"):
            for doc in load_corpus(kind, 6_000_000):
                lines.extend(line for line in doc.split("\n") if line.strip())
        rng = np.random.default_rng(0)
        sample = [lines[i] for i in rng.permutation(len(lines))[:400_000]]
        t0 = time.perf_counter()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_prefix=prefix,
            vocab_size=VOCAB,
            model_type="bpe",
            character_coverage=0.9995,
            byte_fallback=True,
            user_defined_symbols=["\n"],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            num_threads=2,
            minloglevel=2,
        )
        print(f"trained sentencepiece ({VOCAB}) in {time.perf_counter() - t0:.0f} s", flush=True)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def token_stream(kind: str, max_chars: int) -> np.ndarray:
    path = os.path.join(CACHE_DIR, f"{kind}-{VOCAB}-{max_chars}.npy")
    if os.path.exists(path):
        return np.load(path)
    sp = tokenizer()
    docs = load_corpus(kind, max_chars)
    ids = sp.encode(docs)
    stream = np.concatenate([np.asarray(d, dtype=np.int32) for d in ids])
    np.save(path, stream)
    return stream


def sample_sequences(stream: np.ndarray, batch: int, length: int, seed: int) -> np.ndarray:
    """batch windows of `length` tokens at random offsets (they may overlap for large B)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Methods. Each runs `steps` replay steps on sequences whose first `ctx` tokens are the prompt.


class Timer:
    """Accumulates wall time and this thread's CPU time over `with` blocks. The CPU time is what
    a single-threaded method costs regardless of other processes competing for the cores."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> None:
        self._w, self._c = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._w
        self.cpu += time.thread_time() - self._c

    def per(self, n: int) -> dict[str, float]:
        return dict(us_per_seq_step=self.wall / n * 1e6, cpu_us_per_seq_step=self.cpu / n * 1e6)


def accept(tree: DraftTree, row: int, truth: np.ndarray) -> int:
    return len(longest_accepted_path(tree, row, truth[:64].tolist()))


def run_cacheback(seqs, ctx, steps, config, max_nodes, max_depth, chain, threads):
    batch, length = seqs.shape
    specdecode.set_num_threads(threads)
    cache = NGramCache(max_sequences=batch, **config)
    slots = np.arange(batch, dtype=np.int32)
    t0 = time.perf_counter()
    cache.update(
        slots,
        np.ascontiguousarray(seqs[:, :ctx]).reshape(-1),
        (np.arange(batch + 1) * ctx).astype(np.int32),
    )
    warm = time.perf_counter() - t0
    pos = np.full(batch, ctx, dtype=np.int32)
    timer, draft_timer = Timer(), Timer()
    emitted = 0
    offsets = np.zeros(batch + 1, dtype=np.int32)
    for _ in range(steps):
        with timer, draft_timer:
            tree = cache.draft(slots, seqs, pos, max_nodes, max_depth, chain=chain)
        commits = []
        for b in range(batch):
            n = accept(tree, b, seqs[b, pos[b] :]) + 1
            commits.append(seqs[b, pos[b] : pos[b] + n])
        np.cumsum([len(c) for c in commits], out=offsets[1:])
        flat = np.concatenate(commits)
        with timer:
            cache.update(slots, flat, offsets)
        pos += np.diff(offsets).astype(np.int32)
        emitted += len(flat)
        gc.collect(0)  # the oracle's garbage, collected outside the timed calls
    specdecode.set_num_threads(0)
    return dict(
        tokens_per_step=emitted / (batch * steps),
        **timer.per(batch * steps),
        draft_cpu_us=draft_timer.per(batch * steps)["cpu_us_per_seq_step"],
        warm_ns_per_token=warm / (batch * ctx) * 1e9,
        nbytes=cache.nbytes,
    )


def hf_pld(num_output_tokens: int, ngram: int):
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = PromptLookupCandidateGenerator(
        num_output_tokens=num_output_tokens, max_matching_ngram_size=ngram, max_length=1 << 30
    )

    def propose(history: np.ndarray) -> list[int]:
        ids = torch.from_numpy(history.astype(np.int64)).unsqueeze(0)
        out, _ = gen.get_candidates(ids)
        return out[0, ids.shape[1] :].tolist()

    return propose


def numpy_suffix(k: int, max_n: int, min_n: int = 1):
    """Ours: the longest suffix (max_n down to min_n tokens) that occurred before; propose the k
    tokens that followed its most recent earlier occurrence (the method of vLLM's proposer)."""

    def propose(history: np.ndarray) -> list[int]:
        length = len(history)
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            suffix = history[length - n :]
            # Candidate starts i with a continuation: i + n < length.
            hits = history[: length - n] == suffix[0]
            for j in range(1, n):
                hits &= history[j : length - n + j] == suffix[j]
            idx = np.flatnonzero(hits)
            if idx.size:
                start = int(idx[-1]) + n
                return history[start : start + k].tolist()
        return []

    return propose


def run_chain_baseline(seqs, ctx, steps, propose):
    batch = seqs.shape[0]
    timer, emitted = Timer(), 0
    for b in range(batch):
        pos = ctx
        for _ in range(steps):
            with timer:
                draft = propose(seqs[b, :pos])
            truth = seqs[b, pos:]
            n = 0
            while n < len(draft) and draft[n] == truth[n]:
                n += 1
            pos += n + 1
            emitted += n + 1
        gc.collect(0)
    return dict(tokens_per_step=emitted / (batch * steps), **timer.per(batch * steps))


def run_reference(seqs, ctx, steps, config, max_nodes, max_depth):
    batch = seqs.shape[0]
    ref = RefNGramCache(max_sequences=batch, **config)
    for b in range(batch):
        ref.update_one(b, seqs[b, :ctx].tolist())
    timer, emitted = Timer(), 0
    pos = [ctx] * batch
    for _ in range(steps):
        for b in range(batch):
            with timer:
                toks, pars = ref.draft_one(
                    b, seqs[b, pos[b] - 8 : pos[b]].tolist(), max_nodes, max_depth, False
                )
            tree = DraftTree(torch.tensor([toks]), torch.tensor([pars]), torch.tensor([len(toks)]))
            n = accept(tree, 0, seqs[b, pos[b] :]) + 1
            with timer:
                ref.update_one(b, seqs[b, pos[b] : pos[b] + n].tolist())
            pos[b] += n
            emitted += n
        gc.collect(0)
    return dict(tokens_per_step=emitted / (batch * steps), **timer.per(batch * steps))


# ---------------------------------------------------------------------------------------------


def report(path: str) -> str:
    """Markdown tables of a results file written with --out."""
    with open(path) as f:
        res = json.load(f)
    cfg = res["config"]
    lines = [
        f"Cacheback config: `{cfg['cacheback']}`, tree {cfg['tree_nodes']} nodes / depth "
        f"{cfg['tree_depth']}, chain {cfg['chain_len']} drafts; {cfg['steps']} replay steps per "
        f"sequence; baselines on {cfg['baseline_seqs']} sequences x {cfg['baseline_steps']} "
        f"steps. Load average {res['machine']['load_at_start'][0]:.1f} at start, "
        f"{res['machine']['load_at_end'][0]:.1f} at end.",
        "",
        "| corpus | B | context | method | tokens/step | us/seq/step (wall) | "
        "us/seq/step (thread CPU) | of which draft (CPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for row in res["rows"]:
        key = (row["corpus"], row["ctx"])
        for name in ("cacheback-tree-t1", "cacheback-tree-t2", "cacheback-chain-t1"):
            r = row[name]
            cpu = f"{r['cpu_us_per_seq_step']:.2f}" if name.endswith("t1") else "n/a (2 threads)"
            lines.append(
                f"| {row['corpus']} | {row['batch']} | {row['ctx']} | {name} | "
                f"{r['tokens_per_step']:.3f} | {r['us_per_seq_step']:.2f} | {cpu} | "
                f"{r['draft_cpu_us']:.2f} |"
                if name.endswith("t1")
                else f"| {row['corpus']} | {row['batch']} | {row['ctx']} | {name} | "
                f"{r['tokens_per_step']:.3f} | {r['us_per_seq_step']:.2f} | {cpu} | |"
            )
        if key in seen:
            continue
        seen.add(key)
        for name, r in row["baselines"].items():
            lines.append(
                f"| {row['corpus']} | {cfg['baseline_seqs']} (B=1 calls) | {row['ctx']} | "
                f"{name} | {r['tokens_per_step']:.3f} | {r['us_per_seq_step']:.2f} | "
                f"{r['cpu_us_per_seq_step']:.2f} | |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--batches", default="1,64,512")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--corpora", default="code,prose")
    ap.add_argument("--steps", type=int, default=32, help="replay steps for cacheback")
    ap.add_argument("--baseline-seqs", type=int, default=8)
    ap.add_argument("--baseline-steps", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--config",
        default='{"tables": [[1, 4]], "max_leaders": 512, "max_followers": 4}',
        help="NGramCache options as JSON (default: the configuration bench/RESULTS.md's goals "
        "are measured with, one table (1, 4) of 512 leaders)",
    )
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--report", metavar="JSON", help="print markdown tables of a results file")
    args = ap.parse_args()
    if args.report:
        print(report(args.report))
        return
    # Every method on one thread (torch's intra-op pool would otherwise help hf-pld's scans).
    torch.set_num_threads(1)
    # Collections triggered by the bench's own bookkeeping must not land in timed calls; the
    # runs collect explicitly between steps.
    gc.disable()
    if args.quick:
        args.batches, args.contexts, args.steps = "1,8", "1024", 8
        args.baseline_seqs, args.baseline_steps = 2, 4

    config = json.loads(args.config)
    config["tables"] = [tuple(t) for t in config.get("tables", [(1, 2)])]
    tree_nodes, tree_depth, chain_len = 16, 8, 8
    results = dict(
        machine=dict(
            platform=platform.platform(),
            processor=platform.processor(),
            cpus=os.cpu_count(),
            python=platform.python_version(),
            torch=torch.__version__,
            load_at_start=os.getloadavg(),
        ),
        config=dict(
            cacheback=config,
            tree_nodes=tree_nodes,
            tree_depth=tree_depth,
            chain_len=chain_len,
            steps=args.steps,
            baseline_seqs=args.baseline_seqs,
            baseline_steps=args.baseline_steps,
        ),
        rows=[],
    )
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    for kind in args.corpora.split(","):
        stream = token_stream(kind, 12_000_000)
        print(f"{kind}: {len(stream)} tokens", flush=True)
        for ctx in contexts:
            length = ctx + 64 * max(args.steps, args.baseline_steps) + 64
            sub = sample_sequences(stream, args.baseline_seqs, length, seed=ctx)
            base = (
                {}
                if args.no_baselines
                else {
                    "hf-pld": run_chain_baseline(
                        sub, ctx, args.baseline_steps, hf_pld(chain_len, 2)
                    ),
                    "numpy-suffix": run_chain_baseline(
                        sub, ctx, args.baseline_steps, numpy_suffix(chain_len, 3)
                    ),
                    "python-ref": run_reference(
                        sub, ctx, args.baseline_steps, config, tree_nodes, tree_depth
                    ),
                    "cacheback-subset": run_cacheback(
                        sub, ctx, args.baseline_steps, config, tree_nodes, tree_depth, False, 1
                    ),
                    "cacheback-chain-subset": run_cacheback(
                        sub, ctx, args.baseline_steps, config, chain_len + 1, chain_len, True, 1
                    ),
                }
            )
            for name, r in base.items():
                print(
                    f"  {kind} ctx={ctx} {name:24s} tok/step={r['tokens_per_step']:.3f} "
                    f"us/seq/step={r['us_per_seq_step']:.2f} cpu={r['cpu_us_per_seq_step']:.2f}",
                    flush=True,
                )
            for batch in batches:
                seqs = sample_sequences(stream, batch, length, seed=batch * 7 + ctx)
                row = dict(corpus=kind, batch=batch, ctx=ctx, baselines=base)
                for threads in (1, 2):
                    row[f"cacheback-tree-t{threads}"] = run_cacheback(
                        seqs, ctx, args.steps, config, tree_nodes, tree_depth, False, threads
                    )
                row["cacheback-chain-t1"] = run_cacheback(
                    seqs, ctx, args.steps, config, chain_len + 1, chain_len, True, 1
                )
                results["rows"].append(row)
                print(
                    f"  {kind} B={batch} ctx={ctx} "
                    + " ".join(
                        f"{k}: {row[k]['tokens_per_step']:.3f} tok/step "
                        f"{row[k]['us_per_seq_step']:.3f} us "
                        f"cpu {row[k]['cpu_us_per_seq_step']:.3f}"
                        f" (draft {row[k]['draft_cpu_us']:.3f})"
                        for k in row
                        if k.startswith("cacheback")
                    ),
                    flush=True,
                )
    results["machine"]["load_at_end"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
