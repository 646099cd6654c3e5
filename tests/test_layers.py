"""The package's layers (docs/ARCHITECTURE.md), kept by a test: no import against them, no cycle.

Every import in every module counts, lazy ones inside functions too: a lazy import is still a
dependency, only a cheaper one. A module may import from its own layer or a lower one. A new
module must be placed in LAYERS (the test names it), so the map cannot go stale.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hpc_tba"

LAYERS: dict[str, int] = {
    # 0 foundation: typed configs and plain data, no behaviour of any component
    "hpc_tba.config": 0, "hpc_tba.runfiles": 0, "hpc_tba.console": 0, "hpc_tba.topology": 0,
    "hpc_tba.messages": 0, "hpc_tba.memory": 0,
    # 1 components: pure libraries (losses, replay buffer, models, tasks), no distributed code
    "hpc_tba.losses": 1, "hpc_tba.buffer": 1, "hpc_tba.models": 1, "hpc_tba.tasks": 1,
    # 2 plumbing: transports and groups, engines, checkpoints, Slurm knowledge, local launch
    "hpc_tba.comm": 2, "hpc_tba.engine": 2, "hpc_tba.checkpoint": 2, "hpc_tba.checkpoint_staging": 2,
    "hpc_tba.launcher.slurm": 2,
    "hpc_tba.launcher.local": 2,
    # 3 roles: learner, searcher and what they are made of
    "hpc_tba.roles": 3,
    # 4 assembly: configs composed, ranks set up, roles and engines built; the planner counts them
    "hpc_tba.assembly": 4, "hpc_tba.planner": 4, "hpc_tba.plan_checkpoint": 4, "hpc_tba.plan_dryrun": 4,
    "hpc_tba.plan_learner": 4, "hpc_tba.plan_nccl": 4, "hpc_tba.plan_sync": 4,
    # 5 entry points
    "hpc_tba": 5, "hpc_tba.__main__": 5, "hpc_tba.cli": 5, "hpc_tba.run": 5,
    "hpc_tba.launcher": 5, "hpc_tba.launcher.submit": 5, "hpc_tba.launcher.scripts": 5, "hpc_tba.eval_cli": 5,
    "hpc_tba.data_cli": 5,
    "hpc_tba.status": 5, "hpc_tba.plots": 5,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _layer(module: str) -> int | None:
    name = module
    while name:
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports (resolved to modules that exist)."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from x import y`: the module x.y when y is one, else (a name defined in) x
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        for name in names:
            if not name.startswith("hpc_tba.") and name != "hpc_tba":
                continue
            if name == "hpc_tba":  # the root package's __init__ runs for any import of the package
                continue
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, mods) for m, f in mods.items()}


def test_every_module_is_placed_in_a_layer():
    unplaced = sorted(m for m in _modules() if _layer(m) is None)
    assert not unplaced, f"place these modules in tests/test_layers.py LAYERS: {unplaced}"


def test_no_import_against_the_layers():
    bad = []
    for m, targets in _graph().items():
        for t in targets:
            if (_layer(t) or 0) > (_layer(m) or 0):
                bad.append(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    # A package's __init__ importing its own submodules is not a cycle of design: drop the edges
    # from a package to modules inside it before looking.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in _graph().items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_config_layer_imports_without_torch_or_hydra():
    code = ("import sys, hpc_tba.config as c; c.RunConfig(); "
            "bad = [m for m in ('torch', 'hydra', 'deepspeed', 'vllm', 'mpi4py') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=PKG.parent)
    assert r.returncode == 0, r.stdout + r.stderr
