"""The speculative decoding loop: draft, verify in one target pass, accept, commit, repeat.

:class:`SpeculativeDecoder` drives a target :class:`~specdecode.models.CausalLM` and a drafter
(:mod:`specdecode.drafters`) over a batch of prompts. Every step, for every unfinished sequence:

1. **draft**: the drafter proposes a tree whose root is the last committed token;
2. **tree input**: tokens, positions ``prefix_len + depth`` and the ancestor mask of
   :func:`specdecode.ops.tree_info`;
3. **target forward**: one pass of the target over all trees of the batch;
4. **verify**: :func:`specdecode.ops.verify` walks each tree with the target's logits (and the
   draft probabilities where the drafter sampled) and emits the accepted drafts plus one
   correction or bonus token (with a ``judge``, AutoJudge, the drafts it allows are accepted
   whatever the rule: :mod:`specdecode.judge`);
5. **accept**: the target cache keeps only the root-to-accepted-node path (``cache.compact``);
6. **commit**: emitted tokens are appended, cut at stop tokens and at ``max_new_tokens``;
7. **update drafters**: the drafter observes the committed tokens (never rejected drafts).

Invariant: the target cache of a sequence holds its committed tokens except the last one, which
is the root of the next tree and is scored by the next forward pass.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from . import ops
from ._ops.verify import method_options
from .drafters import Drafter, NoDrafter, _host_int32
from .models.protocol import accepts_num_nodes

__all__ = [
    "AdaptiveBudget",
    "CostAwareBudget",
    "GenerationOutput",
    "GenerationStats",
    "SpeculativeDecoder",
    "generate",
]

_METHODS = ("exact", "block", "greedy", "typical", "relaxed", "topk_accept")
# The options of ops.verify each method reads.
_METHOD_OPTIONS = {
    "exact": (),
    "block": (),
    "greedy": (),
    "typical": ("eps", "alpha"),
    "relaxed": ("eps", "correction"),
    "topk_accept": ("topk_accept",),
}


@dataclasses.dataclass
class GenerationStats:
    """What a :meth:`SpeculativeDecoder.generate` call did.

    Attributes
    ----------
    steps : int
        Decoding steps (target forward passes after the prefill).
    row_steps : int
        Sum over steps of the sequences still running (what the mean below is taken over).
    new_tokens : int
        Tokens generated over all sequences.
    accepted_by_position : list of float
        Entry ``d - 1``: of the row-steps whose draft reached depth ``d``, the fraction in which
        the draft token at depth ``d`` was accepted.
    offered_by_position, accepted_counts_by_position : list of int
        The counts behind ``accepted_by_position``: entry ``d - 1`` is the number of row-steps
        whose draft reached depth ``d``, resp. in which the draft token at depth ``d`` was
        accepted.
    node_budgets : list of int
        Node budget (root included) used at each step: the engine's ``max_nodes``, with an
        :class:`AdaptiveBudget` its choice, with a :class:`CostAwareBudget` the largest tree
        scored.
    draft_time, verify_time, bookkeeping_time, prefill_time, wall_time : float
        Seconds: drafting (propose + tree pruning), the target forward over the trees plus
        :func:`~specdecode.ops.verify`, everything else in the loop (cache compaction, commit,
        drafter updates), the prompt prefill, and the whole call.
    judge_accepted : int
        With a ``judge``: accepted draft tokens that differ from the target's most likely token
        (mismatches the judge let through; under greedy verification, every token it accepted
        that the rule alone would have rejected).
    """

    steps: int = 0
    row_steps: int = 0
    new_tokens: int = 0
    accepted_by_position: list[float] = dataclasses.field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    bookkeeping_time: float = 0.0
    prefill_time: float = 0.0
    wall_time: float = 0.0
    offered_by_position: list[int] = dataclasses.field(default_factory=list, repr=False)
    accepted_counts_by_position: list[int] = dataclasses.field(default_factory=list, repr=False)
    node_budgets: list[int] = dataclasses.field(default_factory=list, repr=False)
    judge_accepted: int = 0

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted, over all sequences and steps."""
        return sum(self.accepted_counts_by_position)

    @property
    def offered_depth(self) -> int:
        """Draft depth offered (sum over row-steps of the draft's depth; a tree offers its
        depth, not its node count): the denominator of :attr:`acceptance_rate`."""
        return sum(self.offered_by_position)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft depth offered (0.0 when nothing was drafted)."""
        offered = self.offered_depth
        return self.accepted_tokens / offered if offered else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per sequence per step (1.0 for plain decoding)."""
        return self.new_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time (all sequences together)."""
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def _record(self, depths: np.ndarray, accepted: np.ndarray) -> None:
        offered, taken = self.offered_by_position, self.accepted_counts_by_position
        deepest = int(depths.max()) if depths.size else 0
        while len(offered) < deepest:
            offered.append(0)
            taken.append(0)
        for d in range(1, deepest + 1):
            offered[d - 1] += int((depths >= d).sum())
            taken[d - 1] += int((accepted >= d).sum())
        pairs = zip(taken, offered)
        self.accepted_by_position = [a / o if o else 0.0 for a, o in pairs]

    def summary(self) -> str:
        """One line: steps, tokens/step, tokens/s and the time split."""
        return (
            f"{self.new_tokens} tokens in {self.steps} steps "
            f"({self.tokens_per_step:.2f} tokens/step, {self.tokens_per_second:.1f} tokens/s); "
            f"prefill {self.prefill_time:.3f}s, draft {self.draft_time:.3f}s, "
            f"verify {self.verify_time:.3f}s, bookkeeping {self.bookkeeping_time:.3f}s"
        )


@dataclasses.dataclass
class GenerationOutput:
    """Result of :meth:`SpeculativeDecoder.generate`.

    Attributes
    ----------
    sequences : list of list of int
        The generated tokens of each prompt (the prompt not included), stop token included.
    finish_reasons : list of str
        Per prompt: ``"stop"`` (a stop/EOS token), ``"length"`` (``max_new_tokens``).
    stats : GenerationStats
        Counters and timings of the call.
    """

    sequences: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats

    def padded(self, pad: int = ops.PAD_TOKEN) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens int64 [B, max_len] padded with pad, lengths int64 [B])``."""
        lengths = torch.tensor([len(s) for s in self.sequences], dtype=torch.int64)
        width = int(lengths.max()) if len(self.sequences) else 0
        out = torch.full((len(self.sequences), width), pad, dtype=torch.int64)
        for b, seq in enumerate(self.sequences):
            out[b, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        return out, lengths


def _per_row(value: Any, name: str, batch: int, kind: type) -> list:
    if isinstance(value, (list, tuple, np.ndarray, torch.Tensor)):
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        if len(items) != batch:
            raise ValueError(f"{name}: expected one value per prompt ({batch}), got {len(items)}")
    else:
        items = [value] * batch
    out = []
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
            raise TypeError(f"{name}: expected a number or one per prompt, got {v!r}")
        if kind is int and not float(v).is_integer():
            raise TypeError(f"{name}: expected ints, got {v!r}")
        out.append(kind(v))
    return out


@dataclasses.dataclass
class _Batch:
    """Loop state: committed tokens and progress of every sequence."""

    tokens: list[list[int]]  # prompt + generated, per row
    prompt_lens: list[int]
    max_new: int
    done: list[bool]
    reasons: list[str]
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    # Batch row held by each row of the target cache, in cache order. All rows at first; the
    # rows of finished sequences are dropped from the cache when it can drop rows (keep_rows).
    rows: list[int] = dataclasses.field(default_factory=list)
    # (rows, device) -> the sampling parameters of those rows on that device, built once per
    # change of the cache's rows instead of indexed and copied every step.
    _sampling: Optional[tuple[tuple, dict[str, torch.Tensor]]] = None
    # Whether the last step scored no draft node (see SpeculativeDecoder._roots_without_proposal).
    scored_roots_only: bool = True

    def sampling_parameters(self, device: torch.device) -> dict[str, torch.Tensor]:
        """temperature, top_k, top_p and seed of the cache's rows, on ``device``."""
        key = (tuple(self.rows), device)
        if self._sampling is None or self._sampling[0] != key:
            rows = torch.tensor(self.rows, dtype=torch.int64)
            params = {
                name: getattr(self, name)[rows].to(device)
                for name in ("temperature", "top_k", "top_p", "seed")
            }
            self._sampling = (key, params)
        return self._sampling[1]

    @property
    def active(self) -> list[int]:
        return [b for b, d in enumerate(self.done) if not d]

    def generated(self, b: int) -> int:
        return len(self.tokens[b]) - self.prompt_lens[b]


@dataclasses.dataclass
class _Tree:
    tokens: torch.Tensor  # int32 [B, N], -1 padding
    parents: torch.Tensor  # int32 [B, N]
    num_nodes: torch.Tensor  # int32 [B]
    draft_probs: Optional[torch.Tensor]  # float [B, N, V] or None
    draft_deterministic: Optional[torch.Tensor]  # bool [B] or None (with draft_probs only)
    depth: torch.Tensor  # int32 [B, N], -1 padding
    mask: torch.Tensor  # uint32 [B, N, W]


# Forward-pass costs measured by AdaptiveBudget, per target model and batch size: a target's cost
# curve does not change between generate() calls, so it is measured once per process.
_MEASURED_COSTS: weakref.WeakKeyDictionary[Any, dict[int, dict[int, float]]] = (
    weakref.WeakKeyDictionary()
)


class AdaptiveBudget:
    """Chooses each step's draft-tree size: the node budget with the most expected tokens per
    second of step time, from acceptance and costs measured while decoding.

    A bigger tree accepts more tokens per target pass but costs more per pass, and where that
    trade lands depends on the drafter, the text, the model, the batch size and the hardware
    (a small target on a CPU is compute-bound over a 16-node tree). This policy measures both
    sides instead of fixing a size:

    * **tokens**: a step whose tree was pruned to its first ``n`` nodes tells what every budget
      ``m <= n`` would have accepted, since nodes are numbered parents first and the accepted
      path of the ``m``-node tree is the part of the accepted path with node index ``< m``. An
      exponential moving average per candidate of ``1 + accepted`` (tokens per row-step) is kept;
      every ``explore_every`` steps the largest candidate is used so the big budgets stay
      measured.
    * **cost**: the target's forward time at each candidate size for the batch size at hand,
      timed once per target model and batch size on the live cache (a few passes that are rolled
      back), plus the measured rest of a step (drafting, verification, bookkeeping), or the
      ``cost`` callable when given (deterministic choices, e.g. for tests).

    The step uses ``argmax_n rows * tokens[n] / (cost(batch, n) + overhead)``. The choice only
    changes which drafts are scored, never what is accepted: greedy outputs are identical to the
    target's, and exact verification keeps the sampled distribution, whatever the budgets.
    With measured costs the budgets (not the greedy tokens) depend on timing.

    Parameters
    ----------
    candidates : sequence of int
        Node budgets (root included) to choose from, each in ``[1, 1024]``; clipped to the
        engine's ``max_nodes`` and the drafter's ``max_nodes`` when it has one.
    explore_every : int
        Use the largest candidate every this many steps (>= 1; 1 always uses it).
    decay : float
        Weight of the past in the moving averages, in ``[0, 1)``.
    cost : callable ``(batch, nodes) -> float``, optional
        Seconds (or any proportional unit) of a step that scores ``nodes`` nodes for each of
        ``batch`` sequences. None: measured (see above).
    """

    def __init__(
        self,
        candidates: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32),
        *,
        explore_every: int = 8,
        decay: float = 0.9,
        cost: Optional[Callable[[int, int], float]] = None,
    ) -> None:
        cands = list(candidates) if isinstance(candidates, (list, tuple, range)) else None
        if not cands or any(isinstance(c, bool) or not isinstance(c, int) for c in cands):
            raise TypeError(
                f"candidates: expected a non-empty sequence of ints, got {candidates!r}"
            )
        if any(not 1 <= c <= ops.MAX_TREE_NODES for c in cands):
            raise ValueError(
                f"candidates: expected values in [1, {ops.MAX_TREE_NODES}], got {cands}"
            )
        if isinstance(explore_every, bool) or not isinstance(explore_every, int):
            raise TypeError(f"explore_every: expected an int, got {explore_every!r}")
        if explore_every < 1:
            raise ValueError(f"explore_every: expected >= 1, got {explore_every}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise ValueError(f"decay: expected a number in [0, 1), got {decay!r}")
        if cost is not None and not callable(cost):
            raise TypeError(f"cost: expected a callable (batch, nodes) -> float, got {cost!r}")
        self.candidates = sorted(set(cands))
        self.explore_every = explore_every
        self.decay = float(decay)
        self.cost = cost
        self._tokens: dict[int, float] = {}  # candidate -> EMA of tokens per row-step
        self._overhead: Optional[float] = None  # EMA of a step's time outside the forward
        self._steps = 0
        self._target_ref: Any = (
            None  # the target of the last choose() (whose costs observe refines)
        )
        self._costs: dict[
            int, dict[int, float]
        ] = {}  # fallback when the target is not weak-refable

    @property
    def expected_tokens(self) -> dict[int, float]:
        """Measured tokens per row-step of each candidate seen so far (a copy)."""
        return dict(self._tokens)

    def _usable(self, limit: int) -> list[int]:
        usable = [c for c in self.candidates if c <= limit]
        return usable or [max(1, limit)]

    def _known_costs(self, target: Any, batch: int) -> dict[int, float]:
        if target is None:
            return {}
        try:
            per_target = _MEASURED_COSTS.setdefault(target, {})
        except TypeError:
            per_target = self._costs
        return per_target.setdefault(batch, {})

    def _forward_costs(self, target: Any, cache: Any, batch: int, sizes: list[int]) -> dict:
        known = self._known_costs(target, batch)
        missing = [n for n in sizes if n not in known]
        if missing:
            known.update(_time_forwards(target, cache, missing))
        return known

    def choose(self, target: Any, cache: Any, rows: int, limit: int) -> int:
        """The budget of the next step for ``rows`` running sequences (``limit``: the most the
        engine and drafter allow)."""
        usable = self._usable(limit)
        step = self._steps
        self._steps += 1
        if step % self.explore_every == 0 or any(n not in self._tokens for n in usable):
            return usable[-1]
        batch = int(cache.batch_size)
        if self.cost is not None:
            costs = {n: float(self.cost(batch, n)) for n in usable}
        else:
            costs = self._forward_costs(target, cache, batch, usable)
        overhead = self._overhead or 0.0
        best, best_rate = usable[-1], -1.0
        for n in usable:
            rate = rows * self._tokens[n] / max(costs[n] + overhead, 1e-12)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def observe(
        self,
        path: torch.Tensor,
        num_accepted: torch.Tensor,
        rows: torch.Tensor,
        budget: int,
        forward_seconds: Optional[float] = None,
        batch: Optional[int] = None,
        target: Any = None,
    ) -> None:
        """Updates the token estimates (and the measured cost of ``budget``) from a verified step.

        Parameters
        ----------
        path : torch.Tensor
            int ``[B, P]`` on the CPU: accepted node indices, root first (``ops.verify``'s path).
        num_accepted : torch.Tensor
            int ``[B]``: accepted draft tokens per row.
        rows : torch.Tensor
            int64 indices of the rows that were running.
        budget : int
            The node budget the step used (its trees held at most that many nodes).
        forward_seconds, batch, target : float, int and CausalLM, optional
            The step's target forward time, cache batch size and target: with measured costs (no
            ``cost`` callable) they refine the cost of ``budget`` for that batch size (a moving
            average, so one slow pass on a busy machine does not fix the choice for good).
        """
        if forward_seconds is not None and batch is not None and self.cost is None:
            known = self._known_costs(target, batch)
            if budget in known:
                known[budget] = self.decay * known[budget] + (1 - self.decay) * forward_seconds
        if rows.numel() == 0:
            return
        path = path[rows].to(torch.int64)
        acc = num_accepted[rows].to(torch.int64)
        j = torch.arange(path.shape[1]).unsqueeze(0)
        on_path = (j >= 1) & (j <= acc.unsqueeze(1))  # [R, P]: accepted draft nodes
        seen = [n for n in self.candidates if n <= budget] or [budget]
        sizes = torch.tensor(seen, dtype=torch.int64)
        # accepted within the first n nodes, per row and candidate: [R, C]
        within = ((path.unsqueeze(-1) < sizes) & on_path.unsqueeze(-1)).sum(dim=1)
        tokens = (1.0 + within.to(torch.float64)).mean(dim=0).tolist()
        for n, value in zip(seen, tokens):
            old = self._tokens.get(n)
            self._tokens[n] = value if old is None else self.decay * old + (1 - self.decay) * value

    def observe_overhead(self, seconds: float) -> None:
        """Updates the moving average of a step's time outside the target's forward pass."""
        old = self._overhead
        self._overhead = seconds if old is None else self.decay * old + (1 - self.decay) * seconds


# Calibrated forward-cost curves of CostAwareBudget, per target and batch size (as for
# AdaptiveBudget: a target's cost curve does not change between generate() calls).
_COST_CURVES: weakref.WeakKeyDictionary[Any, dict[int, _CostCurve]] = weakref.WeakKeyDictionary()
# Interleaved timing rounds of a calibration (each keeps the fastest pass of every size).
_CALIBRATION_ROUNDS = 5


@dataclasses.dataclass
class _CostCurve:
    """Forward seconds of one target pass at a fixed cache batch size ``B``, as a function of
    ``M`` real tokens over all rows and the padded width ``T``:
    ``f(M) + pad * B * max(0, T - ceil(M / B))``, ``f`` piecewise linear through the measured
    points (extrapolated linearly past the last), ``pad`` the cost of one padding query row of
    the attention call (zero when the target computes padding like real tokens: then ``M`` is
    ``B * T``)."""

    batch: int
    points: list[tuple[int, float]]  # (M, seconds), M increasing
    pad: float
    ragged: bool

    def many(self, m: np.ndarray, t: np.ndarray) -> np.ndarray:
        """:meth:`__call__` over arrays (same arithmetic, vectorised)."""
        b = self.batch
        m = np.asarray(m, dtype=np.float64)
        t = np.asarray(t, dtype=np.float64)
        if not self.ragged:
            m = b * t
        extra = self.pad * b * np.maximum(0.0, t - np.ceil(m / b))
        xs = np.array([p[0] for p in self.points], dtype=np.float64)
        ys = np.array([p[1] for p in self.points], dtype=np.float64)
        if xs.size == 1:
            return ys[0] * np.maximum(1.0, m / xs[0]) + extra
        out = np.interp(m, xs, ys)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        beyond = m > xs[-1]
        out[beyond] = ys[-1] + slope * (m[beyond] - xs[-1])
        return out + extra

    def __call__(self, m: int, t: int) -> float:
        b = self.batch
        if not self.ragged:
            m = b * t
        extra = self.pad * b * max(0, t - -(-m // b))
        pts = self.points
        if len(pts) == 1:  # one size measured: cost proportional beyond it
            return pts[0][1] * max(1.0, m / pts[0][0]) + extra
        if m <= pts[0][0]:
            return pts[0][1] + extra
        for (m0, c0), (m1, c1) in zip(pts, pts[1:]):
            if m <= m1:
                return c0 + (c1 - c0) * (m - m0) / (m1 - m0) + extra
        (m0, c0), (m1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) * (m - m1) / (m1 - m0) + extra


def _chain_input(
    target: Any, cache: Any, nodes: torch.Tensor, width: int, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, positions and tree mask of chains of ``nodes[b]`` real tokens per row padded to
    ``width`` after each row's ``lengths[b]`` cached tokens (the input of a timing pass)."""
    batch = int(cache.batch_size)
    parents = ops.chain_parents(batch, width - 1).to(torch.int32)
    idx = torch.arange(width).unsqueeze(0)
    parents = torch.where(idx < nodes.clamp(min=1).unsqueeze(1), parents, -1).to(torch.int32)
    device = target.device
    mask = ops.tree_info(parents).mask.to(device)
    tokens = torch.zeros((batch, width), dtype=torch.int64, device=device)
    positions = (lengths.unsqueeze(1) + torch.arange(width)).to(device)
    return tokens, positions, mask


def _time_passes(
    target: Any,
    cache: Any,
    shapes: Sequence[tuple[torch.Tensor, int]],
    ragged: bool,
    lengths: torch.Tensor,
    rounds: int = _CALIBRATION_ROUNDS,
) -> list[float]:
    """Fastest forward seconds of each ``(nodes, width)`` pass shape on the live cache (every
    pass rolled back).

    The shapes are timed in interleaved rounds (each round times every shape once) and each
    keeps its minimum: noise on a shared machine only ever adds time, and a burst of it hits one
    round of every shape rather than all the passes of one shape, so the minima of the shapes
    are comparable with one another."""
    inputs = [_chain_input(target, cache, nodes, width, lengths) for nodes, width in shapes]
    best = [float("inf")] * len(shapes)
    for _ in range(max(1, rounds)):
        for j, ((nodes, _), (tokens, positions, mask)) in enumerate(zip(shapes, inputs)):
            extra = {"num_nodes": nodes} if ragged else {}
            t0 = time.perf_counter()
            target.forward(tokens, positions, cache, tree_mask=mask, **extra)
            best[j] = min(best[j], time.perf_counter() - t0)
            cache.truncate(lengths)
    return best


def _fit_line(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points replaced by a robust line ``a + b * M`` through them (Theil-Sen: ``b`` the
    median of the pairwise slopes, clipped at 0 since a pass never costs less for more tokens;
    ``a`` the median of ``y - b * M``), values kept ``> 0``.

    A line has two parameters estimated from all the points, and medians ignore a minority of
    bad points, so a size that was timed while the machine was busy (its time too high, noise
    only ever adds) moves neither the curve nor the budget's choice; in a curve through the raw
    points one slow size bends the cost of every size around it."""
    xs = np.array([m for m, _ in points], dtype=np.float64)
    ys = np.array([c for _, c in points], dtype=np.float64)
    if xs.size < 2 or float(np.ptp(xs)) == 0.0:
        return [(int(m), float(ys.min())) for m in xs]
    i, j = np.triu_indices(xs.size, k=1)
    apart = xs[j] != xs[i]
    slopes = (ys[j] - ys[i])[apart] / (xs[j] - xs[i])[apart]
    slope = max(0.0, float(np.median(slopes)))
    intercept = float(np.median(ys - slope * xs))
    floor = max(float(ys.min()), 1e-9) * 1e-3
    return [(int(m), max(intercept + slope * m, floor)) for m in xs]


def _fit_curve(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The calibrated points of a cost curve: :func:`_fit_line` through the passes of two or
    more real tokens, and a one-token pass (``M = 1``) kept as measured, capped at the line's
    first value so that the curve never falls.

    Why apart: one token goes through matrix-vector products, which read each weight once as
    it is, while two or more go through matrix products (a BLAS gemm, or a prepacked oneDNN
    weight: :func:`specdecode.models.transformer._mm_rows`) with costs of their own. On the
    bundled ``pycode`` target at batch 1 the one-token pass took 3.6 ms and the passes of 2 to
    17 tokens lay on a line through 5.3 ms at one token (``bench/RESULTS.md``, ``## e2e``,
    session 14). Fitted with the others, the plain step looked 1.5 times as dear as it is, so a
    draft that is rarely accepted (Cacheback at temperature 1) looked worth scoring."""
    points = list(points)
    if len(points) < 3 or points[0][0] != 1:
        return _fit_line(points)
    line = _fit_line(points[1:])
    return [(1, min(float(points[0][1]), line[0][1]))] + line


def _calibrate(target: Any, cache: Any, max_nodes: int, ragged: bool) -> _CostCurve:
    """Measures a :class:`_CostCurve` on the live cache (every pass rolled back): the fastest of
    interleaved rounds per size, then a monotone line through those of two or more tokens and
    the one-token pass as measured (:func:`_fit_curve`)."""
    batch = int(cache.batch_size)
    lengths = cache.lengths.to("cpu", torch.int64).clone()
    room = int(cache.max_length) - int(lengths.max())
    top = max(1, min(max_nodes, room))
    sizes = sorted({m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if m < batch * top})
    sizes.append(batch * top)
    if not ragged:
        sizes = sorted({batch * n for n in (1, 2, 4, 8, 16, top) if n <= top})
    shapes = []
    for m in sizes:
        # Balanced rows: m real tokens spread as evenly as the width allows.
        nodes = torch.full((batch,), m // batch, dtype=torch.int64)
        nodes[: m % batch] += 1
        shapes.append((nodes, -(-m // batch)))
    ones = torch.ones(batch, dtype=torch.int64)
    padded = ragged and top > 1
    if padded:
        # One real token per row at width `top` against width 1: the padded attention rows.
        shapes += [(ones, 1), (ones, top)]
    times = _time_passes(target, cache, shapes, ragged, lengths)
    points = _fit_curve(list(zip(sizes, times[: len(sizes)])))
    pad = 0.0
    if padded:
        narrow, wide = times[-2], times[-1]
        pad = max(0.0, (wide - narrow) / (batch * (top - 1)))
    return _CostCurve(batch, points, pad, ragged)


class CostAwareBudget:
    """Per-sequence draft sizes that maximise expected tokens per second of a step, from a
    measured cost curve of the target's forward pass and per-depth acceptance.

    Where :class:`AdaptiveBudget` picks one size for every row, this policy gives each running
    sequence its own number of nodes, after the drafts are known: node ``i`` of row ``b`` (at
    depth ``d``) is expected to add ``g = r_b * c(2) * ... * c(d)`` tokens, where ``r_b`` is the
    row's measured rate of accepting its first draft token and ``c(j)`` the measured rate of
    accepting depth ``j`` once depth ``j - 1`` was accepted (all rows together). The nodes of all
    rows, best first (each row's nodes in order, so kept sets stay trees), are cut where
    ``(rows + sum g) / (cost(rows + nodes, width) + overhead)`` peaks. ``cost`` is the target's
    forward time as a function of the real tokens of the pass and its padded width, calibrated
    once per target and batch size on the live cache (rolled-back passes in interleaved rounds,
    a robust line through the fastest pass of each size, the one-token pass apart) and scaled
    online by the ratio of measured to predicted forward times, so a busier machine moves the
    curve; with a target that skips padding (``num_nodes``, as
    :class:`~specdecode.models.Transformer`) rows with poor drafts and finished rows cost
    nothing, so good rows keep long drafts. The
    gains are exact for chains (Cacheback ``chain=True``, a model chain) and a depth-only
    approximation for trees.

    Exploration needs no schedule: the counts behind ``r_b`` and ``c(j)`` decay every step
    towards optimistic priors, so depths that were cut for a while look promising again and get
    scored. The choice only changes which drafts are scored, never what is accepted.

    Parameters
    ----------
    decay : float
        Per-step weight of the past in the acceptance counts, in ``[0, 1)``.
    prior : float
        Prior acceptance rate of the first depth, in ``(0, 1]`` (optimism drives exploration);
        each deeper depth's prior is the estimate of the depth above it.
    prior_weight : float
        Pseudo-count of the prior (> 0); a row's first-token rate starts from the global one
        with this weight.
    cost : callable ``(batch, real_tokens, width) -> float``, optional
        Forward seconds of a pass with ``real_tokens`` real tokens in a ``batch x width``
        layout. None: calibrated (see above).
    """

    def __init__(
        self,
        *,
        decay: float = 0.95,
        prior: float = 0.7,
        prior_weight: float = 1.0,
        cost: Optional[Callable[[int, int, int], float]] = None,
    ) -> None:
        for name, value, ok in (
            ("decay", decay, lambda v: 0 <= v < 1),
            ("prior", prior, lambda v: 0 < v <= 1),
            ("prior_weight", prior_weight, lambda v: v > 0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}: expected a number, got {value!r}")
            if not math.isfinite(value) or not ok(value):
                raise ValueError(f"{name}: out of range, got {value!r}")
        if cost is not None and not callable(cost):
            raise TypeError(
                f"cost: expected a callable (batch, real_tokens, width) -> float, got {cost!r}"
            )
        self.decay = float(decay)
        self.prior = float(prior)
        self.prior_weight = float(prior_weight)
        self.cost = cost
        self._depth_acc = np.zeros(2, dtype=np.float64)  # index j: depth j (j >= 1)
        self._depth_off = np.zeros(2, dtype=np.float64)
        self._row_acc: dict[int, float] = {}
        self._row_off: dict[int, float] = {}
        self._scale = 1.0  # measured forward time / the curve's (moving average)
        self._overhead: Optional[float] = None
        self._curve: Optional[_CostCurve] = None
        self._last_prediction: Optional[float] = None

    # ---- estimates ---------------------------------------------------------------------------

    def _rates(self, depth: int) -> np.ndarray:
        """Acceptance rate of depths ``0..depth`` (entry 0 unused) with the prior mixed in.

        Depth 1 starts from ``prior``; each deeper depth from the estimate of the depth above.
        A depth is observed only when the one above was accepted, so at low acceptance the deep
        counts stay empty: with a fixed prior they would keep promising long chains that the
        shallow depths have already shown not to pay."""
        self._grow(depth)
        w = self.prior_weight
        rates = np.zeros(depth + 1)
        mean = self.prior
        for j in range(1, depth + 1):
            mean = (self._depth_acc[j] + w * mean) / (self._depth_off[j] + w)
            rates[j] = mean
        return rates

    def _grow(self, depth: int) -> None:
        if depth + 1 > self._depth_acc.size:
            extra = depth + 1 - self._depth_acc.size
            self._depth_acc = np.concatenate([self._depth_acc, np.zeros(extra)])
            self._depth_off = np.concatenate([self._depth_off, np.zeros(extra)])

    def row_rate(self, row: int) -> float:
        """Estimated rate at which ``row`` accepts its first draft token."""
        w = self.prior_weight
        first = float(self._rates(1)[1])
        acc, off = self._row_acc.get(row, 0.0), self._row_off.get(row, 0.0)
        return (acc + w * first) / (off + w)

    def expected_gains(
        self, rows: Sequence[int], depth: Union[torch.Tensor, np.ndarray]
    ) -> np.ndarray:
        """float64 ``[R, N]``: expected tokens each node adds (0 for the root and padding),
        made non-increasing along each row so that best-first order keeps row prefixes.
        ``depth``: int ``[R, N]`` node depths (-1: padding), a CPU tensor or numpy array."""
        d = np.asarray(depth, dtype=np.int64)
        deepest = int(d.max()) if d.size else 0
        rates = self._rates(max(deepest, 1))
        # along[j] = c(2) * ... * c(j) for j >= 1 (1 at depth 1), 0 at depth 0 and padding.
        along = np.zeros(deepest + 2)
        if deepest >= 1:
            along[1 : deepest + 1] = np.cumprod(np.concatenate([[1.0], rates[2 : deepest + 1]]))
        first = np.array([self.row_rate(b) for b in rows], dtype=np.float64)
        gains = first[:, None] * along[np.clip(d, 0, None)]
        gains[d <= 0] = 0.0
        gains[:, 1:] = np.minimum.accumulate(gains[:, 1:], axis=1) if gains.shape[1] > 1 else 0
        return gains

    # ---- the choice ----------------------------------------------------------------------------

    def _predict(self, batch: int, m: int, t: int) -> float:
        if self.cost is not None:
            return float(self.cost(batch, m, t))
        assert self._curve is not None
        return self._scale * self._curve(m, t)

    def _predict_many(self, batch: int, m: np.ndarray, t: np.ndarray) -> np.ndarray:
        """:meth:`_predict` over arrays of real-token counts and widths."""
        if self.cost is not None:
            return np.array([float(self.cost(batch, int(a), int(b))) for a, b in zip(m, t)])
        assert self._curve is not None
        return self._scale * self._curve.many(m, t)

    def allocate(
        self,
        target: Any,
        cache: Any,
        rows: Sequence[int],
        num_nodes: Union[torch.Tensor, np.ndarray],
        depth: Union[torch.Tensor, np.ndarray],
        ragged: bool,
        limit: Optional[int] = None,
    ) -> torch.Tensor:
        """Node limits of the running rows.

        Parameters
        ----------
        target, cache : CausalLM and its cache
            For the calibration of the cost curve (rolled-back passes on the live cache).
        rows : sequence of int
            The running rows (batch indices).
        num_nodes : torch.Tensor or numpy.ndarray
            int ``[R]`` on the CPU: nodes of each running row's draft (root included).
        depth : torch.Tensor or numpy.ndarray
            int ``[R, N]`` on the CPU: node depths of those drafts (-1: padding or a node that
            may not be scored).
        ragged : bool
            Whether the target skips padding (then a pass costs its real tokens).
        limit : int, optional
            The most nodes per row any step may score (the calibration covers it); default the
            width of ``depth``.

        Returns
        -------
        torch.Tensor
            int32 ``[R]``: per running row, keep the nodes of index below this (the root
            always), ``1 <= .. <= num_nodes``.
        """
        batch = int(cache.batch_size)
        depth = np.asarray(depth, dtype=np.int64)
        num_nodes = np.asarray(num_nodes, dtype=np.int64)
        r, n = depth.shape
        self._ensure_curve(target, cache, batch, n, limit, ragged)
        gains = self.expected_gains(rows, depth)
        valid = np.arange(n)[None, :] < num_nodes[:, None]
        gains[~valid | (depth < 0)] = -1.0
        gains[:, 0] = -1.0
        flat = gains.reshape(-1)
        order = np.argsort(-flat, kind="stable")
        order = order[flat[order] >= 0]
        widths = np.concatenate([[1], np.maximum.accumulate(order % n + 1)]).astype(np.int64)
        best_k = self._best_cut(batch, r, flat[order], widths, ragged)
        # Per row: one past the last chosen node index (node order; the chosen nodes of a row
        # are its first valid ones, since gains do not increase along a row).
        limits = np.ones(r, dtype=np.int64)
        if best_k:
            np.maximum.at(limits, order[:best_k] // n, order[:best_k] % n + 1)
        return torch.from_numpy(limits.astype(np.int32))

    def chain_pays(
        self, target: Any, cache: Any, row: int, nodes: int, ragged: bool, limit: int
    ) -> bool:
        """Whether :meth:`allocate` would score any node of a chain of ``nodes`` nodes (root
        included) drafted for ``row``, the only row of a batch-1 cache; the same answer
        without a draft (a chain's gains depend on its depths only) and without sorting (they
        do not increase along it). Arguments as :meth:`allocate`'s."""
        batch = int(cache.batch_size)
        self._ensure_curve(target, cache, batch, nodes, limit, ragged)
        depth = np.arange(nodes, dtype=np.int64)[None, :]
        gains = self.expected_gains([row], depth)[0, 1:]
        widths = np.arange(1, nodes + 1, dtype=np.int64)
        return self._best_cut(batch, 1, gains, widths, ragged) > 0

    def _ensure_curve(
        self, target: Any, cache: Any, batch: int, n: int, limit: Optional[int], ragged: bool
    ) -> None:
        """Calibrates the cost curve of ``target`` at this batch size where none covers ``n``
        nodes per row yet (a given ``cost`` needs none)."""
        if self.cost is not None or (self._curve is not None and self._curve.batch == batch):
            return
        try:
            per_target = _COST_CURVES.setdefault(target, {})
        except TypeError:
            per_target = {}
        curve = per_target.get(batch)
        top = max(n, limit or 1, 1)
        if curve is None or curve.points[-1][0] < batch * n:
            curve = per_target[batch] = _calibrate(target, cache, top, ragged)
        self._curve = curve

    def _best_cut(
        self, batch: int, rows: int, gains: np.ndarray, widths: np.ndarray, ragged: bool
    ) -> int:
        """How many of the candidate nodes to score: ``gains`` float64 ``[K]`` best first,
        ``widths`` int64 ``[K + 1]`` the padded width once the first ``k`` are scored (1 for
        ``k = 0``, the roots alone). Keeps the prediction of the chosen pass for
        :meth:`observe`."""
        totals = rows + np.concatenate([[0.0], np.cumsum(gains)])
        base = rows if ragged else batch
        real = base + np.arange(gains.size + 1) if ragged else batch * widths
        costs = self._predict_many(batch, real, widths)
        rates = totals / np.maximum(costs + (self._overhead or 0.0), 1e-12)
        best_k = int(np.argmax(rates))  # first maximum: the fewest nodes among equals
        self._last_prediction = self._predict(batch, int(real[best_k]), int(widths[best_k]))
        return best_k

    def observe(
        self,
        rows: Sequence[int],
        depth: Sequence[int],
        accepted: Sequence[int],
        forward_seconds: Optional[float] = None,
    ) -> None:
        """Updates the acceptance counts from a verified step.

        Parameters
        ----------
        rows : sequence of int
            The running rows.
        depth : sequence of int
            Depth of each running row's scored draft (0: the root alone).
        accepted : sequence of int
            Accepted draft tokens of each running row.
        forward_seconds : float, optional
            The step's forward time: refines the scale of the calibrated cost curve.
        """
        g = self.decay
        self._depth_acc *= g
        self._depth_off *= g
        for b in list(self._row_acc):
            self._row_acc[b] *= g
            self._row_off[b] *= g
        for b, dep, acc in zip(rows, depth, accepted):
            dep, acc = int(dep), int(acc)
            if dep < 1:
                continue
            self._grow(dep)
            self._row_off[b] = self._row_off.get(b, 0.0) + 1.0
            self._row_acc[b] = self._row_acc.get(b, 0.0) + float(acc >= 1)
            # Depth j is observed when it was offered and depth j - 1 was accepted.
            top = min(dep, acc + 1)
            self._depth_off[1 : top + 1] += 1.0
            self._depth_acc[1 : min(acc, dep) + 1] += 1.0
        predicted = self._last_prediction
        if forward_seconds is not None and predicted and self.cost is None:
            # predicted already carries the scale: the scale that would have predicted this
            # pass is scale * ratio, and the average moves towards that (moving towards the
            # ratio itself would settle on the square root of the true scale).
            ratio = min(max(forward_seconds / predicted, 0.25), 4.0)
            self._scale = 0.9 * self._scale + 0.1 * self._scale * ratio

    def observe_overhead(self, seconds: float) -> None:
        """Updates the moving average of a step's time outside the target's forward pass."""
        old = self._overhead
        self._overhead = seconds if old is None else 0.9 * old + 0.1 * seconds

    def reset_rows(self, rows: Sequence[int]) -> None:
        """Forgets the per-row rates of ``rows`` (new sequences in those slots)."""
        for b in rows:
            self._row_acc.pop(int(b), None)
            self._row_off.pop(int(b), None)


def _time_forwards(target: Any, cache: Any, sizes: Sequence[int]) -> dict[int, float]:
    """Seconds of one target forward over a chain of ``n`` nodes per row for each ``n``, on the
    live cache (rolled back after each pass); the fastest of 3 passes."""
    batch = int(cache.batch_size)
    lengths = cache.lengths.to("cpu", torch.int64).clone()
    room = int(cache.max_length) - int(lengths.max())
    device = target.device
    out: dict[int, float] = {}
    for n in sizes:
        if n > room:
            out[n] = float("inf")
            continue
        parents = ops.chain_parents(batch, n - 1).to(torch.int32)
        mask = ops.tree_info(parents).mask.to(device)
        tokens = torch.zeros((batch, n), dtype=torch.int64, device=device)
        positions = (lengths.unsqueeze(1) + torch.arange(n)).to(device)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            target.forward(tokens, positions, cache, tree_mask=mask)
            best = min(best, time.perf_counter() - t0)
            cache.truncate(lengths)
        out[n] = best
    return out


def _check_verify_options(method: str, options: dict[str, Any]) -> None:
    """The lossy methods' options, checked before any work: each must be one the method reads,
    with the ranges :func:`specdecode.ops.verify` takes."""
    for name in options:
        if name not in _METHOD_OPTIONS[method]:
            users = [m for m, names in _METHOD_OPTIONS.items() if name in names]
            raise ValueError(
                f"{name}: method={method!r} does not use it (it is an option of "
                f"{' and '.join(repr(m) for m in users)})"
            )
    method_options(method, options.get("eps"), options.get("alpha"), options.get("topk_accept"))
    correction = options.get("correction", "residual")
    if correction not in ("residual", "target"):
        raise ValueError(f"correction: expected 'residual' or 'target', got {correction!r}")


class SpeculativeDecoder:
    """Speculative decoding of a target model with a drafter, for batches of prompts.

    Parameters
    ----------
    target : CausalLM
        The model whose output distribution is preserved (:class:`~specdecode.models.Transformer`,
        :class:`~specdecode.models.HFCausalLM` or any :class:`~specdecode.models.CausalLM`).
    drafter : Drafter, optional
        Proposes draft trees (:mod:`specdecode.drafters`); default :class:`NoDrafter` (plain
        autoregressive decoding through the same loop). A steered drafter (one that names
        ``target_hidden`` layers and has ``steer(slots, hidden)``, as a
        :class:`~specdecode.drafters.ModelDrafter` with ``steering=``) gets the target's states
        at those layers: after the prefill, at each prompt's last prefilled position, and after
        every verify pass, at each running row's last accepted node (:mod:`specdecode.steering`).
        One with ``target_states = "path"`` and ``follow(slots, hidden, lengths)`` (a
        :class:`~specdecode.specformer.SpecFormerDrafter`) gets them at every prefilled position
        and at each running row's root and accepted nodes (:mod:`specdecode.specformer`).
    method : str
        Verification rule of :func:`specdecode.ops.verify`: ``"exact"`` (lossless, default),
        ``"block"`` (lossless block verification: sampled chains keep at least as many drafts
        per step in expectation; other drafts are verified as by ``"exact"``), ``"greedy"``, or
        the lossy ``"typical"``, ``"relaxed"``, ``"topk_accept"``. Sequences with temperature 0
        are verified greedily whatever the method.
    max_nodes : int
        Largest tree (root included) scored per sequence and step; bigger drafts are pruned
        (the target cache reserves this many slots beyond the longest sequence).
    progress : bool
        Show a progress bar of generated tokens (tqdm if installed, else a line on stderr).
    budget : AdaptiveBudget or CostAwareBudget, optional
        Chooses the node budget of every step (at most ``max_nodes``): one for all rows
        (:class:`AdaptiveBudget`) or one per row (:class:`CostAwareBudget`); None: every step
        may use ``max_nodes`` nodes.
    judge : object with ``allow(hidden, logits, tokens, parents)``, optional
        A judge of mismatches (:class:`specdecode.judge.TokenJudge`, AutoJudge): the target is
        asked for its last hidden state in every verify pass, and the nodes the judge allows are
        accepted whatever the method says (:func:`specdecode.ops.verify`'s ``allow``). Lossy by
        design; meant for ``method="greedy"`` (or temperature 0). The judge must come from
        this target (its features have the target's hidden size).
    **verify_options
        ``eps``, ``alpha``, ``topk_accept``, ``correction`` for the lossy methods (see
        :func:`specdecode.ops.verify`), checked here: an option the method does not read, or
        one out of range, raises ValueError.
    """

    def __init__(
        self,
        target: Any,
        drafter: Optional[Drafter] = None,
        *,
        method: str = "exact",
        max_nodes: int = 64,
        progress: bool = False,
        budget: Union[AdaptiveBudget, CostAwareBudget, None] = None,
        judge: Any = None,
        **verify_options: Any,
    ) -> None:
        for attr in ("forward", "new_cache", "vocab_size", "max_length", "device"):
            if not hasattr(target, attr):
                raise TypeError(
                    f"target: expected a CausalLM (specdecode.models), it has no {attr!r}"
                )
        if drafter is None:
            drafter = NoDrafter()
        for attr in ("start", "propose", "observe", "release"):
            if not callable(getattr(drafter, attr, None)):
                raise TypeError(f"drafter: expected a Drafter, it has no {attr}() method")
        if method not in _METHODS:
            raise ValueError(f"method: expected one of {list(_METHODS)}, got {method!r}")
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int):
            raise TypeError(f"max_nodes: expected an int, got {type(max_nodes).__name__}")
        if not 1 <= max_nodes <= ops.MAX_TREE_NODES:
            raise ValueError(f"max_nodes: expected 1 to {ops.MAX_TREE_NODES}, got {max_nodes}")
        unknown = set(verify_options) - {"eps", "alpha", "topk_accept", "correction"}
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        _check_verify_options(method, verify_options)
        drafter_vocab = getattr(drafter, "vocab_size", None)
        if drafter_vocab is not None and int(drafter_vocab) != int(target.vocab_size):
            raise ValueError(
                f"drafter: its vocabulary has {drafter_vocab} tokens, the target's "
                f"{target.vocab_size}; drafter and target must share one vocabulary"
            )
        if budget is not None and not isinstance(budget, (AdaptiveBudget, CostAwareBudget)):
            raise TypeError(
                f"budget: expected an AdaptiveBudget, a CostAwareBudget or None, got {budget!r}"
            )
        if judge is not None and method == "block":
            raise ValueError(
                "judge: method='block' judges each chain as one block, a judge's single nodes "
                "cannot be allowed in it; use method='greedy' (or 'exact') with a judge"
            )
        if judge is not None and not callable(getattr(judge, "allow", None)):
            raise TypeError(
                f"judge: expected an object with allow(hidden, logits, tokens, parents) "
                f"(specdecode.judge.TokenJudge), got {judge!r}"
            )
        self.target = target
        self.drafter = drafter
        self.budget = budget
        self.judge = judge
        self.method = method
        self.max_nodes = max_nodes
        self.progress = bool(progress)
        self.verify_options = verify_options
        self._steer_layers = _steer_layers(drafter, target)
        # "path": the drafter follows the target's states at every accepted node (SpecFormer);
        # "last": only at each row's last accepted node (a steered draft model).
        self._follow_path = getattr(drafter, "target_states", "last") == "path"
        # A target that skips padding tokens (num_nodes=) does no work for the unused nodes of
        # short drafts and of finished rows.
        self._ragged = accepts_num_nodes(target)

    # ---- request validation ------------------------------------------------------------------

    def _check_request(
        self, prompts: Any, max_new_tokens: int, stop_token_ids: Optional[Iterable[int]]
    ) -> tuple[list[list[int]], set[int]]:
        if isinstance(prompts, (torch.Tensor, np.ndarray)):
            if prompts.ndim != 2:
                raise ValueError(f"prompts: expected a [B, T] array, got {list(prompts.shape)}")
            prompts = prompts.tolist()
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: expected a non-empty list of token id lists")
        if all(isinstance(t, (int, np.integer)) for t in prompts):
            raise TypeError("prompts: expected a list of prompts (a list of token id lists)")
        vocab = int(self.target.vocab_size)
        rows = []
        for i, p in enumerate(prompts):
            row = p.tolist() if isinstance(p, (torch.Tensor, np.ndarray)) else list(p)
            if not row:
                raise ValueError(f"prompts: prompt {i} is empty; a sequence needs a first token")
            for t in row:
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise TypeError(f"prompts: prompt {i} holds {t!r}, expected token ids (int)")
            lo, hi = min(row), max(row)
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"prompts: prompt {i} has token id {bad} outside the target's vocabulary "
                    f"[0, {vocab})"
                )
            rows.append([int(t) for t in row])
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise TypeError(f"max_new_tokens: expected an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        limit = int(self.target.max_length)
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens: the longest prompt ({longest} tokens) plus {max_new_tokens} new "
                f"tokens exceeds the target's max length {limit}"
            )
        stops = set()
        if isinstance(stop_token_ids, (torch.Tensor, np.ndarray)):
            stop_token_ids = stop_token_ids.tolist()
        if isinstance(stop_token_ids, (int, np.integer)) and not isinstance(stop_token_ids, bool):
            stop_token_ids = [stop_token_ids]  # one id, as transformers' eos_token_id may be
        for t in stop_token_ids or ():
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"stop_token_ids: {t!r} is not a token id in [0, {vocab})")
            stops.add(int(t))
        batch = len(rows)
        capacity = getattr(self.drafter, "max_sequences", None)
        if capacity is not None and batch > int(capacity):
            raise ValueError(
                f"prompts: {batch} prompts exceed the drafter's {capacity} sequence slots"
            )
        return rows, stops

    # ---- the loop ----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Union[Sequence[Sequence[int]], torch.Tensor],
        *,
        max_new_tokens: int,
        temperature: Union[float, Sequence[float]] = 0.0,
        top_k: Union[int, Sequence[int]] = 0,
        top_p: Union[float, Sequence[float]] = 1.0,
        seed: Union[int, Sequence[int], None] = None,
        stop_token_ids: Optional[Iterable[int]] = None,
        on_step: Optional[Callable[[int, list[int]], Any]] = None,
    ) -> GenerationOutput:
        """Generates up to ``max_new_tokens`` tokens after each prompt.

        Parameters
        ----------
        prompts : list of list of int, or int tensor or numpy array [B, T]
            ``B >= 1`` prompts of any lengths ``>= 1``, token ids in ``[0, vocab_size)``.
        max_new_tokens : int
            Tokens to generate per prompt at most; prompt + new tokens must fit the target's
            ``max_length``.
        temperature, top_k, top_p : number or one per prompt
            Sampling of the target (temperature 0 = greedy, top_k 0 = off, top_p 1 = off).
        seed : int or one per prompt, optional
            Philox key per sequence: an int gives row ``b`` the key ``seed + b``; a list sets each
            row's key, and a row's tokens then do not depend on the rest of the batch as long as
            its drafts do not: without a ``budget`` (both budgets size trees from the whole
            batch), with drafters whose drafts of a sequence depend on that sequence alone (all
            of this package's drafters), and while no sequence of the batch nears the target's
            or the draft model's max length (drafts are then shortened for every row). None
            draws a random seed.
        stop_token_ids : int or iterable of int, optional
            Tokens (e.g. EOS) that end a sequence; the stop token is part of the output.
        on_step : callable ``(row, new_tokens)``, optional
            Called after every step, in row order, for each sequence that committed tokens in it:
            ``row`` is the prompt's index, ``new_tokens`` (list of int) what it just committed
            (already cut at a stop token or the token budget), so that streaming the calls of
            one row gives exactly its ``sequences`` entry. Its return value is ignored; an
            exception it raises stops generation and propagates.

        Returns
        -------
        GenerationOutput
            ``sequences`` (per prompt lists of new tokens), ``finish_reasons`` and ``stats``;
            ``padded()`` gives a padded tensor and lengths.

        Raises
        ------
        TypeError, ValueError
            An empty prompt, a token id outside the vocabulary, too long a request, bad sampling
            arguments, more prompts than the drafter has slots; raised before any work.
        """
        t_wall = time.perf_counter()
        rows, stops = self._check_request(prompts, max_new_tokens, stop_token_ids)
        max_new_tokens = int(max_new_tokens)  # numpy ints included (checked above)
        batch = len(rows)
        temps = _per_row(temperature, "temperature", batch, float)
        top_ks = _per_row(top_k, "top_k", batch, int)
        top_ps = _per_row(top_p, "top_p", batch, float)
        if any(not (t >= 0 and np.isfinite(t)) for t in temps):
            raise ValueError(f"temperature: expected finite values >= 0, got {temps}")
        if any(k < 0 for k in top_ks):
            raise ValueError(f"top_k: expected values >= 0, got {top_ks}")
        # top_k >= vocab_size keeps every token (off), as does vocab_size itself, which also fits
        # the int32 the kernels take (a top_k of 2**40 would overflow it).
        vocab = int(self.target.vocab_size)
        top_ks = [min(k, vocab) for k in top_ks]
        if any(not 0 < p <= 1 for p in top_ps):
            raise ValueError(f"top_p: expected values in (0, 1], got {top_ps}")
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step: expected a callable (row, new_tokens), got {on_step!r}")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        if isinstance(seed, (list, tuple, np.ndarray, torch.Tensor)):
            seeds = _per_row(seed, "seed", batch, int)
        else:
            seeds = [int(s) for s in _per_row(seed, "seed", 1, int)]
            seeds = [seeds[0] + b for b in range(batch)]
        for b, s in enumerate(seeds):
            if not -(2**63) <= s < 2**63:
                raise ValueError(
                    f"seed: row {b}'s seed {s} is outside int64 (one int seed gives row b the "
                    "seed seed + b)"
                )
        state = _Batch(
            tokens=[list(r) for r in rows],
            prompt_lens=[len(r) for r in rows],
            max_new=max_new_tokens,
            done=[False] * batch,
            reasons=[""] * batch,
            temperature=torch.tensor(temps, dtype=torch.float32),
            top_k=torch.tensor(top_ks, dtype=torch.int32),
            top_p=torch.tensor(top_ps, dtype=torch.float32),
            seed=torch.tensor(seeds, dtype=torch.int64),
            rows=list(range(batch)),
        )
        stats = GenerationStats()
        slots = list(range(batch))
        if isinstance(self.budget, CostAwareBudget):
            self.budget.reset_rows(slots)
        self.drafter.start(slots, rows)
        bar = None
        try:
            configure = getattr(self.drafter, "configure", None)
            if callable(configure):
                configure(slots, temperature=temps, top_k=top_ks, top_p=top_ps, seed=seeds)
            t0 = time.perf_counter()
            cache = self._prefill(state)
            stats.prefill_time = time.perf_counter() - t0
            bar = _Progress(batch * max_new_tokens) if self.progress else None
            while state.active:
                self._step(state, cache, stops, stats, bar, on_step)
            if bar is not None:
                bar.finish()
        finally:
            # A step that raises (a model error, an interrupt) still closes the bar, so the
            # terminal is left on a fresh line.
            if bar is not None:
                bar.close()
            self.drafter.release([b for b in slots if not state.done[b]])
        stats.wall_time = time.perf_counter() - t_wall
        sequences = [state.tokens[b][state.prompt_lens[b] :] for b in range(batch)]
        return GenerationOutput(sequences, state.reasons, stats)

    def _prefill(self, state: _Batch) -> Any:
        """Fills the target cache with every prompt but its last token (the first root).

        The prompts go through one causal pass padded to the longest; each row is then truncated
        to its own length, so padding never becomes part of a sequence.
        """
        batch = len(state.tokens)
        longest_total = max(state.prompt_lens) + state.max_new
        size = min(int(self.target.max_length), longest_total + self.max_nodes)
        cache = self.target.new_cache(batch, size)
        width = max(state.prompt_lens) - 1
        if width == 0:
            return cache  # one-token prompts: a steered drafter's first round is unsteered
        device = self.target.device
        ids = torch.zeros((batch, width), dtype=torch.int64)
        for b, row in enumerate(state.tokens):
            ids[b, : len(row) - 1] = torch.tensor(row[:-1], dtype=torch.int64)
        positions = torch.arange(width, dtype=torch.int64).expand(batch, width)
        extra = {}
        if self._ragged:
            # Shorter prompts' padding is not computed (a causal chain's padding comes last).
            extra["num_nodes"] = torch.tensor([n - 1 for n in state.prompt_lens])
        if self._steer_layers is None:
            self.target.forward(ids.to(device), positions.to(device), cache, **extra)
        else:
            _, hidden = self.target.forward(
                ids.to(device),
                positions.to(device),
                cache,
                output_hidden=list(self._steer_layers),
                **extra,
            )
            # Each prompt's first round is steered from its last prefilled position (the one
            # whose distribution gave the first root); one-token prompts have none. A drafter
            # that follows the path gets every prefilled position.
            rows = [b for b, n in enumerate(state.prompt_lens) if n >= 2]
            if rows and self._follow_path:
                pick = torch.tensor(rows, device=device)
                lengths = [state.prompt_lens[b] - 1 for b in rows]
                self.drafter.follow(rows, [h[pick] for h in hidden], lengths)
            elif rows:
                at = torch.tensor([state.prompt_lens[b] - 2 for b in rows], device=device)
                pick = torch.tensor(rows, device=device)
                self.drafter.steer(rows, [h[pick, at] for h in hidden])
        cache.truncate([n - 1 for n in state.prompt_lens])
        return cache

    def _step(
        self,
        state: _Batch,
        cache: Any,
        stops: set[int],
        stats: GenerationStats,
        bar: Any,
        on_step: Optional[Callable[[int, list[int]], Any]] = None,
    ) -> None:
        # Positions in the cache of the running rows (`act`) and their batch rows (`active`).
        act = [i for i, b in enumerate(state.rows) if not state.done[b]]
        active = [state.rows[i] for i in act]
        t0 = time.perf_counter()
        budget = self.max_nodes
        per_row = isinstance(self.budget, CostAwareBudget)
        # The most nodes a row can score this step: ours and the drafter's limit.
        cap = min(self.max_nodes, int(getattr(self.drafter, "max_nodes", self.max_nodes)))
        if isinstance(self.budget, AdaptiveBudget):
            budget = self.budget.choose(self.target, cache, len(active), cap)
        idx = torch.tensor(act, dtype=torch.int64)
        choose = None
        if per_row:

            def choose(num_nodes: np.ndarray, depth: np.ndarray) -> np.ndarray:
                if len(act) == num_nodes.shape[0]:  # every cache row is running
                    return self.budget.allocate(
                        self.target, cache, active, num_nodes, depth, self._ragged, cap
                    ).numpy()
                limits = np.ones(num_nodes.shape[0], dtype=np.int32)
                limits[act] = self.budget.allocate(
                    self.target, cache, active, num_nodes[act], depth[act], self._ragged, cap
                ).numpy()
                return limits

        tree = self._roots_without_proposal(state, cache, act, cap) if per_row else None
        if tree is None:
            tree = self._draft(state, cache, act, budget, choose)
        if per_row:
            budget = int(tree.num_nodes.max())
            state.scored_roots_only = budget == 1
        t1 = time.perf_counter()
        tokens, positions, mask = self._tree_input(cache, tree)
        extra = {}
        if self._ragged:
            # Finished rows still in the cache score nothing (their root is dropped again).
            real = torch.zeros_like(tree.num_nodes)
            real[idx] = tree.num_nodes[idx]
            extra["num_nodes"] = real
        tf = time.perf_counter()
        # Hidden states asked of the target: the judge's last one, then a steered drafter's.
        wanted = ([-1] if self.judge is not None else []) + list(self._steer_layers or ())
        hidden: tuple[torch.Tensor, ...] = ()
        if not wanted:
            logits = self.target.forward(tokens, positions, cache, tree_mask=mask, **extra)
        else:
            logits, hidden = self.target.forward(
                tokens, positions, cache, tree_mask=mask, output_hidden=wanted, **extra
            )
        forward_time = time.perf_counter() - tf
        allow = None if self.judge is None else self._judge(tree, hidden[0], logits)
        result = self._verify(state, tree, logits, allow)
        if allow is not None:
            stats.judge_accepted += _judged(tree, logits, result, idx)
        t2 = time.perf_counter()
        counts = self._accept(state, cache, result, act)
        committed = self._commit(state, result, act, counts, stops)
        if self._steer_layers is not None:
            self._steer_drafter(state, act, result, hidden[1 if self.judge is not None else 0 :])
        self._update_drafter(state, active, committed)
        depths = tree.depth[idx].max(dim=1).values
        if isinstance(self.budget, AdaptiveBudget):
            self.budget.observe(
                result.path.cpu(),
                counts,
                idx,
                budget,
                forward_time,
                int(cache.batch_size),
                self.target,
            )
        elif per_row:
            self.budget.observe(active, depths.tolist(), counts[idx].tolist(), forward_time)
        self._drop_finished(state, cache)
        t3 = time.perf_counter()
        if self.budget is not None:
            self.budget.observe_overhead(t3 - t0 - forward_time)
        stats.steps += 1
        stats.row_steps += len(active)
        stats.new_tokens += sum(len(c) for c in committed)
        stats.node_budgets.append(budget)
        stats._record(depths.numpy(), counts[idx].numpy())
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.bookkeeping_time += t3 - t2
        if bar is not None:
            bar.update(sum(len(c) for c in committed))
        if on_step is not None:
            # After the statistics, so that a callback that raises leaves them consistent.
            for b, row in zip(active, committed):
                if row:
                    on_step(b, list(row))

    def _drop_finished(self, state: _Batch, cache: Any) -> None:
        """Removes finished sequences from the target cache when it can drop rows, so that later
        steps run at the batch size of the running rows (attention, verification and the
        bookkeeping then cost only those)."""
        keep = [i for i, b in enumerate(state.rows) if not state.done[b]]
        if (
            not keep
            or len(keep) == len(state.rows)
            or not callable(getattr(cache, "keep_rows", None))
        ):
            return
        cache.keep_rows(torch.tensor(keep, dtype=torch.int64))
        state.rows = [state.rows[i] for i in keep]

    def _roots_without_proposal(
        self, state: _Batch, cache: Any, act: list[int], cap: int
    ) -> Optional[_Tree]:
        """The root-only tree of a single running sequence, without asking the drafter, when
        :class:`CostAwareBudget` would score no node of the longest chain the drafter could
        propose (at most ``cap`` nodes, the step's limit per row); None otherwise (the step
        drafts as usual).

        At low acceptance (sampling at temperature 1, prose) most steps score the root alone,
        and the proposal, its validation and the pruning would cost several percent of each
        such step for nothing. Only for drafters that declare ``proposes_chains`` (chains, and a
        :meth:`propose` that only reads the drafter's state, so a skipped call changes nothing),
        at batch 1, and after a step that scored the root alone. It is exact there: the gains of
        a chain's nodes do not depend on its tokens, the budget's candidates for a shorter chain
        are a prefix of those of the longest one, and with one row the best cut of a prefix is
        its empty cut whenever that of the whole chain is."""
        if not (
            len(act) == 1
            and len(state.rows) == 1
            and state.scored_roots_only
            and getattr(self.drafter, "proposes_chains", False) is True
        ):
            return None
        b = state.rows[0]
        depth = int(getattr(self.drafter, "max_depth", cap))
        room = cache.max_length - int(cache.lengths.max())
        nodes = max(min(cap, room, depth + 1, state.max_new - state.generated(b)), 1)
        if nodes > 1 and self.budget.chain_pays(self.target, cache, b, nodes, self._ragged, cap):
            return None
        return _root_tree(np.array([[state.tokens[b][-1]]], dtype=np.int32), None)

    def _draft(
        self,
        state: _Batch,
        cache: Any,
        act: list[int],
        budget: int,
        per_row: Optional[Callable[[np.ndarray, np.ndarray], np.ndarray]] = None,
    ) -> _Tree:
        """The drafter's trees for the running rows (cache positions ``act``), root-only trees
        for the finished ones still in the cache, pruned to what this step may use (at most
        ``budget`` nodes, and with ``per_row`` at most ``per_row(num_nodes, depth)[b]`` nodes in
        row ``b``, given the nodes and depths of the trees within the other limits). Rows of the
        result are the cache's rows."""
        batch = len(state.rows)
        active = [state.rows[i] for i in act]
        proposal = self.drafter.propose(active)
        # The trees are small ([B, N] with N <= a few dozen): their bookkeeping runs on numpy
        # arrays, whose operations cost a fraction of a torch op's dispatch at this size.
        p_tokens = _host_int32(proposal.tokens)
        p_parents = _host_int32(proposal.parents)
        p_num = _host_int32(proposal.num_nodes)
        if p_tokens.ndim != 2 or p_tokens.shape[0] != len(active):
            raise ValueError(
                f"drafter: propose() returned tokens of shape {list(p_tokens.shape)}, expected "
                f"[{len(active)}, N]"
            )
        width = p_tokens.shape[1]
        if p_parents.shape != p_tokens.shape or p_num.shape != (len(active),):
            raise ValueError(
                f"drafter: propose() returned parents of shape {list(p_parents.shape)} and "
                f"num_nodes of shape {list(p_num.shape)} for tokens of shape "
                f"{list(p_tokens.shape)}"
            )
        if len(act) == batch:  # every cache row is running (always at batch 1)
            tokens = p_tokens.copy()
            parents = np.ascontiguousarray(p_parents)
            num_nodes = p_num.copy()
        else:
            tokens = np.full((batch, width), -1, dtype=np.int32)
            parents = np.full((batch, width), -1, dtype=np.int32)
            num_nodes = np.ones(batch, dtype=np.int32)
            tokens[act] = p_tokens
            parents[act] = p_parents
            num_nodes[act] = p_num
        # Node 0 is by definition the last committed token, whatever the drafter put there.
        tokens[:, 0] = [state.tokens[b][-1] for b in state.rows]
        probs = getattr(proposal, "draft_probs", None)
        full_probs = None
        if probs is not None:
            probs = torch.as_tensor(probs)
            vocab = int(self.target.vocab_size)
            if tuple(probs.shape) != (len(active), width, vocab):
                raise ValueError(
                    f"drafter: draft_probs has shape {list(probs.shape)}, expected "
                    f"[{len(active)}, {width}, {vocab}]"
                )
            if len(act) == batch:
                # Every row runs: the drafter's rows as they are (nothing below writes to them).
                full_probs = probs.cpu()
            else:
                full_probs = torch.zeros((batch, width, vocab), dtype=probs.dtype)
                full_probs[torch.tensor(act, dtype=torch.int64)] = probs.cpu()
        deterministic = getattr(proposal, "draft_deterministic", None)
        full_deterministic = None
        if deterministic is not None and full_probs is not None:
            deterministic = torch.as_tensor(deterministic).cpu()
            if deterministic.dtype != torch.bool or tuple(deterministic.shape) != (len(active),):
                raise ValueError(
                    f"drafter: draft_deterministic is {deterministic.dtype} of shape "
                    f"{list(deterministic.shape)}, expected bool [{len(active)}]"
                )
            # Finished rows have root-only trees, which read no draft row either way.
            full_deterministic = torch.ones(batch, dtype=torch.bool)
            full_deterministic[torch.tensor(act, dtype=torch.int64)] = deterministic
        # Depth limit: a step emits at most depth + 1 tokens, so drafting past the remaining
        # budget is wasted (and could run past the target's max length). 0 for finished rows.
        depth_limit = np.zeros(batch, dtype=np.int32)
        depth_limit[act] = [state.max_new - state.generated(b) - 1 for b in active]
        room = cache.max_length - int(cache.lengths.max())
        limit = min(budget, room)
        info = ops.tree_info(parents)
        node_limit: Union[int, np.ndarray] = limit
        if per_row is not None:
            index = np.arange(width)[None, :]
            depth = info.depth.numpy()
            fits = (
                (index < num_nodes[:, None])
                & (depth >= 0)
                & (depth <= depth_limit[:, None])
                & (index < max(limit, 1))
            )
            depth = np.where(fits, depth, -1).astype(np.int32)
            chosen = per_row(fits.sum(axis=1).astype(np.int32), depth)
            node_limit = np.minimum(np.asarray(chosen, dtype=np.int64), max(limit, 1))
        return _prune(
            tokens,
            parents,
            num_nodes,
            full_probs,
            depth_limit,
            node_limit,
            info,
            full_deterministic,
        )

    def _tree_input(
        self, cache: Any, tree: _Tree
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Target input over the trees, on the target's device: token ids and positions (int64
        ``[B, N]``) and the tree mask (uint32 ``[B, N, W]``). Padding nodes become token 0 at
        the root's position (their mask rows are empty and their outputs unused)."""
        vocab = int(self.target.vocab_size)
        # On numpy views of the CPU trees: [B, N] with N a few dozen, where torch's per-op cost
        # would exceed the work.
        depth = tree.depth.numpy()
        valid = depth >= 0
        host_tokens = tree.tokens.numpy()
        if ((host_tokens >= vocab) & valid).any():
            bad = int(host_tokens[valid].max())
            raise ValueError(
                f"drafter: proposed token id {bad}, outside the target's vocabulary [0, {vocab})"
            )
        if ((host_tokens < 0) & valid).any():
            raise ValueError("drafter: proposed a negative token id in a valid node")
        device = self.target.device
        prefix = cache.lengths.to("cpu", torch.int64).numpy()[:, None]
        positions = torch.from_numpy(prefix + np.maximum(depth, 0))
        tokens = torch.from_numpy(np.maximum(host_tokens, 0).astype(np.int64))
        return tokens.to(device), positions.to(device), tree.mask.to(device)

    def _judge(self, tree: _Tree, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The judge's ``allow`` mask (bool ``[B, N]`` on the logits' device) for the trees."""
        device = logits.device
        allow = self.judge.allow(hidden, logits, tree.tokens.to(device), tree.parents.to(device))
        allow = torch.as_tensor(allow)
        if allow.dtype != torch.bool or tuple(allow.shape) != tuple(tree.tokens.shape):
            raise ValueError(
                f"judge: allow() returned {allow.dtype} of shape {list(allow.shape)}, expected "
                f"bool {list(tree.tokens.shape)}"
            )
        return allow.to(device)

    def _verify(
        self,
        state: _Batch,
        tree: _Tree,
        logits: torch.Tensor,
        allow: Optional[torch.Tensor] = None,
    ) -> ops.VerifyResult:
        device = logits.device
        offset = torch.tensor([len(state.tokens[b]) for b in state.rows], dtype=torch.int64)
        probs = tree.draft_probs
        return ops.verify(
            logits.contiguous(),
            tree.tokens.to(device),
            parents=tree.parents.to(device),
            num_nodes=tree.num_nodes.to(device),
            draft_probs=None if probs is None else probs.to(device, torch.float32).contiguous(),
            draft_deterministic=(
                None if tree.draft_deterministic is None else tree.draft_deterministic.to(device)
            ),
            **state.sampling_parameters(device),
            offset=offset.to(device),
            method=self.method,
            max_depth=max(int(tree.depth.max()), 0),
            allow=allow,
            **self.verify_options,
        )

    def _accept(
        self, state: _Batch, cache: Any, result: ops.VerifyResult, active: list[int]
    ) -> torch.Tensor:
        """Keeps the root and the accepted nodes of each running row (cache positions
        ``active``) in the target cache; finished rows drop the whole tree. Returns the accepted
        counts per cache row (CPU int64)."""
        status = result.status.cpu().numpy()
        accepted = result.num_accepted.cpu().to(torch.int64)
        bad = np.flatnonzero(status[active] != 0)
        if bad.size:
            i = active[int(bad[0])]
            raise RuntimeError(
                f"target: non-finite or zero-mass distribution for sequence {state.rows[i]} "
                f"(verify status {int(status[i])}); generation stopped"
            )
        keep = np.zeros(cache.batch_size, dtype=np.int32)
        keep[active] = accepted.numpy()[active] + 1
        device = result.path.device
        cache.compact(result.path.to(torch.int32).contiguous(), torch.from_numpy(keep).to(device))
        return accepted

    def _commit(
        self,
        state: _Batch,
        result: ops.VerifyResult,
        active: list[int],
        accepted: torch.Tensor,
        stops: set[int],
    ) -> list[list[int]]:
        """Appends each running row's emitted tokens (cache positions ``active``), cut after a
        stop token or at the token budget; returns what each running row committed."""
        emitted = result.emitted.cpu().numpy()
        num = result.num_emitted.cpu().numpy()
        committed = []
        for i in active:
            b = state.rows[i]
            row = emitted[i, : int(num[i])].tolist()
            budget = state.max_new - state.generated(b)
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), None)
            if cut is not None and cut <= budget:
                row = row[:cut]
                state.done[b], state.reasons[b] = True, "stop"
            elif len(row) >= budget:
                row = row[:budget]
                state.done[b], state.reasons[b] = True, "length"
            state.tokens[b].extend(row)
            committed.append(row)
        return committed

    def _steer_drafter(
        self,
        state: _Batch,
        act: list[int],
        result: ops.VerifyResult,
        hidden: Sequence[torch.Tensor],
    ) -> None:
        """Hands a steered drafter the target's states at each running row's last accepted node
        (cache positions ``act``; the root when nothing was accepted): the node whose
        distribution gave the row's bonus or correction token, the next round's root. A drafter
        that follows the path gets the states of the root and every accepted node, in order."""
        rows = [i for i in act if not state.done[state.rows[i]]]
        if not rows:
            return
        device = hidden[0].device
        index = torch.tensor(rows, dtype=torch.int64, device=result.path.device)
        accepted = result.num_accepted[index].long()
        slots = [state.rows[i] for i in rows]
        pick = index.to(device)
        if self._follow_path:
            span = int(accepted.max()) + 1
            nodes = result.path[index, :span].to(device, torch.int64).clamp_min(0)
            states = [h[pick.unsqueeze(1), nodes] for h in hidden]
            self.drafter.follow(slots, states, (accepted + 1).tolist())
            return
        nodes = result.path[index, accepted].to(device, torch.int64)
        self.drafter.steer(slots, [h[pick, nodes] for h in hidden])

    def _update_drafter(self, state: _Batch, active: list[int], committed: list[list[int]]) -> None:
        running = [i for i, b in enumerate(active) if not state.done[b]]
        if running:
            self.drafter.observe(
                [active[i] for i in running],
                [np.asarray(committed[i], dtype=np.int32) for i in running],
            )
        finished = [b for b in active if state.done[b]]
        if finished:
            self.drafter.release(finished)


def _steer_layers(drafter: Any, target: Any) -> Optional[tuple[int, ...]]:
    """The target's hidden-state indices a steered drafter reads (its ``target_hidden``), checked
    against the target; None for a drafter that is not steered."""
    layers = getattr(drafter, "target_hidden", None)
    if layers is None:
        return None
    method = "follow" if getattr(drafter, "target_states", "last") == "path" else "steer"
    if not callable(getattr(drafter, method, None)):
        raise TypeError(f"drafter: it names target_hidden layers but has no {method}() method")
    layers = tuple(layers)
    if not layers or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        raise TypeError(f"drafter: target_hidden must be a non-empty tuple of ints, got {layers}")
    count = getattr(target, "num_hidden_layers", None)
    if count is not None and any(not -(count + 1) <= i <= count for i in layers):
        raise ValueError(
            f"drafter: it reads target hidden states {layers}, the target has "
            f"indices 0 .. {count} (layers + the final norm); was it made for another target?"
        )
    wants = getattr(drafter, "target_hidden_size", None)
    has = getattr(getattr(target, "config", None), "hidden_size", None)
    if wants is not None and has is not None and int(wants) != int(has):
        raise ValueError(
            f"drafter: it reads target states of size {wants}, the target's hidden "
            f"size is {has}; was it made for another target?"
        )
    return layers


def _judged(tree: _Tree, logits: torch.Tensor, result: ops.VerifyResult, rows: torch.Tensor) -> int:
    """Accepted nodes of the cache rows ``rows`` whose token is not the target's argmax at their
    parent (the mismatches a judge let through)."""
    # A handful of accepted nodes per row: a loop over numpy views costs less than torch ops.
    top = logits.argmax(dim=-1).cpu().numpy()  # [B, N]: the target's choice for the children
    tokens, parents = tree.tokens.numpy(), tree.parents.numpy()
    path = result.path.cpu().numpy()  # [B, D + 1]: the root, then the accepted nodes
    accepted = result.num_accepted.cpu().numpy()
    count = 0
    for b in rows.tolist():
        for node in path[b, 1 : int(accepted[b]) + 1]:
            count += int(tokens[b, node] != top[b, parents[b, node]])
    return count


def _prune(
    tokens: Union[torch.Tensor, np.ndarray],
    parents: Union[torch.Tensor, np.ndarray],
    num_nodes: Union[torch.Tensor, np.ndarray],
    probs: Optional[torch.Tensor],
    depth_limit: Union[torch.Tensor, np.ndarray],
    node_limit: Union[int, torch.Tensor, np.ndarray],
    info: Optional[ops.TreeInfo] = None,
    deterministic: Optional[torch.Tensor] = None,
) -> _Tree:
    """Keeps the nodes of each tree within its depth limit and the first ``node_limit`` nodes
    (an int for every row, or int ``[B]`` per row; at least the root is kept).

    Both conditions keep a set closed under ancestors (a parent is shallower than and precedes
    its children), so the kept nodes, renumbered in their original order, form a valid tree.
    The index arithmetic runs on numpy (int32 ``[B, N]`` arrays; torch CPU tensors are read
    without a copy); the returned :class:`_Tree` holds torch tensors. ``deterministic`` (bool
    ``[B]``, per row) passes through unchanged.
    """
    tokens_np = np.asarray(tokens, dtype=np.int32)
    parents_np = np.ascontiguousarray(parents, dtype=np.int32)
    num_np = np.asarray(num_nodes, dtype=np.int32)
    if _keeps_roots_only(node_limit, depth_limit):
        return _root_tree(tokens_np, probs, deterministic)
    if info is None:
        info = ops.tree_info(parents_np)
    depth = info.depth.numpy()
    n = tokens_np.shape[1]
    index = np.arange(n)[None, :]
    if isinstance(node_limit, (torch.Tensor, np.ndarray)):
        within = index < np.maximum(np.asarray(node_limit, dtype=np.int64), 1)[:, None]
    else:
        within = index < max(int(node_limit), 1)
    keep = (
        (index < num_np[:, None])
        & (depth >= 0)
        & (depth <= np.asarray(depth_limit, dtype=np.int64)[:, None])
        & within
    )
    if keep.all():
        return _Tree(
            torch.from_numpy(tokens_np),
            torch.from_numpy(parents_np),
            torch.from_numpy(num_np),
            probs,
            deterministic,
            info.depth,
            info.mask,
        )
    counts = keep.sum(axis=1)
    width = int(counts.max())
    # Kept nodes first, in their original order (a stable sort of "not kept").
    order = np.argsort(~keep, axis=1, kind="stable")[:, :width]
    kept = np.take_along_axis(keep, order, axis=1)
    new_index = np.cumsum(keep, axis=1) - 1  # new index of each kept node
    old_parent = np.take_along_axis(parents_np, order, axis=1).astype(np.int64)
    new_parent = np.take_along_axis(new_index, np.maximum(old_parent, 0), axis=1)
    new_parents = np.where(kept & (old_parent >= 0), new_parent, -1).astype(np.int32)
    new_tokens = np.where(kept, np.take_along_axis(tokens_np, order, axis=1), -1).astype(np.int32)
    new_probs = None
    if probs is not None:
        gather = torch.from_numpy(order).unsqueeze(-1).expand(-1, -1, probs.shape[-1])
        new_probs = probs.gather(1, gather)
    info = ops.tree_info(new_parents)
    return _Tree(
        torch.from_numpy(new_tokens),
        torch.from_numpy(new_parents),
        info.num_nodes,
        new_probs,
        deterministic,
        info.depth,
        info.mask,
    )


def _keeps_roots_only(
    node_limit: Union[int, torch.Tensor, np.ndarray],
    depth_limit: Union[torch.Tensor, np.ndarray],
) -> bool:
    """Whether :func:`_prune` keeps nothing but the roots (the step the budget judged no draft to
    pay for, the common case at low acceptance)."""
    depth_limit = np.asarray(depth_limit)
    if depth_limit.size == 0:
        return False
    return int(depth_limit.max()) <= 0 or int(np.max(np.asarray(node_limit))) <= 1


def _root_tree(
    tokens: np.ndarray,
    probs: Optional[torch.Tensor],
    deterministic: Optional[torch.Tensor] = None,
) -> _Tree:
    """The root-only trees of ``tokens`` (int32 ``[B, N]``): node 0 of every row, depth 0, the
    mask of a node that sees itself. Built without the tree kernel, which would only confirm
    this."""
    batch = tokens.shape[0]
    return _Tree(
        torch.from_numpy(np.ascontiguousarray(tokens[:, :1])),
        torch.full((batch, 1), -1, dtype=torch.int32),
        torch.ones(batch, dtype=torch.int32),
        None if probs is None else probs[:, :1],
        deterministic,
        torch.zeros((batch, 1), dtype=torch.int32),
        torch.ones((batch, 1, 1), dtype=torch.uint32),
    )


class _Progress:
    """A minimal progress bar: tqdm when installed, else a carriage-return line on stderr."""

    def __init__(self, total: int, unit: str = "tok", units: str = "tokens") -> None:
        self.total, self.count = total, 0
        self.units = units
        self._closed = False
        try:
            from tqdm import tqdm

            self._bar: Any = tqdm(total=total, unit=unit)
        except ImportError:
            self._bar = None

    def update(self, n: int) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
        else:
            import sys

            sys.stderr.write(f"\r{self.count}/{self.total} {self.units}")
            sys.stderr.flush()

    def finish(self) -> None:
        """Every sequence is done: the total becomes the tokens generated, so a run whose
        sequences stopped early (a stop token) ends at 100 % instead of short of its total."""
        if self.count == self.total:
            return
        self.total = self.count
        if self._bar is not None:
            self._bar.total = self.count
            self._bar.refresh()
        else:
            import sys

            # Spaces cover the end of the longer line written before (the old total's digits).
            sys.stderr.write(f"\r{self.count}/{self.total} {self.units}" + " " * 12)
            sys.stderr.flush()

    def close(self) -> None:
        """Ends the bar's line; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        else:
            import sys

            sys.stderr.write("\n")


def generate(
    model: Any,
    prompts: Union[Sequence[Sequence[int]], torch.Tensor],
    *,
    drafter: Optional[Drafter] = None,
    max_new_tokens: int,
    temperature: Union[float, Sequence[float]] = 0.0,
    top_k: Union[int, Sequence[int]] = 0,
    top_p: Union[float, Sequence[float]] = 1.0,
    seed: Union[int, Sequence[int], None] = None,
    stop_token_ids: Optional[Iterable[int]] = None,
    method: str = "exact",
    max_nodes: int = 64,
    progress: bool = False,
    on_step: Optional[Callable[[int, list[int]], Any]] = None,
    budget: Optional[AdaptiveBudget] = None,
    judge: Any = None,
    **verify_options: Any,
) -> GenerationOutput:
    """Generates with speculative decoding in one call (see :class:`SpeculativeDecoder`).

    Parameters
    ----------
    model : CausalLM
        The target model.
    prompts : list of list of int, or int tensor or numpy array [B, T]
        The prompts (token ids).
    drafter : Drafter, optional
        Default :class:`~specdecode.drafters.NoDrafter` (plain decoding).
    max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, on_step
        As in :meth:`SpeculativeDecoder.generate`.
    method, max_nodes, progress, budget, judge
        As in :class:`SpeculativeDecoder`.
    **verify_options
        ``eps``, ``alpha``, ``topk_accept``, ``correction`` for the lossy methods, as in
        :class:`SpeculativeDecoder`.

    Returns
    -------
    GenerationOutput
        Generated tokens per prompt, finish reasons and :class:`GenerationStats`.
    """
    decoder = SpeculativeDecoder(
        model,
        drafter,
        method=method,
        max_nodes=max_nodes,
        progress=progress,
        budget=budget,
        judge=judge,
        **verify_options,
    )
    return decoder.generate(
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_token_ids=stop_token_ids,
        on_step=on_step,
    )
