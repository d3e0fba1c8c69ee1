"""Tree utilities: validation, depths, ancestor masks and root-to-leaf paths.

The tree format every op of specdecode shares: a batch of B draft trees is an int32 array
``parents[B, N]``. In each row, node 0 is the root (the last committed token) and has parent -1;
every other valid node ``i`` has ``0 <= parents[b, i] < i`` (parents come before their children,
which rules out cycles); the row is padded with -1 after its ``num_nodes[b]`` valid nodes.
``N <= 1024``. A chain of k drafts is the tree ``[-1, 0, 1, ..., k-1]``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from .. import _C
from .common import as_array, device_of, empty, raise_numpy_dtype_error, stream_of

MAX_TREE_NODES = 1024

_TREE_ERRORS = {
    1: "the root (node 0) must have parent -1, got parent {parent}",
    2: "node {node} has parent {parent}, but a parent must come before its child "
    "(parent index < child index; this also rules out cycles)",
    3: "node {node} has parent {parent}; parents are node indices >= 0, or -1 for padding",
    4: "node {node} (parent {parent}) follows padding: -1 may only pad the end of a row "
    "(a second root, or padding in the middle)",
}


class TreeInfo(NamedTuple):
    """Result of :func:`tree_info`.

    Attributes
    ----------
    depth : torch.Tensor
        int32 ``[B, N]``: depth of each node (root 0), -1 for padding.
    mask : torch.Tensor
        uint32 ``[B, N, ceil(N / 32)]``: bit ``j % 32`` of word ``j // 32`` in row ``i`` is set iff
        node ``j`` is node ``i`` or an ancestor of ``i``; rows of padding are all zero.
    num_nodes : torch.Tensor
        int32 ``[B]``: valid nodes per row (at least 1, the root).
    """

    depth: torch.Tensor
    mask: torch.Tensor
    num_nodes: torch.Tensor


def _raise_tree_errors(parents: Any, status: torch.Tensor) -> None:
    host = status.cpu().numpy()  # one copy from a device; it waits for the kernels
    bad = np.flatnonzero(host[:, 0])
    if bad.size == 0:
        return
    b = int(bad[0])
    code, node = (int(v) for v in host[b])
    row = torch.as_tensor(parents)[b] if not isinstance(parents, torch.Tensor) else parents[b]
    parent = int(row[node])
    more = f" ({bad.size - 1} more invalid rows)" if bad.size > 1 else ""
    raise ValueError(
        f"parents: invalid tree in batch row {b}: "
        + _TREE_ERRORS[code].format(node=node, parent=parent)
        + more
    )


def _tree_info(parents: Any, with_mask: bool) -> TreeInfo:
    parents = as_array(parents, "parents", torch.int32)
    device = device_of(parents, "parents")
    shape = tuple(parents.shape)
    if len(shape) != 2:
        raise ValueError(f"parents: expected shape [B, N], got {list(shape)}")
    batch, n = shape
    words = (n + 31) // 32
    depth = empty((batch, n), torch.int32, device)
    mask = empty((batch, n, words), torch.uint32, device) if with_mask else None
    num_nodes = empty((batch,), torch.int32, device)
    status = empty((batch, 2), torch.int32, device)
    try:
        _C.tree_info(parents, depth, mask, num_nodes, status, stream_of(device))
    except ValueError:
        # A numpy array DLPack cannot carry (byte order, object dtype) is a dtype error.
        raise_numpy_dtype_error("dtype int32", parents=parents)
        raise
    _raise_tree_errors(parents, status)
    return TreeInfo(depth, mask, num_nodes)


def tree_info(parents: Any) -> TreeInfo:
    """Validates a batch of trees and computes depths, ancestor masks and node counts.

    Parameters
    ----------
    parents : torch.Tensor or array-like
        int32 ``[B, N]``, ``1 <= N <= 1024``, contiguous, on the CPU or a CUDA device; in the
        tree format described in this module (node 0 the root with parent -1, parents before
        children, -1 padding at the end of each row). A numpy array or any object with
        ``__dlpack__`` is read without a copy; a nested list is converted.

    Returns
    -------
    TreeInfo
        ``depth`` int32 ``[B, N]``, ``mask`` uint32 ``[B, N, ceil(N/32)]`` and ``num_nodes``
        int32 ``[B]``, torch tensors on the device of ``parents``.

    Raises
    ------
    TypeError
        ``parents`` is not int32.
    ValueError
        Wrong shape, non-contiguous, ``N > 1024``, a CUDA array in a build without CUDA, or an
        invalid tree (a parent index >= its child, a second root, padding in the middle, a root
        with a parent); the message names the first invalid batch row and node.
    """
    if torch.compiler.is_compiling():
        return TreeInfo(*_tree_info_op(parents))
    return _tree_info(parents, with_mask=True)


# The op as torch.compile sees it: a custom op whose fake implementation gives the output shapes,
# so graphs containing tree_info trace without running the kernel. Eager calls skip this layer.
@torch.library.custom_op("specdecode::tree_info", mutates_args=())
def _tree_info_op(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    info = _tree_info(parents, with_mask=True)
    return info.depth, info.mask, info.num_nodes


@_tree_info_op.register_fake
def _tree_info_fake(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(parents.dim() == 2, lambda: "parents: expected shape [B, N]")
    torch._check(parents.dtype == torch.int32, lambda: "parents: expected dtype int32")
    batch, n = parents.shape
    return (
        parents.new_empty((batch, n), dtype=torch.int32),
        parents.new_empty((batch, n, (n + 31) // 32), dtype=torch.uint32),
        parents.new_empty((batch,), dtype=torch.int32),
    )


def tree_paths(
    parents: Any, *, max_paths: int | None = None, path_len: int | None = None
) -> torch.Tensor:
    """Root-to-leaf paths of a batch of trees.

    Parameters
    ----------
    parents : torch.Tensor or array-like
        int32 ``[B, N]`` in the tree format (see :func:`tree_info`).
    max_paths, path_len : int, optional
        Static output sizes. By default ``L`` is the largest leaf count in the batch and the path
        length is the largest depth + 1, which on a GPU costs a device-to-host sync; give both
        (e.g. ``N`` and ``N``) to avoid it.

    Returns
    -------
    torch.Tensor
        int32 ``[B, L, D + 1]``: row ``l`` of batch ``b`` holds the node indices from the root to
        the ``l``-th leaf (leaves in ascending node order), padded with -1; rows past the leaf
        count of ``b`` are all -1. A single-node tree has the one path ``[0]``.

    Raises
    ------
    ValueError
        As :func:`tree_info`, or when the given ``max_paths`` / ``path_len`` are too small for
        the trees, below 1 or above 1024.
    """
    parents = as_array(parents, "parents", torch.int32)
    info = _tree_info(parents, with_mask=False)
    device = info.depth.device
    batch, n = info.depth.shape
    num_paths = empty((batch,), torch.int32, device)
    status = empty((batch,), torch.int32, device)
    stream = stream_of(device)
    if max_paths is None or path_len is None:
        _C.tree_paths(parents, info.depth, info.num_nodes, None, num_paths, status, stream)
        if max_paths is None:
            max_paths = int(num_paths.max()) if batch else 1
        if path_len is None:
            path_len = int(info.depth.max()) + 1 if batch else 1
    for name, value in (("max_paths", max_paths), ("path_len", path_len)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
        # Checked before the [B, max_paths, path_len] allocation, which could be huge; a tree has
        # at most MAX_TREE_NODES leaves and depth MAX_TREE_NODES - 1.
        if value > MAX_TREE_NODES:
            raise ValueError(f"{name}: expected at most {MAX_TREE_NODES}, got {value}")
    max_paths, path_len = int(max_paths), int(path_len)
    paths = empty((batch, max_paths, path_len), torch.int32, device)
    _C.tree_paths(parents, info.depth, info.num_nodes, paths, num_paths, status, stream)
    bad = np.flatnonzero(status.cpu().numpy())
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"max_paths={max_paths}, path_len={path_len} are too small for batch row {b}: it "
            f"has {int(num_paths[b])} leaves and depth {int(info.depth[b].max())}"
        )
    return paths


def chain_parents(batch: int, k: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The parents of a batch of chains of ``k`` draft tokens.

    Parameters
    ----------
    batch : int
        Number of rows ``B >= 0``.
    k : int
        Draft tokens per chain, ``0 <= k < 1024``; the tree has ``k + 1`` nodes (the root first).
    device : torch.device or str, optional
        Where to allocate (default CPU).

    Returns
    -------
    torch.Tensor
        int32 ``[B, k + 1]``, every row ``[-1, 0, 1, ..., k - 1]``.
    """
    for name, value in (("batch", batch), ("k", k)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    batch, k = int(batch), int(k)
    if k + 1 > MAX_TREE_NODES:
        raise ValueError(f"k: a chain has at most {MAX_TREE_NODES - 1} drafts, got {k}")
    # torch's own error for a size past int64 would not name the argument.
    if batch * (k + 1) >= 2**63:
        raise ValueError(f"batch: {batch} rows of {k + 1} nodes exceed an int64 element count")
    row = torch.arange(-1, k, dtype=torch.int32, device=device)
    return row.unsqueeze(0).expand(batch, k + 1).contiguous()
