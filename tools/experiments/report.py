"""Render docs/RESULTS.md and its PNG plots from every `<experiment>.json` in docs/results.

    python tools/experiments/report.py [--results docs/results] [--out docs/RESULTS.md]

`run.py` calls this after every experiment, so a JSON added by any experiment (offline or
online) lands in the same document. Per experiment: its description; the command, date, machine
and time it took; the data sets; a table of mean ± std over seeds (n = seeds); the plots; the
exact `hpc-tba` command of each arm; then the hand-written discussion
`<results>/<experiment>.discussion.md`, if there is one. A discussion opens with
`<!-- results: ID -->`, the `results_id` of the numbers it was written against; when the numbers
have changed since, the report says so above it instead of silently pairing old prose with new
numbers.

A result measured by hand rather than by an experiment definition lives in
`<results>/<name>.section.md`, a Markdown section that opens with its `## Title` line; each one
is copied after the generated experiments, in name order, and listed in the contents, so
regenerating the file never drops it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.runner import DEFAULT_OUT, REPO, ExperimentError, format_value  # noqa: E402

DEFAULT_REPORT = REPO / "docs" / "RESULTS.md"
STAMP = re.compile(r"<!--\s*results:\s*([0-9a-f]+)\s*-->")


def load_results(results_dir: Path, order: Sequence[str] = ()) -> list[dict]:
    """Every experiment JSON in results_dir: those named in `order` first, then by name."""
    docs = []
    for path in sorted(Path(results_dir).glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "experiment" in data and "arms" in data:
            docs.append(data)
    rank = {n: i for i, n in enumerate(order)}
    return sorted(docs, key=lambda d: (rank.get(d["experiment"], len(rank)), d["experiment"]))


def load_sections(results_dir: Path) -> list[tuple[str, str]]:
    """The hand-written sections in results_dir: (title, text), by file name.

    Each `<name>.section.md` must open with a `## ` heading (the title the contents links to)."""
    sections = []
    for path in sorted(Path(results_dir).glob("*.section.md")):
        text = path.read_text().strip()
        first = text.splitlines()[0] if text else ""
        if not first.startswith("## "):
            raise ExperimentError(f"{path}: a hand-written section must open with a '## Title' "
                                  f"line, not {first[:60]!r}")
        sections.append((first[3:].strip(), text))
    return sections


def mean_std(stat: dict, fmt: str) -> str:
    """`mean ± std` in the column's format (± omitted for a single run)."""
    mean = format_value(stat["mean"], fmt)
    if stat["n"] < 2:
        return mean
    if fmt == "pct":
        return f"{100 * stat['mean']:.1f} ± {100 * stat['std']:.1f}%"
    return f"{mean} ± {format_value(stat['std'], fmt)}"


def render_table(data: dict) -> str:
    """The experiment's main table: one row per arm, mean ± std over its seeds."""
    cols = data["columns"]
    base = next((a for a in data["arms"] if a["name"] == data.get("baseline_arm")), None)
    first = cols[0] if cols else None
    delta = base is not None and first is not None and first["key"] in base["metrics"]
    head = ["arm", "data / group", *(c["label"] for c in cols)]
    if delta:
        head.insert(3, f"Δ {first['label']} vs {base['label']}")
    head.append("seeds")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in data["arms"]:
        cells = [arm["label"], arm["group"] or "—"]
        for c in cols:
            s = arm["metrics"].get(c["key"])
            cells.append(mean_std(s, c["fmt"]) if s else "—")
        if delta:
            s = arm["metrics"].get(first["key"])
            d = s["mean"] - base["metrics"][first["key"]]["mean"] if s else None
            text = "—" if d is None or arm is base else (
                f"{100 * d:+.1f} pts" if first["fmt"] == "pct" else f"{d:+.3g}")
            cells.insert(3, text)
        cells.append(str(len(arm["seeds"])))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt_stat(key: str, v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float) and math.isnan(v):
        return "—"
    if float(v).is_integer() and abs(v) >= 1:
        return f"{int(v)}"
    if 0.0 <= v <= 1.0 and not key.lower().startswith("mean"):
        return f"{100 * v:.1f}%"
    return f"{v:.3f}"


