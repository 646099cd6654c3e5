"""The learning-fidelity experiments. Adding one is a few lines here, plus its name in the
tuple that builds EXPERIMENTS at the bottom:

    TBA = Experiment(
        name="tba", title="TBA vs synchronous baselines", description="...",
        arms=(Arm("tb_async", "TB async", ("algo=tb",)),
              Arm("grpo_sync", "GRPO sync", ("algo=grpo", "learner=sync"))),
        eval_args=None,                       # online runs report test/pass@1 in summary.json
        curve_keys=("buffer/added",),
        columns=(Column("summary/pass@1_after", "held-out pass@1"),),
        plots=(Plot("curve", y="test/pass@1", x="time/elapsed_s", xlabel="wall clock (s)"),))

Shared settings of the offline arms are the Hydra preset `configs/experiment/fidelity_offline.yaml`
(50 steps of 64 rows, lr 1e-4, K = 1); every arm uses them unchanged, so arms differ only in the
objective. They were set once, before any arm was compared, so that one run of the first arm
measured (naive REINFORCE on the 10% set) took about a minute; nothing was tuned per arm.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from experiments.offline import PoolSpec, alol_set, pool_stats, topr_baselines, topr_sets
from experiments.runner import Arm, Column, Experiment, Plot, Prepared
from hpc_tba.tasks.offline import effective_positive_fraction

POOL = PoolSpec(samples=16)
"""16 samples at T = 1 for each of the task's 2000 training prompts (the report's data table
shows how many distinct rows of each kind that gives)."""
QUICK_POOL = PoolSpec(samples=8, max_prompts=100)
OFFLINE = ("+experiment=fidelity_offline",)
QUICK = ("learner.total_steps=3", "learner.prompts_per_step=8")
EVAL_T1 = ("searcher.temperature=1.0",)
"""The sampled pass@1 is at T = 1, the temperature the data were drawn at (greedy is separate)."""

# --------------------------------------------------------------------------- TOPR

TOPR_SETS = {"p10": 0.10, "p50": 0.50}
"""Raw positive fraction of each TOPR data set (rows subsampled from the pool)."""
TOPR_TARGETS = (0.15, 0.50)
"""Effective positive fractions p̃ the baseline arms aim at (the paper: best near 10-20%)."""
TOPR_FAMILY = (
    ("topr", "TOPR", ()),
    ("naive", "naive REINFORCE", ("algo.topr_neg_min=1.0", "algo.topr_neg_max=1.0")),
    ("tis", "truncated IS", ("algo.topr_pos_min=0.0",)),
    ("sftpos", "SFT on positives", ("algo.topr_neg_max=0.0",)),
)
"""(key, label, overrides): the family's settings (ALGORITHMS.md §2; hpc_tba/losses/topr_loss.py)."""
TOPR_BASELINE_ARMS = (("p10", 0.15), ("p10", 0.50), ("p50", 0.15))
"""TOPR with the baseline c that moves the set's p̃ to the target."""


def _group(name: str) -> str:
    return f"{round(100 * TOPR_SETS[name])}% positives"


def prepare_topr(data_dir: Path, *, quick: bool, force: bool) -> Prepared:
    pool = QUICK_POOL if quick else POOL
    sets = topr_sets(data_dir, pool=pool, fractions=TOPR_SETS, size=60 if quick else 3000,
                     force=force)
    vars = {f"data_{n}": str(path) for n, (path, _) in sets.items()}
    vars.update(topr_baselines({n: s["positive fraction p"] for n, (_, s) in sets.items()},
                               TOPR_TARGETS))
    stats = {pool.filename: pool_stats(data_dir / pool.filename),
             **{f"topr_{n}.jsonl": s for n, (_, s) in sets.items()}}
    return Prepared(vars=vars, stats=stats)


def topr_derive(metrics: dict[str, float], info: Mapping[str, str]) -> dict[str, float]:
    """p̃ from the positive fraction the learner actually drew and the arm's baseline c."""
    if "baseline" not in info or "topr/pos_frac@mean" not in metrics:
        return {}
    return {"topr/p_eff": effective_positive_fraction(metrics["topr/pos_frac@mean"],
                                                      float(info["baseline"]))}


