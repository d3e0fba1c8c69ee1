"""The byte accounting of bench/bench_verify.py: the rows exact verification must read."""

from __future__ import annotations

import importlib.util
import os

import reference_verify
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "bench_verify.py")
_spec = importlib.util.spec_from_file_location("bench_verify", _PATH)
bench_verify = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_verify)

HEAP = [-1] + [(i - 1) // 2 for i in range(1, 15)]  # node i's children: 2i + 1, 2i + 2


def path(*nodes: int, width: int = 5) -> torch.Tensor:
    return torch.tensor(list(nodes) + [-1] * (width - len(nodes)), dtype=torch.int32)


def test_chain_rows():
    # Every draft accepted: the walk ends at the leaf (bonus token), no q row.
    assert bench_verify.rows_read(None, 5, path(0, 1, 2, 3, 4), 4) == 5
    # Stopped at node 2, whose child was rejected: 3 target rows and node 2's q row.
    assert bench_verify.rows_read(None, 5, path(0, 1, 2), 2) == 4
    # Nothing accepted: the root row and its q row.
    assert bench_verify.rows_read(None, 5, path(0), 0) == 2


def test_tree_rows():
    # 0 -> 2 (its second child: child 1 was rejected against q[0]) -> 5 (first child of 2),
    # stopped at 5, whose children 11 and 12 were both rejected against q[5].
    assert bench_verify.rows_read(HEAP, 15, path(0, 2, 5), 2) == 3 + 2
    # 0 -> 1 -> 4 (second child of 1) -> 10 (second child of 4), a leaf: q[1] and q[4].
    assert bench_verify.rows_read(HEAP, 15, path(0, 1, 4, 10), 3) == 4 + 2


def test_native_op_bytes_match_the_paths():
    gen = torch.Generator().manual_seed(3)
    b, v = 6, 700
    parents = torch.tensor(HEAP, dtype=torch.int32).expand(b, 15).contiguous()
    target, q, tokens = bench_verify.make_case(b, HEAP, 15, v, gen)
    for kind in ("logits", "probs"):
        fn, _, visited, nbytes = bench_verify.native_op(target, q, tokens, parents, kind)
        res = fn()
        assert visited == int(res.num_accepted.sum()) + b
        rows = sum(
            bench_verify.rows_read(HEAP, 15, res.path[i], int(res.num_accepted[i]))
            for i in range(b)
        )
        assert nbytes == rows * v * 4
        # At least every visited target row, at most one q row more per visited node.
        assert visited * v * 4 <= nbytes <= 2 * visited * v * 4


def test_deterministic_drafts_read_no_q_rows():
    gen = torch.Generator().manual_seed(4)
    b, v = 5, 600
    target, _, tokens = bench_verify.make_case(b, None, 5, v, gen)
    assert bench_verify.rows_read(None, 5, path(0, 1, 2), 2, with_q=False) == 3
    for kind in ("logits", "probs"):
        fn, _, visited, nbytes = bench_verify.native_op(target, None, tokens, None, kind)
        res = fn()
        assert visited == int(res.num_accepted.sum()) + b
        assert nbytes == visited * v * 4


def test_torch_baseline_with_deterministic_drafts():
    # The draft of node 1 has all the mass of row 0 and that of node 2 none of row 1: node 1 is
    # accepted, node 2 rejected, and the correction is never the rejected token.
    v = 50
    target = torch.randn(64, 3, v)
    tokens = torch.randint(0, v, (64, 3))
    rows = torch.arange(64)
    target[rows, 0] = -float("inf")
    target[rows, 0, tokens[:, 1]] = 0.0
    target[rows, 1, tokens[:, 2]] = -float("inf")
    emitted, num = reference_verify.torch_verify_chain(target, None, tokens)
    assert num.tolist() == [2] * 64
    assert torch.equal(emitted[:, 0], tokens[:, 1].int())
    assert bool((emitted[:, 1] != tokens[:, 2].int()).all())


def test_agreeing_drafter_case():
    # top_mass: every target row gives one token that probability, and the deterministic draft
    # of node i is the top token of node i - 1's row, so the accepted count follows a geometric
    # law: E = 0.8 + 0.8^2 + 0.8^3 + 0.8^4 = 2.3616 of 4.
    gen = torch.Generator().manual_seed(5)
    b, v = 4000, 300
    target, _, tokens = bench_verify.make_case(b, None, 5, v, gen, top_mass=0.8)
    p = torch.softmax(target[:, :4], -1)
    drafted = p.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(drafted, torch.full_like(drafted, 0.8), atol=1e-5)
    assert torch.allclose(p.max(-1).values, drafted)
    fn, _, visited, nbytes = bench_verify.native_op(target, None, tokens, None, "logits")
    res = fn()
    mean = float(res.num_accepted.float().mean())
    assert abs(mean - 2.3616) < 0.08, mean
    assert nbytes == visited * v * 4
