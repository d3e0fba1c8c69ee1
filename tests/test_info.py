"""specdecode.info(), the thread settings and the `specdecode info` command."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import specdecode
from specdecode import _C

TORCH_ON_OPENMP = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
needs_torch_openmp = pytest.mark.skipif(
    not TORCH_ON_OPENMP, reason="this torch build does not run its intra-op threads on OpenMP"
)


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


def test_info_reports_the_cpu_kernel_paths():
    kernels = specdecode.info()["cpu_kernels"]
    assert kernels["tree_attention"] == _C.attention_isa()
    assert kernels["tree_attention"] in ("amx", "avx512bf16", "avx512", "avx2", "generic")
    # verify's path is the best its exp loops run here (0 baseline, 1 AVX2, 2 AVX-512).
    x = np.zeros(8, dtype=np.float32)
    used = _C.verify_exp_approx(x, np.empty_like(x), 2)
    assert kernels["verify"] == ("baseline", "avx2", "avx512")[used]
    if platform.machine() not in ("x86_64", "AMD64"):
        assert kernels == {"tree_attention": "generic", "verify": "baseline"}
    line = f"tree_attention {kernels['tree_attention']}, verify {kernels['verify']}"
    assert f"CPU kernels: {line}" in specdecode._info.format_info()
    # The attention override is what the next call runs, and info follows it.
    try:
        assert _C.set_attention_isa("generic")
        assert specdecode.info()["cpu_kernels"]["tree_attention"] == "generic"
    finally:
        _C.set_attention_isa("")
    assert specdecode.info()["cpu_kernels"]["tree_attention"] == kernels["tree_attention"]


def test_info_reports_verify_capped_by_the_environment():
    code = "import specdecode; print(specdecode.info()['cpu_kernels']['verify'])"
    env = dict(os.environ, SPECDECODE_CPU_ISA="baseline")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "baseline"


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


@pytest.fixture
def restore_threads():
    before = specdecode.get_threading()["mode"]
    torch_before = torch.get_num_threads()
    yield
    specdecode.set_threading(before)
    specdecode.set_num_threads(0)
    torch.set_num_threads(torch_before)


@needs_torch_openmp
def test_auto_runs_on_torchs_openmp_team(restore_threads):
    specdecode.set_threading("auto")
    threading = specdecode.get_threading()
    assert threading["backend"] == "openmp"
    runtime = threading["runtime"]
    assert os.path.basename(runtime).startswith(("libgomp", "libiomp5", "libomp"))
    # The runtime borrowed is one torch already loaded, not a copy of our own.
    with open("/proc/self/maps") as maps:
        assert runtime in maps.read()
    assert specdecode.info()["threading"] == threading


@pytest.mark.parametrize("mode", ["pool", pytest.param("openmp", marks=needs_torch_openmp)])
def test_chunks_run_side_by_side_and_errors_reach_the_caller(mode, restore_threads):
    specdecode.set_threading(mode)
    assert specdecode.get_threading()["backend"] == mode
    specdecode.set_num_threads(2)
    # Each chunk waits (up to 2 s) for a second thread: 2 distinct threads means both ran.
    assert _C._parallel_probe(8, 2) == 2
    specdecode.set_num_threads(1)
    assert _C._parallel_probe(8, 2) == 1
    specdecode.set_num_threads(2)
    with pytest.raises(RuntimeError, match="chunk 5"):
        _C._parallel_probe(8, 2, 5)
    assert _C._parallel_probe(4, 2) == 2  # the pool or team is usable after the error


@pytest.mark.parametrize("mode", ["pool", pytest.param("openmp", marks=needs_torch_openmp)])
def test_concurrent_callers_get_the_same_results(mode, restore_threads):
    # Callers on several Python threads (the ops release the GIL): on the team each caller gets a
    # team of its own from the runtime, on the pool a caller that finds it busy runs alone.
    import threading

    from specdecode import ops

    specdecode.set_threading(mode)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2, 8, 64, generator=gen)
    k = torch.randn(3, 600, 2, 64, generator=gen)
    v = torch.randn(3, 600, 2, 64, generator=gen)
    lens = torch.tensor([598, 300, 1], dtype=torch.int32)
    logits = torch.randn(8, 4, 500, generator=gen)
    tokens = torch.randint(0, 500, (8, 4), generator=gen)
    seed = torch.arange(8)

    def run():
        return ops.tree_attention(q, k, v, lens), ops.verify(logits, tokens, seed=seed, offset=3)

    expected = run()
    results: list = []
    errors: list = []

    def caller():
        try:
            for _ in range(5):
                results.append(run())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    callers = [threading.Thread(target=caller) for _ in range(3)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=120)
    assert not errors and len(results) == 15
    for attn, res in results:
        assert torch.equal(attn, expected[0])
        assert all(torch.equal(x, y) for x, y in zip(res, expected[1]))


@needs_torch_openmp
def test_thread_count_follows_torch_on_the_openmp_team(restore_threads):
    specdecode.set_threading("openmp")
    specdecode.set_num_threads(0)
    torch.set_num_threads(1)
    assert specdecode.get_num_threads() == 1
    assert _C._parallel_probe(4, 2) == 1
    torch.set_num_threads(2)
    assert specdecode.get_num_threads() == 2
    specdecode.set_num_threads(3)  # an explicit count wins over torch's
    torch.set_num_threads(1)
    assert specdecode.get_num_threads() == 3


def test_set_threading_rejects_unknown_modes(restore_threads):
    with pytest.raises(ValueError, match="mode"):
        specdecode.set_threading("threads")
    specdecode.set_threading("pool")
    assert specdecode.get_threading() == {"mode": "pool", "backend": "pool", "runtime": ""}
    assert "own pool" in specdecode._info.format_info()


# Loads _C without torch (and so without an OpenMP runtime), then loads torch's runtime by hand.
_NO_TORCH_SCRIPT = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("_C", sys.argv[1])
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)
assert "torch" not in sys.modules
assert C.threading() == {"mode": "auto", "backend": "pool", "runtime": ""}, C.threading()
try:
    C.set_threading("openmp")
    raise SystemExit("set_threading('openmp') passed with no OpenMP runtime loaded")
except RuntimeError as e:
    assert "no OpenMP runtime" in str(e)
C.set_num_threads(2)
assert C._parallel_probe(6, 2) == 2
ctypes.CDLL(sys.argv[2])
assert C.threading()["backend"] == "openmp", C.threading()
assert C.threading()["runtime"] == sys.argv[2]
assert C._parallel_probe(6, 2) == 2
print("ok")
"""


