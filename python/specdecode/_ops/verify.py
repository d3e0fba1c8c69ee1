"""Batched verification of draft chains and trees (rejection sampling), and plain sampling.

For each sequence ``b`` of a batch, the draft is a tree in the format of :func:`tree_info`
(``parents=None`` means a chain): node 0 is the root (the last committed token) and
``tokens[b, i]`` is the draft token of node ``i``. ``target[b, i, :]`` is the target's
distribution for the child of node ``i`` (logits or probabilities), and ``draft_probs[b, i, :]``
(optional) the distribution the drafter sampled node ``i``'s children from.

The walk starts at the root. At each node the children are tried in ascending node order with the
rule of ``method``; the first accepted child becomes the next node. Where no child is accepted, a
**correction** token is drawn from what is left of the target distribution; at a leaf, a **bonus**
token is drawn from the leaf's target row. A step therefore emits 1 to depth + 1 tokens.

Target rows are turned into the sampling distribution inside the kernel: logits are divided by
``temperature`` (0 means greedy), then top-k keeps the tokens whose logit is at least the k-th
largest (ties kept), then top-p keeps the most likely tokens whose mass reaches ``top_p`` (ties at
the threshold kept); the rest is renormalised. Nothing of size ``V`` is materialised.

Randomness is Philox4x32-10 keyed by ``(seed[b], offset[b], node, purpose)``: results do not
depend on the batch order, the number of threads or the backend (CPU and CUDA emit the same
tokens). Use a new ``offset`` for every step of a sequence.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch

from .. import _C
from .common import as_array, holds_bool, multiprocessors, numpy_dtype_error, stream_of
from .tree import MAX_TREE_NODES, tree_info

MAX_VOCAB = 256 * 2048
"""Largest vocabulary the kernels accept (fixed chunking of the canonical sums)."""

MAX_SIBLINGS = 64
"""Most children one node of a draft tree may have (exact and relaxed methods)."""

STATUS_NON_FINITE = 1
"""Status bit: a target row on the walk had a NaN/+Inf logit (or a NaN/Inf/negative probability)."""
STATUS_ZERO_MASS = 2
"""Status bit: a target row on the walk had no mass (all logits -inf, or all probabilities 0)."""
STATUS_BAD_DRAFT = 4
"""Status bit: a draft probability read on the walk was NaN, Inf or negative."""

_STATUS_BAD_TREE, _STATUS_BAD_TOKEN, _STATUS_DEPTH, _STATUS_SIBLINGS = 16, 32, 64, 128

_METHODS = {"exact": 0, "greedy": 1, "typical": 2, "relaxed": 3, "topk_accept": 4, "block": 5}

_CPU_FINAL_SLICES = 0
"""Testing knob (not API): with a value >= 1, CPU calls take the final draw's chunk sums in that
many slices with the CUDA kernels' lane-by-lane arithmetic and find the top-p threshold by the
CUDA kernels' per-chunk tries (src/verify.cc, ``verify_one``); 0 is the production path. Every
value gives the same results, which tests/test_ops_verify.py checks."""

Scalar = Union[int, float]


class VerifyResult(NamedTuple):
    """Result of :func:`verify`; int32 tensors on the device of ``target``.

    Attributes
    ----------
    emitted : torch.Tensor
        ``[B, D + 1]``: the accepted draft tokens in path order, then the correction or bonus
        token; padded with -1. ``D`` is ``max_depth``.
    num_emitted : torch.Tensor
        ``[B]``: valid entries of ``emitted`` (``num_accepted + 1``, or ``num_accepted`` when a
        row had a non-zero ``status``).
    path : torch.Tensor
        ``[B, D + 1]``: node index of the root (0) and of each accepted node, padded with -1.
        The KV cache of nodes ``path[b, :num_accepted[b] + 1]`` is the one to keep.
    status : torch.Tensor
        ``[B]``: 0, or an OR of :data:`STATUS_NON_FINITE`, :data:`STATUS_ZERO_MASS`,
        :data:`STATUS_BAD_DRAFT`. A flagged row stops at the node whose row was bad and emits no
        correction/bonus token there; the draft tokens accepted before it stand.
    num_accepted : torch.Tensor
        ``[B]``: number of accepted draft tokens (the depth of the last node of ``path``).
    """

    emitted: torch.Tensor
    num_emitted: torch.Tensor
    path: torch.Tensor
    status: torch.Tensor
    num_accepted: torch.Tensor


class SampleResult(NamedTuple):
    """Result of :func:`sample`; int32 tensors on the device of ``logits``.

    Attributes
    ----------
    tokens : torch.Tensor
        ``[B]``: the sampled token ids, -1 where ``status`` is non-zero.
    status : torch.Tensor
        ``[B]``: 0, or :data:`STATUS_NON_FINITE` / :data:`STATUS_ZERO_MASS` for a bad row.
    """

    tokens: torch.Tensor
    status: torch.Tensor


# ---- argument conversion -------------------------------------------------------------------------


# The dtypes the arguments take, in the words of their dtype checks (and of the TypeError for a
# numpy array whose dtype cannot be read at all).
_FLOAT_DTYPES = "float32, float16 or bfloat16"
_INT_DTYPES = "int32 or int64"
_BOOL_DTYPES = "bool (or uint8)"
_INT_ARRAY = "an int32 or int64 array"
_FLOAT_ARRAY = "a float array"


def _from_list(x: list | tuple, name: str, kind: str, expected: str) -> torch.Tensor:
    """A nested list of numbers as a tensor of the `kind` of values `name` takes ("int",
    "float", "number" (either) or "bool"), decided by the values it holds, not by the scalar
    types torch would infer from them: ints (Python or numpy, of any width) make an int64 tensor,
    a list holding any float a float32 one, an empty list one of `kind`.

    As the tensor path refuses a float tensor for integers and an int tensor for floats, a float
    in a list of `kind` "int" and a list of only ints of `kind` "float" are TypeErrors, and so is
    a bool in a numeric list (torch would make it a 1)."""
    if kind != "bool" and holds_bool(x):
        raise TypeError(f"{name}: expected numbers, got a list holding a bool")
    try:
        t = torch.tensor(x)
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: None, mixed uint64
        raise ValueError(f"{name}: cannot make an array from the given list: {exc}") from None
    if kind == "bool":
        return t  # bool lists stay bool; other dtypes meet the caller's dtype check
    if t.numel() == 0:
        return t.to(torch.int64 if kind == "int" else torch.float32)
    if t.dtype.is_complex:
        raise TypeError(f"{name}: expected {expected}, got a list holding a complex number")
    if t.dtype.is_floating_point:
        if kind == "int":
            raise TypeError(f"{name}: expected {expected}, got a list holding a float")
        return t.to(torch.float32)
    if kind == "float":
        raise TypeError(
            f"{name}: expected {expected}, got a list of ints (write 1.0 for 1, or pass a "
            "float tensor)"
        )
    return t.to(torch.int64)


def _tensor(x: Any, name: str, kind: str, expected: str) -> torch.Tensor:
    """`x` as a torch tensor (zero-copy for arrays; a list is converted by :func:`_from_list`
    to the `kind` of values `name` takes). A numpy array torch cannot read (non-native byte
    order, object, str, ...) is a TypeError naming the `expected` dtypes."""
    if isinstance(x, (list, tuple)):
        return _from_list(x, name, kind, expected)
    x = as_array(x, name)
    if isinstance(x, np.ndarray):
        try:
            return torch.from_numpy(x)
        except (TypeError, ValueError):
            # torch's own errors name neither the argument nor what it takes.
            error = numpy_dtype_error(name, x, expected)
            if error is None:
                raise
            raise error from None
    if isinstance(x, torch.Tensor):
        return x
    raise TypeError(
        f"{name}: expected a torch.Tensor, numpy.ndarray or an array with __dlpack__, "
        f"got {type(x).__name__}"
    )


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _check_float_rows(x: torch.Tensor, name: str, ndim: int) -> None:
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected {_FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous array (call .contiguous())")


def _same_device(x: torch.Tensor, name: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name}: expected an array on {device} (as target), got {x.device}")


def _int_rows(x: Any, name: str, batch: int, n: int, device: torch.device) -> torch.Tensor:
    t = _tensor(x, name, "int", _INT_DTYPES)
    if t.dtype not in _INTS:
        raise TypeError(f"{name}: expected {_INT_DTYPES}, got {t.dtype}")
    if tuple(t.shape) != (batch, n):
        raise ValueError(f"{name}: expected shape [B, N] = [{batch}, {n}], got {list(t.shape)}")
    _same_device(t, name, device)
    if t.dtype == torch.int64:
        if t.device.type == "cpu" and t.numel():
            a = t.numpy()  # numpy's reductions cost less than torch's on these small arrays
            if a.min() < -(2**31) or a.max() >= 2**31:
                raise ValueError(f"{name}: values must fit in int32")
        t = t.to(torch.int32)
    return t.contiguous()


_CONSTANTS: dict = {}
_MAX_CONSTANTS = 256


def _constant(value: Any, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [B] tensor filled with a scalar parameter. On the CPU it is kept for later calls with
    the same value (decoding loops pass the same temperature, top-k, top-p and seed every step):
    native code only reads these tensors, and they are never handed to the caller. Device
    tensors are made anew (a kept one could be read on another stream before its fill ran), as
    under torch.compile (no global tensors in the graph)."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return torch.full((batch,), value, dtype=dtype, device=device)
    key = (type(value), value, batch, dtype)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.clear()
        t = torch.full((batch,), value, dtype=dtype, device=device)
        _CONSTANTS[key] = t
    return t


def _per_sequence(
    value: Any,
    name: str,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    lo: float,
    hi: float,
    lo_open: bool = False,
) -> torch.Tensor:
    """A scalar or [B] array as a contiguous [B] tensor of `dtype`; values checked in range."""
    integer = dtype in _INTS

    def bad(v: float) -> bool:
        return not (v > lo if lo_open else v >= lo) or not v <= hi

    rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{name}: expected a number or a [B] array, got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        if integer and not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {value!r}")
        if bad(float(value)):
            raise ValueError(f"{name}: expected a value in {rng}, got {value!r}")
        return _constant(value, batch, dtype, device)
    if integer:
        t = _tensor(value, name, "int", _INT_ARRAY)
    else:
        t = _tensor(value, name, "number", _FLOAT_ARRAY)
    if integer and t.dtype not in _INTS:
        raise TypeError(f"{name}: expected {_INT_ARRAY}, got {t.dtype}")
    if not integer and not (t.dtype.is_floating_point or t.dtype in _INTS):
        raise TypeError(f"{name}: expected {_FLOAT_ARRAY}, got {t.dtype}")
    if t.dim() == 0:
        t = t.reshape(1).expand(batch)
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name}: expected a scalar or shape [B] = [{batch}], got {list(t.shape)}")
    _same_device(t, name, device)
    # Value checks need the data on the host; device arrays (CUDA-graph capture) are trusted and
    # the kernel treats out-of-range values safely (see verify's docstring).
    if t.device.type == "cpu" and batch:
        # A few values (the engine's usual batch) as Python numbers, more through numpy: torch's
        # per-op cost, several ops per parameter, would exceed the kernel on a short chain.
        if batch <= 64:
            values = t.tolist()
            lo_v, hi_v = min(values), max(values)
            nan = any(v != v for v in values)
        else:
            f = t.detach()
            f = (f.float() if f.dtype == torch.bfloat16 else f).numpy()
            lo_v, hi_v = f.min(), f.max()
            nan = bool(np.isnan(lo_v) or np.isnan(hi_v))
        if nan or bad(float(lo_v)) or bad(float(hi_v)):
            raise ValueError(f"{name}: every value must be in {rng}")
    return t.to(dtype).contiguous()


_HARD_ERRORS = _STATUS_BAD_TREE | _STATUS_BAD_TOKEN | _STATUS_DEPTH | _STATUS_SIBLINGS


def _raise_walk_errors(status: torch.Tensor, parents: Optional[torch.Tensor], n: int) -> None:
    # On the host through numpy (a fraction of torch's per-op cost at these sizes); a device
    # status is copied once.
    hard = status.cpu().numpy() & _HARD_ERRORS
    bad = np.flatnonzero(hard)
    if bad.size == 0:
        return
    b = int(bad[0])
    code = int(hard[b])
    if code & _STATUS_BAD_TREE:
        what = (
            "num_nodes",
            f"num_nodes[{b}] must be in [1, the nodes of the tree row ({n} at most)]",
        )
        if parents is not None:
            tree_info(parents[b : b + 1])  # raises the tree error with its explanation
    elif code & _STATUS_BAD_TOKEN:
        what = ("tokens", f"batch row {b} has a draft token outside [0, V)")
    elif code & _STATUS_DEPTH:
        what = ("max_depth", f"batch row {b} has a tree deeper than max_depth")
    else:
        what = (
            "parents",
            f"batch row {b} has a node with more than {MAX_SIBLINGS} children, "
            "the most verify supports",
        )
    raise ValueError(f"{what[0]}: {what[1]}")


# ---- the native call, registered with torch.library ----------------------------------------------


def _final_slices(batch: int, vocab: int, device: torch.device) -> int:
    """Slices of the vocabulary's 256-token chunks for the CUDA kernel of the final draw's sums
    (one thread block per sequence and slice): about two blocks per SM, and at least 16 chunks a
    slice (one pass of a 128-thread block, eight threads per chunk)."""
    chunks = -(-vocab // 256)
    sms = multiprocessors(device)
    want = -(-2 * sms // max(batch, 1))
    return int(max(1, min(want, -(-chunks // 16))))


def _run(
    target: torch.Tensor,
    tokens: torch.Tensor,
    parents: Optional[torch.Tensor],
    num_nodes: Optional[torch.Tensor],
    draft_probs: Optional[torch.Tensor],
    draft_deterministic: Optional[torch.Tensor],
    allow: Optional[torch.Tensor],
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    target_is_logits: bool,
    method: int,
    eps: float,
    alpha: float,
    topk_accept: int,
    correction_from_target: bool,
    max_depth: int,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, n = target.shape[0], target.shape[1]
    device = target.device
    emitted = torch.empty((batch, max_depth + 1), dtype=torch.int32, device=device)
    path = torch.empty_like(emitted)
    num_emitted = torch.empty((batch,), dtype=torch.int32, device=device)
    status = torch.empty_like(num_emitted)
    num_accepted = torch.empty_like(num_emitted)
    workspace = None
    final_slices = _CPU_FINAL_SLICES
    vocab = int(target.shape[-1]) if target.dim() == 3 else 0
    if device.type == "cuda" and 1 <= vocab <= MAX_VOCAB:
        # The kernels of the final draw hand their data over in this buffer (native code
        # allocates nothing on the GPU); other shapes are left to the native validation.
        final_slices = _final_slices(batch, vocab, device)
        size = _C.verify_workspace_bytes(batch, vocab)
        workspace = torch.empty((size,), dtype=torch.uint8, device=device)
    _C.verify(
        target,
        draft_probs,
        draft_deterministic,
        tokens,
        parents,
        num_nodes,
        allow,
        temperature,
        top_k,
        top_p,
        seed,
        offset,
        target_is_logits,
        method,
        eps,
        alpha,
        topk_accept,
        correction_from_target,
        max_depth,
        emitted,
        num_emitted,
        path,
        status,
        num_accepted,
        stream_of(device),
        workspace,
        final_slices,
    )
    if check:
        _raise_walk_errors(status, parents, n)
    return emitted, num_emitted, path, status, num_accepted


@torch.library.custom_op("specdecode::verify", mutates_args=())
def _verify_op(
    target: torch.Tensor,
    tokens: torch.Tensor,
    parents: Optional[torch.Tensor],
    num_nodes: Optional[torch.Tensor],
    draft_probs: Optional[torch.Tensor],
    draft_deterministic: Optional[torch.Tensor],
    allow: Optional[torch.Tensor],
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    target_is_logits: bool,
    method: int,
    eps: float,
    alpha: float,
    topk_accept: int,
    correction_from_target: bool,
    max_depth: int,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run(
        target,
        tokens,
        parents,
        num_nodes,
        draft_probs,
        draft_deterministic,
        allow,
        temperature,
        top_k,
        top_p,
        seed,
        offset,
        target_is_logits,
        method,
        eps,
        alpha,
        topk_accept,
        correction_from_target,
        max_depth,
        check,
    )


@_verify_op.register_fake
def _verify_fake(
    target,
    tokens,
    parents,
    num_nodes,
    draft_probs,
    draft_deterministic,
    allow,
    temperature,
    top_k,
    top_p,
    seed,
    offset,
    target_is_logits,
    method,
    eps,
    alpha,
    topk_accept,
    correction_from_target,
    max_depth,
    check,
):
    batch = target.shape[0]
    emitted = target.new_empty((batch, max_depth + 1), dtype=torch.int32)
    vec = target.new_empty((batch,), dtype=torch.int32)
    return emitted, vec, torch.empty_like(emitted), torch.empty_like(vec), torch.empty_like(vec)


def _dispatch(*args: Any) -> tuple[torch.Tensor, ...]:
    # Eager calls go straight to the native module; under torch.compile the registered op (with
    # its fake implementation) keeps the graph traceable.
    if torch.compiler.is_compiling():
        return torch.ops.specdecode.verify(*args)
    return _run(*args)


def _draft_deterministic(
    value: Any, draft: Optional[torch.Tensor], batch: int, device: torch.device
) -> Optional[torch.Tensor]:
    """verify's ``draft_deterministic`` as a contiguous bool ``[B]`` tensor (None stays None)."""
    if value is None:
        return None
    if draft is None:
        raise ValueError(
            "draft_deterministic: only meaningful with draft_probs (without them every "
            "sequence is verified as deterministic)"
        )
    if isinstance(value, (bool, np.bool_)):
        return torch.full((batch,), bool(value), dtype=torch.bool, device=device)
    t = _tensor(value, "draft_deterministic", "bool", _BOOL_DTYPES)
    if t.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"draft_deterministic: expected {_BOOL_DTYPES}, got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(
            f"draft_deterministic: expected a bool or shape [B] = [{batch}], got {list(t.shape)}"
        )
    _same_device(t, "draft_deterministic", device)
    return t.contiguous()


