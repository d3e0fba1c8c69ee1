"""Build and runtime information, and the CPU thread count."""

from __future__ import annotations

from typing import Any

from . import _C


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
        ``compiler`` (str).
    """
    return dict(_C.build_info())


def get_num_threads() -> int:
    """Threads the CPU kernels use (results never depend on it)."""
    return int(_C.num_threads())


def set_num_threads(n: int) -> None:
    """Sets the threads the CPU kernels use; 0 restores the default.

    The default is ``SPECDECODE_NUM_THREADS`` if set, else the CPUs this process may run on.
    """
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"n: expected an int, got {type(n).__name__}")
    _C.set_num_threads(n)


def format_info(data: dict[str, Any] | None = None) -> str:
    """The report printed by ``specdecode info``."""
    data = info() if data is None else data
    cuda = data["cuda"]

    def cuda_version(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}" if v else "none"

    lines = [
        f"specdecode {data['version']}",
        f"backends compiled in: {', '.join(data['backends'])}",
        f"CPU threads: {data['num_threads']}",
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
