"""tree_info: the native op against a vectorised PyTorch implementation of the same op.

pytest bench/test_bench_tree.py --benchmark-only --benchmark-json=tree.json
python bench/report.py tree.json
"""

from __future__ import annotations

import pytest
import torch
from torch_tree import tree_info_torch

from specdecode import ops

SHAPES = [(b, n) for b in (1, 64, 512) for n in (16, 64, 256)]


def random_trees(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Parent of node i uniform in [max(0, i - 4), i): bushy but deep trees like real drafts.
    index = torch.arange(n)
    low = (index - 4).clamp(min=0)
    span = (index - low).clamp(min=1)
    offset = (torch.rand((batch, n), generator=g) * span).long()
    parents = (low + offset).to(torch.int32)
    parents[:, 0] = -1
    return parents.contiguous()


@pytest.mark.parametrize("batch, n", SHAPES, ids=[f"B{b}-N{n}" for b, n in SHAPES])
@pytest.mark.parametrize("impl", ["native", "torch"])
def test_tree_info(benchmark, impl, batch, n):
    parents = random_trees(batch, n)
    expected = ops.tree_info(parents)
    fn = ops.tree_info if impl == "native" else tree_info_torch
    benchmark.group = f"tree_info B={batch} N={n}"
    benchmark.extra_info.update(impl=impl, batch=batch, n=n)
    depth, mask, num_nodes = benchmark(fn, parents)
    assert torch.equal(depth, expected.depth)
    assert torch.equal(mask.to(torch.int64), expected.mask.to(torch.int64))
    assert torch.equal(num_nodes, expected.num_nodes)
