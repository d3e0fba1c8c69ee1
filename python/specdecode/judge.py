"""Judge decoding without manual annotation (AutoJudge).

Lossless greedy speculative decoding rejects every draft token that differs from the target's
argmax, although many such *mismatches* do not change what the response achieves (another word
in a comment, another equally good phrasing). AutoJudge (Garipov et al., 2025, "AutoJudge: Judge
Decoding Without Manual Annotation") learns which mismatches matter for a task and accepts the
others, so that a step goes on past them:

1. **mine** (:func:`mine_important_tokens`): for each training prompt the target's greedy
   response is the *reference*. The draft model, fed the current response, predicts every token;
   at the first position where its prediction differs from the response, the draft token is
   swapped in and the target continues greedily from it. A task check
   ``equivalent(prompt, reference, candidate)`` says whether the candidate still achieves what
   the reference does: if it does, the mismatch is *unimportant* and the candidate becomes the
   current response (the search goes on along it); if not, the mismatch is *important* and the
   response stays. The search then moves past the position (the paper's semi-greedy search).
2. **fit** (:meth:`TokenJudge.fit`): a logistic regression on features the target computes
   anyway while it verifies (:func:`judge_features`: its last hidden state before the token and
   at the token, and the log-probabilities of the token and of the argmax), with the threshold
   set for a wanted recall of important mismatches.
3. **decode**: ``SpeculativeDecoder(target, drafter, method="greedy", judge=judge)`` asks the
   target for its last hidden state in the verify pass, and the judge's ``allow`` mask makes
   :func:`specdecode.ops.verify` accept the mismatches judged unimportant.

This gives up the target's output (the method is lossy by design): what it keeps is the task
outcome that ``equivalent`` checks, to the extent the judge's recall on held-out mismatches
says. :func:`same_python_code` is such a check for code completion (the program's tokens agree,
whatever the comments, docstrings and blank lines say).

**The judge protocol.** The engine accepts any object with a method
``allow(hidden, logits, tokens, parents) -> bool [B, N]`` (the inputs as in
:func:`judge_features`): True where a node's token may be accepted whatever the verification rule
says.
"""

from __future__ import annotations

import dataclasses
import decimal
import io
import math
import re
import tokenize
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from .drafters import ModelDrafter
from .engine import SpeculativeDecoder, _Progress
from .models._checks import check_positive_int

__all__ = [
    "MinedMismatches",
    "Mismatch",
    "TokenJudge",
    "judge_features",
    "mine_important_tokens",
    "final_number",
    "python_code_tokens",
    "same_final_number",
    "same_python_code",
]

# The scalars appended to the two hidden states (see judge_features).
NUM_SCALAR_FEATURES = 3
# A token of probability 0 has log-probability -inf; features must stay finite.
_LOG_PROB_FLOOR = -100.0
_FORMAT = "specdecode.TokenJudge/1"


# ---- features ----------------------------------------------------------------------------------


