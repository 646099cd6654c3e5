"""Offline data for TOPR and A-LoL: reading, curation, a preprocessing pass that caches log-probs.

Both papers train on a fixed file of scored responses instead of generating (ALGORITHMS.md §2,
§3). One row per (prompt, response), JSONL or parquet:

    {"prompt": str, "response": str, "reward": number,
     "logp_behavior": number?, "logp_ref": number?, "advantage": number?, ...}

`logp_*` are sequence log-probs summed over response tokens (log μ(y|x) of the policy that
generated the row, log π_ref(y|x)); `advantage` is A-LoL's R − V(x). Optional fields may be
absent or null; other fields are kept untouched. Rows that break the format raise DataError
naming file, line and field.

TOPR curation. With rewards R ∈ {+1, −1} and a baseline c, training on R − c weights positives
by (1 − c) and negatives by (1 + c), so a raw positive fraction p becomes the effective fraction
p̃ = p(1 − c) / (1 + c(1 − 2p)); the paper found p̃ ≈ 10-20% best. `baseline_for_target` inverts
it: c = (p − p̃) / (p + p̃ − 2pp̃). "Anna Karenina" curation keeps the first correct response per
prompt and every incorrect one (correct answers are alike; each wrong one is wrong its own way).

Preprocessing. `preprocess(path, behavior_fn=..., ref_fn=..., value_fn=...)` fills in whichever of
logp_behavior / logp_ref / advantage are missing, by calling the functions given in batches, and
writes every row (with the new fields) to `<name>.preprocessed.jsonl` next to the data, so the
expensive model pass runs once and training reads the result. Given `temperature=T` it records
`logp_temperature: T` on each row whose log-probs are all under T, and recomputes the log-probs
of rows recorded at another temperature; the learner refuses rows whose log-probs are at a
temperature other than the one it scores at, naming both (`check_temperature`). The functions are plain callables
(the learner passes ones backed by the model), which keeps this module testable without a model.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from hpc_tba.config import TaskConfig
from hpc_tba.tasks.base import Prompt, Task
from hpc_tba.tasks.layout import task_files
from hpc_tba.tasks.records import (
    DataError,
    Row,
    get_float,
    get_str,
    iter_rows,
    mapped,
    read_rows,
    write_jsonl,
)

LogProbFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
"""(prompts, responses) -> summed log-prob of each response given its prompt."""
ValueFn = Callable[[Sequence[str]], Sequence[float]]
"""prompts -> V(x), A-LoL's value of each prompt under the reference policy."""

OPTIONAL_FIELDS = ("logp_behavior", "logp_ref", "advantage", "logp_temperature")
LOGP_FIELDS = ("logp_behavior", "logp_ref")


@dataclasses.dataclass(frozen=True)
class OfflineExample:
    """One scored response of an offline data set."""

    prompt: str
    response: str
    reward: float
    logp_behavior: float | None = None
    """log μ(y|x) summed over response tokens (TOPR's importance ratio), if known."""
    logp_ref: float | None = None
    """log π_ref(y|x) summed over response tokens (A-LoL's ratio), if known."""
    advantage: float | None = None
    """A-LoL's R − V(x), if computed."""
    logp_temperature: float | None = None
    """The temperature logp_behavior / logp_ref are under (log softmax(logits / T)); the learner
    refuses rows whose temperature is not the one it scores at (searcher.temperature)."""
    source: str = ""
    """`file:line` the row came from (for messages)."""


def parse_row(path: str | Path, line: int, row: Row) -> OfflineExample:
    """Validate one raw row; DataError naming file, line and field if it breaks the format."""
    reward = get_float(path, line, row, "reward")
    assert reward is not None
    opt = {f: get_float(path, line, row, f, optional=True) for f in OPTIONAL_FIELDS}
    return OfflineExample(prompt=get_str(path, line, row, "prompt"),
                          response=get_str(path, line, row, "response", allow_empty=True),
                          reward=reward, source=f"{path}:{line}", **opt)


