"""Data sets of the offline experiments, drawn from the starting model (TOPR §2, A-LoL §3 of
docs ALGORITHMS.md).

Both start from one pool: `tools/make_offline_data.py` samples the starting (embedded) model at
temperature 1 on the arithmetic task's training prompts, so the behaviour policy μ of every row is
the starting model and `hpc-tba preprocess` computes its exact log μ(y|x).

The replay buffer keeps each distinct response of a prompt once (exact duplicates are removed), so
the learner trains on distinct (prompt, response) rows whatever the file holds. The sets are
therefore built from distinct rows: otherwise the positive fraction written in the file would not
be the one the learner sees (a correct answer repeated 8 times in the file is one row in training).

- TOPR (`topr_sets`): rewards ±1 (the paper's), positives subsampled against negatives to an exact
  raw fraction p (e.g. 10% and 50%), all sets of the same size.
- A-LoL (`alol_set`): the A-LoL papers' rewards are continuous classifier scores; the task's is
  0/1, so this set scores responses with a graded reward (`graded_reward`: 1 for the exact
  answer, partial credit for a near miss) and mixes the starting model's rows (half correct) with
  injected noise: wrong answers drawn uniformly at random (mostly reward 0), marked `noise: true`.
  After preprocessing, `advantage_stats` reports the share of rows with A = R − V(x) ≤ 0 (which the
  A-LoL variants never train on), overall and per kind of row.

Extra fields (`correct`, `noise`) ride along in the rows; the project's reader ignores them.
"""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from hpc_tba.tasks.offline import baseline_for_target, preprocessed_path
from hpc_tba.tasks.records import Row, read_rows, write_jsonl

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """How the pool of starting-model samples is drawn (`tools/make_offline_data.py`)."""

    samples: int = 16
    """Responses per training prompt."""
    max_prompts: int = 0
    """Use the first N training prompts (0: all 2000)."""
    temperature: float = 1.0
    """Sampling temperature (1: μ is the model itself, as preprocess computes log μ)."""
    seed: int = 0

    @property
    def filename(self) -> str:
        return f"pool_s{self.samples}_m{self.max_prompts}_t{self.temperature:g}_seed{self.seed}.jsonl"


# --------------------------------------------------------------------------- pure row operations

def distinct_rows(rows: Sequence[Row]) -> list[Row]:
    """The first row of each distinct (prompt, response), in file order."""
    seen: set[tuple[str, str]] = set()
    out = []
    for r in rows:
        key = (r["prompt"], r["response"])
        if key not in seen:
            seen.add(key)
            out.append(dict(r))
    return out


def is_positive(row: Row) -> bool:
    return float(row["reward"]) > 0


def take_positive_fraction(rows: Sequence[Row], *, fraction: float, size: int,
                           rng: np.random.Generator) -> list[Row]:
    """`size` rows of which exactly round(fraction · size) are positive, drawn without replacement
    and kept in file order. Raises ValueError when the rows do not hold enough of either kind."""
    if not 0.0 <= fraction <= 1.0 or size < 1:
        raise ValueError(f"fraction must be in [0, 1] and size >= 1, got {fraction}, {size}")
    pos = [i for i, r in enumerate(rows) if is_positive(r)]
    neg = [i for i, r in enumerate(rows) if not is_positive(r)]
    n_pos = round(fraction * size)
    n_neg = size - n_pos
    if n_pos > len(pos) or n_neg > len(neg):
        raise ValueError(f"{size} rows at {100 * fraction:.0f}% positive need {n_pos} positive and "
                         f"{n_neg} negative rows; the pool has {len(pos)} and {len(neg)} distinct "
                         "ones (sample more per prompt, or ask for fewer rows)")
    keep = np.concatenate([rng.choice(pos, n_pos, replace=False),
                           rng.choice(neg, n_neg, replace=False)]).astype(int)
    return [dict(rows[i]) for i in sorted(keep.tolist())]


def with_pm1_rewards(rows: Sequence[Row]) -> list[Row]:
    """Rewards +1 (correct) / −1 (incorrect), TOPR's convention; `correct` keeps the verdict."""
    return [{**r, "reward": 1.0 if is_positive(r) else -1.0, "correct": is_positive(r)}
            for r in rows]


_INT = re.compile(r"-?\d+")


def graded_reward(response: str, answer: str, *, width: float = 10.0) -> float:
    """1 for the exact answer; for another integer n, 0.5 · max(0, 1 − |n − answer| / width)
    (a near miss earns partial credit, a distant one nothing); 0 for anything else."""
    text = response.strip()
    if text == answer.strip():
        return 1.0
    if not _INT.fullmatch(text):
        return 0.0
    return 0.5 * max(0.0, 1.0 - abs(int(text) - int(answer)) / width)