def judge_features(
    hidden: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor
) -> torch.Tensor:
    """Features of each drafted node for a judge, from one target pass over the draft tree.

    Node ``i`` with parent ``p`` gets ``[h[p], h[i], log P(t_i), log P(top) - log P(t_i), H]``:
    the target's hidden state where it predicted the node's token and where it read it, the
    log-probability under the target (at ``p``) of the node's token ``t_i``, its gap to the most
    likely token's, and the entropy of the target's distribution at ``p`` (nats). Everything is
    what the verify pass computes anyway, so a judge adds no model pass.

    Parameters
    ----------
    hidden : torch.Tensor
        float ``[B, N, H]``: the target's last hidden state (the input of its ``lm_head``) at each
        node (``output_hidden=[-1]`` of :meth:`specdecode.models.CausalLM.forward`).
    logits : torch.Tensor
        float ``[B, N, V]``: the target's logits at each node (row ``i`` predicts its children).
    tokens : torch.Tensor
        integer ``[B, N]``: each node's token (the root's is not read).
    parents : torch.Tensor
        integer ``[B, N]``: each node's parent, ``-1`` for the root and for padding (the tree
        format of :func:`specdecode.ops.tree_info`).

    Returns
    -------
    torch.Tensor
        float32 ``[B, N, 2 H + 3]`` on the device of ``hidden``; rows of nodes without a parent
        (the root, padding) are 0.

    Raises
    ------
    ValueError
        Shapes that do not agree.
    """
    if hidden.ndim != 3 or logits.ndim != 3:
        raise ValueError(
            f"hidden, logits: expected [B, N, H] and [B, N, V], got {list(hidden.shape)} and "
            f"{list(logits.shape)}"
        )
    batch, n, width = hidden.shape
    if tuple(logits.shape[:2]) != (batch, n):
        raise ValueError(
            f"logits: expected [B, N, V] with [B, N] = [{batch}, {n}] (as hidden), got "
            f"{list(logits.shape)}"
        )
    for name, t in (("tokens", tokens), ("parents", parents)):
        if tuple(t.shape) != (batch, n):
            raise ValueError(f"{name}: expected [B, N] = [{batch}, {n}], got {list(t.shape)}")
    device = hidden.device
    parents = parents.to(device=device, dtype=torch.int64)
    has_parent = parents >= 0
    parent = parents.clamp(min=0)
    token = tokens.to(device=device, dtype=torch.int64).clamp(0, logits.shape[-1] - 1)

    h = hidden.float()
    h_parent = torch.gather(h, 1, parent[..., None].expand(batch, n, width))
    logits = logits.to(device).float()
    lse = torch.logsumexp(logits, dim=-1)  # [B, N]
    top = logits.amax(dim=-1) - lse
    # entr(p) = -p log p, 0 at p = 0 (a -inf logit must not give 0 * -inf = nan).
    entropy = torch.special.entr(torch.softmax(logits, dim=-1)).sum(dim=-1)
    # The token's logit is read in its parent's row: index rows [b, parent[b, i]].
    rows = parent + torch.arange(batch, device=device)[:, None] * n
    token_logit = logits.flatten(0, 1)[rows.flatten(), token.flatten()].view(batch, n)
    log_p = (token_logit - torch.gather(lse, 1, parent)).clamp(min=_LOG_PROB_FLOOR)
    gap = torch.gather(top, 1, parent) - log_p
    scalars = torch.stack([log_p, gap, torch.gather(entropy, 1, parent)], dim=-1)
    features = torch.cat([h_parent, h, scalars], dim=-1)
    return features * has_parent[..., None]


# ---- the classifier ----------------------------------------------------------------------------


def _as_features(features: Any, name: str = "features") -> torch.Tensor:
    t = torch.as_tensor(features)
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a float tensor, got {t.dtype}")
    return t


def _as_labels(important: Any, rows: int) -> torch.Tensor:
    t = torch.as_tensor(important)
    if t.dtype != torch.bool:
        raise TypeError(f"important: expected a bool tensor, got {t.dtype}")
    if tuple(t.shape) != (rows,):
        raise ValueError(f"important: expected shape [M] = [{rows}], got {list(t.shape)}")
    return t.cpu()


def _check_fraction(name: str, value: Any, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    value = float(value)
    ok = (0.0 < value <= 1.0) if low_open else (0.0 <= value <= 1.0)
    if not ok:
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name}: expected a value in {interval}, got {value}")
    return value


def _threshold_for_recall(scores: torch.Tensor, important: torch.Tensor, recall: float) -> float:
    """A threshold ``t`` that accepts (scores below ``t``) at most ``1 - recall`` of the important
    mismatches and, within that, as many mismatches as possible.

    The largest such threshold is the score ``s_k`` of the k-th lowest important mismatch; ``t``
    lies halfway between ``s_k`` and the highest score below it, which makes the same decisions
    on ``scores`` but leaves a margin for the rounding differences between the passes that
    computed the features (a full-sequence pass here, a tree pass in the engine)."""
    scores = scores.double()
    positive = torch.sort(scores[important]).values
    if positive.numel() == 0:
        raise ValueError("important: no important mismatch to calibrate the threshold on")
    # The k lowest-scored important mismatches may fall below t: k <= (1 - recall) * n.
    k = int(math.floor((1.0 - recall) * positive.numel() + 1e-9))
    if k >= positive.numel():
        return math.inf
    top = float(positive[k])
    below = scores[scores < top]
    return 0.5 * (top + float(below.max())) if below.numel() else 0.5 * top


