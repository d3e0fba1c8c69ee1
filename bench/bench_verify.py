"""Benchmark of specdecode.ops.verify on the CPU against pure-PyTorch baselines.

Run (benchmarks must never overlap):

    flock /tmp/specdecode-bench.lock python bench/bench_verify.py [--quick] [--out FILE]
    flock /tmp/specdecode-bench.lock python bench/bench_verify.py --interleaved ROUNDS

Cases: B in {1, 8, 64}; chains of k in {4, 8} drafts and a 64-node tree (a binary heap tree,
siblings sampled from q without replacement); V in {32000, 128256}; target logits and target
probabilities (float32). These cases have draft probabilities q and draft tokens sampled from q,
with q close to the target (so that several drafts get accepted, as in practice). "chain k=4,
no q" takes the same tokens as deterministic drafts (an n-gram or prompt-lookup drafter: no
``draft_probs``; a draft is accepted with p(x), the correction comes from p without it). Those
drafts rarely match the flat targets, so the walk mostly stops at the root; "chain k=4, no q,
p_top 0.8" is a drafter that agrees with the target: every target row puts 0.8 of its mass on
one token and the deterministic draft is that token, so about 2.4 of 4 drafts are accepted and
the walk reads several rows per sequence, as with an LLM and a good drafter.

A second table times ``ops.sample`` (the non-speculative path, same processing and RNG) with
plain, top-k 50, top-p 0.9 and top-k 50 + top-p 0.95 filtering against the usual PyTorch
sampler (:func:`torch_sample`), B in {1, 8}, V = 128256 (``--sampling`` runs only that table).

Baselines measured in the same run:
* ``torch``: the vectorised pure-PyTorch exact chain verification of tests/reference_verify.py
  (softmax of every row, gather, cumprod of the accepts, residual of the stop row, multinomial);
* ``hf``: transformers' ``_speculative_sampling`` (batch 1, chains, logits: it softmaxes the
  draft logits too, which it is given as log q);
* the machine's memory bandwidth: a reduction over a 1 GiB float32 tensor (read-only). It is
  measured before the cases (the ``% of bw`` column is against this reading) and once more after
  them, since on a shared VM it moves by a third between readings a few minutes apart; the load
  average is printed with each reading.

``GB/s`` is the bytes that must be read divided by the op's time: every target row on the accepted
path plus the draft row of every node where a draft was rejected (V * 4 bytes each): in a chain
the stop node when it has a child; in a tree each node of the path whose accepted child is not
its first (the children tried before it were rejected against that node's q) and the stop node
when it has children.

``--device cuda`` runs the same cases on a GPU: the op's CUDA kernels, the PyTorch baseline on
the GPU, FlashInfer's ``chain_speculative_sampling`` (chains; it takes probabilities, so its
logits column includes a softmax) when ``flashinfer`` can be imported, and the bandwidth probe
on the GPU's memory; times are taken after ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys
import time

import torch

import specdecode
from specdecode import ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from reference_verify import torch_verify_chain  # noqa: E402

# Set by main(): the device the cases run on, and how to wait for it (a no-op on the CPU).
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timeit(fn, min_time: float = 0.3, min_reps: int = 3, max_reps: int = 200) -> float:
    fn()  # warm-up
    _sync()
    times = []
    start = time.perf_counter()

    def more() -> bool:
        return len(times) < min_reps or time.perf_counter() - start < min_time

    while len(times) < max_reps and more():
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def memory_bandwidth() -> float:
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32, device=DEVICE)  # 1 GiB
    t = timeit(lambda: x.sum(), min_time=1.0)
    return x.numel() * 4 / t / 1e9


def rows_read(
    parents: list[int] | None,
    n: int,
    path: torch.Tensor,
    accepted: torch.Tensor,
    with_q: bool = True,
) -> int:
    """Target and draft rows a sequence's exact verification must read, from its result.

    ``path``: int ``[D+1]`` node indices (root first), ``accepted``: number of accepted nodes.
    Target rows: every node of the path (the root and the accepted nodes). Draft rows (only
    ``with_q``, drafts sampled from q; deterministic drafts have none): the q row of each path
    node where a child was rejected before the walk went on (its accepted child is not its first
    one) and of the stop node if it has children (all of them were rejected).
    """
    par = list(range(-1, n - 1)) if parents is None else parents
    first_child: dict[int, int] = {}
    for i in range(1, n):
        first_child.setdefault(par[i], i)
    nodes = path[: accepted + 1].tolist()
    if not with_q:
        return len(nodes)
    draft_rows = sum(1 for a, c in zip(nodes, nodes[1:]) if first_child[a] != c)
    draft_rows += int(nodes[-1] in first_child)
    return len(nodes) + draft_rows


def native_op(target, q, tokens, parents, kind: str):
    """The op on one case as a timeable closure, with the rows it must read.

    ``q`` None: deterministic drafts (no ``draft_probs``, as from an n-gram drafter). Returns
    ``(fn, rows, visited, bytes_read)``: ``rows`` is the target input of ``kind`` ("logits" or
    "probs"), ``visited`` the target rows on the accepted paths (``B`` roots plus the accepted
    nodes), ``bytes_read`` the target and draft rows of :func:`rows_read` summed over the batch,
    V * 4 bytes each.
    """
    b, n, v = target.shape
    logits = kind == "logits"
    rows = target if logits else torch.softmax(target, -1)
    kw = dict(
        parents=parents,
        draft_probs=q,
        seed=torch.arange(b, device=target.device),
        offset=1,
        target_is_logits=logits,
    )

    def fn():
        return ops.verify(rows, tokens, **kw)

    res = fn()
    path, accepted = res.path.cpu(), res.num_accepted.cpu()
    visited = int(accepted.sum()) + b
    parents_list = None if parents is None else parents[0].tolist()
    total = sum(
        rows_read(parents_list, n, path[i], int(accepted[i]), q is not None) for i in range(b)
    )
    return fn, rows, visited, total * v * 4


def interleaved_goal_row(rounds: int, gen: torch.Generator) -> list[str]:
    """The goal row (chain k=4, B=64, V=128256) timed in alternation with the bandwidth probe.

    On a shared VM the probe moves by a third within minutes (26 to 48 GB/s on the quiet
    machine), so one reading before the cases can be far from the bandwidth the op actually had.
    Here every round times the logits op, the probabilities op and the probe back to back, and
    each op's share is taken against the probe of its own round; the table gives every round and
    the minimum / median / maximum share, so a bad round is shown, not hidden.
    """
    b, n, v = 64, 5, 128256
    target, q, tokens = make_case(b, None, n, v, gen)
    cases = {}
    for kind in ("logits", "probs"):
        fn, _, _, bytes_read = native_op(target, q, tokens, None, kind)
        cases[kind] = (fn, bytes_read)
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32, device=DEVICE)
    lines = [
        "| round | probe GB/s | logits ms | logits GB/s | logits % | probs ms | probs GB/s "
        "| probs % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    shares: dict[str, list[float]] = {"logits": [], "probs": []}
    for r in range(rounds):
        t = {kind: timeit(fn) for kind, (fn, _) in cases.items()}
        bw = x.numel() * 4 / timeit(lambda: x.sum()) / 1e9
        cells = []
        for kind, (_, nbytes) in cases.items():
            gbs = nbytes / t[kind] / 1e9
            shares[kind].append(gbs / bw)
            cells.append(f"{t[kind] * 1e3:.3f} | {gbs:.1f} | {100 * gbs / bw:.0f}%")
        line = f"| {r + 1} | {bw:.1f} | " + " | ".join(cells) + " |"
        print(line, flush=True)
        lines.append(line)
    lines.append("")
    for kind, s in shares.items():
        s = sorted(s)
        line = (
            f"{kind}: share of the same round's bandwidth min {100 * s[0]:.0f}%, "
            f"median {100 * s[len(s) // 2]:.0f}%, max {100 * s[-1]:.0f}% over {rounds} rounds"
        )
        print(line, flush=True)
        lines.append(line)
    return lines


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover (no load average on this platform)
        return "n/a"


def make_case(
    b: int,
    parents: list[int] | None,
    n: int,
    v: int,
    gen: torch.Generator,
    top_mass: float | None = None,
):
    distinct = 16
    base = torch.randn(distinct, v, generator=gen) * 3
    if top_mass is not None:
        top = torch.randint(0, v, (distinct,), generator=gen)
        # Give one token per row the probability top_mass: its logit is the log-sum-exp of the
        # others plus log(top_mass / (1 - top_mass)).
        rows = torch.arange(distinct)
        others = base.clone()
        others[rows, top] = -float("inf")
        base[rows, top] = torch.logsumexp(others, -1) + torch.log(
            torch.tensor(top_mass / (1.0 - top_mass))
        )
    base_q = torch.softmax(base + torch.randn(distinct, v, generator=gen), -1)
    idx = torch.arange(b * n) % distinct
    target = base[idx].view(b, n, v)
    q = base_q[idx].view(b, n, v)
    tokens = torch.zeros(b, n, dtype=torch.int64)
    if top_mass is not None and parents is None:
        # The drafter proposes each node's most likely child: the top token of its parent's row.
        for i in range(1, n):
            tokens[:, i] = top[idx.view(b, n)[:, i - 1]]
    elif parents is None:
        draws = torch.multinomial(base_q, 64, replacement=True, generator=gen)
        for i in range(1, n):
            rows = idx.view(b, n)[:, i - 1]
            tokens[:, i] = draws[rows, torch.randint(0, 64, (b,), generator=gen)]
    else:
        pairs = torch.multinomial(base_q, 2, replacement=False, generator=gen)
        for i in range(1, n):
            p = parents[i]
            rows = idx.view(b, n)[:, p]
            tokens[:, i] = pairs[rows, (i - 1) % 2]
    return target.to(DEVICE), q.to(DEVICE), tokens.to(DEVICE)


def torch_sample(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The usual PyTorch sampler (as transformers' top-k and top-p logits warpers, then softmax
    and multinomial): top-k by ``topk``, top-p by a sort and a cumulative sum."""
    x = logits.float()
    if top_k > 0:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -float("inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, dim=-1)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, -1) >= top_p  # keep the token that crosses top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, -float("inf")))
    return torch.multinomial(torch.softmax(x, -1), 1).squeeze(-1)


SAMPLING = [(0, 1.0), (50, 1.0), (0, 0.9), (50, 0.95)]
"""(top_k, top_p) of the sampling table: plain, transformers' default top-k, a common top-p,
and both."""


def sampling_rows(gen: torch.Generator) -> list[str]:
    """``ops.sample`` with the usual filters against :func:`torch_sample`, B in {1, 8},
    V = 128256. Two kinds of rows: ``randn * 3`` logits (flat: top-p 0.9 keeps most of the
    vocabulary) and a power law (``-1.1 log rank`` plus noise, closer to a language model's
    next-token distribution)."""
    v = 128256
    out = [
        "",
        "| logits | B | top_k | top_p | specdecode ms | torch ms | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(out), flush=True)
    for b in (1, 8):
        flat = torch.randn(b, v, generator=gen) * 3
        ranks = torch.stack([torch.randperm(v, generator=gen) for _ in range(b)]).float() + 1
        power = -1.1 * torch.log(ranks) + torch.randn(b, v, generator=gen) * 0.3
        for name, x in (("randn*3", flat), ("power law", power)):
            x = x.to(DEVICE)
            for top_k, top_p in SAMPLING:

                def native(x=x, top_k=top_k, top_p=top_p):
                    return ops.sample(x, top_k=top_k, top_p=top_p, seed=0, offset=1)

                def baseline(x=x, top_k=top_k, top_p=top_p):
                    return torch_sample(x, top_k, top_p)

                t_native, t_torch = timeit(native), timeit(baseline)
                line = (
                    f"| {name} | {b} | {top_k} | {top_p} | {t_native * 1e3:.3f} | "
                    f"{t_torch * 1e3:.3f} | {t_torch / t_native:.1f}x |"
                )
                print(line, flush=True)
                out.append(line)
    return out


def hf_speculative_sampling():
    """transformers' ``_speculative_sampling`` as ``fn(ids, candidate_logits, k, new_logits)``,
    or None without transformers. Some 5.x releases take a required ``is_done_candidate`` (the
    draft ended on a stop token): False here, as for every case of this benchmark."""
    try:
        from transformers.generation.utils import _speculative_sampling
    except ImportError:  # pragma: no cover
        return None
    if "is_done_candidate" not in inspect.signature(_speculative_sampling).parameters:
        return _speculative_sampling

    def run(ids, candidate_logits, k, new_logits):
        return _speculative_sampling(ids, candidate_logits, k, new_logits, is_done_candidate=False)

    return run


def flashinfer_chain():
    """FlashInfer's chain_speculative_sampling as ``fn(target_probs, q, tokens)`` in our layout
    (``q[:, i]`` drew node ``i + 1``), or None without a GPU or without flashinfer."""
    if DEVICE.type != "cuda":
        return None
    try:
        from flashinfer.sampling import chain_speculative_sampling
    except ImportError:
        return None

    def run(target_probs, q, tokens):
        k = tokens.shape[1] - 1
        return chain_speculative_sampling(
            q[:, :k].contiguous(), tokens[:, 1:].to(torch.int32).contiguous(), target_probs
        )

    return run


def run_case(
    name, parents_list, n, v, b, gen, bw, hf_sampling, fi_chain, with_q=True, top_mass=None
) -> list[str]:
    out = []
    target, q, tokens = make_case(b, parents_list, n, v, gen, top_mass)
    if not with_q:
        q = None
    parents = None
    if parents_list is not None:
        parents = torch.tensor(parents_list, dtype=torch.int32, device=DEVICE)
        parents = parents.expand(b, n).contiguous()
    for kind in ("logits", "probs"):
        logits = kind == "logits"
        native, rows, visited, bytes_read = native_op(target, q, tokens, parents, kind)
        t_native = timeit(native)
        gbs = bytes_read / t_native / 1e9
        t_torch = t_hf = t_fi = float("nan")
        if parents_list is None and fi_chain is not None and q is not None:

            def fi(rows=rows, logits=logits):
                return fi_chain(torch.softmax(rows, -1) if logits else rows, q, tokens)

            t_fi = timeit(fi)
        if parents_list is None:

            def baseline(rows=rows, logits=logits):
                return torch_verify_chain(rows, q, tokens, target_is_logits=logits)

            t_torch = timeit(baseline)
            if b == 1 and logits and hf_sampling is not None and q is not None:
                k = n - 1
                ids = tokens[:, 1:]
                cand_logits = torch.log(q[:, :k])

                def hf(rows=rows, ids=ids, cand_logits=cand_logits, k=k):
                    return hf_sampling(ids, cand_logits, k, rows)

                t_hf = timeit(hf)
        line = (
            f"| {name} | {b} | {v} | {kind} | {t_native * 1e3:.3f} | "
            f"{t_torch * 1e3:.3f} | {t_torch / t_native:.1f}x | {t_hf * 1e3:.3f} | "
            f"{visited / b - 1:.2f} | {gbs:.1f} | {100 * gbs / bw:.0f}% |"
        )
        if fi_chain is not None:
            line += f" {t_fi * 1e3:.3f} |"
        print(line, flush=True)
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="B=8 only, fewer cases")
    ap.add_argument(
        "--goal-row",
        action="store_true",
        help="only the goal row: chain k=4, B=64, V=128256",
    )
    ap.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only the goal row, timed in ROUNDS rounds alternating with the bandwidth probe",
    )
    ap.add_argument(
        "--sampling",
        action="store_true",
        help="only the sampling table (ops.sample with top-k / top-p against PyTorch)",
    )
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda[:N]: where the cases run"
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    if DEVICE.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device: expected cpu or cuda, got {args.device!r}")
    gen = torch.Generator().manual_seed(0)
    if args.interleaved > 0:
        lines = [f"load average {load_average()}"]
        print(lines[0], flush=True)
        lines += interleaved_goal_row(args.interleaved, gen)
        lines.append(f"load average {load_average()}")
        print(lines[-1], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return
    if args.sampling:
        lines = [f"load average {load_average()}", *sampling_rows(gen)]
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return
    bw = memory_bandwidth()
    fi_chain = flashinfer_chain()
    machine = (
        f"GPU {torch.cuda.get_device_name(DEVICE)}, flashinfer "
        f"{'found' if fi_chain is not None else 'not installed'}"
        if DEVICE.type == "cuda"
        else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    )
    lines = [
        f"machine: {machine}, specdecode threads {specdecode.get_num_threads()}, torch threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}",
        f"memory bandwidth on {DEVICE.type} (1 GiB float32 sum, read): {bw:.1f} GB/s "
        f"(load average {load_average()})",
        "",
        "| shape | B | V | input | specdecode ms | torch ms | speed-up | hf ms | accepted/seq "
        "| GB/s | % of bw |" + (" flashinfer ms |" if fi_chain is not None else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if fi_chain is not None else ""),
    ]
    print("\n".join(lines), flush=True)
    _speculative_sampling = hf_speculative_sampling()
    heap = [-1] + [(i - 1) // 2 for i in range(1, 64)]
    shapes = [
        ("chain k=4", None, 5, True, None),
        ("chain k=8", None, 9, True, None),
        ("tree 64", heap, 64, True, None),
        ("chain k=4, no q", None, 5, False, None),
        ("chain k=4, no q, p_top 0.8", None, 5, False, 0.8),
    ]
    batches = [8] if args.quick else [1, 8, 64]
    vocabs = (32000, 128256)
    if args.goal_row:
        shapes, batches, vocabs = shapes[:1], [64], (128256,)
    for name, parents_list, n, with_q, top_mass in shapes:
        for v in vocabs:
            for b in batches:
                lines += run_case(
                    name,
                    parents_list,
                    n,
                    v,
                    b,
                    gen,
                    bw,
                    _speculative_sampling,
                    fi_chain,
                    with_q,
                    top_mass,
                )
    if not args.goal_row:
        lines += sampling_rows(gen)
    after = (
        f"memory bandwidth after the cases: {memory_bandwidth():.1f} GB/s "
        f"(load average {load_average()})"
    )
    print(after, flush=True)
    lines += ["", after]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
