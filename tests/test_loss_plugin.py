"""A new objective is one module plus one yaml: tests/plugins/clipped_pg_loss.py and
tests/plugins/configs/algo/clipped_pg.yaml, found through HPC_TBA_CONFIG_PATH. Composition,
the dispatcher, the planner, the offline preprocessor and the real Learner follow what the module
declares, without a line of hpc_tba knowing its name."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import types

import numpy as np
import pytest
import torch

from hpc_tba.assembly.compose import CONFIG_PATH_ENV, compose
from hpc_tba.comm.groups import free_ports
from hpc_tba.config import ConfigError
from hpc_tba.losses import LossInputs, compute_loss, group_coupled, loss_units, needs
from hpc_tba.plan.planner import PlanOptions, make_plan

PLUGIN_CONFIGS = pathlib.Path(__file__).parent / "plugins" / "configs"


@pytest.fixture
def plugin_path(monkeypatch):
    monkeypatch.setenv(CONFIG_PATH_ENV, str(PLUGIN_CONFIGS))


def _inputs(*, with_ref: bool) -> LossInputs:
    g = torch.Generator().manual_seed(7)
    B, T = 6, 5
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    mask[5] = False  # one padding row: not a loss unit
    return LossInputs(logp=(-torch.rand(B, T, generator=g)).requires_grad_(),
                      logp_ref=-torch.rand(B, T, generator=g) if with_ref else None,
                      logp_behavior=-torch.rand(B, T, generator=g), mask=mask,
                      rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]),
                      group_ids=torch.tensor([0, 0, 0, 1, 1, 2]))


def test_the_plugin_composes_from_its_yaml_and_is_validated_by_its_class(plugin_path):
    cfg = compose(["algo=clipped_pg", "algo.cpg_ratio_max=3"])
    assert type(cfg.algo).__name__ == "ClippedPGConfig" and cfg.algo.name == "clipped_pg"
    assert cfg.algo.cpg_ratio_max == 3.0 and cfg.algo.cpg_kl_coef == 0.0
    assert cfg.algo.reward_map == "none" and cfg.algo.reward_range == [0.0, 1.0]  # the common fit ran
    with pytest.raises(ConfigError, match="unknown config key 'algo.beta0'"):
        compose(["algo=clipped_pg", "+algo.beta0=1"])
    with pytest.raises(ConfigError, match="cpg_ratio_max"):
        compose(["algo=clipped_pg", "algo.cpg_ratio_max=0.5"])
    with pytest.raises(ConfigError, match="cpg_kl_coef"):
        compose(["algo=clipped_pg", "algo.cpg_kl_coef=x"])


def test_without_the_config_path_the_plugin_is_unknown(monkeypatch):
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    with pytest.raises(ConfigError, match="algo/clipped_pg"):
        compose(["algo=clipped_pg"])
    monkeypatch.setenv(CONFIG_PATH_ENV, str(PLUGIN_CONFIGS / "nonexistent"))
    with pytest.raises(ConfigError, match="not a directory"):
        compose([])


def test_dispatcher_preprocessor_and_planner_follow_the_declaration(plugin_path):
    from hpc_tba.roles.offline import required_fields

    plain = compose(["algo=clipped_pg"]).algo
    with_kl = compose(["algo=clipped_pg", "algo.cpg_kl_coef=0.1"]).algo
    assert needs(plain) == dataclasses.replace(needs(plain), reference=False, behavior_logp=True,
                                               advantages=False, group_coupled=False)
    assert needs(with_kl).reference and not group_coupled(with_kl)
    x = _inputs(with_ref=False)
    assert loss_units(plain, x).item() == 5  # default units: non-empty rows
    loss, m = compute_loss(plain, x, step=0)
    loss.backward()
    assert torch.isfinite(loss) and x.logp.grad.abs().sum() > 0 and x.logp.grad[5].abs().sum() == 0
    assert m["loss/clipped_pg"].item() == pytest.approx(loss.item()) and "loss/ratio_mean" in m
    with pytest.raises(ValueError, match="logp_ref"):
        compute_loss(with_kl, _inputs(with_ref=False), step=0)
    compute_loss(with_kl, _inputs(with_ref=True), step=0)
    # offline rows must carry log μ (the loss reads it); no advantage column
    assert required_fields(plain) == ["logp_behavior"]
    fast = PlanOptions(deepspeed=False)
    assert make_plan(compose(["algo=clipped_pg"]), fast).terms["reference"] == 0
    assert make_plan(compose(["algo=clipped_pg", "algo.cpg_kl_coef=0.1"]), fast).terms["reference"] > 0


def test_the_saved_config_and_the_launch_overrides_recreate_the_plugin_run(plugin_path):
    from omegaconf import OmegaConf

    from hpc_tba.cli.submit import config_overrides
    from hpc_tba.config import RunConfig, to_yaml

    cfg = compose(["algo=clipped_pg", "algo.cpg_kl_coef=0.25"])
    saved = OmegaConf.create(to_yaml(cfg))
    assert set(saved.algo) == {f.name for f in dataclasses.fields(cfg.algo)}
    again = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig(algo=type(cfg.algo)())), saved))
    assert again == cfg
    assert compose(config_overrides(cfg)) == cfg


def _worker(rank: int, port: int, tmp: str, algos) -> None:
    from conftest import gloo_deepspeed

    gloo_deepspeed(0, 1, port)
    reports = [_train_two_steps(algo, os.path.join(tmp, f"run{i}")) for i, algo in enumerate(algos)]
    pathlib.Path(tmp, "report.json").write_text(json.dumps(reports))


def _train_two_steps(algo, run_dir: str, G: int = 2, K: int = 3) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    from hpc_tba.buffer import BufferShard
    from hpc_tba.comm.messages import SampledBatch
    from hpc_tba.config import BufferConfig, LearnerConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.learner import Learner

    model = sorted(p for p in glob.glob(os.path.expanduser("~/.cache/hpc_tba/models/tiny-llama-*"))
                   if not p.endswith(".lock"))[0]
    learner = Learner(cfg=LearnerConfig(total_steps=2, prompts_per_step=G, lr=1e-3, warmup_steps=1,
                                        sync_wire_dtype="fp32"),
                      loss=algo, shard=BufferShard(BufferConfig(), directory=None), k=K, temperature=0.7,
                      model_path=model, transport=types.SimpleNamespace(rank=0),
                      topo=Topology.build(1, 1, 0, needs_searchers=False), sync_group=None, run_dir=run_dir)
    rng = np.random.default_rng(0)
    responses = [rng.integers(3, 21, rng.integers(2, 6)).astype(np.int32) for _ in range(G * K)]
    batch = SampledBatch(
        prompt_ids=np.repeat(np.arange(G), K).astype(np.int64), group_ids=np.repeat(np.arange(G), K),
        prompt_tokens=[rng.integers(3, 21, 4).astype(np.int32)] * (G * K), response_tokens=responses,
        rewards=np.array([1, 0, 1, 0, 0, 1], np.float32),
        logp_behavior=[rng.normal(-3, 0.3, len(r)).astype(np.float32) for r in responses],
        policy_versions=np.zeros(G * K, dtype=np.int64))

    def weights():  # ZeRO-3 holds shards: the full fp32 values
        return [safe_get_full_fp32_param(p).clone() for p in learner.engine.module.parameters()]

    before = weights()
    metrics = [learner.train_step(batch) for _ in range(2)]
    moved = sum(float((p - b).abs().sum()) for p, b in zip(weights(), before))
    return {"has_ref": learner.ref is not None, "moved": moved,
            "losses": [float(m.get("loss/clipped_pg", float("nan"))) for m in metrics]}


def test_the_real_learner_trains_the_plugin(plugin_path, tmp_path, monkeypatch):
    # One gloo rank, DeepSpeed ZeRO-3 on CPU (tests/test_learner_device.py): two steps per config.
    import sys

    import torch.multiprocessing as mp

    kls = (0.0, 0.1)
    algos = [compose(["algo=clipped_pg", f"algo.cpg_kl_coef={kl}"]).algo for kl in kls]
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(sys, "path", [here, *sys.path])  # the spawned worker unpickles plugins.*
    mp.spawn(_worker, args=(free_ports(1)[0], str(tmp_path), algos), nprocs=1, join=True)
    for kl, report in zip(kls, json.loads((tmp_path / "report.json").read_text())):
        assert report["has_ref"] is (kl > 0), report  # the learner builds the reference only when declared
        assert report["moved"] > 0 and all(np.isfinite(report["losses"])), report


def test_the_registry_refuses_what_it_cannot_serve(plugin_path):
    from hpc_tba.config import AlgoConfig
    from hpc_tba.losses import registry

    compose(["algo=clipped_pg"])  # imports the plugin module

    with pytest.raises(TypeError, match="subclassing AlgoConfig"):
        registry.register(registry.Objective("bad", dict, lambda *a, **k: None))

    @dataclasses.dataclass
    class Impostor(AlgoConfig):
        pass

    for name in ("tb", "clipped_pg"):  # a built-in (imported or not yet), a plugin already imported
        with pytest.raises(ValueError, match="already registered"):
            registry.register(registry.Objective(name, Impostor, lambda *a, **k: None))
    with pytest.raises(ValueError, match="algo.name='ppo' is not one of"):
        registry.make_config("ppo")
    with pytest.raises(ValueError, match="cannot be imported"):
        registry.objective("x", "no_such_module_for_hpc_tba")
    with pytest.raises(TypeError, match="needs a TBConfig"):
        registry.objective_of(AlgoConfig(name="tb"))  # the bare common part is no objective's config
    assert type(registry.make_config("tb", beta0=0.5)).__name__ == "TBConfig"
