"""The yaml under configs/ mirrors the typed configs (hpc_tba/config), the config package stands
on the ground floor, and a run's saved config.yaml holds its whole configuration.

Rules tested here:
- the default yaml of every component group (the ones configs/config.yaml picks, except algo)
  lists every field of its dataclass, at the dataclass default unless a comment on the line or
  right above it says why not (the embedded run's micro-batch of 160, its earlier warm start);
- an objective's yaml (configs/algo/, and the test plugin's) sets only fields its objective's
  class declares, and every field the class adds to AlgoConfig (so a user reads the objective's
  knobs there); AlgoConfig's own fields come from the registered algo_schema.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from hpc_tba import config as config_pkg
from hpc_tba.assembly.compose import compose
from hpc_tba.config import AlgoConfig, RunConfig, to_yaml
from hpc_tba.losses.registry import BUILTIN, config_class

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PLUGIN_ALGOS = pathlib.Path(__file__).parent / "plugins" / "configs" / "algo"


def _base_groups() -> dict[str, str]:
    """group -> option that configs/config.yaml picks."""
    picks = {}
    for entry in OmegaConf.load(CONFIGS / "config.yaml").defaults:
        if isinstance(entry, str) or not hasattr(entry, "keys"):
            continue
        (group, option), = entry.items()
        picks[group] = option
    return picks


def _body(path: pathlib.Path) -> dict:
    node = OmegaConf.load(path)
    return {k: v for k, v in OmegaConf.to_container(node).items() if k != "defaults"}


def _commented(path: pathlib.Path, key: str) -> bool:
    lines = path.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(f"{key}:"))
    header = next(n for n, line in enumerate(lines) if line.startswith("# at the dataclass's default"))
    # inline, or a comment block right above the key that is not the group's header
    return "#" in lines[i].split(":", 1)[1] or (lines[i - 1].startswith("#") and i - 1 > header)


def test_every_base_yaml_lists_every_field_at_its_default_or_says_why():
    picks = _base_groups()
    schema_of = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    assert set(picks) == {"model", "algo", "task", "buffer", "learner", "searcher", "cluster"}
    for group, option in picks.items():
        if group == "algo":
            continue
        cls = getattr(config_pkg, schema_of[group])
        path = CONFIGS / group / f"{option}.yaml"
        body = _body(path)
        fields = [f.name for f in dataclasses.fields(cls)]
        assert sorted(body) == sorted(fields), \
            f"{path}: missing {set(fields) - set(body)}, extra {set(body) - set(fields)}"
        from_yaml = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), body))
        default = cls()
        for name in fields:
            if getattr(from_yaml, name) != getattr(default, name):
                assert _commented(path, name), f"{path}: {name} differs from {cls.__name__}'s default without a comment"


def _algo_yamls():
    return sorted(CONFIGS.glob("algo/*.yaml")) + sorted(PLUGIN_ALGOS.glob("*.yaml"))


@pytest.mark.parametrize("path", _algo_yamls(), ids=lambda p: p.stem)
def test_each_algo_yaml_sets_exactly_its_objective_fields(path, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))  # the plugin's module
    body = _body(path)
    assert OmegaConf.load(path).defaults == ["algo_schema"] and body["name"] == path.stem
    cls = config_class(body["name"], body.get("module", ""))
    declared = {f.name for f in dataclasses.fields(cls)}
    own = declared - {f.name for f in dataclasses.fields(AlgoConfig)}
    assert set(body) <= declared, f"{path}: {set(body) - declared} not fields of {cls.__name__}"
    assert own <= set(body), f"{path}: {cls.__name__} fields {own - set(body)} not in the yaml"


def test_every_builtin_objective_has_its_yaml():
    assert {p.stem for p in CONFIGS.glob("algo/*.yaml")} == set(BUILTIN)


@pytest.mark.parametrize("name", BUILTIN)
def test_the_saved_config_holds_every_field_and_recomposes_the_same(name):
    cfg = compose([f"algo={name}"])
    saved = OmegaConf.create(to_yaml(cfg))
    assert set(saved.algo) == {f.name for f in dataclasses.fields(cfg.algo)}
    again = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig(algo=type(cfg.algo)())), saved))
    assert again == cfg and type(again.algo) is type(cfg.algo)


def test_launch_overrides_recreate_a_run_of_another_objective():
    from hpc_tba.cli.submit import config_overrides

    cfg = compose(["algo=dpo", "algo.dpo_beta=0.2", "learner.total_steps=3"])
    overrides = config_overrides(cfg)
    assert overrides[0] == "algo=dpo" and "algo.dpo_beta=0.2" in overrides
    assert compose(overrides) == cfg


def test_the_config_package_imports_only_itself():
    for path in (ROOT / "hpc_tba" / "config").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for n in names:
                assert not n.startswith("hpc_tba") or n.startswith("hpc_tba.config"), f"{path.name}: {n}"
                assert n.split(".")[0] not in ("torch", "numpy"), f"{path.name}: {n}"


def test_composing_every_objective_imports_no_torch():
    code = ("import sys; from hpc_tba.assembly.compose import compose; "
            f"[compose(['algo=' + n]) for n in {list(BUILTIN)!r}]; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"
