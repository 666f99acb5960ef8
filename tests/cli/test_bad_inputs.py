"""Bad input across every command and option family: one line, the expected exit code, no
traceback, no hang. The cases are a table generated from families x variants (odd files in
every file slot, bad config values in every command that loads a config, bad option values,
unwritable targets, corrupt caches, samples and problems files); each runs in-process through
the same ``run_app`` the console scripts use, under a timeout. Signals (Ctrl-C, SIGTERM) and a
full disk are tested below the table, in subprocesses and on a small tmpfs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from inprocess import run_cli
from primus_perf.base.devices import DeviceIdentity
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.gate.gate import SAMPLES_SCHEMA
from primus_perf.problems import AttentionProblem, GemmProblem

TRACE = Path(__file__).parents[1] / "data" / "traces" / "h100_cuda_graph.json.gz"
ON_CPU = not torch.cuda.is_available()


@dataclass(frozen=True)
class Case:
    """``argv``: app name then arguments, with ``{name}`` placeholders for the fixture paths."""

    family: str
    argv: tuple[str, ...]
    exit_code: int
    pattern: str  # regex the last stderr line (or, for exit 0, the output) must match

    @property
    def id(self) -> str:
        return f"{self.family}:{' '.join(self.argv[:4])}"[:90]


# --------------------------------------------------------------------------- families

ODD_FILES = {  # kind -> what the one line says (alternatives: each command words it its own way)
    "missing": r"not found|unknown config",
    "empty": r"empty \(0 bytes\)",
    "directory": r"directory|no trace",
    "fifo": r"FIFO",
    "devzero": r"character device",
    "huge": r"MiB|is not JSON|corrupt|binary|not a primus-perf tuning cache",
    "binary": r"binary|is not JSON|corrupt|not valid|cannot (read|parse)|not a primus-perf tuning cache",
    "text": r"is not JSON|not valid|corrupt|cannot (read|parse)|must be a mapping|expected a list|not a primus-perf"
            r" tuning cache",
}
FILE_SLOTS = {  # slot -> argv with {X}; kinds it does not treat as bad (a valid input there)
    "analyze": (("profile", "analyze", "{X}"), ()),
    "shapes": (("profile", "shapes", "{X}", "-o", "{out}"), ()),
    "report": (("profile", "report", "{X}", "-o", "{out}"), ()),
    "compare-base": (("profile", "compare", "{X}", "{trace}"), ()),
    "compare-candidate": (("profile", "compare", "{trace}", "{X}"), ()),
    "gate-baseline": (("profile", "gate", "--baseline", "{X}", "--candidate", "{samples}"), ()),
    "gate-candidate": (("profile", "gate", "--baseline", "{samples}", "--candidate", "{X}"), ()),
    "cache-show": (("tune", "cache", "show", "{X}"), ()),
    "cache-export": (("tune", "cache", "export", "{X}", "--format", "tunableop", "--torch-version", "2.14.0", "--out", "{out}"), ()),
    "cache-merge": (("tune", "cache", "merge", "{out}", "{X}"), ()),
    "gemm-problems": (("tune", "gemm", "--problems", "{X}", "--dry-run"), ()),
    "gemm-trace": (("tune", "gemm", "--from-trace", "{X}", "--dry-run"), ()),
    "attention-problems": (("tune", "attention", "--problems", "{X}"), ()),
    "attention-trace": (("tune", "attention", "--from-trace", "{X}"), ()),
    "grouped-gemm-problems": (("tune", "grouped-gemm", "--problems", "{X}", "--dry-run"), ()),
    "grouped-gemm-trace": (("tune", "grouped-gemm", "--trace", "{X}", "--dry-run"), ()),
    "train-config": (("train", "--config", "{X}"), ()),
    "train-cache": (("train", "tuning.cache={X}"), ()),
    "train-data": (("train", "data.path={X}"), ("binary", "text", "huge")),  # any bytes are data
    "run-config": (("profile", "run", "--config", "{X}", "--out", "{outdir}"), ()),
    "bench-config": (("profile", "bench", "--config", "{X}", "-o", "{out}"), ()),
    "report-cache": (("profile", "report", "{trace}", "--cache", "{X}", "-o", "{out}"), ()),
}

BAD_OVERRIDES = [  # (override, the key the line names)
    ("model.dim=0", "model.dim"), ("model.dim=-1", "model.dim"), ("model.dim=1048576", "model.dim"),
    ("model.dim=abc", "model.dim"), ("model.dim=1.5", "model.dim"), ("model.dim=true", "model.dim"),
    ("model.dim=", "model.dim"), ("train.micro_batch=100000", "train.micro_batch"),
    ("train.micro_batch=0", "train.micro_batch"), ("model.vocab_size=1e11", "model.vocab_size"),
    ("model.n_layers=1000000000000", "model.n_layers"), ("model.dim=4294967296", "model.dim"),
    ("model.vocab_size=100000000000", "model.dim|model.vocab_size"),
    ("train.lr=.nan", "train.lr"), ("train.lr=nan", "train.lr"), ("train.lr=.inf", "train.lr"),
    ("train.lr=-.inf", "train.lr"), ("train.lr=0", "train.lr"), ("train.lr=-1", "train.lr"),
    ("train.lr=fast", "train.lr"), ("train.beta1=1", "train.beta1"), ("train.beta1=1.5", "train.beta1"),
    ("train.beta1=-0.1", "train.beta1"), ("train.beta2=1.0", "train.beta2"), ("train.beta2=.nan", "train.beta2"),
    ("train.eps=0", "train.eps"), ("train.eps=-1e-8", "train.eps"), ("model.init_std=0", "model.init_std"),
    ("model.init_std=-0.02", "model.init_std"), ("model.norm_eps=0", "model.norm_eps"),
    ("model.rope_theta=0", "model.rope_theta"), ("model.rope_theta=-1", "model.rope_theta"),
    ("model.rope_theta=.inf", "model.rope_theta"), ("train.seed=1180591620717411303424", "train.seed"),
    ("train.seed=-1", "train.seed"), ("train.sdpa_backend=bogus", "train.sdpa_backend"),
    ("train.device=tpu", "train.device"), ("train.dtype=fp8", "train.dtype"), ("train.nope=1", "train.nope"),
    ("nope.x=1", "nope"), ("model=3", "dotted"), ("noequals", "key=value"), ("=3", "dotted"),
    ("train.=3", "dotted"), ("model.n_heads=3", "model.dim"), ("model.n_kv_heads=3", "model.n_kv_heads"),
    ("parallel.tp=2", "parallel.tp"), ("parallel.dp=-1", "parallel.dp"), ("parallel.dp=5", "parallel.dp"),
    ("train.steps=0", "train.steps"), ("train.seq_len=-4", "train.seq_len"), ("train.warmup=-1", "train.warmup"),
    ("train.grad_clip=-1", "train.grad_clip"), ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.min_lr=1", "train.lr"), ("model.qkv_bias=maybe", "model.qkv_bias"),
    ("train.log_every=0", "train.log_every"), ("tuning.cache=/nonexistent/c.json", "tuning.cache"),
    ("data.path=/nonexistent/corpus.txt", "data.path"), ("train.recompute=3", "train.recompute"),
] + ([("train.sdpa_backend=cudnn", "train.sdpa_backend"), ("train.sdpa_backend=efficient", "train.sdpa_backend"),
      ("train.dtype=bf16", "train.dtype")] if ON_CPU else [])
CONFIG_COMMANDS = {
    "train": ("train",),
    "run": ("profile", "run", "--out", "{outdir}"),
    "bench": ("profile", "bench", "--config", "tiny", "-o", "{out}"),
}

GATE = ("profile", "gate", "--baseline", "{samples}", "--candidate", "{samples}")
BAD_OPTIONS = [  # (argv, what the line names)
    *[(("profile", "analyze", "{trace}", "--top", v), "--top") for v in ("-5", "0", "abc")],
    *[(("profile", "compare", "{trace}", "{trace}", "--top", v), "--top") for v in ("-5", "0")],
    *[(("profile", "run", "--out", "{outdir}", opt, v), opt) for opt, v in (
        ("--steps", "0"), ("--steps", "-1"), ("--steps", "x"), ("--warmup", "-1"), ("--wait", "-1"),
        ("--baseline", "-1"), ("--after", "-1"), ("--layers", "0"))],
    (("profile", "run", "--out", "{outdir}", "--ranks", "0,x"), "--ranks"),
    (("profile", "run", "--out", "{outdir}", "--ranks", "5"), "ranks must be in"),
    *[(("profile", "bench", "--config", "tiny", "-o", "{out}", opt, v), opt) for opt, v in (
        ("--repeat", "0"), ("--repeat", "x"), ("--warmup", "-1"), ("--profile-steps", "-1"))],
    (("profile", "bench", "--config", "tiny", "--set", "model.dim=64"), "--set"),
    *[(("tune", "step", "--config", "tiny", "--out", "{outdir}", *extra), text) for extra, text in (
        (("--levers", "compile,nope"), "unknown lever nope"), (("--budget-min", "0"), "--budget-min"),
        (("--blocks", "1"), "--blocks"), (("--cache", "/nonexistent/c.json"), "--cache"),
        (("model.n_layers=1000000000000",), "model.n_layers"), (("train.global_batch=3",), "train.global_batch"))],
    *[((*GATE, "--alpha", v), "alpha") for v in ("0", "0.7", "-1", "nan", "abc")],
    *[((*GATE, "--max-regression", v), "max regression|percentage") for v in ("abc", "150%", "-3%")],
    ((*GATE, "--metric", "nope"), "nope"),
    (("profile", "gate", "--baseline", "{samples5}", "--candidate", "{samples5}", "--alpha", "0.005"),
     "smallest possible p"),
    (("profile", "gate", "--baseline", "{samples}", "--candidate", "{samples_h100}"), "--allow-mismatch"),
    (("profile", "gate", "--baseline", "{samples}", "--candidate", "{samples_other_config}"), "--allow-mismatch"),
    (("tune", "cache", "export", "{cache}", "--format", "bogus", "--out", "{out}"), "format"),
    *[(("tune", "attention", "--problem", spec), "--problem") for spec in (
        "1,2,3", "a,b,c,d,e,f", "1,8,3,128,64,causal", "1,8,8,128,64,maybe", "0,8,8,128,64,causal",
        "1,8,8,-128,64,causal", "1,8,8,128,64,causal,extra")],
    (("tune", "attention", "--problem", "1,8,8,128,64,causal", "--dtype", "bogus"), "--dtype"),
    (("tune", "attention", "--problem", "1,8,8,128,64,causal", "--strategy", "bogus"), "--strategy"),
    (("tune", "attention", "--problem", "1,8,8,128,64,causal", "--trials", "0"), "--trials"),
    (("tune", "attention", "--problem", "1,8,8,128,64,causal", "--budget-s", "0"), "--budget-s"),
    (("tune", "gemm", "--problems", "{problems}", "--budget-s", "-1"), "--budget-s"),
    (("tune", "gemm", "--dry-run"), "nothing to tune"),
    (("tune", "attention",), "nothing to tune"),
    (("train", "--steps", "0"), "--steps"), (("train", "--layers", "0"), "--layers"),
    (("train", "--layers", "x"), "--layers"), (("train", "--config", "no-such-preset"), "no-such-preset"),
    (("tune", "nosuch"), "No such command"), (("profile", "nosuch"), "No such command"),
    *[((*cmd, "--no-such-option"), "No such option") for cmd in (
        ("profile", "analyze"), ("profile", "shapes"), ("profile", "report"), ("profile", "compare"),
        ("profile", "run"), ("profile", "bench"), ("profile", "gate"), ("tune", "gemm"), ("tune", "attention"),
        ("tune", "cache", "show"), ("tune", "cache", "merge"), ("tune", "cache", "export"), ("train",))],
]

WRITE_TARGETS = {  # target -> what the line says
    "{rofile}": r"cannot write .*(Read-only|Permission denied)",
    "{notdir}/sub/out.json": r"cannot write .*Not a directory",
    "{dir}": r"(Is a|is a) directory",
}
WRITERS = [
    ("profile", "analyze", "{trace}", "--json", "{T}"),
    ("profile", "shapes", "{trace}", "-o", "{T}"),
    ("profile", "report", "{trace}", "-o", "{T}"),
    ("profile", "report", "{trace}", "-o", "{out}", "--json", "{T}"),
    ("profile", "compare", "{trace}", "{trace}", "-o", "{T}"),
    ("profile", "compare", "{trace}", "{trace}", "--json", "{T}"),
    ("profile", "gate", "--baseline", "{samples}", "--candidate", "{samples}", "--json", "{T}"),
    ("tune", "cache", "export", "{cache}", "--format", "tunableop", "--torch-version", "2.14.0", "--out", "{T}"),
    ("tune", "cache", "merge", "{T}", "{cache}"),
    ("profile", "bench", "--config", "tiny", "-o", "{T}"),
    ("train", "--steps", "1", "--json-log", "{T}"),
]

CORRUPT_CACHES = {
    "truncated": b'{"schema": 1, "entries": [',
    "newer-schema": b'{"schema": 9, "entries": []}',
    "not-a-cache": b'{"hello": 1}',
    "entries-dict": b'{"schema": 1, "entries": {}}',
    "binary": b"\x00\x01\x02 not a cache",
}
CACHE_READERS = [
    ("tune", "cache", "show", "{C}"),
    ("tune", "cache", "export", "{C}", "--format", "tunableop", "--torch-version", "2.14.0", "--out", "{out}"),
    ("tune", "cache", "merge", "{out}", "{C}"),
    ("train", "--steps", "1", "tuning.cache={C}"),
    ("profile", "report", "{trace}", "--cache", "{C}", "-o", "{out}"),
]

BAD_SAMPLES = {
    "schema": {"schema": "other/1"},
    "no-metrics": {"metrics": {}},
    "metric-not-list": {"metrics": {"step_time": 0.1}},
    "strings": {"metrics": {"step_time": ["0.1"] * 20}},
    "booleans": {"metrics": {"step_time": [True] * 20}},
    "negative": {"metrics": {"step_time": [-0.1] * 20}},
    "nan": {"metrics": {"step_time": [float("nan")] * 20}},
    "too-few": {"metrics": {"step_time": [0.1, 0.1, 0.1]}},
    "no-device": {"device": None},
    "not-a-mapping": [1, 2, 3],
}
BAD_PROBLEMS = {
    "M-bool": [{"M": True, "N": 64, "K": 64}],
    "M-zero": [{"M": 0, "N": 64, "K": 64}],
    "N-negative": [{"M": 64, "N": -5, "K": 64}],
    "K-string": [{"M": 64, "N": 64, "K": "x"}],
    "M-float": [{"M": 1.5, "N": 64, "K": 64}],
    "N-missing": [{"M": 64, "K": 64}],
    "kind": [{"kind": "bogus", "problem": {}}],
    "dtype": [{"M": 64, "N": 64, "K": 64, "dtype": "bogus"}],
    "unknown-field": [{"M": 64, "N": 64, "K": 64, "colour": "red"}],
    "item-not-mapping": [[64, 64, 64]],
    "problems-not-list": {"problems": "many"},
    "top-number": 42,
    "attention-heads": [{"kind": "attention", "problem": {"batch": 1, "heads_q": 8, "heads_kv": 3, "seq_q": 64,
                                                          "seq_kv": 64, "head_dim": 64}}],
    "attention-bool": [{"kind": "attention", "problem": {"batch": True, "heads_q": 8, "heads_kv": 8,
                                                         "seq_q": 64, "seq_kv": 64, "head_dim": 64}}],
}


def _cases() -> list[Case]:
    cases = []
    for slot, (argv, valid_kinds) in FILE_SLOTS.items():
        for kind, pattern in ODD_FILES.items():
            if kind not in valid_kinds:
                cases.append(Case(f"odd-file-{kind}-{slot}", tuple(a.replace("{X}", "{" + kind + "}") for a in argv),
                                  2, pattern))
    for name, cmd in CONFIG_COMMANDS.items():
        for override, key in BAD_OVERRIDES:
            cases.append(Case(f"config-{name}", (*cmd, override), 2, re.escape(key) if "|" not in key else key))
    for argv, text in BAD_OPTIONS:
        cases.append(Case("option", argv, 2, re.escape(text) if "|" not in text else text))
    for target, pattern in WRITE_TARGETS.items():
        for argv in WRITERS:
            cases.append(Case(f"write-{target.strip('{}').split('}')[0]}", tuple(a.replace("{T}", target) for a in argv),
                              2, pattern))
    for name in CORRUPT_CACHES:
        for argv in CACHE_READERS:
            pattern = r"newer primus-perf \(schema 9" if name == "newer-schema" else \
                r"corrupt|is not JSON|is not a primus-perf tuning cache"
            cases.append(Case(f"cache-{name}", tuple(a.replace("{C}", "{cache_" + name + "}") for a in argv),
                              2, pattern))
    for name in BAD_SAMPLES:
        for side in (("--baseline", "{samples_" + name + "}", "--candidate", "{samples}"),
                     ("--baseline", "{samples}", "--candidate", "{samples_" + name + "}")):
            cases.append(Case(f"samples-{name}", ("profile", "gate", *side), 2, r"samples|metric|device|not"))
    for name in BAD_PROBLEMS:
        for argv in (("tune", "gemm", "--problems", "{problems_" + name + "}", "--dry-run"),
                     ("tune", "attention", "--problems", "{problems_" + name + "}")):
            cases.append(Case(f"problems-{name}", argv, 2, r"item 0|expected a list|problems"))
    # valid input that used to fail: accepted, with a note where something was skipped
    cases += [
        Case("valid", ("tune", "cache", "show", "{cache_bad_entry}"), 0, r"skipped invalid gemm entry #1"),
        Case("valid", ("tune", "cache", "merge", "{out}", "{cache_bad_entry}"), 0, r"took 2 entries(.|\n)*skipped invalid"),
        Case("valid", ("tune", "gemm", "--problems", "{problems_fp16}", "--dry-run"), 0, r"1 unique GEMM"),
        Case("valid", ("profile", "analyze", "{trace}", "--json", "-"), 0, r'"device"'),
        Case("valid", ("profile", "analyze", "{run_dir}", "--top", "3"), 0, r"GPU time by category"),
    ]
    return cases


CASES = _cases()


# --------------------------------------------------------------------------- fixtures


def _entry(i: int) -> CacheEntry:
    p = GemmProblem.from_row_major(64 + i, 64, 64, b_transposed=True)
    return CacheEntry("gemm", p.key(), p.to_dict(), DeviceIdentity("NVIDIA H100", "nvidia", "sm_90", 132).to_dict(),
                      {"cublasLt": "13.1.0"}, {"config": {"source": "torch", "algo": i}, "blob": b"\x01"},
                      times={"tuned_ms": 1.0, "default_ms": 1.2})


def _samples(n: int = 20, **extra) -> dict:
    doc = {"schema": SAMPLES_SCHEMA, "config": "tiny", "overrides": [],
           "device": {"name": "cpu", "arch": "", "compute_units": 2, "world_size": 1},
           "metrics": {"step_time": [0.1 + 0.001 * (i % 5) for i in range(n)]}}
    doc.update(extra)
    return doc


@contextlib.contextmanager
def _mounted_tmpfs(path: Path, size: str) -> object:
    """A tmpfs at ``path`` (root only); yields False where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> object:
    root = tmp_path_factory.mktemp("bad")
    p: dict[str, str] = {"trace": str(TRACE)}
    (root / "empty.json").write_bytes(b"")
    p["empty"] = str(root / "empty.json")
    p["missing"] = str(root / "nope" / "missing.json")
    (root / "adir").mkdir()
    p["directory"] = p["dir"] = str(root / "adir")
    os.mkfifo(root / "fifo.json")
    p["fifo"] = str(root / "fifo.json")
    p["devzero"] = "/dev/zero"
    with open(root / "huge.json", "wb") as f:  # 3 GiB, sparse: costs no disk
        f.truncate(3 << 30)
        f.seek(0)
        f.write(b"\x7fELF")
    p["huge"] = str(root / "huge.json")
    (root / "binary.yaml").write_bytes(bytes(range(256)) * 64)
    p["binary"] = str(root / "binary.yaml")
    (root / "text.yaml").write_text("hello world, not what you wanted\n")
    p["text"] = str(root / "text.yaml")
    (root / "file").write_text("x")
    p["notdir"] = str(root / "file")
    p["out"] = str(root / "out" / "result.json")
    p["outdir"] = str(root / "outdir")
    cache = root / "cache.json"
    TuningCache(cache).put_many([_entry(1), _entry(2)])
    p["cache"] = str(cache)
    for name, content in CORRUPT_CACHES.items():
        (root / f"cache_{name}.json").write_bytes(content)
        p[f"cache_{name}"] = str(root / f"cache_{name}.json")
    bad = json.loads(cache.read_text())
    bad["entries"].insert(1, {**bad["entries"][0], "solution": {"blob": "@@@"}})
    (root / "cache_bad_entry.json").write_text(json.dumps(bad))
    p["cache_bad_entry"] = str(root / "cache_bad_entry.json")
    for name, doc in (("samples", _samples()), ("samples5", _samples(5)),
                      ("samples_h100", _samples(device={"name": "NVIDIA H100", "arch": "sm_90", "compute_units": 132,
                                                        "world_size": 1})),
                      ("samples_other_config", _samples(config="llama3-8b")),
                      *((f"samples_{k}", v if not isinstance(v, dict) else {**_samples(), **v})
                        for k, v in BAD_SAMPLES.items())):
        (root / f"{name}.json").write_text(json.dumps(doc))
        p[name] = str(root / f"{name}.json")
    (root / "problems.json").write_text(json.dumps([{"M": 64, "N": 64, "K": 64}]))
    p["problems"] = str(root / "problems.json")
    (root / "problems_fp16.json").write_text(json.dumps([{"M": 64, "N": 64, "K": 64, "dtype": "fp16"}]))
    p["problems_fp16"] = str(root / "problems_fp16.json")
    for name, doc in BAD_PROBLEMS.items():
        (root / f"problems_{name}.json").write_text(json.dumps(doc))
        p[f"problems_{name}"] = str(root / f"problems_{name}.json")
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "rank0.pt.trace.json.gz").write_bytes(TRACE.read_bytes())
    (run_dir / "manifest.json").write_text(json.dumps({"traces": {"0": "rank0.pt.trace.json.gz"}}))
    p["run_dir"] = str(run_dir)
    with _read_only_dir(root / "ro") as ro:
        p["rofile"] = str(ro / "old.json") if ro else ""
        yield p


