"""Offline data for TOPR / A-LoL: reading with per-line errors, curation, and preprocessing."""
import json
from pathlib import Path

import numpy as np
import pytest

from hpc_tba.tasks.offline import (
    OfflineExample,
    alol_sampling_probs,
    anna_karenina,
    baseline_for_target,
    effective_positive_fraction,
    positive_fraction,
    preprocess,
    preprocessed_path,
    read_offline,
    require_fields,
    write_offline,
)
from hpc_tba.tasks.records import DataError


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    {"prompt": "1+1=", "response": "2", "reward": 1, "logp_behavior": -0.5, "id": "a"},
    {"prompt": "1+1=", "response": "3", "reward": -1, "logp_behavior": None},
    {"prompt": "2+2=", "response": "four", "reward": 1.0},
    {"prompt": "2+2=", "response": "", "reward": -1.0, "logp_ref": -9.0},
]


def test_read_offline(tmp_path: Path) -> None:
    ex = read_offline(write(tmp_path / "d.jsonl", ROWS))
    assert [(e.prompt, e.response, e.reward) for e in ex] == [
        ("1+1=", "2", 1.0), ("1+1=", "3", -1.0), ("2+2=", "four", 1.0), ("2+2=", "", -1.0)]
    assert [e.logp_behavior for e in ex] == [-0.5, None, None, None]
    assert ex[3].logp_ref == -9.0 and ex[0].source.endswith("d.jsonl:1")
    with pytest.raises(DataError, match=r"d.jsonl:2: field 'logp_behavior': missing; run"):
        require_fields(ex, "logp_behavior")


@pytest.mark.parametrize("row,match", [
    ({"prompt": "p", "response": "r", "reward": "1"},
     r"field 'reward': expected a number, got str"),
    ({"prompt": "p", "response": "r", "reward": True},
     r"field 'reward': expected a number, got bool"),
    ('{"prompt": "p", "response": "r", "reward": NaN}', r"field 'reward': must be finite"),
    ({"prompt": "p", "response": "r"}, r"field 'reward': missing"),
    ({"response": "r", "reward": 1}, r"field 'prompt': missing \(the row has response, reward\)"),
    ({"prompt": "p", "response": 3, "reward": 1}, r"field 'response': expected a string, got int"),
    ({"prompt": "p", "response": "r", "reward": 1, "advantage": "high"}, r"field 'advantage'"),
    ("[1, 2]", r"expected a JSON object, got list"),
])
def test_bad_rows_name_file_line_field(tmp_path: Path, row: object, match: str) -> None:
    path = write(tmp_path / "bad.jsonl", [ROWS[0], row])
    with pytest.raises(DataError, match=r"bad.jsonl:2: " + match):
        read_offline(path)


def test_empty_and_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="holds no rows"):
        read_offline(write(tmp_path / "e.jsonl", []))
    (tmp_path / "x.tsv").write_text("a\tb\n")  # CSV is read since issue 27 (through datasets)
    with pytest.raises(DataError, match="unknown file type '.tsv'"):
        read_offline(tmp_path / "x.tsv")


def test_effective_positive_fraction_hand_computed() -> None:
    assert effective_positive_fraction(0.5, 0.5) == pytest.approx(0.25)
    assert effective_positive_fraction(0.8, 0.0) == pytest.approx(0.8)
    assert effective_positive_fraction(0.2, -0.5) == pytest.approx(0.3 / 0.7)
    # Direct count: 30 positives weighted (1-c), 70 negatives weighted (1+c).
    p, c = 0.3, 0.4
    assert effective_positive_fraction(p, c) == pytest.approx(30 * 0.6 / (30 * 0.6 + 70 * 1.4))
    with pytest.raises(ValueError):
        effective_positive_fraction(1.5, 0.0)


def test_baseline_for_target_inverts() -> None:
    assert baseline_for_target(0.5, 0.25) == pytest.approx(0.5)
    for p in (0.05, 0.3, 0.5, 0.9):
        for target in (0.1, 0.15, 0.2, 0.6):
            c = baseline_for_target(p, target)
            assert -1 < c < 1
            assert effective_positive_fraction(p, c) == pytest.approx(target)
    assert baseline_for_target(0.6, 0.1) > 0 > baseline_for_target(0.05, 0.1)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        baseline_for_target(0.0, 0.1)


def test_anna_karenina_curation() -> None:
    mk = lambda p, r, w: OfflineExample(p, r, w)
    rows = [mk("A", "w1", -1), mk("A", "r1", 1), mk("A", "r2", 1), mk("A", "w2", -1),
            mk("B", "r1", 1), mk("C", "w1", 0), mk("B", "r2", 1)]
    kept = anna_karenina(rows)
    assert [(e.prompt, e.response) for e in kept] == [
        ("A", "w1"), ("A", "r1"), ("A", "w2"), ("B", "r1"), ("C", "w1")]
    assert positive_fraction(rows) == pytest.approx(4 / 7)
    assert positive_fraction(kept) == pytest.approx(2 / 5)


