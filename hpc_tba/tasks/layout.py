"""Where a split of a data set lives: the folder layouts users download, resolved to data files.

`task.path` may be
- a path containing `{split}` (e.g. `data/gsm8k/{split}.jsonl`): that path with the split name;
- a file: that file, whatever the split (a data set used for one purpose only);
- a directory, in any of the layouts the Hugging Face hub and `datasets` produce:
  - the hub cache's `datasets--org--name` folder (`huggingface-cli download` without
    `--local-dir`): its snapshot named by `refs/main` (or its only snapshot);
  - a repository downloaded with `--local-dir` (or that snapshot): split files at the top
    (`train.jsonl`, `test.parquet`, `train-00000-of-00002.parquet`, `train.jsonl.gz`), under `data/`,
    in a split folder (`train/0000.parquet`, the original MATH archive's `train/<type>/<n>.json`),
    or in config sub-folders (openai/gsm8k: `main/train-00000-of-00001.parquet`,
    `socratic/...`), one of which `task.subset` picks (the only one holding the split when unset);
  - `datasets.save_to_disk` output: a DatasetDict (`dataset_dict.json`, one folder of Arrow shards
    per split) or one Dataset (`state.json` + Arrow shards: every split, like a single file).

A split that is not there is a DataError listing the splits (and config sub-folders) found.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from hpc_tba.tasks.records import SUFFIXES, DataError, Row, data_suffix, first_row, iter_rows, mapped

SHARD = re.compile(r"^(?P<split>.+?)[-_]\d+(-of-\d+)?([-_.].*)?$")
"""`train-00000-of-00002` (the hub's shards, maybe with a hash after), `train_0`: split `train`."""


def snapshot_of(path: Path) -> Path:
    """The snapshot folder of a hub cache entry `datasets--org--name` (refs/main, else the only
    snapshot); `path` itself if it is not one."""
    snaps = path / "snapshots"
    if not snaps.is_dir():
        return path
    ref = path / "refs" / "main"
    if ref.is_file() and (snaps / ref.read_text().strip()).is_dir():
        return snaps / ref.read_text().strip()
    found = sorted(p for p in snaps.iterdir() if p.is_dir())
    if len(found) == 1:
        return found[0]
    raise DataError(path, f"a hub cache entry with {len(found)} snapshots "
                          f"({', '.join(p.name for p in found) or 'none'}) and no refs/main: set "
                          "task.path to the snapshot folder you want")


def split_files(path: str | Path, split: str, *, subset: str = "") -> list[Path]:
    """The data file(s) holding `split` of the data set at `path`, in order (module docstring).

    `subset` names the config sub-folder where the data set has several (gsm8k: main, socratic);
    a data set whose split is not in sub-folders ignores it. Raises DataError naming what was
    looked for and the splits found when nothing matches."""
    if "{split}" in str(path):
        path = Path(str(path).replace("{split}", split)).expanduser()
        if not path.is_file():
            raise DataError(path, f"no such file for split {split!r}")
        return [path]
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(path, "no such file or directory")
    root = snapshot_of(path)
    if subset and (root / subset).is_dir():
        root = root / subset
    found = _direct(root, split)
    if found is not None:
        return found
    if subset and not (root / subset).is_dir() and _subsets(root):
        raise DataError(root, f"no config sub-folder {subset!r} (task.subset): the ones found are "
                              f"{', '.join(_subsets(root))}")
    holding = [s for s in _subsets(root) if _direct(root / s, split) is not None]
    if len(holding) == 1:
        return _direct(root / holding[0], split) or []
    if len(holding) > 1:
        raise DataError(root, f"split {split!r} is in several config sub-folders "
                              f"({', '.join(holding)}): choose one with task.subset=NAME")
    raise DataError(root, missing_split_message(root, split))


def sources(path: str | Path, split: str, subsets: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """The files of `split` across config sub-folders (for converters): those of each named
    subset, in order; none named: the folder's own, else every sub-folder holding the split."""
    if subsets:
        return [f for s in subsets for f in split_files(path, split, subset=s)]
    root = Path(path).expanduser()
    if root.is_dir():
        root = snapshot_of(root)
        if _direct(root, split) is None:
            holding = [s for s in _subsets(root) if _direct(root / s, split) is not None]
            if holding:
                return [f for s in holding for f in _direct(root / s, split) or []]
    return split_files(path, split)


def describe(path: str | Path) -> dict[str, list[str]]:
    """{"<subset or .>": [splits found]} of a data set folder (for `hpc-tba data show`)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return {".": ["(one file: every split)"]}
    root = snapshot_of(root)
    out = {".": splits_found(root)} if splits_found(root) else {}
    out.update({s: splits_found(root / s) for s in _subsets(root)})
    return out


def missing_split_message(root: Path, split: str) -> str:
    """`no file for split ...`: what was looked for, the splits and sub-folders found."""
    ext = ", ".join(f"{split}{s}" for s in SUFFIXES[:4])
    splits, subsets = splits_found(root), _subsets(root)
    found = f"the splits found are {', '.join(splits)}" if splits else "no split found"
    if subsets:
        found += f"; config sub-folders (task.subset): {', '.join(subsets)}"
    return (f"no file for split {split!r}: looked for {ext}, {split}-*.<ext>, data/{split}*, "
            f"{split}/**; {found} (the split names are task.split_train / task.split_test)")


def splits_found(root: Path) -> list[str]:
    """The split names a folder holds (files named by split, split folders, save_to_disk)."""
    dd = _dataset_dict(root)
    if dd is not None:
        return dd
    names = set(_file_splits(root)) | set(_file_splits(root / "data"))
    subsets = set(_subsets(root))
    for sub in _subdirs(root):
        if sub.name not in subsets and sub.name != "data" and _has_data(sub):
            names.add(sub.name)
    return sorted(names)


def _direct(d: Path, split: str) -> list[Path] | None:
    """Files of `split` in folder `d` itself (no config sub-folders), or None."""
    dd = _dataset_dict(d)
    if dd is not None:
        if split not in dd:
            return None
        return _arrow_files(d / split)
    if (d / "state.json").is_file():  # one save_to_disk Dataset: every split
        return _arrow_files(d)
    for where in (d, d / "data"):
        if not where.is_dir():
            continue
        for suffix in SUFFIXES:
            if (where / f"{split}{suffix}").is_file():
                return [where / f"{split}{suffix}"]
        shards = sorted(p for p in where.iterdir() if p.is_file() and data_suffix(p)
                        and _split_of(p) == split)
        if shards:
            return shards
    folder = d / split
    if folder.is_dir():
        if (folder / "state.json").is_file():
            return _arrow_files(folder)
        files = sorted(p for p in folder.rglob("*") if p.is_file() and data_suffix(p))
        if files:
            kinds = {data_suffix(p) for p in files}
            if len(kinds) > 1:
                raise DataError(folder, f"holds data files of several types ({', '.join(sorted(kinds))})"
                                        ": keep one")
            return files
    return None


def _split_of(p: Path) -> str:
    stem = p.name[: -len(data_suffix(p))]
    m = SHARD.match(stem)
    return m.group("split") if m else stem


def _file_splits(d: Path) -> list[str]:
    if not d.is_dir():
        return []
    return sorted({_split_of(p) for p in d.iterdir() if p.is_file() and data_suffix(p)})


def _subdirs(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))


def _has_data(d: Path) -> bool:
    return any(p.is_file() and data_suffix(p) for p in d.rglob("*"))


def _subsets(root: Path) -> list[str]:
    """Config sub-folders: those holding split files of their own (or save_to_disk output)."""
    if _dataset_dict(root) is not None or (root / "state.json").is_file():
        return []
    return [s.name for s in _subdirs(root) if s.name != "data" and (
        _file_splits(s) or _file_splits(s / "data") or _dataset_dict(s) is not None
        or (s / "state.json").is_file())]


def _dataset_dict(d: Path) -> list[str] | None:
    """The splits of a save_to_disk DatasetDict folder, or None if `d` is not one."""
    f = d / "dataset_dict.json"
    if not f.is_file():
        return None
    try:
        splits = json.loads(f.read_text())["splits"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f, "not a datasets DatasetDict index (expected {\"splits\": [...]})") from None
    return [str(s) for s in splits]


def _arrow_files(d: Path) -> list[Path]:
    """The Arrow shards of a save_to_disk Dataset folder, as its state.json lists them."""
    state = d / "state.json"
    if not state.is_file():
        raise DataError(d, "not a datasets save_to_disk folder (no state.json)")
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(state, "not a datasets state.json (expected _data_files)") from None
    files = [d / n for n in names]
    for f in files:
        if not f.is_file():
            raise DataError(f, "no such file (listed in state.json)")
    return files


# --------------------------------------------------------------------------- a task's data

REQUIRED: dict[str, tuple[str | tuple[str, ...], ...]] = {
    "gsm8k": ("question", "answer"),
    "math": ("problem", ("answer", "solution")),
    "preference": ("prompt",),
    "redteam": ("prompt",),
    "offline": ("prompt", "response", "reward"),
}
"""Fields every row of a file-backed task must have (a tuple: one of them)."""
COMPUTED = {"offline": ("logp_behavior", "logp_ref", "advantage", "logp_temperature")}
"""Fields whose mapped column may be absent: `hpc-tba preprocess` writes them under that name."""


def split_name(cfg, split: str) -> str:
    """The data set's name for the task's split: task.split_train for "train", task.split_test
    for "test", any other name as it is."""
    return {"train": cfg.split_train, "test": cfg.split_test}.get(split, split)


def task_files(cfg, split: str) -> list[Path]:
    """The files of the task's `split` (task.path, task.subset, task.split_train/split_test)."""
    return split_files(cfg.path, split_name(cfg, split), subset=cfg.subset)


def task_rows(cfg, split: str) -> Iterator[tuple[Path, int, Row]]:
    """(file, line, row) of every row of the task's `split`, streamed, columns mapped."""
    for path in task_files(cfg, split):
        for line, row in iter_rows(path):
            yield path, line, mapped(path, line, row, cfg.columns)


def check_columns(cfg) -> None:
    """Check task.columns and the task's required fields against the first row of its data (the
    train split, else the test split): a DataError naming the file, the wanted field and the
    columns found. A task that reads no files passes."""
    if cfg.name not in REQUIRED or not cfg.path:
        return
    files, error = None, None
    for split in ("train", "test"):
        try:
            files = task_files(cfg, split)
            break
        except DataError as e:
            error = error or e
    if files is None:
        assert error is not None
        raise error
    path = files[0]
    row = first_row(path)
    found = ", ".join(sorted(row)) or "none"
    computed = COMPUTED.get(cfg.name, ())
    for field, column in cfg.columns.items():
        if column not in row and field not in computed:
            raise DataError(path, f"task.columns.{field}={column!r}: no such column; the columns "
                                  f"found are {found}", field=field)
    row = mapped(path, 1, row, cfg.columns, computed)
    for need in REQUIRED[cfg.name]:
        alts = need if isinstance(need, tuple) else (need,)
        if not any(a in row for a in alts):
            wanted = " or ".join(repr(a) for a in alts)
            raise DataError(path, f"task {cfg.name!r} reads {wanted}, which the data does not have "
                                  f"(the columns found are {found}): name its column with "
                                  f"task.columns.{alts[0]}=<column>", field=alts[0])
