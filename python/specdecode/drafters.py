"""Drafters: what proposes draft tokens for the target to verify.

The engine drives a drafter through a small protocol, one call per decoding step for the whole
batch. Sequences live in *slots* (``0 <= slot < max_sequences``) for as long as they decode:

* :meth:`Drafter.start` opens slots for new sequences and warms the drafter up with their prompts;
* :meth:`Drafter.propose` returns a draft tree per sequence (:class:`~specdecode.ops.DraftTree`,
  root = the last committed token);
* :meth:`Drafter.observe` hands over the tokens each sequence committed in the step (the accepted
  drafts followed by the bonus or correction token); only committed tokens ever reach a drafter;
* :meth:`Drafter.release` closes slots whose sequences finished.

:class:`CachebackDrafter` implements it with Cacheback's n-gram LRU cache
(:class:`~specdecode.ops.NGramCache`), which needs no model.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from .ops import DraftTree, NGramCache

__all__ = ["CachebackDrafter", "Drafter", "longest_accepted_path"]


@runtime_checkable
class Drafter(Protocol):
    """The protocol the engine uses to get drafts; see the module docstring."""

    def start(self, slots: Sequence[int], prompts: Sequence[Any]) -> None: ...

    def propose(self, slots: Sequence[int]) -> DraftTree: ...

    def observe(self, slots: Sequence[int], committed: Sequence[Any]) -> None: ...

    def release(self, slots: Sequence[int]) -> None: ...


def _slots_array(slots: Sequence[int] | Any, max_sequences: int) -> np.ndarray:
    arr = np.asarray(slots)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"slots: expected a 1-D sequence of ints, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _token_rows(rows: Sequence[Any], name: str, batch: int) -> list[np.ndarray]:
    if len(rows) != batch:
        raise ValueError(f"{name}: expected {batch} rows (one per slot), got {len(rows)}")
    out = []
    for i, row in enumerate(rows):
        arr = row.cpu().numpy() if isinstance(row, torch.Tensor) else np.asarray(row)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"{name}: row {i} must be a 1-D array of token ids, got {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{name}: row {i} has token ids outside [0, 2**31)")
        out.append(arr.astype(np.int32, copy=False))
    return out


class CachebackDrafter:
    """Cacheback drafting: a draft tree per sequence from its own n-gram LRU tables.

    Parameters
    ----------
    cache : NGramCache, optional
        The cache to draft from (one table set per slot, or shared). By default a new
        ``NGramCache(**cache_options)``.
    max_nodes : int
        Nodes per draft tree, the root included (the output width ``N``), 1 to 1024.
    max_depth : int
        Deepest draft level.
    chain : bool
        Draft a single path (the most recent follower at each step) instead of a tree.
    **cache_options
        Passed to :class:`NGramCache` when ``cache`` is not given, e.g. ``leader_len``,
        ``follower_len``, ``tables``, ``max_sequences``, ``static``.

    Notes
    -----
    The drafter keeps the last ``max(leader_len)`` committed tokens of each slot (of the static
    cache's tables too), which is all drafting reads, so :meth:`propose` needs only the slots.
    Drafts never enter the cache: only what :meth:`start` and :meth:`observe` are given.
    """

    def __init__(
        self,
        cache: NGramCache | None = None,
        *,
        max_nodes: int = 16,
        max_depth: int = 8,
        chain: bool = False,
        **cache_options: Any,
    ) -> None:
        if cache is None:
            cache = NGramCache(**cache_options)
        elif cache_options:
            raise TypeError("cache_options are only used when no cache is given")
        if not isinstance(cache, NGramCache):
            raise TypeError(f"cache: expected an NGramCache, got {type(cache).__name__}")
        if cache.frozen:
            raise ValueError("cache: is frozen; pass it as static= of a live cache instead")
        self.cache = cache
        self.max_nodes = int(max_nodes)
        self.max_depth = int(max_depth)
        self.chain = bool(chain)
        if not 1 <= self.max_nodes <= 1024:
            raise ValueError(f"max_nodes: expected 1 to 1024, got {max_nodes}")
        if self.max_depth < 0:
            raise ValueError(f"max_depth: expected >= 0, got {max_depth}")
        lens = [lead for lead, _ in cache.tables]
        if cache.static is not None:
            lens += [lead for lead, _ in cache.static.tables]
        self._keep = max(lens)
        n = cache.max_sequences
        # Right-aligned history of the last _keep committed tokens of every slot.
        self._history = np.zeros((n, self._keep), dtype=np.int32)
        self._history_len = np.zeros(n, dtype=np.int32)
        self._open = np.zeros(n, dtype=bool)

    @property
    def max_sequences(self) -> int:
        return self.cache.max_sequences

    def _check_open(self, slots: np.ndarray, want_open: bool) -> None:
        if slots.size and (slots.min() < 0 or slots.max() >= self.max_sequences):
            raise ValueError(f"slots: expected slots in [0, {self.max_sequences}), got {slots}")
        if len(np.unique(slots)) != slots.size:
            raise ValueError("slots: a slot appears twice")
        bad = slots[self._open[slots] != want_open]
        if bad.size:
            state = "not open (call start first)" if want_open else "already open (release it)"
            raise ValueError(f"slots: slot {int(bad[0])} is {state}")

    def _remember(self, slots: np.ndarray, rows: list[np.ndarray]) -> None:
        k = self._keep
        for slot, row in zip(slots.tolist(), rows):
            if row.size == 0:
                continue
            if row.size >= k:
                self._history[slot] = row[-k:]
            else:
                self._history[slot] = np.concatenate([self._history[slot, row.size :], row])
            self._history_len[slot] = min(k, int(self._history_len[slot]) + row.size)

    def _feed(self, slots: np.ndarray, rows: list[np.ndarray]) -> None:
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum([r.size for r in rows], out=offsets[1:])
        flat = np.concatenate(rows) if rows else np.zeros(0, np.int32)
        self.cache.update(slots, np.ascontiguousarray(flat, dtype=np.int32), offsets)
        self._remember(slots, rows)

    def start(self, slots: Sequence[int], prompts: Sequence[Any]) -> None:
        """Opens slots for new sequences and feeds their prompts (warm start).

        Parameters
        ----------
        slots : sequence of int
            Free slots, distinct.
        prompts : sequence of 1-D int arrays
            Each sequence's prompt, at least one token (the root of the first draft).
        """
        slots_arr = _slots_array(slots, self.max_sequences)
        self._check_open(slots_arr, want_open=False)
        rows = _token_rows(prompts, "prompts", slots_arr.size)
        for i, row in enumerate(rows):
            if row.size == 0:
                raise ValueError(f"prompts: prompt {i} is empty; a sequence needs a first token")
        self.cache.reset(slots_arr)
        self._history_len[slots_arr] = 0
        self._feed(slots_arr, rows)
        self._open[slots_arr] = True

    def propose(self, slots: Sequence[int]) -> DraftTree:
        """Drafts a tree per sequence.

        Returns
        -------
        DraftTree
            ``tokens``/``parents`` int32 ``[B, max_nodes]`` and ``num_nodes`` int32 ``[B]``;
            ``tokens[b, 0]`` is the last committed token of ``slots[b]``.
        """
        slots_arr = _slots_array(slots, self.max_sequences)
        self._check_open(slots_arr, want_open=True)
        lens = self._history_len[slots_arr]
        # Left-align each history (drafting reads the last lens[b] entries of a row).
        contexts = np.zeros((slots_arr.size, self._keep), dtype=np.int32)
        for b, slot in enumerate(slots_arr.tolist()):
            n = int(lens[b])
            contexts[b, :n] = self._history[slot, self._keep - n :]
        return self.cache.draft(
            slots_arr,
            contexts,
            lens.astype(np.int32),
            self.max_nodes,
            self.max_depth,
            chain=self.chain,
        )

    def observe(self, slots: Sequence[int], committed: Sequence[Any]) -> None:
        """Feeds the tokens each sequence committed this step (accepted drafts + bonus).

        Parameters
        ----------
        slots : sequence of int
            Open slots, distinct.
        committed : sequence of 1-D int arrays
            Row ``b`` is what ``slots[b]`` committed, in order (may be empty).
        """
        slots_arr = _slots_array(slots, self.max_sequences)
        self._check_open(slots_arr, want_open=True)
        self._feed(slots_arr, _token_rows(committed, "committed", slots_arr.size))

    def release(self, slots: Sequence[int]) -> None:
        """Closes the slots of finished sequences (their tables are cleared on the next start)."""
        slots_arr = _slots_array(slots, self.max_sequences)
        self._check_open(slots_arr, want_open=True)
        self._open[slots_arr] = False


def longest_accepted_path(tree: DraftTree, row: int, continuation: Sequence[int]) -> list[int]:
    """The longest root path of a draft tree that matches a known continuation (greedy replay).

    The replay oracle used to evaluate drafters offline: the true continuation plays the target,
    so a draft token is accepted iff it equals the next true token.

    Parameters
    ----------
    tree : DraftTree
        Draft trees of a batch.
    row : int
        Which row of the batch.
    continuation : sequence of int
        The true tokens following the root.

    Returns
    -------
    list of int
        The accepted draft tokens (a prefix of ``continuation``), possibly empty.
    """
    n = int(tree.num_nodes[row])
    tokens = tree.tokens[row, :n].tolist()
    parents = tree.parents[row, :n].tolist()
    children: dict[int, list[int]] = {}
    for i in range(1, n):
        children.setdefault(parents[i], []).append(i)
    accepted: list[int] = []
    node = 0
    for tok in continuation:
        nxt = next((c for c in children.get(node, ()) if tokens[c] == tok), None)
        if nxt is None:
            break
        accepted.append(int(tok))
        node = nxt
    return accepted
