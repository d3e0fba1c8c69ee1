"""A vectorised pure-PyTorch tree_info: the baseline the native op is measured against.

It loops over node positions (parents come before children, so node i's parent row is final when
row i is built) and vectorises over the batch: the natural way to write this op in PyTorch.
"""

from __future__ import annotations

import torch


def tree_info_torch(parents: torch.Tensor):
    batch, n = parents.shape
    words = (n + 31) // 32
    valid = parents >= 0
    valid[:, 0] = parents[:, 0] == -1
    # Validity: root first, parents before children, padding only at the end.
    index = torch.arange(n, device=parents.device)
    if not bool(valid[:, 0].all()):
        raise ValueError("root must have parent -1")
    if bool(((parents >= index) & (index > 0)).any()):
        raise ValueError("parent index >= child index")
    if bool((parents < -1).any()):
        raise ValueError("bad parent")
    num_nodes = valid.to(torch.int32).sum(1)
    if bool((valid.to(torch.int32).cumprod(1).sum(1) != num_nodes).any()):
        raise ValueError("padding in the middle")

    depth = torch.full((batch, n), -1, dtype=torch.int32, device=parents.device)
    mask = torch.zeros((batch, n, words), dtype=torch.int64, device=parents.device)
    depth[:, 0] = 0
    mask[:, 0, 0] = 1
    rows = torch.arange(batch, device=parents.device)
    for i in range(1, n):
        p = parents[:, i].clamp(min=0).long()
        ok = valid[:, i]
        row = mask[rows, p].clone()
        row[:, i // 32] |= 1 << (i % 32)
        mask[:, i] = torch.where(ok.unsqueeze(1), row, mask[:, i])
        depth[:, i] = torch.where(ok, depth[rows, p] + 1, depth[:, i])
    return depth, mask.to(torch.uint32), num_nodes
