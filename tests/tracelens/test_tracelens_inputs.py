"""Which files an analysis reads: the traces a run folder's manifest lists, the JSON files
of a folder without one, files as given; primus-perf's own documents skipped with a note."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from primus_perf.base.errors import TraceError
from primus_perf.tracelens.inputs import MANIFEST, discover

TRACES = Path(__file__).parents[1] / "data" / "traces"
RUN = TRACES / "h100_llama3-8b_l4_s4096_run"


def test_a_run_folder_reads_the_traces_its_manifest_lists(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    (run / "stray.json").write_text("{}")  # e.g. a trace of another run copied in
    got = discover([run])
    assert got.traces == [run / "rank0.pt.trace.json.gz"]
    assert got.manifest["config_name"] == "llama3-8b"
    assert any("1 other JSON file(s) ignored" in n for n in got.notes)
    (run / "rank0.pt.trace.json.gz").unlink()
    with pytest.raises(TraceError, match="lists trace.*missing: rank0.pt.trace.json.gz"):
        discover([run])


def test_an_interrupted_run_reads_the_traces_its_ranks_wrote(tmp_path: Path) -> None:
    """Ctrl-C under torchrun: rank 0 writes the manifest, another rank may stop before
    writing its trace; the ranks that wrote theirs are analyzed, the others named."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(TRACES / "h200_tp2" / "trace_rank0.json.gz", run / "rank0.pt.trace.json.gz")
    manifest = {"schema": "primus-perf-run/1", "world_size": 2, "traced_ranks": [0, 1], "interrupted": True,
                "traces": {"0": "rank0.pt.trace.json.gz", "1": "rank1.pt.trace.json.gz"}}
    (run / MANIFEST).write_text(json.dumps(manifest))
    got = discover([run])
    assert got.traces == [run / "rank0.pt.trace.json.gz"]
    assert got.notes == [f"{run}: an interrupted run; trace(s) not written before the stop: rank1.pt.trace.json.gz"]
    (run / MANIFEST).write_text(json.dumps({**manifest, "interrupted": False}))
    with pytest.raises(TraceError, match="missing: rank1.pt.trace.json.gz"):  # a finished run: an error
        discover([run])
    (run / "rank0.pt.trace.json.gz").unlink()
    (run / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="missing: rank0.pt.trace.json.gz, rank1.pt.trace.json.gz"):
        discover([run])


def test_a_folder_without_manifest_gives_its_json_files(tmp_path: Path) -> None:
    for name in ("rank1.json", "rank0.json.gz", "notes.txt"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "samples.json").write_text(json.dumps({"schema": "primus-perf-bench/1", "metrics": {}}))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rank2.json").write_text("{}")
    got = discover(tmp_path)
    assert [p.name for p in got.traces] == ["rank0.json.gz", "rank1.json"] and got.manifest == {}
    assert got.notes == [f"skipped {tmp_path / 'samples.json'}: a primus-perf file, not a trace"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no trace files"):
        discover(tmp_path / "empty")
    with pytest.raises(TraceError, match="not found"):
        discover(tmp_path / "nope")


def test_files_as_given_skip_the_manifest() -> None:
    got = discover(sorted(RUN.iterdir()))
    assert got.traces == [RUN / "rank0.pt.trace.json.gz"] and got.manifest["config_name"] == "llama3-8b"
    assert got.notes == [f"skipped {RUN / MANIFEST}: a primus-perf file, not a trace"]
    with pytest.raises(TraceError, match="no trace among"):
        discover([RUN / MANIFEST])


def test_report_of_a_run_folder_glob_works(tmp_path: Path) -> None:
    """``primus-profile report runs/base/*.json*`` names manifest.json too."""
    files = [str(p) for p in sorted(RUN.iterdir())]
    r = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "report", *files, "-o",
                        str(tmp_path / "r.html")], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r.html").is_file() and "tokens_per_s" in (tmp_path / "r.html").read_text()