def inject_noise(rows: Sequence[Row], answers: Mapping[str, str], *, share: float,
                 max_answer: int, rng: np.random.Generator,
                 reward: Callable[[str, str], float] = graded_reward) -> list[Row]:
    """`rows` (marked noise: false) plus injected wrong answers making up `share` of the result.

    Each noise row takes a prompt of `rows` at random and a wrong integer answer drawn uniformly
    from [0, max_answer] that the prompt has no row for yet (the buffer would drop a duplicate),
    scored by `reward` like every other row.
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"noise share must be in [0, 1), got {share}")
    clean = [{**r, "noise": False} for r in rows]
    n_noise = round(share * len(clean) / (1.0 - share))
    prompts = list(dict.fromkeys(r["prompt"] for r in clean))
    missing = [p for p in prompts if p not in answers]
    if missing:
        raise ValueError(f"no answer known for prompt {missing[0]!r}")
    taken = {p: {r["response"].strip() for r in clean if r["prompt"] == p} for p in prompts}
    noise: list[Row] = []
    attempts = 0
    while len(noise) < n_noise:
        attempts += 1
        if attempts > 100 * max(n_noise, 1):
            raise ValueError(f"could not draw {n_noise} distinct wrong answers in [0, {max_answer}]")
        p = prompts[int(rng.integers(len(prompts)))]
        wrong = str(int(rng.integers(max_answer + 1)))
        if wrong == answers[p].strip() or wrong in taken[p]:
            continue
        taken[p].add(wrong)
        noise.append({"prompt": p, "response": wrong, "reward": reward(wrong, answers[p]),
                      "correct": False, "noise": True})
    return clean + noise


def positive_share(rows: Sequence[Row]) -> float:
    return sum(map(is_positive, rows)) / max(len(rows), 1)


def advantage_stats(rows: Sequence[Row]) -> dict[str, float]:
    """Share of rows with A ≤ 0 (never trained on by the A-LoL variants): overall, among correct
    responses, among the starting model's wrong ones and among injected noise."""
    def dropped(sel: list[Row]) -> float:
        return float(np.mean([r["advantage"] <= 0 for r in sel])) if sel else float("nan")

    correct = [r for r in rows if r.get("correct")]
    wrong = [r for r in rows if not r.get("correct") and not r.get("noise")]
    noise = [r for r in rows if r.get("noise")]
    return {"A<=0 (all)": dropped(list(rows)), "A<=0 (correct)": dropped(correct),
            "A<=0 (model's wrong)": dropped(wrong), "A<=0 (injected noise)": dropped(noise),
            "mean A": float(np.mean([r["advantage"] for r in rows]))}


# --------------------------------------------------------------------------- files and commands

def rows_of(path: Path) -> list[Row]:
    return [row for _, row in read_rows(path)]


def sample_pool(data_dir: Path, spec: PoolSpec, *, force: bool = False) -> Path:
    """The pool file of starting-model samples (drawn once, then reused)."""
    path = data_dir / spec.filename
    if path.is_file() and not force:
        return path
    data_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "tools" / "make_offline_data.py"), str(path),
           "--samples", str(spec.samples), "--temperature", str(spec.temperature),
           "--max-prompts", str(spec.max_prompts), "--seed", str(spec.seed)]
    _check_call(cmd, data_dir / f"{path.stem}.log")
    return path


def preprocess(path: Path) -> Path:
    """`hpc-tba preprocess`: log μ = log π_ref under the starting model and A = R − V(x)."""
    hpc = Path(sys.executable).parent / "hpc-tba"
    # At the temperature the arms train at (fidelity_offline: searcher.temperature=1.0).
    _check_call([str(hpc), "preprocess", "+experiment=fidelity_offline", f"task.path={path}"],
                path.with_suffix(".preprocess.log"))
    return preprocessed_path(path)


def _check_call(cmd: Sequence[str], log: Path) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {rc}; log {log}:\n{tail}")


def _is_built(path: Path, spec: dict, *, force: bool) -> bool:
    """Whether the data set and its preprocessed file exist, built with this exact spec."""
    meta = path.with_suffix(".meta.json")
    if force or not meta.is_file() or not preprocessed_path(path).is_file():
        return False
    return json.loads(meta.read_text()).get("spec") == spec


def _save_spec(path: Path, spec: dict) -> None:
    path.with_suffix(".meta.json").write_text(json.dumps({"spec": spec}, indent=1))


def task_answers(overrides: Sequence[str] = ()) -> tuple[dict[str, str], int]:
    """{prompt text: answer} of the arithmetic task's training prompts, and the largest answer."""
    from hpc_tba.assembly.compose import compose
    from hpc_tba.tasks import build_task

    cfg = compose(list(overrides))
    answers = {p.text: p.answer for p in build_task(cfg.task).prompts("train")}
    return answers, 2 * cfg.task.max_operand


# --------------------------------------------------------------------------- the data sets

def pool_stats(path: Path) -> dict[str, float]:
    """What the starting model sampled: samples, their correct share, distinct rows of each kind."""
    rows = rows_of(path)
    distinct = distinct_rows(rows)
    return {"rows": len(rows), "prompts": len({r["prompt"] for r in rows}),
            "positive fraction p": positive_share(rows), "distinct rows": len(distinct),
            "distinct positive rows": sum(map(is_positive, distinct))}


