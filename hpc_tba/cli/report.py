"""`<run_dir>/report.png`: what a run did, on one page; several runs overlaid for comparison.

Panels: held-out pass@1 over learner steps and over training wall-clock time; the reward of the
samples the learner trained on over steps and time, beside the reward of the samples the searchers
generated with each policy version (`reward/fresh_by_version`, drawn at step v: what the policy
itself does; the trained samples are what the buffer's sampler and duplicate rule chose); the
staleness of those samples (learner version − behaviour version, all steps); where each role's
time went (`util/*`). Everything is read back from the files the run writes: `metrics_<role>.jsonl`
(the TensorBoard scalars),
`histograms_learner.json` (the staleness lags), `summary*.json` and `config.yaml`.

    hpc-tba report RUN_DIR [RUN_DIR ...] [-o OUT.png]
"""
from __future__ import annotations

import os

import numpy as np

from hpc_tba.checkpoint.runfiles import read_json, read_jsonl


def load_run(run_dir: str) -> dict:
    """The series one run's report draws, from its files (works mid-run too)."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a run directory")
    learner = read_jsonl(os.path.join(run_dir, "metrics_learner.jsonl"))
    if not learner:
        raise FileNotFoundError(f"{run_dir} has no metrics_learner.jsonl yet (not a run directory, "
                                "or the learner has not logged a step)")
    evals = {int(r["step"]): (r["test/pass@1"], r.get("test/at_time_s")) for r in learner
             if "test/pass@1" in r}  # a resumed run re-logs a version: the latest row wins
    train = [r for r in learner if "reward/sampled_mean" in r]
    fresh = {int(r["step"]): r["reward/fresh_by_version"] for r in learner if "reward/fresh_by_version" in r}
    step_time = {r["step"]: r.get("time/elapsed_s") for r in train}
    util: dict[str, dict[str, float]] = {}
    summary = read_json(os.path.join(run_dir, "summary.json")) or {}
    if summary.get("time"):
        util["learner"] = _utils(summary["time"])
    elif train:
        util["learner"] = _utils(next((r for r in reversed(learner) if "time/elapsed_s" in r), {}))
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("metrics_searcher") and name.endswith(".jsonl"):
            role = name[len("metrics_"):-len(".jsonl")]
            rows = [r for r in read_jsonl(os.path.join(run_dir, name)) if "time/elapsed_s" in r]
            if rows:
                util[role] = _utils(rows[-1])
    hist = (read_json(os.path.join(run_dir, "histograms_learner.json")) or {}).get("buffer/staleness", {})
    return {
        "label": _label(run_dir),
        "eval_steps": sorted(evals), "eval_pass": [evals[v][0] for v in sorted(evals)],
        "eval_time": [evals[v][1] for v in sorted(evals)],
        "steps": [r["step"] for r in train], "reward": [r["reward/sampled_mean"] for r in train],
        "time": [r.get("time/elapsed_s") for r in train],
        "fresh_steps": sorted(fresh), "fresh_reward": [fresh[v] for v in sorted(fresh)],
        "fresh_time": [step_time.get(v, 0.0 if v == 0 else None) for v in sorted(fresh)],
        "staleness": {int(k): int(v) for k, v in hist.items()},
        "util": util,
    }


def _utils(metrics: dict) -> dict[str, float]:
    return {k[len("util/"):]: float(v) for k, v in metrics.items() if k.startswith("util/")}


def _label(run_dir: str) -> str:
    """Run directory name, with the algorithm and schedule from its config."""
    name = os.path.basename(os.path.normpath(run_dir))
    algo = mode = None
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
        algo, mode = cfg.algo.name, cfg.learner.mode
    except Exception:  # no or unreadable config.yaml: the name alone
        pass
    return f"{name} ({algo}, {mode})" if algo else name


def _smooth(y: list[float], n: int = 10) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    if len(y) < n:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    head = c[1:n] / np.arange(1, n)
    return np.concatenate([head, (c[n:] - c[:-n]) / n])


def draw_report(run_dirs: list[str], out: str) -> str:
    """Draw the report of one run (or several overlaid) into `out`; returns `out`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    runs = [load_run(d) for d in run_dirs]
    fig, ax = plt.subplots(2, 3, figsize=(16, 9))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        c = colors[i % len(colors)]
        ax[0, 0].plot(r["eval_steps"], r["eval_pass"], "o-", color=c, label=r["label"])
        times = [(t, p) for t, p in zip(r["eval_time"], r["eval_pass"]) if t is not None]
        if times:
            ax[0, 1].plot(*zip(*times), "o-", color=c, label=r["label"])
        if r["steps"]:
            ax[1, 0].plot(r["steps"], r["reward"], color=c, alpha=0.25)
            ax[1, 0].plot(r["steps"], _smooth(r["reward"]), color=c, label=f"{r['label']}: trained")
            timed = [(t, y) for t, y in zip(r["time"], _smooth(r["reward"])) if t is not None]
            if timed:
                ax[1, 1].plot(*zip(*timed), color=c, label=f"{r['label']}: trained")
        if r["fresh_steps"]:
            ax[1, 0].plot(r["fresh_steps"], r["fresh_reward"], "s--", color=c, markersize=3,
                          label=f"{r['label']}: fresh, by generating version")
            timed = [(t, y) for t, y in zip(r["fresh_time"], r["fresh_reward"]) if t is not None]
            if timed:
                ax[1, 1].plot(*zip(*timed), "s--", color=c, markersize=3,
                              label=f"{r['label']}: fresh, by generating version")
        _staleness(ax[0, 2], r, c, offset=i, n=len(runs))
    _utilisation(ax[1, 2], runs)
    for a, title, xl, yl in ((ax[0, 0], "held-out pass@1 (greedy) by learner step", "learner step", "pass@1"),
                             (ax[0, 1], "held-out pass@1 by training time", "seconds", "pass@1"),
                             (ax[1, 0], "reward: trained (mean of 10), fresh by version (dashed)",
                              "learner step / policy version", "reward"),
                             (ax[1, 1], "reward by time: trained (mean of 10), fresh (dashed)",
                              "seconds", "reward")):
        a.set_title(title)
        a.set_xlabel(xl)
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
        if yl == "pass@1":
            a.set_ylim(0, 1)
        if a.lines:
            a.legend(fontsize=8)
    fig.suptitle("hpc_tba run report" + ("" if len(runs) == 1 else f" - {len(runs)} runs"))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _staleness(a, r: dict, color: str, *, offset: int, n: int) -> None:
    a.set_title("staleness of trained samples (learner - behaviour version)")
    a.set_xlabel("versions behind")
    a.set_ylabel("fraction of samples")
    a.xaxis.get_major_locator().set_params(integer=True)
    if not r["staleness"]:
        return
    lags = np.array(sorted(r["staleness"]))
    counts = np.array([r["staleness"][k] for k in lags], dtype=np.float64)
    width = 0.8 / n
    a.bar(lags - 0.4 + width * (offset + 0.5), counts / counts.sum(), width=width, color=color,
          label=f"{r['label']}: mean {float((lags * counts).sum() / counts.sum()):.2f}")
    a.legend(fontsize=8)


