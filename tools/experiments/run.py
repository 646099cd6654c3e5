"""Run a learning-fidelity experiment (or all of them), then render docs/RESULTS.md.

    python tools/experiments/run.py topr [--seeds 3] [--jobs 2]   # one experiment
    python tools/experiments/run.py all                            # every one, then the report
    python tools/experiments/run.py alol --quick                   # smoke run: tiny data, 3 steps
    python tools/experiments/run.py --list

Runs go under runs/experiments/<experiment>/<arm>/seed<k>; a finished run is reused unless
--force. Results go to docs/results/<experiment>.json and the report to docs/RESULTS.md (with
--quick, to runs/experiments-quick/results/ instead, so a smoke run never overwrites results).
On a shared machine run it under `nice -n 19`; --jobs 2 runs two trainings at once (each learner
uses one core; the offline preset unpins cores so the two do not share one).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.definitions import EXPERIMENTS  # noqa: E402
from experiments.report import DEFAULT_REPORT, render  # noqa: E402
from experiments.runner import (  # noqa: E402
    DEFAULT_OUT,
    DEFAULT_ROOT,
    REPO,
    ExperimentError,
    run_experiment,
)

QUICK_ROOT = REPO / "runs" / "experiments-quick"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?", help=f"one of {', '.join(EXPERIMENTS)}, or all")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny data, a few steps, results outside docs/")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    ap.add_argument("--force", action="store_true", help="rebuild the data and rerun finished runs")
    ap.add_argument("--arms", default=None, help="comma-separated arm names (default: all arms)")
    ap.add_argument("--root", type=Path, default=None, help="where runs and data go "
                    f"(default {DEFAULT_ROOT.relative_to(REPO)})")
    ap.add_argument("--out", type=Path, default=None, help="where <experiment>.json goes "
                    f"(default {DEFAULT_OUT.relative_to(REPO)})")
    ap.add_argument("--no-report", action="store_true", help="do not render the report")
    ap.add_argument("--list", action="store_true", help="list experiments and their arms")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for exp in EXPERIMENTS.values():
            print(f"{exp.name}: {exp.title}")
            for a in exp.arms:
                print(f"  {a.name:<14} {a.label}{' [' + a.group + ']' if a.group else ''}")
        return 0
    if args.experiment is None:
        print(f"run.py: name an experiment ({', '.join(EXPERIMENTS)}) or `all`; --list shows "
              "them", file=sys.stderr)
        return 2
    if args.experiment != "all" and args.experiment not in EXPERIMENTS:
        print(f"run.py: unknown experiment {args.experiment!r}; known: "
              f"{', '.join(EXPERIMENTS)}, or all", file=sys.stderr)
        return 2
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    if args.arms and len(names) > 1:
        print("run.py: --arms needs one experiment, not all", file=sys.stderr)
        return 2
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    root = args.root or (QUICK_ROOT if args.quick else DEFAULT_ROOT)
    out = args.out or (QUICK_ROOT / "results" if args.quick else DEFAULT_OUT)
    report = DEFAULT_REPORT if out.resolve() == DEFAULT_OUT.resolve() else out / "RESULTS.md"
    failures: list[str] = []
    try:
        for name in names:
            command = (f"python tools/experiments/run.py {name} --seeds {seeds}"
                       + (" --quick" if args.quick else ""))
            _, failed = run_experiment(
                EXPERIMENTS[name], seeds=seeds, quick=args.quick, root=root, out=out,
                jobs=args.jobs, force=args.force, command=command,
                arms=args.arms.split(",") if args.arms else None)
            failures += failed
        if not args.no_report:
            print(f"wrote {render(out, report, order=list(EXPERIMENTS))}")
    except ExperimentError as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 2
    for f in failures:
        print(f"\nFAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
