"""Files in and out: atomic writes, and the one check of an input file before it is read.

Writes go to a temporary file in the same directory, renamed over the target: a reader
never sees a half-written file, a writer killed mid-write leaves the old file (or none),
and concurrent writers of one directory never share a temporary name. A temporary name
says which host and process writes it (``.<name>.<host>-<pid>.<random>.tmp``): the next
write of the same target removes those whose writer is gone (a process of this host that
no longer runs, or, of another host, one untouched for :data:`ORPHAN_AGE_S`), so files of
writers killed with ``kill -9`` do not pile up. The cache, traces,
manifests, reports, problem and sample files and the trainer's JSON log are written
through here. A target that cannot be written (read-only, missing folder, permission
denied, full disk, a directory in the way) is one :class:`~primus_perf.base.errors.UserError`
naming the path and the reason, and the old file stays byte-for-byte as it was.

:func:`read_input` reads an input file after the one check (:func:`check_input_file`
checks without reading it all): it exists, is a regular file (not a FIFO, a device or a
directory, also behind a symlink), is not empty, is readable, is not larger than a limit
and (where the caller says what it must start with) looks like one. The file is opened
non-blocking and checked on the open descriptor (``fstat``), so the check needs no
timeout: a FIFO without a writer, or a file swapped for one after a ``stat``, never
blocks the reader. :func:`load_json` and :func:`load_yaml` parse what was read: a
document nested too deep for the parser, or YAML aliases that expand past a bound (a
"billion laughs" bomb), are a ValueError like any other malformed document.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from primus_perf.base.errors import UserError

TEMP_SUFFIX = ".tmp"
ORPHAN_AGE_S = 3600.0  # a temporary file of another host untouched this long belongs to a killed writer
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_WRITER = re.compile(r"\.([0-9a-f]{8})-(\d+)\.[^.]*\.tmp$")
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


def _temp(path: Path) -> tuple[int, str]:
    """A new temporary file next to ``path``, named after this host and process."""
    return tempfile.mkstemp(dir=path.parent, prefix=f"{temp_prefix(path)}{_HOST}-{os.getpid()}.", suffix=TEMP_SUFFIX)


def _writer_gone(tmp: Path, older_than_s: float, now: float) -> bool:
    m = _WRITER.search(tmp.name)
    if m and m.group(1) == _HOST:  # a process of this host: gone when it no longer runs
        try:
            os.kill(int(m.group(2)), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, OverflowError):  # another user's live process; a bad number
            return False
        return False
    return now - tmp.stat().st_mtime > older_than_s


def remove_orphaned_temps(path: str | os.PathLike, *, older_than_s: float = ORPHAN_AGE_S) -> list[Path]:
    """Remove temporary files of ``path`` (this module's name pattern) whose writer is gone:
    a process of this host that no longer runs, or (another host's, or an unnamed writer's)
    a file untouched for ``older_than_s``. A writer holding the lock that serializes the
    writers of ``path`` may pass a short age: a live writer's temporary file is younger."""
    p = Path(path)
    removed = []
    now = time.time()
    with contextlib.suppress(OSError):
        for tmp in p.parent.glob(temp_prefix(p) + "*" + TEMP_SUFFIX):
            with contextlib.suppress(OSError):
                if tmp.is_file() and _writer_gone(tmp, older_than_s, now):
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
        remove_orphaned_temps(p)
        fd, tmp = _temp(p)
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
            remove_orphaned_temps(self.path)
            fd, tmp = _temp(self.path)
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


def read_input(
    path: str | os.PathLike,
    *,
    what: str = "file",
    max_bytes: int | None = None,
    starts_with: Sequence[bytes] | None = None,
    expected: str = "",
    text: bool = False,
    head_only: bool = False,
) -> bytes:
    """The bytes of ``path`` if it is a regular, non-empty, readable file, else one
    UserError naming it (``head_only``: its first 64 KiB, the check alone).

    ``max_bytes``: refuse larger files. ``starts_with``: the first non-blank bytes must
    begin with one of these (e.g. ``b"{"`` or the gzip magic; ``expected`` names the format
    in the message). ``text``: the first 64 KiB must be UTF-8 without NUL bytes. Never
    blocks: the file is opened non-blocking and checked on its descriptor, so a FIFO or a
    device (also behind a symlink, also swapped in after a ``stat``) is refused unread."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UserError(f"{what} not found: {p}") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {p}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        name = next((name for test, name in _KIND_NAMES if test(st.st_mode)), "a special file")
        raise UserError(f"{what} {p} is {name}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_size == 0:
            raise UserError(f"{what} {p} is empty (0 bytes)")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UserError(f"{what} {p} is {st.st_size / 2**20:.1f} MiB, more than the {max_bytes / 2**20:.0f} MiB"
                            f" a {what} can be")
        try:
            head = f.read(65536)
            rest = b"" if head_only else f.read()
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
    return head + rest


def check_input_file(path: str | os.PathLike, **checks: Any) -> Path:
    """``path`` after :func:`read_input`'s check (for a reader that opens it itself)."""
    read_input(path, head_only=True, **checks)
    return Path(path)


def load_json(raw: bytes | str) -> Any:
    """``json.loads``; a document nested too deep for the parser is a ValueError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


MAX_YAML_NODES = 1_000_000


def load_yaml(text: str, max_nodes: int = MAX_YAML_NODES) -> Any:
    """``yaml.safe_load`` of a document whose aliases expand to at most ``max_nodes`` nodes
    (a "billion laughs" document is refused before it is built); ValueError for a document
    that is not YAML, nested too deep, recursive, or that bomb."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes: dict[int, int] = {}
        open_: set[int] = set()
        stack: list[tuple[Any, bool]] = [(node, False)]
        while stack:
            n, done = stack.pop()
            if id(n) in sizes:
                continue
            kids = [x for pair in n.value for x in pair] if isinstance(n, yaml.MappingNode) else \
                n.value if isinstance(n, yaml.SequenceNode) else []
            if done:
                sizes[id(n)] = 1 + sum(sizes[id(k)] for k in kids)
                open_.discard(id(n))
                if sizes[id(n)] > max_nodes:
                    raise ValueError(f"its aliases expand to more than {max_nodes:,} values (a YAML bomb?)")
                continue
            if any(id(k) in open_ for k in kids):
                raise ValueError("a recursive alias (a value that contains itself)")
            open_.add(id(n))
            stack.append((n, True))
            stack.extend((k, False) for k in kids if id(k) not in sizes)
        return loader.construct_document(node)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except yaml.YAMLError as exc:
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    finally:
        loader.dispose()