OLD = b'{"old": "file"}\n'


@contextlib.contextmanager
def _read_only_dir(path: Path) -> object:
    """A folder holding ``old.json`` that cannot be written: a tmpfs remounted read-only
    (root), or a folder without write permission (others); None where neither works."""
    if os.geteuid() != 0:
        path.mkdir()
        (path / "old.json").write_bytes(OLD)
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with _mounted_tmpfs(path, "1m") as ok:
        if not ok:
            yield None
            return
        (path / "old.json").write_bytes(OLD)
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path


def _fill(argv: tuple[str, ...], paths: dict[str, str], tmp_path: Path) -> list[str]:
    values = {**paths, "out": str(tmp_path / "out" / "result.json"), "outdir": str(tmp_path / "outdir")}
    return [re.sub(r"\{([\w-]+)\}", lambda m: values[m.group(1)], a) for a in argv]


# --------------------------------------------------------------------------- the table


def test_the_table_has_at_least_300_cases_across_every_family() -> None:
    families = {c.family.split("-")[0] for c in CASES}
    assert len(CASES) >= 300, len(CASES)
    assert families >= {"odd", "config", "option", "write", "cache", "samples", "problems", "valid"}
    commands = {c.argv[:2] if c.argv[0] != "train" else ("train",) for c in CASES}
    assert {("profile", "analyze"), ("profile", "shapes"), ("profile", "report"), ("profile", "compare"),
            ("profile", "run"), ("profile", "bench"), ("profile", "gate"), ("tune", "gemm"), ("tune", "attention"),
            ("tune", "cache"), ("train",)} <= commands


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, paths: dict[str, str], tmp_path: Path) -> None:
    if "{rofile}" in " ".join(case.argv) and not paths["rofile"]:
        pytest.skip("no read-only folder here (tmpfs mount not permitted)")
    argv = _fill(case.argv, paths, tmp_path)
    code, out, err, error = run_cli(argv)
    assert error is None, f"{type(error).__name__}: {error}"
    assert "Traceback" not in out + err, err[-3000:]
    assert code == case.exit_code, (argv, code, out[-1500:], err[-1500:])
    lines = [x for x in err.splitlines() if x.strip()]
    if case.exit_code == 0:
        assert re.search(case.pattern, out + err), (case.pattern, out[-1500:], err[-1500:])
    else:
        assert lines and lines[-1].startswith("error:"), err[-1500:]
        assert sum(x.startswith("error:") for x in lines) == 1, err
        assert re.search(case.pattern, lines[-1]), (case.pattern, lines[-1])
    if paths["rofile"]:
        assert Path(paths["rofile"]).read_bytes() == OLD  # the old file, byte for byte


