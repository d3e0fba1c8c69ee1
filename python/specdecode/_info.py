"""Build and runtime information, and the CPU threads of the kernels."""

from __future__ import annotations

import os
import platform
import warnings
from typing import Any, Literal

from . import _C

_THREADING_MODES = ("auto", "pool", "openmp")

if os.environ.get("SPECDECODE_THREADING", "auto") not in ("auto", "pool"):
    warnings.warn(
        f"SPECDECODE_THREADING={os.environ['SPECDECODE_THREADING']!r} is not 'auto' or 'pool'; "
        "using 'auto' (set 'openmp' with specdecode.set_threading once torch is imported)",
        RuntimeWarning,
        stacklevel=2,
    )


def info() -> dict[str, Any]:
    """What this installation of specdecode is and what it can use.

    Returns
    -------
    dict
        ``version`` (str); ``backends`` (list of str, ``"cpu"`` and, when compiled in, ``"cuda"``);
        ``cuda`` (dict: ``compiled`` bool, ``runtime_version`` and ``driver_version`` as CUDA
        encodes them, e.g. 13000 for 13.0, 0 when absent; ``devices``, a list of dicts with
        ``index``, ``name``, ``capability``, ``total_memory``; ``error``, why no device is usable,
        empty when devices were found); ``num_threads`` (int, threads of the CPU kernels);
        ``threading`` (dict, as :func:`get_threading`); ``cpu_kernels`` (dict: the CPU code
        path of ``tree_attention``, ``"amx"`` (bf16 tiles on AMX tile multiplies, the rest as
        ``"avx512bf16"``), ``"avx512bf16"``, ``"avx512"``, ``"avx2"`` or ``"generic"``,
        and of ``verify``, ``"avx512"``, ``"avx2"`` or ``"baseline"``; the vector paths exist on
        x86-64 only, other CPUs run the portable ones); ``compiler`` (str).
    """
    return dict(_C.build_info())


def get_num_threads() -> int:
    """Threads the CPU kernels use (results never depend on it).

    The count set by :func:`set_num_threads` or ``SPECDECODE_NUM_THREADS`` if any; else, when the
    kernels run on torch's OpenMP team (see :func:`get_threading`), torch's own count
    (``torch.set_num_threads`` changes it); else the CPUs this process may run on.
    """
    return int(_C.num_threads())


def set_num_threads(n: int) -> None:
    """Sets the threads the CPU kernels use; 0 restores the default (:func:`get_num_threads`)."""
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"n: expected an int, got {type(n).__name__}")
    _C.set_num_threads(n)


def get_threading() -> dict[str, str]:
    """Which threads the CPU kernels run on.

    Returns
    -------
    dict
        ``mode`` (str): ``"auto"``, ``"pool"`` or ``"openmp"``, as set by :func:`set_threading` or
        ``SPECDECODE_THREADING``. ``backend`` (str): what the next parallel kernel runs on,
        ``"openmp"`` (the team of the OpenMP runtime already loaded in the process, torch's) or
        ``"pool"`` (a small pool of specdecode's own; always in the child of a fork, where an
        OpenMP team does not survive). ``runtime`` (str): the path of that OpenMP runtime, ``""``
        for the pool.
    """
    return dict(_C.threading())


def set_threading(mode: Literal["auto", "pool", "openmp"]) -> None:
    """Chooses the threads the CPU kernels run on; results never depend on it.

    Parameters
    ----------
    mode : {"auto", "pool", "openmp"}
        ``"auto"`` (the default): the team of the OpenMP runtime torch loaded, as soon as one is
        in the process, else a pool of specdecode's own. ``"openmp"``: that team, and an error if
        no OpenMP runtime is loaded. ``"pool"``: always specdecode's own pool (the environment
        variable ``SPECDECODE_THREADING=pool`` sets this at start-up).

    Notes
    -----
    specdecode never loads an OpenMP runtime of its own. Torch's OpenMP threads keep spinning for
    a while after each of torch's parallel regions, and a kernel of ours runs right after one (the
    projection before attention, the LM head before verification); on the same team those
    spinning threads take our work instead of competing with our pool for the cores.
    """
    if mode not in _THREADING_MODES:
        raise ValueError(f"mode: expected one of {_THREADING_MODES}, got {mode!r}")
    _C.set_threading(mode)


def _threading_line(threading: dict[str, str]) -> str:
    if threading["backend"] == "openmp":
        return f"OpenMP team of {threading['runtime']}, mode {threading['mode']}"
    return f"specdecode's own pool, mode {threading['mode']}"


def format_info(data: dict[str, Any] | None = None) -> str:
    """The report printed by ``specdecode info``."""
    data = info() if data is None else data
    cuda = data["cuda"]

    def cuda_version(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}" if v else "none"

    lines = [
        f"specdecode {data['version']}",
        f"backends compiled in: {', '.join(data['backends'])}",
        f"CPU threads: {data['num_threads']} ({_threading_line(data['threading'])})",
        f"CPU kernels: tree_attention {data['cpu_kernels']['tree_attention']}, "
        f"verify {data['cpu_kernels']['verify']} ({platform.machine() or 'unknown CPU'})",
        f"compiler: {data['compiler']}",
    ]
    if cuda["compiled"]:
        lines.append(
            f"CUDA: compiled in (runtime {cuda_version(cuda['runtime_version'])}, "
            f"driver {cuda_version(cuda['driver_version'])})"
        )
        if cuda["devices"]:
            for dev in cuda["devices"]:
                major, minor = dev["capability"]
                gib = dev["total_memory"] / 2**30
                lines.append(
                    f"  device {dev['index']}: {dev['name']} (sm_{major}{minor}, {gib:.1f} GiB)"
                )
        else:
            lines.append(f"  no CUDA device present ({cuda['error']})")
    else:
        lines.append("CUDA: not compiled in (reinstall with SPECDECODE_CUDA=ON to build it)")
    return "\n".join(lines)
