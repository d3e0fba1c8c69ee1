"""Pure-PyTorch references for the tree utilities, written from the definitions."""

from __future__ import annotations

import torch


class InvalidTree(ValueError):
    def __init__(self, row: int, node: int, reason: str):
        super().__init__(f"row {row}, node {node}: {reason}")
        self.row, self.node, self.reason = row, node, reason


def validate_row(parents: list[int], row: int = 0) -> int:
    """Returns the number of valid nodes or raises InvalidTree with the first problem."""
    if parents[0] != -1:
        raise InvalidTree(row, 0, "root")
    count, padding = 1, False
    for i, p in enumerate(parents[1:], start=1):
        if p == -1:
            padding = True
        elif p < -1:
            raise InvalidTree(row, i, "bad parent")
        elif padding:
            raise InvalidTree(row, i, "after padding")
        elif p >= i:
            raise InvalidTree(row, i, "order")
        else:
            count += 1
    return count


def tree_info_reference(parents: torch.Tensor):
    """depth [B, N], dense ancestor mask bool [B, N, N], num_nodes [B]."""
    batch, n = parents.shape
    depth = torch.full((batch, n), -1, dtype=torch.int32)
    dense = torch.zeros((batch, n, n), dtype=torch.bool)
    num_nodes = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        row = parents[b].tolist()
        count = validate_row(row, b)
        num_nodes[b] = count
        for i in range(count):
            node, d = i, 0
            while node != -1:
                dense[b, i, node] = True
                node = row[node]
                d += 1
            depth[b, i] = d - 1
    return depth, dense, num_nodes


def pack_mask(dense: torch.Tensor) -> torch.Tensor:
    """bool [B, N, N] -> uint32 words [B, N, ceil(N/32)] with bit j % 32 of word j // 32."""
    batch, n, _ = dense.shape
    words = (n + 31) // 32
    padded = torch.zeros((batch, n, words * 32), dtype=torch.int64)
    padded[..., :n] = dense.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64), torch.arange(32))
    packed = (padded.view(batch, n, words, 32) * weights).sum(-1)
    return packed.to(torch.uint32)


def unpack_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """uint32 [B, N, W] -> bool [B, N, N]."""
    words = mask.to(torch.int64)
    bits = torch.bitwise_and(
        torch.bitwise_right_shift(words.unsqueeze(-1), torch.arange(32)), 1
    ).bool()
    return bits.flatten(-2)[..., :n]


def tree_paths_reference(parents: torch.Tensor) -> torch.Tensor:
    batch, n = parents.shape
    all_paths = []
    for b in range(batch):
        row = parents[b].tolist()
        count = validate_row(row, b)
        children = {p for p in row[1:count]}
        paths = []
        for leaf in range(count):
            if leaf in children:
                continue
            path, node = [], leaf
            while node != -1:
                path.append(node)
                node = row[node]
            paths.append(path[::-1])
        all_paths.append(paths)
    num_paths = max(len(p) for p in all_paths) if batch else 0
    path_len = max((len(path) for paths in all_paths for path in paths), default=1)
    out = torch.full((batch, num_paths, path_len), -1, dtype=torch.int32)
    for b, paths in enumerate(all_paths):
        for row_index, path in enumerate(paths):
            out[b, row_index, : len(path)] = torch.tensor(path, dtype=torch.int32)
    return out


def random_parents(generator: torch.Generator, batch: int, n: int, pad_max: int) -> torch.Tensor:
    """Random valid trees: each row has n - pad valid nodes, pad in [0, pad_max]."""
    parents = torch.full((batch, n), -1, dtype=torch.int32)
    for b in range(batch):
        pad = int(torch.randint(0, pad_max + 1, (1,), generator=generator)) if pad_max else 0
        count = max(1, n - pad)
        for i in range(1, count):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=generator))
    return parents
