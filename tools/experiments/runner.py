"""Run an experiment: arms x seeds of `hpc-tba train` (then `hpc-tba eval`), aggregated over seeds.

An `Experiment` is a tuple of `Arm`s; an arm is a named list of Hydra overrides of `hpc-tba train`.
Every (arm, seed) is one run in its own directory under the results root:

    <root>/data/                          data sets built by an experiment's `prepare` hook
    <root>/<experiment>/<arm>/seed<k>/    hpc-tba's run_dir (summary.json, metrics_learner.jsonl,
                                          final_model/, eval/eval.json)
    <root>/<experiment>/<arm>/seed<k>.json        the run's collected metrics (its "done" marker)
    <root>/<experiment>/<arm>/seed<k>.{train,eval}.log

A run whose `seed<k>.json` exists is skipped (resumable); `force=True` reruns it. Metrics come
from the run's own files, so online and offline runs are read the same way:

- `summary.json`: `steps`, `summary/pass@1_before|after`, and the curve `test/pass@1` over policy
  versions (online runs: the searchers' held-out greedy pass@1 at every evaluated version);
- `metrics_learner.jsonl`: the curves named in `Experiment.curve_keys` plus `time/elapsed_s`,
  each as (step, value) pairs, and for every curve `<key>@last` and `<key>@mean` (over steps);
- `eval/eval.json` (when the experiment evaluates the exported model): every `eval/...` metric.

Aggregation over seeds is mean, sample standard deviation (ddof 1; 0 for one seed), min and max
per metric; curves are averaged at the steps every seed logged. `run_experiment` writes it all
to `<out>/<experiment>.json`, which `report.py` turns into tables and plots, with the time it
took: `run_compute_s` (training and evaluation summed over runs) and `elapsed_s` (wall clock of
the invocation that ran them, data preparation included; kept when a later invocation only
re-aggregates finished runs).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from experiments.aggregate import aggregate_arm, collect_run, results_id

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO / "runs" / "experiments"
DEFAULT_OUT = REPO / "docs" / "results"
"""Curves read from every run that logs them (wall-clock time at each learner step)."""
RUN_TIMEOUT_S = 3600

Execute = Callable[[Sequence[str], Path], int]
"""(command, log file) -> exit code; the default runs it as a subprocess (tests pass a fake)."""


class ExperimentError(ValueError):
    """A definition or request the runner cannot use; the message says what to change."""


class RunFailed(RuntimeError):
    """A training or evaluation command of one run exited with an error."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """One configuration of an experiment, run once per seed."""

    name: str
    """Identifier: directory name and JSON key (letters, digits, `_`, `-`)."""
    label: str
    """How tables and plots name it."""
    overrides: tuple[str, ...] = ()
    """`hpc-tba train` overrides after `Experiment.common`; `{var}` is filled from `Prepared.vars`.
    For an arm with train=False they are `hpc-tba eval` overrides instead."""
    group: str = ""
    """Tables and plots cluster arms by group (e.g. the data set they train on)."""
    train: bool = True
    """False: no training; evaluate the starting policy (the config's model) with the same eval."""
    once: bool = False
    """Run the first seed only (for an arm whose result does not depend on the seed)."""
    info: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Facts about the arm (e.g. a baseline it sets), formatted like the overrides, stored in the
    JSON and passed to `Experiment.derive`."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.name):
            raise ExperimentError(f"arm name {self.name!r} must be letters, digits, '_' or '-' "
                                  "(it names a directory)")
        if isinstance(self.overrides, str):
            raise ExperimentError(f"arm {self.name}: overrides must be a tuple of strings, not one "
                                  "string")


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of the experiment's table: an aggregated metric, shown as mean ± std."""

    key: str
    """Metric name as collected (e.g. `eval/pass@1_greedy`, `topr/pos_frac@mean`)."""
    label: str
    """Column header."""
    fmt: str = "pct"
    """pct (x100 with %), float, int or s (seconds)."""


@dataclasses.dataclass(frozen=True)
class Plot:
    """A figure of the report: `bar` (final metric per arm, error bars over seeds) or `curve`
    (metric y against x over the run, one panel per arm group, mean ± std band over seeds)."""

    kind: str
    y: str
    """Metric (bar) or curve key (curve)."""
    x: str = "step"
    """Curve only: `step` or another curve key joined on step (e.g. `time/elapsed_s`); a
    cumulative quantity, taken as 0 at step 0 where the run logged nothing there."""
    title: str = ""
    ylabel: str = ""
    xlabel: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("bar", "curve"):
            raise ExperimentError(f"plot kind {self.kind!r} must be 'bar' or 'curve'")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What an experiment's `prepare` hook built: placeholders for the arms and facts to report."""

    vars: dict[str, str]
    """`{name}` placeholders of the arms' overrides and info (e.g. data-set paths, baselines)."""
    stats: dict[str, dict[str, float | str]]
    """Per data set (row name -> column -> value): shown as a table in the report."""


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Named arms run over seeds; see the module docstring for what is collected."""

    name: str
    title: str
    description: str
    """What the experiment asks and how it is set up (Markdown; opens its section of the report)."""
    arms: tuple[Arm, ...]
    common: tuple[str, ...] = ()
    """Overrides of every training run, before the arm's own (`{var}` filled as in the arms')."""
    quick: tuple[str, ...] = ()
    """Extra training overrides under --quick (a smoke run: few steps)."""
    seed_overrides: tuple[str, ...] = ("learner.seed={seed}", "searcher.seed={seed}")
    """Overrides that set a run's seed (training and evaluation); `{seed}` is the seed."""
    eval_args: tuple[str, ...] | None = ("--samples", "8", "--ks", "1")
    """`hpc-tba eval` flags for the exported final model; None: no evaluation (online runs already
    report held-out pass@1 in summary.json)."""
    eval_overrides: tuple[str, ...] = ()
    """Hydra overrides of the evaluation (the task and sampling temperature it evaluates with)."""
    quick_eval_args: tuple[str, ...] = ("--limit", "20")
    """Extra `hpc-tba eval` flags under --quick."""
    curve_keys: tuple[str, ...] = ()
    """Per-step metrics of metrics_learner.jsonl kept as curves (plus `time/elapsed_s`)."""
    columns: tuple[Column, ...] = ()
    plots: tuple[Plot, ...] = ()
    baseline_arm: str | None = None
    """Arm the report compares against (change of the first column), e.g. the starting model."""
    prepare: Callable[..., Prepared] | None = None
    """`prepare(data_dir, *, quick, force) -> Prepared`: builds the data the arms need (cached)."""
    derive: Callable[[dict[str, float], Mapping[str, str]], dict[str, float]] | None = None
    """`derive(run_metrics, arm_info) -> extra metrics`, applied to each run before aggregation."""

    def __post_init__(self) -> None:
        names = [a.name for a in self.arms]
        if not self.arms:
            raise ExperimentError(f"experiment {self.name!r} has no arms")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ExperimentError(f"experiment {self.name!r}: arm names repeat: {', '.join(dup)}")
        if self.baseline_arm is not None and self.baseline_arm not in names:
            raise ExperimentError(f"experiment {self.name!r}: baseline_arm {self.baseline_arm!r} "
                                  "is not one of its arms")
        if any(not a.train for a in self.arms) and self.eval_args is None:
            raise ExperimentError(f"experiment {self.name!r}: an arm without training needs "
                                  "eval_args (it is only evaluated)")

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise ExperimentError(f"experiment {self.name!r} has no arm {name!r} "
                              f"(arms: {', '.join(a.name for a in self.arms)})")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One (arm, seed): its directory and the commands that produce it."""

    arm: Arm
    seed: int
    run_dir: Path
    train_cmd: tuple[str, ...] | None
    eval_cmd: tuple[str, ...] | None

    @property
    def result_path(self) -> Path:
        return self.run_dir.with_suffix(".json")

    def log(self, what: str) -> Path:
        return self.run_dir.with_suffix(f".{what}.log")


# --------------------------------------------------------------------------- planning

def hpc_tba_bin() -> str:
    """The `hpc-tba` entry point of this Python environment (else the one on PATH)."""
    local = Path(sys.executable).parent / "hpc-tba"
    found = str(local) if local.is_file() else shutil.which("hpc-tba")
    if found is None:
        raise ExperimentError("hpc-tba not found next to this Python or on PATH: install the "
                              "project (make install) and run with .venv/bin/python")
    return found


def fill(text: str, values: Mapping[str, str], where: str) -> str:
    """`text` with `{name}` placeholders replaced; a clear error naming a missing one."""
    try:
        return text.format_map(dict(values))
    except KeyError as e:
        raise ExperimentError(f"{where}: placeholder {e} is not defined (known: "
                              f"{', '.join(sorted(values)) or 'none'})") from None


def plan(exp: Experiment, *, seeds: int, quick: bool, root: Path, vars: Mapping[str, str],
         arms: Sequence[str] | None = None, hpc_tba: str = "hpc-tba") -> list[RunSpec]:
    """Every run of the experiment, seed-major (seed 0 of every arm first, so a partial sweep
    already covers every arm)."""
    if seeds < 1:
        raise ExperimentError(f"--seeds must be >= 1, got {seeds}")
    chosen = [exp.arm(n) for n in arms] if arms else list(exp.arms)
    specs = []
    for seed in range(seeds):
        for arm in chosen:
            if arm.once and seed > 0:
                continue
            vals = {**vars, "seed": str(seed)}
            own = [fill(o, vals, f"{exp.name}/{arm.name}") for o in arm.overrides]
            common = [fill(o, vals, f"{exp.name}.common") for o in exp.common]
            eval_ov = [fill(o, vals, f"{exp.name}.eval_overrides") for o in exp.eval_overrides]
            seed_ov = [fill(o, vals, f"{exp.name}.seed_overrides") for o in exp.seed_overrides]
            run_dir = root / exp.name / arm.name / f"seed{seed}"
            train_cmd = None
            if arm.train:
                train_cmd = (hpc_tba, "train", *common, *own, *(exp.quick if quick else ()),
                             *seed_ov, f"run_dir={run_dir}")
            eval_cmd = None
            if exp.eval_args is not None:
                model = ("--model", str(run_dir / "final_model")) if arm.train else ()
                eval_seed = [o for o in seed_ov if o.startswith("searcher.")]
                eval_cmd = (hpc_tba, "eval", *model, "--out", str(run_dir / "eval"),
                            *exp.eval_args, *(exp.quick_eval_args if quick else ()),
                            *eval_ov, *(() if arm.train else own), *eval_seed)
            specs.append(RunSpec(arm, seed, run_dir, train_cmd, eval_cmd))
    return specs


# --------------------------------------------------------------------------- running

def subprocess_execute(cmd: Sequence[str], log: Path) -> int:
    """Run `cmd` from the repository root with its output in `log` (no progress bars)."""
    env = dict(os.environ, HPC_TBA_NO_PROGRESS="1")
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=env,
                                  cwd=REPO, timeout=RUN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nexperiments: killed after {RUN_TIMEOUT_S} s\n")
            return 124


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_one(spec: RunSpec, exp: Experiment, *, vars: Mapping[str, str],
            execute: Execute = subprocess_execute, force: bool = False) -> tuple[dict, bool]:
    """Run (or reuse) one (arm, seed): (its result record, also in result_path; whether it ran).

    A finished run is reused when its commands are the ones planned now (else the definition
    changed and it runs again); its metrics are collected again from its directory, so a new
    column, curve or derived metric needs no rerun.
    """
    if spec.result_path.is_file() and not force:
        old = json.loads(spec.result_path.read_text())
        if _same_cmd(old.get("train_cmd"), spec.train_cmd) and \
                _same_cmd(old.get("eval_cmd"), spec.eval_cmd):
            if not spec.run_dir.is_dir():
                return old, False
            times = {k: v for k, v in old["metrics"].items() if k.startswith("wall/")}
            return _record(spec, exp, vars, times), False
    if spec.run_dir.exists():  # an interrupted or forced run starts over (hpc-tba refuses a used run_dir)
        shutil.rmtree(spec.run_dir)
    spec.run_dir.parent.mkdir(parents=True, exist_ok=True)
    times = {}
    for what, cmd in (("train", spec.train_cmd), ("eval", spec.eval_cmd)):
        if cmd is None:
            continue
        t0 = time.time()
        rc = execute(cmd, spec.log(what))
        times[f"wall/{what}_s"] = round(time.time() - t0, 2)
        if rc != 0:
            raise RunFailed(f"{exp.name}/{spec.arm.name}/seed{spec.seed}: `hpc-tba {what}` exited "
                            f"{rc}; log {spec.log(what)}:\n{_tail(spec.log(what))}")
    return _record(spec, exp, vars, times), True


def _same_cmd(saved: Sequence[str] | None, planned: Sequence[str] | None) -> bool:
    return (saved is None) == (planned is None) and (saved is None or list(saved) == list(planned))


def _record(spec: RunSpec, exp: Experiment, vars: Mapping[str, str], times: dict) -> dict:
    """Collect, derive and write the result record of a finished run directory."""
    metrics, curves = collect_run(spec.run_dir, exp.curve_keys)
    metrics.update(times)
    info = {k: fill(v, {**vars, "seed": str(spec.seed)}, f"{exp.name}/{spec.arm.name}.info")
            for k, v in spec.arm.info.items()}
    if exp.derive is not None:
        metrics.update(exp.derive(metrics, info))
    record = {"experiment": exp.name, "arm": spec.arm.name, "seed": spec.seed,
              "run_dir": str(spec.run_dir), "train_cmd": spec.train_cmd, "eval_cmd": spec.eval_cmd,
              "info": info, "metrics": metrics, "curves": curves}
    _write_json(spec.result_path, record)
    return record


def run_all(specs: Sequence[RunSpec], exp: Experiment, *, vars: Mapping[str, str], jobs: int = 1,
            execute: Execute = subprocess_execute, force: bool = False,
            log: Callable[[str], None] = print) -> tuple[list[dict], list[str], int]:
    """Run every spec, `jobs` at a time; returns (records of the runs that finished, failures,
    how many of them ran now rather than being reused).

    A failed run does not stop the others; its message is returned and it is retried next time.
    """
    if jobs < 1:
        raise ExperimentError(f"--jobs must be >= 1, got {jobs}")
    records, failures, n_ran = [], [], 0
    with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(_timed, run_one, s, exp, vars=vars, execute=execute, force=force): s
                   for s in specs}
        for i, fut in enumerate(cf.as_completed(futures), 1):
            spec = futures[fut]
            name = f"{exp.name}/{spec.arm.name}/seed{spec.seed}"
            try:
                (record, ran), dt = fut.result()
            except (RunFailed, OSError, ValueError, KeyError) as e:
                failures.append(str(e))
                log(f"[{i}/{len(specs)}] {name}: FAILED ({str(e).splitlines()[0]})")
                continue
            records.append(record)
            n_ran += ran
            headline = _headline(record["metrics"], exp)
            state = f"done in {dt:.0f} s" if ran else "finished earlier, reused"
            log(f"[{i}/{len(specs)}] {name}: {state}{headline}")
    return records, failures, n_ran


def _timed(fn, *args, **kwargs):
    t0 = time.time()
    out = fn(*args, **kwargs)
    return out, time.time() - t0


def _headline(metrics: Mapping[str, float], exp: Experiment) -> str:
    for col in exp.columns:
        if col.key in metrics:
            return f"  ({col.label} {format_value(metrics[col.key], col.fmt)})"
    return ""


def build_report_data(exp: Experiment, records: Sequence[dict], *, prepared: Prepared | None,
                      seeds: int, quick: bool, command: str, elapsed_s: float,
                      jobs: int = 1) -> dict:
    """The experiment's JSON document (what report.py renders)."""
    arms = []
    for arm in exp.arms:
        mine = sorted((r for r in records if r["arm"] == arm.name), key=lambda r: r["seed"])
        if not mine:
            continue
        agg = aggregate_arm(mine)
        arms.append({"name": arm.name, "label": arm.label, "group": arm.group, "train": arm.train,
                     "seeds": [r["seed"] for r in mine], "info": mine[0]["info"],
                     "train_cmd": _strip_cmd(mine[0]["train_cmd"]),
                     "eval_cmd": _strip_cmd(mine[0]["eval_cmd"]), **agg})
    compute = sum(v for r in records for k, v in r["metrics"].items() if k.startswith("wall/"))
    return {
        "experiment": exp.name, "title": exp.title, "description": exp.description,
        "command": command, "seeds": seeds, "quick": quick,
        "generated_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "elapsed_s": round(elapsed_s, 1), "run_compute_s": round(compute, 1), "jobs": jobs,
        "data": prepared.stats if prepared else {},
        "columns": [dataclasses.asdict(c) for c in exp.columns],
        "plots": [dataclasses.asdict(p) for p in exp.plots],
        "baseline_arm": exp.baseline_arm, "arms": arms, "results_id": results_id(arms),
    }


