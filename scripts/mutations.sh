#!/usr/bin/env bash
# Does each feature's test fail when the feature is switched off? Every patch in tests/mutations/ switches one off
# (its first line says what; `# unit:` and `# engine:` name the tests that claim it): the named tests must pass on
# the clean tree, and at least one must fail on an assertion with the patch applied (scripts/mutations.py says how).
#   bash scripts/mutations.sh [--unit | --engine | --all] [--record FILE] [--dir DIR] [NAME ...]
#   --unit (default): the unit tests (seconds each; CI runs these: tests/unit/test_mutations.py)
#   --engine: the real-engine tests (minutes each: a Ray cluster and vLLM engines per mutation);
#             `--engine --record tests/mutations/engine-verdicts.json` keeps the verdicts in the repository
# The tests run with the repository's .venv when there is one (README command 2 makes it), else this python3;
# SUMMIT_MUTATION_PYTHON names another. Without pytest there it refuses to run.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
exec "$py" scripts/mutations.py "$@"
