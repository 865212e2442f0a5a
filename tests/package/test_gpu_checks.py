"""scripts/gpu_checks.sh, the one-GPU check, and scripts/gpu_wheels.sh, which prepares what it installs
on a GPU machine that reaches no registry. On this CPU machine its gpu tests skip; what runs here is
its wiring: the wheels it installs (only those whose package is missing), the phases' summary lines,
the time budget and the packed logs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "scripts" / "gpu_checks.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
PHASES = ["install", "megatron", "models", "zero3", "runtime", "bench-reward-1k", "bench-reference-1k",
          "bench-reward-16k"]


@pytest.mark.parametrize("script", [CHECKS, WHEELS], ids=lambda p: p.name)
def test_bash_n(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_the_carried_wheels_are_the_projects_pins_and_stay_out_of_git():
    text = WHEELS.read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for pin in ("deepspeed==0.19.6", "megatron-core==0.16.1"):
        assert pin in text and f'"{pin}"' in pyproject, pin
    assert "openrlhf==0.11.2" in text and "openrlhf==0.11.2" in (ROOT / "scripts" / "install.sh").read_text()
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu_wheels/x.whl"], cwd=ROOT)
    assert ignored.returncode == 0


def _wheel(folder: Path, dist: str, version: str, module_text: str | None = None) -> Path:
    """A pure-Python wheel holding one module named `dist` (no module if module_text is None)."""
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        if module_text is not None:
            whl.writestr(f"{dist}.py", module_text)
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    out = tmp_path / "out"
    full = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_SITE": str(tmp_path / "site"),
            "GPU_WHEELS": str(tmp_path / "no-wheels"), **env}
    proc = subprocess.run(["bash", str(CHECKS)], capture_output=True, text=True, env=full, timeout=400, cwd="/")
    assert proc.returncode == 0, proc.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("gpu_checks: ") and [line.split(":")[0] for line in lines[1:]] == PHASES
    return proc, {line.split(":")[0]: line.split(":", 1)[1].strip() for line in lines[1:]}


def test_install_takes_only_the_wheels_whose_package_is_missing(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "oppo_gpu_probe", "0.1", "ANSWER = 42\n")
    _wheel(wheels, "pytest", "0.0.1")  # installed here: left out, the environment's pytest kept
    proc, summary = _run(tmp_path, PHASES="install", GPU_WHEELS=str(wheels))
    assert summary["install"].startswith("passed")
    assert (tmp_path / "site" / "oppo_gpu_probe.py").read_text() == "ANSWER = 42\n"
    assert not list((tmp_path / "site").glob("pytest*"))
    log = (tmp_path / "out" / "install.log").read_text()
    assert re.search(r"installed already: pytest \S+ \(pytest-0\.0\.1-py3-none-any\.whl left out\)", log)
    assert all(summary[name] == "skipped (not in PHASES)" for name in PHASES[1:])


def test_each_pytest_phase_says_what_its_gpu_tests_did_and_the_logs_pack(tmp_path):
    """Here CUDA is absent: the ZeRO-3 check's test is collected and skipped, and said to be."""
    _, summary = _run(tmp_path, PHASES="zero3", GPU_CHECKS_PACK="1")
    assert re.match(r"skipped: 0 passed, 0 failed, [1-9]\d* skipped, 0 errors \(\d+ s; ", summary["zero3"])
    assert summary["install"] == "skipped (not in PHASES)"
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu-checks.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu-checks.tar.gz") as packed:
        assert {"host.log", "zero3.log"} <= set(packed.getnames())


def test_a_phase_the_time_budget_cannot_hold_is_skipped_and_said_to_be(tmp_path):
    _, summary = _run(tmp_path, PHASES="models bench", TOTAL_S="5")
    for name in ("models", "bench-reward-1k", "bench-reference-1k", "bench-reward-16k"):
        assert summary[name] == "skipped (the 5 s of TOTAL_S are spent)", summary[name]
