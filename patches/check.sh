#!/usr/bin/env bash
# Check that the april_slime patches apply to a slime checkout (and, optionally, an SGLang one).
#
#   patches/check.sh <slime_dir> [sglang_dir]
#
# For each patch prints one of: "applies", "already applied", or "DOES NOT APPLY" (exit status 1).
# Nothing is modified. To apply:  git -C <slime_dir> apply <patch>
set -euo pipefail

here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 <slime_dir> [sglang_dir]" >&2
    exit 2
fi

status=0

check_tree() {  # <kind> <dir>
    local kind="$1" dir="$2" patch found=0
    if [ ! -d "$dir" ]; then
        echo "$kind: $dir is not a directory" >&2
        status=1
        return
    fi
    for patch in "$here"/"$kind"-*.patch; do
        [ -e "$patch" ] || continue
        found=1
        local name
        name="$(basename "$patch")"
        if git -C "$dir" apply --check "$patch" 2>/dev/null; then
            echo "$name: applies to $dir"
        elif git -C "$dir" apply --check --reverse "$patch" 2>/dev/null; then
            echo "$name: already applied in $dir"
        else
            echo "$name: DOES NOT APPLY to $dir" >&2
            git -C "$dir" apply --check "$patch" || true
            status=1
        fi
    done
    if [ "$found" -eq 0 ]; then
        echo "$kind: no patches needed"
    fi
}

check_tree slime "$1"
if [ $# -eq 2 ]; then
    check_tree sglang "$2"
fi
exit "$status"