def read_offline(path: str | Path, columns: Mapping[str, str] | None = None) -> list[OfflineExample]:
    """Every row of an offline data file, validated (see the module docstring for the format);
    `columns` (task.columns) maps the fields to the file's column names."""
    return [parse_row(path, line, mapped(path, line, row, columns or {}, OPTIONAL_FIELDS))
            for line, row in iter_rows(path)]


def write_offline(path: str | Path, examples: Iterable[OfflineExample]) -> Path:
    """Write examples as JSONL in the format `read_offline` reads (null optional fields omitted)."""
    rows = []
    for ex in examples:
        row: Row = {"prompt": ex.prompt, "response": ex.response, "reward": ex.reward}
        row.update({f: getattr(ex, f) for f in OPTIONAL_FIELDS if getattr(ex, f) is not None})
        rows.append(row)
    return write_jsonl(path, rows)


# --------------------------------------------------------------------------- TOPR curation

def is_positive(ex: OfflineExample) -> bool:
    """Correct / positive: reward > 0 (works for both {0, 1} and {−1, +1} rewards)."""
    return ex.reward > 0


def positive_fraction(examples: Sequence[OfflineExample],
                      correct: Callable[[OfflineExample], bool] = is_positive) -> float:
    """Raw fraction p of positive examples."""
    if not examples:
        raise ValueError("positive_fraction of an empty data set")
    return sum(map(correct, examples)) / len(examples)


def effective_positive_fraction(p: float, c: float) -> float:
    """TOPR's p̃ = p(1 − c) / (1 + c(1 − 2p)): positives' share of the weight after baseline c."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"positive fraction p must be in [0, 1], got {p}")
    if not -1.0 <= c <= 1.0:
        raise ValueError(f"baseline c must be in [-1, 1] for rewards in {{-1, +1}}, got {c}")
    denom = 1.0 + c * (1.0 - 2.0 * p)
    return p * (1.0 - c) / denom if denom > 0 else float(p > 0)


def baseline_for_target(p: float, target: float) -> float:
    """The baseline c that makes the effective positive fraction equal `target`.

    Solves p(1 − c) = p̃(1 + c(1 − 2p)) for c: c = (p − p̃) / (p + p̃ − 2pp̃), always in
    (−1, 1) for p, p̃ in (0, 1). c > 0 when there are more positives than wanted (they get
    down-weighted).
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"raw positive fraction must be strictly between 0 and 1, got {p} "
                         "(a baseline cannot create positives or negatives that are not there)")
    if not 0.0 < target < 1.0:
        raise ValueError(f"target effective positive fraction must be in (0, 1), got {target}")
    return (p - target) / (p + target - 2.0 * p * target)


def anna_karenina(examples: Sequence[OfflineExample],
                  correct: Callable[[OfflineExample], bool] = is_positive) -> list[OfflineExample]:
    """Keep the first correct example of each prompt and every incorrect one, in file order."""
    seen: set[str] = set()
    kept = []
    for ex in examples:
        if not correct(ex):
            kept.append(ex)
        elif ex.prompt not in seen:
            seen.add(ex.prompt)
            kept.append(ex)
    return kept


def alol_sampling_probs(advantages: Sequence[float]) -> np.ndarray:
    """A-LoL draws training examples with probability ∝ A+ = max(A, 0)."""
    a_plus = np.maximum(np.asarray(advantages, dtype=np.float64), 0.0)
    total = a_plus.sum()
    if not np.isfinite(total) or total <= 0:
        raise ValueError("no example has a positive advantage: A-LoL has nothing to train on")
    return a_plus / total


# --------------------------------------------------------------------------- preprocessing

def preprocessed_path(path: str | Path) -> Path:
    """Where `preprocess` writes: `<dir>/<stem>.preprocessed.jsonl` next to the data."""
    path = Path(path)
    return path.with_name(f"{path.stem}.preprocessed.jsonl")


