"""The learning-fidelity runner (tools/experiments): planning, collection of run metrics,
aggregation over seeds, resumability, the report, and the offline data-set construction.

Runs are faked (a fake `hpc-tba` writes the files a real run writes), except one smoke run of
the real commands behind the `long` marker.
"""
from __future__ import annotations

import json
import math
import os
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from experiments import aggregate, offline, report, runner
from experiments.runner import Arm, Column, Experiment, Plot, Prepared

from hpc_tba.tasks.offline import effective_positive_fraction

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------- a fake hpc-tba


def _kv(cmd):
    return dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("-"))


class FakeHpcTba:
    """Writes what `hpc-tba train` / `eval` write; accuracy = 0.5 + 0.1·lr-ish knob + seed noise."""

    def __init__(self, fail_arm: str | None = None):
        self.calls: list[tuple[str, ...]] = []
        self.fail_arm = fail_arm

    def __call__(self, cmd, log: Path) -> int:
        self.calls.append(tuple(cmd))
        log.write_text(" ".join(cmd) + "\n")
        kv = _kv(cmd)
        if cmd[1] == "train":
            run_dir = Path(kv["run_dir"])
            if self.fail_arm and f"/{self.fail_arm}/" in str(run_dir):
                log.write_text("Traceback: boom\n")
                return 1
            run_dir.mkdir(parents=True)
            seed, gain = int(kv["learner.seed"]), float(kv.get("gain", 0.1))
            after = 0.5 + gain + 0.01 * seed
            (run_dir / "summary.json").write_text(json.dumps(
                {"steps": 3, "pass@1": {"0": 0.5, "2": 0.5 + gain / 2, "3": after},
                 "pass@1_before": 0.5, "pass@1_after": after}))
            rows = [{"step": s, "time/elapsed_s": 2.0 * s + seed, "topr/pos_frac": 0.1 * s}
                    for s in (1, 2, 3)] + [{"step": 3, "checkpoint/time_s": 0.1}]
            (run_dir / "metrics_learner.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "torn')
            (run_dir / "final_model").mkdir()
        else:
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            model = cmd[cmd.index("--model") + 1] if "--model" in cmd else None
            acc = 0.4 if model is None else 0.6
            (out / "eval.json").write_text(json.dumps(
                {"metrics": {"eval/pass@1_greedy": acc, "eval/pass@1": acc - 0.1,
                             "diversity/self_bleu": None}}))
        return 0


def _experiment(**kw) -> Experiment:
    base = dict(
        name="toy", title="Toy: a test experiment", description="A toy.",
        arms=(Arm("start", "starting model", train=False, once=True),
              Arm("small", "small gain", ("algo=topr", "task.path={data}", "gain=0.1"),
                  group="g1", info={"baseline": "{c}"}),
              Arm("big", "big gain", ("algo=topr", "task.path={data}", "gain=0.3"), group="g2")),
        common=("+experiment=fidelity_offline",), quick=("learner.total_steps=3",),
        curve_keys=("topr/pos_frac",),
        columns=(Column("eval/pass@1_greedy", "pass@1"), Column("topr/pos_frac@mean", "pos", "float")),
        plots=(Plot("bar", "eval/pass@1_greedy"), Plot("curve", "topr/pos_frac"),
               Plot("curve", "test/pass@1", x="time/elapsed_s")),
        baseline_arm="start",
        prepare=lambda data_dir, *, quick, force: Prepared({"data": str(data_dir / "d.jsonl"),
                                                            "c": "0.25"},
                                                           {"d.jsonl": {"rows": 10, "p": 0.1}}),
        derive=lambda m, info: {"double_c": 2 * float(info["baseline"])} if "baseline" in info else {},
    )
    base.update(kw)
    return Experiment(**base)


# --------------------------------------------------------------------------- aggregation


def test_summarize_is_mean_and_sample_std():
    s = aggregate.summarize([1.0, 2.0, 3.0, 6.0])
    assert s["mean"] == 3.0 and s["n"] == 4 and (s["min"], s["max"]) == (1.0, 6.0)
    assert math.isclose(s["std"], math.sqrt(14 / 3))  # ddof 1
    assert aggregate.summarize([0.7])["std"] == 0.0
    with pytest.raises(ValueError):
        aggregate.summarize([])


def test_aggregate_curve_keeps_steps_every_seed_logged():
    c = aggregate.aggregate_curve([[[1, 1.0], [2, 2.0], [3, 3.0]], [[1, 3.0], [3, 5.0]]])
    assert c == {"step": [1, 3], "mean": [2.0, 4.0], "std": [math.sqrt(2), math.sqrt(2)], "n": 2}


def test_collect_run_reads_summary_curves_and_eval(tmp_path):
    fake = FakeHpcTba()
    run_dir = tmp_path / "r"
    fake(("hpc-tba", "train", f"run_dir={run_dir}", "learner.seed=1"), tmp_path / "t.log")
    fake(("hpc-tba", "eval", "--model", str(run_dir / "final_model"), "--out", str(run_dir / "eval")),
         tmp_path / "e.log")
    metrics, curves = aggregate.collect_run(run_dir, ["topr/pos_frac", "absent/key"])
    # online: pass@1 per policy version from summary.json; wall clock from the learner's metrics
    assert curves["test/pass@1"] == [[0, 0.5], [2, 0.55], [3, 0.61]]
    assert curves["time/elapsed_s"] == [[1, 3.0], [2, 5.0], [3, 7.0]]
    assert "absent/key" not in curves
    assert metrics["summary/pass@1_after"] == 0.61 and metrics["steps"] == 3
    assert metrics["time/elapsed_s@last"] == 7.0
    assert math.isclose(metrics["topr/pos_frac@mean"], 0.2)
    assert metrics["eval/pass@1_greedy"] == 0.6
    assert "diversity/self_bleu" not in metrics  # null in eval.json: undefined, not zero


# --------------------------------------------------------------------------- planning


def test_plan_fills_placeholders_seeds_and_eval_only_arms(tmp_path):
    exp = _experiment()
    specs = runner.plan(exp, seeds=2, quick=True, root=tmp_path, vars={"data": "D", "c": "0.5"})
    names = [(s.arm.name, s.seed) for s in specs]
    assert names == [("start", 0), ("small", 0), ("big", 0), ("small", 1), ("big", 1)]
    small1 = specs[3]
    assert small1.train_cmd[:3] == ("hpc-tba", "train", "+experiment=fidelity_offline")
    assert "task.path=D" in small1.train_cmd and "learner.total_steps=3" in small1.train_cmd
    assert "learner.seed=1" in small1.train_cmd and small1.train_cmd[-1].startswith("run_dir=")
    assert small1.eval_cmd[small1.eval_cmd.index("--model") + 1].endswith("small/seed1/final_model")
    assert "--limit" in small1.eval_cmd and "searcher.seed=1" in small1.eval_cmd
    start = specs[0]
    assert start.train_cmd is None and "--model" not in start.eval_cmd
    assert small1.result_path == tmp_path / "toy" / "small" / "seed1.json"
    with pytest.raises(runner.ExperimentError, match="placeholder 'data'"):
        runner.plan(exp, seeds=1, quick=False, root=tmp_path, vars={"c": "0"})
    with pytest.raises(runner.ExperimentError, match="no arm 'nope'"):
        runner.plan(exp, seeds=1, quick=False, root=tmp_path, vars={}, arms=["nope"])
    with pytest.raises(runner.ExperimentError, match="--seeds"):
        runner.plan(exp, seeds=0, quick=False, root=tmp_path, vars={})


def test_bad_definitions_are_refused():
    with pytest.raises(runner.ExperimentError, match="repeat"):
        _experiment(arms=(Arm("a", "A"), Arm("a", "A again")))
    with pytest.raises(runner.ExperimentError, match="baseline_arm"):
        _experiment(baseline_arm="missing")
    with pytest.raises(runner.ExperimentError, match="directory"):
        Arm("a b", "spaces")
    with pytest.raises(runner.ExperimentError, match="tuple"):
        Arm("a", "A", overrides="algo=tb")
    with pytest.raises(runner.ExperimentError, match="eval_args"):
        _experiment(eval_args=None)
    with pytest.raises(runner.ExperimentError, match="kind"):
        Plot("pie", "x")


# --------------------------------------------------------------------------- running


def test_run_experiment_aggregates_resumes_and_forces(tmp_path):
    exp, fake, out = _experiment(), FakeHpcTba(), tmp_path / "results"
    logs: list[str] = []
    path, failures = runner.run_experiment(exp, seeds=3, root=tmp_path / "runs", out=out,
                                           jobs=2, execute=fake, log=logs.append)
    assert failures == [] and path == out / "toy.json"
    data = json.loads(path.read_text())
    arms = {a["name"]: a for a in data["arms"]}
    assert arms["start"]["seeds"] == [0] and arms["big"]["seeds"] == [0, 1, 2]
    after = arms["big"]["metrics"]["summary/pass@1_after"]
    assert math.isclose(after["mean"], 0.81) and math.isclose(after["std"], 0.01)
    assert arms["small"]["metrics"]["double_c"]["mean"] == 0.5  # derive saw the filled info
    assert arms["small"]["info"] == {"baseline": "0.25"}
    assert arms["big"]["curves"]["test/pass@1"]["step"] == [0, 2, 3]
    assert data["data"] == {"d.jsonl": {"rows": 10, "p": 0.1}}
    assert arms["big"]["train_cmd"].startswith("hpc-tba train +experiment=fidelity_offline")
    n_calls = len(fake.calls)
    assert n_calls == 1 + 2 * 2 * 3  # start: eval only, once; 2 arms x 3 seeds x (train, eval)

    again = FakeHpcTba()
    runner.run_experiment(exp, seeds=3, root=tmp_path / "runs", out=out, execute=again,
                          log=logs.append)
    assert again.calls == []  # every run reused
    reused = json.loads(path.read_text())
    assert reused["results_id"] == data["results_id"]
    assert reused["elapsed_s"] == data["elapsed_s"]  # the wall clock of the sweep that ran them
    runner.run_experiment(exp, seeds=1, root=tmp_path / "runs", out=out, execute=again,
                          force=True, arms=["big"], log=logs.append)
    assert len(again.calls) == 2


def test_a_new_metric_needs_no_rerun_but_a_changed_arm_reruns(tmp_path):
    root, out = tmp_path / "runs", tmp_path / "out"
    runner.run_experiment(_experiment(), seeds=2, root=root, out=out, execute=FakeHpcTba(),
                          log=lambda s: None)
    more = _experiment(curve_keys=("topr/pos_frac", "checkpoint/time_s"))
    fake = FakeHpcTba()
    path, _ = runner.run_experiment(more, seeds=2, root=root, out=out, execute=fake,
                                    log=lambda s: None)
    assert fake.calls == []
    arms = {a["name"]: a for a in json.loads(path.read_text())["arms"]}
    assert arms["big"]["metrics"]["checkpoint/time_s@last"]["mean"] == 0.1
    assert arms["big"]["metrics"]["wall/train_s"]["n"] == 2  # the times of the original runs
    changed = _experiment(arms=(Arm("start", "starting model", train=False, once=True),
                                Arm("small", "small gain", ("algo=topr", "task.path={data}",
                                                            "gain=0.1"), info={"baseline": "{c}"}),
                                Arm("big", "big gain", ("algo=topr", "task.path={data}",
                                                        "gain=0.2"))))
    runner.run_experiment(changed, seeds=2, root=root, out=out, execute=fake, log=lambda s: None)
    assert len(fake.calls) == 4 and all("/big/" in " ".join(c) for c in fake.calls)


def test_a_failed_run_is_reported_and_the_rest_still_aggregate(tmp_path):
    exp = _experiment()
    logs: list[str] = []
    path, failures = runner.run_experiment(exp, seeds=2, root=tmp_path / "runs",
                                           out=tmp_path / "out", execute=FakeHpcTba("small"),
                                           log=logs.append)
    assert len(failures) == 2 and "boom" in failures[0] and "hpc-tba train" in failures[0]
    names = [a["name"] for a in json.loads(path.read_text())["arms"]]
    assert names == ["start", "big"]
    # the failed runs left no result: the next invocation retries them (and their run_dir)
    retry = FakeHpcTba()
    _, failures = runner.run_experiment(exp, seeds=2, root=tmp_path / "runs",
                                        out=tmp_path / "out", execute=retry, log=logs.append)
    assert failures == [] and len(retry.calls) == 4


# --------------------------------------------------------------------------- report


def test_report_renders_tables_plots_and_flags_a_stale_discussion(tmp_path):
    out = tmp_path / "results"
    path, _ = runner.run_experiment(_experiment(), seeds=2, root=tmp_path / "runs", out=out,
                                    execute=FakeHpcTba(), log=lambda s: None)
    rid = json.loads(path.read_text())["results_id"]
    (out / "toy.discussion.md").write_text(f"<!-- results: {rid} -->\nIt agrees.\n")
    md = report.render(out, tmp_path / "RESULTS.md").read_text()
    assert "## Toy: a test experiment" in md and "It agrees." in md and "**Note:**" not in md
    assert "| big gain | g2 | 60.0 ± 0.0% | +20.0 pts |" in md  # Δ vs the starting model
    assert "| starting model | — | 40.0% | — |" in md
    pngs = sorted(p.name for p in out.glob("toy_*.png"))
    assert pngs == ["toy_1_bar_eval_pass_1_greedy.png", "toy_2_curve_topr_pos_frac.png",
                    "toy_3_curve_test_pass_1.png"]
    assert "](results/toy_1_bar_eval_pass_1_greedy.png)" in md
    assert "| `d.jsonl` | 10 | 10.0% |" in md
    (out / "toy.discussion.md").write_text("<!-- results: 0000000000 -->\nOld prose.\n")
    assert "**Note:** this discussion was written against results `0000000000`" in \
        report.render(out, tmp_path / "RESULTS.md").read_text()
    with pytest.raises(runner.ExperimentError, match="no experiment results"):
        report.render(tmp_path / "empty", tmp_path / "R.md")


def test_report_keeps_hand_written_sections(tmp_path):
    out = tmp_path / "results"
    runner.run_experiment(_experiment(), seeds=1, root=tmp_path / "runs", out=out,
                          execute=FakeHpcTba(), log=lambda s: None)
    (out / "zz_hand.section.md").write_text("## Hand: measured by hand\n\n| a | b |\n")
    md = report.render(out, tmp_path / "RESULTS.md").read_text()
    assert md.index("## Toy: a test experiment") < md.index("## Hand: measured by hand")
    assert "[Hand](#hand-measured-by-hand)" in md and "| a | b |" in md
    assert report.render(out, tmp_path / "RESULTS.md").read_text() == md  # regenerated: kept
    (out / "bad.section.md").write_text("no heading\n")
    with pytest.raises(runner.ExperimentError, match="bad.section.md.*'## Title'"):
        report.render(out, tmp_path / "RESULTS.md")


def test_cli_refuses_an_unknown_experiment(capsys):
    from experiments import run

    assert run.main(["nope"]) == 2
    assert "unknown experiment 'nope'; known: topr, alol" in capsys.readouterr().err
    assert run.main([]) == 2
    assert run.main(["all", "--arms", "a_lol"]) == 2


def test_every_arm_of_every_experiment_composes():
    """Each arm's overrides (placeholders filled) are a valid hpc-tba configuration."""
    from experiments.definitions import EXPERIMENTS

    from hpc_tba.assembly.compose import compose

    for exp in EXPERIMENTS.values():
        names = {f for o in (*exp.common, *exp.eval_overrides, *(o for a in exp.arms for o in a.overrides))
                 for _, f, _, _ in string.Formatter().parse(o) if f and f != "seed"}
        fake = {n: "x.jsonl" if n.startswith("data") else "0.1" for n in names}
        for spec in runner.plan(exp, seeds=1, quick=False, root=Path("/tmp/r"), vars=fake):
            if spec.train_cmd is not None:
                cfg = compose(list(spec.train_cmd[2:]))
                assert cfg.task.name != "offline" or cfg.cluster.num_searchers == 0, spec.arm.name


# --------------------------------------------------------------------------- offline data


def _rows(n_pos, n_neg, prompts=10):
    rows = [{"prompt": f"{i % prompts}+1=", "response": f"r{i}", "reward": 1.0}
            for i in range(n_pos)]
    rows += [{"prompt": f"{i % prompts}+1=", "response": f"w{i}", "reward": 0.0}
             for i in range(n_neg)]
    return rows


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_take_positive_fraction_is_exact_and_keeps_file_order(fraction):
    rows = _rows(300, 700)
    got = offline.take_positive_fraction(rows, fraction=fraction, size=400,
                                         rng=np.random.default_rng(0))
    assert len(got) == 400 and offline.positive_share(got) == fraction
    order = [rows.index(r) for r in got]
    assert order == sorted(order)
    with pytest.raises(ValueError, match="distinct"):
        offline.take_positive_fraction(rows, fraction=0.9, size=400, rng=np.random.default_rng(0))


def test_distinct_rows_and_pm1_rewards():
    rows = [{"prompt": "1+1=", "response": "2", "reward": 1.0},
            {"prompt": "1+1=", "response": "2", "reward": 1.0},
            {"prompt": "1+2=", "response": "2", "reward": 0.0}]
    d = offline.distinct_rows(rows)
    assert len(d) == 2
    pm = offline.with_pm1_rewards(d)
    assert [r["reward"] for r in pm] == [1.0, -1.0] and [r["correct"] for r in pm] == [True, False]


def test_graded_reward():
    assert offline.graded_reward("42", "42") == 1.0
    assert offline.graded_reward(" 42 ", "42") == 1.0
    assert offline.graded_reward("43", "42") == pytest.approx(0.45)
    assert offline.graded_reward("52", "42") == 0.0 and offline.graded_reward("90", "42") == 0.0
    assert offline.graded_reward("4x", "42") == 0.0 and offline.graded_reward("", "42") == 0.0


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5])
def test_inject_noise_share_and_that_noise_is_wrong_and_distinct(share):
    answers = {f"{i}+1=": str(i + 1) for i in range(10)}
    clean = [{"prompt": f"{i % 10}+1=", "response": str(i % 10 + 1 + i // 10), "reward": 1.0}
             for i in range(70)]
    rows = offline.inject_noise(clean, answers, share=share, max_answer=98,
                                rng=np.random.default_rng(1))
    noise = [r for r in rows if r["noise"]]
    assert abs(len(noise) / len(rows) - share) < 0.01
    assert all(r["response"] != answers[r["prompt"]] and not r["correct"] for r in noise)
    assert all(r["reward"] == offline.graded_reward(r["response"], answers[r["prompt"]])
               for r in noise)
    assert len(offline.distinct_rows(rows)) == len(rows)  # nothing the buffer would drop
    with pytest.raises(ValueError):
        offline.inject_noise(clean, answers, share=1.0, max_answer=98, rng=np.random.default_rng(1))


def test_advantage_stats_by_kind():
    rows = [{"advantage": 0.5, "correct": True, "noise": False},
            {"advantage": -0.1, "correct": True, "noise": False},
            {"advantage": -0.3, "correct": False, "noise": False},
            {"advantage": 0.0, "correct": False, "noise": True},
            {"advantage": 0.2, "correct": False, "noise": True}]
    s = offline.advantage_stats(rows)
    assert s["A<=0 (all)"] == 0.6 and s["A<=0 (correct)"] == 0.5
    assert s["A<=0 (model's wrong)"] == 1.0 and s["A<=0 (injected noise)"] == 0.5


def test_topr_baselines_hit_the_target_effective_fraction():
    cs = offline.topr_baselines({"p10": 0.1, "p50": 0.5}, (0.15, 0.5))
    assert set(cs) == {"c_p10_t15", "c_p10_t50", "c_p50_t15", "c_p50_t50"}
    assert float(cs["c_p50_t50"]) == 0.0
    for key, p in (("c_p10_t15", 0.1), ("c_p10_t50", 0.1), ("c_p50_t15", 0.5)):
        target = int(key.rsplit("_t", 1)[1]) / 100
        assert abs(effective_positive_fraction(p, float(cs[key])) - target) < 1e-3


# --------------------------------------------------------------------------- real smoke run


@pytest.mark.long  # pool, preprocess, 3 steps under mpiexec, one eval: ~45 s on 2 quiet cores
@pytest.mark.mpi
def test_quick_real_run_of_one_arm(tmp_path):
    """The real commands: data from the embedded model, preprocess, 3 steps of A-LoL, eval."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "experiments", "run.py"), "alol", "--quick",
         "--arms", "a_lol", "--root", str(tmp_path / "runs"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "alol.json").read_text())
    (arm,) = data["arms"]
    assert arm["metrics"]["steps"]["mean"] == 3
    assert 0.0 <= arm["metrics"]["eval/pass@1_greedy"]["mean"] <= 1.0
    assert 0.0 < data["data"]["alol_noise30.jsonl"]["injected noise"] < 0.5
    assert (tmp_path / "out" / "RESULTS.md").is_file()
