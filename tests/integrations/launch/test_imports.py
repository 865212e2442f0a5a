"""The launch side (launcher, Ray driver set-up, `openrlhf-oppo train`) imports no heavy
stack at module level: each of its modules imports in a process where ray, torch, vLLM,
DeepSpeed, transformers and OpenRLHF cannot be imported (their names set to None in
sys.modules, as tests/core checks the core)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LAUNCH = REPO / "openrlhf_oppo" / "integrations" / "launch"
BLOCKED = ("ray", "torch", "vllm", "deepspeed", "transformers", "openrlhf")
ENTRY_POINTS = ("openrlhf_oppo.cli.train", "openrlhf_oppo.cli.train_ppo_ray")


def launch_modules() -> list[str]:
    return sorted(f"openrlhf_oppo.integrations.launch.{p.stem}" for p in LAUNCH.glob("*.py") if p.stem != "__init__")


def _import_blocked(modules: list[str]) -> subprocess.CompletedProcess:
    code = (
        "import importlib, sys\n"
        f"for m in {BLOCKED!r}:\n"
        "    sys.modules[m] = None\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "import openrlhf_oppo\n"
        "print(openrlhf_oppo.__file__)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_every_launch_module_and_the_train_entry_points_import_without_the_heavy_stack():
    modules = launch_modules()
    assert {"openrlhf_oppo.integrations.launch.driver", "openrlhf_oppo.integrations.launch.train_run"} <= set(modules)
    proc = _import_blocked([*modules, *ENTRY_POINTS])
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve().parent == REPO / "openrlhf_oppo"  # this checkout, not another


def test_the_check_fails_on_a_module_level_import_of_a_blocked_name():
    proc = _import_blocked(["json", "ray"])
    assert proc.returncode != 0 and "ray" in proc.stderr