def _processing(
    temperature: Any, top_k: Any, top_p: Any, is_logits: bool, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """temperature float32, top_k int32 and top_p float32, each a contiguous ``[B]`` tensor."""
    if is_logits:
        temp_t = _per_sequence(temperature, "temperature", batch, torch.float32, device, 0, 3e38)
    else:
        temp_t = _per_sequence(temperature, "temperature", batch, torch.float32, device, 0, 1)
        if temp_t.device.type == "cpu" and bool(((temp_t != 0) & (temp_t != 1)).any()):
            raise ValueError("temperature: with probability inputs it must be 0 or 1")
    top_k_t = _per_sequence(top_k, "top_k", batch, torch.int32, device, 0, 2**31 - 1)
    top_p_t = _per_sequence(top_p, "top_p", batch, torch.float32, device, 0, 1, lo_open=True)
    return temp_t, top_k_t, top_p_t


def _run_sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    is_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    status = torch.empty((logits.shape[0],), dtype=torch.int32, device=logits.device)
    _C.sampling_probs(
        logits, temperature, top_k, top_p, is_logits, probs, status, stream_of(logits.device)
    )
    return probs, status


@torch.library.custom_op("specdecode::sampling_probs", mutates_args=())
def _sampling_probs_op(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    is_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_sampling_probs(logits, temperature, top_k, top_p, is_logits)


@_sampling_probs_op.register_fake
def _sampling_probs_fake(logits, temperature, top_k, top_p, is_logits):
    probs = logits.new_empty(logits.shape, dtype=torch.float32)
    return probs, logits.new_empty((logits.shape[0],), dtype=torch.int32)


# ---- public API ----------------------------------------------------------------------------------


def method_options(
    method: str, eps: Optional[float], alpha: Optional[float], topk_accept: Optional[int]
) -> tuple[float, float, int]:
    """``(eps, alpha, K)`` of a verification method, its defaults filled in and its ranges
    checked (ValueError); 0 where the method has no such option. Shared by :func:`verify` and
    the engine, which checks its options before any work."""
    eps_v, alpha_v, k_v = 0.0, 0.0, 0
    if method == "typical":
        eps_v = 0.09 if eps is None else float(eps)
        alpha_v = 0.3 if alpha is None else float(alpha)
        if not (0 <= eps_v <= 1 and alpha_v >= 0 and np.isfinite(alpha_v)):
            raise ValueError(f"eps, alpha: expected 0 <= eps <= 1, alpha >= 0, got {eps}, {alpha}")
    elif method == "relaxed":
        if eps is None:
            raise ValueError("eps: method='relaxed' needs eps >= 0 (the acceptance slack)")
        eps_v = float(eps)
        if not (eps_v >= 0 and np.isfinite(eps_v)):
            raise ValueError(f"eps: expected a finite value >= 0, got {eps!r}")
    elif method == "topk_accept":
        if not isinstance(topk_accept, (int, np.integer)) or isinstance(topk_accept, bool):
            raise ValueError(
                f"topk_accept: method='topk_accept' needs an int K >= 1, got {topk_accept!r}"
            )
        if not 1 <= topk_accept < 2**31:
            raise ValueError(f"topk_accept: expected K >= 1, got {topk_accept}")
        k_v = int(topk_accept)
    return eps_v, alpha_v, k_v


def verify(
    target: Any,
    tokens: Any,
    *,
    parents: Any = None,
    num_nodes: Any = None,
    draft_probs: Any = None,
    draft_deterministic: Any = None,
    target_is_logits: bool = True,
    temperature: Any = 1.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    seed: Any,
    offset: Any,
    method: str = "exact",
    eps: Optional[float] = None,
    alpha: Optional[float] = None,
    topk_accept: Optional[int] = None,
    correction: str = "residual",
    allow: Any = None,
    max_depth: Optional[int] = None,
    check: bool = True,
) -> VerifyResult:
    """Verifies a batch of draft chains or trees against the target in one call.

    Parameters
    ----------
    target : torch.Tensor or array-like
        float32, float16 or bfloat16 ``[B, N, V]``, contiguous, ``1 <= N <= 1024``,
        ``1 <= V <= 524288``: row ``[b, i]`` is the target's distribution for the child of node
        ``i`` (logits, or probabilities when ``target_is_logits=False``; probabilities need not
        be normalised exactly, they are renormalised; a row whose float32 sum overflows
        (past 3.4e38) sets :data:`STATUS_NON_FINITE`, and rows of subnormal values around 1e-45
        lose the precision their draws need).
    tokens : torch.Tensor or array-like
        int32 or int64 ``[B, N]``: the draft token of each node; ``tokens[b, 0]`` (the root) is
        not read, the tokens of valid nodes must be in ``[0, V)``, padding is ignored.
    parents : torch.Tensor or array-like, optional
        int32 ``[B, N]`` in the tree format of :func:`tree_info`. None: every row is a chain
        ``0 -> 1 -> ... -> N-1``.
    num_nodes : torch.Tensor or array-like, optional
        int32 ``[B]``: valid nodes per row, in ``[1, nodes of the tree row]`` (variable draft
        lengths; nodes past it are ignored). Default: all ``N`` nodes for chains, the unpadded
        nodes of each tree row.
    draft_probs : torch.Tensor or array-like, optional
        float32/float16/bfloat16 ``[B, N, V]``, contiguous: row ``[b, i]`` is the distribution
        ``q`` the drafter sampled node ``i``'s children from (siblings sampled without
        replacement). None: the children were chosen deterministically (n-gram, top-k, argmax).
        Each row is used as given, not rescaled: it must sum to 1 (to within its dtype's
        rounding), or the output's distribution leaves the target's (the acceptance test
        ``min(1, p(x) / q(x))`` and the residual ``max(p - q, 0)`` read ``q`` as it is). A
        drafted token with ``q(x) = 0`` is accepted iff ``p(x) > 0`` (``u * q(x) < p(x)``),
        i.e. treated as an infinitely unlikely draft.
    draft_deterministic : bool or array-like [B], optional
        bool (or uint8) per sequence, only with ``draft_probs``: True where the sequence's
        children were chosen deterministically although the batch has ``draft_probs`` (a batch
        that mixes sampled and deterministic drafters). Such a sequence is verified as with
        ``draft_probs=None`` (trees with deterministic siblings included) and its rows of
        ``draft_probs`` are never read: they may hold anything. None: every sequence sampled.
    target_is_logits : bool
        Whether ``target`` holds logits (default) or probabilities.
    temperature, top_k, top_p : scalar or array-like [B]
        Per sequence; temperature ``>= 0`` (0 = greedy: ``method`` is then ``"greedy"`` for that
        sequence), top_k ``>= 0`` (0 = off), top_p in ``(0, 1]`` (1 = off). With probability
        inputs the temperature must be 0 or 1. Device arrays are not range-checked (that would
        sync); the kernel treats a temperature <= 0 as greedy and top_k <= 0 or >= V as off. A
        temperature so small that ``logits / temperature`` leaves float32 (e.g. ``1e-38``) sets
        :data:`STATUS_NON_FINITE` for the row, as a +Inf logit would: use 0 for greedy.
    seed, offset : int or array-like [B]
        Philox key and counter offset per sequence (int32/int64; may live on the device).
    method : str
        ``"exact"`` (default, lossless): one child sampled from q is accepted with
        ``min(1, p(x)/q(x))``; several children sampled from q use recursive rejection sampling
        without replacement (residual ``p <- norm(max(p - q, 0))``, q renormalised without the
        tried token); deterministic children are accepted with
        ``p(c) / (1 - p(tried children))`` and the residual is p without the tried children.
        The output is distributed exactly as the target's sampling distribution.
        ``"block"`` (lossless; Sun et al., "Block Verification Accelerates Speculative
        Decoding", ICLR 2025): a chain sampled from q is judged as one block instead of token by
        token. With ``p_0 = 1``, ``p_j = min(1, p_{j-1} p(x_j) / q(x_j))`` along the chain and
        ``r_j = sum max(p_j p - q, 0)`` of node j's rows, the drafts ``x_1 .. x_tau`` are kept
        for the largest ``tau`` whose test ``u_j < r_j / (r_j + 1 - p_j)`` passes (``u_g < p_g``
        at the last draft ``g``), and the last token comes from ``norm(max(p_tau p - q, 0))``
        (or p past the last draft). Distributed exactly as the target's sampling distribution,
        also when the drafter chose the chain's length from its drafts; in expectation it accepts
        at least as many drafts as ``"exact"`` (a draft the token-by-token test would reject is
        kept when a later test passes) and no valid rule accepts more of a block. It reads every
        row of the chain up to the first ``p_j = 0``, where ``"exact"`` stops at its first
        rejection, and takes one more pass over a row (for ``r_j``) where its test can pass.
        Applies to sequences with sampled drafts (``draft_probs``, not
        ``draft_deterministic``) whose nodes form a chain; the others are verified as with
        ``"exact"`` (for deterministic drafts that is already the most any valid rule accepts).
        Uses the same uniforms as ``"exact"``: where both accept everything, they emit the
        same tokens.
        ``"greedy"``: follow the child equal to the target's argmax (ties: lowest id), emit the
        argmax at the stop; exact for temperature 0.
        ``"typical"`` (lossy, Medusa): accept the first child with
        ``p(x) > min(eps, alpha * exp(-H(p)))``; the correction/bonus token is sampled from p.
        Gives up exactness: likely-but-unsampled continuations are accepted more often than p
        says, which favours frequent tokens and lowers diversity.
        ``"relaxed"`` (lossy, Yin et al.): accept with ``min(1, p(x)/q(x) + eps)`` (deterministic
        children: ``q`` is the one-hot of the child); the correction comes from
        ``norm(max(p - q, 0))`` (``correction="residual"``, Decoding-OPT: the law that minimises
        the total-variation distance to p for this acceptance rule, which is then
        ``sum max(min(q, p + eps q) - p, 0)``) or from p itself (``correction="target"``,
        Decoding-UNO). Gives up exactness for acceptance: over-accepts tokens the draft
        over-weights.
        ``"topk_accept"`` (lossy): accept the first child among the target's ``topk_accept`` most
        likely tokens (ties favour acceptance; probability-0 tokens never); correction/bonus from
        p. Gives up exactness: the draft's choice among the top K replaces the target's.
    eps, alpha : float, optional
        typical: ``eps`` (default 0.09) and ``alpha`` (default 0.3); relaxed: ``eps >= 0``
        (required).
    topk_accept : int, optional
        K for ``method="topk_accept"`` (required, >= 1).
    correction : str
        ``"residual"`` (default) or ``"target"``; only for ``method="relaxed"``.
    allow : torch.Tensor or array-like, optional
        bool ``[B, N]``: node ``i`` is accepted regardless of the rule when its parent is reached
        (the hook for judges and importance-based verifiers). Gives up exactness wherever it is
        set. Not with ``method="block"``, whose decision is one for the whole chain.
    max_depth : int, optional
        ``D``, the width of the outputs minus one. Default: ``N - 1`` for chains, the largest
        depth of the trees (computed with :func:`tree_info`, a device sync on a GPU).
    check : bool
        Raise ValueError for invalid trees, out-of-range tokens or a too small ``max_depth``
        after the call (a device sync on a GPU). With False these only show in ``status``
        (bits 16, 32, 64, 128) and the row emits nothing. Every check is of the whole tree
        (not only of where the draws lead the walk): its validity, its tokens, its depth
        against ``max_depth`` and, for sampled exact / relaxed rows, at most
        :data:`MAX_SIBLINGS` children per node.

    Returns
    -------
    VerifyResult
        ``emitted``, ``num_emitted``, ``path``, ``status``, ``num_accepted`` (int32, on the
        device of ``target``).

    Raises
    ------
    TypeError
        A wrong dtype of any argument.
    ValueError
        A wrong shape, device or contiguity, a value out of range, an invalid tree, or a draft
        token outside ``[0, V)``; the message names the argument.

    Notes
    -----
    Every array argument may also be a nested Python list (a copy, converted as
    :mod:`specdecode.ops` describes): a float among ``tokens``, ``parents``, ``num_nodes``,
    ``seed``, ``offset`` or ``top_k`` is a TypeError, as a float tensor is; ``target`` and
    ``draft_probs`` lists become float32, and one holding only ints is a TypeError, as an int
    tensor is; ``temperature`` and ``top_p`` lists take ints and floats; ``allow`` and
    ``draft_deterministic`` lists hold bools; a bool in any numeric list is a TypeError.

    Zero-probability tokens are never emitted (in every method but ``allow``). Rows with NaN/Inf
    values only matter when the walk reads them: they set ``status`` and emit nothing there.
    Uniforms have 24 bits, so tokens of probability below about 6e-8 are drawn with slightly
    quantised probability; logits more than 87 below the maximum count as probability 0.
    """
    if method not in _METHODS:
        raise ValueError(f"method: expected one of {sorted(_METHODS)}, got {method!r}")
    if correction not in ("residual", "target"):
        raise ValueError(f"correction: expected 'residual' or 'target', got {correction!r}")
    target_t = _tensor(target, "target", "float", _FLOAT_DTYPES)
    _check_float_rows(target_t, "target", 3)
    batch, n, vocab = (int(s) for s in target_t.shape)
    if not 1 <= n <= MAX_TREE_NODES:
        raise ValueError(f"target: expected 1 <= N <= {MAX_TREE_NODES} nodes, got N = {n}")
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"target: expected 1 <= V <= {MAX_VOCAB}, got V = {vocab}")
    device = target_t.device
    tokens_t = _int_rows(tokens, "tokens", batch, n, device)

    parents_t = None
    if parents is not None:
        parents_t = _int_rows(parents, "parents", batch, n, device)
    num_nodes_t = None
    if num_nodes is not None:
        num_nodes_t = _per_sequence(num_nodes, "num_nodes", batch, torch.int32, device, 1, n)
    draft_t = None
    if draft_probs is not None:
        draft_t = _tensor(draft_probs, "draft_probs", "float", _FLOAT_DTYPES)
        _check_float_rows(draft_t, "draft_probs", 3)
        if tuple(draft_t.shape) != (batch, n, vocab):
            raise ValueError(
                f"draft_probs: expected shape [B, N, V] = [{batch}, {n}, {vocab}] (as target), "
                f"got {list(draft_t.shape)}"
            )
        _same_device(draft_t, "draft_probs", device)
    deterministic_t = _draft_deterministic(draft_deterministic, draft_t, batch, device)
    allow_t = None
    if allow is not None:
        if method == "block":
            raise ValueError(
                "allow: method='block' judges a chain as one block, a node cannot be allowed "
                "alone; use method='exact' or 'greedy' with allow"
            )
        allow_t = _tensor(allow, "allow", "bool", _BOOL_DTYPES)
        if allow_t.dtype not in (torch.bool, torch.uint8):
            raise TypeError(f"allow: expected {_BOOL_DTYPES}, got {allow_t.dtype}")
        if tuple(allow_t.shape) != (batch, n):
            raise ValueError(
                f"allow: expected shape [B, N] = [{batch}, {n}], got {list(allow_t.shape)}"
            )
        _same_device(allow_t, "allow", device)
        allow_t = allow_t.contiguous()

    temp_t, top_k_t, top_p_t = _processing(
        temperature, top_k, top_p, target_is_logits, batch, device
    )
    seed_t = _per_sequence(seed, "seed", batch, torch.int64, device, -(2**63), 2**63 - 1)
    offset_t = _per_sequence(offset, "offset", batch, torch.int64, device, -(2**63), 2**63 - 1)

    code = _METHODS[method]
    eps_v, alpha_v, k_v = method_options(method, eps, alpha, topk_accept)
    if max_depth is None:
        if parents_t is None:
            max_depth = n - 1
        else:
            max_depth = int(tree_info(parents_t).depth.max()) if batch else 0
    if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)):
        raise TypeError(f"max_depth: expected an int, got {max_depth!r}")
    if not 0 <= max_depth < MAX_TREE_NODES:
        raise ValueError(f"max_depth: expected 0 <= max_depth < {MAX_TREE_NODES}, got {max_depth}")

    out = _dispatch(
        target_t,
        tokens_t,
        parents_t,
        num_nodes_t,
        draft_t,
        deterministic_t,
        allow_t,
        temp_t,
        top_k_t,
        top_p_t,
        seed_t,
        offset_t,
        bool(target_is_logits),
        code,
        eps_v,
        alpha_v,
        k_v,
        correction == "target",
        int(max_depth),
        bool(check),
    )
    return VerifyResult(*out)


