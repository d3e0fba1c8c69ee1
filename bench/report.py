"""Turns a pytest-benchmark JSON file into a markdown table with speedups over a baseline.

    python bench/report.py RESULT.json [--baseline torch]

Rows are benchmark groups; each implementation's median time is listed with its speedup over the
baseline implementation measured in the same run (the `impl` extra_info field).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json_file")
    parser.add_argument("--baseline", default="torch")
    args = parser.parse_args()
    with open(args.json_file) as f:
        data = json.load(f)
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for bench in data["benchmarks"]:
        impl = bench["extra_info"].get("impl", bench["name"])
        groups[bench["group"]][impl] = bench["stats"]["median"]
    impls = sorted({impl for g in groups.values() for impl in g}, key=lambda s: s != "native")
    header = ["case"] + [f"{i} (median)" for i in impls]
    header += [f"{i} speedup vs {args.baseline}" for i in impls if i != args.baseline]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for group, times in groups.items():
        row = [group] + [fmt_time(times[i]) if i in times else "-" for i in impls]
        base = times.get(args.baseline)
        for i in impls:
            if i == args.baseline:
                continue
            row.append(f"{base / times[i]:.1f}x" if base and i in times else "-")
        print("| " + " | ".join(row) + " |")
    machine = data.get("machine_info", {})
    print(
        f"\nmachine: {machine.get('cpu', {}).get('brand_raw', '?')}, "
        f"python {machine.get('python_version', '?')}; date {data.get('datetime', '?')}"
    )


if __name__ == "__main__":
    main()
