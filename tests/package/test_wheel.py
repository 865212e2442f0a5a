"""The wheel carries the data the package reads at run time (the simulator's presets),
and the package finds that data beside its modules, not in a source checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRESET_FILES = ("paper-7b-h200.yaml", "paper-3b-a100.yaml", "cpu-longtail.yaml", "cpu-longtail-lengths.json",
                "hardware.yaml", "models.yaml")


def test_presets_are_found_inside_the_package_by_importlib_resources():
    from openrlhf_oppo.sim import presets

    package_dir = Path(str(resources.files("openrlhf_oppo.sim.presets")))
    assert presets.PRESET_DIR == package_dir
    assert presets.PRESET_DIR.is_relative_to(Path(presets.__file__).parent)
    assert {"paper-7b-h200", "paper-3b-a100", "cpu-longtail"} <= set(presets.preset_names())
    assert presets.load_preset("paper-7b-h200").hardware.name == "h200"


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                    reason="needs a git checkout to list the tracked files")
def test_wheel_holds_the_presets_and_no_lab_code(tmp_path):
    # Build from a copy of the tracked files, so the checkout gets no build/ or egg-info and
    # nothing untracked (or stale in build/lib) can slip into the wheel.
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "openrlhf_oppo", "oppo_lab"], cwd=REPO,
                             capture_output=True, text=True, check=True, timeout=60).stdout.split()
    for rel in tracked:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("openrlhf_oppo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"openrlhf_oppo/sim/presets/{f}" for f in PRESET_FILES} <= names
    assert "openrlhf_oppo/sim/presets/__init__.py" in names
    # the lab sits beside the package in the source tree, and none of it is in the wheel
    assert any(rel.startswith("oppo_lab/") for rel in tracked)
    assert [n for n in names if n.startswith("oppo_lab")] == []
