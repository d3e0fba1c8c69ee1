"""Argument validation shared by the models (raises before any work is done)."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from .._ops.common import as_array

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as a Python int ``>= minimum``; numpy integers are taken (as lengths and the
    engine's counts take them), bools and other types are a TypeError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def check_float_dtype(name: str, dtype: Any, min_bits: int = 8) -> torch.dtype:
    """A real floating-point torch dtype of at least ``min_bits`` bits (an integer, bool or
    complex dtype would silently round or break the values)."""
    if (
        not isinstance(dtype, torch.dtype)
        or not dtype.is_floating_point
        or dtype.itemsize * 8 < min_bits
    ):
        at_least = f" of at least {min_bits} bits" if min_bits > 8 else ""
        raise TypeError(
            f"{name}: expected a floating-point torch.dtype{at_least} (torch.float32, "
            f"torch.float16, torch.bfloat16, ...), got {dtype!r}"
        )
    return dtype


def check_tokens(
    input_ids: Any, positions: Any, vocab_size: int, batch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates ``input_ids`` / ``positions`` ``[B, T]``; returns them as int64."""
    for name, x in (("input_ids", input_ids), ("positions", positions)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _INT_DTYPES:
            raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
        if x.dim() != 2:
            raise ValueError(f"{name}: expected shape [B, T], got {list(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name}: expected device {device}, got {x.device}")
    if input_ids.shape != positions.shape:
        raise ValueError(
            f"positions: expected the shape of input_ids {list(input_ids.shape)}, "
            f"got {list(positions.shape)}"
        )
    batch, t = input_ids.shape
    if batch != batch_size:
        raise ValueError(f"input_ids: batch {batch} does not match the cache's batch {batch_size}")
    if t < 1:
        raise ValueError("input_ids: expected at least one token per row (T >= 1)")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if int(positions.min()) < 0:
        raise ValueError(f"positions: expected positions >= 0, got {int(positions.min())}")
    return input_ids.long(), positions.long()


def check_tree_mask(tree_mask: Optional[Any], batch: int, t: int, device: torch.device) -> None:
    if tree_mask is None:
        return
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_mask: expected a torch.Tensor, got {type(tree_mask).__name__}")
    if tree_mask.dtype != torch.uint32:
        raise TypeError(f"tree_mask: expected uint32 (from ops.tree_info), got {tree_mask.dtype}")
    words = (t + 31) // 32
    if tuple(tree_mask.shape) != (batch, t, words):
        raise ValueError(
            f"tree_mask: expected shape [B, T, ceil(T/32)] = {[batch, t, words]}, "
            f"got {list(tree_mask.shape)}"
        )
    if tree_mask.device != device:
        raise ValueError(f"tree_mask: expected device {device}, got {tree_mask.device}")


def check_num_nodes(num_nodes: Optional[Any], batch: int, t: int) -> Optional[torch.Tensor]:
    """Validates a forward pass's ``num_nodes`` (real tokens per row, CPU integer ``[B]`` with
    values in ``[0, T]``); returns it as int64, or None when every token is real (nothing to
    skip)."""
    if num_nodes is None:
        return None
    if not isinstance(num_nodes, torch.Tensor):
        raise TypeError(f"num_nodes: expected a torch.Tensor, got {type(num_nodes).__name__}")
    if num_nodes.dtype not in _INT_DTYPES:
        raise TypeError(f"num_nodes: expected an integer dtype, got {num_nodes.dtype}")
    if num_nodes.device.type != "cpu":
        raise ValueError(f"num_nodes: expected a CPU tensor, got device {num_nodes.device}")
    if tuple(num_nodes.shape) != (batch,):
        raise ValueError(f"num_nodes: expected shape [{batch}], got {list(num_nodes.shape)}")
    counts = num_nodes.to(torch.int64)
    if batch and (int(counts.min()) < 0 or int(counts.max()) > t):
        raise ValueError(f"num_nodes: expected values in [0, {t}], got {counts.tolist()}")
    if int(counts.sum()) == batch * t:
        return None
    return counts


def check_compact_args(
    path: Any, num_accepted: Any, batch: int, device: Optional[torch.device] = None
) -> None:
    """Types, dtypes, device and shapes of a cache's ``compact(path, num_accepted)`` arguments."""
    for name, x in (("path", path), ("num_accepted", num_accepted)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.int32:
            raise TypeError(f"{name}: expected int32, got {x.dtype}")
        if device is not None and x.device != device:
            raise ValueError(f"{name}: expected device {device}, got {x.device}")
    if path.dim() != 2 or path.shape[0] != batch:
        raise ValueError(f"path: expected shape [{batch}, P], got {list(path.shape)}")
    if tuple(num_accepted.shape) != (batch,):
        raise ValueError(f"num_accepted: expected shape [{batch}], got {list(num_accepted.shape)}")


def check_keep_rows(rows: Any, batch: int) -> None:
    """A cache's ``keep_rows(rows)`` argument: an int64 CPU tensor ``[R]``, ``R >= 1``, of
    distinct row indices in ``[0, batch)``."""
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64:
        raise TypeError(f"rows: expected an int64 torch.Tensor, got {rows!r}")
    if rows.device.type != "cpu" or rows.dim() != 1 or rows.numel() == 0:
        raise ValueError(f"rows: expected a non-empty 1-D CPU tensor, got {list(rows.shape)}")
    if int(rows.min()) < 0 or int(rows.max()) >= batch:
        raise ValueError(f"rows: expected indices in [0, {batch}), got {rows.tolist()}")
    if torch.unique(rows).numel() != rows.numel():
        raise ValueError(f"rows: a row appears twice in {rows.tolist()}")


@functools.lru_cache(maxsize=16)
def _single_bits(t: int) -> np.ndarray:
    """uint32 ``[T, ceil(T / 32)]``: row ``j`` the ancestor-mask words with bit ``j`` alone."""
    table = np.zeros((t, (t + 31) // 32), dtype=np.uint32)
    j = np.arange(t)
    table[j, j // 32] = np.left_shift(np.uint32(1), (j % 32).astype(np.uint32))
    table.setflags(write=False)
    return table


def check_accepted_path(
    path: np.ndarray, counts: np.ndarray, tree_mask: Optional[torch.Tensor], t: int
) -> None:
    """Checks that each row's kept nodes ``path[b, :counts[b]]`` (host int64 ``[B, P]``, nodes
    already known to be in ``[0, T)``) form a root-to-node path of the last forward pass.

    ``tree_mask``: that pass's uint32 ancestor bitmask ``[B, T, ceil(T / 32)]``, or None for a
    causal chain (node ``i`` saw nodes ``0..i``). Compacting keeps the K/V of the kept nodes,
    computed while each of them attended to the nodes its mask row shows; they describe the kept
    sequence only when node ``path[b, i]`` saw exactly ``path[b, :i + 1]``: the path starts at
    the root (node 0) and each node is a child of the one before it. Anything else would leave a
    cache that silently disagrees with its tokens.
    """
    batch, width = path.shape
    if batch == 0 or width == 0:
        return
    used = np.arange(width)[None, :] < counts[:, None]
    bad = np.flatnonzero(used[:, 0] & (path[:, 0] != 0))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"path: row {b} starts at node {int(path[b, 0])}; an accepted path starts at the "
            "root, node 0 (the last committed token)"
        )
    nodes = np.where(used, path, 0)
    if tree_mask is None:
        wrong = used & (nodes != np.arange(width)[None, :])
        rows = None
    else:
        # rows[b, i]: the mask words of node path[b, i], which must hold exactly the bits of
        # path[b, :i + 1] (and path[b, i] must be new: a repeated node adds no bit).
        rows = tree_mask.cpu().numpy()[np.arange(batch)[:, None], nodes]
        expected = np.bitwise_or.accumulate(_single_bits(t)[nodes], axis=1)
        wrong = used & (rows != expected).any(axis=2)
        wrong[:, 1:] |= used[:, 1:] & (nodes[:, 1:] <= nodes[:, :-1])
    if wrong.any():
        b, i = (int(x) for x in np.argwhere(wrong)[0])
        node = int(path[b, i])
        if rows is None:
            saw = list(range(node + 1))
        else:
            saw = [j for j in range(t) if int(rows[b, i, j // 32]) >> (j % 32) & 1]
        raise ValueError(
            f"path: row {b} keeps node {node} at path[{b}, {i}], which saw nodes {saw} of the "
            f"last forward pass, not the path {path[b, : i + 1].tolist()}: an accepted path "
            "runs from the root down the tree, each node a child of the one before"
        )


def check_steer(
    steer: Optional[Any], batch: int, t: int, num_layers: int, hidden: int, device: torch.device
) -> Optional[torch.Tensor]:
    """Validates a forward pass's ``steer`` (vectors added to the residual stream after each
    layer): floating ``[B, L, H]`` (one per row, every token) or ``[B, T, L, H]`` (one per
    token), on the model's device. Returns it as ``[B, 1 or T, L, H]``, or None. Its values are
    not read (no device sync per pass): a non-finite one reaches the logits, as a non-finite
    weight would; the steered drafter checks its vectors once per round."""
    if steer is None:
        return None
    if not isinstance(steer, torch.Tensor):
        raise TypeError(f"steer: expected a torch.Tensor, got {type(steer).__name__}")
    if not steer.dtype.is_floating_point:
        raise TypeError(f"steer: expected a floating dtype, got {steer.dtype}")
    if steer.device != device:
        raise ValueError(f"steer: on {steer.device}, the model on {device}")
    shapes = ([batch, num_layers, hidden], [batch, t, num_layers, hidden])
    if list(steer.shape) not in shapes:
        raise ValueError(
            f"steer: expected shape {shapes[0]} (per row) or {shapes[1]} (per token), "
            f"got {list(steer.shape)}"
        )
    return steer.unsqueeze(1) if steer.dim() == 3 else steer


def check_hidden_indices(output_hidden: Optional[Sequence[int]], num_layers: int) -> list[int]:
    """Normalises hidden-state indices to ``0..L`` (negative ones count from ``L + 1``)."""
    if output_hidden is None:
        return []
    if isinstance(output_hidden, int) or not isinstance(output_hidden, (list, tuple, range)):
        raise TypeError(
            "output_hidden: expected a sequence of layer indices, got "
            f"{type(output_hidden).__name__}"
        )
    out = []
    for i in output_hidden:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"output_hidden: expected ints, got {i!r}")
        i = int(i)
        j = i + num_layers + 1 if i < 0 else i
        if not 0 <= j <= num_layers:
            raise ValueError(
                f"output_hidden: index {i} is outside [-{num_layers + 1}, {num_layers}] "
                f"(0 = embeddings, {num_layers} = last layer)"
            )
        out.append(j)
    return out


def as_lengths(
    value: Union[int, Sequence[int], torch.Tensor], batch: int, name: str = "lengths"
) -> torch.Tensor:
    """int64 ``[B]`` CPU tensor from an int (broadcast), a sequence of ints, or an integer
    tensor or numpy array. Bools and floats are refused (a cast would silently truncate 2.7 to
    2 and read True as 1)."""
    expected = f"{name}: expected an int, a list of ints or an integer tensor"
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(f"{expected}, got {type(value).__name__}")
    if isinstance(value, (int, np.integer)):
        return torch.full((batch,), int(value), dtype=torch.int64)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected an integer array, got {value.dtype}")
        value = torch.from_numpy(value.astype(np.int64))
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INT_DTYPES:
            raise TypeError(f"{name}: expected an integer tensor, got {value.dtype}")
        t = value.detach().to("cpu", torch.int64)
    else:
        try:
            items = list(value)
        except TypeError:
            raise TypeError(f"{expected}, got {type(value).__name__}") from None
        # Refuses bools and floats (TypeError) and ints outside int64 (ValueError).
        t = as_array(items, name, torch.int64)
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name}: expected shape [{batch}], got {list(t.shape)}")
    return t