def render_data(stats: dict) -> str:
    """Data-set facts (row name -> column -> value) as a table."""
    if not stats:
        return ""
    keys = list(dict.fromkeys(k for row in stats.values() for k in row))
    lines = ["| data set | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for name, row in stats.items():
        lines.append(f"| `{name}` | " + " | ".join(_fmt_stat(k, row[k]) if k in row else "—"
                                                   for k in keys) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots

def _fmt_of(data: dict, key: str) -> str:
    return next((c["fmt"] for c in data["columns"] if c["key"] == key), "float")


def _scale(fmt: str) -> float:
    return 100.0 if fmt == "pct" else 1.0


def plot_bar(data: dict, spec: dict, path: Path) -> bool:
    """Final metric per trained arm, clustered by group; error bars = std; dots = seeds."""
    import matplotlib.pyplot as plt

    arms = [a for a in data["arms"] if a["train"] and spec["y"] in a["metrics"]]
    if not arms:
        return False
    k = _scale(_fmt_of(data, spec["y"]))
    groups = list(dict.fromkeys(a["group"] for a in arms))
    labels = list(dict.fromkeys(a["label"] for a in arms))
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(max(6.0, 3.5 + 0.55 * len(arms) + 0.4 * len(groups)), 4.2))
    x, ticks, seen = 0.0, [], set()
    for g in groups:
        mine = [a for a in arms if a["group"] == g]
        start = x
        for a in mine:
            s = a["metrics"][spec["y"]]
            ax.bar(x, k * s["mean"], yerr=k * s["std"] if s["n"] > 1 else None, width=0.8,
                   color=colors[a["label"]], capsize=3,
                   label=a["label"] if a["label"] not in seen else None)
            seen.add(a["label"])
            ax.scatter([x] * len(s["values"]), [k * v for v in s["values"]], color="black", s=8,
                       zorder=3)
            x += 1.0
        ticks.append(((start + x - 1.0) / 2, g or "—"))
        x += 0.6
    base = next((a for a in data["arms"] if a["name"] == data.get("baseline_arm")), None)
    if base is not None and spec["y"] in base["metrics"]:
        v = k * base["metrics"][spec["y"]]["mean"]
        ax.axhline(v, color="gray", linestyle="--", linewidth=1,
                   label=f"{base['label']} ({v:.1f}{'%' if k == 100 else ''})")
    ax.set_xticks([t for t, _ in ticks], [g for _, g in ticks])
    ax.set_ylabel(spec["ylabel"] or spec["y"])
    ax.set_title(spec["title"] or spec["y"])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _x_values(arm: dict, x: str, steps: Sequence[int]) -> list[float] | None:
    if x == "step":
        return [float(s) for s in steps]
    cx = arm["curves"].get(x)
    if cx is None:
        return None
    at = dict(zip(cx["step"], cx["mean"]))
    at.setdefault(0, 0.0)  # cumulative quantities start at 0
    if any(s not in at for s in steps):
        return None
    return [at[s] for s in steps]


def plot_curve(data: dict, spec: dict, path: Path) -> bool:
    """Curve y over x per arm (mean, ± std band), one panel per group of arms."""
    import matplotlib.pyplot as plt

    arms = [a for a in data["arms"] if spec["y"] in a["curves"]]
    if not arms:
        return False
    groups = list(dict.fromkeys(a["group"] for a in arms))
    labels = list(dict.fromkeys(a["label"] for a in arms))
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 3.8), squeeze=False,
                             sharey=True)
    for ax, g in zip(axes[0], groups):
        for a in (a for a in arms if a["group"] == g):
            c = a["curves"][spec["y"]]
            xs = _x_values(a, spec["x"], c["step"])
            if xs is None:
                continue
            lo = [m - s for m, s in zip(c["mean"], c["std"])]
            hi = [m + s for m, s in zip(c["mean"], c["std"])]
            ax.plot(xs, c["mean"], color=colors[a["label"]], label=a["label"], linewidth=1.4)
            ax.fill_between(xs, lo, hi, color=colors[a["label"]], alpha=0.2, linewidth=0)
        ax.set_title(g or spec["title"] or spec["y"], fontsize=10)
        ax.set_xlabel(spec["xlabel"] or spec["x"])
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel(spec["ylabel"] or spec["y"])
    if len(groups) > 1 and spec["title"]:
        fig.suptitle(spec["title"], fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render_plots(data: dict, results_dir: Path) -> list[Path]:
    """Write the experiment's plots next to its JSON; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for i, spec in enumerate(data["plots"], 1):
        slug = re.sub(r"[^A-Za-z0-9]+", "_", spec["y"]).strip("_")
        path = Path(results_dir) / f"{data['experiment']}_{i}_{spec['kind']}_{slug}.png"
        draw = plot_bar if spec["kind"] == "bar" else plot_curve
        if draw(data, spec, path):
            written.append(path)
    return written


# --------------------------------------------------------------------------- the document

def discussion(results_dir: Path, data: dict) -> str:
    """The hand-written discussion of this experiment, with a warning if its numbers changed."""
    path = Path(results_dir) / f"{data['experiment']}.discussion.md"
    if not path.is_file():
        return ""
    text = path.read_text().strip()
    m = STAMP.search(text)
    if m is None or m.group(1) != data["results_id"]:
        was = m.group(1) if m else "no id"
        warn = (f"> **Note:** this discussion was written against results `{was}`; the table "
                f"above is `{data['results_id']}`. Check the numbers quoted below against it.\n\n")
        return warn + text
    return text


def render_experiment(data: dict, results_dir: Path, report_dir: Path) -> str:
    plots = render_plots(data, results_dir)
    n_runs = sum(len(a["seeds"]) for a in data["arms"])
    out = [f"## {data['title']}", ""]
    if data.get("quick"):
        out += ["> Smoke run (`--quick`): a few steps on a tiny data set, not a result.", ""]
    out += [data["description"], "",
            f"Regenerate: `{data['command']}` · {n_runs} runs · generated {data['generated_at']} "
            f"on {data['machine']['cpus']} CPU cores · run time {data['run_compute_s'] / 60:.1f} "
            f"min summed over runs, {data['elapsed_s'] / 60:.1f} min wall clock with "
            f"{data.get('jobs', 1)} run(s) at a time (data included) · "
            f"results id `{data['results_id']}`", ""]
    if data.get("data"):
        out += ["Data sets:", "", render_data(data["data"]), ""]
    out += [render_table(data), ""]
    for p in plots:
        out += [f"![{p.stem}]({_relpath(p, report_dir).as_posix()})", ""]
    out += ["<details><summary>Exact command of each arm (seed 0)</summary>", ""]
    for a in data["arms"]:
        cmds = [c for c in (a["train_cmd"], a["eval_cmd"]) if c]
        out.append(f"- **{a['label']}**{' (' + a['group'] + ')' if a['group'] else ''}: "
                   + " && ".join(f"`{c}`" for c in cmds))
    out += ["", "</details>", ""]
    text = discussion(results_dir, data)
    if text:
        out += [text, ""]
    return "\n".join(out)


def _relpath(path: Path, start: Path) -> Path:
    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve()))


def render(results_dir: Path = DEFAULT_OUT, out: Path = DEFAULT_REPORT,
           order: Sequence[str] = ()) -> Path:
    """Write the results document from every experiment JSON in results_dir; returns its path."""
    results_dir, out = Path(results_dir), Path(out)
    docs = load_results(results_dir, order)
    sections = load_sections(results_dir)
    if not docs:
        raise ExperimentError(f"no experiment results in {results_dir} (run "
                              "tools/experiments/run.py first)")
    lines = [
        "# Results: learning fidelity",
        "",
        "Does each objective do on this system what its paper says it does? Small, fast "
        "experiments on the embedded task (2-digit addition with the tiny Llama, 2 CPU cores), "
        "several seeds each, mean ± standard deviation over seeds (n = seeds; sample std). Every "
        "table and plot below is generated from `docs/results/<experiment>.json` by "
        "`python tools/experiments/report.py`; `python tools/experiments/run.py all --jobs 2` "
        "reruns every experiment and then the report (runs already finished under "
        "`runs/experiments` are reused; `--force` reruns them; on a shared machine prefix "
        "`nice -n 19`). Where a result disagrees with a paper, the discussion says so.",
        "",
        "Contents: " + " · ".join(
            [f"[{d['title'].split(':')[0]}](#{_anchor(d['title'])})" for d in docs]
            + [f"[{title.split(':')[0]}](#{_anchor(title)})" for title, _ in sections]),
        "",
    ]
    for d in docs:
        lines.append(render_experiment(d, results_dir, out.parent))
    lines += [text + "\n" for _, text in sections]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=DEFAULT_OUT,
                    help="directory of <experiment>.json (default docs/results)")
    ap.add_argument("--out", type=Path, default=DEFAULT_REPORT,
                    help="the Markdown file to write (default docs/RESULTS.md)")
    args = ap.parse_args(argv)
    try:
        from experiments.definitions import EXPERIMENTS

        path = render(args.results, args.out, order=list(EXPERIMENTS))
    except ExperimentError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
