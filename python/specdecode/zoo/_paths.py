"""Checks of the paths the zoo's commands read and write, and of their numeric options, before
any work is done.

Each path check returns the path or raises ``FileNotFoundError`` (something that should be there
is not) or ``ValueError`` (it is there but of the wrong kind, or cannot be written), with a
message that names ``what`` the path is for; :func:`exit_with_error` turns them into the one-line
error of a command.

A numeric option's range is checked by its argparse ``type`` (:func:`int_at_least`,
:func:`float_in`): a value out of range is argparse's usage error naming the option, as a value
that is no number at all is.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

# argparse's exit code for a usage error, which a bad path given on the command line is too.
EXIT_USAGE = 2


def existing_dir(path: Path, what: str, files: Sequence[str] = ()) -> Path:
    """``path``, a directory that holds each of ``files``.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist, or one of ``files`` is missing from it.
    ValueError
        ``path`` is not a directory.
    """
    path = _existing(path, what, Path.is_dir, "directory")
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{what} {path} has no {', '.join(missing)}")
    return path


def existing_file(path: Path, what: str) -> Path:
    """``path``, an existing file.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        ``path`` is a directory or another non-file.
    """
    return _existing(path, what, Path.is_file, "file")


def writable_dir(path: Path, what: str) -> Path:
    """``path``, a writable directory or one that can be created (with its missing parents).

    Raises
    ------
    ValueError
        ``path`` or its nearest existing ancestor is not a directory, or cannot be written.
    """
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{what} {path} is not a directory")
        _check_writable(path, what, path)
        return path
    ancestor = _nearest_existing(path)
    if not ancestor.is_dir():
        raise ValueError(f"{what} {path} cannot be created: {ancestor} is not a directory")
    _check_writable(ancestor, what, path)
    return path


def writable_file(path: Path, what: str) -> Path:
    """``path``, a file that can be written: an existing writable file, or a new one in an
    existing writable directory.

    Raises
    ------
    FileNotFoundError
        The directory of ``path`` does not exist.
    ValueError
        ``path`` is a directory, or ``path`` or its directory cannot be written.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ValueError(f"{what} {path} is not writable")
        return path
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"{what} {path}: the directory {parent} does not exist")
    _check_writable(parent, what, path)
    return path


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an int ``>= minimum`` (else argparse's usage error, which names the
    option: ``argument --seq-len: expected an int >= 1, got 0``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an int >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
        return value

    return parse


def float_in(
    low: float, high: float = math.inf, *, low_open: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a finite float in ``[low, high]`` (``(low, high]`` with
    ``low_open``); else argparse's usage error, which names the option."""
    if high == math.inf:
        wanted = f"a finite float {'>' if low_open else '>='} {low:g}"
    else:
        wanted = f"a float in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and value <= high):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    return parse


def exit_with_error(prog: str, exc: Exception) -> NoReturn:
    """Ends the command ``prog`` with exit code 2, as argparse does on a usage error, and one
    line ``PROG: error: MESSAGE`` on stderr (no traceback, no usage block)."""
    sys.stderr.write(f"{prog}: error: {exc}\n")
    raise SystemExit(EXIT_USAGE)


def _existing(path: Path, what: str, is_kind: Callable[[Path], bool], kind: str) -> Path:
    """``Path(path)`` if it exists and ``is_kind`` of it holds; else ``FileNotFoundError``
    (missing) or ``ValueError`` (``path`` is not a ``kind``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not is_kind(path):
        raise ValueError(f"{what} {path} is not a {kind}")
    return path


def _nearest_existing(path: Path) -> Path:
    # A relative path's chain ends at "." (the working directory), which exists.
    for ancestor in path.parents:
        if ancestor.exists():
            return ancestor
    return Path(".")


def _check_writable(directory: Path, what: str, path: Path) -> None:
    # Creating an entry needs write and search permission on the directory.
    if not os.access(directory, os.W_OK | os.X_OK):
        where = "" if directory == path else f" (in {directory})"
        raise ValueError(f"{what} {path} is not writable{where}")
