"""specdecode: speculative decoding for PyTorch models.

Native kernels (C++ on the CPU, CUDA on NVIDIA GPUs) for the hot spots of speculative decoding,
and a thin Python layer around them. The kernels are in :mod:`specdecode.ops`.
"""

from __future__ import annotations

from . import ops
from ._info import get_num_threads, info, set_num_threads
from .ops import PAD_TOKEN, TreeInfo, chain_parents, tree_info, tree_paths

__version__: str = info()["version"]

__all__ = [
    "PAD_TOKEN",
    "TreeInfo",
    "__version__",
    "chain_parents",
    "get_num_threads",
    "info",
    "ops",
    "set_num_threads",
    "tree_info",
    "tree_paths",
]