# --------------------------------------------------------------------------- a full disk

FULL_DISK_WRITERS = {
    "analyze --json": ("profile", "analyze", "{trace}", "--json", "{T}"),
    "report -o": ("profile", "report", "{trace}", "-o", "{T}"),
    "report --json": ("profile", "report", "{trace}", "-o", "{other}", "--json", "{T}"),
    "compare -o": ("profile", "compare", "{trace}", "{trace}", "-o", "{T}"),
    "shapes -o": ("profile", "shapes", "{trace}", "-o", "{T}"),
    "cache merge": ("tune", "cache", "merge", "{T}", "{cache}"),
    "cache export": ("tune", "cache", "export", "{cache}", "--format", "tunableop", "--torch-version", "2.14.0", "--out", "{T}"),
    "train --json-log": ("train", "--steps", "2", "model.n_layers=1", "--json-log", "{T}"),
    "run --out": ("profile", "run", "--steps", "1", "--wait", "0", "--baseline", "1", "--after", "0",
                  "model.n_layers=1", "--out", "{D}"),
}


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """A folder on a full file system holding ``old.json`` (a valid cache): a 256 KiB tmpfs
    filled up (root), else every atomic write goes to /dev/full (ENOSPC on the first flush)."""
    old = TuningCache(tmp_path / "seed.json")
    old.put(_entry(0))
    content = old.path.read_bytes()
    disk = tmp_path / "disk"
    with _mounted_tmpfs(disk, "256k") as ok:
        if ok:
            (disk / "old.json").write_bytes(content)
            (disk / "run").mkdir()
            with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        else:
            import primus_perf.base.files as files

            disk.mkdir()
            (disk / "old.json").write_bytes(content)
            real_mkstemp = files.tempfile.mkstemp

            def full_mkstemp(*args, **kwargs):
                fd, name = real_mkstemp(*args, **kwargs)
                os.close(fd)
                return os.open("/dev/full", os.O_WRONLY), name

            monkeypatch.setattr(files.tempfile, "mkstemp", full_mkstemp)
        yield disk, content


