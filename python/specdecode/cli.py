"""The ``specdecode`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _cmd_info(args: argparse.Namespace) -> int:
    from ._info import format_info, info

    if args.json:
        import json

        print(json.dumps(info(), indent=2))
    else:
        print(format_info())
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .benchmark import run_from_args

    return run_from_args(args, " ".join(["specdecode", *sys.argv[1:]]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdecode", description="Speculative decoding for PyTorch models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p_info = sub.add_parser("info", help="version, backends, CUDA devices, threads")
    p_info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p_info.set_defaults(func=_cmd_info)
    from .benchmark import add_arguments

    p_bench = sub.add_parser("bench", help="end-to-end benchmark against transformers")
    add_arguments(p_bench)
    p_bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
