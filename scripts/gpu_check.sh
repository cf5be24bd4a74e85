#!/usr/bin/env bash
# GPU check, for a machine with CUDA (CI has none; everything else passes without a GPU).
#
# Covers: the CUDA-marked profiler tests; float32 and bfloat16 profiles of every example model on
# cuda:0 with hook bytes against max_memory_allocated; the profiler accuracy benchmark on CUDA; and
# the runtime on NCCL. With ONE GPU the runtime can only run K = 1 (one NCCL rank per GPU), with
# --check against the unsplit model and peak memory against the prediction; with two or more GPUs
# it also runs a K = 2 1F1B pipeline over NCCL. K = 2 on one GPU is covered by the CPU/gloo tests.
#
# Usage: bash scripts/gpu_check.sh [REPORT_DIR]    (prints tables; exit 0 when all passed)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
report_dir=${1:-${OUT:-$(mktemp -d)}}
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
echo "== profiler"
python -m profiler.gpu_check || status=1
echo "== runtime"
python -m runtime.gpu_check --report-dir "$report_dir" || status=1
echo "gpu check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