def _topr_arms() -> tuple[Arm, ...]:
    arms = [Arm("start", "starting model", train=False, once=True)]
    for d in TOPR_SETS:
        for key, label, extra in TOPR_FAMILY:
            info = {} if key == "sftpos" else {"baseline": "0"}
            arms.append(Arm(f"{key}_{d}", label, ("algo=topr", f"task.path={{data_{d}}}", *extra),
                            group=_group(d), info=info))
    for d, target in TOPR_BASELINE_ARMS:
        t = round(100 * target)
        c = f"{{c_{d}_t{t}}}"
        arms.append(Arm(f"topr_{d}_t{t}", f"TOPR, c for p̃ = {t}%",
                        ("algo=topr", f"task.path={{data_{d}}}", f"algo.topr_baseline={c}"),
                        group=_group(d), info={"baseline": c}))
    return tuple(arms)


TOPR = Experiment(
    name="topr",
    title="TOPR: offline from a fixed data set of the starting model's samples",
    description=(
        "Le Roux et al. (2025) train from a fixed set of the model's own samples with rewards ±1 "
        "and find that naive off-policy REINFORCE collapses once negatives dominate, while TOPR "
        "(SFT on positives, truncated importance weights on negatives) improves; a baseline c "
        "acts through the effective positive fraction p̃ = p(1−c)/(1+c(1−2p)), best near 10-20%. "
        "Here: two data sets of 3,000 distinct (prompt, response) rows drawn from the starting "
        "model at T = 1 on the arithmetic task's training prompts, with 10% and 50% positives "
        "(subsampled to the exact fraction from the pool of 16 samples per prompt, the data "
        "table's first row); four settings of the TOPR family on each, plus TOPR "
        "with the baseline set for p̃ = 15% (and 50% on the 10% set). Every arm: 50 steps of 64 "
        "rows (about one pass over the data), Adam at lr 1e-4, no KL, no reference model. "
        "Evaluated on the 200 held-out prompts: greedy pass@1 and sampled pass@1 at T = 1. "
        "`positives in batches` is the fraction the learner actually drew (a prompt is drawn "
        "first, then one of its rows, so rows of prompts with few rows are drawn more often and "
        "the fraction differs from the file's); `p̃` follows from it and c; "
        "the mean weight of negatives is clip(π/μ, a−, b−) averaged over the run (1: no "
        "tapering), `log π/μ` is the mean sequence log-ratio of the training rows at the last "
        "step (how far the policy has moved from the data's behaviour policy on them)."),
    arms=_topr_arms(),
    common=OFFLINE,
    quick=QUICK,
    eval_overrides=EVAL_T1,
    curve_keys=("topr/pos_frac", "topr/weight_neg", "loss/ratio_log_mean", "loss/topr"),
    columns=(Column("eval/pass@1_greedy", "pass@1 greedy"),
             Column("eval/pass@1", "pass@1 T=1"),
             Column("topr/pos_frac@mean", "positives in batches"),
             Column("topr/p_eff", "p̃"),
             Column("topr/weight_neg@mean", "mean weight of negatives", "float"),
             Column("loss/ratio_log_mean@last", "log π/μ (last step)", "float"),
             Column("wall/train_s", "train time", "s")),
    plots=(Plot("bar", "eval/pass@1_greedy", title="TOPR family: held-out greedy pass@1",
                ylabel="pass@1 (greedy)"),
           Plot("bar", "eval/pass@1", title="TOPR family: held-out pass@1 at T = 1",
                ylabel="pass@1 (T = 1, 8 samples)"),
           Plot("curve", "loss/ratio_log_mean", title="Drift from the behaviour policy on the "
                "training rows", ylabel="mean log π/μ of the batch", xlabel="learner step"),
           Plot("curve", "topr/weight_neg", title="Importance weight of the negatives "
                "(1 = untapered)", ylabel="mean weight of negatives", xlabel="learner step")),
    baseline_arm="start",
    prepare=prepare_topr,
    derive=topr_derive,
)

# --------------------------------------------------------------------------- A-LoL

ALOL_NOISE = 0.30
"""Share of the A-LoL data set that is injected noise (random wrong answers)."""


def prepare_alol(data_dir: Path, *, quick: bool, force: bool) -> Prepared:
    path, stats = alol_set(data_dir, pool=QUICK_POOL if quick else POOL,
                           size=60 if quick else 3000, noise_share=ALOL_NOISE, force=force)
    return Prepared(vars={"data_alol": str(path)}, stats={path.name: stats})