def topr_stats(rows: Sequence[Row], answers: Mapping[str, str]) -> dict[str, float]:
    """Size and raw positive fraction; the positive fraction a learner drawing a prompt first and
    then one of its rows sees, and the rows per prompt behind the difference; how near the wrong
    answers are to the right one."""
    n_rows: dict[str, int] = {}
    n_pos: dict[str, int] = {}
    for r in rows:
        n_rows[r["prompt"]] = n_rows.get(r["prompt"], 0) + 1
        n_pos[r["prompt"]] = n_pos.get(r["prompt"], 0) + is_positive(r)
    pos = [n_rows[r["prompt"]] for r in rows if is_positive(r)]
    neg = [n_rows[r["prompt"]] for r in rows if not is_positive(r)]
    miss = [abs(int(r["response"]) - int(answers[r["prompt"]])) for r in rows
            if not is_positive(r) and _INT.fullmatch(r["response"].strip())]

    def mean(xs) -> float:
        return float(np.mean(xs)) if len(xs) else float("nan")

    return {"rows": len(rows), "prompts": len(n_rows), "positive fraction p": positive_share(rows),
            "positives if drawn prompt-first": mean([n_pos[p] / n_rows[p] for p in n_rows]),
            "rows per prompt, positive rows": mean(pos),
            "rows per prompt, negative rows": mean(neg),
            "wrong within 10 of the answer": mean([d <= 10 for d in miss]),
            "wrong off by one": mean([d == 1 for d in miss])}


def topr_sets(data_dir: Path, *, pool: PoolSpec, fractions: Mapping[str, float], size: int,
              seed: int = 0, force: bool = False) -> dict[str, tuple[Path, dict]]:
    """{name: (file, stats)}: one ±1-reward set per raw positive fraction, preprocessed."""
    source = sample_pool(data_dir, pool, force=force)
    answers, _ = task_answers()
    distinct = None
    out = {}
    for name, frac in fractions.items():
        path = data_dir / f"topr_{name}.jsonl"
        spec = {"pool": pool.filename, "fraction": frac, "size": size, "seed": seed}
        if not _is_built(path, spec, force=force):
            distinct = distinct if distinct is not None else distinct_rows(rows_of(source))
            rng = np.random.default_rng([seed, round(1000 * frac)])
            rows = with_pm1_rewards(take_positive_fraction(distinct, fraction=frac, size=size,
                                                           rng=rng))
            write_jsonl(path, rows)
            preprocess(path)
            _save_spec(path, spec)
        out[name] = (path, topr_stats(rows_of(path), answers))
    return out


def alol_set(data_dir: Path, *, pool: PoolSpec, size: int, noise_share: float,
             clean_positive: float = 0.5, seed: int = 0,
             force: bool = False) -> tuple[Path, dict]:
    """(file, stats): starting-model rows (clean_positive of them correct) plus injected noise,
    graded rewards, preprocessed (advantages), with the share of rows the A ≤ 0 filter drops."""
    path = data_dir / f"alol_noise{round(100 * noise_share)}.jsonl"
    spec = {"pool": pool.filename, "size": size, "noise_share": noise_share,
            "clean_positive": clean_positive, "seed": seed, "reward": "graded_reward(width=10)"}
    if not _is_built(path, spec, force=force):
        source = sample_pool(data_dir, pool, force=force)
        answers, max_answer = task_answers()
        rng = np.random.default_rng([seed, 7])
        n_clean = round(size * (1.0 - noise_share))
        clean = take_positive_fraction(distinct_rows(rows_of(source)), fraction=clean_positive,
                                       size=n_clean, rng=rng)
        clean = [{**r, "reward": graded_reward(r["response"], answers[r["prompt"]]),
                  "correct": is_positive(r)} for r in clean]
        write_jsonl(path, inject_noise(clean, answers, share=noise_share, max_answer=max_answer,
                                       rng=rng))
        preprocess(path)
        _save_spec(path, spec)
    rows = rows_of(preprocessed_path(path))
    stats = {"rows": len(rows), "prompts": len({r["prompt"] for r in rows}),
             "correct": float(np.mean([bool(r["correct"]) for r in rows])),
             "injected noise": float(np.mean([bool(r["noise"]) for r in rows])),
             "mean reward": float(np.mean([r["reward"] for r in rows])),
             **advantage_stats(rows)}
    return path, stats


def topr_baselines(fractions: Mapping[str, float], targets: Sequence[float]) -> dict[str, str]:
    """`c_<set>_t<target%>`: the baseline c giving effective positive fraction `target` on a set
    of raw fraction p (TOPR's p̃ = p(1 − c) / (1 + c(1 − 2p)), inverted)."""
    return {f"c_{name}_t{round(100 * t)}": f"{baseline_for_target(p, t):.4f}"
            for name, p in fractions.items() for t in targets if 0 < p < 1}