@needs_torch_openmp
def test_pool_until_an_openmp_runtime_is_loaded(restore_threads):
    specdecode.set_threading("auto")  # even where SPECDECODE_THREADING=pool is set
    runtime = specdecode.get_threading()["runtime"]
    env = {k: v for k, v in os.environ.items() if k != "SPECDECODE_THREADING"}
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_SCRIPT, _C.__file__, runtime],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# The parent runs a parallel region (on the team or the pool), forks, and the child runs one too.
_FORK_SCRIPT = """
import os, sys, torch, specdecode
from specdecode import _C, ops
specdecode.set_threading(sys.argv[1])
specdecode.set_num_threads(2)
gen = torch.Generator().manual_seed(3)
q = torch.randn(1, 1, 8, 64, generator=gen)
k = torch.randn(1, 3000, 2, 64, generator=gen)
v = torch.randn(1, 3000, 2, 64, generator=gen)
lens = torch.tensor([2999], dtype=torch.int32)
expected = ops.tree_attention(q, k, v, lens)
assert _C._parallel_probe(4, 2) == 2
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    same = torch.equal(ops.tree_attention(q, k, v, lens), expected)
    threads = _C._parallel_probe(4, 2)
    os.write(w, f"{same} {threads} {specdecode.get_threading()['backend']}".encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(r, 100).decode())
"""


@pytest.mark.parametrize("mode", ["pool", pytest.param("openmp", marks=needs_torch_openmp)])
def test_a_forked_child_runs_on_a_fresh_pool(mode):
    # An OpenMP team does not survive fork (GNU libgomp waits for the parent's threads); before
    # the child switched to a pool of its own, this hung.
    # A session of its own, so that a hung child is killed with its parent on a timeout.
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORK_SCRIPT, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the forked child hung")
    assert proc.returncode == 0, err
    assert out.split() == ["True", "2", "pool"]


def test_threading_environment_variable():
    script = "import specdecode; print(specdecode.get_threading()['mode'])"
    for value, mode in (("pool", "pool"), ("auto", "auto")):
        env = dict(os.environ, SPECDECODE_THREADING=value)
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == mode
    env = dict(os.environ, SPECDECODE_THREADING="omp")
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode != 0 and "SPECDECODE_THREADING='omp'" in result.stderr


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
