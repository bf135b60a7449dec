#!/usr/bin/env bash
# The system packages the tests run (never the serving set-up's business): Debian's Prometheus and Chromium
# (headless) for tests/cpu/test_monitoring.py, slurmctld, slurmd and munge for test_slurm.py, sshd and rsync for
# test_launcher.py. Installed with apt where we are root; otherwise the command to run is printed (and those tests
# fail, naming what is missing).
set -euo pipefail
APT_PACKAGES="prometheus chromium slurmctld slurmd slurm-client munge openssh-server rsync"
if command -v prometheus >/dev/null && command -v chromium >/dev/null && command -v slurmctld >/dev/null \
    && command -v slurmd >/dev/null && command -v munged >/dev/null && [ -x /usr/sbin/sshd ] \
    && command -v rsync >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  t_apt=$(date +%s)
  apt-get update -qq >/dev/null
  # shellcheck disable=SC2086 # a list of packages
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $APT_PACKAGES >/dev/null
  echo "test packages: $APT_PACKAGES installed in $(( $(date +%s) - t_apt )) s"
else
  echo "test packages: some of $APT_PACKAGES missing; as root: apt-get install $APT_PACKAGES" >&2
fi
