"""``primus-train``: run the reference trainer in one process."""

from __future__ import annotations

import typer

from primus_perf.cli.common import not_yet_available, run_app

app = typer.Typer(name="primus-train", add_completion=False)


@app.command()
def train() -> None:
    """Train a preset or YAML config."""
    not_yet_available("primus-train")


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
