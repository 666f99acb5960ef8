"""Capture: ``primus-profile run`` and ``profile_steps`` write real traces and a manifest;
every rank under torchrun (gloo); bad input is one line with exit code 2."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from inprocess import completed
from primus_perf.base.errors import UserError
from primus_perf.profiler.capture import (
    Schedule,
    parse_ranks,
    prepare_out_dir,
    profile_steps,
    profile_window,
    trace_name,
)
from primus_perf.tracelens.analyze import analyze
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import gemm_flops_per_step
from trainer_runs import _run

SMALL = ["train.seq_len=64", "train.micro_batch=2"]


def _cli(args: list[str], nproc: int = 1, timeout: int = 240) -> subprocess.CompletedProcess:
    return _run(args, nproc, timeout, module="primus_perf.cli.profile")


def _events(path: Path) -> list[dict]:
    return json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]


def test_run_writes_a_trace_of_the_active_steps_and_a_manifest(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = _cli(["run", "--config", "tiny", "--out", str(out), "--steps", "2", "--warmup", "1", *SMALL])
    assert r.returncode == 0, r.stderr
    trace = out / trace_name(0)
    events = _events(trace)
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert len(steps) == 2
    shaped = [e for e in events if e.get("cat") == "cpu_op" and "Input Dims" in e.get("args", {})]
    assert shaped, "record_shapes must be on"
    m = json.loads((out / "manifest.json").read_text())
    for key in ("schema", "config", "device", "versions", "world_size", "traced_ranks", "traces", "steps",
                "step_time_s", "tokens_per_s", "overhead"):
        assert key in m, key
    assert [s["phase"] for s in m["steps"]] == ["baseline"] * 3 + ["wait"] * 2 + ["warmup", "active", "active"] + \
        ["after"] * 3
    assert all(s["time_s"] > 0 and "loss" in s and "tokens_per_expert" not in s for s in m["steps"])  # dense
    assert m["overhead"]["outside_window_vs_unprofiled"] > 0
    assert "profiler overhead" in r.stdout
    # the run directory is what the analyzer reads: manifest attached, FLOPs exact
    cfg = load_config("tiny", SMALL)
    a = analyze([out])
    assert a.manifest["config_name"] == "tiny" and a.steps and len(a.steps) == 2
    assert a.totals["gemm_flops_per_step"] == gemm_flops_per_step(cfg.model, 2, 64)


def test_profile_steps_api_profiles_any_step_function(tmp_path: Path) -> None:
    w = torch.randn(64, 64)

    def step() -> float:
        return float((torch.randn(32, 64) @ w).sum())

    res = profile_steps(step, tmp_path, Schedule(active=2, warmup=0, wait=1, baseline=1, after=1),
                        rank=3, step_info=lambda v: {"value": v})
    assert res.trace == tmp_path / "rank3.pt.trace.json.gz"
    names = {e.get("name") for e in _events(res.trace)}
    assert "aten::mm" in names
    assert [s["phase"] for s in res.steps] == ["baseline", "wait", "active", "active", "after"]
    assert all("value" in s for s in res.steps)
    # an untraced rank runs the same steps and writes nothing
    res2 = profile_steps(step, tmp_path / "other", Schedule(active=2, warmup=0, wait=1, baseline=1, after=1),
                         traced=False)
    assert res2.trace is None and len(res2.steps) == 5 and not list((tmp_path / "other").iterdir())


def _profiler_steps(trace: Path) -> list[str]:
    return sorted(e["name"] for e in _events(trace) if e.get("name", "").startswith("ProfilerStep#"))


def test_profile_window_inside_any_step_loop(tmp_path: Path) -> None:
    w = torch.randn(64, 64)
    with profile_window(tmp_path / "loop.json.gz", active=3, warmup=1) as window:
        for _ in range(window.steps):
            float((torch.randn(32, 64) @ w).sum())
            window.step()
    assert window.steps == 4 and window.trace == tmp_path / "loop.json.gz"
    assert len(_profiler_steps(window.trace)) == 3
    assert "aten::mm" in {e.get("name") for e in _events(window.trace)}
    # a loop that stops before the window ends keeps the active steps recorded so far
    with profile_window(tmp_path / "early.json.gz", active=5, warmup=1) as window:
        for _ in range(3):
            float((torch.randn(32, 64) @ w).sum())
            window.step()
    assert window.trace is not None
    assert sum(e.get("name") == "aten::mm" for e in _events(window.trace)) == 2
    with pytest.raises(UserError, match="at least 1 active step"), profile_window(tmp_path / "n.json.gz", active=0):
        pass


def test_ctrl_c_inside_the_profilers_step_waits_for_the_step_and_keeps_the_trace(tmp_path: Path) -> None:
    """Ctrl-C landing inside the profiler's own step (between closing one ProfilerStep
    and opening the next) once left it unable to stop: the process failed at exit."""
    w = torch.randn(64, 64)
    steps_done = []
    with pytest.raises(KeyboardInterrupt), \
            profile_window(tmp_path / "int.json.gz", active=4, warmup=1) as window:
        real_step = window._prof.step

        def step_hit_by_ctrl_c() -> None:
            if len(steps_done) == 2:
                os.kill(os.getpid(), signal.SIGINT)  # arrives while the profiler steps
            real_step()
            steps_done.append(1)

        window._prof.step = step_hit_by_ctrl_c
        for _ in range(window.steps):
            float((torch.randn(32, 64) @ w).sum())
            window.step()
    assert len(steps_done) == 3  # the interrupted step finished before the interrupt went on
    assert window.trace is not None and {"ProfilerStep#1", "ProfilerStep#2"} <= set(_profiler_steps(window.trace))


def test_ctrl_c_while_the_profiler_starts_stops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held while the profiler starts, the interrupt is raised once it has started: the
    window must still stop it, or the next profile in the process cannot start."""
    start = torch.profiler.profile.__enter__

    def start_hit_by_ctrl_c(self):
        os.kill(os.getpid(), signal.SIGINT)
        return start(self)

    monkeypatch.setattr(torch.profiler.profile, "__enter__", start_hit_by_ctrl_c)
    body_ran = []
    with pytest.raises(KeyboardInterrupt), profile_window(tmp_path / "a.json.gz", active=1, warmup=0):
        body_ran.append(1)
    assert not body_ran and not torch.autograd.profiler._is_profiler_enabled
    monkeypatch.undo()
    with profile_window(tmp_path / "b.json.gz", active=1, warmup=0) as window:
        float(torch.randn(8, 8).sum())
        window.step()
    assert window.trace is not None


