#!/usr/bin/env bash
# The GPU checks, in one command, for a lent GPU machine with no network (tests/test_gpu.py).
#
#   bash tools/gpu_check.sh            # from anywhere; the log goes to $OUT/gpu_check.log if OUT is set
#
# 1. Installs the wheels carried in .whl/ (deepspeed and what it needs that such a machine lacks:
#    pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions, hjson) into
#    $GPU_CHECK_SITE (default /tmp/site), without the network, compiling nothing.
# 2. Prints the GPUs, the driver, and the versions of torch and of every package the tests use.
# 3. Runs the tests marked `gpu` in tests/test_gpu.py (a ZeRO-3 bf16 engine on CUDA over NCCL:
#    trains, syncs, resumes; the weight sync with CUDA tensors; the sync's device ring: learner
#    rank 0's feed broadcasting a GPU learner's versions through its two device pieces; Ulysses
#    sequence parallelism's kernels in bf16 on a GQA model, SP 2 on this one GPU with the
#    all-to-alls over gloo; the learner's memory figures, torch's peak and the driver's used
#    bytes; engine restarts freeing the GPU), tests/test_engine_process.py (the engine hop
#    into a CUDA worker; TP=2 out of process on 2 GPUs), tests/test_worker_sync.py (a TP=2
#    out-of-process engine on 2 GPUs whose workers receive the learner's broadcast themselves, the
#    searcher's process without a CUDA context) and tests/test_weight_staging.py (pinned
#    host staging of exactly the planned bytes) with hpc_tba imported from this checkout;
#    among them the real learner role (tools/role_check.py under mpiexec: Learner.train_step,
#    WeightSender -> WeightReceiver, checkpoint, export), which needs mpi4py and mpich from .whl/
#    (their mpiexec lands in $GPU_CHECK_SITE/bin, put on PATH here) and skips without them.
# 4. Runs `hpc-tba doctor` for a node of a 2-node, 1-GPU-per-node layout (CUDA, NCCL, driver,
#    /dev/shm, host memory against the plan).
# What one GPU cannot show is the smoke job's part (`sbatch slurm/tba_8b_smoke.sh`, 2 nodes x 8
# GPUs): NCCL across GPUs and nodes (ZeRO-3's collectives over 8 ranks, SP's all-to-all, the
# weight sync's per-engine groups and their buffers against the plan's NCCL rows), engines of TP 4
# out of process, the doctor's cross-node all-reduce, a preemption, requeue and resume, and the
# sync time, step time and memory per GPU beside `hpc-tba plan`'s. The script prints that list
# at the end. Meant to finish within 10 minutes on one GPU (GPU_CHECK_TIMEOUT_S, 600, bounds the
# tests).
# Exits with pytest's status, else the doctor's (1 if the wheels do not install). Preparing .whl/ (on a machine with
# pip's registry; it is ignored by git):
#   cp ~/.cache/pip/wheels/*/*/*/*/deepspeed-0.19.8-py3-none-any.whl .whl/   # or: pip wheel --no-deps deepspeed==0.19.8
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     typing-extensions==4.16.0 hjson==3.1.0 mpi4py==4.1.2 mpich==5.0.2 omegaconf==2.3.1 hydra-core==1.3.8
#   cp ~/.cache/pip/wheels/*/*/*/*/antlr4_python3_runtime-4.9.3-py3-none-any.whl .whl/   # hydra's parser
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1

main() {
    echo "== wheels ($(ls .whl/*.whl 2>/dev/null | wc -l) in .whl/)"
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || { echo "gpu_check: the carried wheels did not install"; return 1; }
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"  # mpiexec of the mpich wheel
    # pip --target drops a wheel's data/lib (MPICH's libmpi.so.12 among it; seen on the H200
    # image, 2026-12-04, where mpi4py then took the system's Open MPI): unpack it by hand
    if compgen -G ".whl/mpich-*.whl" >/dev/null; then
        "$PY" -c '
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[2]) as z:  # data/lib/... -> $SITE/lib/... (libmpi.so.12, lib/mpich/)
    for info in z.infolist():
        parts = info.filename.split("/")
        if len(parts) < 4 or parts[1:3] != ["data", "lib"] or info.is_dir():
            continue
        out = os.path.join(sys.argv[1], "lib", *parts[3:])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as dst:
            dst.write(z.read(info))
        os.chmod(out, 0o755)
