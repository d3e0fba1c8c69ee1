"""The DLPack boundary: what the native module sees of torch, numpy and raw capsules."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import cuda_available, cuda_skip_reason, requires_cuda
from dlpack_capsule import capsule_claiming_device

from specdecode import _C, ops

TORCH_DTYPES = {
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint32: "uint32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


@pytest.mark.parametrize("dtype, name", TORCH_DTYPES.items())
def test_torch_dtypes_shapes_and_zero_copy(dtype, name):
    t = torch.zeros((3, 5), dtype=dtype)
    d = _C.describe_array(t)
    assert d["dtype"] == name
    assert d["device"] == "cpu"
    assert d["shape"] == [3, 5] and d["strides"] == [5, 1]
    assert d["contiguous"]
    assert d["data"] == t.data_ptr()


@pytest.mark.parametrize(
    "dtype, name",
    [
        (np.int32, "int32"),
        (np.int64, "int64"),
        (np.uint32, "uint32"),
        (np.float16, "float16"),
        (np.float32, "float32"),
        (np.float64, "float64"),
    ],
)
def test_numpy_dtypes_and_zero_copy(dtype, name):
    a = np.zeros((4, 2), dtype=dtype)
    d = _C.describe_array(a)
    assert d["dtype"] == name and d["shape"] == [4, 2] and d["strides"] == [2, 1]
    assert d["data"] == a.ctypes.data


def test_strides_and_offsets_are_seen():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    view = base[1:, ::2, 1:4]
    d = _C.describe_array(view)
    assert d["shape"] == [2, 2, 3]
    assert d["strides"] == [20, 10, 1]
    assert not d["contiguous"]
    assert d["data"] == view.data_ptr()
    t = base.transpose(0, 2)
    assert _C.describe_array(t)["strides"] == [1, 5, 20]
    n = np.arange(24, dtype=np.int32).reshape(4, 6)[:, 1::2]
    assert _C.describe_array(n)["strides"] == [6, 2]


def test_size_one_dims_do_not_break_contiguity():
    t = torch.zeros((1, 7), dtype=torch.int32)
    assert _C.describe_array(t.t())["contiguous"]


def test_empty_arrays_are_contiguous_whatever_their_strides():
    assert _C.describe_array(np.zeros((0, 5), dtype=np.int32))["contiguous"]
    assert _C.describe_array(torch.zeros((3, 0), dtype=torch.int32))["contiguous"]
    assert _C.describe_array(torch.zeros((0, 4)).t())["contiguous"]


def test_read_only_numpy_rejected_as_output_only():
    a = np.zeros(4, dtype=np.int32)
    a.flags.writeable = False
    assert _C.describe_array(a)["dtype"] == "int32"  # fine as an input
    with pytest.raises((ValueError, BufferError), match="read-only|readonly"):
        _C.describe_array(a, writable=True)


def test_requires_grad_tensors_are_read_and_export_errors_name_the_argument():
    t = torch.zeros(3, requires_grad=True)
    assert _C.describe_array(t)["data"] == t.data_ptr()  # read in place, autograd untouched

    class Refuses:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kwargs):
            raise BufferError("cannot export this")

    with pytest.raises(ValueError, match="array: cannot be exported through DLPack: cannot export"):
        _C.describe_array(Refuses())


def test_protocol_producers_without_max_version_are_supported():
    class Legacy:
        """A producer of the pre-1.0 protocol: __dlpack__ takes only `stream`."""

        def __init__(self):
            self.inner = torch.arange(6, dtype=torch.int32)

        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, stream=None):
            return torch.utils.dlpack.to_dlpack(self.inner)

    legacy = Legacy()
    assert _C.describe_array(legacy)["data"] == legacy.inner.data_ptr()


def test_torch_subclasses_use_the_protocol():
    class Sub(torch.Tensor):
        pass

    t = torch.arange(4, dtype=torch.int32).as_subclass(Sub)
    assert _C.describe_array(t)["shape"] == [4]
    p = torch.nn.Parameter(torch.zeros(2, 3))
    assert _C.describe_array(p)["shape"] == [2, 3]


def test_non_arrays_are_type_errors():
    for bad in ([1, 2], "x", 3, None, object()):
        with pytest.raises(TypeError, match="array: expected an array that supports DLPack"):
            _C.describe_array(bad)


def test_capsules_are_consumed_once():
    cap = torch.utils.dlpack.to_dlpack(torch.zeros(2))
    assert _C.describe_array(cap)["shape"] == [2]
    with pytest.raises(TypeError, match="already consumed"):
        _C.describe_array(cap)


def test_unsupported_device_and_dtype_are_reported():
    a = np.zeros(3, dtype=np.int32)
    with pytest.raises(TypeError, match="unsupported device type 4"):
        _C.describe_array(capsule_claiming_device(a, device_type=4))
    d = _C.describe_array(capsule_claiming_device(a, device_type=2, device_id=1))
    assert d["device"] == "cuda:1"
    d = _C.describe_array(capsule_claiming_device(a, device_type=1, dtype_code=5))  # complex
    assert d["dtype"] == "an unsupported dtype"


def test_negative_sizes_are_refused():
    """A negative size is malformed, and would match any size where a shape check uses -1."""
    import dlpack_capsule

    parents = np.array([[-1, 0, 1]], dtype=np.int32)
    cap = capsule_claiming_device(parents, device_type=1)
    dlpack_capsule._KEEP_ALIVE[-1].dl_tensor.shape[0] = -5
    depth = torch.empty((7, 3), dtype=torch.int32)
    num_nodes = torch.empty((9,), dtype=torch.int32)
    status = torch.empty((9, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"parents: negative size in shape \[-5, 3\]"):
        _C.tree_info(cap, depth, None, num_nodes, status, 0)


@pytest.mark.cuda
@pytest.mark.skipif(
    not cuda_available() or torch.cuda.device_count() < 2,
    reason=cuda_skip_reason() or "needs two CUDA devices",
)
def test_ops_on_another_gpu_leave_the_callers_current_device():
    """An op switches to its arrays' device for its launches and gives the caller's current
    device back (tests/test_cuda_emu.py checks the same on emulated devices, per op family)."""
    torch.cuda.set_device(0)
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    depth = ops.tree_info(parents.to("cuda:1")).depth
    assert depth.device == torch.device("cuda:1")
    assert torch.equal(depth.cpu(), ops.tree_info(parents).depth)
    assert torch.cuda.current_device() == 0
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 64, generator=gen) for _ in range(3))
    lens = torch.tensor([0], dtype=torch.int32)
    out = ops.tree_attention(*(x.to("cuda:1") for x in (q, k, v, lens)))
    assert torch.cuda.current_device() == 0
    assert torch.allclose(out.cpu(), ops.tree_attention(q, k, v, lens), atol=1e-5)
    assert torch.empty(1, device="cuda").device == torch.device("cuda:0")


@pytest.mark.cuda
@requires_cuda
def test_the_driver_says_which_primary_contexts_are_active(tmp_path):
    """An op gives the caller's device back only where its primary context is active (making it
    current would create one: device memory). The driver query behind that rule, in a fresh
    process: no context on device 0 before torch first uses it, one after."""
    code = (
        "import torch\n"
        "from specdecode import _C\n"
        "before = _C._primary_context_active(0)\n"
        "torch.zeros(1, device='cuda:0')\n"
        "print(before, _C._primary_context_active(0))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True"]
