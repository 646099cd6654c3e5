"""Asynchrony speed-up, measured: wall-clock time to a held-out accuracy target, sync vs TBA async.

    python tools/bench_async.py                        # 3 seeds, target: start + 0.20, embedded task
    python tools/bench_async.py --seeds 0 1 2 3 4 --gain 0.25 --steps 100 --out docs
    python tools/bench_async.py --target 0.80          # an absolute target instead

Each seed runs the embedded default twice on the same processes and cores, differing in
scheduling only (`learner=sync` vs `learner=default`): (a) synchronous on-policy — the searchers
generate one batch with the current weights, the learner trains on exactly it, syncs, repeat;
(b) TBA — searchers never stop, the learner samples the replay buffer. The baseline (a) is
measured in the same invocation, interleaved with (b), so machine noise hits both.

The target is relative by default: each run's own held-out pass@1 before training (version 0)
plus `--gain`, so the benchmark asks the same of every machine (the embedded warm start stops in
a band of held-out accuracy, not at a fixed accuracy; see hpc_tba.tasks.embedded).

Reported per mode: time to the first held-out evaluation at or above the target (clocks start
when every rank has built its role, so model loading is excluded and the warm start included),
steps to the target, wall time of all steps, and where each role's time went (`util/*`, from the
Timers every role records to TensorBoard). The ratio sync ÷ async is given per seed and as
mean ± std. Time to target = steps to target × seconds per step: the breakdown says which factor
asynchrony changed.

The measured per-role costs of each mode (seconds per learner step, samples per second per
searcher, sync and apply seconds) also feed the scheduling simulator (tools/simulator/calibration.py);
its predicted sync ÷ async time per step is compared with the measured one and the error is stated.
Writes <out>/bench_async.json and <out>/bench_async.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {"sync": "learner=sync", "async": "learner=default"}


def run_once(mode: str, seed: int, args: argparse.Namespace, root: Path) -> Path:
    run_dir = root / f"{mode}_seed{seed}"
    if (run_dir / "summary.json").exists() and not args.force:
        return run_dir
    cmd = [str(Path(sys.executable).parent / "hpc-tba"), "train", MODES[mode],
           f"learner.seed={seed}", f"searcher.seed={seed}", f"learner.total_steps={args.steps}",
           f"learner.eval_every={args.eval_every}", "learner.export_final=false",
           f"run_dir={run_dir}", *args.overrides]
    if run_dir.exists():  # an unfinished run (no summary): start it again from scratch
        shutil.rmtree(run_dir)
    t0 = time.time()
    env = {**os.environ, "HPC_TBA_NO_PROGRESS": "1"}
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"bench_async: {mode} seed {seed} failed (exit {proc.returncode}; log {log}): "
                         f"{' '.join(cmd)}")
    print(f"  {mode:5} seed {seed}: {time.time() - t0:5.1f} s", file=sys.stderr, flush=True)
    return run_dir


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(run_dir: Path, target: float | None, gain: float = 0.0) -> dict:
    """Time/steps to target (absolute, or None: the run's starting pass@1 + gain), per-role
    utilisation and per-role costs of one finished run."""
    s = json.loads((run_dir / "summary.json").read_text())
    curve = sorted((int(v), acc, s["pass@1_time_s"].get(v)) for v, acc in s["pass@1"].items())
    start = s["pass@1"].get("0")
    if target is None:
        if start is None:
            raise SystemExit(f"bench_async: {run_dir} has no evaluation before training (version 0) "
                             "to measure a relative target from; use --target")
        target = start + gain
    hit = next(((v, t) for v, acc, t in curve if acc >= target and t is not None), None)
    lt = s["time"]
    steps = s["steps"]
    searchers = [json.loads(p.read_text()) for p in sorted(run_dir.glob("summary_searcher*.json"))]
    gen_rates = []
    for sm in searchers:
        gen_s = sm["time"].get("time/generate_s", 0.0)
        if gen_s > 0:
            gen_rates.append(sm["rounds"] / gen_s)
    learner_rows = _jsonl(run_dir / "metrics_learner.jsonl")
    syncs = sum(1 for r in learner_rows if "sync/time_s" in r)
    return {
        "curve": [[v, acc, t] for v, acc, t in curve], "start_pass@1": start, "target": target,
        "time_to_target_s": hit[1] if hit else None, "steps_to_target": hit[0] if hit else None,
        "wall_s": lt["time/elapsed_s"], "steps": steps,
        "s_per_step": lt["time/elapsed_s"] / steps,
        "final_pass@1": curve[-1][1],
        "learner_util": {k[5:]: v for k, v in lt.items() if k.startswith("util/")},
        "searcher_util": _mean_dicts([{k[5:]: v for k, v in sm["time"].items() if k.startswith("util/")}
                                      for sm in searchers]),
        "costs": {"learner_step_s": lt.get("time/train_s", 0.0) / steps,
                  "sync_s": lt.get("time/sync_s", 0.0) / max(syncs, 1),
                  "rounds_per_s_per_searcher": statistics.fmean(gen_rates) if gen_rates else 0.0,
                  "apply_s": statistics.fmean(sm["time"].get("time/apply_s", 0.0) / max(sm["rounds"], 1)
                                              for sm in searchers) if searchers else 0.0},
    }


def _mean_dicts(ds: list[dict]) -> dict:
    keys = sorted({k for d in ds for k in d})
    return {k: statistics.fmean(d.get(k, 0.0) for d in ds) for k in keys}


def _spread(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


def calibrate(results: dict, cfg: dict, measured_ratio: float,
              target_ratio: float | None = None) -> dict:
    """Feed the measured per-role costs of each mode to the simulator; compare s/step ratios,
    and (given `target_ratio`) time-to-target ratios with each mode's measured steps to target."""
    from simulator import calibration
    from simulator.config import ASSUMPTIONS

    def costs(mode: str) -> dict:
        runs = results[mode]
        c = _mean_dicts([r["costs"] for r in runs])
        prompts_per_round = cfg["sync_prompts_per_round"] if mode == "sync" else cfg["prompts_per_round"]
        gen = c["rounds_per_s_per_searcher"] * prompts_per_round * cfg["samples_per_prompt"]
        if mode == "sync":  # the simulator's sync mode has no apply stall: the learner waits for it
            return {"gen_samples_per_s": gen, "learner_step_s": c["learner_step_s"],
                    "sync_s": c["sync_s"] + c["apply_s"], "apply_s": 0.0}
        return {"gen_samples_per_s": gen, "learner_step_s": c["learner_step_s"], "sync_s": c["sync_s"],
                "apply_s": c["apply_s"]}

    base = {k: cfg[k] for k in ("samples_per_prompt", "k", "prompts_per_step", "prompts_per_round",
                                "num_searchers", "num_learners", "sync_every", "steps", "recency_m")}
    base["warm_start_samples"] = cfg["warm_start"]
    measured = {**base, **costs("async"), "sync_mode": {**costs("sync"), "sync_every": 1},
                "async_mode": costs("async"), "measured_speedup": measured_ratio}
    out = calibration.calibrate(measured)
    # The prediction from a sync run alone (its costs for both modes), as a user without an async
    # run would make it; the difference to the above is how the roles' costs change when they
    # run concurrently on shared cores (contention, or warmer caches), which is not modelled.
    from_sync = {**measured, "async_mode": {**costs("sync"), "sync_s": measured["sync_s"]}}
    out["predicted_speedup_from_sync_costs"] = calibration.calibrate(from_sync)["predicted_speedup"]
    steps = {m: [r["steps_to_target"] for r in results[m] if r["steps_to_target"]] for m in results}
    if target_ratio is not None and all(steps.values()):
        # The simulator knows nothing of accuracy: give it the updates each mode needed.
        to_target = {**measured, "measured_speedup": target_ratio,
                     "sync_mode": {**measured["sync_mode"], "steps": round(statistics.fmean(steps["sync"]))},
                     "async_mode": {**measured["async_mode"], "steps": round(statistics.fmean(steps["async"]))}}
        t = calibration.calibrate(to_target)
        out["time_to_target"] = {k: t[k] for k in ("predicted_speedup", "measured_speedup", "relative_error")}
    out["inputs"] = measured
    out["assumptions"] = list(ASSUMPTIONS)
    return out


def run_config(overrides: list[str]) -> dict:
    from hpc_tba.assembly.compose import compose

    c = compose(overrides)
    return {"samples_per_prompt": c.searcher.samples_per_prompt, "k": c.searcher.k,
            "prompts_per_step": c.learner.prompts_per_step, "prompts_per_round": c.searcher.prompts_per_round,
            "sync_prompts_per_round": -(-c.learner.prompts_per_step * c.cluster.num_learners
                                        // c.cluster.num_searchers),
            "num_searchers": c.cluster.num_searchers, "num_learners": c.cluster.num_learners,
            "sync_every": c.learner.sync_every, "recency_m": c.buffer.recency_m,
            "warm_start": c.buffer.warm_start}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"sync": "tab:orange", "async": "tab:blue"}
    for mode, runs in results.items():
        for i, r in enumerate(runs):
            t = [p[2] for p in r["curve"] if p[2] is not None]
            a = [p[1] for p in r["curve"] if p[2] is not None]
            ax1.plot(t, a, color=colors[mode], alpha=0.7, label=mode if i == 0 else None)
            ax2.plot([p[0] for p in r["curve"]], [p[1] for p in r["curve"]], color=colors[mode],
                     alpha=0.7, label=mode if i == 0 else None)
    targets = sorted({round(r["target"], 4) for runs in results.values() for r in runs})
    for ax, xl in ((ax1, "seconds since all ranks were ready"), (ax2, "learner steps")):
        for target in targets:  # one line per distinct target (relative targets may differ by run)
            ax.axhline(target, color="grey", ls="--", lw=1)
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out pass@1")
        ax.legend()
    ax1.set_title("accuracy vs wall-clock")
    ax2.set_title("accuracy vs updates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--target", type=float, default=None,
                    help="an absolute held-out pass@1 to reach (default: relative, see --gain)")
    ap.add_argument("--gain", type=float, default=0.20,
                    help="target = each run's own starting held-out pass@1 + this (default 0.20)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--runs", default="runs/bench_async", help="where the runs go")
    ap.add_argument("--out", default="docs", help="where bench_async.json/.png go")
    ap.add_argument("--force", action="store_true", help="rerun runs that already finished")
    ap.add_argument("overrides", nargs="*", help="extra hpc-tba overrides for both modes")
    args = ap.parse_args(argv)
    if len(args.seeds) < 1 or (args.target is not None and not 0 < args.target <= 1):
        ap.error("need at least one seed and a target in (0, 1]")
    if args.target is None and not 0 < args.gain < 1:
        ap.error("--gain must be in (0, 1)")
    root = Path(args.runs).resolve()
    cfg = {**run_config(args.overrides), "steps": args.steps}
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    for i, seed in enumerate(args.seeds):  # alternate the order so drift hits both modes
        for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):
            results[mode].append({"seed": seed, **measure(run_once(mode, seed, args, root), args.target,
                                                          args.gain)})

    ratios, step_ratios, per_step = [], [], []
    for s, a in zip(results["sync"], results["async"]):
        if s["time_to_target_s"] and a["time_to_target_s"]:
            ratios.append(s["time_to_target_s"] / a["time_to_target_s"])
            step_ratios.append(s["steps_to_target"] / a["steps_to_target"])
        per_step.append(s["s_per_step"] / a["s_per_step"])
    out = {"target": args.target, "gain": None if args.target is not None else args.gain,
           "seeds": args.seeds, "config": cfg, "overrides": args.overrides,
           "ratio_time_to_target": _spread(ratios), "ratio_steps_to_target": _spread(step_ratios),
           "ratio_s_per_step": _spread(per_step), "runs": results,
           "command": "python tools/bench_async.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    out["simulator"] = calibrate(results, cfg, out["ratio_s_per_step"]["mean"],
                                 out["ratio_time_to_target"].get("mean"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_async.json").write_text(json.dumps(out, indent=1))
    plot(results, Path(args.out) / "bench_async.png")
    print(report(out))
    return 0


def report(out: dict) -> str:
    def fmt(d: dict, unit: str = "x") -> str:
        if not d.get("n"):
            return "n/a (target not reached)"
        return f"{d['mean']:.2f}{unit} ± {d['std']:.2f} (min {d['min']:.2f}, max {d['max']:.2f}, n={d['n']})"

    starts = [r["start_pass@1"] for m in ("sync", "async") for r in out["runs"][m] if r["start_pass@1"] is not None]
    goal = (f"target held-out pass@1 {out['target']:.2f}" if out.get("gain") is None else
            f"target held-out pass@1 = start + {out['gain']:.2f} (starts {min(starts):.3f}-{max(starts):.3f})")
    lines = [f"{goal}, seeds {out['seeds']}", "",
             f"{'':26}{'sync':>18}{'async':>18}"]
    for key, name in (("time_to_target_s", "time to target (s)"), ("steps_to_target", "steps to target"),
                      ("s_per_step", "s per step (all steps)"), ("final_pass@1", "final pass@1")):
        vals = {m: _spread([r[key] for r in out["runs"][m]]) for m in ("sync", "async")}
        cells = [f"{v['mean']:.3g} ± {v['std']:.2g}" if v.get("n") else "n/a" for v in vals.values()]
        lines.append(f"{name:26}{cells[0]:>18}{cells[1]:>18}")
    lines += ["", f"sync ÷ async time to target:  {fmt(out['ratio_time_to_target'])}",
              f"sync ÷ async steps to target: {fmt(out['ratio_steps_to_target'])}",
              f"sync ÷ async seconds per step: {fmt(out['ratio_s_per_step'])}", "",
              "where the time went (fraction of wall-clock, mean over seeds):"]
    for mode in ("sync", "async"):
        for role in ("learner_util", "searcher_util"):
            u = _mean_dicts([r[role] for r in out["runs"][mode]])
            lines.append(f"  {mode:5} {role[:-5]:8} " + "  ".join(f"{k} {v:.2f}" for k, v in u.items()))
    sim = out["simulator"]
    lines += ["", f"simulator, fed each mode's measured costs: predicted sync ÷ async s/step "
              f"{sim['predicted_speedup']:.2f}x vs measured {sim['measured_speedup']:.2f}x "
              f"(error {100 * sim['relative_error']:+.1f}%); from the sync run's costs alone it "
              f"predicts {sim['predicted_speedup_from_sync_costs']:.2f}x"]
    if "time_to_target" in sim:
        t = sim["time_to_target"]
        lines.append(f"simulator, given each mode's mean steps to target: predicted time-to-target "
                     f"ratio {t['predicted_speedup']:.2f}x vs measured {t['measured_speedup']:.2f}x "
                     f"(error {100 * t['relative_error']:+.1f}%)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
