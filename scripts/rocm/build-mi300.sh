#!/usr/bin/env bash
# Build the ROCm stack for slime + april_slime on an MI300X (gfx942) node, inside a ROCm PyTorch
# image with Python >= 3.11. The pins are the ones slime 624b824a8 supports; where each comes from
# is in scripts/rocm/README.md. docker/Dockerfile.mi300 runs this script.
#
#   WORKDIR=/workspace bash scripts/rocm/build-mi300.sh
#
# Steps, in order (set SKIP_<STEP>=1 to skip one): SLIME (clone; its docker/ patches are used by
# later steps), AITER, TE, SGLANG, MEGATRON, APEX, RAY, SLIME_INSTALL, APRIL. Every pin can be
# overridden from the environment (SGLANG_REF=..., and so on). A patch that does not apply stops
# the build; nothing is skipped silently. A source tree with local changes (an earlier run's
# patches) is not reused: remove it, or skip its step.
set -euxo pipefail

HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
# shellcheck source-path=SCRIPTDIR source=env-mi300.sh
source "${HERE}/env-mi300.sh"

WORKDIR=${WORKDIR:-/workspace}
SLIME_DIR=${SLIME_DIR:-${WORKDIR}/slime}
APRIL_SLIME_DIR=${APRIL_SLIME_DIR:-$(cd -- "${HERE}/../.." && pwd)}
MAX_JOBS=${MAX_JOBS:-64}
export MAX_JOBS