def test_alol_sampling_probs() -> None:
    np.testing.assert_allclose(alol_sampling_probs([1.0, -2.0, 3.0, 0.0]), [0.25, 0, 0.75, 0])
    with pytest.raises(ValueError, match="nothing to train on"):
        alol_sampling_probs([-1.0, 0.0])


def test_preprocess_fills_missing_and_writes_next_to_data(tmp_path: Path) -> None:
    src = write(tmp_path / "hh.jsonl", ROWS)
    calls: list[tuple[str, int]] = []

    def behavior(prompts: list, responses: list) -> list:
        calls.append(("behavior", len(prompts)))
        return [-float(len(r)) - 1 for r in responses]

    def ref(prompts: list, responses: list) -> list:
        calls.append(("ref", len(prompts)))
        return [-2.0] * len(prompts)

    def value(prompts: list) -> list:
        calls.append(("value", len(prompts)))
        return [{"1+1=": 0.25, "2+2=": -0.5}[p] for p in prompts]

    out = preprocess(src, behavior_fn=behavior, ref_fn=ref, value_fn=value, batch_size=2)
    assert out == preprocessed_path(src) == tmp_path / "hh.preprocessed.jsonl"
    # Rows 2-4 lack logp_behavior (2 batches of <= 2), rows 1-3 lack logp_ref; 2 distinct prompts.
    assert calls == [("behavior", 2), ("behavior", 1), ("ref", 2), ("ref", 1), ("value", 2)]
    ex = read_offline(out)
    assert [e.logp_behavior for e in ex] == [-0.5, -2.0, -5.0, -1.0]  # row 1 kept as given
    assert [e.logp_ref for e in ex] == [-2.0, -2.0, -2.0, -9.0]
    assert [e.advantage for e in ex] == [0.75, -1.25, 1.5, -0.5]
    assert json.loads(out.read_text().splitlines()[0])["id"] == "a"  # extra fields kept
    assert read_offline(src)[1].logp_behavior is None  # the source is untouched
    # Resuming from the output computes nothing more.
    calls.clear()
    preprocess(out, behavior_fn=behavior, out=tmp_path / "again.jsonl")
    assert calls == []


def test_preprocess_rejects_bad_model_outputs(tmp_path: Path) -> None:
    src = write(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match="returned 1 values for 3 inputs"):
        preprocess(src, behavior_fn=lambda p, r: [0.0])
    with pytest.raises(ValueError, match="non-finite"):
        preprocess(src, ref_fn=lambda p, r: [float("nan")] * len(p))
    assert not preprocessed_path(src).exists()


def test_write_offline_roundtrip(tmp_path: Path) -> None:
    ex = [OfflineExample("p", "r", 1.0, logp_behavior=-3.0), OfflineExample("q", "s", -1.0)]
    back = read_offline(write_offline(tmp_path / "w.jsonl", ex))
    assert [(e.prompt, e.response, e.reward, e.logp_behavior) for e in back] == [
        ("p", "r", 1.0, -3.0), ("q", "s", -1.0, None)]


def test_parquet_offline(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([ROWS[0], ROWS[2]]), tmp_path / "d.parquet")
    ex = read_offline(tmp_path / "d.parquet")
    assert [(e.response, e.logp_behavior) for e in ex] == [("2", -0.5), ("four", None)]


def test_offline_task_from_config(tmp_path: Path) -> None:
    from hpc_tba.assembly.compose import compose
    from hpc_tba.tasks import build_task

    write(tmp_path / "train.jsonl", ROWS + [{"prompt": "1+1=", "response": "two", "reward": 1}])
    cfg = compose(["task=offline", f"task.path={tmp_path}", "task.curation=anna_karenina"])
    task = build_task(cfg.task)
    # Anna Karenina drops the second correct answer to "1+1=".
    assert [e.response for e in task.examples("train")] == ["2", "3", "four", ""]
    assert [(p.id, p.text) for p in task.prompts("train")] == [(0, "1+1="), (1, "2+2=")]
    p = task.prompts("train")
    rewards, failed = task.rewards([p[0], p[0], p[1]], ["3", "unseen", "four"])
    assert rewards.tolist() == [-1.0, 0.0, 1.0] and failed == 1
    with pytest.raises(ValueError, match="task.curation='best' must be"):
        compose(["task=offline", f"task.path={tmp_path}", "task.curation=best"])
