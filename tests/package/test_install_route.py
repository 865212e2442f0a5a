"""The GPU install route (scripts/install.sh with OPPO_STACK=gpu, which dockerfile/Dockerfile
runs) never builds flash-attn in pip's isolated build env: its setup.py imports torch, and the
isolated env has none ("No module named 'torch'"). OpenRLHF's own Dockerfile installs vLLM
first and then flash-attn against vLLM's torch; so does ours."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_branch() -> list[str]:
    """The pip install lines of install.sh's GPU branch, continuation lines joined."""
    text = (ROOT / "scripts" / "install.sh").read_text().replace("\\\n", " ")
    branch = text[text.index("\nelse\n"):text.index("\nfi\n", text.index("\nelse\n"))]
    return [line.strip() for line in branch.splitlines() if "$PIP" in line and not line.strip().startswith("#")]


def _extra(name: str) -> list[str]:
    """An optional-dependencies list of pyproject.toml (tomllib is 3.11+, the package 3.10+)."""
    text = (ROOT / "pyproject.toml").read_text()
    return ast.literal_eval(re.search(rf"^{name} = (\[.*?\])$", text, re.M | re.S).group(1))


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[=<>\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_the_gpu_extra_does_not_pull_flash_attn_into_an_isolated_build():
    names = _requirement_names(_extra("gpu")) | _requirement_names(_extra("openrlhf"))
    # openrlhf 0.11.2's own requirements pin flash-attn==2.8.3: it must come with --no-deps.
    assert not names & {"flash-attn", "openrlhf"}, names
    assert "torch==2.13.0" in _extra("openrlhf")


def test_install_sh_builds_flash_attn_without_isolation_after_vllm_and_torch():
    lines = _gpu_branch()
    vllm = next(i for i, line in enumerate(lines) if "vllm==0.29.0" in line)
    assert "torch==2.13.0" in shlex.split(lines[vllm])  # torch stays pinned
    flash = [i for i, line in enumerate(lines) if "flash-attn" in line or "FLASH_ATTN_WHEEL" in line]
    assert flash and min(flash) > vllm
    for i in flash:
        words = shlex.split(lines[i])
        assert "--no-build-isolation" in words or "$FLASH_ATTN_WHEEL" in words, lines[i]
        assert "--no-deps" in words, lines[i]  # never lets pip swap torch underneath vLLM
    (openrlhf,) = [line for line in lines if "openrlhf==" in line]
    assert "--no-deps" in shlex.split(openrlhf)
    assert min(i for i, line in enumerate(lines) if "-e" in shlex.split(line)) > max(flash)


def test_the_dockerfile_installs_through_install_sh_and_never_pip_installs_flash_attn_itself():
    text = (ROOT / "dockerfile" / "Dockerfile").read_text().replace("\\\n", " ")
    runs = [line for line in text.splitlines() if line.startswith("RUN ")]
    assert any("bash scripts/install.sh" in r for r in runs)
    for run in runs:
        if "pip install" in run and "flash" in run:
            assert "--no-build-isolation" in run or ".whl" in run, run
    assert "ARG FLASH_ATTN_WHEEL" in text
