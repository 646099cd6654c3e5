"""Reading user data files into rows; errors name the file, line (or row) and field.

Users bring their data sets as local files (compute nodes are usually offline), so the first thing
that goes wrong is the file itself. Every row comes back with its 1-based line number (JSONL) or
row number (parquet, Arrow, CSV, a JSON list) so that a validation error can point at the exact
place. `iter_rows` streams: it holds one line (JSON Lines) or one record batch of one shard
(parquet, Arrow, CSV) at a time, so a large file costs only the rows the task keeps.

- parquet, Arrow (`datasets.save_to_disk` shards) and CSV go through `datasets` (streaming: its
  `parquet` / `arrow` / `csv` builders, one file at a time so that an error names the file);
- JSON Lines (also gzipped, as Anthropic/hh-rlhf serves them) and JSON are read here line by line:
  the error must name the line, and a column whose type changes from row to row (a number in one
  row, a string in the next) must be the row's error, not a schema clash in the whole file.

`columns` (task.columns) maps the task's field names to the file's column names: a row is read
with `mapped(...)`, which copies each mapped column under its field name.
"""
from __future__ import annotations

import gzip
import json
import math
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

Row = dict[str, Any]

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".jsonl.gz", ".json.gz")
"""File types `read_rows` understands."""
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
"""Suffix -> the `datasets` packaged builder that reads it."""


class DataError(ValueError):
    """A data file that cannot be used; the message names the file, the line and the field."""

    def __init__(self, path: str | Path, message: str, *, line: int | None = None,
                 field: str | None = None):
        where = str(path) + (f":{line}" if line is not None else "")
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{where}: {what}{message}")
        self.path, self.line, self.field = str(path), line, field


def data_suffix(path: str | Path) -> str:
    """The data suffix of a file name (`.jsonl.gz` as a whole), or "" if it is not a data file."""
    name = Path(path).name.lower()
    return max((s for s in SUFFIXES if name.endswith(s)), key=len, default="")


def read_rows(path: str | Path) -> list[tuple[int, Row]]:
    """All rows of a data file (SUFFIXES), numbered: `list(iter_rows(path))`."""
    return list(iter_rows(path))


def iter_rows(path: str | Path) -> Iterator[tuple[int, Row]]:
    """The rows of a JSONL, JSON (a list of objects or one object), parquet, Arrow or CSV file.

    Yields (line, row) pairs: the line number in a JSONL file (blank lines skipped but counted),
    else the 1-based row number. Raises DataError for an unreadable file, a row that is not an
    object, or a file with no rows at all (an empty split is always a mistake)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "no such file")
    suffix = data_suffix(path)
    if suffix in (".jsonl", ".jsonl.gz"):
        rows = _read_jsonl(path)
    elif suffix in (".json", ".json.gz"):
        rows = iter(_read_json(path))
    elif suffix in BUILDERS:
        rows = _read_datasets(path, BUILDERS[suffix])
    else:
        raise DataError(path, f"unknown file type {path.suffix.lower()!r}; expected one of "
                              f"{', '.join(SUFFIXES)}")
    empty = True
    for n, row in rows:
        empty = False
        yield n, row
    if empty:
        raise DataError(path, "the file holds no rows")


def first_row(path: str | Path) -> Row:
    """The first row of a data file (reads no further)."""
    for _, row in iter_rows(path):
        return row
    raise AssertionError("unreachable: iter_rows raises on an empty file")


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_jsonl(path: Path) -> Iterator[tuple[int, Row]]:
    with _open_text(path) as f:
        try:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(path, f"not valid JSON ({e.msg} at column {e.colno})",
                                    line=n) from None
                if not isinstance(row, dict):
                    raise DataError(path, f"expected a JSON object, got {type(row).__name__}",
                                    line=n)
                yield n, row
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise DataError(path, f"cannot be read ({e})") from None


def _read_json(path: Path) -> list[tuple[int, Row]]:
    try:
        with _open_text(path) as f:
            data = json.loads(f.read())
    except json.JSONDecodeError as e:
        raise DataError(path, f"not valid JSON ({e.msg})", line=e.lineno) from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(path, f"cannot be read ({e})") from None
    items = data if isinstance(data, list) else [data]
    for n, row in enumerate(items, start=1):
        if not isinstance(row, dict):
            raise DataError(path, f"expected a JSON object, got {type(row).__name__}", line=n)
    return list(enumerate(items, start=1))


def _read_datasets(path: Path, builder: str) -> Iterator[tuple[int, Row]]:
    """Rows of one parquet / Arrow / CSV file through `datasets`, streamed (no cache written)."""
    try:
        import datasets
    except ImportError:
        raise DataError(path, f"reading {builder} files needs the `datasets` package (a dependency "
                              "of hpc_tba: pip install datasets), or convert the file to JSONL") from None
    try:
        # `split="train"` is the builder's name for all rows of the files given, not our split.
        ds = datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True)
        yield from enumerate(ds, start=1)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow / datasets raise many types for a bad file
        raise DataError(path, f"not a readable {builder} file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None


def mapped(path: str | Path, line: int, row: Row, columns: Mapping[str, str],
           optional: Collection[str] = ()) -> Row:
    """`row` with each mapped column copied under its task field name (task.columns); a DataError
    naming the file, line, field and the row's columns when a mapped column is missing (unless
    its field is `optional`: computed later, as offline log-probs are by preprocessing)."""
    if not columns:
        return row
    out = dict(row)
    for field, column in columns.items():
        if column not in row and field in optional:
            continue
        if column not in row:
            raise DataError(path, f"column {column!r} (task.columns.{field}) missing; the row has "
                                  f"{', '.join(sorted(row)) or 'no fields'}", line=line, field=field)
        out[field] = row[column]
    return out


def write_jsonl(path: str | Path, rows: list[Row]) -> Path:
    """Write rows as JSONL atomically (a temporary file renamed over the target)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    tmp.replace(path)
    return path


def get_str(path: str | Path, line: int, row: Row, field: str, *, allow_empty: bool = False) -> str:
    """row[field] as a string, or a DataError naming the file, line and field."""
    if field not in row:
        raise DataError(path, f"missing (the row has {', '.join(sorted(row)) or 'no fields'})",
                        line=line, field=field)
    value = row[field]
    if not isinstance(value, str):
        raise DataError(path, f"expected a string, got {type(value).__name__}", line=line,
                        field=field)
    if not allow_empty and not value.strip():
        raise DataError(path, "is empty", line=line, field=field)
    return value


def get_float(path: str | Path, line: int, row: Row, field: str, *,
              optional: bool = False) -> float | None:
    """row[field] as a finite float (None if optional and absent/null), else a DataError."""
    if field not in row or row[field] is None:
        if optional:
            return None
        raise DataError(path, "missing" if field not in row else "is null", line=line, field=field)
    value = row[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(path, f"expected a number, got {type(value).__name__} {value!r:.40}",
                        line=line, field=field)
    if not math.isfinite(value):
        raise DataError(path, f"must be finite, got {value}", line=line, field=field)
    return float(value)
