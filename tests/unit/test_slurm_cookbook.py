"""docs/deployment/slurm-cookbook.md as a user types it: every `summit validate` and `summit sbatch` line of the page
runs (the CLI in-process, from the repository root) and succeeds, and each written script asks SLURM for exactly the
`#SBATCH` lines the page shows after it (`--exclusive` only where shown). The shipped configs the recipes name are
sized as the page says (Meta's FP8 checkpoint as fp8 where it is not readable)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from app.cli import main
from app.plan.validate import Hardware, validate_doc

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs/deployment/slurm-cookbook.md"
SHOWN = ("--nodes=", "--gpus-per-node=", "--cpus-per-task=", "--mem=", "--exclusive", "--time=")


def recipes() -> list[tuple[str, list[str] | None]]:
    """(command, the #SBATCH lines the page shows for it, or None for a validate line), in page order."""
    blocks = re.findall(r"```(bash|text)\n(.*?)```", PAGE.read_text(), re.S)
    found: list[tuple[str, list[str] | None]] = []
    for i, (kind, body) in enumerate(blocks):
        if kind != "bash":
            continue
        for line in body.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command.startswith("summit validate"):
                found.append((command, None))
            elif command.startswith("summit sbatch"):
                shown = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else ""
                found.append((command, [x[len("#SBATCH ") :] for x in shown.splitlines() if x.startswith("#SBATCH ")]))
    return found


def test_the_page_has_the_four_recipes():
    commands = " ".join(c for c, _ in recipes())
    for config in ("llama8b.yaml --gpus-per-node 1", "llama70b-tp8.yaml", "llama405b-fp8-2node.yaml", "--batch"):
        assert config in commands, config
    assert all(shown for c, shown in recipes() if c.startswith("summit sbatch")), "each sbatch line shows its lines"


@pytest.mark.parametrize("command,shown", recipes(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_command_runs_and_asks_for_what_the_page_shows(command, shown, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = shlex.split(command)[1:]
    if "-o" in argv:
        argv[argv.index("-o") + 1] = str(tmp_path / argv[argv.index("-o") + 1])
    assert main(argv) == 0, capsys.readouterr()
    if shown is None:
        assert capsys.readouterr().out.rstrip().endswith(": ok")
        return
    script = Path(argv[argv.index("-o") + 1]).read_text()
    asked = [x[len("#SBATCH ") :] for x in script.splitlines() if x.startswith("#SBATCH ")]
    assert [x for x in asked if x.startswith(SHOWN)] == shown, asked


def test_metas_fp8_checkpoint_is_sized_as_fp8_where_it_cannot_be_read():
    """The 2-node recipe's `model_preset: llama-3.1-405b-fp8` (Meta's checkpoint's own quantization_config) sizes
    its weights where the path does not exist: the heaviest of two stages holds 63 layers' bf16 attention
    (63 x 1.141 GB), 62 FP8 feed-forwards (62 x 2.617 GB), one bf16 feed-forward (the first or last layer, 5.234 GB),
    their norms and one vocab matrix (4.203 GB): 243.58 GB over TP 8 = 28.4 GiB a GPU. With the bf16 preset instead,
    the same file is sized bf16 (47.2 GiB)."""
    doc = yaml.safe_load((REPO / "serve_configs/llama405b-fp8-2node.yaml").read_text())
    env = {**os.environ, "LLAMA405B_FP8_PATH": "/nonexistent/Meta-Llama-3.1-405B-Instruct-FP8"}
    report = validate_doc(doc, Hardware("h100-80gb", 8, 2), env=env)
    assert report.ok and "TP 8 × PP 2, fp8 weights 28.4 GiB" in report.lines[0], report.lines
    model = doc["applications"][0]["args"]["models"][0]
    assert model["model_preset"] == "llama-3.1-405b-fp8" and model["engine_kwargs"]["allow_deprecated_quantization"]
    model["model_preset"] = "llama-3.1-405b"
    assert "bf16 weights 47.2 GiB" in validate_doc(doc, Hardware("h100-80gb", 8, 2), env=env).lines[0]


def test_sbatch_warns_of_idle_gpus_takes_a_gpu_type_and_a_batch_concurrency(tmp_path, capsys, monkeypatch):
    """llama70b.yaml (one replica of TP 4) on an 8-GPU ask: warned that 4 GPUs would sit idle, with the ask that fits;
    at --gpus-per-node 4 no warning. --gpu-type asks SLURM's gres for that type, --constraint passes through; a batch
    job runs `summit batch` at the Batch API's 512 lines in flight unless told. The hint names the directory the
    script's relative paths need."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "j.sbatch"
    assert main(["sbatch", "serve_configs/llama70b.yaml", "--gpus-per-node", "8", "-o", str(out)]) == 0
    said = capsys.readouterr().err
    assert "asks for 8 GPUs (1 × --gpus-per-node 8) but the YAML's replicas use 4: 4 would sit idle" in said, said
    assert f"submit it with: cd {REPO} && sbatch {out}" in said, said
    argv = ["sbatch", "serve_configs/llama70b.yaml", "--gpus-per-node", "4", "--gpu-type", "h100", "--constraint", "ib"]
    assert main([*argv, "-o", str(out)]) == 0
    assert "warning" not in capsys.readouterr().err
    asked = [x for x in out.read_text().splitlines() if x.startswith("#SBATCH ")]
    assert "#SBATCH --gres=gpu:h100:4" in asked and "#SBATCH --constraint=ib" in asked, asked
    assert not any(x.startswith("#SBATCH --gpus-per-node") for x in asked), asked
    assert (
        main(["sbatch", "serve_configs/tiny-cpu.yaml", "--gpus-per-node", "0", "--batch", "in.jsonl", "-o", str(out)])
        == 0
    )
    assert "BATCH_CONCURRENCY=${BATCH_CONCURRENCY:-512}" in out.read_text()
    assert '--concurrency "${BATCH_CONCURRENCY:-512}" --retry-errors' in out.read_text()