@pytest.mark.parametrize("name", list(FULL_DISK_WRITERS))
def test_a_full_disk_is_one_line_and_the_old_file_survives_byte_for_byte(
        name: str, full_disk: tuple[Path, bytes], paths: dict[str, str], tmp_path: Path) -> None:
    disk, content = full_disk
    values = {**paths, "T": str(disk / "old.json"), "D": str(disk / "run"), "other": str(tmp_path / "r.html")}
    argv = [re.sub(r"\{([\w-]+)\}", lambda m: values[m.group(1)], a) for a in FULL_DISK_WRITERS[name]]
    code, out, err, error = run_cli(argv)
    assert error is None and "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and lines[-1].startswith("error:"), (code, out[-1000:], err[-2000:])
    assert "No space left on device" in lines[-1], lines[-1]
    assert (disk / "old.json").read_bytes() == content
    assert not [p for p in disk.iterdir() if p.name.endswith(".tmp")]  # no temporary left behind


# --------------------------------------------------------------------------- signals


def _spawn(module: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # -X faulthandler: a command that does not stop is sent SIGABRT, and its stacks are shown
    return subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", module, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_lines(proc: subprocess.Popen[str], pattern: str, count: int, timeout: float = 120,
                    stderr: bool = False) -> list[str]:
    stream = proc.stderr if stderr else proc.stdout
    assert stream is not None
    seen: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = stream.readline()
        if not line:
            break
        if re.search(pattern, line):
            seen.append(line)
            if len(seen) >= count:
                return seen
    proc.kill()
    raise AssertionError(f"{pattern!r} seen {len(seen)} times; stderr: {proc.stderr.read()[-2000:]}")


