"""Plumbing shared by the op families: device discovery, streams, output allocation.

Inputs may be torch tensors, numpy arrays or any object with ``__dlpack__`` (the attention ops:
torch tensors only); they reach the native module zero-copy through DLPack (other producers than
torch and numpy wrapped in a torch tensor first, see :func:`as_array`). Outputs are torch tensors
allocated here on the inputs' device, because the native module allocates nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

# DLPack device types.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def device_of(x: Any, name: str) -> torch.device:
    """The torch device an array lives on (CPU or CUDA)."""
    if isinstance(x, torch.Tensor):
        return x.device
    if isinstance(x, np.ndarray):
        return torch.device("cpu")
    if hasattr(x, "__dlpack_device__"):
        kind, index = x.__dlpack_device__()
        kind = int(kind)
        if kind in (_DL_CPU, _DL_CUDA_HOST):
            return torch.device("cpu")
        if kind in (_DL_CUDA, _DL_CUDA_MANAGED):
            return torch.device("cuda", int(index))
        raise TypeError(f"{name}: unsupported DLPack device type {kind} (expected CPU or CUDA)")
    raise TypeError(
        f"{name}: expected a torch.Tensor, numpy.ndarray or an array with __dlpack__, "
        f"got {type(x).__name__}"
    )


def holds_bool(x: list | tuple) -> bool:
    """Whether a nested list/tuple holds a Python or numpy bool anywhere."""
    stack: list[Any] = [x]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, (bool, np.bool_)):
            return True
    return False


def _numpy_dtype_problem(dtype: np.dtype) -> str | None:
    """How a numpy dtype that DLPack (and torch.from_numpy) cannot carry is described in an
    error; None for the dtypes it carries (bool, ints, float16/32/64, complex64/128)."""
    if not dtype.isnative:
        return f"{dtype.str} ({dtype.newbyteorder('=').name} in non-native byte order)"
    kind, size = dtype.kind, dtype.itemsize
    if kind in "biu" or (kind == "f" and size in (2, 4, 8)) or (kind == "c" and size in (8, 16)):
        return None
    return str(dtype)


def numpy_dtype_error(name: str, x: Any, expected: str) -> TypeError | None:
    """The TypeError for a numpy array whose dtype cannot cross DLPack (non-native byte order,
    object, str, datetime, longdouble, ...), in the words of the dtype checks: ``expected`` says
    which dtypes `name` takes. None where `x` is no such array.

    Called only after a conversion or a native call has failed, so that it costs nothing where
    the inputs are good; the export's own error, a ValueError, would not name the dtypes."""
    if not isinstance(x, np.ndarray):
        return None
    problem = _numpy_dtype_problem(x.dtype)
    if problem is None:
        return None
    return TypeError(f"{name}: expected {expected}, got a numpy array of dtype {problem}")


def raise_numpy_dtype_error(expected: str, **arrays: Any) -> None:
    """Raises :func:`numpy_dtype_error`'s TypeError for the first of `arrays` (name=array) that
    has one; returns otherwise. For the except clause of a native call that takes the arrays."""
    for name, x in arrays.items():
        error = numpy_dtype_error(name, x, expected)
        if error is not None:
            raise error from None


def as_array(x: Any, name: str, dtype: torch.dtype | None = None) -> Any:
    """Passes torch tensors and numpy arrays through; wraps other ``__dlpack__`` producers in a
    torch tensor (zero-copy) so that callers can read ``.shape``; turns nested Python
    lists/tuples into tensors of `dtype`.

    For an integer `dtype` the list must hold ints in its range: a float or bool is a
    TypeError and an int outside it a ValueError (a cast would truncate or wrap them)."""
    if isinstance(x, torch.Tensor):
        return x.detach() if x.requires_grad else x
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            if hasattr(x, "__dlpack_device__"):
                return torch.from_dlpack(x)
            # __dlpack_device__ is part of the protocol, but the native module also reads
            # producers without it (as host arrays); the capsule says where the data is.
            return torch.from_dlpack(x.__dlpack__())
        except BufferError as exc:
            raise ValueError(f"{name}: cannot be exported through DLPack: {exc}") from None
    if isinstance(x, (list, tuple)):
        integral = dtype is not None and not dtype.is_floating_point and dtype != torch.bool
        # torch.tensor([-1, True]) is int64 with True as 1: find the bools before it does.
        if integral and holds_bool(x):
            raise TypeError(f"{name}: expected integers, got a list holding a bool")
        try:
            t = torch.tensor(x) if integral else torch.tensor(x, dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(
                f"{name}: cannot make a {dtype} array from the given list: {exc}"
            ) from None
        if integral and t.numel():
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TypeError(f"{name}: expected integers, got a list of {t.dtype}")
            info = torch.iinfo(dtype)
            lo, hi = int(t.min()), int(t.max())
            if lo < info.min or hi > info.max:
                raise ValueError(
                    f"{name}: {lo if lo < info.min else hi} is outside the range of {dtype}"
                )
        return t.to(dtype) if integral else t
    return x


# torch's getter of a device's current stream as an integer (the handle the launchers take),
# present in CUDA builds only; what triton and inductor call. torch.cuda.current_stream builds a
# Stream object on every call instead, host work on every op.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(device: torch.device) -> int:
    """The caller's current CUDA stream on `device` as an integer (0 for the CPU)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _current_raw_stream is not None:
        return int(_current_raw_stream(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, read once per device (the launchers size
    their grids by it on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessors(index)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