def sample(
    logits: Any,
    temperature: Any = 1.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    *,
    seed: Any,
    offset: Any,
    target_is_logits: bool = True,
) -> SampleResult:
    """Samples one token per row with the processing and RNG of :func:`verify`.

    The non-speculative path: equal to :func:`verify` of a tree with only the root (the token is
    the bonus token of node 0), so a speculative and a plain step sample identically.

    Parameters
    ----------
    logits : torch.Tensor or array-like
        float32, float16 or bfloat16 ``[B, V]``, contiguous (probabilities when
        ``target_is_logits=False``).
    temperature, top_k, top_p : scalar or array-like [B]
        As in :func:`verify` (temperature 0 = argmax).
    seed, offset : int or array-like [B]
        Philox key and offset per sequence.
    target_is_logits : bool
        Whether ``logits`` holds logits (default) or probabilities.

    Returns
    -------
    SampleResult
        ``tokens`` int32 ``[B]`` (-1 for bad rows) and ``status`` int32 ``[B]``.

    Raises
    ------
    TypeError, ValueError
        As :func:`verify`, naming the argument.
    """
    x = _tensor(logits, "logits", "float", _FLOAT_DTYPES)
    _check_float_rows(x, "logits", 2)
    batch = int(x.shape[0])
    tokens = torch.zeros((batch, 1), dtype=torch.int32, device=x.device)
    try:
        res = verify(
            x.unsqueeze(1),
            tokens,
            target_is_logits=target_is_logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            offset=offset,
            max_depth=0,
        )
    except ValueError as exc:
        raise ValueError(str(exc).replace("target:", "logits:", 1)) from None
    return SampleResult(res.emitted[:, 0], res.status)


