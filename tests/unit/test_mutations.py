"""The unit-level mutation check (scripts/mutations.sh --unit): each patch in tests/mutations/ switches a feature off
(the session table ignored, the KV index ignored, the rate limiter never refusing, ...) in a scratch copy of the
tree, and the unit tests that claim the feature must fail on it. A mutation that survives means those tests pass
whether or not the feature works; one whose patch no longer applies must be updated with the code it mutates. The
real-engine level of the same patches is `bash scripts/mutations.sh --engine` (minutes each, not in CI)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MUTATIONS = sorted(p.stem for p in (REPO / "tests" / "mutations").glob("*.patch"))


def test_there_are_mutations_for_each_claimed_feature():
    assert {
        "prefix-table-ignored",
        "session-table-ignored",
        "prefix-keys-constant",
        "adapter-tracking-dropped",
        "kv-index-ignored",
        "autoscale-stays",
        "latency-target-ignored",
        "rate-limit-never-refuses",
        "continuation-not-resumed",
        "stream-resume-ignored",
        "stream-abandoned-on-disconnect",
    } <= set(MUTATIONS)


@pytest.mark.parametrize("name", MUTATIONS)
def test_the_features_unit_tests_fail_with_it_switched_off(name):
    run = subprocess.run(
        ["bash", "scripts/mutations.sh", "--unit", name], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and f"mutation {name} (unit): killed by tests/" in run.stdout, run.stdout + run.stderr