def _stop(proc: subprocess.Popen[str], sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to stderr
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        raise AssertionError(f"the command did not stop within 60 s of the signal; stderr: {err[-6000:]}") from None
    return proc.returncode, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_train_interrupted_keeps_the_json_log_under_its_final_name(tmp_path: Path, sig: int) -> None:
    log = tmp_path / "log.jsonl"
    proc = _spawn("primus_perf.cli.train", "--steps", "100000", "model.n_layers=1", "--json-log", str(log))
    _wait_for_lines(proc, r"^step\s+\d+/", 2)
    code, err = _stop(proc, sig)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.match(rf"interrupted: after \d+ of 100000 steps; the JSON log {re.escape(str(log))} holds \d+ step", last), last
    steps = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(steps) >= 2 and steps[0]["step"] == 1
    assert os.listdir(tmp_path) == ["log.jsonl"]


def test_profile_run_interrupted_keeps_the_recorded_steps(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _spawn("primus_perf.cli.profile", "run", "--steps", "100000", "--wait", "0", "--warmup", "1",
                  "--baseline", "1", "--after", "0", "model.n_layers=1", "--out", str(out))
    _wait_for_lines(proc, r"active", 2)
    code, err = _stop(proc, signal.SIGINT)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.match(r"interrupted: after \d+ steps; wrote .*rank0\.pt\.trace\.json\.gz with \d+ recorded", last), last
    code, _, err, error = run_cli(["profile", "analyze", str(out), "--top", "3"])
    assert code == 0 and error is None, err


def test_profile_run_interrupted_before_recording_says_nothing_was_written(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _spawn("primus_perf.cli.profile", "run", "--steps", "1", "--baseline", "100000",
                  "model.n_layers=1", "--out", str(out))
    _wait_for_lines(proc, r"baseline", 1)
    code, err = _stop(proc, signal.SIGINT)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert re.search(r"interrupted: .*nothing was written", err.strip().splitlines()[-1]), err[-1000:]
    assert not list(out.glob("*"))


def test_bench_interrupted_exits_130_and_writes_nothing(tmp_path: Path) -> None:
    samples = tmp_path / "s.json"
    proc = _spawn("primus_perf.cli.profile", "bench", "--config", "tiny", "--repeat", "100000", "-o", str(samples))
    _wait_for_lines(proc, r"^bench: step", 1, stderr=True)  # past start-up: measuring
    code, err = _stop(proc, signal.SIGINT)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert not samples.exists()


# --------------------------------------------------------------------------- training guards


def test_a_non_finite_loss_stops_with_the_step_and_the_last_finite_loss(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    code, _, err, error = run_cli(["train", "--steps", "30", "train.lr=1e30", "train.min_lr=0", "train.warmup=0",
                                     "train.grad_clip=0", "model.n_layers=1", "--json-log", str(log)])
    assert error is None and code == 3, (code, err[-2000:])
    last = err.strip().splitlines()[-1]
    assert re.match(r"error: loss became (nan|inf) at step (\d+) \(last finite loss [\d.]+ at step \d+\)", last), last
    assert len(log.read_text().splitlines()) >= 1  # the finished steps are kept


@pytest.mark.skipif(not ON_CPU, reason="the CPU path of a tuning cache")
@pytest.mark.parametrize("hide_triton", [False, True], ids=["with-triton", "without-triton"])
def test_a_tuning_cache_on_a_cpu_trains_with_defaults(tmp_path: Path, hide_triton: bool) -> None:
    from primus_perf.base.devices import current_device

    cache = tmp_path / "cache.json"
    gemm = _entry(1)
    gemm.device = current_device().to_dict()
    attn = AttentionProblem(batch=1, heads_q=4, heads_kv=2, seq_q=64, seq_kv=64, head_dim=32)
    attention = CacheEntry("attention", attn.key(), attn.to_dict(), _entry(2).device, {"torch": "2"},
                           {"config": {"backend": "triton"}, "blob": b""})
    TuningCache(cache).put_many([gemm, attention])
    code = ("import sys\n" + ("sys.modules['triton'] = None\n" if hide_triton else "") +
            "from primus_perf.cli.train import main\nsys.argv = ['primus-train', '--steps', '1', "
            f"'model.n_layers=1', 'tuning.cache={cache}']\nmain()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert re.search(r"gemm: 1 entries, not usable here", r.stdout), r.stdout
    assert re.search(r"attention: 0 of 1 entries usable", r.stdout), r.stdout
    assert re.search(r"step\s+1/1", r.stdout)
