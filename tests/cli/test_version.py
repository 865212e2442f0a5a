"""`openrlhf-oppo --version` / `-V`: the package's version and its stack's, from the installed
distributions' metadata, without importing torch or vLLM."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from openrlhf_oppo.upstream import OPENRLHF_VERSION


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_names_the_package_openrlhf_and_torch(flag):
    proc = run("-m", "openrlhf_oppo.cli.main", flag)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith(f"openrlhf-oppo {importlib.metadata.version('openrlhf-oppo')} (")
    assert f"OpenRLHF {importlib.metadata.version('openrlhf')}" in line
    if importlib.metadata.version("openrlhf") == OPENRLHF_VERSION:  # the pinned release: no note
        assert "written against" not in line
    else:
        assert f"OPPO is written against {OPENRLHF_VERSION}" in line
    assert f"torch {importlib.metadata.version('torch')}" in line
    assert "Traceback" not in proc.stderr


def test_version_imports_neither_torch_nor_vllm():
    code = ("import sys\n"
            "from openrlhf_oppo.cli.main import main\n"
            "assert main(['--version']) == 0\n"
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'imported'\n")
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr


def test_help_lists_version():
    proc = run("-m", "openrlhf_oppo.cli.main", "--help")
    assert proc.returncode == 0
    assert "-V, --version" in proc.stdout
