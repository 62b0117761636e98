#!/usr/bin/env bash
# Build the real-stack environment: SGLang 0.5.23 serving on CPU, sglang-router, megatron-core,
# slime at the pinned commit and this project, in the repository's .venv.
#
#   bash scripts/real-stack/setup.sh            # idempotent; the heavy part is cached
#
# Two layers, so a fresh clone does not reinstall 3.5 GB:
#   1. A shared environment under $APRIL_REAL_STACK_CACHE (default ~/.cache/april-slime), keyed
#      by a hash of the files that define it: torch (CPU wheel), SGLang's dependencies without
#      the CUDA-only ones, SGLang itself (--no-deps), the router, megatron-core, and two CPU
#      workarounds (see README.md beside this file). Built once, then reused; a half-built one
#      (no stamp) is removed and rebuilt.
#   1b. SGLang 0.5.15.post1 (slime's image SGLang) in a venv of its own over layer 1, holding only
#      what it pins differently (requirements-sglang-0.5.15.txt); the real tier serves its second
#      set of engines from it (.venv/sglang-0.5.15.post1-python names its interpreter).
#   2. The clone's own .venv, which sees layer 1 through a .pth file and holds the project
#      (editable), its test tools and slime.
#
# slime comes from $SLIME_DIR (a checkout) or else ../shared/third_party/slime-*.tar.gz (next to
# the repository, or next to its parent folder for a worktree). Without
# either, the environment is built without slime and the real tier says so and skips; in CI
# (CI=true or APRIL_REQUIRE_REAL=1) that is an error instead.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${PYTHON:-python3}"

key="$(cat "$here/requirements-sglang-cpu.txt" "$here/constraints-cpu.txt" | sha256sum | cut -c1-16)"
cache="${APRIL_REAL_STACK_CACHE:-$HOME/.cache/april-slime}"
base="$cache/real-stack-$key"

log() { printf '[real-stack] %s\n' "$*" >&2; }

build_base() {
    log "building the shared environment in $base (about 3 minutes, 3.5 GB; once per machine)"
    rm -rf "$base"
    mkdir -p "$cache"
    "$py" -m venv "$base"
    local pip=("$base/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" torch==2.13.0
    "${pip[@]}" -c "$here/constraints-cpu.txt" -r "$here/requirements-sglang-cpu.txt"
    "${pip[@]}" --no-deps sglang==0.5.23
    "$base/bin/python" -c "import sglang_router, megatron.core, torch; \
assert torch.__version__.startswith('2.13.0'), torch.__version__"
    date -u +%FT%TZ > "$base/.complete"
}

# Clones on one machine share the cache: one setup at a time touches it.
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

if [[ -f "$base/.complete" ]]; then
    log "reusing $base"
else
    build_base
fi
# Idempotent, and cheap, so applied on every run: a changed workaround reaches old caches too.
"$base/bin/python" "$here/cpu_workarounds.py" install
PYTHONWARNINGS=ignore "$base/bin/python" -c "import sglang, sglang_router, megatron.core, torch; \
print('sglang', sglang.__version__)" >&2

# Layer 1b: SGLang 0.5.15.post1 (slime's image SGLang) over layer 1, for the real tier's second set
# of engines. A venv of its own holding only the packages it pins differently, seeing layer 1
# through a .pth file placed after its own site-packages (so its own versions win).
old_key="$(cat "$here/requirements-sglang-0.5.15.txt" | sha256sum | cut -c1-16)"
old_sglang="$cache/sglang-0.5.15-$old_key-on-$key"
base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ ! -f "$old_sglang/.complete" ]]; then
    log "building the SGLang 0.5.15.post1 layer in $old_sglang (about 1 minute, 0.5 GB; once per machine)"
    rm -rf "$old_sglang"
    "$py" -m venv "$old_sglang"
    old_site="$("$old_sglang/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\n' "$base_site" > "$old_site/zz_april_real_stack.pth"
    "$old_sglang/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        -r "$here/requirements-sglang-0.5.15.txt"
    SGLANG_USE_CPU_ENGINE=1 PYTHONWARNINGS=ignore "$old_sglang/bin/python" -c \
        "import sglang.srt.entrypoints.http_server, sglang; assert sglang.__version__ == '0.5.15.post1'" 2>/dev/null
    date -u +%FT%TZ > "$old_sglang/.complete"
fi

# Layer 2: the clone's own venv on top of the shared one.
venv="$repo/.venv"
if [[ ! -x "$venv/bin/python" ]]; then
    "$py" -m venv "$venv"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n' "$base_site" > "$site/april_real_stack.pth"
# where the real tier finds the interpreter that serves SGLang 0.5.15.post1
printf '%s\n' "$old_sglang/bin/python" > "$venv/sglang-0.5.15.post1-python"

vpip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# The plugin, then the workbench beside it (its own distribution: workbench/pyproject.toml, which
# owns the `april-slime` command). Two calls, in this order: reinstalling a plugin from before the
# split removes the command its old record lists, and the workbench's install puts it back.
"${vpip[@]}" --no-deps -e "$repo"
"${vpip[@]}" --no-deps -e "$repo/workbench"
"${vpip[@]}" -c "$here/constraints-cpu.txt" pytest pytest-asyncio pytest-timeout matplotlib ruff==0.17.6