def _utilisation(a, runs: list[dict]) -> None:
    """One horizontal bar per role (per run): the fractions of its wall-clock time."""
    a.set_title("where each role's time went (util/*)")
    a.set_xlabel("fraction of wall-clock time")
    bars = [(f"{r['label'].split(' ')[0]}: {role}" if len(runs) > 1 else role, u)
            for r in runs for role, u in r["util"].items()]
    activities = sorted({k for _, u in bars for k in u} - {"other"}) + ["other"]
    cmap = __import__("matplotlib").colormaps["tab10"]
    for j, act in enumerate(activities):
        left = [sum(u.get(x, 0.0) for x in activities[:j]) for _, u in bars]
        a.barh(range(len(bars)), [u.get(act, 0.0) for _, u in bars], left=left,
               color="lightgrey" if act == "other" else cmap(j % 10), label=act)
    a.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    a.set_xlim(0, 1)
    a.invert_yaxis()
    if bars:
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=5)


def report_main(argv: list[str]) -> int:
    """`hpc-tba report RUN_DIR [RUN_DIR ...] [-o OUT]`."""
    import argparse

    p = argparse.ArgumentParser(prog="hpc-tba report", description="Draw a run's report.png; "
                                "several run directories are overlaid in one picture.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--out", help="picture to write (default: RUN_DIR/report.png for one run, "
                   "report.png here for several)")
    args = p.parse_args(argv)
    out = args.out or (os.path.join(args.run_dirs[0], "report.png") if len(args.run_dirs) == 1
                       else "report.png")
    print(f"hpc-tba: wrote {draw_report(args.run_dirs, out)}")
    return 0
