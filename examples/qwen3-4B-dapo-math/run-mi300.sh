#!/bin/bash
# Qwen3-4B on DAPO-Math-17k, one node of 8x MI300X: slime stock / sync / APRIL / CoPRIS.
#   MODE=copris bash examples/qwen3-4B-dapo-math/run-mi300.sh
# Follows slime's scripts/run-qwen3-4B-amd.sh (ROCm image rlsys/slime, or scripts/rocm/ here).
# Stop an earlier run first (ray stop --force); this script does not kill other processes.
set -euxo pipefail
export PYTHONUNBUFFERED=1
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)/common.sh"

# Ray must not rewrite HIP_VISIBLE_DEVICES on AMD GPUs (slime's AMD tutorial)
export RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=${RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES:-1}
export HIP_VISIBLE_DEVICES=${HIP_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}
NUM_GPUS=$(echo "${HIP_VISIBLE_DEVICES}" | tr ',' '\n' | wc -l)

MISC_ARGS+=(
   # ROCm builds have no apex gradient-accumulation fusion
   --no-gradient-accumulation-fusion
   # as slime's AMD script: keep both models resident (192 GB per MI300X)
   --no-offload-train
   --no-offload-rollout
)

RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"${MEGATRON_LM_DIR:-/workspace/Megatron-LM}/\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\"
  }
}"

run_slime "${NUM_GPUS}" "${RUNTIME_ENV_JSON}"