slime_src="${SLIME_DIR:-}"
if [[ -z "$slime_src" ]]; then
    # ../shared beside the repository (a clone), or beside its parent (a worktree under wt/)
    tarball="$(ls "$repo"/../shared/third_party/slime-*.tar.gz "$repo"/../../shared/third_party/slime-*.tar.gz \
        2>/dev/null | head -n 1 || true)"
    if [[ -n "$tarball" ]]; then
        slime_src="$cache/$(basename "$tarball" .tar.gz)"
        if [[ ! -f "$slime_src/setup.py" ]]; then
            rm -rf "$slime_src"
            tar xzf "$tarball" -C "$cache"
        fi
    fi
fi
if [[ -n "$slime_src" ]]; then
    [[ -d "$slime_src" ]] || { log "SLIME_DIR=$slime_src does not exist"; exit 1; }
    # A private copy with patches/ applied: the training tier needs train_metadata in the loss.
    patch_key="$(cat "$repo"/patches/slime-*.patch 2>/dev/null | sha256sum | cut -c1-12)"
    patched="$cache/slime-patched-$patch_key-$(basename "$slime_src")"
    if [[ ! -f "$patched/.complete" ]]; then
        rm -rf "$patched"
        cp -r "$slime_src" "$patched"
        for p in "$repo"/patches/slime-*.patch; do
            (cd "$patched" && patch -p1 --forward --silent < "$p") \
                || { log "$(basename "$p") does not apply to $slime_src"; exit 1; }
        done
        touch "$patched/.complete"
    fi
    flock -u 9
    "${vpip[@]}" --no-deps "$patched"
    # slime's trainer actor (megatron_utils/actor.py) imports it at module level; it only acts on
    # CUDA memory, and the training tier runs that actor's train_actor on the CPU
    "${vpip[@]}" --no-deps torch-memory-saver==0.0.10
    log "slime from $slime_src (patches applied)"

    # Layer 2b: slime's own launcher (train.py under Ray) as a user runs it, on SGLang 0.5.15.post1
    # (slime at the pin cannot start 0.5.23: it reads ServerArgs as a dataclass). A venv of the
    # clone's seeing, in this order, the 0.5.15.post1 layer, the shared layer and Megatron-LM's
    # megatron.training (slime's parse_args imports it; the megatron-core wheel lacks it), holding
    # the project, slime, torch-memory-saver and Ray's dashboard (for `ray job submit`). Its bin/
    # has python3 and ray, so PATH=<it>/bin runs the launchers unchanged; <it>/slime is their SLIME_DIR.
    megatron_tarball="$(ls "$repo"/../shared/third_party/megatron-lm/megatron-lm-*.tar.gz \
        "$repo"/../../shared/third_party/megatron-lm/megatron-lm-*.tar.gz 2>/dev/null | head -n 1 || true)"
    launcher="$venv/slime-launcher"
    if [[ -n "$megatron_tarball" ]]; then
        megatron_lm="$cache/$(basename "$megatron_tarball" .tar.gz)"
        if [[ ! -f "$megatron_lm/.complete" ]]; then
            rm -rf "$megatron_lm" && mkdir -p "$megatron_lm"
            tar xzf "$megatron_tarball" -C "$megatron_lm"
            touch "$megatron_lm/.complete"
        fi
        megatron_root="$(dirname "$(ls -d "$megatron_lm"/*/megatron | head -n 1)")"
        [[ -x "$launcher/bin/python" ]] || "$py" -m venv "$launcher"
        launcher_site="$("$launcher/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        old_site="$("$old_sglang/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        printf '%s\n' "$old_site" "$base_site" "$megatron_root" > "$launcher_site/zz_april_slime_launcher.pth"
        lpip=("$launcher/bin/python" -m pip install -q --disable-pip-version-check)
        "${lpip[@]}" --no-deps -e "$repo" "$patched" torch-memory-saver==0.0.10
        ln -sfn "$patched" "$launcher/slime"  # SLIME_DIR of the launchers: train.py beside slime/
        ray_version="$("$base/bin/python" -c 'import ray; print(ray.__version__)')"
        "${lpip[@]}" -c "$here/constraints-cpu.txt" "ray[default]==$ray_version"
        printf '#!%s\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' \
            "$launcher/bin/python" > "$launcher/bin/ray"
        chmod +x "$launcher/bin/ray"
        SGLANG_USE_CPU_ENGINE=1 PYTHONWARNINGS=ignore "$launcher/bin/python" -c \
            "import sglang, slime, april_slime, megatron.training, ray.dashboard; assert sglang.__version__ == '0.5.15.post1'" \
            2>/dev/null || { log "the slime launcher environment in $launcher does not import"; exit 1; }
        log "slime's launcher: PATH=$launcher/bin:\$PATH (SGLang 0.5.15.post1, Megatron-LM from $megatron_tarball)"
    elif [[ "${APRIL_REQUIRE_REAL:-}" == 1 || "${CI:-}" =~ ^([Tt][Rr][Uu][Ee]|1|yes)$ ]]; then
        log "no Megatron-LM training tarball in ../shared/third_party/megatron-lm/: slime's launcher cannot run"
        exit 1
    fi
elif [[ "${APRIL_REQUIRE_REAL:-}" == 1 || "${CI:-}" =~ ^([Tt][Rr][Uu][Ee]|1|yes)$ ]]; then
    # CI must run the real tier: stop here rather than let it skip.
    log "no slime, and CI requires the real tier: set SLIME_DIR to a checkout of THUDM/slime@624b824a8 or put its tarball in ../shared/third_party/"
    exit 1
else
    log "no slime: set SLIME_DIR to a checkout of THUDM/slime@624b824a8; the real tier will skip"
fi
log "ready: . $venv/bin/activate"
