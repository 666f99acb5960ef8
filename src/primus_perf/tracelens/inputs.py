"""Which files to analyze: trace files and run folders in, trace files and a manifest out.

A run folder written by ``primus-profile run`` holds ``manifest.json`` whose ``traces``
field maps each traced rank to its trace file; those files are read, and nothing else in
the folder (a listed file that is missing is an error, except in a run stopped by Ctrl-C,
whose ranks may stop before writing theirs: a note). A folder without a manifest (or
whose manifest lists no traces) gives its ``*.json`` and ``*.json.gz`` files. Files named on the command line are read as given,
except primus-perf's own documents (a manifest, a report's or an analysis's JSON, a
samples or problems file: JSON that starts with a ``"schema": "primus-perf-...`` key), which
are skipped with a note, so that ``report runs/base/*.json`` works.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.errors import TraceError

MANIFEST = "manifest.json"
TRACE_SUFFIXES = (".json", ".json.gz")
_OWN_DOCUMENT = re.compile(rb'^\s*\{\s*"schema"\s*:\s*"primus-perf-')
_SNIFF_BYTES = 256


@dataclass
class Inputs:
    """The trace files to analyze, the run manifest next to them, and what was skipped."""

    traces: list[Path]
    manifest: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _head(path: Path) -> bytes:
    """The first bytes of a file, uncompressed when it is gzip; empty when unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
            if head[:2] != b"\x1f\x8b":
                return head
        with gzip.open(path, "rb") as g:
            return g.read(_SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):
        return b""  # the loader reports what is wrong with it


def is_own_document(path: Path) -> bool:
    """A file primus-perf wrote that is not a trace (manifest, report, samples, ...)."""
    return path.name == MANIFEST or bool(_OWN_DOCUMENT.match(_head(path)))


def read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's ``manifest.json`` ({} when absent or unreadable)."""
    m = folder / MANIFEST
    if not m.is_file():
        return {}
    try:
        data = json.loads(m.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def manifest_traces(manifest: dict[str, Any]) -> list[str]:
    """File names of the traces a manifest lists (``traces``: rank -> file name)."""
    traces = manifest.get("traces")
    if not isinstance(traces, dict):
        return []
    return [str(name) for _, name in sorted(traces.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0)]


def _folder(folder: Path, notes: list[str]) -> tuple[list[Path], dict[str, Any]]:
    manifest = read_manifest(folder)
    listed = manifest_traces(manifest)
    if listed:
        files = [folder / name for name in listed]
        missing = [f.name for f in files if not f.is_file()]
        if missing and manifest.get("interrupted") and len(missing) < len(files):
            # stopped by Ctrl-C under torchrun: some ranks stopped before writing theirs
            notes.append(f"{folder}: an interrupted run; trace(s) not written before the stop:"
                         f" {', '.join(missing)}")
            files = [f for f in files if f.is_file()]
        elif missing:
            raise TraceError(f"{folder / MANIFEST} lists trace(s) that are missing: {', '.join(missing)}")
        others = [f for f in folder.iterdir() if f.name.endswith(TRACE_SUFFIXES) and f not in files
                  and f.name != MANIFEST]
        if others:
            notes.append(f"{folder}: read the {len(files)} trace(s) {MANIFEST} lists; "
                         f"{len(others)} other JSON file(s) ignored")
        return files, manifest
    files = []
    for f in sorted(folder.iterdir()):
        if not (f.is_file() and f.name.endswith(TRACE_SUFFIXES)):
            continue
        if is_own_document(f):
            if f.name != MANIFEST:
                notes.append(f"skipped {f}: a primus-perf file, not a trace")
            continue
        files.append(f)
    if not files:
        raise TraceError(f"no trace files (*.json, *.json.gz) in {folder}")
    return files, manifest


def discover(paths: Sequence[str | Path] | str | Path) -> Inputs:
    """Trace files of files and run folders (see the module docstring)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    traces: list[Path] = []
    manifest: dict[str, Any] = {}
    notes: list[str] = []
    for p in map(Path, paths):
        if p.is_dir():
            files, m = _folder(p, notes)
            traces += files
            manifest = manifest or m
        elif not p.exists():
            raise TraceError(f"trace not found: {p}")
        elif is_own_document(p):
            notes.append(f"skipped {p}: a primus-perf file, not a trace")
        else:
            traces.append(p)
            manifest = manifest or read_manifest(p.parent)
    if not traces:
        raise TraceError(f"no trace among {', '.join(map(str, paths))}" if paths else "no trace given")
    return Inputs(traces=list(dict.fromkeys(traces)), manifest=manifest, notes=notes)
