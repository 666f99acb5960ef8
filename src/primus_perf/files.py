"""Files in and out: atomic writes, and the one check of an input file before it is read.

Writes go to a temporary file in the same directory, renamed over the target: a reader
never sees a half-written file, a writer killed mid-write leaves the old file (or none),
and concurrent writers of one directory never share a temporary name. The cache, traces,
manifests, reports, problem and sample files and the trainer's JSON log are written
through here. A target that cannot be written (read-only, missing folder, permission
denied, full disk, a directory in the way) is one :class:`~primus_perf.errors.UserError`
naming the path and the reason, and the old file stays byte-for-byte as it was.

:func:`check_input_file` is the one check before a file is read: it exists, is a regular
file (not a FIFO, a device or a directory), is not empty, is readable, is not larger
than a limit and (where the caller says what it must start with) looks like one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from primus_perf.errors import UserError

TEMP_SUFFIX = ".tmp"
# OS errors a user can cause (and fix) when a file is written; others are bugs.
USER_ERRNOS = frozenset({
    errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR,
    errno.ENOTDIR, errno.EDQUOT, errno.EEXIST, errno.ENAMETOOLONG, errno.EFBIG, errno.ELOOP,
})


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once, at import: os.umask can only be read by setting it


def write_error(path: str | os.PathLike, exc: OSError) -> UserError:
    """The one-line error for an OSError while writing ``path``."""
    reason = exc.strerror or exc.__class__.__name__
    return UserError(f"cannot write {path}: {reason}")


def temp_prefix(path: str | os.PathLike) -> str:
    """Name prefix of the temporary files :func:`atomic_open` makes for ``path``."""
    return f".{Path(path).name}."


def remove_orphaned_temps(path: str | os.PathLike, *, older_than_s: float = 60.0) -> list[Path]:
    """Remove temporary files of ``path`` (this module's name pattern) left by a writer
    that was killed, older than ``older_than_s``. Call it only while holding the lock that
    serializes the writers of ``path``: a live writer's temporary file is younger."""
    p = Path(path)
    removed = []
    now = time.time()
    with contextlib.suppress(OSError):
        for tmp in p.parent.glob(temp_prefix(p) + "*" + TEMP_SUFFIX):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > older_than_s and tmp.is_file():
                    tmp.unlink()
                    removed.append(tmp)
    return removed


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, fsync: bool = False,
                encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path`` for writing; on a clean exit it replaces
    ``path`` (with the permissions a plain ``open`` would give), on an error it is removed.
    An OSError a user can cause becomes a one-line UserError naming ``path``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes only ('w' or 'wb'), not {mode!r}")
    p = Path(path)
    tmp = None
    try:
        if p.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(p))
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=temp_prefix(p), suffix=TEMP_SUFFIX)
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, p)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                Path(tmp).unlink()
        if isinstance(exc, OSError) and exc.errno in USER_ERRNOS:
            raise write_error(path, exc) from None
        raise


def check_writable(path: str | os.PathLike) -> Path:
    """Before long work whose result goes to ``path``: can a file be written there? (Its
    folder is made; a probe file is created and removed.) The one-line UserError of a write."""
    p = Path(path)
    try:
        if p.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(p))
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p.parent, prefix=temp_prefix(p), suffix=TEMP_SUFFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise write_error(p, exc) from None
    return p


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = False) -> Path:
    with atomic_open(path, fsync=fsync) as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = False, **dump_kwargs: Any) -> Path:
    with atomic_open(path, fsync=fsync) as f:
        json.dump(obj, f, **dump_kwargs)
    return Path(path)


def write_output(path: str | os.PathLike, text: str) -> None:
    """``--json PATH`` and friends: ``-`` prints ``text`` to stdout, anything else is a file."""
    if str(path) == "-":
        print(text)
    else:
        write_text(path, text if text.endswith("\n") else text + "\n")


class LineLog:
    """A file written a line at a time (JSON lines) that appears under its final name only
    when closed: lines go to a temporary name next to it (flushed and fsynced per line), and
    :meth:`close` renames it over ``path`` (when at least one line was written: an old file
    at ``path`` is never replaced by an empty one, and is untouched until then). Close it in
    a ``finally`` (the CLIs turn SIGTERM into an exception so that it runs)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            if self.path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a directory", str(self.path))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=temp_prefix(self.path), suffix=TEMP_SUFFIX)
        except OSError as exc:
            raise write_error(self.path, exc) from None
        self.partial = Path(tmp)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self.lines = 0

    def write(self, line: str) -> None:
        try:
            self._file.write(line.rstrip("\n") + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise write_error(self.path, exc) from None
        self.lines += 1

    def close(self) -> None:
        """Rename the lines written so far to the final name (idempotent); with no line
        written, remove the temporary file and leave ``path`` as it was."""
        if self._file.closed:
            return
        try:
            self._file.close()
            if not self.lines:
                self.partial.unlink()
                return
            os.chmod(self.partial, 0o666 & ~_UMASK)
            os.replace(self.partial, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.partial.unlink()
            raise write_error(self.path, exc) from None


# --------------------------------------------------------------------------- reading

_KIND_NAMES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_input_file(
    path: str | os.PathLike,
    *,
    what: str = "file",
    max_bytes: int | None = None,
    starts_with: Sequence[bytes] | None = None,
    expected: str = "",
    text: bool = False,
) -> Path:
    """``path`` if it is a regular, non-empty, readable file, else one UserError naming it.

    ``max_bytes``: refuse larger files. ``starts_with``: the first non-blank bytes must
    begin with one of these (e.g. ``b"{"`` or the gzip magic; ``expected`` names the format
    in the message). ``text``: the first 64 KiB
    must be UTF-8 without NUL bytes. Never blocks: a FIFO or a device is refused from its
    ``stat``, before it is opened."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise UserError(f"{what} not found: {p}") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {p}: {exc.strerror}") from None
    for test, name in _KIND_NAMES:
        if test(st.st_mode):
            raise UserError(f"{what} {p} is {name}, not a regular file")
    if st.st_size == 0:
        raise UserError(f"{what} {p} is empty (0 bytes)")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UserError(f"{what} {p} is {st.st_size / 2**20:.1f} MiB, more than the {max_bytes / 2**20:.0f} MiB"
                        f" a {what} can be")
    try:
        with open(p, "rb") as f:
            head = f.read(65536)
    except OSError as exc:
        raise UserError(f"cannot read {what} {p}: {exc.strerror}") from None
    if starts_with is not None and not head.lstrip().startswith(tuple(starts_with)):
        raise UserError(f"{what} {p} is not {expected or 'what it should be'} (it starts with {head[:8]!r})")
    if text:
        import codecs

        try:
            if b"\x00" in head:
                raise UnicodeDecodeError("utf-8", head, 0, 1, "NUL byte")
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError:
            raise UserError(f"{what} {p} is a binary file, not text") from None
    return p
