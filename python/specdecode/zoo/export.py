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

from .corpus import MANIFEST_NAME
from .train import TOKENIZER_NAME


def export_model(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """Re-save the model in ``src`` to ``dst`` with parameters in ``dtype``."""
    from ..models import Transformer

    model = Transformer.from_pretrained(str(src), dtype=dtype)
    if dst.exists():
        shutil.rmtree(dst)
    model.save_pretrained(str(dst))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdecode.zoo.export", description=__doc__)
    p.add_argument("--target", type=Path, required=True, help="final/ of the target's run")
    p.add_argument("--draft", type=Path, required=True, help="final/ of the draft's run")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    args = p.parse_args(argv)
    tok_t = (args.target / TOKENIZER_NAME).read_bytes()
    if tok_t != (args.draft / TOKENIZER_NAME).read_bytes():
        raise SystemExit("--target and --draft were trained with different tokenizers")
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    for role, src in (("target", args.target), ("draft", args.draft)):
        export_model(src, args.out / role, dtype)
        log = src.parent / "log.jsonl"
        if log.exists():
            shutil.copyfile(log, args.out / f"{role}_log.jsonl")
    (args.out / TOKENIZER_NAME).write_bytes(tok_t)
    shutil.copyfile(args.target / MANIFEST_NAME, args.out / MANIFEST_NAME)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({total / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
