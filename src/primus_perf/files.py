"""Atomic file writes: a temporary file in the same directory, renamed over the target.

A reader never sees a half-written file, a writer killed mid-write leaves the old file (or
none), and concurrent writers of one directory never share a temporary name. The cache,
traces, manifests, reports, problem and sample files are written through here.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once, at import: os.umask can only be read by setting it


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, fsync: bool = False,
                encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path`` for writing; on a clean exit it replaces
    ``path`` (with the permissions a plain ``open`` would give), on an error it is removed."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes only ('w' or 'wb'), not {mode!r}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = False) -> Path:
    with atomic_open(path, fsync=fsync) as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = False, **dump_kwargs: Any) -> Path:
    with atomic_open(path, fsync=fsync) as f:
        json.dump(obj, f, **dump_kwargs)
    return Path(path)
