"""Simulate synchronous on-policy RL vs TBA's asynchronous schedule from per-role costs.

    python tools/simulate.py run --preset gsm8k_4gpu --out /tmp/sim      # report + 3 PNGs
    python tools/simulate.py run --preset llama70b_128gpu --num-searchers 32 --k 4
    python tools/simulate.py run --from-json costs.json --json           # SimConfig fields in JSON
    python tools/simulate.py calibrate measured.json                      # measured CPU costs
    python tools/simulate.py presets [--out docs]                         # table of all presets

Every SimConfig field is a flag (--gen-tokens-per-s ...; `run --help` lists them with their
docstrings). Precedence: preset < --from-json < flags. The model and its assumptions are in
tools/simulator/ and docs/SIMULATION.md; the assumptions are printed beside every result.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from simulator.calibration import CALIBRATION_KEYS, calibrate
from simulator.config import ASSUMPTIONS, STATES, SimConfig, field_docs, from_json
from simulator.presets import PRESETS, preset
from simulator.schedules import compare, costs, sweep_searchers

SWEEP = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    docs = field_docs()
    for f in dataclasses.fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, type=lambda s: s.lower() in ("1", "true", "yes"),
                           default=None, help=docs.get(f.name, ""))
            continue
        kind = int if f.type in ("int", int) else float
        p.add_argument(flag, dest=f.name, type=kind, default=None, help=docs.get(f.name, ""))


def build_config(args: argparse.Namespace) -> SimConfig:
    cfg = preset(args.preset) if args.preset else SimConfig()
    if args.from_json:
        cfg = from_json(args.from_json, cfg)
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)
             if getattr(args, f.name, None) is not None}
    return cfg.replace(**flags)


def report_lines(cfg: SimConfig, result: dict, sweep: list[dict] | None) -> list[str]:
    lines = ["costs (s): " + ", ".join(f"{k}={v:.4g}" for k, v in costs(cfg).items()), ""]
    lines.append(f"{'':22}{'sync':>12}{'async':>12}")
    s, a = result["sync"], result["async"]
    rows = [("time to N updates (s)", s.wall_s, a.wall_s), ("s per update", s.wall_s / s.steps,
                                                            a.wall_s / a.steps),
            ("generated samples/s", s.gen_samples_per_s, a.gen_samples_per_s),
            ("trained samples/s", s.trained_samples_per_s, a.trained_samples_per_s)]
    lines += [f"{name:22}{x:12.4g}{y:12.4g}" for name, x, y in rows]
    lines.append(f"speed-up (sync / async time): {result['speedup']:.3f}x")
    lines += ["", "utilisation (fraction of wall time): " + " / ".join(STATES)]
    for r in (s, a):
        for role, fr in r.utilisation.items():
            lines.append(f"  {r.mode:5} {role:8} " + "  ".join(f"{fr[x]:.3f}" for x in STATES))
    st = a.staleness_stats()
    lines.append(f"async staleness (learner version - sample version): mean {st['mean']:.2f}, "
                 f"p50 {st['p50']:.0f}, p90 {st['p90']:.0f}, max {st['max']}")
    hist = a.staleness_hist()
    lines.append("  histogram (prompt groups, staleness 0..): " + " ".join(map(str, hist[:16]))
                 + (" ..." if len(hist) > 16 else ""))
    if sweep:
        lines += ["", "speed-up vs searchers: " + ", ".join(
            f"{r['num_searchers']}: {r['speedup']:.2f}x" for r in sweep),
                  "  with replay ratio 1: " + ", ".join(
            f"{r['num_searchers']}: {r['speedup_replay1']:.2f}x" for r in sweep)]
    lines += ["", "assumptions:"] + [f"  - {x}" for x in ASSUMPTIONS]
    return lines


def plot(result: dict, sweep: list[dict], out: Path, prefix: str, title: str,
         searchers: int) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    colors = {"generating": "tab:green", "training": "tab:blue", "syncing": "tab:orange",
              "waiting": "lightgray"}
    paths = []
    fig, ax = plt.subplots(figsize=(5, 2.6))
    labels = [f"{m} {role}" for m in ("sync", "async") for role in result[m].utilisation]
    left = [0.0] * len(labels)
    for state in STATES:
        vals = [result[m].utilisation[role][state] for m in ("sync", "async")
                for role in result[m].utilisation]
        ax.barh(labels, vals, left=left, color=colors[state], label=state)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of wall-clock time")
    ax.set_title(f"{title}: utilisation (speed-up {result['speedup']:.2f}x)", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)
    paths.append(_save(fig, out / f"{prefix}util.png"))

    fig, ax = plt.subplots(figsize=(5, 2.6))
    hist = result["async"].staleness_hist()
    shown = hist[:12] + ([sum(hist[12:])] if len(hist) > 12 else [])
    ax.bar(range(len(shown)), [h / sum(hist) for h in shown], color="tab:blue")
    if len(hist) > 12:
        ax.set_xticks(range(0, 13, 2), [*map(str, range(0, 12, 2)), "12+"])
    st = result["async"].staleness_stats()
    ax.set_xlabel("staleness (learner steps)")
    ax.set_ylabel("fraction of samples")
    ax.set_title(f"{title}: async staleness (mean {st['mean']:.1f}, p90 {st['p90']:.0f}, "
                 f"max {st['max']})", fontsize=9)
    paths.append(_save(fig, out / f"{prefix}staleness.png"))

    fig, ax = plt.subplots(figsize=(5, 2.6))
    n = [r["num_searchers"] for r in sweep]
    ax.plot(n, [r["speedup"] for r in sweep], "o-", color="tab:red", label="TBA (unlimited reuse)")
    ax.plot(n, [r["speedup_replay1"] for r in sweep], "s--", color="tab:purple", ms=4,
            label="replay ratio 1")
    ax.plot([searchers], [result["speedup"]], "k*", ms=10, label="this layout")
    ax.legend(fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("searchers (generation engines)")
    ax.set_ylabel("sync time / async time")
    ax.set_title(f"{title}: speed-up vs searchers", fontsize=9)
    paths.append(_save(fig, out / f"{prefix}speedup.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=72, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def cmd_run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    result = compare(cfg)
    sweep = sweep_searchers(cfg, sorted({*SWEEP[:args.sweep_points], cfg.num_searchers})) \
        if args.out or args.sweep_points else None
    if args.json:
        print(json.dumps({"config": dataclasses.asdict(cfg), "costs": costs(cfg),
                          "sync": result["sync"].summary(cfg.k), "async": result["async"].summary(cfg.k),
                          "speedup": result["speedup"], "sweep": sweep,
                          "assumptions": list(ASSUMPTIONS)}, indent=1))
    else:
        print("\n".join(report_lines(cfg, result, sweep)))
    if args.out:
        title = args.preset or "custom"
        for path in plot(result, sweep, Path(args.out), args.prefix, title, cfg.num_searchers):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    measured = json.loads(Path(args.measured).read_text())
    out = calibrate(measured)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"sync: {out['sync_wall_s']:.4g} s, async: {out['async_wall_s']:.4g} s, "
          f"predicted speed-up {out['predicted_speedup']:.3f}x")
    if "measured_speedup" in out:
        print(f"measured speed-up {out['measured_speedup']:.3f}x, relative error "
              f"{100 * out['relative_error']:+.1f}%")
    print("assumptions:\n" + "\n".join(f"  - {x}" for x in ASSUMPTIONS))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    print("| preset | N | time to N, sync / async (h) | s per update, sync / async | speed-up "
          "| trained samples/s, sync / async | async learner train / sync / wait "
          "| searcher generating, sync / async | async staleness p50 / p90 / mean / max | recent slots |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in PRESETS:
        cfg = preset(name)
        r = compare(cfg)
        s, a = r["sync"], r["async"]
        lu, st = a.utilisation["learner"], a.staleness_stats()
        print(f"| {name} | {cfg.steps} | {s.wall_s / 3600:.2f} / {a.wall_s / 3600:.2f} "
              f"| {s.wall_s / s.steps:.2f} / {a.wall_s / a.steps:.2f} | {r['speedup']:.2f}x "
              f"| {s.trained_samples_per_s:.1f} / {a.trained_samples_per_s:.1f} "
              f"| {lu['training']:.2f} / {lu['syncing']:.2f} / {lu['waiting']:.2f} "
              f"| {s.utilisation['searcher']['generating']:.2f} / "
              f"{a.utilisation['searcher']['generating']:.2f} "
              f"| {st['p50']:.0f} / {st['p90']:.0f} / {st['mean']:.1f} / {st['max']} "
              f"| {100 * st['recent_frac']:.0f}% |")
        if args.out:
            sweep = sweep_searchers(cfg, sorted({*SWEEP, cfg.num_searchers}))
            plot(r, sweep, Path(args.out), f"sim_{name}_", name, cfg.num_searchers)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate sync and async for one configuration")
    r.add_argument("--preset", choices=list(PRESETS), help="start from a preset layout")
    r.add_argument("--from-json", help="JSON of SimConfig fields (e.g. measured costs)")
    r.add_argument("--out", help="directory for the PNGs (utilisation, staleness, speed-up sweep)")
    r.add_argument("--prefix", default="sim_", help="file-name prefix of the PNGs")
    r.add_argument("--sweep-points", type=int, default=None,
                   help=f"searcher counts for the sweep, first n of {SWEEP} (default: all with --out)")
    r.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_config_flags(r)
    c = sub.add_parser("calibrate", help="predict sync/async ratio from measured per-role costs",
                       description="keys: " + "; ".join(f"{k}: {v}" for k, v in
                                                         CALIBRATION_KEYS.items()))
    c.add_argument("measured", help="JSON of measured costs (keys in --help)")
    c.add_argument("--json", action="store_true")
    t = sub.add_parser("presets", help="markdown table of every preset (and PNGs with --out)")
    t.add_argument("--out", help="directory for sim_<preset>_*.png")
    args = p.parse_args(argv)
    if args.cmd == "run" and args.out and args.sweep_points is None:
        args.sweep_points = len(SWEEP)
    return {"run": cmd_run, "calibrate": cmd_calibrate, "presets": cmd_presets}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
