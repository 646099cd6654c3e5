"""Users' data as the hub and `datasets` lay it out (issue 27): parquet shards in config folders,
the hub cache's snapshots, save_to_disk output, CSV, gzipped JSONL; split names, config
sub-folders and column mapping; a large file streamed one record batch at a time.

The data sets are written here with pyarrow / datasets in the exact column names and folder
structure the hub serves (openai/gsm8k: `main/train-00000-of-00001.parquet`, `socratic/...`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_tba.config import TaskConfig
from hpc_tba.tasks import build_task
from hpc_tba.tasks.layout import check_columns, split_files
from hpc_tba.tasks.math import GSM8KTask, MathTask
from hpc_tba.tasks.records import DataError, iter_rows

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

GSM8K = {
    "train": [{"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"}
              for a in range(1, 9)],
    "test": [{"question": "What is 3 - 5?", "answer": "3 - 5 = -2\n#### -2"},
             {"question": "What is 2 * 6?", "answer": "2 * 6 = 12\n#### 12"}],
}
SOCRATIC = {s: [{"question": r["question"], "answer": "How? " + r["answer"]} for r in rows]
            for s, rows in GSM8K.items()}


def write_parquet(path: Path, rows: list[dict], **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, **kw)
    return path


def gsm8k_repo(root: Path) -> Path:
    """openai/gsm8k as `huggingface-cli download --repo-type dataset openai/gsm8k --local-dir`
    writes it: README.md, main/ and socratic/ with one parquet shard per split."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n"
                                    "  - split: train\n    path: main/train-*\n---\n# GSM8K\n")
    for config, data in (("main", GSM8K), ("socratic", SOCRATIC)):
        for split, rows in data.items():
            write_parquet(root / config / f"{split}-00000-of-00001.parquet", rows)
    return root


def gsm8k_cache(cache: Path) -> Path:
    """The same repo in the hub cache (`huggingface-cli download` without --local-dir):
    datasets--openai--gsm8k/{refs/main, snapshots/<hash>/..., blobs/} with files as symlinks."""
    entry = cache / "datasets--openai--gsm8k"
    commit = "e53f048856ff4f594e959d75785d2c2d37b678ee"
    stage = gsm8k_repo(cache / "stage")
    blobs = entry / "blobs"
    blobs.mkdir(parents=True)
    for f in sorted(stage.rglob("*")):
        if f.is_file():
            blob = blobs / f"{abs(hash(str(f))):x}"
            f.rename(blob)
            link = entry / "snapshots" / commit / f.relative_to(stage)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(blob)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return entry


def answers(task, split="train") -> list[str]:
    return [p.answer for p in task.prompts(split)]


def test_gsm8k_hub_download_and_cache_layouts(tmp_path: Path) -> None:
    repo = gsm8k_repo(tmp_path / "gsm8k")
    task = build_task(TaskConfig(name="gsm8k", path=str(repo), subset="main"))
    assert answers(task) == [str(2 * a) for a in range(1, 9)]
    assert answers(task, "test") == ["-2", "12"]
    socratic = GSM8KTask(TaskConfig(name="gsm8k", path=str(repo), subset="socratic"))
    assert socratic.prompts("test")[0].text.endswith("What is 3 - 5?\n\nSolution:\n")
    with pytest.raises(DataError, match=r"several config sub-folders \(main, socratic\): choose "
                                        r"one with task.subset"):
        GSM8KTask(TaskConfig(name="gsm8k", path=str(repo))).prompts("train")
    with pytest.raises(DataError, match=r"no config sub-folder 'nope' \(task.subset\): the ones "
                                        r"found are main, socratic"):
        GSM8KTask(TaskConfig(name="gsm8k", path=str(repo), subset="nope")).prompts("train")
    # the hub cache entry resolves to refs/main's snapshot; the split folder given directly too
    entry = gsm8k_cache(tmp_path / "hub")
    assert answers(GSM8KTask(TaskConfig(name="gsm8k", path=str(entry), subset="main")),
                   "test") == ["-2", "12"]
    assert answers(GSM8KTask(TaskConfig(name="gsm8k", path=str(repo / "main"),
                                        subset="main")), "test") == ["-2", "12"]