# sources (override to build from mirrors)
SLIME_REPO=${SLIME_REPO:-https://github.com/THUDM/slime.git}
SGLANG_REPO=${SGLANG_REPO:-https://github.com/sgl-project/sglang.git}
MEGATRON_REPO=${MEGATRON_REPO:-https://github.com/NVIDIA/Megatron-LM.git}
AITER_REPO=${AITER_REPO:-https://github.com/ROCm/aiter.git}
TE_REPO=${TE_REPO:-https://github.com/ROCm/TransformerEngine.git}
APEX_REPO=${APEX_REPO:-https://github.com/ROCm/apex.git}

# ---------------------------------------------------------------- pins (scripts/rocm/README.md)
SLIME_REF=${SLIME_REF:-624b824a898ab0ec1fcb4d373004c7f3852bf515}
# slime's docker/README.md at SLIME_REF: stable pair SGLang v0.5.15.post1 + Megatron 1dcf0daf
SGLANG_REF=${SGLANG_REF:-0b3bb0cbe31873994c9f989fddfe2f87ca839fdd}   # v0.5.15.post1
SLIME_PATCH_VERSION=${SLIME_PATCH_VERSION:-v0.5.15.post1}             # slime docker/patch/<version>/
MEGATRON_REF=${MEGATRON_REF:-1dcf0dafa884ad52ffb243625717a3471643e087}
# SGLang's ROCm recipe (docker/rocm.Dockerfile, AITER_COMMIT_DEFAULT) for this SGLang generation
AITER_REF=${AITER_REF:-9127c94a18e4398e1eba91f6639e910f0994ad02}
# slime's newest ROCm recipe at SLIME_REF (docker/Dockerfile.rocm_MI350-5)
TE_REF=${TE_REF:-90c04bcdc3c109505b318f40a39680263af55edf}
RAY_VERSION=${RAY_VERSION:-2.47.1}
SGLANG_ROUTER_VERSION=${SGLANG_ROUTER_VERSION:-0.3.2}
TORCH_MEMORY_SAVER_VERSION=${TORCH_MEMORY_SAVER_VERSION:-0.0.9.post1}
# ROCm/apex: one release branch per torch minor (apex README); pinned to the branch heads
apex_ref_for_torch() {  # <torch major.minor>
    case "$1" in
        2.8) echo 102ee921a23d6ef7ed73ee91b7d54c6d39631d69 ;;   # release/1.8.0
        2.9) echo f18052b57ca75623f39fa0235718b4bf8cc46a0b ;;   # release/1.9.0
        2.10) echo e97c6656fb57d03e5fa48ad417853aa497f123ce ;;  # release/1.10.0
        2.11) echo c0f56f7eccd343a08a1b0d0be59f1e7e0e9b90b7 ;;  # release/1.11.0
        *) return 1 ;;
    esac
}
# slime's ROCm patches: the Megatron fused-kernel loader for HIP. amd_patch/latest/megatron.patch
# and sglang.patch were written for the Megatron 48406695 / SGLang of slime's 2025 ROCm recipes
# and do not apply to the pinned versions (slime's docker/patch/<version>/ patches replace
# them); set AMD_SGLANG_PATCH=1 only with an SGLANG_REF the SGLang one was written for.
AMD_PATCH_DIR=${AMD_PATCH_DIR:-${SLIME_DIR}/docker/amd_patch/latest}
AMD_SGLANG_PATCH=${AMD_SGLANG_PATCH:-0}

die() {
    echo "build-mi300: $*" >&2
    exit 1
}

step() {  # <STEP>: true unless SKIP_<STEP>=1
    local skip="SKIP_$1"
    [ "${!skip:-0}" != "1" ]
}

# ---------------------------------------------------------------- preflight
python - <<'EOF' || die "april_slime needs Python >= 3.11 (asyncio.timeout); use a base image with it"
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
EOF
torch_info=$(python -c 'import torch; print(torch.__version__, torch.version.hip or "")') \
    || die "torch is not importable: start from a ROCm PyTorch image"
read -r TORCH_VERSION TORCH_HIP <<<"${torch_info}"
[ -n "${TORCH_HIP:-}" ] || die "torch ${TORCH_VERSION} is not a ROCm build"
# Every pip call below keeps the image's ROCm torch: an unpinned dependency on torch would
# otherwise resolve to the CUDA wheel on PyPI (several GB of nvidia packages) and replace it.
mkdir -p "${WORKDIR}"
cd "${WORKDIR}" || die "cannot enter ${WORKDIR}"
TORCH_CONSTRAINTS="${WORKDIR}/torch-rocm-constraints.txt"
echo "torch==${TORCH_VERSION}" > "${TORCH_CONSTRAINTS}"
export PIP_CONSTRAINT="${TORCH_CONSTRAINTS}"

clone() {  # <url> <dir> <ref>
    if [ ! -d "$2/.git" ]; then
        git clone "$1" "$2"
    elif [ -n "$(git -C "$2" status --porcelain --untracked-files=no)" ]; then
        die "$2 has local changes (an earlier build's patches?); remove it to rebuild, or skip its step"
    fi
    git -C "$2" fetch --tags origin
    git -C "$2" checkout --detach "$3"
    git -C "$2" submodule update --init --recursive
}

apply_patch() {  # <dir> <patch>: 3-way (as slime's Dockerfiles), and loud on any failure
    [ -f "$2" ] || die "patch $2 is missing"
    git -C "$1" apply --3way "$2" \
        || die "$(basename "$2") does not apply to $1 at $(git -C "$1" rev-parse --short HEAD)"
    if git -C "$1" diff --name-only --diff-filter=U | grep -q .; then
        die "$(basename "$2") left merge conflicts in $1"
    fi
}

# ---------------------------------------------------------------- steps
if step SLIME; then
    clone "${SLIME_REPO}" "${SLIME_DIR}" "${SLIME_REF}"
fi
SLIME_PATCH_DIR="${SLIME_DIR}/docker/patch/${SLIME_PATCH_VERSION}"

if step AITER; then
    pip uninstall -y aiter || true
    clone "${AITER_REPO}" aiter "${AITER_REF}"
    (
        cd aiter || exit 1
        pip install -r requirements.txt
        # keep the image's torch-matched Triton, as SGLang's ROCm recipe does
        export AITER_USE_SYSTEM_TRITON=1
        PREBUILD_KERNELS=1 GPU_ARCHS="${GPU_ARCH_LIST}" python setup.py build_ext --inplace
        GPU_ARCHS="${GPU_ARCH_LIST}" pip install --no-build-isolation --config-settings editable_mode=compat -e .
    )
fi

if step TE; then
    clone "${TE_REPO}" TransformerEngine "${TE_REF}"
    (cd TransformerEngine && pip install --no-build-isolation -v .)
fi

if step SGLANG; then
    [ -d "${SLIME_PATCH_DIR}" ] || die "${SLIME_PATCH_DIR} is missing: SLIME_PATCH_VERSION must name a folder of slime's docker/patch/"
    pip install IPython orjson python-multipart torchao==0.9.0 pybind11
    pip uninstall -y sgl_kernel sglang || true
    clone "${SGLANG_REPO}" sglang "${SGLANG_REF}"
    # slime's SGLang patches for this version, in the order slime's docker/Dockerfile applies them
    apply_patch sglang "${SLIME_PATCH_DIR}/sglang.patch"
    for p in sglang-top_p.patch sglang-release_hicache.patch sglang-pull_weights.patch sglang-deterministic.patch; do
        if [ -f "${SLIME_PATCH_DIR}/$p" ]; then
            apply_patch sglang "${SLIME_PATCH_DIR}/$p"
        fi
    done
    if [ "${AMD_SGLANG_PATCH}" = "1" ]; then
        apply_patch sglang "${AMD_PATCH_DIR}/sglang.patch"
    fi
    (
        cd sglang/sgl-kernel || exit 1
        rm -f pyproject.toml
        mv pyproject_rocm.toml pyproject.toml
        AMDGPU_TARGET="${GPU_ARCH_LIST}" python setup_rocm.py install
    )
    (
        cd sglang || exit 1
        # At this SGLang generation the HIP extras (all_hip) live in python/pyproject_other.toml;
        # python/pyproject.toml is the CUDA package and has none.
        if [ -f python/pyproject_other.toml ]; then
            rm -f python/pyproject.toml
            mv python/pyproject_other.toml python/pyproject.toml
        fi
        grep -q '^all_hip' python/pyproject.toml || die "SGLang ${SGLANG_REF} defines no all_hip extra"
        pip install -e "python[all_hip]"
    )
    pip install "sglang-router==${SGLANG_ROUTER_VERSION}"
    # MI300X in virtualised environments reports itself as MI300X_VF: reuse the tuned configs
    for d in sglang/python/sglang/srt/layers/quantization/configs \
             sglang/python/sglang/srt/layers/moe/fused_moe_triton/configs; do
        [ -d "$d" ] || continue
        find "$d" -type f -name '*MI300X*' -print0 | while IFS= read -r -d '' f; do
            vf="${f/MI300X/MI300X_VF}"
            [ -e "$vf" ] || cp "$f" "$vf"
        done
    done
fi

if step MEGATRON; then
    [ -d "${SLIME_PATCH_DIR}" ] || die "${SLIME_PATCH_DIR} is missing: SLIME_PATCH_VERSION must name a folder of slime's docker/patch/"
    # slime's docker/Dockerfile pins the two together (Megatron needs NumPy 1.x)
    pip install "numpy==1.26.4" "scipy==1.17.1"
    pip uninstall -y megatron-core || true
    clone "${MEGATRON_REPO}" Megatron-LM "${MEGATRON_REF}"
    apply_patch Megatron-LM "${AMD_PATCH_DIR}/amd_megatron_fused_kernels_init.patch"
    apply_patch Megatron-LM "${SLIME_PATCH_DIR}/megatron.patch"
    if [ -f "${SLIME_PATCH_DIR}/megatron-sglang-aligned.patch" ]; then
        apply_patch Megatron-LM "${SLIME_PATCH_DIR}/megatron-sglang-aligned.patch"
    fi
    (cd Megatron-LM && pip install --no-build-isolation -e .)
fi

if step APEX; then
    torch_minor=$(python -c 'import torch; print(".".join(torch.__version__.split("+")[0].split(".")[:2]))')
    APEX_REF=${APEX_REF:-$(apex_ref_for_torch "${torch_minor}")} \
        || die "no pinned ROCm/apex commit for torch ${torch_minor}; set APEX_REF"
    pip uninstall -y apex || true
    clone "${APEX_REPO}" apex "${APEX_REF}"
    (cd apex && APEX_BUILD_CPP_OPS=1 APEX_BUILD_CUDA_OPS=1 pip install --no-build-isolation .)
fi

if step RAY; then
    pip install "ray[data,train,tune,serve]==${RAY_VERSION}" "torch_memory_saver==${TORCH_MEMORY_SAVER_VERSION}" tensorboard
fi

if step SLIME_INSTALL; then
    pip install -r "${SLIME_DIR}/requirements.txt"
    pip install --no-deps -e "${SLIME_DIR}"
fi

if step APRIL; then
    pip install -e "${APRIL_SLIME_DIR}"
    # slime patches of this plugin: applied 3-way; any that does not apply stops the build
    bash "${APRIL_SLIME_DIR}/patches/check.sh" --apply "${SLIME_DIR}"
    if [ "${CHECK_ENV:-1}" = "1" ]; then
        python "${APRIL_SLIME_DIR}/scripts/check_env.py" --slime-dir "${SLIME_DIR}"
    fi
fi
