#!/bin/bash
# Build the ROCm stack for slime + april_slime on an MI300X node, inside a ROCm PyTorch image
# (e.g. rocm/sgl-dev, or the base of slime's docker/Dockerfile.rocm). Mirrors the build steps of
# slime's ROCm Dockerfiles at the pinned commit; every step can be skipped.
#
#   WORKDIR=/workspace SLIME_DIR=/workspace/slime APRIL_SLIME_DIR=$PWD bash scripts/rocm/build-mi300.sh
#
# Steps (set SKIP_<STEP>=1 to skip one): AITER, TE, SGLANG, MEGATRON, APEX, RAY, SLIME, APRIL.
# The prebuilt image rlsys/slime (slime's AMD tutorial) already contains AITER..RAY: on it, run
# with SKIP_AITER=1 SKIP_TE=1 SKIP_SGLANG=1 SKIP_MEGATRON=1 SKIP_APEX=1 SKIP_RAY=1.
set -euxo pipefail

HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${HERE}/env-mi300.sh"

WORKDIR=${WORKDIR:-/workspace}
SLIME_DIR=${SLIME_DIR:-${WORKDIR}/slime}
APRIL_SLIME_DIR=${APRIL_SLIME_DIR:-$(cd "${HERE}/../.." && pwd)}
MAX_JOBS=${MAX_JOBS:-64}
export MAX_JOBS

# pins (override to move them); defaults are those of slime's ROCm Dockerfiles
SLIME_REF=${SLIME_REF:-624b824a898ab0ec1fcb4d373004c7f3852bf515}
AITER_REF=${AITER_REF:-v0.1.7.post2}
TE_REF=${TE_REF:-90c04bcdc3c109505b318f40a39680263af55edf}
SGLANG_REF=${SGLANG_REF:-v0.5.6}
MEGATRON_REF=${MEGATRON_REF:-48406695c4efcf1026a7ed70bb390793918dd97b}
RAY_VERSION=${RAY_VERSION:-2.47.1}

mkdir -p "${WORKDIR}"
cd "${WORKDIR}"

clone() {  # <url> <dir> <ref>
    if [ ! -d "$2/.git" ]; then
        git clone "$1" "$2"
    fi
    git -C "$2" fetch --tags origin
    git -C "$2" checkout "$3"
    git -C "$2" submodule update --init --recursive
}

if [ "${SKIP_SLIME:-0}" != "1" ]; then
    # slime first: its docker/amd_patch files are used by later steps
    clone https://github.com/THUDM/slime.git "${SLIME_DIR}" "${SLIME_REF}"
fi
AMD_PATCH_DIR=${AMD_PATCH_DIR:-${SLIME_DIR}/docker/amd_patch/latest}

if [ "${SKIP_AITER:-0}" != "1" ]; then
    pip uninstall -y aiter || true
    clone https://github.com/ROCm/aiter.git aiter "${AITER_REF}"
    (cd aiter && PREBUILD_KERNELS=1 GPU_ARCHS="${GPU_ARCH_LIST}" python setup.py develop)
fi

if [ "${SKIP_TE:-0}" != "1" ]; then
    clone https://github.com/ROCm/TransformerEngine.git TransformerEngine "${TE_REF}"
    (cd TransformerEngine && pip install . -v)
fi

if [ "${SKIP_SGLANG:-0}" != "1" ]; then
    pip install IPython orjson python-multipart torchao pybind11
    pip uninstall -y sgl_kernel sglang || true
    clone https://github.com/sgl-project/sglang.git sglang "${SGLANG_REF}"
    if [ -f "${AMD_PATCH_DIR}/sglang.patch" ]; then
        if git -C sglang apply --check "${AMD_PATCH_DIR}/sglang.patch"; then
            git -C sglang apply "${AMD_PATCH_DIR}/sglang.patch"
        else
            echo "slime's ROCm SGLang patch does not apply to ${SGLANG_REF}; set SGLANG_REF to the" \
                 "version it targets" >&2
            exit 1
        fi
    fi
    (cd sglang/sgl-kernel && cp pyproject_rocm.toml pyproject.toml && AMDGPU_TARGET="${GPU_ARCH_LIST}" python setup_rocm.py install)
    (cd sglang && pip install -e "python[all_hip]")
    pip install sglang-router --force-reinstall
    # MI300X in virtualised environments reports itself as MI300X_VF: reuse the tuned configs
    find sglang/python/sglang/srt/layers/quantization/configs/ \
         sglang/python/sglang/srt/layers/moe/fused_moe_triton/configs/ \
         -type f -name '*MI300X*' 2>/dev/null | while read -r f; do cp -n "$f" "${f/MI300X/MI300X_VF}"; done
fi

if [ "${SKIP_MEGATRON:-0}" != "1" ]; then
    pip install "numpy>=1.21.0,<2.0"
    clone https://github.com/NVIDIA/Megatron-LM.git Megatron-LM "${MEGATRON_REF}"
    for p in amd_megatron_fused_kernels_init.patch megatron.patch; do
        if [ -f "${AMD_PATCH_DIR}/$p" ] && git -C Megatron-LM apply --check "${AMD_PATCH_DIR}/$p"; then
            git -C Megatron-LM apply "${AMD_PATCH_DIR}/$p"
        fi
    done
    (cd Megatron-LM && pip install -e .)
fi

if [ "${SKIP_APEX:-0}" != "1" ]; then
    pip uninstall -y apex || true
    clone https://github.com/ROCm/apex.git apex master
    (cd apex && python setup.py install)
fi

if [ "${SKIP_RAY:-0}" != "1" ]; then
    pip install "ray[data,train,tune,serve]==${RAY_VERSION}" torch_memory_saver tensorboard
fi

if [ "${SKIP_SLIME:-0}" != "1" ]; then
    (cd "${SLIME_DIR}" && pip install -e . --no-deps)
fi

if [ "${SKIP_APRIL:-0}" != "1" ]; then
    pip install -e "${APRIL_SLIME_DIR}"
    bash "${APRIL_SLIME_DIR}/patches/check.sh" "${SLIME_DIR}" || true
    for p in "${APRIL_SLIME_DIR}"/patches/slime-*.patch; do
        if git -C "${SLIME_DIR}" apply --check "$p" 2>/dev/null; then
            git -C "${SLIME_DIR}" apply "$p"
        fi
    done
    python "${APRIL_SLIME_DIR}/scripts/check_env.py" --slime-dir "${SLIME_DIR}" || true
fi
