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
    # 0 foundation: typed configs (and the rank layout computed from them), the pinned versions
    "hpc_tba.config": 0, "hpc_tba.pins": 0,
    # 1 libraries: models, tasks, losses; checkpoints on disk; what a rank learns from its launcher
    "hpc_tba.models": 1, "hpc_tba.tasks": 1, "hpc_tba.losses": 1, "hpc_tba.checkpoint": 1,
    "hpc_tba.launcher": 1,
    # 2 plumbing: the messages and their transport, process groups, the weight sync
    "hpc_tba.comm": 2,
    # 3 components on the plumbing: the replay buffer's shards, the generation engines
    "hpc_tba.buffer": 3, "hpc_tba.engine": 3,
    # 4 roles: learner, searcher and what they are made of
    "hpc_tba.roles": 4,
    # 5 assembly: configs composed, ranks set up, roles and engines built
    "hpc_tba.assembly": 5,
    # 6 planning: the planner, its dry run and memory arithmetic count what assembly would build
    "hpc_tba.plan": 6,
    # 7 entry points: the command line, a rank's entry, submitit, the sbatch scripts
    "hpc_tba": 7, "hpc_tba.__main__": 7, "hpc_tba.cli": 7,
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


def _room(module: str) -> str:
    """The drawing's room of a module: its top-level package (or the loose module itself)."""
    return ".".join(module.split(".")[:2])


def test_every_room_has_one_layer():
    # A layer per top-level package, none per module inside one: a room split across layers is
    # drawn with arrows that run back up between its neighbours.
    assert all(name.count(".") <= 1 for name in LAYERS)
    assert {_room(m) for m in _modules()} <= set(LAYERS)


def test_no_import_cycle_between_rooms():
    # The structure drawing's rule: no arrow runs back up, so the rooms (top-level packages and
    # loose modules) import each other without a loop, lazy imports included.
    rooms: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        rooms.setdefault(_room(m), set()).update(_room(t) for t in targets if _room(t) != _room(m))
    assert _cycles(rooms) == []


MAX_MODULE_LINES = 420


def test_every_module_has_one_job_and_at_most_420_lines():
    long = {m: n for m, f in _modules().items() if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules where they have two jobs (at most {MAX_MODULE_LINES} lines): {long}"


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_config_layer_imports_without_torch_or_hydra():
    code = ("import sys, hpc_tba.config as c; c.RunConfig(); "
            "bad = [m for m in ('torch', 'hydra', 'deepspeed', 'vllm', 'mpi4py') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=PKG.parent)
    assert r.returncode == 0, r.stdout + r.stderr
