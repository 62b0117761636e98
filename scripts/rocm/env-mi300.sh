# shellcheck shell=bash
# Environment of an MI300X (gfx942) node for slime + SGLang + april_slime.
# Source it before building (build-mi300.sh does) and before launching a job.
# Values follow slime's docker/Dockerfile.rocm (MI300) and docker/Dockerfile.rocm_MI350-5.

export GPU_ARCH=${GPU_ARCH:-gfx942}                # MI300X / MI325X; gfx950 for MI350 / MI355
export GPU_ARCH_LIST=${GPU_ARCH_LIST:-$GPU_ARCH}
export PYTORCH_ROCM_ARCH=${PYTORCH_ROCM_ARCH:-$GPU_ARCH}
export AMDGPU_TARGET=${AMDGPU_TARGET:-$GPU_ARCH}
export ROCM_PATH=${ROCM_PATH:-/opt/rocm}
export CMAKE_PREFIX_PATH="${ROCM_PATH}:${ROCM_PATH}/hip:/usr/local:/usr"

# TransformerEngine (ROCm fork)
export NVTE_FRAMEWORK=pytorch
export NVTE_ROCM_ARCH=$GPU_ARCH
export NVTE_USE_HIPBLASLT=1
export NVTE_USE_ROCM=1

# SGLang / RCCL performance settings
export HIP_FORCE_DEV_KERNARG=1
export HSA_NO_SCRATCH_RECLAIM=1
export SGLANG_USE_AITER=1
export SGLANG_MOE_PADDING=1
export SGLANG_SET_CPU_AFFINITY=1
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
export NCCL_MIN_NCHANNELS=112
export TORCHINDUCTOR_MAX_AUTOTUNE=1
export TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1

# Ray must leave HIP_VISIBLE_DEVICES alone (slime's AMD tutorial)
export RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1
export HIP_VISIBLE_DEVICES=${HIP_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}
