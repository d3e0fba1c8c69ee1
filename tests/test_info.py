"""specdecode.info(), the thread setting and the `specdecode info` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import specdecode


def test_info_fields():
    data = specdecode.info()
    assert data["version"] == specdecode.__version__
    assert "cpu" in data["backends"]
    cuda = data["cuda"]
    assert ("cuda" in data["backends"]) == cuda["compiled"]
    assert isinstance(cuda["devices"], list)
    if cuda["compiled"] and not cuda["devices"]:
        assert cuda["error"]  # says why no device is usable
    assert data["num_threads"] >= 1


def test_set_num_threads_round_trip():
    default = specdecode.get_num_threads()
    try:
        specdecode.set_num_threads(3)
        assert specdecode.get_num_threads() == 3
        assert specdecode.info()["num_threads"] == 3
    finally:
        specdecode.set_num_threads(0)
    assert specdecode.get_num_threads() == default
    with pytest.raises(ValueError):
        specdecode.set_num_threads(-1)
    with pytest.raises(TypeError):
        specdecode.set_num_threads(2.0)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdecode", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_info():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    assert f"specdecode {specdecode.__version__}" in result.stdout
    assert "backends compiled in: cpu" in result.stdout
    if specdecode.info()["cuda"]["compiled"]:
        assert "CUDA: compiled in" in result.stdout
    else:
        assert "CUDA: not compiled in" in result.stdout


def test_cli_info_json_and_bad_command():
    result = run_cli("info", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["version"] == specdecode.__version__
    bad = run_cli("no-such-command")
    assert bad.returncode == 2
    assert "invalid choice" in bad.stderr
