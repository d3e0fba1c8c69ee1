"""Drafters: what proposes draft tokens for the target to verify.

The engine drives a drafter through a small protocol, one call per decoding step for the whole
batch. Sequences live in *slots* (``0 <= slot < max_sequences``) for as long as they decode:

* :meth:`Drafter.start` opens slots for new sequences and warms the drafter up with their prompts
  (a call it refuses, for a slot named twice or already open or an empty prompt, opens none);
* :meth:`Drafter.propose` returns a draft tree per sequence (:class:`~specdecode.ops.DraftTree`,
  root = the last committed token);
* :meth:`Drafter.observe` hands over the tokens each sequence committed in the step (the accepted
  drafts followed by the bonus or correction token); only committed tokens ever reach a drafter;
* :meth:`Drafter.release` closes slots whose sequences finished.

A drafter may also set ``proposes_chains = True``: its drafts are chains and :meth:`propose` only
reads its state. The engine may then skip :meth:`propose` on a step where its budget would score
no node of any chain (:class:`~specdecode.engine.CostAwareBudget`); :meth:`observe` still gets
every committed token.

A drafter may also read the target: one that names ``target_hidden`` (hidden-state indices of the
target) and has ``steer(slots, hidden)`` gets the target's states at those layers, at each
sequence's last accepted node, before each :meth:`observe` (a steered draft model, SD²:
:mod:`specdecode.steering`). One that also sets ``target_states = "path"`` and has
``follow(slots, hidden, lengths)`` gets them at every position instead: the prompt's after the
prefill, the root's and the accepted nodes' after each verify pass (SpecFormer's head:
:mod:`specdecode.specformer`).

:class:`CachebackDrafter` implements it with Cacheback's n-gram LRU cache
(:class:`~specdecode.ops.NGramCache`), which needs no model; :class:`ModelDrafter` with a small
draft model; :class:`CombinedDrafter` asks one drafter first and a second one where the first has
nothing.
"""

from __future__ import annotations

import math
from typing import (
    Any,
    Callable,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Union,
    runtime_checkable,
)

import numpy as np
import torch

from . import ops
from .models.protocol import accepts_num_nodes, accepts_steer
from .ops import DraftTree, NGramCache, tree_info

__all__ = [
    "CachebackDrafter",
    "CombinedDrafter",
    "Drafter",
    "ModelDrafter",
    "NoDrafter",
    "SampledDraftTree",
    "SlotSampling",
    "longest_accepted_path",
]


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
    # Checked before the int32 cast, which would wrap 2**32 + s onto slot s.
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= max_sequences):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise ValueError(f"slots: expected slots in [0, {max_sequences}), got {bad}")
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


# Slots any drafter can hold: they cross to native code as int32.
_INT32_SLOTS = int(np.iinfo(np.int32).max)


def _checked_slots(
    slots: Sequence[int] | Any,
    is_open: Callable[[int], bool],
    want_open: bool,
    max_sequences: int = _INT32_SLOTS,
) -> list[int]:
    """``slots`` as distinct ints in ``[0, max_sequences)``, each open or each not yet open as
    ``want_open`` says (the checks of :func:`_new_slots` and :func:`_open_slots`)."""
    slots_l = _slots_array(slots, max_sequences).tolist()
    if len(set(slots_l)) != len(slots_l):
        raise ValueError("slots: a slot appears twice")
    for slot in slots_l:
        if is_open(slot) != want_open:
            state = "not open (call start first)" if want_open else "already open (release it)"
            raise ValueError(f"slots: slot {slot} is {state}")
    return slots_l


def _new_slots(
    slots: Sequence[int] | Any,
    prompts: Sequence[Any],
    is_open: Callable[[int], bool],
    vocab: Optional[int] = None,
    max_sequences: int = _INT32_SLOTS,
) -> tuple[list[int], list[np.ndarray]]:
    """The slots and prompts of a drafter's ``start``, checked in full before the drafter
    changes anything, so a bad call opens no slot: distinct ints in ``[0, max_sequences)`` that
    are not open yet, and one prompt per slot with at least one token (the root of the first
    draft), every id below ``vocab`` where the drafter has one."""
    slots_l = _checked_slots(slots, is_open, False, max_sequences)
    rows = _token_rows(prompts, "prompts", len(slots_l))
    for i, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"prompts: prompt {i} is empty; a sequence needs a first token")
        if vocab is not None and int(row.max()) >= vocab:
            raise ValueError(
                f"prompts: token id {int(row.max())} of prompt {i} is outside the drafter's "
                f"vocabulary [0, {vocab})"
            )
    return slots_l, rows


