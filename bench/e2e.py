"""End-to-end benchmark against Hugging Face transformers (same as ``specdecode bench``).

    flock /tmp/specdecode-bench.lock python bench/e2e.py --out bench/results/e2e [options]

The logic lives in :mod:`specdecode.benchmark` so that ``specdecode bench`` works from an
installed wheel; see ``python bench/e2e.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import sys

from specdecode.benchmark import add_arguments, run_from_args

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args()
    sys.exit(run_from_args(args, " ".join(["python bench/e2e.py", *sys.argv[1:]])))