def test_torchrun_two_ranks_trace_every_rank_or_the_chosen(tmp_path: Path) -> None:
    out = tmp_path / "all"
    r = _cli(["run", "--config", "tiny", "--out", str(out), "--steps", "1", "--wait", "0", "--baseline", "1",
              "--after", "1", *SMALL, "parallel.tp=2"], nproc=2)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.glob("*.gz")) == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["world_size"] == 2 and m["traced_ranks"] == [0, 1]
    a = analyze([out])
    assert a.ranks == [0, 1]
    # rank 0, untraced and with no step after the window, waits for rank 1's trace before
    # its manifest and its "wrote 1 trace(s)" (it once wrote them while rank 1 was exporting)
    out1 = tmp_path / "one"
    r = _cli(["run", "--config", "tiny", "--out", str(out1), "--steps", "1", "--wait", "0", "--baseline", "1",
              "--after", "0", "--ranks", "1", *SMALL, "parallel.tp=2"], nproc=2)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out1.glob("*.gz")] == ["rank1.pt.trace.json.gz"]
    trace_written = (out1 / trace_name(1)).stat().st_mtime_ns
    assert (out1 / "manifest.json").stat().st_mtime_ns >= trace_written


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for args, text in (
        (["run", "--config", "no-such-preset"], "no-such-preset"),
        (["run", "--config", "tiny", "--out", str(blocker / "sub")], "cannot write to --out"),
        (["run", "--config", "tiny", "--out", str(tmp_path / "o"), "--ranks", "0,x"], "--ranks"),
        (["run", "--config", "tiny", "--out", str(tmp_path / "o"), "--ranks", "5"], "ranks must be in 0..0"),
        (["run", "--config", "tiny", "--steps", "0"], "greater than or equal to 1"),
    ):
        r = completed(["profile", *args])  # refused before any work: in this process
        assert r.returncode == 2, (args, r.stderr)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and text in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_parse_ranks() -> None:
    assert parse_ranks(None, 4) == [0, 1, 2, 3]
    assert parse_ranks("3,0,3", 4) == [0, 3]
    assert parse_ranks("all", 2) == [0, 1]
    for bad in ("x", "4", "-1", ",", "0;1"):
        with pytest.raises(UserError):
            parse_ranks(bad, 4)


