"""The simulator's lab: calibration on measured CPU runs (`calibrate`, `fitting`), validation against
them and against published GPU runs (`validate`, `published`), and the presets those studies use
(`presets/`: the calibrated CPU preset and the published runs), beside the product's presets."""

from __future__ import annotations

from pathlib import Path

from openrlhf_oppo.sim import presets
from oppo_lab import schedules as _ablations  # noqa: F401 (registers the ablation schedules)

PRESET_DIR = Path(__file__).parent / "presets"


def preset_names() -> list[str]:
    """The lab's presets and the product's."""
    return sorted({p.stem for p in PRESET_DIR.glob("*.yaml")} | set(presets.preset_names()))


def load_preset(name: str, sets: list[str] | tuple[str, ...] = ()) -> presets.SimConfig:
    """`presets.load_preset` that also finds the lab's presets by name."""
    lab = PRESET_DIR / f"{name}.yaml"
    return presets.load_preset(str(lab) if lab.exists() else name, sets)
