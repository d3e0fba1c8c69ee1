"""Tree utilities against the pure-PyTorch reference, and every invalid input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_tree import (
    pack_mask,
    random_parents,
    tree_info_reference,
    tree_paths_reference,
    unpack_mask,
)

import specdecode
from specdecode import ops


@st.composite
def tree_batches(draw, max_batch: int = 5, max_n: int = 70):
    """Batches of valid trees of one width, with ragged padding, across mask-word boundaries."""
    batch = draw(st.integers(1, max_batch))
    n = draw(st.integers(1, max_n))
    shape = draw(st.sampled_from(["random", "chain", "star", "deep"]))
    rows = []
    for _ in range(batch):
        count = draw(st.integers(1, n))
        row = [-1]
        for i in range(1, count):
            if shape == "chain":
                row.append(i - 1)
            elif shape == "star":
                row.append(0)
            elif shape == "deep":
                row.append(max(0, i - draw(st.integers(1, 2))))
            else:
                row.append(draw(st.integers(0, i - 1)))
        rows.append(row + [-1] * (n - count))
    return torch.tensor(rows, dtype=torch.int32)


@settings(max_examples=150, deadline=None)
@given(tree_batches())
def test_tree_info_matches_reference(parents):
    depth_ref, dense_ref, num_ref = tree_info_reference(parents)
    info = ops.tree_info(parents)
    assert info.depth.dtype == torch.int32 and info.num_nodes.dtype == torch.int32
    assert info.mask.dtype == torch.uint32
    assert info.mask.shape == (*parents.shape, (parents.shape[1] + 31) // 32)
    torch.testing.assert_close(info.depth, depth_ref, rtol=0, atol=0)
    torch.testing.assert_close(info.num_nodes, num_ref, rtol=0, atol=0)
    assert torch.equal(unpack_mask(info.mask, parents.shape[1]), dense_ref)
    assert torch.equal(info.mask.to(torch.int64), pack_mask(dense_ref).to(torch.int64))


@settings(max_examples=150, deadline=None)
@given(tree_batches())
def test_tree_paths_matches_reference(parents):
    expected = tree_paths_reference(parents)
    got = ops.tree_paths(parents)
    assert got.dtype == torch.int32
    assert torch.equal(got, expected)


def test_tree_paths_static_sizes_pad_and_reject_too_small():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]], dtype=torch.int32)
    got = ops.tree_paths(parents, max_paths=4, path_len=4)
    assert got.shape == (2, 4, 4)
    expected = torch.full((2, 4, 4), -1, dtype=torch.int32)
    expected[0, 0, :2] = torch.tensor([0, 2])  # leaves in ascending node order: 2, then 3
    expected[0, 1, :3] = torch.tensor([0, 1, 3])
    expected[1, 0, :2] = torch.tensor([0, 1])
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="too small for batch row 0"):
        ops.tree_paths(parents, max_paths=1, path_len=4)
    with pytest.raises(ValueError, match="too small for batch row 0"):
        ops.tree_paths(parents, max_paths=2, path_len=2)
    with pytest.raises(ValueError, match="max_paths"):
        ops.tree_paths(parents, max_paths=0, path_len=2)
    # Too large is refused by name before the [B, max_paths, path_len] output is allocated.
    with pytest.raises(ValueError, match="max_paths: expected at most 1024, got 1025"):
        ops.tree_paths(parents, max_paths=1025, path_len=4)
    with pytest.raises(ValueError, match="path_len: expected at most 1024, got 1025"):
        ops.tree_paths(parents, max_paths=2, path_len=1025)


def test_known_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, -1]], dtype=torch.int32)
    info = ops.tree_info(parents)
    assert info.depth.tolist() == [[0, 1, 1, 2, 2, 2, -1]]
    assert info.num_nodes.tolist() == [6]
    assert info.mask[0, :, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101, 0]
    paths = ops.tree_paths(parents)
    assert paths.tolist() == [[[0, 1, 3], [0, 1, 4], [0, 2, 5]]]


def test_single_node_and_max_size_trees():
    info = ops.tree_info(torch.tensor([[-1]], dtype=torch.int32))
    assert info.depth.tolist() == [[0]] and info.mask.tolist() == [[[1]]]
    assert ops.tree_paths(torch.tensor([[-1]], dtype=torch.int32)).tolist() == [[[0]]]

    chain = ops.chain_parents(2, 1023)
    info = ops.tree_info(chain)
    assert info.mask.shape == (2, 1024, 32)
    assert info.depth[0, -1].item() == 1023
    last_row = unpack_mask(info.mask[:, -1:], 1024)
    assert bool(last_row.all())
    paths = ops.tree_paths(chain)
    assert paths.shape == (2, 1, 1024)
    assert torch.equal(paths[0, 0], torch.arange(1024, dtype=torch.int32))


def test_random_large_batch_matches_reference():
    g = torch.Generator().manual_seed(0)
    parents = random_parents(g, batch=64, n=100, pad_max=40)
    depth_ref, dense_ref, num_ref = tree_info_reference(parents)
    info = ops.tree_info(parents)
    assert torch.equal(info.depth, depth_ref)
    assert torch.equal(info.num_nodes, num_ref)
    assert torch.equal(unpack_mask(info.mask, 100), dense_ref)
    assert torch.equal(ops.tree_paths(parents), tree_paths_reference(parents))


def test_results_do_not_depend_on_thread_count():
    g = torch.Generator().manual_seed(1)
    parents = random_parents(g, batch=300, n=40, pad_max=30)
    before = specdecode.get_num_threads()
    try:
        specdecode.set_num_threads(1)
        one = ops.tree_info(parents)
        paths_one = ops.tree_paths(parents)
        specdecode.set_num_threads(4)
        assert specdecode.get_num_threads() == 4
        four = ops.tree_info(parents)
        paths_four = ops.tree_paths(parents)
    finally:
        specdecode.set_num_threads(0)
    assert specdecode.get_num_threads() == before
    for a, b in zip(one, four):
        assert torch.equal(a, b)
    assert torch.equal(paths_one, paths_four)


def test_chain_parents():
    got = ops.chain_parents(3, 4)
    assert got.dtype == torch.int32 and got.shape == (3, 5)
    assert got.tolist() == [[-1, 0, 1, 2, 3]] * 3
    assert ops.chain_parents(2, 0).tolist() == [[-1], [-1]]
    assert ops.chain_parents(0, 3).shape == (0, 4)
    with pytest.raises(ValueError, match="k"):
        ops.chain_parents(1, 1024)
    with pytest.raises(ValueError, match="batch"):
        ops.chain_parents(-1, 2)
    with pytest.raises(ValueError, match="batch: .* exceed an int64"):
        ops.chain_parents(2**62, 3)
    with pytest.raises(ValueError, match="k"):
        ops.chain_parents(1, 2.5)
    assert ops.chain_parents(np.int64(2), np.int32(3)).tolist() == [[-1, 0, 1, 2]] * 2


def test_tree_paths_of_an_empty_batch_and_numpy_sizes():
    """B = 0 works as in tree_info and verify; sizes may be numpy ints."""
    empty = ops.tree_paths(torch.zeros((0, 5), dtype=torch.int32))
    assert empty.shape[0] == 0 and empty.dtype == torch.int32
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    want = ops.tree_paths(parents)
    got = ops.tree_paths(parents, max_paths=np.int64(2), path_len=np.int32(3))
    assert torch.equal(got, want)


# ---- invalid trees ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, node, message",
    [
        ([0, 0, 1], 0, "root"),
        ([5, -1, -1], 0, "root"),
        ([-1, 0, 2, 1], 2, "must come before its child"),  # parent == child: a self-cycle
        ([-1, 2, 1], 1, "must come before its child"),  # 1 -> 2 -> 1: a cycle
        ([-1, 0, 3, 2], 2, "must come before its child"),
        ([-1, 0, -1, 1], 3, "follows padding"),  # padding in the middle
        ([-1, 0, -1, -1, 0], 4, "follows padding"),  # a second root, then a child
        ([-1, 0, -2], 2, "parents are node indices"),
    ],
)
def test_invalid_tree_names_row_and_node(row, node, message):
    good = [-1] + [0] * (len(row) - 1)
    parents = torch.tensor([good, good, row], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"batch row 2: .*{message}") as err:
        ops.tree_info(parents)
    if node:
        assert f"node {node}" in str(err.value)
    with pytest.raises(ValueError, match="batch row 2"):
        ops.tree_paths(parents)


def test_invalid_rows_are_counted():
    parents = torch.tensor([[-1, 1], [-1, 0], [0, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"batch row 0: .*\(1 more invalid rows\)"):
        ops.tree_info(parents)


def test_too_many_nodes():
    with pytest.raises(ValueError, match="1 to 1024 nodes, got N = 1025"):
        ops.tree_info(torch.full((1, 1025), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="N = 0"):
        ops.tree_info(torch.zeros((1, 0), dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32, torch.uint8])
def test_wrong_dtype(dtype):
    with pytest.raises(TypeError, match="parents: expected dtype int32, got"):
        ops.tree_info(torch.tensor([[-1, 0]]).to(dtype))


@pytest.mark.parametrize(
    "dtype, got",
    [(">i4", r">i4 \(int32 in non-native byte order\)"), (object, "object"), ("<U2", "<U2")],
)
def test_numpy_dtypes_dlpack_cannot_carry_are_type_errors(dtype, got):
    """A big-endian or object numpy array failed in the DLPack export, a ValueError that named no
    dtype; it is a wrong dtype, reported as the other wrong dtypes are."""
    parents = np.array([[-1, 0, 1]]).astype(dtype)
    message = f"parents: expected dtype int32, got a numpy array of dtype {got}"
    with pytest.raises(TypeError, match=message):
        ops.tree_info(parents)
    with pytest.raises(TypeError, match=message):
        ops.tree_paths(parents)


def test_wrong_rank():
    with pytest.raises(ValueError, match=r"parents: expected shape \[B, N\]"):
        ops.tree_info(torch.tensor([-1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"parents: expected shape \[B, N\]"):
        ops.tree_paths(torch.tensor([[[-1, 0]]], dtype=torch.int32))


def test_not_an_array():
    with pytest.raises(TypeError, match="parents"):
        ops.tree_info("not an array")
    with pytest.raises(TypeError, match="parents"):
        ops.tree_info(object())


def test_non_contiguous_input_is_rejected():
    wide = torch.full((3, 16), -1, dtype=torch.int32)
    wide[:, 2] = 0
    strided = wide[:, ::2]
    with pytest.raises(ValueError, match="parents: must be contiguous"):
        ops.tree_info(strided)
    # The contiguous copy of the same data is accepted.
    assert ops.tree_info(strided.contiguous()).num_nodes.tolist() == [2, 2, 2]


# ---- array types -------------------------------------------------------------------------------


def test_numpy_input_zero_copy_and_lists():
    parents_np = np.array([[-1, 0, 1, 1], [-1, 0, -1, -1]], dtype=np.int32)
    from_np = ops.tree_info(parents_np)
    from_torch = ops.tree_info(torch.from_numpy(parents_np))
    from_list = ops.tree_info(parents_np.tolist())
    for a, b, c in zip(from_np, from_torch, from_list):
        assert torch.equal(a, b) and torch.equal(a, c)
    expected_paths = [[[0, 1, 2], [0, 1, 3]], [[0, 1, -1], [-1, -1, -1]]]
    assert ops.tree_paths(parents_np).tolist() == expected_paths
    with pytest.raises(TypeError, match="int32"):
        ops.tree_info(parents_np.astype(np.int64))
    with pytest.raises(ValueError, match="contiguous"):
        ops.tree_info(np.asfortranarray(np.array([[-1, 0], [-1, 0], [-1, 0]], dtype=np.int32)))


class _Producer:
    """A DLPack producer that is neither torch nor numpy."""

    def __init__(self, array: np.ndarray, with_device: bool = True):
        self.array = array
        if with_device:
            self.__dlpack_device__ = array.__dlpack_device__

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)


@pytest.mark.parametrize("with_device", [True, False])
def test_other_dlpack_producers(with_device):
    """Any object with __dlpack__ works as the docstring says, invalid trees included."""
    parents = np.array([[-1, 0, 1, 1], [-1, 0, -1, -1]], dtype=np.int32)
    want = ops.tree_info(parents)
    got = ops.tree_info(_Producer(parents, with_device))
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert torch.equal(ops.tree_paths(_Producer(parents, with_device)), ops.tree_paths(parents))
    bad = np.array([[-1, 0], [-1, 1]], dtype=np.int32)
    with pytest.raises(ValueError, match="batch row 1: node 1 has parent 1"):
        ops.tree_info(_Producer(bad, with_device))
    with pytest.raises(ValueError, match="parents: cannot be exported through DLPack"):
        ops.tree_info(_Producer(parents.astype(">i4"), with_device))


@pytest.mark.parametrize("row", [[-1, 0, True], [-1, np.True_, 0], [True, False]])
def test_lists_holding_bools_are_refused(row):
    """torch.tensor([-1, True]) would make True a silent 1."""
    with pytest.raises(TypeError, match="parents: expected integers"):
        ops.tree_info([row])


def test_requires_grad_and_views_are_fine():
    base = torch.full((4, 9), -1, dtype=torch.int32)
    base[:, 1] = 0
    view = base[1:3]  # a contiguous view with a storage offset
    info = ops.tree_info(view)
    assert info.num_nodes.tolist() == [2, 2]


def test_torch_compile_traces_tree_info():
    def depth_plus_one(parents):
        return ops.tree_info(parents).depth + 1

    compiled = torch.compile(depth_plus_one, backend="aot_eager", fullgraph=True)
    parents = ops.chain_parents(2, 5)
    assert torch.equal(compiled(parents), ops.tree_info(parents).depth + 1)


# ---- CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
def test_cuda_matches_cpu_exactly():
    g = torch.Generator().manual_seed(2)
    for n in (1, 5, 32, 33, 100, 1024):
        parents = random_parents(g, batch=37, n=n, pad_max=n // 2)
        cpu = ops.tree_info(parents)
        gpu = ops.tree_info(parents.cuda())
        for a, b in zip(cpu, gpu):
            assert b.device.type == "cuda"
            assert torch.equal(a, b.cpu())
        assert torch.equal(ops.tree_paths(parents), ops.tree_paths(parents.cuda()).cpu())
    bad = torch.tensor([[-1, 0], [-1, 1]], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="batch row 1"):
        ops.tree_info(bad)


def test_cuda_array_without_cuda_build_is_a_clear_error():
    if specdecode.info()["cuda"]["compiled"]:
        pytest.skip("this build has CUDA; the error under test is the one of CPU-only builds")
    from dlpack_capsule import capsule_claiming_device

    from specdecode import _C

    parents = np.array([[-1, 0]], dtype=np.int32)
    with pytest.raises(ValueError, match=r"parents: is on cuda:0, but this build .* no CUDA"):
        _C.tree_info(capsule_claiming_device(parents, device_type=2), None, None, None, None, 0)
