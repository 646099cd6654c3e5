"""Reading user data files (JSONL, parquet, JSON) into rows; errors name the file, line and field.

Users bring their data sets as local files (compute nodes are usually offline), so the first thing
that goes wrong is the file itself. Every row comes back with its 1-based line number (JSONL) or
row number (parquet, JSON list) so that a validation error can point at the exact place.

Parquet needs `pyarrow`, which hpc_tba does not depend on: reading a parquet file without it
raises a DataError that says which package to install.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Row = dict[str, Any]

SUFFIXES = (".jsonl", ".json", ".parquet")
"""File types `read_rows` understands."""


class DataError(ValueError):
    """A data file that cannot be used; the message names the file, the line and the field."""

    def __init__(self, path: str | Path, message: str, *, line: int | None = None,
                 field: str | None = None):
        where = str(path) + (f":{line}" if line is not None else "")
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{where}: {what}{message}")
        self.path, self.line, self.field = str(path), line, field


def read_rows(path: str | Path) -> list[tuple[int, Row]]:
    """All rows of a JSONL, JSON (a list of objects or one object) or parquet file, numbered.

    Returns (line, row) pairs: the line number in a JSONL file (blank lines skipped but counted),
    else the 1-based row number. Raises DataError for an unreadable file, a row that is not a JSON
    object, or a file with no rows at all (an empty split is always a mistake).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "no such file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = list(_read_jsonl(path))
    elif suffix == ".json":
        rows = _read_json(path)
    elif suffix == ".parquet":
        rows = _read_parquet(path)
    else:
        raise DataError(path, f"unknown file type {suffix!r}; expected one of "
                              f"{', '.join(SUFFIXES)}")
    if not rows:
        raise DataError(path, "the file holds no rows")
    return rows


def _read_jsonl(path: Path) -> Iterator[tuple[int, Row]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(path, f"not valid JSON ({e.msg} at column {e.colno})",
                                line=n) from None
            if not isinstance(row, dict):
                raise DataError(path, f"expected a JSON object, got {type(row).__name__}", line=n)
            yield n, row


def _read_json(path: Path) -> list[tuple[int, Row]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(path, f"not valid JSON ({e.msg})", line=e.lineno) from None
    items = data if isinstance(data, list) else [data]
    for n, row in enumerate(items, start=1):
        if not isinstance(row, dict):
            raise DataError(path, f"expected a JSON object, got {type(row).__name__}", line=n)
    return list(enumerate(items, start=1))


def _read_parquet(path: Path) -> list[tuple[int, Row]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(path, "reading parquet needs the `pyarrow` package (pip install pyarrow), "
                              "or convert the file to JSONL") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DataError(path, f"not a readable parquet file ({e})") from None
    return list(enumerate(table.to_pylist(), start=1))


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


def split_files(path: str | Path, split: str) -> list[Path]:
    """The file(s) holding `split` of a data set at `path`, by convention.

    - a path containing `{split}` (e.g. `data/gsm8k/{split}.jsonl`): that path with the split name;
    - a file: that file, whatever the split (for a data set used for one purpose only);
    - a directory: the first that exists of `<split>.jsonl`, `<split>.json`, `<split>.parquet`,
      `<split>-*.parquet` (Hugging Face shards, in name order), `<split>/**/*.json` (the original
      MATH archive: one problem per file).
    Raises DataError naming what was looked for when nothing matches.
    """
    if "{split}" in str(path):
        path = Path(str(path).replace("{split}", split))
        if not path.is_file():
            raise DataError(path, f"no such file for split {split!r}")
        return [path]
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(path, "no such file or directory")
    for name in (f"{split}.jsonl", f"{split}.json", f"{split}.parquet"):
        if (path / name).is_file():
            return [path / name]
    for found in (sorted(path.glob(f"{split}-*.parquet")), sorted(path.glob(f"{split}/**/*.json"))):
        if found:
            return found
    raise DataError(path, f"no file for split {split!r}: looked for {split}.jsonl, {split}.json, "
                          f"{split}.parquet, {split}-*.parquet and {split}/**/*.json")
