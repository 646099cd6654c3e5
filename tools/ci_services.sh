#!/usr/bin/env bash
# System packages the test suite needs beyond the Python environment: Slurm and munge (the
# real-Slurm tests start their own one-machine cluster from tools/local_slurm.sh). Idempotent.
set -euo pipefail
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "[ci] installing slurm-wlm and munge" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq slurm-wlm munge >/dev/null
fi