class TokenJudge:
    """A logistic-regression judge over :func:`judge_features`.

    ``importance(x) = sigmoid(((x - mean) / scale) . weight + bias)`` is the judge's probability
    that a mismatch is important; :meth:`allow` accepts the nodes whose importance is below
    ``threshold``. Build one with :meth:`fit` (or :meth:`load`).

    Parameters
    ----------
    weight, mean, scale : torch.Tensor
        float ``[F]``; ``scale > 0``.
    bias : float
    threshold : float
        Importance below which a mismatch is accepted (``0``: never, ``inf``: always).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: float,
        mean: torch.Tensor,
        scale: torch.Tensor,
        threshold: float,
    ) -> None:
        weight = _as_features(weight, "weight").detach().cpu().float().contiguous()
        mean = _as_features(mean, "mean").detach().cpu().float().contiguous()
        scale = _as_features(scale, "scale").detach().cpu().float().contiguous()
        if weight.ndim != 1 or weight.numel() == 0:
            raise ValueError(f"weight: expected a non-empty [F] tensor, got {list(weight.shape)}")
        for name, t in (("mean", mean), ("scale", scale)):
            if tuple(t.shape) != tuple(weight.shape):
                raise ValueError(
                    f"{name}: expected [F] = {list(weight.shape)}, got {list(t.shape)}"
                )
        if not bool(torch.isfinite(weight).all() & torch.isfinite(mean).all()):
            raise ValueError("weight, mean: expected finite values")
        if not bool((scale > 0).all() & torch.isfinite(scale).all()):
            raise ValueError("scale: expected finite values > 0")
        if not math.isfinite(float(bias)):
            raise ValueError(f"bias: expected a finite float, got {bias}")
        threshold = float(threshold)
        if math.isnan(threshold) or threshold < 0:
            raise ValueError(f"threshold: expected a value >= 0 (inf allowed), got {threshold}")
        self.weight, self.mean, self.scale = weight, mean, scale
        self.bias = float(bias)
        self.threshold = threshold
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    @property
    def num_features(self) -> int:
        """``F``, the width of the features it reads."""
        return int(self.weight.numel())

    def __repr__(self) -> str:
        return f"TokenJudge(num_features={self.num_features}, threshold={self.threshold:.4g})"

    def _params(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in (self.weight, self.mean, self.scale))
        return self._on[device]

    def importance(self, features: Any) -> torch.Tensor:
        """Probability that each mismatch is important.

        Parameters
        ----------
        features : torch.Tensor
            float ``[..., F]``.

        Returns
        -------
        torch.Tensor
            float32 ``[...]`` in ``[0, 1]``, on the device of ``features``.
        """
        x = _as_features(features)
        if x.ndim == 0 or x.shape[-1] != self.num_features:
            raise ValueError(
                f"features: expected [..., F] with F = {self.num_features} (the judge was fitted "
                f"on {self.num_features} features), got {list(x.shape)}"
            )
        weight, mean, scale = self._params(x.device)
        z = ((x.float() - mean) / scale) @ weight + self.bias
        return torch.sigmoid(z)

    def allow(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        parents: torch.Tensor,
    ) -> torch.Tensor:
        """The judge protocol of :class:`~specdecode.engine.SpeculativeDecoder`: bool
        ``[B, N]``, True where node ``i`` (not the root or padding) is judged unimportant.

        Parameters are those of :func:`judge_features`.
        """
        features = judge_features(hidden, logits, tokens, parents)
        if features.shape[-1] != self.num_features:
            raise ValueError(
                f"judge: fitted on {self.num_features} features, the target's hidden size "
                f"{hidden.shape[-1]} gives {features.shape[-1]} (2 H + {NUM_SCALAR_FEATURES}); "
                "a judge belongs to the target it was mined with"
            )
        has_parent = parents.to(features.device) >= 0
        return (self.importance(features) < self.threshold) & has_parent

    def with_threshold(self, threshold: float) -> TokenJudge:
        """The same classifier with another threshold."""
        return TokenJudge(self.weight, self.bias, self.mean, self.scale, threshold)

    def threshold_for_recall(self, features: Any, important: Any, recall: float) -> float:
        """The largest threshold that keeps (rejects) at least ``recall`` of the important
        mismatches in ``features`` (``[M, F]``, labels bool ``[M]``)."""
        recall = _check_fraction("recall", recall, low_open=True)
        x = _as_features(features)
        labels = _as_labels(important, int(x.shape[0]) if x.ndim else 0)
        return _threshold_for_recall(self.importance(x).cpu(), labels, recall)

    @classmethod
    def fit(
        cls,
        features: Any,
        important: Any,
        *,
        recall: float = 0.9,
        l2: float = 1e-2,
        balanced: bool = True,
        max_iter: int = 200,
    ) -> TokenJudge:
        """Fits the logistic regression (L-BFGS, float64) and sets the threshold.

        Parameters
        ----------
        features : torch.Tensor
            float ``[M, F]``, e.g. :attr:`MinedMismatches.features`.
        important : torch.Tensor
            bool ``[M]``; both classes must occur.
        recall : float
            In ``(0, 1]``: the threshold keeps at least this fraction of the important
            mismatches of the training set (1: none of them is accepted). Calibrating on held-out
            mismatches (:meth:`threshold_for_recall`, :meth:`with_threshold`) is more faithful.
        l2 : float
            Ridge penalty ``l2 / 2 * |w|^2`` on the standardised weights (``>= 0``).
        balanced : bool
            Weigh the two classes equally (important mismatches are usually the rarer).
        max_iter : int
            L-BFGS iterations.
        """
        x = _as_features(features).detach().cpu().double()
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"features: expected a non-empty [M, F] tensor, got {list(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("features: expected finite values")
        labels = _as_labels(important, int(x.shape[0]))
        positives = int(labels.sum())
        if positives == 0 or positives == labels.numel():
            raise ValueError(
                f"important: both classes are needed to fit, got {positives} important of "
                f"{labels.numel()} mismatches"
            )
        recall = _check_fraction("recall", recall, low_open=True)
        if isinstance(l2, bool) or not isinstance(l2, (int, float)) or not l2 >= 0:
            raise ValueError(f"l2: expected a float >= 0, got {l2!r}")
        max_iter = check_positive_int("max_iter", max_iter)

        mean = x.mean(dim=0)
        scale = x.std(dim=0, unbiased=False)
        scale = torch.where(scale > 1e-8, scale, torch.ones_like(scale))
        z = (x - mean) / scale
        y = labels.double()
        if balanced:
            w = torch.where(labels, 0.5 / positives, 0.5 / (labels.numel() - positives))
        else:
            w = torch.full_like(y, 1.0 / labels.numel())
        w = w.double()
        weight = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
        bias = torch.zeros((), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS(
            [weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe", tolerance_grad=1e-9
        )

        def closure() -> torch.Tensor:
            opt.zero_grad()
            margin = z @ weight + bias
            loss = (
                w
                * torch.nn.functional.binary_cross_entropy_with_logits(margin, y, reduction="none")
            ).sum() + 0.5 * float(l2) * weight.square().sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        judge = cls(weight.detach(), float(bias.detach()), mean, scale, math.inf)
        return judge.with_threshold(judge.threshold_for_recall(x.float(), labels, recall))

    def save(self, path: Union[str, Path]) -> None:
        """Writes the judge to one safetensors file (its threshold in the metadata)."""
        from .models.io import write_tensor_file

        tensors = {"weight": self.weight, "mean": self.mean, "scale": self.scale}
        meta = {"format": _FORMAT, "bias": repr(self.bias), "threshold": repr(self.threshold)}
        write_tensor_file(path, tensors, meta)

    @classmethod
    def load(cls, path: Union[str, Path]) -> TokenJudge:
        """Reads a judge written by :meth:`save`.

        Raises
        ------
        FileNotFoundError
            If ``path`` does not exist.
        ValueError
            If the file is not a saved judge.
        """
        from .models.io import read_tensor_file

        meta, tensors = read_tensor_file(path, "judge")
        if meta.get("format") != _FORMAT or set(tensors) != {"weight", "mean", "scale"}:
            raise ValueError(f"path: {path} does not hold a TokenJudge (format {_FORMAT})")
        return cls(
            tensors["weight"],
            float(meta["bias"]),
            tensors["mean"],
            tensors["scale"],
            float(meta["threshold"]),
        )


# ---- mining ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One labelled mismatch: in the response to prompt ``prompt``, at ``position`` (0 = the first
    new token), the draft predicted ``draft_token`` where the current response had
    ``target_token``; ``important`` says whether swapping it in broke the task check."""

    prompt: int
    position: int
    target_token: int
    draft_token: int
    important: bool


