"""Tree-masked attention over a KV cache, and compaction of the cache to the accepted path.

The target scores a whole draft tree (or chain) in one forward pass: the model appends the K/V of
the ``T`` tree nodes to its cache at positions ``[prefix_len, prefix_len + T)`` and calls
:func:`tree_attention`; node ``i`` attends to the whole prefix and to the tree nodes visible in
row ``i`` of the ancestor mask from :func:`specdecode.ops.tree_info`. After verification,
:func:`compact_kv` moves the K/V of the accepted nodes to ``[prefix_len, prefix_len + n)``.

Both ops are also registered with ``torch.library`` as ``torch.ops.specdecode.tree_attention``
and ``torch.ops.specdecode.compact_kv`` (with fake implementations), so they trace under
``torch.compile``; in eager mode the public functions call the native module directly.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Union

import numpy as np
import torch

from .. import _C
from .common import empty, multiprocessors, stream_of

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 80, 96, 128, 256)

_COMPACT_ERRORS = {
    1: "num_accepted[{b}] = {count} is outside [0, L = {width}]",
    2: "path[{b}, {i}] = {node} is negative, but the first num_accepted entries must be nodes",
    3: "path[{b}, {i}] = {node} does not follow path[{b}, {prev}] = {prev_node}; an accepted "
    "path is strictly increasing (parents come before children)",
    4: "row {b}: prefix_lens = {prefix} with path node {node} is outside the cache of length "
    "{length}",
}


def _check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x.detach() if x.requires_grad else x


# The kernels scale scores by scale * log2(e) in float32 (exp2 in the softmax).
_MAX_SCALE = float(torch.finfo(torch.float32).max) / math.log2(math.e)


def _default_scale(scale: Optional[float], head_dim: int) -> float:
    if scale is None:
        # D < 1 is the kernel checks' to report (with the supported head dims).
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    if not math.isfinite(scale) or abs(scale) > _MAX_SCALE:
        raise ValueError(
            f"scale: expected a finite float of magnitude <= {_MAX_SCALE:.3g} (float32 after "
            f"the kernels' factor log2(e)), got {scale}"
        )
    return float(scale)


def split_count(
    batch: int,
    kv_heads: int,
    rows: int,
    block_rows: int,
    cache_len: int,
    float32: bool,
    sms: int,
) -> int:
    """KV splits of the CUDA kernel for one launch.

    Parameters
    ----------
    batch, kv_heads : int
        B and Hkv of the launch.
    rows : int
        T x (Hq / Hkv): the query rows that share one KV head.
    block_rows : int
        The query rows one thread block takes (the native module's
        ``tree_attention_block_rows``): 32 for the CUDA-core kernel (fp32); 16, 32, 64 or 128
        for the tensor-core one (fp16 / bf16; 128 from 65 rows at head dims up to 128, where
        the device's shared memory allows and the 64-row blocks would fill the SMs four times
        over).
    cache_len : int
        S, the cache's length (the prefix is at most ``S - T`` of it).
    float32 : bool
        The CUDA-core kernel (32-key tiles) rather than the tensor-core one (64-key tiles, 32 at
        D 256).
    sms : int
        The device's streaming multiprocessors.

    Returns
    -------
    int
        Splits in [1, 64]: about one thread block per SM where a KV head has at most 32 rows
        (one block, whose warps share the keys of each tile), about two where it has more, and
        at most ``ceil(S / 64)`` (fp32: two of its kernel's 32-key tiles per split) or
        ``ceil(S / 256)`` (fp16 / bf16).
    """
    blocks = batch * kv_heads * max(1, -(-rows // max(block_rows, 1)))
    # H100 (bench/RESULTS.md, sessions 22 and 30): with at most 32 rows, two blocks per SM were
    # 2-5 % slower at B 8 and 12-17 % at B 1 S 16384 than one. With more (each of a block's
    # warps then runs every key of its tile), one per SM was 19-44 % slower at T 64 and 29 %
    # at bf16 B 8 S 4096 T 16 (one block of 64 rows).
    per_sm = 1 if rows <= 32 else 2
    # The ratio rounded: rounding up took two splits where the batch alone nearly fills the GPU,
    # 10-50 % slower than one (H200 sweep, bench/RESULTS.md).
    want = max(1, round(per_sm * sms / max(blocks, 1)))
    min_keys = 64 if float32 else 256
    return int(max(1, min(want, -(-cache_len // min_keys), 64)))


@functools.lru_cache(maxsize=4096)
def _block_rows(
    device_index: int, batch: int, kv_heads: int, rows: int, head_dim: int, float32: bool
) -> int:
    """The native launcher's rows per thread block (a device query: cached per launch shape)."""
    return int(_C.tree_attention_block_rows(batch, kv_heads, rows, head_dim, float32, device_index))


def _num_splits(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """KV splits of the CUDA kernel for these tensors (1 on the CPU, and in a build without the
    CUDA kernels, whose native call then reports that): see split_count."""
    if q.device.type != "cuda" or not hasattr(_C, "tree_attention_block_rows"):
        return 1
    batch, t, hq, d = q.shape
    kv_heads = max(k_cache.shape[2], 1)
    rows = t * (hq // kv_heads)
    float32 = q.dtype == torch.float32
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return split_count(
        batch,
        kv_heads,
        rows,
        _block_rows(index, max(batch, 1), kv_heads, max(rows, 1), max(d, 1), float32),
        k_cache.shape[1],
        float32,
        multiprocessors(q.device),
    )


def _tree_attention_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    scale: float,
    with_lse: bool,
    check_prefix: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if q.dim() != 4:
        raise ValueError(f"q: expected shape [B, T, Hq, D], got {list(q.shape)}")
    batch, t, hq, d = q.shape
    device = q.device
    out = empty((batch, t, hq, d), q.dtype, device)
    lse = empty((batch, t, hq), torch.float32, device) if with_lse else None
    status = empty((batch,), torch.int32, device)
    part_o = part_lse = None
    if device.type == "cuda" and k_cache.dim() == 4:
        splits = _num_splits(q, k_cache)
        part_o = empty((splits, batch, t, hq, d), torch.float32, device)
        part_lse = empty((splits, batch, t, hq), torch.float32, device)
    _C.tree_attention(
        q,
        k_cache,
        v_cache,
        prefix_lens,
        tree_mask,
        out,
        lse,
        status,
        scale,
        part_o,
        part_lse,
        stream_of(device),
    )
    if check_prefix:
        _raise_bad_prefix(status, prefix_lens, t, k_cache.shape[1])
    return out, lse


def _raise_bad_prefix(status: torch.Tensor, prefix_lens: torch.Tensor, t: int, s: int) -> None:
    """The kernel's per-row status as an error. On CUDA the status comes over in one copy, which
    waits for the kernel (``torch.nonzero`` there took a count, a second kernel and the same wait
    on top)."""
    flags = status.cpu().numpy()
    if not np.count_nonzero(flags):
        return
    bad = np.flatnonzero(flags)
    b = int(bad[0])
    raise ValueError(
        f"prefix_lens: row {b} has prefix_len {int(prefix_lens[b])}, but 0 <= prefix_len and "
        f"prefix_len + T ({t}) <= S ({s}) are required"
        + (f" ({bad.size - 1} more invalid rows)" if bad.size > 1 else "")
    )


def tree_attention_in_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """:func:`tree_attention` (``[B, T, Hq, D]`` out) for a caller whose ``prefix_lens`` are
    valid by construction, such as a model's KV cache, which checks ``prefix_len + T <= S`` on
    its host copy of the lengths before it appends the tree's K/V.

    The kernel and its argument checks are the same; only the read of the kernel's per-row
    status is left out. That read waits for the device on CUDA: once per layer and step in a
    model, it would keep the host from queueing the next layer's work while the GPU runs. A row
    that breaks the invariant gets an unspecified output instead of an error. Under
    ``torch.compile`` the checked op is traced instead.
    """
    scale = _default_scale(scale, q.shape[-1])
    if torch.compiler.is_compiling():
        return torch.ops.specdecode.tree_attention(
            q, k_cache, v_cache, prefix_lens, tree_mask, scale
        )[0]
    return _tree_attention_impl(
        q, k_cache, v_cache, prefix_lens, tree_mask, scale, False, check_prefix=False
    )[0]


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention of the ``T`` nodes of a draft tree over a KV cache that already holds them.

    Query node ``i`` of sequence ``b`` attends to every prefix position
    ``< prefix_lens[b]`` of the cache (dense, unmasked) and to the tree nodes ``j`` stored at
    ``prefix_lens[b] + j`` whose bit is set in row ``i`` of ``tree_mask`` (its ancestors and
    itself, as :func:`specdecode.ops.tree_info` returns). The two parts are computed separately
    and merged with the log-sum-exp rule. On the CPU each prefix key is read once per KV head for
    all ``T x Hq / Hkv`` query rows of that head; on CUDA once per KV head and block of up to 64
    such rows, with the prefix split across thread blocks (flash-decoding) and the splits merged.
    On sm_80 and newer, fp16 / bf16 caches whose rows start on 16-byte boundaries run both
    products on the tensor cores (``P`` rounded to the input type before ``P V``, float
    accumulation; one running online-softmax state spans prefix and tree, the same merge applied
    key by key); fp32, other layouts and older GPUs run on the CUDA cores in float.
    Grouped-query attention maps query head ``h`` to KV head ``h // (Hq / Hkv)``. Positional
    encodings (RoPE at ``prefix_len + depth``) are the caller's job. The op has no backward:
    given inputs that require grad (with grad enabled) its outputs require grad too, and a
    backward pass through them raises.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, T, Hq, D]``, float32, float16 or bfloat16, last dim contiguous.
        ``1 <= T <= 1024``; ``D`` in 32, 64, 80, 96, 128, 256.
    k_cache, v_cache : torch.Tensor
        ``[B, S, Hkv, D]``, same dtype and device as ``q``, ``Hq`` a multiple of ``Hkv``,
        ``S >= T``. May be strided views into larger buffers (the last dim must be contiguous,
        both must have the same strides).
    prefix_lens : torch.Tensor
        int32 ``[B]``, ``0 <= prefix_lens[b]`` and ``prefix_lens[b] + T <= S``.
    tree_mask : torch.Tensor, optional
        uint32 ``[B, T, ceil(T / 32)]``, contiguous: bit ``j % 32`` of word ``j // 32`` in row
        ``i`` makes node ``j`` visible from node ``i``. Bits at ``j >= T`` are ignored. ``None``
        means a causal chain (node ``i`` sees nodes ``0..i``); ``T = 1`` is plain decoding.
        The K/V rows of all ``T`` nodes are read: as with a dense masked softmax, an inf or NaN
        in the V row of a node may reach rows whose mask hides it (``0 * inf``), so a padding
        node's K/V must be finite (a model's forward pass writes them like any node's).
        A visible key whose score is +inf or NaN (an inf or NaN in ``q`` or ``k``) makes the
        row's output and lse NaN, as a dense softmax makes the output, whichever KV split holds
        the key.
    scale : float, optional
        Multiplies the scores ``q . k``; default ``1 / sqrt(D)``. Finite, ``|scale| <=
        2.36e38`` (float32 once multiplied by ``log2(e)``).
    return_lse : bool
        Also return the log-sum-exp of the scaled scores of each query row.

    Returns
    -------
    out : torch.Tensor
        ``[B, T, Hq, D]`` of the dtype of ``q`` (accumulated in float32). bfloat16 inputs on
        a CPU with AVX512_BF16 multiply bf16 operands: the scores exactly, and, with 5 or more
        query rows per KV head (``T * Hq / Hkv``), ``P V`` (prefix and tree) with the softmax
        weights rounded to bfloat16 (relative error 2^-9 per weight, the size of the output's
        own rounding), as the CUDA kernel's tensor-core products, FlashAttention and torch's
        bf16 SDPA do: about a third of the outputs are then one bf16 ulp off the exactly
        rounded result, with errors no larger than SDPA's. The CPU kernels flush denormal
        intermediate results (softmax weights below 2^-126 of a row's largest) to zero, and
        restore the calling thread's floating-point mode after.
    lse : torch.Tensor
        float32 ``[B, T, Hq]``, natural log; only with ``return_lse``. A row that sees no key at
        all (empty prefix and an all-zero mask row, e.g. a padding node) gets ``out = 0`` and
        ``lse = -inf``.

    Raises
    ------
    TypeError
        A dtype is wrong or ``q``, ``k_cache``, ``v_cache`` disagree in dtype.
    ValueError
        ``scale`` is out of range, shapes disagree, ``Hq`` is not a multiple of ``Hkv``, ``T``
        or ``D`` unsupported, the mask has the wrong width, arrays are on different devices, or
        a ``prefix_lens`` entry is negative or leaves no room for the ``T`` tree nodes (checked
        on the device; on CUDA this check synchronises).
    """
    # With grad on for an input that wants it, the op goes through torch's dispatcher as under
    # torch.compile: the output then requires grad and a backward pass raises (no formula)
    # instead of the output silently leaving the graph.
    tracked = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k_cache, v_cache)
    )
    inputs = (q, k_cache, v_cache)
    q = _check_tensor(q, "q")
    k_cache = _check_tensor(k_cache, "k_cache")
    v_cache = _check_tensor(v_cache, "v_cache")
    prefix_lens = _check_tensor(prefix_lens, "prefix_lens")
    if tree_mask is not None:
        tree_mask = _check_tensor(tree_mask, "tree_mask")
    if q.dim() != 4:
        raise ValueError(f"q: expected shape [B, T, Hq, D], got {list(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q: expected float32, float16 or bfloat16, got {q.dtype}")
    scale = _default_scale(scale, q.shape[-1])
    if tracked:
        out, lse = torch.ops.specdecode.tree_attention(*inputs, prefix_lens, tree_mask, scale)
    elif torch.compiler.is_compiling():
        out, lse = torch.ops.specdecode.tree_attention(
            q, k_cache, v_cache, prefix_lens, tree_mask, scale
        )
    else:
        out, lse = _tree_attention_impl(
            q, k_cache, v_cache, prefix_lens, tree_mask, scale, return_lse
        )
    return (out, lse) if return_lse else out


def _raise_compact_errors(
    status: torch.Tensor,
    path: torch.Tensor,
    num_accepted: torch.Tensor,
    prefix_lens: torch.Tensor,
    cache_len: int,
) -> None:
    host = status.cpu().numpy()  # one copy from a device; it waits for the kernels
    bad = np.flatnonzero(host[:, 0])
    if bad.size == 0:
        return
    b = int(bad[0])
    code, i = (int(x) for x in host[b])
    row = path[b].tolist()
    if code == 4 and int(prefix_lens[b]) < 0:
        raise ValueError(
            f"compact_kv: prefix_lens[{b}] = {int(prefix_lens[b])} is negative; the cache was "
            "not modified"
        )
    msg = _COMPACT_ERRORS[code].format(
        b=b,
        i=i,
        prev=i - 1,
        node=row[i] if row else None,
        prev_node=row[i - 1] if i > 0 else None,
        count=int(num_accepted[b]),
        width=len(row),
        prefix=int(prefix_lens[b]),
        length=cache_len,
    )
    raise ValueError("compact_kv: " + msg + "; the cache was not modified")


def _compact_kv_impl(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    path: torch.Tensor,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected shape [B, S, Hkv, D], got {list(k_cache.shape)}")
    device = k_cache.device
    batch = k_cache.shape[0]
    new_lens = empty((batch,), torch.int32, device)
    status = empty((batch, 2), torch.int32, device)
    _C.compact_kv(
        k_cache, v_cache, prefix_lens, path, num_accepted, new_lens, status, stream_of(device)
    )
    # Written behind autograd's back: a tensor saved for a backward pass now fails its version
    # check there, as after any in-place torch op.
    torch.autograd.graph.increment_version(k_cache)
    if v_cache.data_ptr() != k_cache.data_ptr():
        torch.autograd.graph.increment_version(v_cache)
    _raise_compact_errors(status, path, num_accepted, prefix_lens, k_cache.shape[1])
    return new_lens


def compact_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    path: torch.Tensor,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    """Keeps the accepted path of a tree in the KV cache, in place.

    For each sequence ``b`` and ``i < num_accepted[b]``, the K and V rows of tree node
    ``path[b, i]`` (at cache position ``prefix_lens[b] + path[b, i]``) move to position
    ``prefix_lens[b] + i``. Accepted paths are strictly increasing (parents come before
    children), so every destination is at or before its source and after every source still to
    be read: moving in increasing ``i`` handles overlapping ranges correctly.

    Parameters
    ----------
    k_cache, v_cache : torch.Tensor
        ``[B, S, Hkv, D]``, float32, float16 or bfloat16, writable, same strides, last dim
        contiguous (strided views into larger buffers are fine). Modified in place.
    prefix_lens : torch.Tensor
        int32 ``[B]``: where each sequence's tree starts in the cache.
    path : torch.Tensor
        int32 ``[B, L]``: accepted node indices (e.g. from verification), root first; entries
        at and after ``num_accepted[b]`` are ignored (typically -1 padding).
    num_accepted : torch.Tensor
        int32 ``[B]``, ``0 <= num_accepted[b] <= L``: how many path entries to keep.

    Returns
    -------
    torch.Tensor
        int32 ``[B]``: the new cache lengths ``prefix_lens + num_accepted``.

    Raises
    ------
    TypeError
        Wrong dtypes, or the caches differ in dtype.
    ValueError
        Shapes or devices disagree, or a row's path is not strictly increasing, has a negative
        node, or points outside the cache; then nothing is moved (on CUDA this check
        synchronises).
    RuntimeError
        A cache requires grad while grad mode is on: the move has no backward. (Like any
        in-place op, the move bumps the caches' version counters, so a backward pass that saved
        them fails autograd's check instead of using moved values.)
    """
    for cache in (k_cache, v_cache):
        if isinstance(cache, torch.Tensor) and cache.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "compact_kv: moves K/V rows in place and has no backward; give it caches that "
                "do not require grad (under torch.no_grad(), or .detach()ed)"
            )
    k_cache = _check_tensor(k_cache, "k_cache")
    v_cache = _check_tensor(v_cache, "v_cache")
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        # Rows that share memory would be written by several moves at once.
        if any(st == 0 and n > 1 for st, n in zip(cache.stride(), cache.shape)):
            raise ValueError(
                f"{name}: a broadcast view (a stride of 0 in shape {list(cache.shape)}) cannot "
                "be moved in place; pass a cache with memory of its own"
            )
    prefix_lens = _check_tensor(prefix_lens, "prefix_lens")
    path = _check_tensor(path, "path")
    num_accepted = _check_tensor(num_accepted, "num_accepted")
    if torch.compiler.is_compiling():
        return torch.ops.specdecode.compact_kv(k_cache, v_cache, prefix_lens, path, num_accepted)
    return _compact_kv_impl(k_cache, v_cache, prefix_lens, path, num_accepted)


# ---- torch.library registration -----------------------------------------------------------


@torch.library.custom_op("specdecode::tree_attention", mutates_args=())
def _tree_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _tree_attention_impl(q, k_cache, v_cache, prefix_lens, tree_mask, scale, True)
    assert lse is not None
    return out, lse


@_tree_attention_op.register_fake
def _(q, k_cache, v_cache, prefix_lens, tree_mask, scale):
    batch, t, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, t, hq), dtype=torch.float32)


@torch.library.custom_op("specdecode::compact_kv", mutates_args=("k_cache", "v_cache"))
def _compact_kv_op(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    path: torch.Tensor,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    return _compact_kv_impl(k_cache, v_cache, prefix_lens, path, num_accepted)


@_compact_kv_op.register_fake
def _(k_cache, v_cache, prefix_lens, path, num_accepted):
    return prefix_lens.new_empty(prefix_lens.shape)
