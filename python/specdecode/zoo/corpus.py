"""The training corpus of the zoo models: the Python standard library's own sources.

The corpus is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` of the interpreter that
runs the training, excluding ``site-packages`` / ``dist-packages`` (third-party code, different on
every machine) and the standard library's test suites (``test/``, ``tests/``, ``idle_test/``
directories): the tests are a third of the files but mostly repetitive fixtures, and the token
budget of a 2-core training run is far below one pass over the rest anyway.

A file belongs to the held-out split when the sha256 of its path *relative to the stdlib root*
falls in the first ``1/HELDOUT_MODULUS`` of the hash space: the split depends only on the file's
name, so it is the same on every machine and every Python version that has the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

from ._paths import existing_dir

EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
HELDOUT_MODULUS = 20  # 1 file in 20 (5%) is held out

MANIFEST_NAME = "corpus_manifest.json"


@dataclass(frozen=True)
class CorpusFile:
    """One source file of the corpus.

    Attributes
    ----------
    path : str
        Path relative to the stdlib root, with ``/`` separators.
    sha256 : str
        Hex sha256 of the file's bytes.
    heldout : bool
        Whether the file belongs to the held-out split.
    """

    path: str
    sha256: str
    heldout: bool


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(relpath: str) -> bool:
    """Whether the file at ``relpath`` (relative, ``/`` separators) is in the held-out split."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def iter_source_paths(root: Optional[Path] = None) -> Iterator[str]:
    """Relative paths of the corpus files under ``root``, sorted (byte order of the path)."""
    root = stdlib_root() if root is None else Path(root)
    found: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of excluded trees entirely.
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                rel = Path(dirpath, name).relative_to(root).as_posix()
                found.append(rel)
    yield from sorted(found)


def read_text(root: Path, relpath: str) -> Optional[str]:
    """The file's text as UTF-8, or None when it is not valid UTF-8 (such files are skipped)."""
    data = (Path(root) / relpath).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class Corpus:
    """The corpus: its root and its files, with their texts loaded on demand."""

    root: Path
    files: Sequence[CorpusFile]

    @classmethod
    def collect(cls, root: Optional[Path] = None) -> Corpus:
        """Scan ``root`` (default: this interpreter's stdlib) and hash every file.

        Raises
        ------
        FileNotFoundError
            ``root`` does not exist.
        ValueError
            ``root`` is not a directory.
        """
        root = stdlib_root() if root is None else existing_dir(root, "corpus root").resolve()
        files = []
        for rel in iter_source_paths(root):
            data = (root / rel).read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            files.append(CorpusFile(rel, hashlib.sha256(data).hexdigest(), is_heldout(rel)))
        return cls(root, tuple(files))

    def texts(self, heldout: Optional[bool] = None) -> Iterator[str]:
        """Texts of the files in order; ``heldout`` selects a split (None: all files)."""
        for f in self.files:
            if heldout is None or f.heldout == heldout:
                text = read_text(self.root, f.path)
                if text is not None:
                    yield text

    def combined_hash(self) -> str:
        """sha256 over the sorted ``"<sha256>  <path>\\n"`` lines (the sha256sum format)."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.sha256}  {f.path}\n".encode())
        return h.hexdigest()

    def manifest(self) -> dict:
        """A JSON-able record of the corpus: interpreter, root, files and hashes."""
        n_bytes = sum((self.root / f.path).stat().st_size for f in self.files)
        return {
            "python": sys.version.split()[0],
            "implementation": sys.implementation.name,
            "stdlib_root": str(self.root),
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "heldout_rule": f"sha256(relative path)[:8] as big-endian int % {HELDOUT_MODULUS} == 0",
            "num_files": len(self.files),
            "num_heldout_files": sum(f.heldout for f in self.files),
            "num_bytes": n_bytes,
            "combined_sha256": self.combined_hash(),
            "files": [
                {"path": f.path, "sha256": f.sha256, "heldout": f.heldout} for f in self.files
            ],
        }

    def write_manifest(self, path: Path) -> None:
        """Write :meth:`manifest` as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.manifest(), indent=1) + "\n", encoding="utf-8")
