#!/usr/bin/env bash
# Check that the april_slime patches apply to a slime checkout (and, optionally, an SGLang one),
# or apply them.
#
#   patches/check.sh [--apply] <slime_dir> [sglang_dir]
#
# For each patch prints one of: "applies", "already applied", or "DOES NOT APPLY" (exit status 1).
# Without --apply nothing is modified. With --apply every patch that applies is applied with
# `git apply --3way` (plain `git apply` in a directory that is not a git checkout); when any patch
# of a tree neither applies nor is already applied, nothing in that tree is touched and the exit
# status is 1, and a 3-way apply that leaves conflict markers fails as well. The build scripts
# (scripts/rocm/build-mi300.sh, docker/) use --apply.
set -euo pipefail

here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
usage="usage: $0 [--apply] <slime_dir> [sglang_dir]"

apply=0
if [ "${1:-}" = "--apply" ]; then
    apply=1
    shift
fi
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "$usage" >&2
    exit 2
fi

status=0

is_checkout() {  # <dir>: the root of a git work tree
    [ "$(git -C "$1" rev-parse --show-toplevel 2>/dev/null)" = "$(cd -- "$1" && pwd -P)" ]
}

# git as used on <dir>. A plain directory (an unpacked release) gets git with discovery stopped at
# its parent: inside some other repository, `git apply` would take paths relative to that
# repository's root and silently skip every file.
in_tree() {  # <dir> <git args...>
    local dir="$1"
    shift
    if is_checkout "$dir"; then
        git -C "$dir" "$@"
    else
        GIT_CEILING_DIRECTORIES="$(cd -- "$dir/.." && pwd -P)" git -C "$dir" "$@"
    fi
}

# A patch in each state: 0 applies, 1 already applied, 2 neither.
patch_state() {  # <dir> <patch>
    if in_tree "$1" apply --check "$2" 2>/dev/null; then
        return 0
    elif in_tree "$1" apply --check --reverse "$2" 2>/dev/null; then
        return 1
    fi
    return 2
}

check_tree() {  # <kind> <dir>
    local kind="$1" dir="$2" patch name found=0 state
    if [ ! -e "$dir" ]; then
        echo "$kind: $dir does not exist" >&2
        status=1
        return
    fi
    if [ ! -d "$dir" ]; then
        echo "$kind: $dir is not a directory" >&2
        status=1
        return
    fi
    local pending=()
    for patch in "$here"/"$kind"-*.patch; do
        [ -e "$patch" ] || continue
        found=1
        name="$(basename "$patch")"
        state=0
        patch_state "$dir" "$patch" || state=$?
        case "$state" in
            0) echo "$name: applies to $dir"; pending+=("$patch") ;;
            1) echo "$name: already applied in $dir" ;;
            *)
                echo "$name: DOES NOT APPLY to $dir" >&2
                in_tree "$dir" apply --check "$patch" || true
                status=1
                ;;
        esac
    done
    if [ "$found" -eq 0 ]; then
        echo "$kind: no patches needed"
        return
    fi
    # all-or-nothing per tree: apply only when every patch of this tree is usable
    if [ "$apply" -eq 1 ] && [ "$status" -eq 0 ]; then
        # (the ${x+...} form: bash before 4.4 calls an empty array unbound under set -u)
        for patch in ${pending[@]+"${pending[@]}"}; do
            name="$(basename "$patch")"
            if is_checkout "$dir"; then
                # 3-way, as slime's Dockerfiles apply theirs; the result is staged, so
                # `git diff --cached` shows what the patches changed
                if ! git -C "$dir" apply --3way "$patch"; then
                    echo "$name: git apply --3way failed in $dir" >&2
                    status=1
                    return
                fi
                if git -C "$dir" diff --name-only --diff-filter=U | grep -q .; then
                    echo "$name: left merge conflicts in $dir" >&2
                    status=1
                    return
                fi
            elif ! in_tree "$dir" apply "$patch"; then
                echo "$name: git apply failed in $dir" >&2
                status=1
                return
            fi
            echo "$name: applied to $dir"
        done
    fi
}

check_tree slime "$1"
if [ $# -eq 2 ]; then
    check_tree sglang "$2"
fi
exit "$status"