@dataclasses.dataclass
class MinedMismatches:
    """What :func:`mine_important_tokens` found.

    Attributes
    ----------
    features : torch.Tensor
        float32 ``[M, F]`` (CPU): :func:`judge_features` of each mismatch, computed on the
        sequence with the draft token swapped in (what the target sees when it verifies it).
    important : torch.Tensor
        bool ``[M]`` (CPU).
    mismatches : list of Mismatch
        ``M`` records, in the order of ``features``.
    references : list of list of int
        The target's greedy response to each prompt.
    responses : list of list of int
        Each prompt's response after the unimportant swaps.
    """

    features: torch.Tensor
    important: torch.Tensor
    mismatches: list[Mismatch]
    references: list[list[int]]
    responses: list[list[int]]

    @property
    def important_fraction(self) -> float:
        """Fraction of the mismatches that are important (0.0 when none was found)."""
        n = int(self.important.numel())
        return float(self.important.sum()) / n if n else 0.0

    def summary(self) -> str:
        """One line: mismatches, the prompts they come from, the important fraction."""
        prompts = len({m.prompt for m in self.mismatches})
        return (
            f"{len(self.mismatches)} mismatches from {prompts} prompts, "
            f"{self.important_fraction:.1%} important"
        )

    def select(self, prompts: Iterable[int]) -> MinedMismatches:
        """The mismatches of the given prompt indices (for a split by prompt: mismatches of one
        response are correlated, so train and held-out sets should not share prompts).
        ``references`` and ``responses`` stay those of every prompt, as ``Mismatch.prompt``
        indexes them."""
        keep = sorted(set(int(p) for p in prompts))
        rows = [i for i, m in enumerate(self.mismatches) if m.prompt in set(keep)]
        index = torch.tensor(rows, dtype=torch.int64)
        return MinedMismatches(
            self.features[index],
            self.important[index],
            [self.mismatches[i] for i in rows],
            self.references,
            self.responses,
        )


