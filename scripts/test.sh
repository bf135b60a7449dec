#!/usr/bin/env bash
# README command 2: set up, then run every test (unit, then the real-engine CPU suite; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${SUMMIT_VENV:-.venv}/bin/activate"
exec python -m pytest tests -q -p no:cacheprovider --timeout 900 --durations=40 "$@"