_ALOL = ("algo=alol", "task.path={data_alol}")
_BY_ADV = ("buffer.sampler=advantage",)  # A-LoL draws rows ∝ A+ (ALGORITHMS.md §3)

ALOL = Experiment(
    name="alol",
    title="A-LoL: offline on a data set with injected noise",
    description=(
        "Baheti et al. (ICLR 2024) train on existing data of mixed quality: A = R − V(x) with V "
        "fitted on the frozen reference, rows with A ≤ 0 never trained on, the rest drawn ∝ A+ "
        "and weighted by a clipped ratio to π_ref; the paper reports that this filter makes it "
        "resilient to noisy or suboptimal training data. Here: 3,000 rows, 70% "
        "the starting model's distinct samples (half correct, half wrong) and 30% injected noise "
        "(uniformly random wrong answers). The task's reward is 0/1; A-LoL's papers use "
        "continuous scores, so this set is scored with a graded reward: 1 for the exact answer, "
        "0.5·max(0, 1 − |n − answer|/10) for another number n (a near miss gets partial credit, "
        "most noise gets 0). A is computed by `hpc-tba preprocess` (V: a head on the frozen "
        "starting model's prompt states fitted to the file's rewards). Reward-weighted SFT has no "
        "objective of its own in hpc_tba: it is `algo=alol algo.alol_variant=r_lol "
        "algo.alol_clip_eps=0`, whose importance weight is then exactly 1, i.e. R · NLL with "
        "summed token NLL, rows drawn uniformly. SFT trains on every row (`algo=sft "
        "algo.sft_min_reward=-inf`). The A-LoL KL variant's β_KL = 0.1 is this experiment's "
        "choice (the paper's value is not recorded in ALGORITHMS.md). Same 50 steps of 64 rows, "
        "lr 1e-4, for every arm; evaluated with the exact-match reward on the 200 held-out "
        "prompts. `mean ratio weight` is the importance weight the objective applied to the "
        "rows it trained on (the clipped sequence ratio π/π_ref for A-LoL and R-LoL, the mean "
        "clipped per-token ratio for seq, 1 for ref-free, KL and reward-weighted SFT)."),
    arms=(
        Arm("start", "starting model", train=False, once=True),
        Arm("a_lol", "A-LoL", (*_ALOL, *_BY_ADV), group="A-LoL family"),
        Arm("ref_free", "A-LoL ref-free", (*_ALOL, *_BY_ADV, "algo.alol_variant=ref_free"),
            group="A-LoL family"),
        Arm("seq", "A-LoL seq", (*_ALOL, *_BY_ADV, "algo.alol_variant=seq"), group="A-LoL family"),
        Arm("kl", "A-LoL KL", (*_ALOL, *_BY_ADV, "algo.alol_variant=kl", "algo.alol_kl_beta=0.1"),
            group="A-LoL family"),
        Arm("r_lol", "R-LoL", (*_ALOL, "algo.alol_variant=r_lol"), group="A-LoL family"),
        Arm("sft", "SFT (all rows)", ("algo=sft", "task.path={data_alol}",
                                      "algo.sft_min_reward=-inf"), group="baselines"),
        Arm("wsft", "reward-weighted SFT", (*_ALOL, "algo.alol_variant=r_lol",
                                            "algo.alol_clip_eps=0.0"), group="baselines"),
    ),
    common=OFFLINE,
    quick=QUICK,
    eval_overrides=EVAL_T1,
    curve_keys=("loss/ratio_log_mean", "loss/reward_mean", "alol/adv_pos_frac",
                "alol/weight_mean"),
    columns=(Column("eval/pass@1_greedy", "pass@1 greedy"),
             Column("eval/pass@1", "pass@1 T=1"),
             Column("loss/reward_mean@mean", "mean reward of drawn rows", "float"),
             Column("alol/adv_pos_frac@mean", "rows with A > 0 in batches"),
             Column("alol/weight_mean@mean", "mean ratio weight", "float"),
             Column("loss/ratio_log_mean@last", "log π/π_ref (last step)", "float"),
             Column("wall/train_s", "train time", "s")),
    plots=(Plot("bar", "eval/pass@1_greedy", title="A-LoL on noisy data: held-out greedy pass@1",
                ylabel="pass@1 (greedy)"),
           Plot("bar", "eval/pass@1", title="A-LoL on noisy data: held-out pass@1 at T = 1",
                ylabel="pass@1 (T = 1, 8 samples)"),
           Plot("curve", "loss/ratio_log_mean", title="Drift from π_ref on the training rows",
                ylabel="mean log π/π_ref of the batch", xlabel="learner step")),
    baseline_arm="start",
    prepare=prepare_alol,
)

