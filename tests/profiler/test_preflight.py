"""Preflight on the CPU: the verdict logic with injected figures (a slow GPU and a slow
link flagged, exit code 1; a healthy job exit code 0), the CPU-only path (host checks,
GPU checks skipped, exit 0), and a 2-rank torchrun job over gloo (collectives and P2P)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from primus_perf.cli.profile import app
from primus_perf.profiler.preflight import Measurement, PreflightReport, evaluate, run
from primus_perf.profiler.preflight.checks import format_value
from primus_perf.profiler.preflight.comm import link_pairs
from trainer_runs import _free_port


def _gpus(tflops: list[float], peak: float = 989.4) -> list[Measurement]:
    return [Measurement("gpu", "bf16 GEMM 8192", f"gpu {i}", v, "TFLOP/s", 0.6 * peak, "60% of peak", peers=True)
            for i, v in enumerate(tflops)]


def _links(gb_s: dict[tuple[int, int], float]) -> list[Measurement]:
    return [Measurement("p2p", "intra-node send/recv 256 MiB", f"link {s}->{d}", v, "GB/s", 0.6 * 450, peers=True,
                        peer_key="intra-node") for (s, d), v in gb_s.items()]


HEALTHY_LINKS = {(s, d): 380.0 + s + d for s in range(4) for d in range(4) if s != d}


def _status(checks, subject: str) -> str:
    return next(c.status for c in checks if c.measurement.subject == subject)


def test_one_slow_gpu_and_one_slow_link_are_flagged() -> None:
    links = dict(HEALTHY_LINKS)
    links[(2, 3)] = 300.0  # above the datasheet floor (270), 79% of its peers
    checks = evaluate(_gpus([790, 800, 640, 805]) + _links(links))
    report = PreflightReport(checks, 0.9)
    flagged = {c.measurement.subject: c for c in report.failed}
    assert set(flagged) == {"gpu 2", "link 2->3"}
    assert flagged["gpu 2"].status == "slow" and "81% of the median" in flagged["gpu 2"].reason
    assert flagged["gpu 2"].peer_median == pytest.approx(795)
    assert report.exit_code == 1
    assert json.loads(json.dumps(report.to_dict()))["exit_code"] == 1
    # a lower threshold lets both through
    assert PreflightReport(evaluate(_gpus([790, 800, 640, 805]) + _links(links), 0.75), 0.75).exit_code == 0


def test_healthy_job_passes_and_a_bound_fails_alone() -> None:
    report = PreflightReport(evaluate(_gpus([790, 800, 795, 805]) + _links(HEALTHY_LINKS)), 0.9)
    assert report.exit_code == 0 and {c.status for c in report.checks} == {"ok"}
    # every GPU equally slow: no outlier among peers, but all below the datasheet floor
    checks = evaluate(_gpus([500, 505, 498, 502]))
    assert {c.status for c in checks} == {"fail"} and "below expected" in checks[0].reason
    # a ceiling: uncorrected ECC errors must be 0; telemetry not measured is skipped, not failed
    ecc = Measurement("telemetry", "uncorrected ECC errors (volatile)", "gpu 0", 3.0, "", 0.0, "none",
                      higher_is_better=False)
    missing = Measurement("telemetry", "power", "gpu 0", None, "W", reason="pynvml is not installed")
    checks = evaluate([ecc, missing])
    assert [c.status for c in checks] == ["fail", "skipped"] and checks[1].reason == "pynvml is not installed"
    assert format_value(1234.5, "GB/s") == "1,234 GB/s" and format_value(0.0257, "GB/s") == "0.0257 GB/s"
    assert format_value(None) == "-" and format_value(21.94, "GiB") == "21.9 GiB"


def test_cpu_only_run_reports_host_checks_and_skips_gpus(tmp_path: Path) -> None:
    out, page = tmp_path / "preflight.json", tmp_path / "preflight.html"
    result = CliRunner().invoke(app, ["preflight", "--json", str(out), "-o", str(page), "--disk", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {c["group"] for c in data["checks"]} == {"host"}
    assert {c["name"] for c in data["checks"]} >= {"free disk", "available memory"}
    assert any("GPU checks skipped" in s for s in data["skipped"]) and "GPU checks skipped" in result.output
    assert data["facts"]["per_rank"][0]["host"]["cpus"] == os.cpu_count()
    html = page.read_text()
    assert '"kind": "preflight"' in html or '"kind":"preflight"' in html
    assert "preflightPage" in html


def test_cli_exit_code_1_with_an_injected_slow_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run, "measure_gpus", lambda job, sizes: _gpus([790, 800, 640, 805]))
    monkeypatch.setattr(run, "measure_links", lambda job, sizes: _links(HEALTHY_LINKS))
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["preflight", "--json", str(out), "--disk", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "preflight failed" in result.output and "slow" in result.output
    data = json.loads(out.read_text())
    assert [c["subject"] for c in data["checks"] if c["status"] == "slow"] == ["gpu 2"]
    result = CliRunner().invoke(app, ["preflight", "--threshold", "1.5"])
    assert result.exit_code != 0 and "--threshold" in str(result.exception or result.output)


def test_link_pairs_cover_each_node_and_the_next_node() -> None:
    assert link_pairs([0, 0]) == [(0, 1), (1, 0)]
    pairs = link_pairs([0, 0, 1, 1])
    assert (0, 1) in pairs and (2, 3) in pairs and (0, 2) not in [(s, d) for s, d in pairs[:4]]
    assert pairs[-4:] == [(0, 2), (1, 3), (2, 0), (3, 1)]  # each rank to its counterpart one node on


def test_two_ranks_under_torchrun_measure_collectives_and_links(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "-m", "primus_perf.cli.profile", "preflight", "--json", str(out),
           "--disk", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    data = json.loads(out.read_text())
    assert result.returncode == data["exit_code"], result.stderr[-2000:]  # CPU links are noisy: either verdict
    names = {c["name"] for c in data["checks"] if c["group"] == "collective"}
    assert names == {f"{op} {size}" for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
                     for size in ("64 KiB", "1 MiB")}
    assert all(c["value"] > 0 for c in data["checks"] if c["group"] in ("collective", "p2p"))
    assert sorted(c["subject"] for c in data["checks"] if c["group"] == "p2p") == ["link 0->1", "link 1->0"]
    assert data["facts"]["ranks"] == 2 and data["facts"]["nodes"] == 1
    assert [c["group"] for c in data["checks"]].count("host") == 3  # one node: host checked once


PUBLISH_LATE = """
import sys, time
from pathlib import Path
from primus_perf.profiler.preflight import run
from test_preflight import _links