def _open_slots(slots: Sequence[int] | Any, is_open: Callable[[int], bool]) -> list[int]:
    """The slots of a call on open sequences (propose, observe, release, ...), checked in full
    before the drafter changes anything: distinct ints, every one open."""
    return _checked_slots(slots, is_open, True)


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
        for name, value in (("max_nodes", max_nodes), ("max_depth", max_depth)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {value!r}")
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

    @property
    def proposes_chains(self) -> bool:
        """Whether the drafts are chains (``chain=True``); :meth:`propose` only reads the cache,
        so the engine may skip it (see the module docstring)."""
        return self.chain

    def _check_open(self, slots: np.ndarray, want_open: bool) -> None:
        """``slots`` from _slots_array (in range)."""
        if slots.size > 1 and len(np.unique(slots)) != slots.size:
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
        static = self.cache.static
        if static is not None and max(lead for lead, _ in static.tables) > self._keep:
            # The history kept per slot was sized at construction: such leaders never match.
            raise ValueError(
                "cache: its static cache has leaders longer than the drafter keeps "
                f"({self._keep} tokens): attach the static cache before building the drafter"
            )
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


def _host_int32(x: Any) -> np.ndarray:
    """A drafter's int output (numpy array, torch tensor on any device, nested list) as a
    C-contiguous int32 numpy array on the host."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, dtype=np.int32)
    return np.ascontiguousarray(torch.as_tensor(x).to("cpu", torch.int32).numpy())


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


# ---- drafts that carry the distribution they were sampled from ---------------------------------


class SampledDraftTree(NamedTuple):
    """A :class:`~specdecode.ops.DraftTree` plus the distributions its tokens were sampled from.

    The first three fields are those of ``DraftTree``, so code that reads only the tree treats
    both alike; the engine passes ``draft_probs`` to :func:`specdecode.ops.verify`, which makes
    the verification of *sampled* drafts lossless.

    Attributes
    ----------
    tokens, parents, num_nodes : torch.Tensor
        As in :class:`~specdecode.ops.DraftTree` (int32 ``[B, N]``, ``[B, N]``, ``[B]``).
    draft_probs : torch.Tensor
        float32 ``[B, N, V]``: row ``[b, i]`` is the distribution node ``i``'s children were
        sampled from (zeros for leaves, whose rows are never read).
    draft_deterministic : torch.Tensor or None
        bool ``[B]``: True for a sequence whose children were chosen deterministically although
        the batch carries ``draft_probs`` (:class:`CombinedDrafter` mixing its two drafters);
        its rows of ``draft_probs`` are not read. None (default): every sequence sampled.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    draft_probs: torch.Tensor
    draft_deterministic: Optional[torch.Tensor] = None


# ---- the autoregressive baseline ----------------------------------------------------------------


class NoDrafter:
    """Proposes nothing: every step is one plain autoregressive target step (the baseline).

    Each tree is the root alone, so the engine's verification emits exactly the target's own
    next token, sampled with the same randomness as :func:`specdecode.ops.sample`.
    """

    def __init__(self, max_sequences: int = 1 << 20) -> None:
        self.max_sequences = int(max_sequences)
        self._root: dict[int, int] = {}

    def start(self, slots: Sequence[int], prompts: Sequence[Any]) -> None:
        slots_l, rows = _new_slots(
            slots, prompts, self._root.__contains__, max_sequences=self.max_sequences
        )
        for slot, row in zip(slots_l, rows):
            self._root[slot] = int(row[-1])

    def propose(self, slots: Sequence[int]) -> DraftTree:
        slots_l = _open_slots(slots, self._root.__contains__)
        batch = len(slots_l)
        tokens = torch.tensor([[self._root[s]] for s in slots_l], dtype=torch.int32)
        return DraftTree(
            tokens.reshape(batch, 1),
            torch.full((batch, 1), -1, dtype=torch.int32),
            torch.ones(batch, dtype=torch.int32),
        )

    def observe(self, slots: Sequence[int], committed: Sequence[Any]) -> None:
        slots_l = _open_slots(slots, self._root.__contains__)
        rows = _token_rows(committed, "committed", len(slots_l))
        for slot, row in zip(slots_l, rows):
            if row.size:
                self._root[slot] = int(row[-1])

    def release(self, slots: Sequence[int]) -> None:
        for slot in _open_slots(slots, self._root.__contains__):
            del self._root[slot]


# ---- a draft model ------------------------------------------------------------------------------

# Draft randomness must be independent of the verifier's: both use Philox keyed by (seed, offset),
# so the drafter keys its draws with the sequence's seed moved by an odd constant per depth (the
# verifier uses the seed itself). Within a sequence no two draws share a key.
_DRAFT_SEED_STEP = 0x9E3779B97F4A7C15


def _check_steering(steering: Any, model: Any) -> Any:
    """``steering`` for ``model`` (a DraftSteering sized for it, whose forward takes ``steer``)
    or None."""
    if steering is None:
        return None
    from .steering import DraftSteering

    if not isinstance(steering, DraftSteering):
        raise TypeError(
            f"steering: expected a specdecode.steering.DraftSteering, got {type(steering).__name__}"
        )
    if not accepts_steer(model):
        raise TypeError(
            "steering: the draft model's forward takes no steer= (a steered drafter needs "
            "specdecode.models.Transformer or a model with the same extension)"
        )
    config = getattr(model, "config", None)
    sizes = (getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None))
    if sizes != (steering.draft_layers, steering.draft_hidden_size):
        raise ValueError(
            f"steering: made for a draft model of {steering.draft_layers} layers x "
            f"{steering.draft_hidden_size} hidden, this one has {sizes[0]} x {sizes[1]}"
        )
    return steering.to(model.device).eval()


def _top_probability(logits: torch.Tensor) -> torch.Tensor:
    """The largest softmax probability of each row of float logits ``[B, V]`` -> ``[B]``; rows
    with a non-finite logit give NaN, which compares below every floor."""
    return torch.softmax(logits, dim=-1).amax(dim=-1)


def _draft_seed(seed: torch.Tensor, depth: int) -> torch.Tensor:
    """int64 ``[B]``: the Philox key of depth ``depth``'s draws (wraps modulo 2**64)."""
    step = (_DRAFT_SEED_STEP * (depth + 1)) % (1 << 64)
    out = []
    for s in seed.tolist():
        v = (s + step) % (1 << 64)
        out.append(v - (1 << 64) if v >= 1 << 63 else v)
    return torch.tensor(out, dtype=torch.int64)


class SlotSampling:
    """Per-slot sampling parameters for a drafter that samples its drafts as verify samples the
    target's: the engine passes each sequence's through :meth:`configure`. Subclasses keep their
    open slots' committed tokens in ``self._seq`` (slot -> list of tokens)."""

    _seq: dict[int, list[int]]

    def _init_sampling(self) -> None:
        self._temperature: dict[int, float] = {}
        self._top_k: dict[int, int] = {}
        self._top_p: dict[int, float] = {}
        self._seed: dict[int, int] = {}

    def _reset_sampling(self, slot: int) -> None:
        """A new slot drafts greedily until configured."""
        self._temperature[slot], self._top_k[slot], self._top_p[slot] = 0.0, 0, 1.0
        self._seed[slot] = 0

    def configure(
        self,
        slots: Sequence[int],
        *,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        seed: Sequence[int],
    ) -> None:
        """Sets each slot's sampling parameters (the engine passes the target's)."""
        for i, slot in enumerate(_open_slots(slots, self._seq.__contains__)):
            self._temperature[slot] = float(temperature[i])
            self._top_k[slot] = int(top_k[i])
            self._top_p[slot] = float(top_p[i])
            self._seed[slot] = int(seed[i])

    def _sampling(self, slots: list[int]) -> tuple[torch.Tensor, ...]:
        """(temperature float32, top-k int64, top-p float32, seed int64), each ``[len(slots)]``."""
        t = torch.tensor([self._temperature[s] for s in slots], dtype=torch.float32)
        k = torch.tensor([self._top_k[s] for s in slots], dtype=torch.int64)
        p = torch.tensor([self._top_p[s] for s in slots], dtype=torch.float32)
        seed = torch.tensor([self._seed[s] for s in slots], dtype=torch.int64)
        return t, k, p, seed


