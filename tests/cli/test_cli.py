from __future__ import annotations

import subprocess
import sys

import pytest

from inprocess import completed

COMMANDS = {
    "train": [[]],
    "profile": [["run"], ["analyze"], ["shapes"], ["report"], ["compare"], ["bench"], ["gate"]],
    "tune": [["gemm"], ["attention"], ["cache"], ["cache", "show"]],
}


@pytest.mark.parametrize(
    "app,args",
    [(m, a) for m, arglists in COMMANDS.items() for a in arglists],
)
def test_help_works_for_every_command(app: str, args: list[str]) -> None:
    """In this process, as the console script runs it (``python -m`` itself: the version test)."""
    result = completed([app, *args, "--help"])
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_kineto_marks_are_dropped_and_the_rest_of_stderr_kept(tmp_path) -> None:
    """A profiled window prints no ``USDT:... profiler_start`` line; what else goes to stderr
    while the profiler starts and stops (C-level writes included) still comes out, in order."""
    from primus_perf.profiler.kineto_marks import without_marks

    mark = b"USDT:2026-11-25 14:14:10 16009:16009 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    assert without_marks(b"a\n" + mark + b"b\n" + mark.rstrip(b"\n")) == b"a\nb\n"
    code = f"""
import os, torch
from primus_perf.profiler.capture import profile_window
from primus_perf.profiler.kineto_marks import kineto_marks_dropped
with profile_window({str(tmp_path / "t.json.gz")!r}, active=1, warmup=0) as w:
    for _ in range(w.steps):
        torch.ones(4) @ torch.ones(4)
        w.step()
with kineto_marks_dropped():
    os.write(2, b"kept before\\n")
    os.write(2, {mark!r})
    os.write(2, b"kept after\\n")
print("trace", w.trace is not None)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "trace True" in res.stdout
    assert "USDT:" not in res.stderr, res.stderr
    assert "kept before\nkept after\n" in res.stderr


def test_profiled_commands_print_no_kineto_marks(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "run", "--config", "tiny", "--steps", "1",
                          "--wait", "0", "--baseline", "0", "--after", "0", "model.n_layers=1", "train.seq_len=32",
                          "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "USDT" not in res.stderr and "profiler_start" not in res.stderr, res.stderr
    # the CPU run's trace: no empty GPU tables, the problems with their CPU times
    res = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "analyze", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "GPU time by category" not in res.stdout and "hotspots" not in res.stdout
    assert "no GPU events: the GPU time and hotspot tables are left out" in res.stdout
    assert "GEMM problems" in res.stdout


def test_own_html_pages_in_a_glob_are_skipped_with_a_note(tmp_path) -> None:
    from pathlib import Path

    trace = Path(__file__).parents[1] / "data" / "traces" / "h100_llama3-8b_l2_s1024_cudnn.json.gz"
    page = tmp_path / "report.html"
    res = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "report", str(trace), "-o", str(page)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    other = tmp_path / "other.html"
    other.write_text("<!DOCTYPE html><html><body>not ours</body></html>")
    res = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "analyze", str(trace), str(page)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"skipped {page}: a primus-perf file, not a trace" in res.stderr
    res = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "analyze", str(trace), str(other)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "is not JSON (an object or array) or gzip" in res.stderr  # another HTML file is still an error


def test_enable_without_a_cache_names_the_flag_and_the_variable(tmp_path) -> None:
    import os

    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    env = {k: v for k, v in os.environ.items() if k != "PRIMUS_PERF_CACHE"}
    res = subprocess.run([sys.executable, "-m", "primus_perf.launch", "--", str(script)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 2 and "ran" not in res.stdout
    assert res.stderr.strip().splitlines() == [
        "error: no tuning cache: pass --cache PATH or set PRIMUS_PERF_CACHE (enable(cache=PATH) in Python)"]


@pytest.mark.parametrize("argv", [["primus_perf.cli.train"], ["primus_perf.cli.profile", "analyze"],
                                  ["primus_perf.cli.tune", "cache", "show"], ["primus_perf.launch"],
                                  ["primus_perf.launch", "--cache", "c.json"]])
def test_every_command_prints_its_version_and_the_launcher_its_help(argv: list[str]) -> None:
    from pathlib import Path

    import tomllib

    from primus_perf import __version__

    assert __version__ == tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
    r = subprocess.run([sys.executable, "-m", *argv, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"primus-perf {__version__} (torch "), r.stdout + r.stderr
    if argv[0] == "primus_perf.launch":
        r = subprocess.run([sys.executable, "-m", *argv, "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "-- script.py args" in r.stdout, r.stderr
        r = subprocess.run([sys.executable, "-m", *argv, "--bogus", "--", "x.py"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and r.stderr.strip().startswith("error: unrecognized arguments: --bogus"), r.stderr


def test_the_resolved_config_prints_as_yaml_and_o_is_the_output_everywhere() -> None:
    import typer.main
    import yaml

    from primus_perf.cli import profile, train, tune

    r = completed(["train", "--config", "tiny", "--layers", "1", "train.seq_len=64", "--print-config"])
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["model"]["n_layers"] == 1 and cfg["train"]["seq_len"] == 64 and "tok/s" not in r.stdout
    # -o is the command's output (a file, or a folder) wherever it exists, spelled --output
    found = []

    def walk(cmd) -> None:
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)
        for param in getattr(cmd, "params", []):
            if "-o" in param.opts:
                found.append((cmd.name, param.opts))

    for app in (profile.app, tune.app, train.app):
        walk(typer.main.get_command(app))
    assert len(found) >= 8 and all("--output" in opts for _, opts in found), found


def test_every_numeric_option_has_a_lower_bound_and_a_choice_is_checked() -> None:
    """--budget-s -1 and --blocks 0 were accepted: each number an option takes is bounded
    where it is parsed (those checked in their command's body are named here)."""
    import typer.main

    from primus_perf.cli import profile, train, tune

    checked_in_body = {("gate", "--alpha"), ("preflight", "--threshold")}
    unbounded = []

    def walk(cmd) -> None:
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)
        for p in getattr(cmd, "params", []):
            ann = getattr(getattr(p, "type_descriptor", None), "annotation", None)
            numeric = ann in (int, float) or str(ann) in ("typing.Optional[int]", "typing.Optional[float]")
            if numeric and getattr(p, "min", None) is None and (cmd.name, p.opts[0]) not in checked_in_body:
                unbounded.append((cmd.name, p.opts))

    for app in (profile.app, tune.app, train.app):
        walk(typer.main.get_command(app))
    assert not unbounded
    r = completed(["tune", "attention", "--strategy", "magic", "--problem", "1,2,2,64,16,causal", "--dry-run"])
    assert r.returncode == 2 and "--strategy must be one of grid, tpe, got 'magic'" in r.stderr
