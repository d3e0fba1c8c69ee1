"""Shared test helpers. Tests import the installed specdecode, never the source tree."""

from __future__ import annotations

import pathlib

import pytest
import torch

import specdecode

_SOURCE_PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "specdecode"
if pathlib.Path(specdecode.__file__).resolve().parent == _SOURCE_PACKAGE:
    raise RuntimeError(
        "tests must run against the installed package (pip install .), "
        f"but specdecode was imported from the source tree {_SOURCE_PACKAGE}"
    )


def cuda_available() -> bool:
    """True when this build has the CUDA backend and torch sees a GPU."""
    return bool(specdecode.info()["cuda"]["compiled"]) and torch.cuda.is_available()


def cuda_skip_reason() -> str:
    if not specdecode.info()["cuda"]["compiled"]:
        return "specdecode was built without CUDA (SPECDECODE_CUDA=OFF or no nvcc)"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return ""


requires_cuda = pytest.mark.skipif(not cuda_available(), reason=cuda_skip_reason() or "cuda")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module of tiny-model tests: on a small shared machine
    more threads only add contention, and no result depends on the count. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
