"""Every command's output read from a file, as a Slurm job or a CI log has it: no number or
name cut or wrapped, in tables and in help texts, also with CI=true GITHUB_ACTIONS=true.

One Python process runs every command (stdout redirected to one file per command, as a
shell's ``> file`` does), so the whole check costs one start-up; the JSON each command can
write is the reference its printed numbers and names are checked against."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "tests" / "data" / "traces"
CUDNN = TRACES / "h100_llama3-8b_l2_s1024_cudnn.json.gz"
FLASH = TRACES / "h100_llama3-8b_l2_s1024_flash.json.gz"
GATE = ROOT / "benchmarks" / "results" / "gate" / "h100"
CACHE = ROOT / "benchmarks" / "results" / "closed_loop" / "h100" / "tuning_cache.json"

# Runs each command as its console script would (run_app: help layout, errors), with its
# stdout (fd 1 and sys.stdout) going to OUT/<name>.txt and its stderr to OUT/<name>.err.
DRIVER = r'''
import json, os, sys
from pathlib import Path
out = Path(sys.argv[1])
commands = json.loads(Path(sys.argv[2]).read_text())
from primus_perf.cli import profile, tune
from primus_perf.cli.common import run_app
apps = {"primus-profile": profile.app, "primus-tune": tune.app}

def cpu_tuning(kind):
    from primus_perf.cli.tune_run import run_tuning
    from primus_perf.problems import AttentionProblem, GemmProblem
    if kind == "gemm":
        from primus_perf.tuner.gemm.plugin import GemmTuner
        probs = [GemmProblem.from_row_major(64, 96, 32, b_transposed=True), GemmProblem.from_row_major(96, 64, 32)]
        run_tuning(probs, lambda: GemmTuner(library=None, device="cpu"), str(out / "cpu_gemm.json"), budget_s=0.05)
    else:
        from primus_perf.cli.tune_attention import render
        from primus_perf.tuner.attention.plugin import AttentionTuner
        run_tuning([AttentionProblem(1, 2, 1, 64, 64, 16, "f16", True)],
                   lambda: AttentionTuner(strategy=None, device="cpu"), str(out / "cpu_attn.json"),
                   budget_s=0.05,
                   on_done=lambda r: r.cached or render(r))

for name, argv in commands.items():
    sys.stdout.flush(); sys.stderr.flush()
    fds = os.dup(1), os.dup(2)
    with open(out / f"{name}.txt", "w") as so, open(out / f"{name}.err", "w") as se:
        os.dup2(so.fileno(), 1); os.dup2(se.fileno(), 2)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        try:
            if argv[0] == "cpu-tuning":
                cpu_tuning(argv[1]); code = 0
            else:
                try:
                    run_app(apps[argv[0]], argv[1:])
                except SystemExit as exc:
                    code = exc.code
        except BaseException as exc:
            print(f"crashed: {exc!r}", file=sys.stderr); code = 99
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(fds[0], 1); os.dup2(fds[1], 2)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    (out / f"{name}.code").write_text(str(code))
'''


def _help_commands() -> dict[str, list[str]]:
    """Every command and group of both apps, each with --help."""
    import typer.main

    from primus_perf.cli import profile, tune

    found: dict[str, list[str]] = {}

    def walk(prog: str, cmd, path: list[str]) -> None:
        found["help " + " ".join([prog, *path])] = [prog, *path, "--help"]
        for sub_name, sub in getattr(cmd, "commands", {}).items():
            walk(prog, sub, [*path, sub_name])

    walk("primus-profile", typer.main.get_command(profile.app), [])
    walk("primus-tune", typer.main.get_command(tune.app), [])
    return found


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("logs")
    problems = out / "problems.json"
    problems.write_text(json.dumps({"problems": [
        {"M": 8944, "N": 1024, "K": 1024, "b_transposed": True},
        {"kind": "attention", "problem": {"batch": 1, "heads_q": 32, "heads_kv": 8, "seq_q": 4096, "seq_kv": 4096,
                                          "head_dim": 128, "dtype": "bf16", "causal": True}},
        {"kind": "grouped_gemm", "problem": {"groups": 8, "k": 2048, "n": 1408, "tokens": 8192, "skew": 1.5,
                                             "dtype": "bf16", "trans_w": True, "phase": "fwd"}}]}))
    commands = {
        "analyze": ["primus-profile", "analyze", str(CUDNN), "--top", "30", "--json", str(out / "analyze.json")],
        "compare": ["primus-profile", "compare", str(CUDNN), str(FLASH), "--top", "40", "--json", str(out / "compare.json")],
        "gate": ["primus-profile", "gate", "--baseline", str(GATE / "baseline.json"), "--candidate",
                 str(GATE / "candidate_recompute.json"), "--allow-mismatch", "--json", str(out / "gate.json")],
        "bench": ["primus-profile", "bench", "--config", "tiny", "--repeat", "2", "--warmup", "0", "--profile-steps",
                  "0", "model.n_layers=1", "train.seq_len=64", "-o", str(out / "samples.json")],
        "report": ["primus-profile", "report", str(CUDNN), "-o", str(out / "report.html")],
        "cache show": ["primus-tune", "cache", "show", str(CACHE), "--keys"],
        "cache merge": ["primus-tune", "cache", "merge", str(out / "merged.json"), str(CACHE)],
        "cache export": ["primus-tune", "cache", "export", str(CACHE), "--format", "tunableop", "--torch-version",
                         "2.14.0", "--out", str(out / "tunableop.csv")],
        "gemm dry-run": ["primus-tune", "gemm", "--offline", "--from-trace", str(CUDNN), "--problems", str(problems),
                         "--dry-run"],
        "attention dry-run": ["primus-tune", "attention", "--problems", str(problems), "--dry-run"],
        "grouped dry-run": ["primus-tune", "grouped-gemm", "--problems", str(problems), "--dry-run"],
        "gemm cpu tuning": ["cpu-tuning", "gemm"],
        "attention cpu tuning": ["cpu-tuning", "attention"],
        **_help_commands(),
    }
    (out / "commands.json").write_text(json.dumps(commands))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH", "FORCE_COLOR")}
    env.update(CI="true", GITHUB_ACTIONS="true", PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, "-c", DRIVER, str(out), str(out / "commands.json")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def _text(logs: Path, name: str) -> str:
    code = (logs / f"{name}.code").read_text()
    assert code in ("0", "None", "1"), f"{name} exited {code}: {(logs / f'{name}.err').read_text()[-2000:]}"
    return (logs / f"{name}.txt").read_text()


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header cells, body rows) of each box table in the text; asserts the header is one line."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].lstrip().startswith("┏"):
            j = i + 1
            header = []
            while not lines[j].lstrip().startswith("┡"):
                header.append(lines[j])
                j += 1
            assert len(header) == 1, "a table header wrapped:\n" + "\n".join(lines[i:j + 1])
            rows = []
            j += 1
            while not lines[j].lstrip().startswith("└"):
                rows.append([c.strip() for c in lines[j].strip().strip("│").split("│")])
                j += 1
            out.append(([c.strip() for c in header[0].strip().strip("┃").split("┃")], rows))
            i = j
        i += 1
    return out


def check_whole(text: str) -> None:
    """Nothing cut and no cell wrapped: no ellipsis; each table row has the header's cells and
    its first cell filled (a wrapped row's second line has an empty first cell)."""
    assert "…" not in text, next(line for line in text.splitlines() if "…" in line)
    for header, rows in tables(text):
        for row in rows:
            assert len(row) == len(header), (header, row)
            assert row[0], f"a wrapped row under {header}: {row}"


COMMANDS = ["analyze", "compare", "gate", "bench", "report", "cache show", "cache merge", "cache export",
            "gemm dry-run", "attention dry-run", "grouped dry-run", "gemm cpu tuning", "attention cpu tuning"]


@pytest.mark.parametrize("name", COMMANDS)
def test_nothing_is_cut_or_wrapped(logs: Path, name: str) -> None:
    text = _text(logs, name)
    assert text.strip(), f"{name} printed nothing"
    check_whole(text)


def test_analyze_prints_every_name_and_number_whole(logs: Path) -> None:
    text = _text(logs, "analyze")
    data = json.loads((logs / "analyze.json").read_text())
    cells = {c for _, rows in tables(text) for row in rows for c in row}
    for row in data["gemm_problems"][:30] + data["attention_problems"][:30]:
        assert row["label"] in cells, row["label"]
        assert f"{row['time_s'] * 1e3:.3f}" in cells
    for row in data["hotspots"][:30]:
        assert row["op"] in cells and row["shape"] in cells, row
    ops = [row["op"] for row in data["cpu_ops"][:30]]
    assert any(len(op) > 60 for op in ops) and set(ops) <= cells  # op names whole, past 60 characters too


def test_compare_prints_every_shape_whole(logs: Path) -> None:
    text = _text(logs, "compare")
    data = json.loads((logs / "compare.json").read_text())
    cells = {c for _, rows in tables(text) for row in rows for c in row}
    for r in sorted(data["ops"], key=lambda r: -abs(r["delta_ms"]))[:40]:
        assert r["shape"] in cells and f"{r['delta_ms']:+.3f}" in cells, r


def test_gate_prints_medians_in_ms_and_every_verdict_whole(logs: Path) -> None:
    text = _text(logs, "gate")
    data = json.loads((logs / "gate.json").read_text())
    (_header, rows), = tables(text)
    by_metric = {row[0]: row for row in rows}
    for v in data["verdicts"]:
        row = by_metric[v["metric"]]
        assert row[2] == f"{v['baseline_median'] * 1e3:.3f} ms" and row[3] == f"{v['candidate_median'] * 1e3:.3f} ms"
        assert row[-1] == ("REGRESSION" if v["regression"] else "improved" if v["improvement"] else "ok")
    assert "overridess" not in text + (logs / "gate.err").read_text()


def test_cache_show_prints_every_label_and_key_whole(logs: Path) -> None:
    from primus_perf.cache.store import CacheEntry

    text = _text(logs, "cache show")
    entries = [CacheEntry.from_dict(e) for e in json.loads(CACHE.read_text())["entries"]]
    (_header, rows), = tables(text)
    assert [(r[1], r[2]) for r in rows] == [(e.label(), e.problem_key) for e in entries]


def test_dry_run_labels_are_the_problems_labels(logs: Path) -> None:
    from primus_perf.problems import GemmProblem

    lines = [line for line in _text(logs, "gemm dry-run").splitlines() if "  gemm:" in line]
    assert lines
    for line in lines:
        label, key = line.split("  ")
        assert GemmProblem.from_spec(label).row_major_shapes()[:3] == tuple(int(x) for x in label.split()[0].split("x"))
        assert key.startswith("gemm:"), line


def test_bench_shows_progress_in_a_log(logs: Path) -> None:
    err = (logs / "bench.err").read_text()
    assert "bench: step 2 of 2" in err, err


def test_help_of_every_command_is_whole(logs: Path) -> None:
    import typer.main

    from primus_perf.cli import profile, tune

    helps = [n for n in json.loads((logs / "commands.json").read_text()) if n.startswith("help ")]
    assert len(helps) >= 15
    roots = {"primus-profile": typer.main.get_command(profile.app), "primus-tune": typer.main.get_command(tune.app)}
    for name in helps:
        text = _text(logs, name)
        assert "Usage:" in text and "…" not in text, name
        assert not re.search(r"[╭│╰]", text), f"{name}: rich boxes in a log"
        prog, *path = name.split()[1:]
        cmd = roots[prog]
        for part in path:
            cmd = cmd.commands[part]
        for param in cmd.params:
            for opt in param.opts + param.secondary_opts:
                if opt.startswith("-"):
                    assert re.search(rf"(^|[\s,/]){re.escape(opt)}([\s,/=]|$)", text, re.M), (name, opt)


def test_columns_never_cuts_a_table_or_a_line(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "60", "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-m", "primus_perf.cli.tune", "cache", "show", str(CACHE)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    check_whole(res.stdout)
    widths = {len(line) for line in res.stdout.splitlines() if line.startswith(("┃", "│"))}
    assert min(widths) > 60  # the table is as wide as its content, not cut to COLUMNS
    assert any(len(line) > 60 and not line.startswith(("┃", "│")) for line in res.stdout.splitlines())


def test_report_counts_problems_as_the_tuners_do(logs: Path) -> None:
    """Problems are unique keys in every command (a problem's fwd and bwd rows are one
    problem, as shapes and the tuners count it)."""
    data = json.loads((logs / "analyze.json").read_text())
    gemm, attention = ({r["key"] for r in data[k]} for k in ("gemm_problems", "attention_problems"))
    line = _text(logs, "report").strip().splitlines()[-1]
    assert f"{len(gemm)} GEMM and {len(attention)} attention problems" in line, line
    assert len(data["attention_problems"]) > len(attention)  # the case that told them apart
