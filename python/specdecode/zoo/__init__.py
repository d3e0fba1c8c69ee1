"""Model pairs trained by this project and shipped inside the package.

``pycode`` is a Llama-style target and a smaller draft trained on the Python standard library's
sources, with their sentencepiece tokenizer (see docs/zoo.md for sizes, training and quality)::

    from specdecode import zoo
    target, draft, tokenizer = zoo.load("pycode")

Everything loads from the package directory: no network access is ever made.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Tuple

import torch

from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from ..models import Transformer
    from ..specformer import SpecFormerHead
    from ..steering import DraftSteering

_ROOT = Path(__file__).resolve().parent

# name -> one-line description; each name is a directory beside this file holding target/ and
# draft/ (Hugging Face layout: config.json + model.safetensors) and tokenizer.model.
_PAIRS = {
    "pycode": "target + draft trained on the Python standard library's sources (sentencepiece BPE)",
}

__all__ = [
    "Tokenizer",
    "available",
    "load",
    "load_specformer",
    "load_steering",
    "load_tokenizer",
    "path",
]


def available() -> List[str]:
    """Names of the shipped model pairs whose files are present in this installation."""
    return [name for name in sorted(_PAIRS) if _complete(_ROOT / name)]


def _complete(d: Path) -> bool:
    return (d / "tokenizer.model").is_file() and all(
        (d / role / f).is_file()
        for role in ("target", "draft")
        for f in ("config.json", "model.safetensors")
    )


def path(name: str) -> Path:
    """Directory of the pair ``name`` (``target/``, ``draft/``, ``tokenizer.model``).

    Raises
    ------
    TypeError
        If ``name`` is not a str.
    ValueError
        If ``name`` is not a known pair.
    FileNotFoundError
        If the pair's files are missing from this installation.
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected str, got {type(name).__name__}")
    if name not in _PAIRS:
        raise ValueError(f"name: unknown model pair {name!r}; known: {sorted(_PAIRS)}")
    d = _ROOT / name
    if not _complete(d):
        raise FileNotFoundError(f"name: the files of {name!r} are missing from {d}")
    return d


def load_tokenizer(name: str = "pycode") -> Tokenizer:
    """The tokenizer of the pair ``name`` alone (no model weights are read)."""
    return Tokenizer(path(name) / "tokenizer.model")


def load(name: str = "pycode") -> Tuple[Transformer, Transformer, Tokenizer]:
    """Load a shipped target/draft pair and its tokenizer, offline, on the CPU in float32.

    Parameters
    ----------
    name : str
        One of :func:`available` (``"pycode"``).

    Returns
    -------
    target : specdecode.models.Transformer
        The target model (eval mode).
    draft : specdecode.models.Transformer
        The draft model (eval mode), same vocabulary as the target.
    tokenizer : Tokenizer
        The sentencepiece tokenizer both models were trained with.
    """
    from ..models import Transformer  # noqa: F811 (the runtime import of the annotation's class)

    d = path(name)
    # Stored in float16 to fit the wheel's size budget; computed in float32.
    target = Transformer.from_pretrained(str(d / "target"), dtype=torch.float32).eval()
    draft = Transformer.from_pretrained(str(d / "draft"), dtype=torch.float32).eval()
    return target, draft, Tokenizer(d / "tokenizer.model")


STEERING_NAME = "steering.safetensors"


def load_steering(name: str = "pycode") -> DraftSteering:
    """The pair's trained steering map (:mod:`specdecode.steering`, SD²) for its draft model.

    Trained by ``specdecode steer --model NAME --out .../steering.safetensors`` (docs/zoo.md
    gives the command); stored in float16, returned in float32 on the CPU.

    Raises
    ------
    TypeError, ValueError, FileNotFoundError
        As :func:`path`; FileNotFoundError also when the pair ships no steering map.
    """
    from ..steering import DraftSteering  # noqa: F811 (the runtime import of the annotation's class)

    f = path(name) / STEERING_NAME
    if not f.is_file():
        raise FileNotFoundError(f"name: the pair {name!r} ships no steering map ({f})")
    return DraftSteering.load(f)


SPECFORMER_NAME = "specformer.safetensors"
SPECFORMER_ROOT_NAME = "specformer_root.safetensors"


def load_specformer(name: str = "pycode", root_aware: bool = False) -> SpecFormerHead:
    """The pair's trained SpecFormer draft head (:mod:`specdecode.specformer`) for its target:
    the paper's, or with ``root_aware`` the head that also reads the round's root token.

    Trained by ``specdecode specformer --model NAME --out .../specformer.safetensors`` (and
    ``--root-aware --out .../specformer_root.safetensors``; docs/zoo.md gives the commands);
    stored in float16, returned in float32 on the CPU.

    Raises
    ------
    TypeError, ValueError, FileNotFoundError
        As :func:`path`; FileNotFoundError also when the pair ships no SpecFormer head.
    """
    from ..specformer import SpecFormerHead  # noqa: F811 (the annotation's class, at run time)

    f = path(name) / (SPECFORMER_ROOT_NAME if root_aware else SPECFORMER_NAME)
    if not f.is_file():
        raise FileNotFoundError(f"name: the pair {name!r} ships no SpecFormer head ({f})")
    return SpecFormerHead.load(f)
