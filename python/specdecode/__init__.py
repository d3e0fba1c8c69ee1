"""specdecode: speculative decoding for PyTorch models.

Native kernels (C++ on the CPU, CUDA on NVIDIA GPUs) for the hot spots of speculative decoding,
and a thin Python layer around them. The kernels are in :mod:`specdecode.ops`.
"""

from __future__ import annotations

from . import drafters, engine, judge, models, ops, specformer, steering, timeseries
from ._info import get_num_threads, get_threading, info, set_num_threads, set_threading
from .engine import GenerationOutput, GenerationStats, SpeculativeDecoder, generate
from .ops import PAD_TOKEN, TreeInfo, chain_parents, tree_info, tree_paths

__version__: str = info()["version"]

__all__ = [
    "GenerationOutput",
    "GenerationStats",
    "PAD_TOKEN",
    "SpeculativeDecoder",
    "TreeInfo",
    "__version__",
    "chain_parents",
    "drafters",
    "engine",
    "generate",
    "get_num_threads",
    "get_threading",
    "info",
    "judge",
    "models",
    "ops",
    "set_num_threads",
    "set_threading",
    "specformer",
    "steering",
    "tree_info",
    "timeseries",
    "tree_paths",
]