' "$SITE" .whl/mpich-*.whl || { echo "gpu_check: MPICH's libraries did not unpack"; return 1; }
        export LD_LIBRARY_PATH="$SITE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    # mpi4py picks its MPI ABI from the symbols already in the process: on the H200 image
    # (2026-12-04) it took Open MPI's (the role check ran as a singleton under MPICH's mpiexec:
    # "the job has 1 ranks"), so something imported before it, torch by all signs, brings a
    # system Open MPI into the global scope. Where that is so, MPICH's libmpi goes first
    # (LD_PRELOAD) and mpi4py is told its ABI; elsewhere nothing changes. Not yet run on a GPU.
    if [[ -e "$SITE/lib/libmpi.so.12" ]] && "$PY" -c \
        'import ctypes, sys, torch; sys.exit(0 if hasattr(ctypes.CDLL(None), "ompi_mpi_comm_self") else 1)'; then
        echo "torch brings Open MPI's symbols: MPICH's libmpi preloaded for mpi4py"
        export LD_PRELOAD="$SITE/lib/libmpi.so.12${LD_PRELOAD:+:$LD_PRELOAD}" MPI4PY_MPIABI=mpich
    elif [[ -e "$SITE/lib/libmpi.so.12" ]]; then
        echo "torch brings no Open MPI symbols: mpi4py finds MPICH's libmpi itself"
    fi

    echo "== machine"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    "$PY" - <<'EOF'
import importlib
import importlib.metadata
import sys

import torch

print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for dist, name in [("transformers", "transformers"), ("tokenizers", "tokenizers"), ("safetensors", "safetensors"),
                   ("numpy", "numpy"), ("typing-extensions", "typing_extensions"), ("pydantic", "pydantic"),
                   ("hjson", "hjson"), ("deepspeed", "deepspeed"), ("pytest", "pytest"),
                   ("mpi4py", "mpi4py")]:
    try:
        module = importlib.import_module(name)
        print(f"{dist} {importlib.metadata.version(dist)} {module.__file__}")
    except Exception as e:  # keep going: the tests say which of them they need
        print(f"{dist} NOT IMPORTABLE: {type(e).__name__}: {e}")
EOF

    # The preflight the sbatch scripts run on every node, here on this one GPU node as node 0 of a
    # 2-node, 1-GPU-per-node layout (1 learner + 1 engine): CUDA, NCCL, driver, /dev/shm, memory.
    # Not yet run on a GPU (written 2026-12-06 without one); its cross-node all-reduce needs the
    # 2-node smoke job.
    echo "== hpc-tba doctor (python -m hpc_tba.cli.doctor, one GPU node of a 2-node layout)"
    "$PY" -m hpc_tba.cli.doctor cluster.nodes=2 cluster.gpus_per_node=1 cluster.num_searchers=1 \
        "run_dir=${TMPDIR:-/tmp}/gpu_check_doctor"
    local doctor_rc=$?
    echo "gpu_check: doctor exited with $doctor_rc"

    # test_engine_process.py: the engine hop into a CUDA worker, and (2 GPUs) a TP=2 out-of-process
    # engine synced through it; test_worker_sync.py: (2 GPUs) the TP=2 out-of-process sync, the
    # workers in the learner's broadcast; test_weight_staging.py: host staging pinned exactly
    echo "== tests (pytest -m gpu tests/test_gpu.py tests/test_engine_process.py tests/test_worker_sync.py tests/test_weight_staging.py)"
    timeout "${GPU_CHECK_TIMEOUT_S:-600}" "$PY" -m pytest -q -m gpu tests/test_gpu.py tests/test_engine_process.py \
        tests/test_worker_sync.py tests/test_weight_staging.py -p no:cacheprovider -rA --durations=0 "$@"
    local rc=$?
    echo "gpu_check: pytest exited with $rc"
    echo "gpu_check: not shown by one GPU, the smoke job's part (sbatch slurm/tba_8b_smoke.sh, 2 nodes x 8 GPUs):"
    echo "  NCCL across GPUs and nodes (ZeRO-3 over 8 ranks, SP all-to-all, per-engine weight-sync groups),"
    echo "  TP-4 engines out of process, the doctor's cross-node all-reduce, preemption -> requeue -> resume,"
    echo "  and its PASS/FAIL line: sync time, step time, memory per GPU beside hpc-tba plan's"
    (( rc == 0 )) && rc=$doctor_rc
    return $rc
}

if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    main "$@" 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
main "$@"
