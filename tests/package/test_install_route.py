"""The GPU install route (scripts/install.sh with OPPO_STACK=gpu, which dockerfile/Dockerfile
runs) never builds flash-attn in pip's isolated build env: its setup.py imports torch, and the
isolated env has none ("No module named 'torch'"). OpenRLHF's own Dockerfile installs vLLM
first and then flash-attn against vLLM's torch; so does ours."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
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


# -- the GPU host's requirements, checked before anything is downloaded ---------------------------------

def _host(tmp_path: Path, driver: str | None, nvcc_release: str | None) -> dict[str, str]:
    """An environment whose PATH holds stand-ins: nvidia-smi answering `driver` (absent if None),
    nvcc answering `nvcc_release` (absent if None), and a python that logs every call and has no
    flash-attn installed. CUDA_HOME names an empty folder when nvcc is absent (torch looks there first)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "python.log"
    stand_ins = {"python": f'echo "python $*" >> {log}\nexit 1'}
    if driver is not None:
        stand_ins["nvidia-smi"] = f'echo "{driver}"'
    if nvcc_release is not None:
        stand_ins["nvcc"] = (f'echo "Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.88"\n'
                             f'echo "Build cuda_{nvcc_release}.r{nvcc_release}/compiler.36424714_0"')
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "OPPO_STACK": "gpu",
           "PYTHON": str(bin_dir / "python")}
    if nvcc_release is None:
        (tmp_path / "no-cuda").mkdir()
        env["CUDA_HOME"] = str(tmp_path / "no-cuda")
    return env


def _install(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def _pip_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "python.log"
    return [line for line in log.read_text().splitlines() if "-m pip" in line] if log.exists() else []


def test_a_driver_older_than_r580_stops_the_gpu_install_before_any_download(tmp_path):
    env = _host(tmp_path, driver="550.54.15", nvcc_release="13.0")
    out = _install(env)
    assert out.returncode == 1
    assert "NVIDIA driver 550.54.15 is older than the R580 series" in out.stderr
    assert "cuda-toolkit==13.0.3" in out.stderr and "nothing was downloaded" in out.stderr
    assert _pip_calls(tmp_path) == []


def test_a_cuda_12_nvcc_stops_the_gpu_install_when_flash_attn_must_compile(tmp_path):
    env = _host(tmp_path, driver="580.159.04", nvcc_release="12.4")
    out = _install(env)
    assert out.returncode == 1
    assert "nvcc is CUDA 12.4" in out.stderr and "cpp_extension refuses" in out.stderr
    assert "install the CUDA 13 toolkit" in out.stderr and "FLASH_ATTN_WHEEL" in out.stderr
    assert _pip_calls(tmp_path) == []


def test_no_nvcc_stops_the_gpu_install_naming_where_it_looked(tmp_path):
    env = _host(tmp_path, driver="580.159.04", nvcc_release=None)
    out = _install(env, "--check")
    assert out.returncode == 1
    assert f"no nvcc in {env['CUDA_HOME']}/bin (CUDA_HOME)" in out.stderr and "about an hour" in out.stderr


def test_a_prebuilt_flash_attn_wheel_needs_no_nvcc(tmp_path):
    env = _host(tmp_path, driver="580.159.04", nvcc_release=None)
    out = _install({**env, "FLASH_ATTN_WHEEL": str(tmp_path / "flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl")},
                   "--check")
    assert out.returncode == 0, out.stderr
    assert "driver 580.159.04" in out.stdout and "meets the GPU stack's requirements" in out.stdout


def test_a_cuda_13_host_passes_and_the_check_installs_nothing(tmp_path):
    env = _host(tmp_path, driver="580.159.04", nvcc_release="13.0")
    out = _install(env, "--check")
    assert out.returncode == 0, out.stderr
    assert "nvcc 13.0" in out.stdout and "about an hour" in out.stdout
    assert _pip_calls(tmp_path) == []


def test_a_host_without_a_driver_is_let_through_with_a_note(tmp_path):
    """An image build or a login node installs for GPU nodes it is not: the driver is theirs."""
    env = _host(tmp_path, driver=None, nvcc_release="13.0")
    out = _install(env, "--check")
    assert out.returncode == 0, out.stderr
    assert "nvidia-smi not found" in out.stderr and "R580" in out.stderr


def test_the_requirement_checks_come_before_the_first_pip_install():
    text = (ROOT / "scripts" / "install.sh").read_text()
    call = text.index("\n  gpu_requirements\n")
    installs = [m.start() for m in re.finditer(r"^\s*\$PIP ", text, re.M)]
    assert installs and call < min(installs)


def test_the_readme_states_the_requirements_the_install_checks():
    text = " ".join((ROOT / "README.md").read_text().split())
    for fact in ("R580 series or newer", "`cuda-toolkit==13.0.3`", "vLLM 0.29.0 pins that torch",
                 "no prebuilt wheel for torch 2.13", "about an hour", "CUDA 13's `nvcc`",
                 "OPPO_STACK=gpu bash scripts/install.sh --check"):
        assert fact in text, fact
