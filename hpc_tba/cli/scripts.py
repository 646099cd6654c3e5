"""The sbatch scripts shipped in slurm/, generated from the presets' composed configs.

    python -m hpc_tba.cli.scripts sbatch <overrides>    # print the script for a config
    python -m hpc_tba.cli.scripts write-scripts         # regenerate slurm/*.sh

An entry point: it composes configs (the assembly layer), then asks launcher/slurm.py, which
holds all Slurm knowledge, for the text. tests/test_slurm_scripts.py keeps slurm/*.sh equal to it.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hpc_tba.assembly.compose import compose
from hpc_tba.cli.sbatch import sbatch_script
from hpc_tba.plan.planner import check_grace

REPO = Path(__file__).resolve().parents[2]
SCRIPTS_DIR = REPO / "slurm"
# The scripts shipped in slurm/: name -> the Hydra overrides baked into it.
PRESETS: dict[str, tuple[str, ...]] = {
    "tba_70b": ("+experiment=tba_70b",),
    "tba_70b_long": ("+experiment=tba_70b_long",),
    "tba_8b": ("+experiment=tba_8b",),
    "tba_8b_smoke": ("+experiment=tba_8b_smoke",),
    "tiny_cpu": ("cluster=slurm_cpu",),
}


def preset_script(name: str) -> str:
    """Generate slurm/<name>.sh from its preset overrides."""
    overrides = PRESETS[name]
    return _checked_script(list(overrides), name)


def _checked_script(overrides: list[str], name: str) -> str:
    """The sbatch text, refused (ValueError) when USR1's grace cannot hold a checkpoint save."""
    cfg = compose(overrides)
    check_grace(cfg)
    return sbatch_script(cfg, overrides, name=name)


def write_scripts(directory: Path = SCRIPTS_DIR) -> list[Path]:
    """Regenerate every preset script (executable)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PRESETS:
        path = directory / f"{name}.sh"
        path.write_text(preset_script(name))
        path.chmod(0o755)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """`sbatch <overrides>` prints a script; `write-scripts` regenerates slurm/*.sh."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["write-scripts"]:
        for path in write_scripts():
            print(path)
        return 0
    if args[:1] == ["sbatch"]:
        overrides = args[1:]
        name = next((o.split("=", 1)[1] for o in overrides if o.startswith("name=")), "tba")
        try:
            sys.stdout.write(_checked_script(overrides, name))
        except ValueError as e:
            print(f"hpc_tba.cli.scripts sbatch: {e}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m hpc_tba.cli.scripts {sbatch <overrides> | write-scripts}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