def test_missing_split_lists_the_splits_found_and_split_names_are_configurable(tmp_path: Path) -> None:
    repo = gsm8k_repo(tmp_path / "gsm8k")
    cfg = TaskConfig(name="gsm8k", path=str(repo), subset="main", split_test="validation")
    with pytest.raises(DataError, match=r"main: no file for split 'validation': .* the splits "
                                        r"found are test, train .*task.split_test"):
        GSM8KTask(cfg).prompts("test")
    # train on the test split, evaluate on the train split: the names are the data set's
    cfg = TaskConfig(name="gsm8k", path=str(repo), subset="main", split_train="test",
                     split_test="train")
    assert answers(GSM8KTask(cfg)) == ["-2", "12"] and len(GSM8KTask(cfg).prompts("test")) == 8
    with pytest.raises(ValueError, match="must name splits"):
        TaskConfig(name="gsm8k", path="x", split_test=" ")


def test_sharded_data_folder_save_to_disk_csv_and_gzipped_jsonl(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = GSM8K["train"]
    # data/train-0000N-of-00002.parquet (the hub's layout of a one-config data set), in order
    for i in range(2):
        write_parquet(tmp_path / "shards" / "data" / f"train-{i:05d}-of-00002.parquet",
                      rows[4 * i: 4 * i + 4])
    assert answers(GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path / "shards")))) == \
        [str(2 * a) for a in range(1, 9)]
    # save_to_disk: a DatasetDict (a folder of Arrow shards per split) and a single Dataset
    dd = datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in GSM8K.items()})
    dd.save_to_disk(str(tmp_path / "saved"), num_shards={"train": 2, "test": 1})
    assert len(split_files(tmp_path / "saved", "train")) > 1  # several Arrow shards
    task = GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path / "saved")))
    assert answers(task) == [str(2 * a) for a in range(1, 9)] and answers(task, "test") == ["-2", "12"]
    with pytest.raises(DataError, match=r"saved: no file for split 'validation'.*the splits found "
                                        r"are train, test"):
        task.prompts("validation")
    dd["test"].save_to_disk(str(tmp_path / "one"))
    assert answers(GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path / "one")))) == ["-2", "12"]
    # CSV with a quoted multi-line answer, and a gzipped JSONL (Anthropic/hh-rlhf's format)
    datasets.Dataset.from_list(GSM8K["test"]).to_csv(str(tmp_path / "csv" / "test.csv"))
    assert answers(GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path / "csv"))), "test") == \
        ["-2", "12"]
    import gzip

    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "train.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[:2]) + "\n{oops\n")
    with pytest.raises(DataError, match=r"train.jsonl.gz:4: not valid JSON"):
        GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path / "gz"))).prompts("train")


def test_parquet_errors_name_file_row_and_field(tmp_path: Path) -> None:
    write_parquet(tmp_path / "d" / "train.parquet",
                  [GSM8K["train"][0], {"question": "q", "answer": "no final line"}])
    with pytest.raises(DataError, match=r"train.parquet:2: field 'answer': has no final '####"):
        GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path / "d"))).prompts("train")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"bad/train.parquet: not a readable parquet file"):
        GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path / "bad"))).prompts("train")


def test_column_mapping_is_checked_against_the_first_row(tmp_path: Path) -> None:
    rows = [{"problem": r["question"], "solution_text": r["answer"]} for r in GSM8K["train"]]
    write_parquet(tmp_path / "d" / "train-00000-of-00001.parquet", rows)
    cfg = TaskConfig(name="gsm8k", path=str(tmp_path / "d"),
                     columns={"question": "problem", "answer": "solution_text"})
    assert answers(build_task(cfg)) == [str(2 * a) for a in range(1, 9)]
    bad = TaskConfig(name="gsm8k", path=str(tmp_path / "d"), columns={"question": "problme"})
    with pytest.raises(DataError, match=r"train-00000-of-00001.parquet: field 'question': "
                                        r"task.columns.question='problme': no such column; the "
                                        r"columns found are problem, solution_text"):
        build_task(bad)
    unmapped = TaskConfig(name="gsm8k", path=str(tmp_path / "d"), columns={"question": "problem"})
    with pytest.raises(DataError, match=r"field 'answer': task 'gsm8k' reads 'answer', which the "
                                        r"data does not have .*task.columns.answer=<column>"):
        check_columns(unmapped)
    math_cfg = TaskConfig(name="math", path=str(tmp_path / "d"), columns={"problem": "problem"})
    with pytest.raises(DataError, match=r"reads 'answer' or 'solution'"):
        check_columns(math_cfg)
    ok = MathTask(TaskConfig(name="math", path=str(tmp_path / "d"),
                             columns={"solution": "solution_text"}))
    with pytest.raises(DataError, match=r"parquet:1: field 'solution': has no \\boxed"):
        ok.prompts("train")
    # at config time: field names the task does not read, and tasks that read no files
    with pytest.raises(ValueError, match=r"task.columns.questoin: task 'gsm8k' has no field "
                                         r"'questoin'; its fields are question, answer"):
        TaskConfig(name="gsm8k", path="x", columns={"questoin": "problem"})
    with pytest.raises(ValueError, match="task 'arithmetic' reads no files"):
        TaskConfig(columns={"question": "q"})