def _padded(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """int64 ``[B, max len]``, right-padded with token 0 (harmless for a causal model's outputs at
    the real positions)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return ids.to(device)


def _score(
    model: Any, rows: Sequence[Sequence[int]], hidden: bool = False
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One causal pass of ``model`` over ragged rows: logits ``[B, T, V]`` (and the last hidden
    state ``[B, T, H]``) with T the longest row."""
    ids = _padded(rows, model.device)
    batch, width = ids.shape
    cache = model.new_cache(batch, width)
    positions = torch.arange(width, device=ids.device).expand(batch, width)
    if not hidden:
        return model.forward(ids, positions, cache)
    logits, (h,) = model.forward(ids, positions, cache, output_hidden=[-1])
    return logits, h


class _Search:
    """The semi-greedy search of one prompt: its current response and where the scan stands."""

    def __init__(self, index: int, prompt: list[int], reference: list[int]) -> None:
        self.index = index  # of the prompt, in the caller's list
        self.prompt = prompt
        self.reference = reference
        self.response = list(reference)
        self.start = 0  # positions before it are settled
        self.found = 0  # mismatches labelled
        self.predictions: Optional[list[int]] = None  # the draft's, for the current response
        self.pending: Optional[tuple[int, int]] = None  # (position, draft token)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.response

    def settle(self, candidate: list[int], important: bool) -> Mismatch:
        """Records the verdict on the pending mismatch and moves past it; an unimportant one
        makes ``candidate`` the current response (whose draft predictions are then stale)."""
        p, d = self.pending
        record = Mismatch(self.index, p, self.response[p], d, important)
        if not important:
            self.response, self.predictions = candidate, None
        self.start, self.found, self.pending = p + 1, self.found + 1, None
        return record


@torch.no_grad()
def mine_important_tokens(
    target: Any,
    draft: Any,
    prompts: Any,
    equivalent: Callable[[list[int], list[int], list[int]], Any],
    *,
    max_new_tokens: int,
    max_mismatches: Optional[int] = None,
    stop_token_ids: Optional[Iterable[int]] = None,
    batch_size: int = 8,
    draft_k: int = 4,
    progress: bool = False,
) -> MinedMismatches:
    """Labels the mismatches between a draft and a target model as important or not (AutoJudge's
    search), with the features a judge is fitted on.

    For each prompt, the target's greedy response is the reference. Repeatedly: the draft model
    predicts every token of the current response (one pass, fed the response); at the first
    position ``p`` not yet settled where its prediction ``d`` differs, the candidate is the
    response up to ``p``, then ``d``, then the target's greedy continuation (to the same length
    in new tokens, or a stop token). ``equivalent(prompt, reference, candidate)`` decides: True
    makes the mismatch unimportant and the candidate the current response; False makes it
    important. The scan resumes after ``p``; it ends at the end of the response or after
    ``max_mismatches`` mismatches. Prompts are searched side by side in batches; every greedy
    generation is the target's (speculative decoding with the draft model, ``method="greedy"``).

    Parameters
    ----------
    target, draft : CausalLM
        The models of the decoder the judge will serve (same vocabulary).
    prompts : list of list of int
        Token ids, each prompt non-empty.
    equivalent : callable ``(prompt, reference, candidate) -> bool``
        The task check on token id lists (new tokens only for ``reference`` and ``candidate``),
        e.g. comparing extracted answers, running tests, or :func:`same_python_code` on the
        decoded texts.
    max_new_tokens : int
        Length of the responses in new tokens.
    max_mismatches : int, optional
        Mismatches to label per prompt at most (None: all).
    stop_token_ids : iterable of int, optional
        Tokens that end a response (kept in it).
    batch_size : int
        Prompts searched together.
    draft_k : int
        Draft depth of the speculative greedy generations (their output is the target's).
    progress : bool
        A progress bar over the response positions settled.

    Returns
    -------
    MinedMismatches
        ``features`` is ``[0, 0]`` when no mismatch was found.
    """
    for attr in ("forward", "new_cache", "vocab_size", "max_length", "device"):
        for name, model in (("target", target), ("draft", draft)):
            if not hasattr(model, attr):
                raise TypeError(f"{name}: expected a CausalLM (specdecode.models), no {attr!r}")
    if int(draft.vocab_size) != int(target.vocab_size):
        raise ValueError(
            f"draft: its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}"
        )
    if not callable(equivalent):
        raise TypeError(f"equivalent: expected a callable, got {equivalent!r}")
    if max_mismatches is not None:
        max_mismatches = check_positive_int("max_mismatches", max_mismatches)
    batch_size = check_positive_int("batch_size", batch_size)
    draft_k = check_positive_int("draft_k", draft_k)
    greedy = SpeculativeDecoder(
        target, ModelDrafter(draft, k=draft_k, sample=False), method="greedy"
    )
    # The prompts, the length and the stop tokens as the decoder checks a request (the target's
    # max length); the draft reads whole responses too, so they must fit its max length as well.
    rows, stop_set = greedy._check_request(prompts, max_new_tokens, stop_token_ids)
    max_new_tokens, stops = int(max_new_tokens), sorted(stop_set)
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens > int(draft.max_length):
        raise ValueError(
            f"max_new_tokens: the longest prompt ({longest} tokens) plus {max_new_tokens} new "
            f"tokens exceeds the draft model's max length {draft.max_length}"
        )

    def generate(prefixes: list[list[int]], new: list[int]) -> list[list[int]]:
        # One call generates max(new) tokens after every prefix; where the longest prefix cannot
        # take that many (each row alone fits: prompt + max_new_tokens), one call per row.
        if max(len(p) for p in prefixes) + max(new) > int(target.max_length):
            return [generate([p], [n])[0] for p, n in zip(prefixes, new)]
        out = greedy.generate(
            prefixes, max_new_tokens=max(new), temperature=0.0, stop_token_ids=stops, seed=0
        )
        return [seq[:n] for seq, n in zip(out.sequences, new)]

    features: list[torch.Tensor] = []
    records: list[Mismatch] = []
    references: list[list[int]] = []
    responses: list[list[int]] = []
    bar = _Progress(len(rows) * max_new_tokens, unit="pos", units="positions") if progress else None
    try:
        for first in range(0, len(rows), batch_size):
            chunk = rows[first : first + batch_size]
            firsts = generate(chunk, [max_new_tokens] * len(chunk))
            searches = [_Search(first + i, p, r) for i, (p, r) in enumerate(zip(chunk, firsts))]
            # Rounds: every open search moves to its next mismatch, and all of them are labelled
            # with one batched target pass (features) and one batched generation (candidates).
            while todo := _next_mismatches(draft, searches, max_mismatches, max_new_tokens, bar):
                feats = _mismatch_features(target, todo)
                candidates = _candidates(todo, stops, max_new_tokens, generate)
                for s, f, cand in zip(todo, feats, candidates):
                    important = not bool(equivalent(list(s.prompt), list(s.reference), cand))
                    records.append(s.settle(cand, important))
                    features.append(f)
                    if bar is not None:
                        bar.update(1)
            references.extend(s.reference for s in searches)
            responses.extend(s.response for s in searches)
        if bar is not None:
            bar.finish()
    finally:
        if bar is not None:
            bar.close()
    # Without any mismatch there is no pass to read F from: the features are then [0, 0].
    stacked = torch.stack(features) if features else torch.zeros((0, 0))
    important = torch.tensor([m.important for m in records], dtype=torch.bool)
    return MinedMismatches(stacked, important, records, references, responses)


def _next_mismatches(
    draft: Any,
    searches: list[_Search],
    max_mismatches: Optional[int],
    max_new_tokens: int,
    bar: Optional[_Progress],
) -> list[_Search]:
    """Sets each open search's ``pending`` to its next mismatch, or closes the search (no
    mismatch left, or ``max_mismatches`` reached); returns the searches with one."""
    open_ = [s for s in searches if s.start < len(s.response)]
    _predict(draft, [s for s in open_ if s.predictions is None])
    for s in open_:
        before = s.start
        p = _first_mismatch(s)
        if p is None or (max_mismatches is not None and s.found >= max_mismatches):
            s.start = len(s.response)
        else:
            s.pending = (p, s.predictions[p])
        if bar is not None:
            # Settled positions: up to the mismatch, or to the end of max_new_tokens.
            settled = max_new_tokens if s.pending is None else s.pending[0]
            bar.update(max(settled - before, 0))
    return [s for s in open_ if s.pending is not None]


def _predict(draft: Any, searches: list[_Search]) -> None:
    """The draft model's argmax for every token of each current response (teacher-forced)."""
    if not searches:
        return
    logits = _score(draft, [s.sequence[:-1] for s in searches])
    top = logits.argmax(dim=-1).cpu()
    for b, s in enumerate(searches):
        first = len(s.prompt) - 1  # the position that predicts the first new token
        s.predictions = top[b, first : first + len(s.response)].tolist()


def _first_mismatch(s: _Search) -> Optional[int]:
    for p in range(s.start, len(s.response)):
        if s.predictions[p] != s.response[p]:
            return p
    return None


def _mismatch_features(target: Any, searches: list[_Search]) -> list[torch.Tensor]:
    """:func:`judge_features` of each pending mismatch, from the target's pass over the sequence
    with the draft token in place (the pass that would verify it)."""
    seqs = []
    for s in searches:
        p, d = s.pending
        seqs.append(s.prompt + s.response[:p] + [d])
    logits, hidden = _score(target, seqs, hidden=True)
    out = []
    for b, seq in enumerate(seqs):
        node = len(seq) - 1
        pair = slice(node - 1, node + 1)  # [the parent that predicts d, the node that reads it]
        f = judge_features(
            hidden[b : b + 1, pair],
            logits[b : b + 1, pair],
            torch.tensor([[0, seq[-1]]]),
            torch.tensor([[-1, 0]]),
        )
        out.append(f[0, 1].cpu())
    return out


def _candidates(
    searches: list[_Search],
    stops: list[int],
    max_new_tokens: int,
    generate: Callable[[list[list[int]], list[int]], list[list[int]]],
) -> list[list[int]]:
    """Each pending mismatch's candidate response: the response before it, the draft token, and
    the target's greedy continuation up to ``max_new_tokens`` new tokens or a stop token."""
    heads = []
    for s in searches:
        p, d = s.pending
        heads.append(s.response[:p] + [d])
    grow = [i for i, h in enumerate(heads) if len(h) < max_new_tokens and h[-1] not in set(stops)]
    if grow:
        tails = generate(
            [searches[i].prompt + heads[i] for i in grow],
            [max_new_tokens - len(heads[i]) for i in grow],
        )
        for i, tail in zip(grow, tails):
            heads[i] = heads[i] + tail
    return heads


# ---- a task check for code -------------------------------------------------------------------

_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}