class ModelDrafter(SlotSampling):
    """Drafts with an independent small causal LM driven through the CausalLM protocol.

    Parameters
    ----------
    model : CausalLM
        The draft model (e.g. :class:`~specdecode.models.Transformer` or
        :class:`~specdecode.models.HFCausalLM`); its vocabulary must be the target's.
    mode : str
        ``"chain"``: ``k`` tokens, one model step each. ``"tree"``: a dynamic tree (EAGLE-2 style):
        at each depth the ``beam`` nodes of highest cumulative log-probability are expanded with
        their ``branch`` most likely tokens; after ``k`` depths the ``max_nodes - 1`` best nodes
        of all expanded ones form the tree (one tree-attention forward per depth).
    k : int
        Draft depth (``>= 1``).
    sample : bool
        Chain mode: sample each draft token from the drafter's distribution (processed with the
        sequence's temperature / top-k / top-p exactly as verify processes the target's,
        :func:`specdecode.ops.sampling_probs`) and return it as ``draft_probs`` so that
        verification stays lossless; False drafts the argmax. Tree drafts are always the top
        tokens (deterministic children, verified losslessly without ``draft_probs``).
    branch, beam : int
        Tree mode: children per expanded node and nodes expanded per depth.
    max_nodes : int
        Tree mode: nodes of the tree, root included (``2 .. 1024``).
    max_length : int, optional
        Tokens per sequence the drafter's KV cache holds (default: the model's max length).
        Drafts are shortened where a sequence nears it.
    stop_below : float, optional
        A confidence floor in ``(0, 1]`` (BiLD's fallback rule; transformers' assisted
        generation calls it ``assistant_confidence_threshold``): the draft stops where the draft
        model is unsure, so that the target verifies fewer hopeless tokens and the draft model
        runs fewer passes. Chain mode: a sequence's chain ends before the first node at which
        the draft model's largest next-token probability (softmax of its raw logits, before
        temperature / top-k / top-p) is below ``stop_below``, possibly with no draft token at
        all; the decision never depends on a sampled token, so sampled drafts stay lossless.
        Tree mode: a child joins the pool only if its probability given its parent is at least
        ``stop_below``. The passes stop once no sequence has a node left to extend. None (the
        default) drafts ``k`` tokens / depths whatever the confidence.
    steering : specdecode.steering.DraftSteering, optional
        Steers the draft model with the target's hidden states (SD²): the engine asks the target
        for the states at :attr:`target_hidden` in each verify pass and hands those of each
        row's last accepted node to :meth:`steer`; every token the draft model feeds in the next
        round takes the resulting vectors. The model's forward must take ``steer=`` (as
        :class:`~specdecode.models.Transformer`'s does) and have the map's draft sizes. A slot
        not yet steered (a one-token prompt) drafts unsteered.

    Notes
    -----
    The drafter's cache holds, per slot, the sequence's committed tokens except the last (the
    root of the next draft), as the engine's target cache does. Draft tokens written into it
    while drafting are kept only where the committed tokens turn out to equal them (their K/V are
    then exactly what feeding the committed tokens would give); the rest is truncated away when
    :meth:`observe` hands over the committed tokens.
    """

    def __init__(
        self,
        model: Any,
        *,
        mode: str = "chain",
        k: int = 4,
        sample: bool = True,
        branch: int = 4,
        beam: int = 4,
        max_nodes: int = 16,
        max_length: Optional[int] = None,
        stop_below: Optional[float] = None,
        steering: Any = None,
    ) -> None:
        for attr in ("forward", "new_cache", "vocab_size", "max_length", "device"):
            if not hasattr(model, attr):
                raise TypeError(
                    f"model: expected a CausalLM (specdecode.models), it has no {attr!r}"
                )
        if mode not in ("chain", "tree"):
            raise ValueError(f"mode: expected 'chain' or 'tree', got {mode!r}")
        for name, value, lo, hi in (
            ("k", k, 1, 1023),
            ("branch", branch, 1, 64),
            ("beam", beam, 1, 1024),
            ("max_nodes", max_nodes, 2, 1024),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if not lo <= value <= hi:
                raise ValueError(f"{name}: expected {lo} to {hi}, got {value}")
        if stop_below is not None:
            if isinstance(stop_below, bool) or not isinstance(stop_below, (int, float)):
                raise TypeError(
                    f"stop_below: expected a float or None, got {type(stop_below).__name__}"
                )
            if not 0.0 < stop_below <= 1.0:
                raise ValueError(f"stop_below: expected a probability in (0, 1], got {stop_below}")
            stop_below = float(stop_below)
        self.stop_below = stop_below
        self.model = model
        self.steering = _check_steering(steering, model)
        # Row ``slot`` holds that slot's vectors [L, H] for its next round, zeros until the
        # first steer() (one buffer over the cache's rows, handed whole to every pass: rows a
        # pass does not feed are padding, so their vectors are never read).
        self._steer: Optional[torch.Tensor] = None
        # Whether the model's forward skips padding (num_nodes): then the rows a pass does not
        # feed, and the padding of shorter rows, cost it nothing (_forward_rows).
        self._ragged = accepts_num_nodes(model)
        self.mode = mode
        self.k = k
        self.sample = bool(sample)
        self.branch = branch
        self.beam = beam
        self.max_nodes = max_nodes
        self.max_length = int(max_length) if max_length is not None else int(model.max_length)
        if not 2 <= self.max_length <= int(model.max_length):
            raise ValueError(
                f"max_length: expected 2 to the model's max length {model.max_length}, "
                f"got {max_length}"
            )
        self.cache: Any = None
        self._seq: dict[int, list[int]] = {}  # committed tokens per open slot
        self._fed: dict[int, list[int]] = {}  # tokens whose K/V the cache row holds
        self._init_sampling()

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    @property
    def max_sequences(self) -> int:
        return 1 << 20 if self.cache is None or not self._seq else self.cache.batch_size

    @property
    def target_hidden(self) -> Optional[tuple[int, ...]]:
        """The target's hidden-state indices :meth:`steer` reads (None: not steered)."""
        return None if self.steering is None else tuple(self.steering.target_layers)

    @property
    def target_hidden_size(self) -> Optional[int]:
        """The target hidden size the steering map reads (None: not steered)."""
        return None if self.steering is None else int(self.steering.target_hidden_size)

    def steer(self, slots: Sequence[int], hidden: Sequence[torch.Tensor]) -> None:
        """Sets each slot's steering for its next round from the target's states.

        Parameters
        ----------
        slots : sequence of int
            Open slots, ``n`` of them.
        hidden : sequence of torch.Tensor
            One floating ``[n, Ht]`` tensor per index of :attr:`target_hidden`, in that order:
            row ``i`` holds the target's state at slot ``slots[i]``'s last accepted node (the
            node whose distribution gave its newest committed token).
        """
        if self.steering is None:
            raise ValueError("steer: this drafter has no steering (ModelDrafter(steering=...))")
        slots_l = _open_slots(slots, self._seq.__contains__)
        if any(h.dim() != 2 or h.shape[0] != len(slots_l) for h in hidden):
            raise ValueError(
                f"hidden: expected [{len(slots_l)}, Ht] per target layer, got "
                f"{[list(h.shape) for h in hidden]}"
            )
        with torch.no_grad():
            vectors = self.steering(hidden).to(self.model.device, self.model.dtype)
        # Checked once per round here rather than in every pass of the model.
        if not bool(torch.isfinite(vectors).all()):
            raise ValueError("hidden: the target's states give non-finite steering vectors")
        buf = self._steer_buffer()
        buf[torch.tensor(slots_l, device=buf.device)] = vectors

    def _steer_buffer(self) -> torch.Tensor:
        """The steering rows of the cache's rows, made (zeros) for the current cache."""
        rows = self.cache.batch_size
        if self._steer is None or self._steer.shape[0] != rows:
            shape = (rows, self.steering.draft_layers, self.steering.draft_hidden_size)
            self._steer = torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
        return self._steer

    # ---- protocol ------------------------------------------------------------------------------

    def start(self, slots: Sequence[int], prompts: Sequence[Any]) -> None:
        """Opens slots with their prompts (fed lazily, with the first draft)."""
        slots_l, rows = _new_slots(slots, prompts, self._seq.__contains__, self.vocab_size)
        need = max(slots_l, default=-1) + 1
        if self.cache is None or (not self._seq and self.cache.batch_size < need):
            self.cache = self.model.new_cache(max(need, 1), self.max_length)
        elif self.cache.batch_size < need:
            raise ValueError(
                f"slots: slot {need - 1} does not fit the drafter's cache of "
                f"{self.cache.batch_size} rows while other slots are open"
            )
        lengths = self.cache.lengths.to("cpu", torch.int64).clone()
        for slot, row in zip(slots_l, rows):
            self._seq[slot] = row.tolist()
            self._fed[slot] = []
            self._reset_sampling(slot)
            lengths[slot] = 0
        self.cache.truncate(lengths)
        if self.steering is not None:  # new slots draft unsteered until their first steer()
            self._steer_buffer()[torch.tensor(slots_l, device=self.model.device)] = 0

    def observe(self, slots: Sequence[int], committed: Sequence[Any]) -> None:
        """Appends committed tokens and truncates the cache to what still matches them."""
        slots_l = _open_slots(slots, self._seq.__contains__)
        rows = _token_rows(committed, "committed", len(slots_l))
        lengths = self.cache.lengths.to("cpu", torch.int64).clone()
        for slot, row in zip(slots_l, rows):
            seq = self._seq[slot]
            seq.extend(row.tolist())
            fed = self._fed[slot]
            keep = 0
            limit = min(len(fed), len(seq) - 1)
            while keep < limit and fed[keep] == seq[keep]:
                keep += 1
            del fed[keep:]
            lengths[slot] = keep
        self.cache.truncate(lengths)

    def release(self, slots: Sequence[int]) -> None:
        slots_l = _open_slots(slots, self._seq.__contains__)
        lengths = self.cache.lengths.to("cpu", torch.int64).clone() if self.cache else None
        for slot in slots_l:
            del self._seq[slot]
            del self._fed[slot]
            if lengths is not None:
                lengths[slot] = 0
        if lengths is not None:
            self.cache.truncate(lengths)

    def propose(self, slots: Sequence[int]) -> Union[DraftTree, SampledDraftTree]:
        """Drafts a chain or a tree per slot (see the class docstring)."""
        slots_l = _open_slots(slots, self._seq.__contains__)
        if not slots_l:
            empty = torch.zeros((0, 1), dtype=torch.int32)
            return DraftTree(empty, empty.clone(), torch.zeros(0, dtype=torch.int32))
        if self.mode == "chain":
            return self._propose_chain(slots_l)
        return self._propose_tree(slots_l)

    # ---- model steps ---------------------------------------------------------------------------

    def _forward_rows(
        self,
        slots: list[int],
        rows: list[list[int]],
        positions: Optional[list[list[int]]] = None,
        parents: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Feeds ``rows[i]`` to cache row ``slots[i]`` (a chain, or a tree with ``parents``).

        Every cache row takes part in the forward pass (the protocol is batched over the whole
        cache); rows not fed get one padding token that is truncated away again, as are the
        padding tokens of shorter rows. A model that takes ``num_nodes`` (as
        :class:`~specdecode.models.Transformer`) is told each row's real tokens, so that padding
        (rows of finished sequences, rows another drafter serves this step, the tails of shorter
        rows) is not computed. Returns logits ``[len(slots), T, V]`` (zeros at padding).
        """
        cache = self.cache
        before = cache.lengths.to("cpu", torch.int64).clone()
        width = max(len(r) for r in rows)
        total = cache.batch_size
        ids = torch.zeros((total, width), dtype=torch.int64)
        pos = before.unsqueeze(1) + torch.arange(width).unsqueeze(0)
        after = before.clone()
        for i, slot in enumerate(slots):
            ids[slot, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.int64)
            if positions is not None:
                pos[slot, : len(rows[i])] = torch.tensor(positions[i], dtype=torch.int64)
            after[slot] += len(rows[i])
        mask = None
        if parents is not None:
            full = torch.full((total, width), -1, dtype=torch.int32)
            full[:, 0] = -1
            full[slots, : parents.shape[1]] = parents
            mask = tree_info(full).mask
        extra = {}
        if self._ragged:
            real = torch.zeros(total, dtype=torch.int64)
            real[slots] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
            extra["num_nodes"] = real
        device = self.model.device
        if self.steering is not None:
            # The round rule (specdecode.steering): every token fed this round takes its
            # slot's vectors.
            extra["steer"] = self._steer_buffer()
        logits = self.model.forward(
            ids.to(device),
            pos.to(device),
            cache,
            tree_mask=None if mask is None else mask.to(device),
            **extra,
        )
        cache.truncate(after)
        return logits[torch.tensor(slots, device=logits.device)]

    def _room(self, slots: list[int], tree: bool) -> int:
        """Draft depth whose forward passes fit every cache row and position range (0: no pass).

        The drafted rows grow by the root plus the nodes of each depth on top of the committed
        prefix: a chain adds one node per depth; a tree pass its frontier, at depth ``j`` at most
        ``min(beam, branch ** j)`` nodes. Every cache row takes part in each pass, padded to its
        width (``_forward_rows``), so the rows with the most tokens held, drafted this time or
        not, need room for the widest pass: the catch-up, as wide as the most committed tokens a
        slot has not fed, and a tree pass at depth ``d`` (the root and the frontiers of depths
        ``1 .. d``, fed after the root is taken back).
        """
        longest = max(len(self._seq[s]) for s in slots)
        # nodes[d]: the draft nodes of depths 1 .. d, a running sum of the nodes each depth adds
        # (linear in the depth: k may be up to 1023), kept for the depths that fit.
        nodes = [0]
        width = 1
        while len(nodes) <= self.k:
            if tree:
                width = min(self.beam, width * self.branch)
            if longest + nodes[-1] + width > self.max_length:
                break
            nodes.append(nodes[-1] + width)
        depth = len(nodes) - 1
        held = max(len(fed) for fed in self._fed.values())  # the cache's longest row
        pending = max(len(self._seq[s]) - len(self._fed[s]) for s in slots)
        if held + pending > self.max_length:
            return 0
        if tree:
            base = max(held, longest - 1)
            while depth > 1 and base + 1 + nodes[depth - 1] > self.max_length:
                depth -= 1
        return depth

    def _catch_up(self, slots: list[int]) -> torch.Tensor:
        """Feeds each slot's committed tokens missing from its cache, the root included;
        returns the logits at the root ``[B, V]``."""
        pending = [self._seq[s][len(self._fed[s]) :] for s in slots]
        logits = self._forward_rows(slots, pending)
        last = torch.tensor([len(p) - 1 for p in pending], device=logits.device)
        for s, p in zip(slots, pending):
            self._fed[s].extend(p)
        return logits[torch.arange(len(slots), device=logits.device), last]

    def _propose_chain(self, slots: list[int]) -> Union[DraftTree, SampledDraftTree]:
        batch = len(slots)
        roots = [self._seq[s][-1] for s in slots]
        depth = self._room(slots, tree=False)
        temperature, top_k, top_p, seed = self._sampling(slots)
        sampled = self.sample and bool((temperature > 0).any())
        vocab = self.vocab_size
        tokens = torch.full((batch, depth + 1), -1, dtype=torch.int32)
        tokens[:, 0] = torch.tensor(roots, dtype=torch.int32)
        probs = torch.zeros((batch, depth + 1, vocab), dtype=torch.float32) if sampled else None
        # Per row: draft nodes below the root. A row whose processed draft distribution is bad
        # (non-finite logits, or a temperature so small that logits / temperature overflows)
        # draws no token (-1): its chain ends at that node instead of feeding -1 to the model.
        lengths = torch.full((batch,), depth, dtype=torch.int32)
        if depth > 0:
            logits = self._catch_up(slots)
            # Offsets: the sequence's committed length, as the verifier's, with per-depth seeds.
            offset = torch.tensor([len(self._seq[s]) for s in slots], dtype=torch.int64)
            for d in range(depth):
                row_logits = logits.float().cpu()
                if self.stop_below is not None:
                    # The fallback rule: a row unsure of its next token drafts no more. It reads
                    # the raw distribution only, never the draw, so sampling stays lossless.
                    unsure = (_top_probability(row_logits) < self.stop_below) & (lengths > d)
                    lengths[unsure] = d
                if not bool((lengths > d).any()):
                    break  # every chain has ended: no more draws or passes
                if sampled:
                    # The target's processing (verify's), so that agreeing models also agree
                    # after top-k / top-p; the draw follows these rows exactly.
                    q = ops.sampling_probs(row_logits, temperature, top_k, top_p).probs
                    draw = ops.sample(
                        q, 1.0, seed=_draft_seed(seed, d), offset=offset, target_is_logits=False
                    )
                    nxt = draw.tokens
                    probs[:, d] = q
                    bad = (nxt < 0) & (lengths > d)
                    lengths[bad] = d
                else:
                    nxt = row_logits.argmax(dim=1).to(torch.int32)
                tokens[:, d + 1] = torch.where(lengths > d, nxt, -1)
                going = torch.nonzero(lengths > d + 1).squeeze(1).tolist()
                if d + 1 < depth and going:
                    # Only the chains still going are fed (an ended row is padding to a model
                    # that takes num_nodes); the others keep logits they no longer read.
                    fed = [slots[i] for i in going]
                    step = [[int(nxt[i])] for i in going]
                    fresh = self._forward_rows(fed, step)[:, 0]
                    if len(going) == batch:  # every chain goes on (always without a floor)
                        logits = fresh
                    else:
                        logits = logits.clone()
                        rows = torch.tensor(going, device=logits.device)
                        logits[rows] = fresh.to(logits.dtype)
                    for s, x in zip(fed, step):
                        self._fed[s].extend(x)
        parents = ops.chain_parents(batch, depth).to(torch.int32)
        num_nodes = lengths + 1
        if probs is None:
            return DraftTree(tokens, parents, num_nodes)
        return SampledDraftTree(tokens, parents, num_nodes, probs)

    def _propose_tree(self, slots: list[int]) -> DraftTree:
        batch = len(slots)
        roots = [self._seq[s][-1] for s in slots]
        depth_limit = self._room(slots, tree=True)
        # Pool of candidate nodes per row: token, parent (pool index), depth, cumulative log p.
        pool_tok = [[r] for r in roots]
        pool_par = [[-1] for _ in slots]
        pool_dep = [[0] for _ in slots]
        pool_score = [[0.0] for _ in slots]
        frontier = [[0] for _ in slots]
        if depth_limit > 0:
            logits = self._catch_up(slots).float().cpu().unsqueeze(1)  # [B, 1, V]
            # The root's K/V is re-fed with every subtree below (node 0 of each tree pass).
            lengths = self.cache.lengths.to("cpu", torch.int64).clone()
            for s in slots:
                self._fed[s].pop()
                lengths[s] -= 1
            self.cache.truncate(lengths)
        # stop_below as a log-probability floor on each child given its parent.
        floor = None if self.stop_below is None else math.log(self.stop_below)
        for d in range(depth_limit):
            logp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logp, min(self.branch, logp.shape[-1]), dim=-1)
            new_frontier = []
            for b in range(batch):
                cand = []
                for f, node in enumerate(frontier[b]):
                    for j in range(top.indices.shape[2]):
                        if floor is not None and float(top.values[b, f, j]) < floor:
                            break  # this child and the less likely ones after it
                        pool_tok[b].append(int(top.indices[b, f, j]))
                        pool_par[b].append(node)
                        pool_dep[b].append(d + 1)
                        pool_score[b].append(pool_score[b][node] + float(top.values[b, f, j]))
                        cand.append(len(pool_tok[b]) - 1)
                cand.sort(key=lambda i, b=b: -pool_score[b][i])
                new_frontier.append(cand[: self.beam])
            frontier = new_frontier
            if d + 1 == depth_limit or not any(frontier):
                break
            logits = self._score_frontier(slots, pool_tok, pool_par, pool_dep, frontier)
        return self._select(batch, pool_tok, pool_par, pool_dep, pool_score)

    def _score_frontier(self, slots, pool_tok, pool_par, pool_dep, frontier) -> torch.Tensor:
        """One tree-attention pass over root + the frontier and its ancestors; truncated after.

        Returns the frontier's logits ``[B, F, V]`` (F = the widest frontier; short rows padded
        by repeating their last node).
        """
        rows, positions, parent_rows, where = [], [], [], []
        for b, s in enumerate(slots):
            keep: set[int] = {0}
            for node in frontier[b]:
                while node not in keep:
                    keep.add(node)
                    node = pool_par[b][node]
            nodes = sorted(keep)  # pool order: parents before children
            index = {node: i for i, node in enumerate(nodes)}
            rows.append([pool_tok[b][n] for n in nodes])
            base = len(self._fed[s])
            positions.append([base + pool_dep[b][n] for n in nodes])
            parent_rows.append([index.get(pool_par[b][n], -1) for n in nodes])
            where.append([index[n] for n in frontier[b]])
        width = max(len(r) for r in rows)
        parents = torch.full((len(slots), width), -1, dtype=torch.int32)
        for b, pr in enumerate(parent_rows):
            parents[b, : len(pr)] = torch.tensor(pr, dtype=torch.int32)
        before = self.cache.lengths.to("cpu", torch.int64).clone()
        logits = self._forward_rows(slots, rows, positions, parents).float().cpu()
        self.cache.truncate(before)
        # A row whose frontier is empty (stop_below pruned every child) reads the root's
        # logits as padding: with no frontier it expands nothing from them.
        f = max(len(w) for w in where)
        idx = torch.tensor([w + [w[-1] if w else 0] * (f - len(w)) for w in where])
        return logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))

    def _select(self, batch, pool_tok, pool_par, pool_dep, pool_score) -> DraftTree:
        """The best ``max_nodes - 1`` pool nodes per row (plus the root) as a draft tree.

        Ranking by (score desc, depth asc) keeps the set ancestor-closed: a child's cumulative
        log-probability never exceeds its parent's, and a tie ranks the shallower parent first.
        """
        width = min(self.max_nodes, max(len(t) for t in pool_tok))
        tokens = torch.full((batch, width), -1, dtype=torch.int32)
        parents = torch.full((batch, width), -1, dtype=torch.int32)
        num_nodes = torch.zeros(batch, dtype=torch.int32)
        for b in range(batch):
            ranked = sorted(
                range(1, len(pool_tok[b])), key=lambda i, b=b: (-pool_score[b][i], pool_dep[b][i])
            )
            nodes = [0] + sorted(ranked[: self.max_nodes - 1])
            index = {node: i for i, node in enumerate(nodes)}
            for i, node in enumerate(nodes):
                tokens[b, i] = pool_tok[b][node]
                parents[b, i] = index[pool_par[b][node]] if node else -1
            num_nodes[b] = len(nodes)
        return DraftTree(tokens, parents, num_nodes)


# ---- two drafters, the cheap one first ---------------------------------------------------------


def _first_path(parents: np.ndarray, num_nodes: int) -> list[int]:
    """The nodes of a tree's first root path (node 0, then the lowest-index child of each node
    on it), in order; parents in parent-before-child order, ``-1`` for the root."""
    path = [0]
    for i in range(1, num_nodes):
        if parents[i] == path[-1]:
            path.append(i)
    return path


def _cut_to_first_path(b: int, tokens: np.ndarray, parents: np.ndarray, num: np.ndarray) -> None:
    """Row ``b`` of int32 ``[B, N]`` trees (and ``[B]`` node counts) cut to its first root path,
    in place: a chain of the same tokens, padded with -1."""
    path = _first_path(parents[b], int(num[b]))
    chain = tokens[b, path].copy()
    tokens[b] = -1
    parents[b] = -1
    tokens[b, : len(path)] = chain
    parents[b, 1 : len(path)] = np.arange(len(path) - 1, dtype=np.int32)
    num[b] = len(path)


def _cut_rows(
    rows: np.ndarray, tokens: np.ndarray, parents: np.ndarray, num: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int32 ``[B, N]`` trees with the given rows cut to their first root path (in place), as
    tensors no wider than the largest tree left (a cut row's nodes come first)."""
    for b in rows:
        _cut_to_first_path(int(b), tokens, parents, num)
    width = int(num.max()) if rows.size else tokens.shape[1]
    return (
        torch.from_numpy(np.ascontiguousarray(tokens[:, :width])),
        torch.from_numpy(np.ascontiguousarray(parents[:, :width])),
        torch.from_numpy(num),
    )


