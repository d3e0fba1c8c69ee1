"""The static, preallocated KV cache of :class:`~specdecode.models.Transformer`."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

from .. import ops
from ._checks import (
    as_lengths,
    check_accepted_path,
    check_compact_args,
    check_float_dtype,
    check_keep_rows,
    check_positive_int,
)


class KVCache:
    """Keys and values of ``B`` sequences, preallocated for ``max_length`` tokens each.

    Storage is one tensor per kind, ``k``/``v`` of shape ``[L, B, S_max, Hkv, D]``; ``layer(i)``
    gives the contiguous ``[B, S_max, Hkv, D]`` views that ``ops.tree_attention`` reads.

    Invariant: row ``b`` holds ``lengths[b]`` tokens at slots ``0 .. lengths[b] - 1``. Slots past
    ``lengths[b]`` may hold stale values from rolled-back drafts; attention never reads them (the
    kernel sees only ``prefix_lens = lengths`` plus the new tokens, which overwrite those slots).

    A forward pass over ``T`` tokens writes slots ``[lengths[b], lengths[b] + T)`` of every layer
    and then advances ``lengths`` by ``T``; it also remembers where that block started, so that
    :meth:`compact` can keep an accepted path of it.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[torch.device, str, None] = None,
    ) -> None:
        num_layers, batch_size, max_length, num_kv_heads, head_dim = (
            check_positive_int(name, value)
            for name, value in (
                ("num_layers", num_layers),
                ("batch_size", batch_size),
                ("max_length", max_length),
                ("num_kv_heads", num_kv_heads),
                ("head_dim", head_dim),
            )
        )
        check_float_dtype("dtype", dtype)
        device = torch.device(device if device is not None else "cpu")
        shape = (num_layers, batch_size, max_length, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        # Host mirror of the lengths: bounds checks without a device sync.
        self._host_lengths = torch.zeros(batch_size, dtype=torch.int64)
        self._tree_start: Optional[torch.Tensor] = None
        self._tree_size = 0
        # The last forward pass's tree mask (None: a causal chain) and real tokens per row (None:
        # all T), for compact's path check.
        self._tree_mask: Optional[torch.Tensor] = None
        self._tree_real: Optional[torch.Tensor] = None

    # ---- shape -------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def lengths(self) -> torch.Tensor:
        """int32 ``[B]`` on the cache's device: tokens held per row (do not modify in place)."""
        return self._lengths

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of layer ``i``, each ``[B, S_max, Hkv, D]``."""
        return self.k[i], self.v[i]

    # ---- used by the model's forward pass ------------------------------------------------------

    def _begin(self, t: int) -> torch.Tensor:
        """Checks room for ``t`` new tokens per row; returns the slot index ``[B, t]`` (int64)."""
        longest = int(self._host_lengths.max())
        if longest + t > self.max_length:
            raise ValueError(
                f"input_ids: {t} new tokens do not fit the cache: a row holds {longest} of at "
                f"most {self.max_length} tokens (max_length exceeded)"
            )
        steps = torch.arange(t, device=self.device, dtype=torch.int64)
        return self._lengths.long().unsqueeze(1) + steps

    def _commit(
        self,
        t: int,
        tree_mask: Optional[torch.Tensor] = None,
        real: Optional[torch.Tensor] = None,
    ) -> None:
        """Makes the ``t`` tokens written by the forward pass part of every row (``tree_mask``:
        the pass's uint32 ancestor mask, None for a causal chain; ``real``: CPU int64 ``[B]``,
        the real tokens per row, None when all ``t`` are)."""
        self._tree_start = self._lengths.clone()
        self._tree_size = t
        self._tree_mask = tree_mask
        self._tree_real = real
        self._lengths += t
        self._host_lengths += t

    def _forget_tree(self) -> None:
        self._tree_start = None
        self._tree_size = 0
        self._tree_mask = None
        self._tree_real = None

    # ---- rollback ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Empties every row (the storage is kept)."""
        self._lengths.zero_()
        self._host_lengths.zero_()
        self._forget_tree()

    def truncate(self, lengths: Union[int, Sequence[int], torch.Tensor]) -> None:
        """Rolls every row back to ``lengths`` tokens.

        Parameters
        ----------
        lengths : int, sequence of int or integer tensor ``[B]``
            New length per row (an int applies to all rows); ``0 <= lengths[b] <=`` the current
            length of row ``b``.
        """
        new = as_lengths(lengths, self.batch_size)
        if bool((new < 0).any()) or bool((new > self._host_lengths).any()):
            b = int(torch.nonzero((new < 0) | (new > self._host_lengths))[0])
            raise ValueError(
                f"lengths: row {b} cannot be truncated to {int(new[b])}: it holds "
                f"{int(self._host_lengths[b])} tokens (truncate only shortens rows)"
            )
        self._host_lengths.copy_(new)
        self._lengths.copy_(new.to(self.device, torch.int32))
        self._forget_tree()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keeps only the given rows, in the given order (the batch shrinks to ``len(rows)``).

        A decoding loop drops the rows of finished sequences with it, so that later passes cost
        only the running ones. The kept rows' contents and lengths are unchanged; the storage is
        copied (``[L, len(rows), S_max, Hkv, D]`` per kind).

        Parameters
        ----------
        rows : torch.Tensor
            int64 ``[R]`` on the CPU, ``1 <= R``, distinct row indices in ``[0, B)``.

        Raises
        ------
        TypeError, ValueError
            Not an int64 CPU tensor, empty, out of range or repeated; nothing changes then.
        """
        check_keep_rows(rows, self.batch_size)
        on_device = rows.to(self.device)
        self.k = self.k.index_select(1, on_device)
        self.v = self.v.index_select(1, on_device)
        self._lengths = self._lengths.index_select(0, on_device)
        self._host_lengths = self._host_lengths.index_select(0, rows)
        # A pending tree (forward done, not yet compacted) stays compactable on the kept rows.
        if self._tree_start is not None:
            self._tree_start = self._tree_start.index_select(0, on_device)
            if self._tree_mask is not None:
                self._tree_mask = self._tree_mask.index_select(0, on_device)
            if self._tree_real is not None:
                self._tree_real = self._tree_real.index_select(0, rows)

    def compact(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keeps the accepted path of the tree scored by the last forward pass, in place.

        Parameters
        ----------
        path : torch.Tensor
            int32 ``[B, P]``: node indices of the last forward's tree, root first, strictly
            increasing; entries at and after ``num_accepted[b]`` are ignored (-1 padding).
            A path runs from the root down the tree: node ``path[b, i]`` must have attended to
            exactly ``path[b, :i + 1]`` in the last forward pass (its ancestors in the tree mask,
            or ``0..i`` in a chain), so that the kept K/V are those of the kept sequence.
        num_accepted : torch.Tensor
            int32 ``[B]``, ``0 <= num_accepted[b] <= P``: nodes to keep per row.

        After the call row ``b`` holds ``start[b] + num_accepted[b]`` tokens, the kept nodes in
        path order at ``start[b] ..``, where ``start`` is ``lengths`` before the last forward.
        Moves go through :func:`specdecode.ops.compact_kv` (all layers in one call).

        Raises
        ------
        ValueError
            No forward pass since the last truncate/compact, a path node outside that pass's
            ``T`` tokens, a path that does not start at the root or is not a root-to-node path
            of that pass's tree (or chain); nothing is moved then.
        """
        if self._tree_start is None:
            raise ValueError(
                "compact: no tree to compact; call it once right after the forward pass that "
                "scored the tree"
            )
        batch = self.batch_size
        check_compact_args(path, num_accepted, batch, self.device)
        # The checks run on host copies through numpy: [B, P] with P a few dozen at most, where
        # each torch op (and, on a GPU, each synchronising bool()) costs more than the check.
        counts = num_accepted.to("cpu", torch.int64)
        host_counts = counts.numpy()
        host_path = path.cpu().numpy()
        width = path.shape[1]
        if batch and (host_counts.min() < 0 or host_counts.max() > width):
            raise ValueError(
                f"num_accepted: expected values in [0, {width}], got {counts.tolist()}"
            )
        used = np.arange(width)[None, :] < host_counts[:, None]
        if (used & ((host_path < 0) | (host_path >= self._tree_size))).any():
            raise ValueError(
                f"path: an accepted node is outside [0, {self._tree_size}), the tokens of the "
                "last forward pass"
            )
        if self._tree_real is not None:
            padding = used & (host_path >= self._tree_real.numpy()[:, None])
            if padding.any():
                b, i = (int(x) for x in np.argwhere(padding)[0])
                raise ValueError(
                    f"path: row {b} keeps node {int(host_path[b, i])}, a padding token of the "
                    f"last forward pass (num_nodes[{b}] = {int(self._tree_real[b])}), never "
                    "computed"
                )
        check_accepted_path(host_path, host_counts, self._tree_mask, self._tree_size)
        if ((host_path == np.arange(width)[None, :]) | ~used).all():
            # Every row keeps a prefix 0, 1, .. of the block (a chain, an accepted first branch,
            # or the root alone): those entries already sit where compaction would put them, so
            # shortening the rows is the whole move.
            self._lengths.copy_(self._tree_start + num_accepted)
            self._host_lengths.copy_(self._tree_start.to("cpu", torch.int64) + counts)
            self._forget_tree()
            return
        layers = self.num_layers
        s, h, d = self.k.shape[2:]
        # Layers are independent copies of the same layout: fold them into the batch dimension
        # so one call moves every layer (row l * B + b is layer l of sequence b).
        new = ops.compact_kv(
            self.k.view(layers * batch, s, h, d),
            self.v.view(layers * batch, s, h, d),
            self._tree_start.repeat(layers),
            path.repeat(layers, 1).contiguous(),
            num_accepted.repeat(layers),
        )
        self._lengths.copy_(new[:batch])
        self._host_lengths.copy_(self._tree_start.to("cpu", torch.int64) + counts)
        self._forget_tree()