# --------------------------------------------------------------------------- TBA

_TB = ("algo=tb",)
TBA = Experiment(
    name="tba",
    title="TBA: asynchronous TB vs synchronous GRPO and RLOO (online, embedded task)",
    description=(
        "Bartoldson et al. (2025) decouple search from training: searchers generate without "
        "pause, the learner trains with the trajectory-balance loss on replay-buffer samples "
        "(recent with probability m), and they report reaching a target accuracy several times "
        "faster in wall-clock time than synchronous on-policy training, with more diverse "
        "solutions. Here, on 2 CPU cores (1 learner + 2 searchers, pinned), the embedded "
        "arithmetic task and model: TB asynchronous (the default run) against GRPO and RLOO run "
        "synchronously on the same machinery (`learner=sync`: the searchers generate one batch "
        "with the current weights, the learner trains on exactly it and syncs, repeat; same G = 16 "
        "prompts × K = 10 samples per step, same lr 3e-5), then TBA's knobs: recency m = 0.5 "
        "instead of 0.95, and 1 searcher instead of 2. 60 learner steps per run; held-out greedy "
        "pass@1 on the 200 test prompts every 10 steps (the searchers evaluate), and the exported "
        "final model evaluated with 8 samples per prompt at T = 0.7 (pass@1, pass@8, diversity). "
        "Wall clock starts when every rank has built its role (model loading "
        "excluded). On this task a correct response is one number, so the paper's 'distinct "
        "correct solutions per prompt' is 1 by construction; reported instead: distinct-1 (distinct "
        "answers ÷ answers, over up to 500 sampled responses) and self-BLEU (lower = more diverse). "
        "The sync ÷ async speed-up with 3 seeds and its time breakdown is "
        "`tools/bench_async.py` (README, docs/SIMULATION.md)."),
    arms=(
        Arm("tb_async", "TB async (TBA)", _TB, group="schedule and objective"),
        Arm("grpo_sync", "GRPO sync", ("algo=grpo", "learner=sync"), group="schedule and objective"),
        Arm("rloo_sync", "RLOO sync", ("algo=rloo", "learner=sync"), group="schedule and objective"),
        Arm("tb_async_m50", "TB async, m = 0.5", (*_TB, "buffer.recency_m=0.5"), group="TBA's knobs"),
        Arm("tb_async_1s", "TB async, 1 searcher", (*_TB, "cluster.num_searchers=1"),
            group="TBA's knobs"),
    ),
    common=("learner.total_steps=60", "learner.eval_every=10"),
    quick=("learner.total_steps=4", "learner.eval_every=2"),
    eval_args=("--samples", "8", "--ks", "1,8", "--diversity"),
    curve_keys=("samples/received", "samples/trained", "buffer/staleness_mean"),
    columns=(Column("summary/pass@1_after", "pass@1 greedy (end)"),
             Column("eval/pass@1", "pass@1 T=0.7"),
             Column("eval/pass@8", "pass@8"),
             Column("diversity/distinct_1", "distinct answers (distinct-1)", "float"),
             Column("diversity/self_bleu", "self-BLEU", "float"),
             Column("time/elapsed_s@last", "wall clock", "s"),
             Column("samples/received@last", "samples generated", "int"),
             Column("buffer/staleness_mean@mean", "mean staleness (steps)", "float")),
    plots=(Plot("curve", "test/pass@1", x="time/elapsed_s", title="Held-out pass@1 vs wall clock",
                ylabel="pass@1 (greedy)", xlabel="seconds since every rank was ready"),
           Plot("curve", "test/pass@1", x="samples/received", title="Held-out pass@1 vs samples "
                "generated", ylabel="pass@1 (greedy)", xlabel="responses generated"),
           Plot("bar", "eval/pass@8", title="pass@8 of the final policy (T = 0.7)",
                ylabel="pass@8")),
)

# --------------------------------------------------------------------------- red-teaming

REDTEAM_SEARCHERS = (1, 2, 3)


