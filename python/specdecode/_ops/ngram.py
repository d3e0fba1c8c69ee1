"""Cacheback n-gram drafting: batched LRU tables of token n-grams, native and host-side.

Cacheback ("Cacheback: Speculative Decoding With Nothing But Cache", Ma, Gim, Zhong, EMNLP 2025)
drafts from Least Recently Used tables of n-grams of the tokens a sequence has committed. A
table maps a *leader* (``leader_len`` tokens) to at most ``max_followers`` *followers* (the
``follower_len`` tokens that came after it), with at most ``max_leaders`` leaders, and evicts
least recently used leaders and followers. Drafting looks up the followers of the last tokens,
merges them into a tree, and recurses from the end of each new path.

The cache runs on the host every decoding step; its arrays must be in CPU memory.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import torch

from .. import _C
from .common import as_array, raise_numpy_dtype_error
from .tree import MAX_TREE_NODES

__all__ = ["DraftTree", "NGramCache"]


class DraftTree(NamedTuple):
    """Draft trees of a batch, in the tree format of :func:`specdecode.ops.tree_info`.

    Attributes
    ----------
    tokens : torch.Tensor
        int32 ``[B, N]``: ``tokens[b, 0]`` is the root, the last committed token of sequence
        ``b``; ``tokens[b, i]`` for ``0 < i < num_nodes[b]`` are draft tokens; -1 after that.
    parents : torch.Tensor
        int32 ``[B, N]``: parent node of each node, -1 for the root and for padding; parents come
        before their children.
    num_nodes : torch.Tensor
        int32 ``[B]``: valid nodes per row, at least 1 (the root alone means no draft).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor


def _int_arg(name: str, value: Any, low: int, high: int | None = None) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"{low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected {bound}, got {value}")
    return value


def _int32_array(x: Any, name: str) -> Any:
    """Lists become int32 tensors; arrays go through to the native checks unchanged."""
    if isinstance(x, (list, tuple)):
        return as_array(x, name, torch.int32)
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return torch.tensor([int(x)], dtype=torch.int32)
    return as_array(x, name)