@pytest.mark.gpu
def test_run_on_the_gpu_records_kernels_and_exact_gemm_flops(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    r = _cli(["run", "--config", "tiny", "--out", str(out), "--steps", "2", "train.device=cuda", *SMALL])
    assert r.returncode == 0, r.stderr
    events = _events(out / trace_name(0))
    assert any(e.get("cat") == "kernel" for e in events)
    m = json.loads((out / "manifest.json").read_text())
    assert m["device"]["name"] and "cuda" in json.dumps(m["versions"]).lower()
    a = analyze([out])
    cfg = load_config("tiny", SMALL)
    assert a.totals["gemm_flops_per_step"] == gemm_flops_per_step(cfg.model, 2, 64)
    assert a.to_json()["breakdown"], "GPU time by category"
    assert len(a.gemm_problems) > 0


def test_another_ranks_write_probe_does_not_make_the_folder_taken(tmp_path: Path) -> None:
    """Under torchrun every rank probes --out while rank 0 checks that it is empty: a
    probe seen mid-way is no earlier run (it refused a fresh folder in CI)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".write-test.abc123").write_text("")
    prepare_out_dir(out, overwrite=False)
    (out / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        prepare_out_dir(out, overwrite=False)


def test_out_folder_with_a_run_is_refused_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    for name in (trace_name(0), "manifest.json", "notes.txt"):
        (out / name).write_text("x")
    with pytest.raises(UserError, match="is not empty .*--overwrite"):
        prepare_out_dir(out, overwrite=False)
    assert {p.name for p in out.iterdir()} == {trace_name(0), "manifest.json", "notes.txt"}
    prepare_out_dir(out, overwrite=True)  # the run's own files go, anything else stays
    assert {p.name for p in out.iterdir()} == {"notes.txt"}
    r = _cli(["run", "--config", "tiny", "--out", str(out), *SMALL])  # refused before training
    assert r.returncode == 2 and "--overwrite" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- your own script

SCRIPT = """
import sys, torch
import primus_perf
explicit, steps, code = sys.argv[1] == "explicit", int(sys.argv[2]), int(sys.argv[3])
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # steps too: not the first
for step in range(steps):
    for micro in range(2):  # gradient accumulation: with explicit marks, a micro-step is a step
        model(torch.randn(16, 32)).sum().backward()
        if explicit:
            primus_perf.profile_step()
    opt.step(); opt.zero_grad(); other.step()
print("done", steps)
sys.exit(code)
"""


@pytest.mark.parametrize("marks", ["optimizer", "explicit"])
def test_run_profiles_your_own_script_into_the_same_run_folder(tmp_path: Path, marks: str) -> None:
    """`primus-profile run -- script.py args`: its steps found from its first optimizer's
    step() (another optimizer does not count) or its primus_perf.profile_step() marks; the
    run folder of `run --config` (a trace of the active steps, a manifest with every step)
    that analyze reads."""
    script, out = tmp_path / "train.py", tmp_path / "run"
    script.write_text(SCRIPT)
    r = _cli(["run", "--out", str(out), "--steps", "2", "--baseline", "2", "--wait", "1", "--warmup", "1", "--after", "1",
              "--", str(script), marks, "8", "0"])
    assert r.returncode == 0, r.stderr
    assert "done 8" in r.stdout and "wrote 1 trace(s)" in r.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["phase"] for s in manifest["steps"]] == ["baseline"] * 2 + ["wait", "warmup", "active", "active", "after"]
    assert manifest["program"] == [str(script), marks, "8", "0"]
    assert manifest["step_marks"] == ("profile_step" if marks == "explicit" else "optimizer.step")
    steps = sorted(e["name"] for e in _events(out / trace_name(0)) if e.get("name", "").startswith("ProfilerStep#"))
    assert len(steps) == 2
    a = analyze([out])
    assert len(a.gemm_problems) > 0


def test_a_script_with_too_few_steps_or_a_failing_exit_is_said(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = _cli(["run", "--out", str(tmp_path / "a"), "--", str(script), "optimizer", "3", "0"])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "error: the program marked 3 steps (optimizer.step() calls), and the window needs 7 to record one"), r.stderr
    r = _cli(["run", "--out", str(tmp_path / "b"), "--steps", "1", "--baseline", "0", "--wait", "0", "--", str(script),
              "optimizer", "2", "3"])
    assert r.returncode == 3 and (tmp_path / "b" / "manifest.json").is_file(), r.stderr  # its exit code, after the folder
    r = _cli(["run", "--config", "tiny", "--out", str(tmp_path / "c"), "--", str(script)])
    assert r.returncode == 2 and "--config and --layers are the reference trainer's" in r.stderr
    r = _cli(["run", "--out", str(tmp_path / "d"), "--", str(tmp_path / "missing.py")])
    assert r.returncode == 2 and "is not a file" in r.stderr


SCRIPT_ALLREDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(40):
    loss = model(torch.randn(4, 16)).square().mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_a_script_under_torchrun_traced_on_one_rank_stops_on_every_rank(tmp_path: Path) -> None:
    # the untraced rank comes to the window's end too: it once went on alone (NCCL: rank 0 waited
    # ten minutes in the window's barrier, then aborted)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_ALLREDUCE)
    out = tmp_path / "run"
    r = _cli(["run", "--out", str(out), "--stop", "--ranks", "0", "--after", "0", "--baseline", "1", "--wait", "1",
              "--warmup", "1", "--steps", "2", "--", str(script)], nproc=2, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.name for p in out.glob("*.gz")] == [trace_name(0)]
    m = json.loads((out / "manifest.json").read_text())
    assert m["traced_ranks"] == [0] and sum(s["phase"] == "active" for s in m["steps"]) == 2