class SamplingProbs(NamedTuple):
    """Result of :func:`sampling_probs`; tensors on the device of ``logits``.

    Attributes
    ----------
    probs : torch.Tensor
        float32 ``[B, V]``: each row's sampling distribution (all zero where ``status`` is set).
    status : torch.Tensor
        int32 ``[B]``: 0, or :data:`STATUS_NON_FINITE` / :data:`STATUS_ZERO_MASS` for a bad row.
    """

    probs: torch.Tensor
    status: torch.Tensor


def sampling_probs(
    logits: Any,
    temperature: Any = 1.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    *,
    target_is_logits: bool = True,
) -> SamplingProbs:
    """The distribution :func:`sample` and :func:`verify` draw a row's token from, written out.

    The processing of :func:`verify`'s target rows, by the same native code on the CPU and on
    CUDA: logits divided by ``temperature``, top-k keeps the tokens whose value is at least the
    k-th largest (ties kept), top-p the most likely tokens whose mass reaches ``top_p`` (ties at
    the threshold kept), renormalised; temperature 0 gives the one-hot of the argmax (the lowest
    index among ties). No sort: the thresholds are searched as in the kernels.

    A drafter that samples its draft token from these rows and passes them to :func:`verify` as
    ``draft_probs`` drafts from exactly the processing the target gets (speculative sampling is
    lossless for any draft distribution; it accepts the most when the two agree).

    Parameters
    ----------
    logits : torch.Tensor or array-like
        float32, float16 or bfloat16 ``[B, V]``, contiguous, V <= :data:`MAX_VOCAB`
        (probabilities when ``target_is_logits=False``: non-negative, a positive total that
        is finite in float32; a row whose sum overflows sets :data:`STATUS_NON_FINITE`).
    temperature, top_k, top_p : scalar or array-like [B]
        As in :func:`verify` (temperature 0 = one-hot argmax; with probability inputs 0 or 1).
    target_is_logits : bool
        Whether ``logits`` holds logits (default) or probabilities.

    Returns
    -------
    SamplingProbs
        ``probs`` float32 ``[B, V]`` (each valid row sums to 1 up to rounding) and ``status``
        int32 ``[B]``.

    Raises
    ------
    TypeError, ValueError
        As :func:`verify`, naming the argument.
    """
    x = _tensor(logits, "logits", "float", _FLOAT_DTYPES)
    _check_float_rows(x, "logits", 2)
    batch, vocab = int(x.shape[0]), int(x.shape[1])
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(
            f"logits: the vocabulary size must be in [1, {MAX_VOCAB}], got V = {vocab}"
        )
    temp_t, top_k_t, top_p_t = _processing(
        temperature, top_k, top_p, target_is_logits, batch, x.device
    )
    args = (x, temp_t, top_k_t, top_p_t, bool(target_is_logits))
    if torch.compiler.is_compiling():
        probs, status = torch.ops.specdecode.sampling_probs(*args)
    else:
        probs, status = _run_sampling_probs(*args)
    return SamplingProbs(probs, status)
