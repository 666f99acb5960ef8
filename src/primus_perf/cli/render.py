"""How every command prints: the consoles, tables and help text, readable in a terminal
and in a log file.

In a terminal, rich fits text and tables to the window (a cell that does not fit folds
onto the next line; nothing is replaced by an ellipsis). When the stream is a file or a
pipe (a Slurm log, a CI job), a table is printed at the width its content needs, whatever
that is: no number or name is cut or wrapped (``COLUMNS``, when set, is the narrowest a
table is drawn); lines of text (notes, errors, summaries) are not wrapped; the help is
click's plain layout, wrapped at ``COLUMNS`` (80 when unset). ``FORCE_COLOR``, ``CI``
and ``GITHUB_ACTIONS`` change colours only, never these widths: what decides is whether
the stream is a terminal.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from rich.cells import cell_len
from rich.console import Console, ConsoleDimensions
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from primus_perf.base import environment

UNWRAPPED = 100_000  # the width of a file or pipe without COLUMNS: lines are never wrapped


def is_tty(stream: IO[str] | None) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (ValueError, OSError):  # a closed stream
        return False


def columns() -> int | None:
    value = environment.get("COLUMNS")
    return int(value) if value.isdigit() and int(value) > 0 else None


class LogConsole(Console):
    """A rich console whose width, for a stream that is not a terminal, is ``COLUMNS`` when
    set and otherwise unlimited (rich would use 80 columns and wrap or cut)."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)  # type: ignore[attr-defined]
        if self._width is None and not is_tty(self.file):
            return ConsoleDimensions(columns() or UNWRAPPED, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        """Text to a file or a pipe is never wrapped (a note's path stays on its line, for
        grep); tables go through :func:`print_table`."""
        if soft_wrap is None and not is_tty(self.file) and all(isinstance(o, str) for o in objects):
            soft_wrap = True
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)


def print_table(table: Table, console: Console | None = None) -> None:
    """Print a table. To a file or a pipe, at the width its content needs when that is
    wider than the console: every cell whole, one line per row."""
    console = console or CONSOLE
    for column in table.columns:
        if column.overflow == "ellipsis":
            column.overflow = "fold"
    if isinstance(table.title, str) and not table.min_width:  # a title on one line, not wrapped
        table.min_width = cell_len(Text.from_markup(table.title).plain)
    if is_tty(console.file):
        console.print(table)
        return
    needed = Measurement.get(console, console.options.update(width=UNWRAPPED), table).maximum
    if needed <= console.width:
        console.print(table)
        return
    console.width = needed
    try:
        console.print(table)
    finally:
        console._width = None  # back to the stream's own width


def new_table(title: str | None, columns: Iterable[str], left: Collection[str] = (), **options: Any) -> Table:
    """A table of ``columns``, right-justified (numbers) but those named in ``left``;
    ``options`` (``overflow``) go to every column."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", **options)
    return table


def signed_pct(v: float) -> str:
    """A relative change as a signed percentage: ``+1.25%``."""
    return f"{v * 100:+.2f}%"


@contextmanager
def step_progress(label: str, console: Console | None = None) -> Iterator[Callable[[int, int], None]]:
    """Progress of a loop of steps; yields ``advance(done, total)``. In a terminal a bar
    (gone when done); to a file or a pipe a line at each tenth of the way and at the end
    (``bench: step 7 of 28, 12 s``), so a batch job's log shows it is moving."""
    console = console or ERR_CONSOLE
    if is_tty(console.file):
        with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task(label, total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    start, shown = time.monotonic(), [-1]

    def advance(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > shown[0] or done == total:
            shown[0] = tenth
            console.print(f"{label}: step {done} of {total}, {time.monotonic() - start:.0f} s",
                          highlight=False, soft_wrap=True)

    yield advance


def plain_help_off_tty(stream: IO[str] | None) -> None:
    """Help printed to a file or a pipe uses click's plain layout (long option names on
    their own line, prose wrapped at word boundaries) instead of rich's 80-column boxes."""
    if not is_tty(stream):
        import typer.core

        typer.core.HAS_RICH = False


def console_for(stderr: bool = False, **kwargs: Any) -> LogConsole:
    return LogConsole(stderr=stderr, **kwargs)


CONSOLE = console_for()
ERR_CONSOLE = console_for(stderr=True)
