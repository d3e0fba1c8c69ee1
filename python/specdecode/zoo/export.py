"""Assemble a shippable pair: ``python -m specdecode.zoo.export --target D --draft D --out D``.

Copies the two trained models (``final/`` directories of :mod:`specdecode.zoo.train` runs) into
``--out`` as ``target/`` and ``draft/`` in the Hugging Face layout, with weights stored in
float16 (the pair must stay within the wheel's 25 MB; :func:`specdecode.zoo.load` computes in
float32), plus ``tokenizer.model``, ``corpus_manifest.json`` and each run's ``log.jsonl``.
Both runs must share the tokenizer.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from ._paths import existing_dir, exit_with_error, writable_dir
from .corpus import MANIFEST_NAME
from .train import TOKENIZER_NAME

# Files of a zoo.train run's final/ that the export reads (the corpus manifest from the target's
# only); Transformer.from_pretrained checks the weights, which may be sharded.
RUN_FILES = ("config.json", TOKENIZER_NAME)


def export_model(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """Re-save the model in ``src`` to ``dst`` with parameters in ``dtype``.

    Raises
    ------
    FileNotFoundError
        ``src`` does not exist or holds no model.
    ValueError
        ``src`` is not a directory, or its checkpoint does not match its config.
    """
    save_model(load_model(src, dtype, "model directory"), dst)


def load_model(src: Path, dtype: torch.dtype, what: str) -> torch.nn.Module:
    """The model in the directory ``src`` (``what`` it is, for error messages) in ``dtype``."""
    from ..models import Transformer

    existing_dir(src, what, ("config.json",))
    return Transformer.from_pretrained(str(src), dtype=dtype)


def save_model(model: torch.nn.Module, dst: Path) -> None:
    """``model.save_pretrained(dst)``, replacing whatever ``dst`` held."""
    if dst.exists():
        shutil.rmtree(dst)
    model.save_pretrained(str(dst))


def export_pair(target: Path, draft: Path, out: Path, dtype: torch.dtype) -> int:
    """Write the pair of the runs' ``final/`` directories ``target`` and ``draft`` to ``out``.

    Everything is read and checked before anything is written.

    Returns
    -------
    int
        Bytes in ``out`` afterwards.

    Raises
    ------
    FileNotFoundError
        ``target`` or ``draft`` does not exist or lacks a file of a run's ``final/``.
    ValueError
        ``target``, ``draft`` or ``out`` is not a directory, ``out`` cannot be written, or the
        two runs were trained with different tokenizers.
    """
    target = existing_dir(target, "target directory", (*RUN_FILES, MANIFEST_NAME))
    draft = existing_dir(draft, "draft directory", RUN_FILES)
    out = writable_dir(out, "output directory")
    tokenizer = (target / TOKENIZER_NAME).read_bytes()
    if tokenizer != (draft / TOKENIZER_NAME).read_bytes():
        raise ValueError(f"{target} and {draft} were trained with different tokenizers")
    models = {
        "target": load_model(target, dtype, "target directory"),
        "draft": load_model(draft, dtype, "draft directory"),
    }
    out.mkdir(parents=True, exist_ok=True)
    for role, src in (("target", target), ("draft", draft)):
        save_model(models[role], out / role)
        log = src.parent / "log.jsonl"
        if log.exists():
            shutil.copyfile(log, out / f"{role}_log.jsonl")
    (out / TOKENIZER_NAME).write_bytes(tokenizer)
    shutil.copyfile(target / MANIFEST_NAME, out / MANIFEST_NAME)
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdecode.zoo.export", description=__doc__)
    p.add_argument("--target", type=Path, required=True, help="final/ of the target's run")
    p.add_argument("--draft", type=Path, required=True, help="final/ of the draft's run")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    args = p.parse_args(argv)
    try:
        total = export_pair(args.target, args.draft, args.out, getattr(torch, args.dtype))
    except (ValueError, OSError) as exc:
        exit_with_error(p.prog, exc)
    print(f"wrote {args.out} ({total / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
