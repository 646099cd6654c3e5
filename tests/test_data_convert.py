"""`hpc-tba data` converters (issue 27) on tiny copies of the hub's data sets, in their exact
column names and folder layouts: Anthropic/hh-rlhf (`<subset>/train.jsonl.gz`, rows
`{"chosen", "rejected"}` whole dialogues) into task=offline rows, and the TL;DR variants
(trl-lib/tldr `prompt`/`completion`, CarperAI `prompt`/`label`, `post`/`summary`,
openai/summarize_from_feedback `info`/`summaries`/`choice`) into task=preference rows."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hpc_tba.cli.main import main
from hpc_tba.config import TaskConfig
from hpc_tba.tasks.convert import hh_rows, tldr_row
from hpc_tba.tasks.offline import OfflineTask
from hpc_tba.tasks.preference import load_prompts
from hpc_tba.tasks.records import DataError


def dialogue(*turns: str) -> str:
    return "".join(f"\n\n{'Human' if i % 2 == 0 else 'Assistant'}: {t}" for i, t in enumerate(turns))


def hh_pairs(n: int, tag: str) -> list[dict]:
    rows = []
    for i in range(n):
        head = ("How do I keep basil alive?", "Water it when the soil is dry.\n\nAnd give it sun.",
                f"What about pot {tag}{i}?")
        rows.append({"chosen": dialogue(*head, f"Use a pot with drainage holes ({i})."),
                     "rejected": dialogue(*head, "Plants are boring.")})
    return rows


def write_gz(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def hh_download(root: Path) -> Path:
    """Anthropic/hh-rlhf as `huggingface-cli download --repo-type dataset --local-dir` writes it."""
    (root).mkdir(parents=True)
    (root / "README.md").write_text("# HH-RLHF\n")
    for subset in ("harmless-base", "helpful-base"):
        write_gz(root / subset / "train.jsonl.gz", hh_pairs(4, subset))
        write_gz(root / subset / "test.jsonl.gz", hh_pairs(2, subset))
    write_gz(root / "red-team-attempts" / "red_team_attempts.jsonl.gz",
             [{"transcript": dialogue("hi", "hello"), "rating": 0}])
    return root


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_hh_pair_splits_at_the_last_assistant_turn() -> None:
    row = hh_pairs(1, "x")[0]
    rows, what = hh_rows("f", 1, row)
    assert what == "ok" and [r["reward"] for r in rows] == [1.0, 0.0]
    assert rows[0]["prompt"] == rows[1]["prompt"] == dialogue(
        "How do I keep basil alive?", "Water it when the soil is dry.\n\nAnd give it sun.",
        "What about pot x0?") + "\n\nAssistant:"
    assert rows[0]["response"] == " Use a pot with drainage holes (0)." and rows[1]["response"] == " Plants are boring."
    mismatch = {"chosen": row["chosen"], "rejected": dialogue("Other question?", "No.")}
    assert hh_rows("f", 2, mismatch) == ([], "mismatch")
    assert hh_rows("f", 3, {"chosen": row["chosen"], "rejected": row["chosen"]}) == ([], "tie")
    only, _ = hh_rows("f", 4, row, chosen_reward=2.0, responses="chosen")
    assert [r["reward"] for r in only] == [2.0]
    with pytest.raises(DataError, match=r"f:5: field 'rejected': ends with a human turn"):
        hh_rows("f", 5, {"chosen": row["chosen"], "rejected": dialogue("a", "b", "c")})
    with pytest.raises(DataError, match=r"f:6: field 'chosen': missing"):
        hh_rows("f", 6, {"transcript": "x"})


def test_hpc_tba_data_hh_rlhf_writes_offline_rows(tmp_path: Path, capsys) -> None:
    src = hh_download(tmp_path / "hh-rlhf")
    assert main(["data", "show", str(src)]) == 0
    shown = capsys.readouterr().out
    assert "harmless-base\ttest\t1 file(s)\tcolumns: chosen, rejected" in shown
    assert "red-team-attempts\tred_team_attempts" in shown
    out = tmp_path / "hh"
    assert main(["data", "hh-rlhf", str(src), str(out), "--rejected-reward", "-1"]) == 0
    assert "wrote" in capsys.readouterr().out
    train = read_jsonl(out / "train.jsonl")
    assert len(train) == 2 * 8 and len(read_jsonl(out / "test.jsonl")) == 2 * 4
    assert [r["reward"] for r in train[:2]] == [1.0, -1.0] and train[0]["label"] == "chosen"
    # the offline task reads it: one prompt per pair, the file's rewards
    task = OfflineTask(TaskConfig(name="offline", path=str(out / "train.jsonl")))
    assert len(task.prompts("train")) == 8 and len(task.examples()) == 16
    # one subset only; a split that is not there is an error listing the ones found
    assert main(["data", "hh-rlhf", str(src), str(tmp_path / "one"), "--subset", "helpful-base",
                 "--split", "test"]) == 0
    assert len(read_jsonl(tmp_path / "one" / "test.jsonl")) == 4
    assert main(["data", "hh-rlhf", str(src), str(tmp_path / "x"), "--subset", "helpful-base",
                 "--split", "validation"]) == 2
    assert "the splits found are test, train" in capsys.readouterr().err


POST = {"subreddit": "relationships", "title": "My friend never answers",
        "post": "We used to talk every day. Now she never replies."}
PROMPT = ("SUBREDDIT: r/relationships\n\nTITLE: My friend never answers\n\nPOST: We used to talk "
          "every day. Now she never replies.\n\nTL;DR:")


@pytest.mark.parametrize("row,reference", [
    ({"prompt": PROMPT, "completion": " friend ignores me"}, " friend ignores me"),  # trl-lib/tldr
    ({"prompt": PROMPT, "label": "friend ignores me"}, " friend ignores me"),  # CarperAI
    ({"prompt": PROMPT, "chosen": "friend ignores me", "rejected": "?"}, " friend ignores me"),
    ({**POST, "summary": "friend ignores me"}, " friend ignores me"),
    ({"info": {"id": "t3_x", **POST, "site": None}, "split": "train", "choice": 1, "worker": "w",
      "summaries": [{"text": " bad one", "policy": "a", "note": None},
                    {"text": " friend ignores me", "policy": "b", "note": None}]}, " friend ignores me"),
    ({"info": {"id": "t3_x", **POST}, "summary": {"text": "friend ignores me", "axes": {}}},
     " friend ignores me"),
])
def test_tldr_layouts_give_the_same_preference_row(row: dict, reference: str) -> None:
    assert tldr_row("f", 1, row) == {"prompt": PROMPT, "reference": reference}


def test_tldr_errors_and_a_post_without_title() -> None:
    assert tldr_row("f", 1, {"post": "p", "summary": "s"})["prompt"] == "POST: p\n\nTL;DR:"
    with pytest.raises(DataError, match=r"f:2: not a TL;DR layout .*the row has text"):
        tldr_row("f", 2, {"text": "x"})
    with pytest.raises(DataError, match=r"f:3: field 'summaries': expected a list of summaries"):
        tldr_row("f", 3, {"info": POST, "summaries": [], "choice": 0})


def test_hpc_tba_data_tldr_from_summarize_from_feedback_parquet(tmp_path: Path, capsys) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = tmp_path / "summarize_from_feedback"
    for split, n in (("train", 3), ("validation", 2)):
        rows = [{"info": {"id": f"t3_{i}", "post": f"post {i} text", "title": f"title {i}",
                          "subreddit": "AskReddit", "site": None},
                 "summaries": [{"text": f" a{i}", "policy": "p", "note": None},
                               {"text": f" b{i}", "policy": "q", "note": None}],
                 "choice": i % 2, "worker": "w", "batch": "b", "split": split}
                for i in range(n) for _ in range(2)]  # two comparisons per post
        (src / "comparisons").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), src / "comparisons" / f"{split}-00000-of-00001.parquet")
    out = tmp_path / "tldr"
    assert main(["data", "tldr", str(src), str(out), "--subset", "comparisons"]) == 0
    assert "duplicates 3" in capsys.readouterr().out
    train = read_jsonl(out / "train.jsonl")
    assert [r["reference"] for r in train] == [" a0", " b1", " a2"]
    cfg = TaskConfig(name="preference", path=str(out), reward_model="rm", split_test="validation")
    assert [p.answer for p in load_prompts(cfg, "validation", answer_field="reference")] == [" a0", " b1"]
