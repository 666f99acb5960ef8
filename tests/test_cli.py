from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = {
    "primus_perf.cli.train": [[]],
    "primus_perf.cli.profile": [["run"], ["analyze"], ["shapes"], ["report"], ["compare"], ["bench"], ["gate"]],
    "primus_perf.cli.tune": [["gemm"], ["attention"], ["cache"], ["cache", "show"]],
}


@pytest.mark.parametrize(
    "module,args",
    [(m, a) for m, arglists in COMMANDS.items() for a in arglists],
)
def test_help_works_for_every_command(module: str, args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, *args, "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
