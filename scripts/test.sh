#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up everything, then run both tiers.
#
#   bash scripts/test.sh [pytest args]
#
# 1. scripts/real-stack/setup.sh: the repository's .venv with the project, its test tools, and the
#    real stack (SGLang 0.5.23 on CPU, sglang-router, megatron-core, slime with patches/ applied),
#    plus the SGLang 0.5.15.post1 layer that tests/real/test_sglang_0515.py serves its engine from.
#    The heavy part is cached under ~/.cache/april-slime, so a second run takes seconds.
# 2. The linters the script tests use (shellcheck, hadolint), where this machine can install them.
# 3. ruff: the lint rules of pyproject.toml.
# 4. pytest: the fast tier (tests/) and the real tier (tests/real/, marker `real`; SGLang 0.5.23,
#    and 0.5.15.post1 for test_sglang_0515.py). Without slime the real tier skips with one line saying why.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/real-stack/setup.sh
bash scripts/install-linters.sh || echo "[test] linters not installed; their tests will skip" >&2
# shellcheck source=/dev/null
. .venv/bin/activate
ruff check --quiet .
python -m pytest -q "$@"
