"""Reading and writing the Hugging Face checkpoint layout (config.json + safetensors), and the
single safetensors files of fitted pieces (a judge, a steering map, a SpecFormer head)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch

PathLike = Union[str, os.PathLike]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def read_config(directory: PathLike) -> dict:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"directory: no {CONFIG_NAME} in {directory}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_state_dict(directory: PathLike) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in its index file."""
    from safetensors.torch import load_file

    directory = Path(directory)
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return load_file(str(single))
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(str(directory / shard)))
        return tensors
    raise FileNotFoundError(
        f"directory: neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME} in {directory}"
    )


def save_state_dict(tensors: dict[str, torch.Tensor], directory: PathLike) -> None:
    """Writes ``model.safetensors`` with the metadata transformers expects."""
    from safetensors.torch import save_file

    # safetensors refuses shared or strided storage; every tensor is written as its own copy.
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(plain, str(Path(directory) / WEIGHTS_NAME), metadata={"format": "pt"})


def write_tensor_file(
    path: PathLike,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Writes a fitted piece's ``tensors`` to one safetensors file with its ``meta``, floating
    tensors rounded to ``dtype`` (float32, float16 or bfloat16) or kept as they are (None)."""
    from safetensors.torch import save_file

    if dtype is not None and dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")

    def stored(t: torch.Tensor) -> torch.Tensor:
        keep = dtype is None or not t.dtype.is_floating_point
        return t.detach().to("cpu", t.dtype if keep else dtype).contiguous()

    plain = {name: stored(t) for name, t in tensors.items()}
    save_file(plain, str(path), metadata=meta)


def read_tensor_file(path: PathLike, what: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of one safetensors file holding a ``what`` (named in errors).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If it is not a safetensors file.
    """
    from safetensors import safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"path: no {what} file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"path: {path} is not a safetensors file ({e})") from e
    return meta, tensors