run.measure_links = lambda job, sizes: _links({(0, 1): 380.0, (1, 0): 100.0}) if job.rank == 0 else []

def publish(report):
    time.sleep(3)  # a long report: the other rank must not have exited (torchrun would stop this one)
    Path(sys.argv[1]).write_text(str(report.exit_code))

report = run.preflight(disk_path=sys.argv[2], publish=publish)
sys.exit(report.exit_code)
"""


def test_every_rank_waits_for_rank_0_to_publish_a_failed_verdict(tmp_path: Path) -> None:
    """A failed check exits 1 on every rank, and torchrun stops the others at the first
    such exit: rank 0's report must be written before any rank returns."""
    script, written = tmp_path / "late.py", tmp_path / "published"
    script.write_text(PUBLISH_LATE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", str(script), str(written), str(tmp_path)]
    here = Path(__file__)  # the script imports this module, and it the helpers at the top of tests/
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(here.parent), str(here.parents[1]), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    assert written.read_text() == "1"


@pytest.mark.gpu
def test_preflight_on_this_gpu(tmp_path: Path) -> None:
    """Real figures of one GPU: GEMM and HBM above zero and judged against the datasheet
    when the device is in the peak table; telemetry read or skipped with its reason."""
    from primus_perf.profiler.preflight import preflight

    report = preflight(gemm_sizes=(4096,), disk_path=tmp_path)
    by_name = {c.measurement.name: c for c in report.checks if c.measurement.group == "gpu"}
    assert by_name["bf16 GEMM 4096"].measurement.value > 10
    assert by_name["HBM copy"].measurement.value > 100
    assert all(c.status != "skipped" or c.reason for c in report.checks)
    assert report.exit_code == (1 if report.failed else 0)


def test_free_disk_of_a_folder_not_made_yet_is_where_it_will_be(tmp_path: Path) -> None:
    from primus_perf.profiler.preflight.host import host_measurements

    later = tmp_path / "runs" / "x"
    (disk,) = [m for m in host_measurements("node0", later) if m.name == "free disk"]
    assert disk.value > 0 and f"in {tmp_path.resolve()} (to be made: {later.resolve()})" in disk.expected_note
    result = CliRunner().invoke(app, ["preflight", "--disk", "/nonexistent/x"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