def test_columns_compose_from_the_command_line(tmp_path: Path) -> None:
    from hpc_tba.assembly.compose import compose

    cfg = compose(["task=gsm8k", "task.path=/x", "task.columns.question=problem",
                   "task.split_test=validation", "task.subset=main"])
    assert cfg.task.columns == {"question": "problem"} and cfg.task.split_test == "validation"


def test_a_large_sharded_file_is_streamed_one_record_batch_at_a_time(tmp_path: Path) -> None:
    """4 shards x 2000 rows of ~1 KB (row groups of 250 rows): peak Arrow memory while reading
    the first rows and the whole split stays about one shard (measured 0.13-0.96 shard for the
    first 10 rows, pyarrow reading ahead on its threads; 0.3-1.03 shard for all 8000), never the
    four files together."""
    shard_rows, pad = 2000, "x" * 1000
    for i in range(4):
        write_parquet(tmp_path / "big" / f"train-{i:05d}-of-00004.parquet",
                      [{"question": f"{pad} {i}-{j}", "answer": f"#### {j}"} for j in range(shard_rows)],
                      row_group_size=250)
    shard_bytes = shard_rows * 1000
    files = split_files(tmp_path / "big", "train")
    assert len(files) == 4

    def peak(limit: int) -> tuple[int, int]:
        pa.default_memory_pool().release_unused()
        base, top, n = pa.total_allocated_bytes(), 0, 0
        for f in files:
            for _ in iter_rows(f):
                n += 1
                top = max(top, pa.total_allocated_bytes() - base)
                if n >= limit:
                    return n, top
        return n, top

    n, top_first = peak(10)
    assert n == 10 and top_first < 1.5 * shard_bytes, top_first
    n, top_all = peak(10 ** 9)
    print(f"peak Arrow bytes: first 10 rows {top_first}, all rows {top_all}, one shard {shard_bytes}")
    assert n == 4 * shard_rows and top_all < 1.5 * shard_bytes, top_all
    task = GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path / "big"), max_prompts=3))
    assert answers(task) == ["0", "1", "2"]


def test_offline_columns_map_reading_and_preprocessing(tmp_path: Path) -> None:
    from hpc_tba.tasks.offline import preprocess, read_offline

    rows = [{"query": f"{a}+1=", "answer_text": str(a + 1), "score": float(a % 2)} for a in range(4)]
    path = tmp_path / "scored.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = {"prompt": "query", "response": "answer_text", "reward": "score", "logp_behavior": "mu"}
    task = build_task(TaskConfig(name="offline", path=str(path), columns=columns))
    assert [ex.reward for ex in task.examples()] == [0.0, 1.0, 0.0, 1.0]
    out = preprocess(path, behavior_fn=lambda ps, rs: [-float(len(r)) for r in rs], temperature=1.0,
                     columns=columns)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mu"] for r in written] == [-1.0, -1.0, -1.0, -1.0] and "logp_behavior" not in written[0]
    assert [ex.logp_behavior for ex in read_offline(out, columns)] == [-1.0] * 4
    with pytest.raises(DataError, match=r"scored.jsonl: field 'reward': task 'offline' reads 'reward'"):
        check_columns(TaskConfig(name="offline", path=str(path), columns={"prompt": "query",
                                                                          "response": "answer_text"}))
