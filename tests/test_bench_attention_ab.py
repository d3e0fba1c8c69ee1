"""bench/attention_ab.py: its case syntax and one timed pass of the child."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "attention_ab.py")
_spec = importlib.util.spec_from_file_location("attention_ab", _PATH)
attention_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(attention_ab)


def test_cases_round_trip():
    case = attention_ab.parse_case("bf16:1:4096:4")
    assert case == ("bf16", 1, 4096, 4, 32, 8, 128)
    assert attention_ab.parse_case(attention_ab.case_arg(case)) == case
    assert attention_ab.case_name(case) == "bf16 B1 S4096 T4"
    heads = attention_ab.parse_case("fp32:1:200:4:16:16:64")
    assert heads == ("fp32", 1, 200, 4, 16, 16, 64)
    assert attention_ab.parse_case(attention_ab.case_arg(heads)) == heads
    assert attention_ab.case_name(heads) == "fp32 B1 S200 T4 Hq16 Hkv16 D64"
    for default in attention_ab.CASES:
        assert attention_ab.parse_case(attention_ab.case_arg(default)) == default


@pytest.mark.parametrize(
    "text,why",
    [
        ("bf16:1:2", "DTYPE:B:S:T"),
        ("bf16:1:2:1:8:4", "DTYPE:B:S:T"),
        ("fp64:1:2:1", "DTYPE:B:S:T"),
        ("fp32:a:2:1", "integers"),
        ("fp32:1:2:1:8:x:64", "integers"),
        ("fp32:1:2:1:6:4:64", "multiple of HKV"),
        ("fp32:1:2:1:8:0:64", "HKV >= 1"),
        ("fp32:0:2:1", "B >= 1"),
        ("fp32:1:-1:1", "S >= 0"),
        ("fp32:1:2:0", "T >= 1"),
    ],
)
def test_bad_cases_say_why(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why.replace("(", r"\(")):
        attention_ab.parse_case(text)


def test_child_times_each_case():
    times = attention_ab.time_cases(
        1, [("fp32", 1, 16, 1, 32, 8, 128), ("bf16", 2, 40, 3, 6, 3, 64)]
    )
    assert len(times) == 2
    assert all(math.isfinite(t) and t > 0 for t in times)
