"""The ops' shared plumbing (specdecode._ops.common): the stream every launcher is handed."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from specdecode._ops import common

from specdecode import ops


def test_stream_of_cpu_is_zero():
    assert common.stream_of(torch.device("cpu")) == 0


def test_stream_of_asks_the_raw_getter_for_the_device_index(monkeypatch):
    """The raw getter is asked for the device's own index, not the current device's (an op on
    cuda:3 from a caller whose current device is 0 runs on cuda:3's stream)."""
    asked = []

    def raw(index: int) -> int:
        asked.append(index)
        return 7000 + index

    monkeypatch.setattr(common, "_current_raw_stream", raw)
    assert common.stream_of(torch.device("cuda", 3)) == 7003
    assert common.stream_of(torch.device("cuda", 0)) == 7000
    assert common.stream_of(torch.device("cpu")) == 0
    assert asked == [3, 0]


@requires_cuda
@pytest.mark.parametrize("raw", [True, False], ids=["raw-getter", "stream-object"])
def test_stream_of_is_the_callers_current_stream(monkeypatch, raw):
    """Inside ``torch.cuda.stream(s)`` the ops are handed s, outside it the default stream, with
    torch's raw getter and with the Stream-object fallback of builds without it."""
    if not raw:
        monkeypatch.setattr(common, "_current_raw_stream", None)
    elif common._current_raw_stream is None:
        pytest.skip("this torch build has no torch._C._cuda_getCurrentRawStream")
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    assert common.stream_of(x.device) == torch.cuda.current_stream().cuda_stream
    with torch.cuda.stream(side):
        assert common.stream_of(x.device) == side.cuda_stream
        assert common.stream_of(torch.device("cuda")) == side.cuda_stream
    assert common.stream_of(x.device) == torch.cuda.current_stream().cuda_stream


@requires_cuda
def test_op_on_a_side_stream_is_ordered_on_that_stream():
    """tree_attention queued on a side stream, its inputs written there and its output read after
    that stream alone is synchronised, equals the same call on the default stream."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 64, generator=g)
    k = torch.randn(2, 512, 2, 64, generator=g)
    v = torch.randn(2, 512, 2, 64, generator=g)
    lens = torch.tensor([300, 508], dtype=torch.int32)
    want = ops.tree_attention(q.cuda(), k.cuda(), v.cuda(), lens.cuda()).cpu()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        qd, kd, vd, ld = (t.to("cuda", non_blocking=True) for t in (q, k, v, lens))
        kd.mul_(1.0)  # a kernel on the side stream that the op must come after
        out = ops.tree_attention(qd, kd, vd, ld)
    side.synchronize()
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)
