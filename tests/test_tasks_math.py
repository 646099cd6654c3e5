"""GSM8K and MATH tasks from real files in their public formats, and the errors bad data gets."""
import json
from pathlib import Path

import numpy as np
import pytest

from hpc_tba.config import TaskConfig
from hpc_tba.tasks import TASKS, build_task
from hpc_tba.tasks.math import GSM8KTask, MathTask
from hpc_tba.tasks.records import DataError

GSM8K_TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
               "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
                 "babysitting. How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
               "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "A company pays $1,250 a week. How much in 4 weeks?",
     "answer": "1,250 * 4 = 5,000\n#### 5,000"},
]
GSM8K_TEST = [{"question": "What is 3 - 5?", "answer": "3 - 5 = -2\n#### -2"}]
MATH_ROWS = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
     "solution": "We have $\\frac{1}{2} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
     "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Solve for the interval.", "solution": "It is $\\boxed{(0,\\infty)}$.",
     "level": "Level 3", "type": "Algebra"},
]
TEMPLATE = "[MATH TASK] Problem:\n{q}\n\nSolution:\n"


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def gsm8k_dir(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", GSM8K_TRAIN)
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", GSM8K_TEST)
    return tmp_path / "gsm8k"


def test_registered() -> None:
    assert TASKS["gsm8k"] is GSM8KTask and TASKS["math"] is MathTask


def test_gsm8k_prompts_and_answers(gsm8k_dir: Path) -> None:
    task = build_task(TaskConfig(name="gsm8k", path=str(gsm8k_dir)))
    train = task.prompts("train")
    assert [p.id for p in train] == [0, 1, 2]
    assert train[0].text == TEMPLATE.format(q=GSM8K_TRAIN[0]["question"])
    assert [p.answer for p in train] == ["72", "10", "5,000"]
    test = task.prompts("test")
    assert [(p.id, p.answer) for p in test] == [(0, "-2")]


def test_gsm8k_reward(gsm8k_dir: Path) -> None:
    task = build_task(TaskConfig(name="gsm8k", path=str(gsm8k_dir)))
    p = task.prompts("train")
    responses = [
        "48/2 = 24 in May, so 48 + 24 = 72.\n#### 72",                 # right, GSM8K form
        "She earns 0.2 per minute, so $10.",                            # right, last number
        "The answer is 5000 dollars.",                                  # right, no separator
    ]
    assert task.score(p, responses).tolist() == [1.0, 1.0, 1.0]
    wrong = ["#### 73", "She earns $10 per 50 minutes, 0.2 each", "5,000.5"]
    assert task.score(p, wrong).tolist() == [0.0, 0.0, 0.0]
    # Text after a new "[MATH TASK]" header is a new problem, not this one's answer.
    assert task.score(p[:1], ["#### 72\n[MATH TASK] Problem:\n#### 5"]).tolist() == [1.0]
    rewards, failed = task.rewards(p, responses)
    assert rewards.dtype == np.float32 and failed == 0
    neg = task.prompts("test")
    assert task.score(neg, ["3 - 5 = -2"]).tolist() == [1.0]


def test_math_task_boxed_reference_and_archive_layout(tmp_path: Path) -> None:
    # The original MATH archive: <split>/<type>/<n>.json, one problem per file.
    for i, row in enumerate(MATH_ROWS):
        (tmp_path / "train" / row["type"]).mkdir(parents=True)
        (tmp_path / "train" / row["type"] / f"{i}.json").write_text(json.dumps(row))
    task = build_task(TaskConfig(name="math", path=str(tmp_path)))
    prompts = task.prompts("train")
    assert sorted(p.answer for p in prompts) == ["(0,\\infty)", "\\frac{3}{4}"]
    by_answer = {p.answer: p for p in prompts}
    assert prompts[0].text.startswith("[MATH TASK] Problem:\n")
    scored = task.score([by_answer["\\frac{3}{4}"]] * 3 + [by_answer["(0,\\infty)"]],
                        ["so $\\boxed{0.75}$", "\\boxed{\\dfrac34}", "\\boxed{3/5}",
                         "\\boxed{(0, \\infty)}"])
    assert scored.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_math_answer_field_wins_and_split_placeholder(tmp_path: Path) -> None:
    row = {"problem": "p", "solution": "\\boxed{1}", "answer": "2", "level": 5, "subject": "x"}
    write_jsonl(tmp_path / "math500_test.jsonl", [row])
    task = MathTask(TaskConfig(name="math", path=str(tmp_path / "math500_{split}.jsonl")))
    assert task.prompts("test")[0].answer == "2"
    with pytest.raises(DataError, match="math500_train.jsonl: no such file"):
        task.prompts("train")


def test_single_file_and_max_prompts(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "any_name.jsonl", GSM8K_TRAIN)
    task = GSM8KTask(TaskConfig(name="gsm8k", path=str(f), max_prompts=2,
                                prompt_template="Q: {question}\nA:"))
    assert [p.text for p in task.prompts("test")] == [f"Q: {r['question']}\nA:"
                                                      for r in GSM8K_TRAIN[:2]]


def test_canonical_answer_groups_equal_numbers(gsm8k_dir: Path) -> None:
    task = GSM8KTask(TaskConfig(name="gsm8k", path=str(gsm8k_dir)))
    assert task.canonical_answer("#### 0.5") == task.canonical_answer("it is 1/2") == "1/2"
    assert task.canonical_answer("no number") is None


@pytest.mark.parametrize("rows,match", [
    ([{"question": "q"}], r"train.jsonl:1: field 'answer': missing"),
    ([GSM8K_TRAIN[0], {"question": 5, "answer": "#### 1"}],
     r"train.jsonl:2: field 'question': expected a string, got int"),
    ([{"question": "q", "answer": "no final line"}],
     r"train.jsonl:1: field 'answer': has no final '#### <number>' line"),
    ([{"question": "  ", "answer": "#### 1"}], r"train.jsonl:1: field 'question': is empty"),
    ([], r"train.jsonl: the file holds no rows"),
])
def test_gsm8k_bad_data(tmp_path: Path, rows: list, match: str) -> None:
    write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=match):
        GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path))).prompts("train")