class NGramCache:
    """Cacheback's n-gram LRU cache for a batch of sequences, with a native batched core.

    Parameters
    ----------
    leader_len : int
        Tokens in a leader (the lookup key), 1 to 16. Ignored when ``tables`` is given.
    follower_len : int
        Tokens in a follower (the continuation stored for a leader), 1 to 32. Ignored when
        ``tables`` is given.
    max_leaders : int
        Leaders per table; inserting a new leader into a full table evicts the least recently
        used leader together with its followers.
    max_followers : int
        Followers per leader, 1 to 64; a new follower in a full row evicts the row's least
        recently used follower.
    touch_on_read : bool
        A lookup during :meth:`draft` that finds a leader makes it the most recently used (as in
        the reference implementation). Drafting then changes the cache's recency order.
    max_sequences : int
        Number of sequence slots (``slots`` values are in ``[0, max_sequences)``).
    shared : bool
        One set of tables shared by all slots (each slot still has its own token tail), instead
        of one set per slot.
    static : NGramCache, optional
        A frozen, shared cache built offline (:meth:`build`, or :meth:`load` of a saved one),
        consulted after this cache's own tables to cover the cold start. Never modified.
    tables : sequence of (int, int), optional
        Several tables with different ``(leader_len, follower_len)``, up to 8; their followers
        are merged when drafting, most recent first.

    Notes
    -----
    All memory is allocated by the constructor (:attr:`nbytes`) and never grows.

    Every n-gram of a slot's token stream enters each table exactly once: :meth:`update` slides a
    window of ``leader_len + follower_len`` tokens over the new tokens and remembers the last
    ``max(leader_len + follower_len) - 1`` tokens of each slot (its tail) for the next call.
    Followers carry the stream position at which they were last seen; followers of several
    tables are merged by that position, most recent first (the earlier table wins a tie), and the
    static cache's followers come after the live ones.

    Thread safety: the batched calls release the GIL and thread over the batch. With per-slot
    tables, concurrent calls (from several Python threads) on distinct slots are safe, since
    they touch disjoint memory; a slot may appear at most once per call. With ``shared=True``,
    :meth:`update` and :meth:`draft` hold a lock and walk the batch serially in batch order, so
    concurrent calls are safe and results are deterministic. A frozen cache is read-only and may
    be shared by any number of caches and threads. :meth:`reset`, :meth:`clear`, :meth:`save` and
    :meth:`freeze` must not overlap other calls that use the same slots.
    """

    def __init__(
        self,
        leader_len: int = 1,
        follower_len: int = 2,
        max_leaders: int = 256,
        max_followers: int = 4,
        touch_on_read: bool = True,
        max_sequences: int = 256,
        shared: bool = False,
        static: NGramCache | None = None,
        tables: Sequence[tuple[int, int]] | None = None,
        *,
        _native: Any = None,
    ) -> None:
        if _native is None:
            if tables is None:
                tables = [(leader_len, follower_len)]
            pairs = []
            for i, pair in enumerate(tables):
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise TypeError(
                        f"tables: entry {i} must be a (leader_len, follower_len) pair, got {pair!r}"
                    )
                pairs.append(
                    (
                        _int_arg("leader_len", pair[0], 1, 16),
                        _int_arg("follower_len", pair[1], 1, 32),
                    )
                )
            _native = _C.NGramCache(
                pairs,
                _int_arg("max_leaders", max_leaders, 1, 1 << 24),
                _int_arg("max_followers", max_followers, 1, 64),
                bool(touch_on_read),
                _int_arg("max_sequences", max_sequences, 1, 1 << 20),
                bool(shared),
            )
        self._native = _native
        self._config: dict[str, Any] = dict(_native.config)
        self._config["tables"] = tuple(tuple(p) for p in self._config["tables"])
        self._static: NGramCache | None = None
        if static is not None:
            self.static = static

    # ---- configuration ---------------------------------------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        """The constructor arguments (``tables`` as a tuple of pairs)."""
        return dict(self._config)

    @property
    def tables(self) -> tuple[tuple[int, int], ...]:
        """``(leader_len, follower_len)`` of each table."""
        return self._config["tables"]

    @property
    def max_sequences(self) -> int:
        return self._config["max_sequences"]

    @property
    def nbytes(self) -> int:
        """Bytes of native memory, all allocated up front (the static cache not included)."""
        return int(self._native.nbytes)

    @property
    def frozen(self) -> bool:
        """A frozen cache is never modified: update/reset raise, lookups do not refresh it."""
        return bool(self._native.frozen)

    def freeze(self) -> NGramCache:
        """Makes this cache read-only (for use as a static cache); returns it."""
        self._native.freeze()
        return self

    @property
    def static(self) -> NGramCache | None:
        """The frozen static cache consulted after this cache's own tables, or None."""
        return self._static

    @static.setter
    def static(self, value: NGramCache | None) -> None:
        if self.frozen:
            # Other caches and threads may be drafting from it: it must not change under them.
            raise ValueError("static: this cache is frozen (read-only); set it before freeze()")
        self._attach_static(value)

    def _attach_static(self, value: NGramCache | None) -> None:
        if value is not None and not isinstance(value, NGramCache):
            raise TypeError(f"static: expected an NGramCache or None, got {type(value).__name__}")
        self._native.set_static(None if value is None else value._native)
        self._static = value

    # ---- batched calls -----------------------------------------------------------------------

    def update(self, slots: Any, tokens: Any, offsets: Any) -> None:
        """Feeds newly committed tokens of a batch of sequences into their tables.

        Parameters
        ----------
        slots : int32 ``[B]``
            Distinct slots in ``[0, max_sequences)``.
        tokens : int32 ``[T]``
            The new tokens of all rows, concatenated; token ids ``>= 0``.
        offsets : int32 ``[B + 1]``
            Row ``b``'s tokens are ``tokens[offsets[b]:offsets[b + 1]]``; ``offsets[0] == 0``,
            non-decreasing, ``offsets[B] == T``.

        All arrays are CPU arrays (torch, numpy, DLPack), contiguous, read without a copy.

        Raises
        ------
        TypeError
            A dtype other than int32.
        ValueError
            Wrong shapes, a CUDA array, a slot out of range or repeated, offsets not monotone,
            a negative token id, or a frozen cache.
        """
        slots = _int32_array(slots, "slots")
        tokens = _int32_array(tokens, "tokens")
        offsets = _int32_array(offsets, "offsets")
        try:
            self._native.update(slots, tokens, offsets)
        except ValueError:
            # A numpy array DLPack cannot carry (byte order, object dtype) is a dtype error.
            raise_numpy_dtype_error("dtype int32", slots=slots, tokens=tokens, offsets=offsets)
            raise

    def draft(
        self,
        slots: Any,
        contexts: Any,
        context_lens: Any,
        max_nodes: int,
        max_depth: int,
        *,
        chain: bool = False,
    ) -> DraftTree:
        """Drafts a token tree for each sequence of a batch.

        The followers of the context's last tokens become children of the root (common
        prefixes merged); then the last ``leader_len`` tokens of each new path are the next
        leader, breadth first, until ``max_nodes`` nodes or ``max_depth`` levels. Siblings claim
        the node budget before descendants.

        Parameters
        ----------
        slots : int32 ``[B]``
            Distinct slots in ``[0, max_sequences)``.
        contexts : int32 ``[B, C]``
            Committed tokens of each sequence, left-aligned; only the last
            ``max(leader_len)`` tokens of each context are read (and checked to be ``>= 0``).
            The rows may be a strided view of a larger buffer (last dimension contiguous).
        context_lens : int32 ``[B]``
            Valid tokens per row, ``1 <= context_lens[b] <= C``.
        max_nodes : int
            Width ``N`` of the output, 1 to 1024, the root included.
        max_depth : int
            Deepest draft level (``>= 0``; the root has depth 0).
        chain : bool
            Keep only the most recent follower at each expansion: a single path.

        Returns
        -------
        DraftTree
            ``tokens`` and ``parents`` int32 ``[B, max_nodes]``, ``num_nodes`` int32 ``[B]``,
            CPU torch tensors in the tree format of :func:`specdecode.ops.tree_info`.

        Raises
        ------
        TypeError
            A dtype other than int32.
        ValueError
            Wrong shapes, a CUDA array, a slot out of range or repeated, a context length out of
            range, a negative token id among those read, or bad ``max_nodes`` / ``max_depth``.
        """
        max_nodes = _int_arg("max_nodes", max_nodes, 1, 1024)
        # A tree of max_nodes nodes is never deeper than max_nodes - 1: larger limits are that.
        max_depth = min(_int_arg("max_depth", max_depth, 0), MAX_TREE_NODES)
        slots = _int32_array(slots, "slots")
        contexts = _int32_array(contexts, "contexts")
        context_lens = _int32_array(context_lens, "context_lens")
        batch = int(slots.shape[0]) if hasattr(slots, "shape") and len(slots.shape) == 1 else 0
        # numpy outputs cross DLPack an order of magnitude faster than torch's; torch.from_numpy
        # then shares their memory.
        tokens = np.empty((batch, max_nodes), dtype=np.int32)
        parents = np.empty((batch, max_nodes), dtype=np.int32)
        num_nodes = np.empty((batch,), dtype=np.int32)
        try:
            self._native.draft(
                slots,
                contexts,
                context_lens,
                max_nodes,
                max_depth,
                bool(chain),
                tokens,
                parents,
                num_nodes,
            )
        except ValueError:
            raise_numpy_dtype_error(
                "dtype int32", slots=slots, contexts=contexts, context_lens=context_lens
            )
            raise
        tokens, parents, num_nodes = (torch.from_numpy(a) for a in (tokens, parents, num_nodes))
        return DraftTree(tokens, parents, num_nodes)

    def reset(self, slots: Any) -> None:
        """Starts new sequences in these slots.

        Forgets the slots' tails and, with per-slot tables, their tables; with ``shared=True``
        the shared tables keep what they learnt. ``slots``: int32 ``[B]``, distinct.
        """
        self._reset_slots(slots, keep_tables=False)

    def end_stream(self, slots: Any) -> None:
        """Ends the slots' token streams without forgetting their tables.

        The next :meth:`update` starts a new stream: no n-gram spans the boundary (between two
        documents of a corpus, say). ``slots``: int32 ``[B]``, distinct.
        """
        self._reset_slots(slots, keep_tables=True)

    def _reset_slots(self, slots: Any, keep_tables: bool) -> None:
        # The native reset: a slot's tail is always forgotten, its own tables unless keep_tables.
        slots = _int32_array(slots, "slots")
        try:
            self._native.reset(slots, keep_tables)
        except ValueError:
            raise_numpy_dtype_error("dtype int32", slots=slots)
            raise

    def clear(self) -> None:
        """Forgets every slot's tables and tail."""
        self._native.clear()

    # ---- static tables, files ----------------------------------------------------------------

    @classmethod
    def build(
        cls,
        streams: Iterable[Any],
        leader_len: int = 1,
        follower_len: int = 2,
        max_leaders: int = 65536,
        max_followers: int = 4,
        tables: Sequence[tuple[int, int]] | None = None,
    ) -> NGramCache:
        """Builds a frozen static cache offline from token streams (a corpus).

        Parameters
        ----------
        streams : iterable of 1-D int arrays or lists
            Token streams, e.g. one per document; no n-gram spans two streams.
        leader_len, follower_len, max_leaders, max_followers, tables
            As in :class:`NGramCache`.

        Returns
        -------
        NGramCache
            A frozen cache with one shared table set, ready to pass as ``static=``.
        """
        cache = cls(
            leader_len,
            follower_len,
            max_leaders=max_leaders,
            max_followers=max_followers,
            touch_on_read=False,
            max_sequences=1,
            shared=True,
            tables=tables,
        )
        slot = torch.zeros(1, dtype=torch.int32)
        for i, stream in enumerate(streams):
            if isinstance(stream, torch.Tensor):
                stream = stream.detach().cpu().numpy()
            host = np.asarray(stream)
            if host.ndim != 1:
                raise ValueError(f"streams: stream {i} must be 1-D, got shape {list(host.shape)}")
            if host.size and not np.issubdtype(host.dtype, np.integer):
                raise TypeError(
                    f"streams: stream {i} must hold integer token ids, got {host.dtype}"
                )
            if host.size and int(host.min()) < 0:
                raise ValueError(f"streams: stream {i} has a negative token id")
            if host.size and int(host.max()) > np.iinfo(np.int32).max:
                raise ValueError(f"streams: stream {i} has a token id beyond int32")
            arr = torch.from_numpy(np.ascontiguousarray(host, dtype=np.int32))
            cache.update(slot, arr, torch.tensor([0, arr.numel()], dtype=torch.int32))
            cache.end_stream(slot)
        return cache.freeze()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the cache (configuration, tables, tails) to a versioned binary file.

        The file has a magic, a version, the configuration and an FNV-1a 64 checksum; the static
        cache is not included (save it separately). The format is little-endian.
        """
        data = self._native.to_bytes()
        with open(path, "wb") as f:
            f.write(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str], static: NGramCache | None = None) -> NGramCache:
        """Reads a cache written by :meth:`save`.

        Raises
        ------
        ValueError
            The file is not an n-gram cache file, has an unsupported version, is truncated or
            corrupted (checksum), or is inconsistent.
        """
        with open(path, "rb") as f:
            data = f.read()
        return cls.from_bytes(data, static=static)

    @classmethod
    def from_bytes(cls, data: bytes, static: NGramCache | None = None) -> NGramCache:
        """As :meth:`load`, from the bytes of a file."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data: expected bytes, got {type(data).__name__}")
        native = _C.NGramCache.from_bytes(bytes(data))
        obj = cls(_native=native)
        if static is not None:
            obj._attach_static(static)  # part of loading: a saved frozen cache may take one
        return obj

    def to_bytes(self) -> bytes:
        """The contents :meth:`save` writes."""
        return self._native.to_bytes()

    # ---- introspection -----------------------------------------------------------------------

    def table_state(self, slot: int = 0, table: int = 0) -> list:
        """The contents of one table of one slot (slot 0 for shared tables).

        Returns
        -------
        list
            ``[(leader, [(follower, stamp), ...]), ...]``: leaders from least to most recently
            used; each row's followers most recent first; tokens as tuples of ints; ``stamp`` is
            the position in the slot's (or the shared) stream where the follower was last seen.
        """
        slot = _int_arg("slot", slot, 0, self.max_sequences - 1)
        state = 0 if self._config["shared"] else slot
        return self._native.table_state(state, _int_arg("table", table, 0, len(self.tables) - 1))

    def tail(self, slot: int) -> list[int]:
        """The last tokens of a slot's stream kept for its next :meth:`update`."""
        return list(self._native.tail(_int_arg("slot", slot, 0, self.max_sequences - 1)))

    def __repr__(self) -> str:
        c = self._config
        return (
            f"NGramCache(tables={list(c['tables'])}, max_leaders={c['max_leaders']}, "
            f"max_followers={c['max_followers']}, touch_on_read={c['touch_on_read']}, "
            f"max_sequences={c['max_sequences']}, shared={c['shared']}, frozen={self.frozen}, "
            f"static={'yes' if self._static is not None else 'no'}, nbytes={self.nbytes})"
        )