def _strip_cmd(cmd: Sequence[str] | None) -> str | None:
    """The command as a reader would type it: `hpc-tba ...`, paths relative to the repository."""
    if cmd is None:
        return None
    words = ["hpc-tba" if i == 0 else w.replace(str(REPO) + "/", "") for i, w in enumerate(cmd)]
    return " ".join(words)


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- one experiment

def run_experiment(exp: Experiment, *, seeds: int, quick: bool = False, root: Path = DEFAULT_ROOT,
                   out: Path = DEFAULT_OUT, jobs: int = 1, force: bool = False,
                   arms: Sequence[str] | None = None, execute: Execute = subprocess_execute,
                   command: str = "", log: Callable[[str], None] = print) -> tuple[Path, list[str]]:
    """Prepare, run every (arm, seed), aggregate, write `<out>/<name>.json`; (path, failures)."""
    t0 = time.time()
    root, out = Path(root), Path(out)
    prepared = None
    if exp.prepare is not None:
        log(f"{exp.name}: preparing data under {root / 'data'}")
        prepared = exp.prepare(root / "data", quick=quick, force=force)
    vars = prepared.vars if prepared else {}
    hpc = hpc_tba_bin() if execute is subprocess_execute else "hpc-tba"
    specs = plan(exp, seeds=seeds, quick=quick, root=root, vars=vars, arms=arms, hpc_tba=hpc)
    log(f"{exp.name}: {len(specs)} runs, {jobs} at a time, under {root / exp.name}")
    records, failures, n_ran = run_all(specs, exp, vars=vars, jobs=jobs, execute=execute,
                                       force=force, log=log)
    path = out / f"{exp.name}.json"
    elapsed = time.time() - t0
    if n_ran == 0 and path.is_file():  # only re-aggregated: keep how the real sweep ran
        previous = json.loads(path.read_text())
        elapsed, jobs = previous.get("elapsed_s", elapsed), previous.get("jobs", jobs)
    data = build_report_data(exp, records, prepared=prepared, seeds=seeds, quick=quick,
                             command=command or f"python tools/experiments/run.py {exp.name} "
                             f"--seeds {seeds}{' --quick' if quick else ''}",
                             elapsed_s=elapsed, jobs=jobs)
    _write_json(path, data)
    log(f"{exp.name}: wrote {path} ({len(records)} runs, {len(failures)} failed, "
        f"{time.time() - t0:.0f} s)")
    return path, failures


def format_value(v: float, fmt: str) -> str:
    """One number as the report shows it."""
    if fmt == "pct":
        return f"{100 * v:.1f}%"
    if fmt == "int":
        return f"{v:.0f}"
    if fmt == "s":
        return f"{v:.0f} s"
    if fmt == "float":
        return f"{v:.3g}"
    raise ExperimentError(f"column format {fmt!r} must be pct, int, s or float")
