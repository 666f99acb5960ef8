"""Every table of an analysis as CSV files or one Excel workbook (one sheet per table).

The tables are the :class:`~primus_perf.tracelens.analyze.Analysis` fields that are
DataFrames (kernels, hotspots, problems, breakdowns, collectives, ...), any list of records
among them (one row per record), and its scalar dicts (``device``, ``totals``) as
two-column ``key, value`` tables; a table added to the analysis is exported with no change
here. Cells that are objects (a problem, a list of kernels) are written as their text, and
text that a spreadsheet would read as a formula (``=``, ``+``, ``-``, ``@`` first) is
prefixed with ``'``.
Excel holds at most :data:`XLSX_MAX_ROWS` rows a sheet: a longer table (the per-kernel
table of a long trace) is cut there and the workbook's ``notes`` sheet says so; its CSV
file is whole. Writing .xlsx needs openpyxl (the ``xlsx`` extra).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pandas as pd

from primus_perf import kinds
from primus_perf.base.errors import UserError

XLSX_MAX_ROWS = 1_048_575  # Excel's sheet limit, less the header row
_SHEET_BAD = re.compile(r"[\[\]:*?/\\]")


_FORMULA = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet would read as the start of a formula


def _text(v: str) -> str:
    """Text as a spreadsheet shows it, never as a formula (a name from a trace can start with ``=``)."""
    return "'" + v if v.startswith(_FORMULA) else v


def _cell(v: Any) -> Any:
    if isinstance(v, str):
        return _text(v)
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    if (hasattr(v, "key") and callable(v.key)) or isinstance(v, (list, tuple, dict, set)):  # a problem, a list
        return _text(str(v))
    return v if pd.api.types.is_scalar(v) else _text(str(v))


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with categorical columns as their values and object cells as text (escaped)."""
    out = df.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.CategoricalDtype):
            out[c] = out[c].astype(str).map(_text)
        elif out[c].dtype == object or pd.api.types.is_string_dtype(out[c].dtype):
            out[c] = out[c].map(_cell)
    return out


def analysis_tables(a: Any) -> dict[str, pd.DataFrame]:
    """Name -> table of every table of an analysis (see the module docstring), in field order."""
    tables: dict[str, pd.DataFrame] = {}
    for f in dataclasses.fields(a):
        if not f.metadata.get("export", True):
            continue
        v = getattr(a, f.name)
        if isinstance(v, pd.DataFrame):
            tables[f.name] = _plain(v.reset_index(drop=True))
        elif isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            tables[f.name] = _plain(pd.DataFrame(v))
        elif f.name == "problems_by_kind":  # one table per kind, named as on Analysis
            for kind, df in v.items():
                tables[kinds.get(kind).table] = _plain(df.reset_index(drop=True))
        elif isinstance(v, dict) and v and all(not isinstance(x, (dict, list)) for x in v.values()):
            tables[f.name] = pd.DataFrame({"key": list(v), "value": [_cell(x) for x in v.values()]})
    if getattr(a, "notes", None):
        tables["notes"] = pd.DataFrame({"note": [_text(n) for n in a.notes]})
    return tables


def write_csv(a: Any, folder: str | Path) -> list[Path]:
    """One ``NAME.csv`` per table in ``folder`` (created); the paths written."""
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out}: {exc.strerror or exc}") from None
    paths = []
    for name, df in analysis_tables(a).items():
        p = out / f"{name}.csv"
        try:
            df.to_csv(p, index=False)
        except OSError as exc:
            raise UserError(f"cannot write {p}: {exc.strerror or exc}") from None
        paths.append(p)
    return paths


def _sheet_name(name: str, taken: set[str]) -> str:
    """A valid, unique Excel sheet name (31 characters, none of ``[]:*?/\\``)."""
    base = _SHEET_BAD.sub("_", name)[:31] or "table"
    s, i = base, 1
    while s.lower() in taken:
        i += 1
        s = f"{base[:28]}_{i}"
    taken.add(s.lower())
    return s


def write_xlsx(a: Any, path: str | Path) -> Path:
    """One workbook, one sheet per table; a table longer than a sheet is cut, and said so."""
    try:
        import openpyxl  # noqa: F401
    except ImportError:
        raise UserError("writing .xlsx needs openpyxl: pip install 'primus-perf[xlsx]' (or write --csv)") from None
    p = Path(path)
    tables = analysis_tables(a)
    cut = [f"{name}: the first {XLSX_MAX_ROWS:,} of {len(df):,} rows (Excel's sheet limit; the CSV export is whole)"
           for name, df in tables.items() if len(df) > XLSX_MAX_ROWS]
    if cut:
        notes = tables.get("notes", pd.DataFrame({"note": []}))
        tables["notes"] = pd.concat([notes, pd.DataFrame({"note": cut})], ignore_index=True)
    taken: set[str] = set()
    try:
        with pd.ExcelWriter(p, engine="openpyxl") as xw:
            for name, df in tables.items():
                df.head(XLSX_MAX_ROWS).to_excel(xw, sheet_name=_sheet_name(name, taken), index=False)
    except OSError as exc:
        raise UserError(f"cannot write {p}: {exc.strerror or exc}") from None
    return p