def prepare_redteam(data_dir: Path, *, quick: bool, force: bool) -> Prepared:
    """The toy red-teaming setup (hpc_tba/tasks/redteam_toy.py): prompts and a trained classifier."""
    from hpc_tba.tasks import redteam_toy

    out = data_dir / "redteam"
    if force and out.exists():
        import shutil

        shutil.rmtree(out)
    redteam_toy.build(out)
    acc = redteam_toy.classifier_accuracy(out / "classifier")
    return Prepared(vars={"rt_prompts": str(out / "prompts"), "rt_clf": str(out / "classifier"),
                          "rt_victim": str(out / "victim")},
                    stats={"toy classifier": {"accuracy on random strings": acc,
                                              "toxic": f"contains {redteam_toy.TOXIC_DIGIT!r}"}})


_RT_TASK = ("task=redteam", "task.path={rt_prompts}", "task.reward_model={rt_clf}",
            "task.victim_model={rt_victim}", "task.reward_label=1", "task.victim_max_new_tokens=8")

REDTEAM = Experiment(
    name="redteam",
    title="Red-teaming: more searchers, more diverse successful attacks? (toy, online)",
    description=(
        "TBA (Bartoldson et al., 2025, ALGORITHMS.md §1 red-teaming) reports that adding searchers "
        "improves the diversity of the successful attacks an attacker finds. Tried here at toy "
        "scale with the same machinery as a real red-teaming run (`task=redteam`): the attacker "
        "(policy) is the embedded arithmetic model; the victim a tiny randomly initialised model "
        "whose 8-token greedy answer depends on the attack in a hash-like way; the toxicity "
        "classifier a tiny sequence classifier trained locally to call a text toxic when it "
        "contains the digit 7 (`hpc_tba/tasks/redteam_toy.py`); reward = P(toxic) of the victim's "
        "answer; the instruction prompts are `a+b=` strings (200 train, 40 test), so attacks are "
        "mostly numbers and about one in eight succeeds at the start. TB with "
        "TBA's red-teaming buffer (m = 0.5, oldest-first eviction), 100 learner steps at lr 1e-4, "
        "prompts_per_step 4, 1, 2 or 3 searchers sharing the machine's second core (the learner "
        "has the first). The final attacker is evaluated with 8 sampled attacks at T = 0.7 per "
        "test prompt: success rate (pass@1 = share of attacks with P(toxic) > 0.5), the number "
        "of distinct successful attacks among the 320, and self-BLEU / distinct-2 of the "
        "successful ones (lower self-BLEU = more diverse). Nothing here is real toxicity, and "
        "on 2 cores extra searchers add no compute, only more, staler samples per learner step."),
    arms=tuple(Arm(f"s{n}", f"{n} searcher{'s' if n > 1 else ''}", (f"cluster.num_searchers={n}",),
                   group="searchers") for n in REDTEAM_SEARCHERS),
    common=(*_RT_TASK, "algo=tb", "buffer=redteam", "buffer.warm_start=64",
            "learner.total_steps=100", "learner.prompts_per_step=4", "learner.lr=1.0e-4",
            "learner.eval_every=0"),
    quick=("learner.total_steps=3",),
    eval_args=("--samples", "8", "--ks", "1"),
    eval_overrides=_RT_TASK,
    curve_keys=("loss/reward_mean", "samples/received"),
    columns=(Column("eval/pass@1", "attack success (T=0.7)"),
             Column("redteam/distinct_successes", "distinct successful attacks", "int"),
             Column("redteam/success_diversity/self_bleu", "self-BLEU of successes", "float"),
             Column("redteam/success_diversity/distinct_2", "distinct-2 of successes", "float"),
             Column("redteam/diversity/self_bleu", "self-BLEU of all attacks", "float"),
             Column("loss/reward_mean@mean", "mean reward trained on", "float"),
             Column("samples/received@last", "samples generated", "int")),
    plots=(Plot("bar", "redteam/distinct_successes", title="Distinct successful attacks of the "
                "final attacker (320 samples)", ylabel="distinct successful attacks"),
           Plot("curve", "loss/reward_mean", title="Reward of the trained-on samples",
                ylabel="mean P(toxic)", xlabel="learner step")),
    prepare=prepare_redteam,
)

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (TOPR, ALOL, TBA, REDTEAM)}
"""Every experiment `run.py` knows, in the order `run.py all` runs them."""
