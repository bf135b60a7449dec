#!/usr/bin/env bash
# README command 2: set up, check the house (lint, format, import layers), then run every test (unit, then the
# real-engine CPU suite; GPU tests skip without CUDA). Three pytest workers (SUMMIT_TEST_WORKERS; 0 = one process) on
# 2 cores (2 workers: ~48 min from a fresh clone when the suite waited as much as it computed; 3: 29-33 min, the box
# at 2.0 cores throughout; 32 min at da9dc1e with the mutation check: tests/README.md). Each module, and the session app's modules together, run on one worker
# (tests/conftest.py).
# SUMMIT_TEST_LONG=1 adds the long tier (tests marked `long`: the launcher, PP across two nodes, offline batch, ...;
# tests/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# the system packages (apt) beside the Python set-up (pip): neither waits for the other
bash scripts/test_packages.sh &
packages=$!
SUMMIT_EXTRAS=${SUMMIT_EXTRAS:-cpu},test bash scripts/setup.sh
. "${SUMMIT_VENV:-.venv}/bin/activate"
ruff check app deployments tests bench scripts
ruff format --check app deployments tests bench scripts
lint-imports
wait "$packages"
# each module's time, from pytest's JUnit XML in the run's own temp dir (SUMMIT_TEST_JUNIT to keep it elsewhere),
# summarised at the end; `python scripts/suite_times.py FILE --order tests/module_order.json` turns it into a
# slowest-first order for the next runs (tests/conftest.py; the file says which order it keeps and why)
junit=${SUMMIT_TEST_JUNIT:-$(mktemp -d "${TMPDIR:-/tmp}/summit-tests.XXXXXX")/junit.xml}
status=0
python -m pytest tests -q -p no:cacheprovider --timeout 900 --durations=40 --junitxml="$junit" \
  -n "${SUMMIT_TEST_WORKERS:-3}" --dist loadscope --no-loadscope-reorder "$@" || status=$?
if [ -s "$junit" ]; then
  echo "slowest modules (all: python scripts/suite_times.py $junit):"
  python scripts/suite_times.py "$junit" --top 15
fi
exit "$status"