def python_code_tokens(text: str) -> list[str]:
    """The program's tokens in Python source: comments, blank lines and layout inside brackets
    dropped, triple-quoted strings (docstrings) read as one placeholder, indentation kept as
    INDENT / DEDENT. Only complete lines count (a completion cut mid-line ends at its last
    newline); tokenizing stops quietly at an unterminated construct.

    Parameters
    ----------
    text : str

    Returns
    -------
    list of str
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    text = text[: text.rfind("\n") + 1]
    out: list[str] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in _SKIPPED:
                continue
            if tok.type == tokenize.STRING and tok.string.lstrip("rRbBuUfF")[:3] in ('"""', "'''"):
                out.append("<docstring>")
            elif tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
                out.append(tokenize.tok_name[tok.type])
            else:
                out.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # an unterminated string or bracket at the cut: the tokens before it stand
    return out


def same_python_code(reference: str, candidate: str, *, coverage: float = 0.75) -> bool:
    """Whether ``candidate`` is the same program as ``reference`` as far as both go.

    The :func:`python_code_tokens` of the two must agree over the shorter one, and the candidate
    must reach at least ``coverage`` of the reference's tokens (so that a swap which turns the
    rest of the completion into a comment does not pass for free). Two completions of a prompt
    to the same token budget typically end at different points, hence the prefix rule.

    Parameters
    ----------
    reference, candidate : str
        Decoded completions (with the prompt or without it, the same way for both).
    coverage : float
        In ``[0, 1]``.
    """
    coverage = _check_fraction("coverage", coverage)
    ref, cand = python_code_tokens(reference), python_code_tokens(candidate)
    n = min(len(ref), len(cand))
    return ref[:n] == cand[:n] and len(cand) >= coverage * len(ref)


# ---- a task check for answers --------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> Optional[decimal.Decimal]:
    """The last number in ``text`` (thousands separators dropped), as GSM8K-style answers end
    (``... #### 72`` or ``The answer is 72.``); None if there is none.

    Parameters
    ----------
    text : str
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    found = _NUMBER.findall(text)
    if not found:
        return None
    return decimal.Decimal(found[-1].replace(",", ""))


def same_final_number(reference: str, candidate: str) -> bool:
    """Whether the two texts end on the same number (``3.50`` equals ``3.5``; two texts without
    any number are the same answer, none).

    Parameters
    ----------
    reference, candidate : str
        Decoded responses.
    """
    return final_number(reference) == final_number(candidate)
