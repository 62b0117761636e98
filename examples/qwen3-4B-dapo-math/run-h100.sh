#!/bin/bash
# Qwen3-4B on DAPO-Math-17k, one node of 8x H100: slime stock / sync / APRIL / CoPRIS.
#   MODE=copris bash examples/qwen3-4B-dapo-math/run-h100.sh
# Stop an earlier run first (ray stop --force); this script does not kill other processes.
set -euxo pipefail
export PYTHONUNBUFFERED=1
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)/common.sh"

NUM_GPUS=${NUM_GPUS:-8}
NVLINK_COUNT=$(nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9][0-9]*' | wc -l || true)
HAS_NVLINK=$([ "${NVLINK_COUNT:-0}" -gt 0 ] && echo 1 || echo 0)

RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"${MEGATRON_LM_DIR:-/root/Megatron-LM}/\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\",
    \"NCCL_NVLS_ENABLE\": \"${HAS_NVLINK}\"
  }
}"

run_slime "${NUM_GPUS}" "${RUNTIME_ENV_JSON}"