def preprocess(path: str | Path, *, behavior_fn: LogProbFn | None = None,
               ref_fn: LogProbFn | None = None, value_fn: ValueFn | None = None,
               out: str | Path | None = None, batch_size: int = 32,
               recompute: bool = False, temperature: float | None = None,
               columns: Mapping[str, str] | None = None) -> Path:
    """Fill in missing logp_behavior / logp_ref / advantage and write all rows next to the data.

    Only rows whose field is absent or null are computed (all rows with `recompute=True`), so an
    interrupted or partial pass can be resumed by preprocessing its own output. `value_fn` is
    called once per distinct prompt; advantage = reward − V(prompt). Returns the output path.
    With `columns` (task.columns) the rows are read through the mapping and the computed fields
    written under their mapped column names, so the output reads back with the same mapping.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    columns = dict(columns or {})
    raw = read_rows(path)
    examples = [parse_row(path, line, mapped(path, line, row, columns, OPTIONAL_FIELDS))
                for line, row in raw]
    rows = [dict(row) for _, row in raw]
    col = {f: columns.get(f, f) for f in (*OPTIONAL_FIELDS, "advantage")}
    stale = {i for i, ex in enumerate(examples) if temperature is not None and
             ex.logp_temperature is not None and ex.logp_temperature != temperature}
    computed: dict[str, set[int]] = {}
    for field, fn in (("logp_behavior", behavior_fn), ("logp_ref", ref_fn)):
        if fn is None:
            continue
        todo = [i for i, ex in enumerate(examples)
                if recompute or i in stale or getattr(ex, field) is None]
        computed[field] = set(todo)
        values = _batched(lambda idx, fn=fn: fn([examples[i].prompt for i in idx],
                                                [examples[i].response for i in idx]),
                          todo, batch_size, field)
        for i, v in zip(todo, values):
            rows[i][col[field]] = v
    if value_fn is not None:
        todo = [i for i, ex in enumerate(examples) if recompute or ex.advantage is None]
        prompts = list(dict.fromkeys(examples[i].prompt for i in todo))
        values = _batched(lambda idx: value_fn([prompts[j] for j in idx]),
                          list(range(len(prompts))), batch_size, "value")
        value_of = dict(zip(prompts, values))
        for i in todo:
            rows[i][col["advantage"]] = examples[i].reward - value_of[examples[i].prompt]
    if temperature is not None:
        _stamp_temperature(examples, rows, computed, temperature, col)
    return write_jsonl(out or preprocessed_path(path), rows)


def _stamp_temperature(examples: Sequence[OfflineExample], rows: list[Row],
                       computed: dict[str, set[int]], temperature: float,
                       col: Mapping[str, str]) -> None:
    """Record `logp_temperature` on rows whose every log-prob is now under `temperature`; a row
    still holding a log-prob given without a temperature is left unstamped (and so refused by
    the learner until the file says which temperature it is under)."""
    for i, ex in enumerate(examples):
        known = ex.logp_temperature == temperature
        if all(rows[i].get(col[f]) is None or i in computed.get(f, ()) or known for f in LOGP_FIELDS):
            if any(rows[i].get(col[f]) is not None for f in LOGP_FIELDS):
                rows[i][col["logp_temperature"]] = temperature
        else:
            rows[i].pop(col["logp_temperature"], None)


def check_temperature(examples: Sequence[OfflineExample], temperature: float,
                      fields: Sequence[str] = LOGP_FIELDS) -> None:
    """Raise DataError at the first row holding a log-prob (of `fields`) not under `temperature`."""
    for ex in examples:
        present = [f for f in fields if getattr(ex, f) is not None]
        if not present or ex.logp_temperature == temperature:
            continue
        path, _, line = ex.source.rpartition(":")
        have = ("no logp_temperature (the temperature it is under is unknown)"
                if ex.logp_temperature is None else f"logp_temperature={ex.logp_temperature:g}")
        raise DataError(path or "<memory>",
                        f"has {have}, but the learner scores at searcher.temperature="
                        f"{temperature:g}: run `hpc-tba preprocess ... searcher.temperature="
                        f"{temperature:g}` (it recomputes them), or set searcher.temperature to "
                        "the data's", line=int(line) if line.isdigit() else None, field=present[0])


def check_reward_range(examples: Sequence[OfflineExample], low: float, high: float) -> None:
    """Raise DataError at the first reward outside the declared task.reward_range."""
    for ex in examples:
        if not low <= ex.reward <= high:
            path, _, line = ex.source.rpartition(":")
            raise DataError(path or "<memory>", f"reward {ex.reward:g} is outside the declared "
                            f"task.reward_range=[{low:g}, {high:g}]",
                            line=int(line) if line.isdigit() else None, field="reward")


def _batched(call: Callable[[list[int]], Sequence[float]], todo: list[int], batch_size: int,
             what: str) -> list[float]:
    """Run `call` over `todo` in batches; check each batch returns one finite float per item."""
    out: list[float] = []
    for start in range(0, len(todo), batch_size):
        idx = todo[start:start + batch_size]
        values = [float(v) for v in call(idx)]
        if len(values) != len(idx):
            raise ValueError(f"{what} function returned {len(values)} values for {len(idx)} inputs")
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise ValueError(f"{what} function returned a non-finite value ({bad[0]})")
        out.extend(values)
    return out


def require_fields(examples: Sequence[OfflineExample], *fields: str) -> None:
    """Raise DataError at the first example lacking one of `fields` (e.g. before TOPR training,
    which needs logp_behavior on every row: run `preprocess` first)."""
    for ex in examples:
        for field in fields:
            if getattr(ex, field) is None:
                path, _, line = ex.source.rpartition(":")
                raise DataError(path or "<memory>",
                                "missing; run hpc_tba.tasks.offline.preprocess to compute it",
                                line=int(line) if line.isdigit() else None, field=field)


# --------------------------------------------------------------------------- task

class OfflineTask(Task):
    """`task=offline`: a fixed file of scored responses (TOPR, A-LoL train on it with no searcher).

    `task.path` follows `tasks.layout` (a file, a `{split}` path, or a directory with
    `train.jsonl`...). `examples(split)` are the rows, curated by `task.curation`; `prompts(split)`
    the distinct prompts in file order. There is no reward model: `score` returns the file's reward
    for a (prompt, response) pair it holds and raises for any other, which `Task.rewards` counts
    as a failed sample (evaluate a model trained offline on a task that can score, e.g. gsm8k).
    """

    name = "offline"
    reward_range = None  # a file's rewards: declare them with task.reward_range

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self._cache: dict[str, list[OfflineExample]] = {}
        self._rewards: dict[tuple[str, str], float] = {}
        self._raw: dict[str, str] = {}  # formatted prompt text -> the file's prompt

    def examples(self, split: str = "train") -> list[OfflineExample]:
        """The split's rows, curated by task.curation, from at most task.max_prompts prompts."""
        if split not in self._cache:
            rows = [ex for f in task_files(self.cfg, split)
                    for ex in read_offline(f, self.cfg.columns)]
            if self.cfg.curation == "anna_karenina":
                rows = anna_karenina(rows)
            if self.cfg.max_prompts:
                keep = set(list(dict.fromkeys(ex.prompt for ex in rows))[: self.cfg.max_prompts])
                rows = [ex for ex in rows if ex.prompt in keep]
            self._cache[split] = rows
            self._rewards.update({(ex.prompt, ex.response): ex.reward for ex in rows})
        return self._cache[split]

    def prompts(self, split: str) -> list[Prompt]:
        texts = dict.fromkeys(ex.prompt for ex in self.examples(split))
        out = self.format_prompts([Prompt(i, t) for i, t in enumerate(texts)])
        self._raw.update({p.text: t for p, t in zip(out, texts)})  # rewards are keyed by the file's text
        return out

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> np.ndarray:
        out = []
        for p, r in zip(prompts, responses):
            key = (self._raw.get(p.text, p.text), r)
            if key not in self._rewards:
                raise KeyError("offline task has no reward for a response that is not in its file")
            out.append(self._rewards[key])
        return np.asarray(out, dtype=np.float32)