class CombinedDrafter:
    """A cheap drafter first, a second one for the sequences the first has nothing for.

    The usual pairing is Cacheback first (:class:`CachebackDrafter`: no model, a draft whenever
    the sequence's recent tokens repeat an n-gram seen before) and a draft model second
    (:class:`ModelDrafter`), which then runs only on the steps where the n-gram tables are silent.
    Each step, every sequence takes ``primary``'s tree when it has at least ``min_drafts`` draft
    nodes, else ``fallback``'s, which is asked for those sequences alone. Both drafters see every
    sequence's prompt and committed tokens, so the fallback's state (a model's KV cache) catches
    up on the steps it sat out.

    Parameters
    ----------
    primary, fallback : Drafter
        The two drafters (any objects of the :class:`Drafter` protocol); their vocabularies, where
        they state one, must agree.
    min_drafts : int
        Draft nodes (besides the root) ``primary``'s tree needs to be taken, ``>= 1``.
    mixed_steps : {"path", "tree"}
        What a ``primary`` row of a sequence that samples (temperature > 0, as the engine
        tells :meth:`configure`) keeps: ``"path"`` (default) its tree's first root path,
        ``"tree"`` the whole tree. Siblings proposed by n-gram tables are seldom accepted when
        sampling, and each costs the target a token of its forward pass: on the zoo pair on a
        CPU, at temperature 0.3 and 0.8 and batch 4, whole trees accepted 2 to 6 % more tokens
        per step and gave 3 to 9 % fewer tokens per second (``bench/combined_sampling.py``,
        bench/RESULTS.md, ``## engine``). ``"tree"`` is for targets whose forward pass costs
        little more for more tokens (a large model on a GPU). The rule looks at the row's own
        sequence only, so a row's drafts do not depend on the rest of the batch; greedy rows
        keep their whole trees.

    Notes
    -----
    Lossless like its parts. When ``fallback`` samples its drafts (a :class:`SampledDraftTree`,
    at temperature > 0) and a step mixes sequences of both drafters, the batch is verified with
    ``draft_probs`` for the fallback's rows and ``draft_deterministic`` set for the primary's,
    which :func:`specdecode.ops.verify` then verifies as deterministic drafts (siblings
    included) without reading a draft distribution for them.

    Attributes
    ----------
    counts : dict
        ``{"primary": n, "fallback": n}``: how many sequence-steps took each drafter's tree since
        construction (a step where neither has a draft counts as the primary's).
    """

    def __init__(
        self, primary: Any, fallback: Any, *, min_drafts: int = 1, mixed_steps: str = "path"
    ) -> None:
        for name, drafter in (("primary", primary), ("fallback", fallback)):
            for attr in ("start", "propose", "observe", "release"):
                if not callable(getattr(drafter, attr, None)):
                    raise TypeError(f"{name}: expected a Drafter, it has no {attr}() method")
        if primary is fallback:
            raise ValueError("primary and fallback: expected two different drafters")
        if all(getattr(d, "target_hidden", None) for d in (primary, fallback)):
            raise ValueError("primary and fallback: at most one of them may be steered")
        if isinstance(min_drafts, bool) or not isinstance(min_drafts, int):
            raise TypeError(f"min_drafts: expected an int, got {type(min_drafts).__name__}")
        if min_drafts < 1:
            raise ValueError(f"min_drafts: expected >= 1, got {min_drafts}")
        if mixed_steps not in ("path", "tree"):
            raise ValueError(f"mixed_steps: expected 'path' or 'tree', got {mixed_steps!r}")
        vocabs = {
            name: int(d.vocab_size)
            for name, d in (("primary", primary), ("fallback", fallback))
            if getattr(d, "vocab_size", None) is not None
        }
        if len(set(vocabs.values())) > 1:
            raise ValueError(
                f"primary and fallback: vocabularies of {vocabs['primary']} and "
                f"{vocabs['fallback']} tokens; the two drafters must share one vocabulary"
            )
        self.primary = primary
        self.fallback = fallback
        self.min_drafts = min_drafts
        self.mixed_steps = mixed_steps
        self._vocab = next(iter(vocabs.values()), None)
        self.counts = {"primary": 0, "fallback": 0}
        # Slots whose sequences sample (temperature > 0), from configure().
        self._sampling: set[int] = set()

    @property
    def vocab_size(self) -> Optional[int]:
        return self._vocab

    @property
    def max_sequences(self) -> int:
        caps = [getattr(d, "max_sequences", None) for d in (self.primary, self.fallback)]
        return min((int(c) for c in caps if c is not None), default=1 << 20)

    @property
    def max_nodes(self) -> int:
        caps = [getattr(d, "max_nodes", None) for d in (self.primary, self.fallback)]
        return max((int(c) for c in caps if c is not None), default=ops.MAX_TREE_NODES)

    # ---- protocol ------------------------------------------------------------------------------

    def start(self, slots: Sequence[int], prompts: Sequence[Any]) -> None:
        """Opens the slots in both drafters."""
        self.primary.start(slots, prompts)
        try:
            self.fallback.start(slots, prompts)
        except BaseException:
            self.primary.release(slots)
            raise

    def configure(self, slots: Sequence[int], **sampling: Any) -> None:
        """Hands the sequences' sampling parameters to each drafter that takes them, and notes
        which sequences sample (``temperature`` > 0) for ``mixed_steps="path"``."""
        temperature = sampling.get("temperature")
        if temperature is not None:
            temps = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (len(slots),))
            for s, t in zip(slots, temps.tolist()):
                if t > 0:
                    self._sampling.add(int(s))
                else:
                    self._sampling.discard(int(s))
        for drafter in (self.primary, self.fallback):
            configure = getattr(drafter, "configure", None)
            if callable(configure):
                configure(slots, **sampling)

    def _steered(self) -> Any:
        """The part that reads the target's hidden states (at most one may), or None."""
        parts = [d for d in (self.primary, self.fallback) if getattr(d, "target_hidden", None)]
        return parts[0] if parts else None

    @property
    def target_hidden(self) -> Optional[tuple[int, ...]]:
        """The target's hidden-state indices a steered part reads (None: no steered part)."""
        part = self._steered()
        return None if part is None else part.target_hidden

    @property
    def target_hidden_size(self) -> Optional[int]:
        part = self._steered()
        return None if part is None else getattr(part, "target_hidden_size", None)

    @property
    def target_states(self) -> str:
        """How the part reading the target takes its states: ``"last"`` (:meth:`steer`) or
        ``"path"`` (:meth:`follow`)."""
        part = self._steered()
        return "last" if part is None else getattr(part, "target_states", "last")

    def steer(self, slots: Sequence[int], hidden: Sequence[torch.Tensor]) -> None:
        """Hands the target's states to the steered part (``ModelDrafter.steer``): it is steered
        on every step, also those where the other part's tree is taken."""
        part = self._steered()
        if part is None:
            raise ValueError("steer: neither part of this drafter is steered")
        part.steer(slots, hidden)

    def follow(
        self, slots: Sequence[int], hidden: Sequence[torch.Tensor], lengths: Sequence[int]
    ) -> None:
        """Hands the target's path states to the part that follows them
        (``SpecFormerDrafter.follow``), on every step, also those where the other part's tree
        is taken."""
        part = self._steered()
        if part is None or getattr(part, "target_states", "last") != "path":
            raise ValueError("follow: neither part of this drafter follows the target's path")
        part.follow(slots, hidden, lengths)

    def observe(self, slots: Sequence[int], committed: Sequence[Any]) -> None:
        """Hands the committed tokens to both drafters."""
        self.primary.observe(slots, committed)
        self.fallback.observe(slots, committed)

    def release(self, slots: Sequence[int]) -> None:
        """Closes the slots in both drafters."""
        self._sampling.difference_update(int(s) for s in slots)
        try:
            self.primary.release(slots)
        finally:
            self.fallback.release(slots)

    def propose(self, slots: Sequence[int]) -> Union[DraftTree, SampledDraftTree]:
        """``primary``'s tree per sequence, ``fallback``'s where that has fewer than
        ``min_drafts`` draft nodes.

        Returns
        -------
        DraftTree or SampledDraftTree
            int32 ``tokens`` / ``parents`` ``[B, N]`` and ``num_nodes`` ``[B]``, ``N`` the wider
            of the two drafters' trees; a :class:`SampledDraftTree` (float32 ``draft_probs``
            ``[B, N, V]``, and ``draft_deterministic`` bool ``[B]`` True for the primary's rows)
            when the fallback's trees carry their distributions.
        """
        slots_l = [int(s) for s in slots]
        first = self.primary.propose(slots_l)
        p_tokens = _host_int32(first.tokens)
        p_parents = _host_int32(first.parents)
        p_num = _host_int32(first.num_nodes)
        if getattr(first, "draft_probs", None) is not None:
            raise TypeError("primary: expected deterministic drafts (a DraftTree), got draft_probs")
        if p_tokens.shape[0] != len(slots_l) or p_num.shape != (len(slots_l),):
            raise ValueError(
                f"primary: propose() returned trees for {p_tokens.shape[0]} sequences, "
                f"expected {len(slots_l)}"
            )
        need = np.flatnonzero(p_num - 1 < self.min_drafts)
        cut = np.array([s in self._sampling for s in slots_l], dtype=bool)
        if self.mixed_steps != "path":
            cut[:] = False
        if need.size == 0:
            self.counts["primary"] += len(slots_l)
            if not cut.any():
                return first
            tokens, parents = p_tokens.copy(), p_parents.copy()
            num_nodes = p_num.astype(np.int32, copy=True)
            return DraftTree(*_cut_rows(np.flatnonzero(cut), tokens, parents, num_nodes))
        second = self.fallback.propose([slots_l[i] for i in need])
        f_tokens = _host_int32(second.tokens)
        f_parents = _host_int32(second.parents)
        f_num = _host_int32(second.num_nodes)
        if f_tokens.shape[0] != need.size or f_num.shape != (need.size,):
            raise ValueError(
                f"fallback: propose() returned trees for {f_tokens.shape[0]} sequences, "
                f"expected {need.size}"
            )
        # A fallback tree no larger than the primary's adds nothing (both may have none): keep the
        # primary's.
        use = f_num > p_num[need]
        take = need[use]
        self.counts["fallback"] += int(take.size)
        self.counts["primary"] += len(slots_l) - int(take.size)
        f_probs = getattr(second, "draft_probs", None)
        width = max(p_tokens.shape[1], f_tokens.shape[1] if take.size else 1)
        batch = len(slots_l)
        tokens = np.full((batch, width), -1, dtype=np.int32)
        parents = np.full((batch, width), -1, dtype=np.int32)
        tokens[:, : p_tokens.shape[1]] = p_tokens
        parents[:, : p_parents.shape[1]] = p_parents
        num_nodes = p_num.astype(np.int32, copy=True)
        fw = f_tokens.shape[1]
        tokens[take] = -1
        parents[take] = -1
        tokens[take, :fw] = f_tokens[use]
        parents[take, :fw] = f_parents[use]
        num_nodes[take] = f_num[use]
        cut[take] = False
        tokens_t, parents_t, num_t = _cut_rows(np.flatnonzero(cut), tokens, parents, num_nodes)
        if f_probs is None or take.size == 0:
            return DraftTree(tokens_t, parents_t, num_t)
        deterministic = np.ones(batch, dtype=bool)
        deterministic[take] = False
        tokens, parents = tokens_t.numpy(), parents_t.numpy()
        width = tokens.shape[1]
        f_probs = torch.as_tensor(f_probs)
        vocab = int(f_probs.shape[-1])
        probs = torch.zeros((batch, width, vocab), dtype=torch.float32)
        keep = min(width, int(f_probs.shape[1]))
        probs[torch.from_numpy(take).long(), :keep] = f_probs[
            torch.from_numpy(np.flatnonzero(use)).long(), :keep
        ].float()
        return SampledDraftTree(
            torch.from_numpy(tokens),
            torch.from_numpy(parents),
            torch.from_numpy(num_nodes),
            probs,
            torch.from_numpy(deterministic),
        )