def test_bad_json_line_and_math_errors(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(json.dumps(GSM8K_TRAIN[0]) + "\n\n{not json\n")
    with pytest.raises(DataError, match=r"train.jsonl:3: not valid JSON"):
        GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path))).prompts("train")
    write_jsonl(tmp_path / "m" / "train.jsonl", [{"problem": "p", "solution": "no box"}])
    with pytest.raises(DataError, match=r"train.jsonl:1: field 'solution': has no \\boxed"):
        MathTask(TaskConfig(name="math", path=str(tmp_path / "m"))).prompts("train")
    write_jsonl(tmp_path / "m2" / "train.jsonl", [{"problem": "p", "solution": "\\boxed{1}",
                                                   "type": ["Algebra"]}])
    with pytest.raises(DataError, match=r"train.jsonl:1: field 'type': expected a string, got li"):
        MathTask(TaskConfig(name="math", path=str(tmp_path / "m2"))).prompts("train")


def test_missing_split_and_missing_path(gsm8k_dir: Path) -> None:
    task = GSM8KTask(TaskConfig(name="gsm8k", path=str(gsm8k_dir)))
    with pytest.raises(DataError, match=r"no file for split 'validation': looked for validation"):
        task.prompts("validation")
    with pytest.raises(ValueError, match="set task.path"):
        TaskConfig(name="gsm8k")
    with pytest.raises(ValueError, match=r"prompt_template must contain `\{question\}`"):
        TaskConfig(name="gsm8k", path="x", prompt_template="no slot")


def test_parquet_hf_shards(tmp_path: Path) -> None:
    shard = tmp_path / "train-00000-of-00001.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        shard.write_bytes(b"PAR1")
        with pytest.raises(DataError, match=r"parquet needs the `pyarrow` package"):
            GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path))).prompts("train")
        return
    pq.write_table(pa.Table.from_pylist(GSM8K_TRAIN), shard)
    task = GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path)))
    assert [p.answer for p in task.prompts("train")] == ["72", "10", "5,000"]


def test_hydra_group_composes(gsm8k_dir: Path) -> None:
    from hpc_tba.assembly.compose import compose
    from hpc_tba.config import ConfigError

    cfg = compose(["task=gsm8k", f"task.path={gsm8k_dir}", "task.max_prompts=2"])
    assert cfg.task.name == "gsm8k" and cfg.task.prompt_template == TEMPLATE.format(q="{question}")
    assert len(build_task(cfg.task).prompts("train")) == 2
    with pytest.raises(ConfigError, match="set task.path"):
        compose(["task=math"])  # path is required
