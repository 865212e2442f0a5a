"""Every cluster preset saves checkpoints and resumes from them on relaunch, a save costing
under 2 % of the run at the preset's projected step time (docs/troubleshooting.md#checkpoints-and-resume)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from openrlhf_oppo import footprint
from openrlhf_oppo.integrations.launch import model_shapes, preflight

REPO = Path(__file__).resolve().parents[3]
PRESETS = sorted((REPO / "configs" / "cluster").glob("*.yaml"))
# seconds a step `openrlhf-oppo simulate` projects for each preset's layout (the commands are in
# docs/troubleshooting.md#checkpoints-and-resume; one seed, 7 measured steps)
PROJECTED_STEP_S = {
    "gsm8k-grpo": 34.53, "gsm8k-ppo": 19.12, "multinode-16gpu": 12.17, "qwen2.5-3b-8xa100": 19.07,
    "qwen2.5-72b-async-64gpu": 47.43, "qwen2.5-72b-megatron-64gpu": 50.00, "qwen2.5-7b-8gpu": 12.95,
    "qwen2.5-7b-async-8gpu": 8.50, "qwen2.5-7b-hybrid-8gpu": 15.81,
}
MAX_SAVE_SHARE = 0.02


def resolved(preset: Path) -> dict:
    return preflight.resolve({}, ["--config", str(preset)], oppo=True)[0]


def save_s(v: dict) -> float:
    """One save: the trained models' checkpoint (the actor; the critic with GAE, as OpenRLHF
    picks it) written by the nodes of the larger trained group at once."""
    params = model_shapes.find(v["actor.model_name_or_path"])[0].params()
    nodes = v["actor.num_nodes"]
    if v["algo.advantage.estimator"] == "gae":
        critic = v["critic.model_name_or_path"] or v["reward.model_name_or_path"] or v["actor.model_name_or_path"]
        if v["reward.remote_url"] and not v["critic.model_name_or_path"]:
            critic = v["actor.model_name_or_path"]
        params += model_shapes.find(critic)[0].params(lm_head=False)
        nodes = max(nodes, v["critic.num_nodes"])
    return footprint.checkpoint_bytes(params) / (nodes * footprint.CHECKPOINT_WRITE_BYTES_PER_S_PER_NODE)


def test_every_preset_has_a_projected_step_time():
    assert sorted(PROJECTED_STEP_S) == [p.stem for p in PRESETS]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_cluster_preset_saves_checkpoints_and_loads_them_on_relaunch(preset):
    v = resolved(preset)
    assert v["ckpt.save_steps"] >= 1  # OpenRLHF's -1 never saves
    assert v["ckpt.load_enable"] is True


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_a_save_costs_under_2_percent_of_the_run_at_the_projected_step_time(preset):
    v = resolved(preset)
    share = save_s(v) / (v["ckpt.save_steps"] * PROJECTED_STEP_S[preset.stem])
    assert share < MAX_SAVE_SHARE


def test_the_hybrid_presets_save_by_hand():
    """14 B x (7.615e9 actor + 7.070e9 critic) = 205.6 GB at 2 GB/s: 102.8 s, every 330 steps of
    15.81 s: 1.97 %."""
    v = resolved(REPO / "configs" / "cluster" / "qwen2.5-7b-hybrid-8gpu.yaml")
    assert save_s(v) == pytest.approx(102.79, abs=0.01)
    assert save_s(v) / (v["ckpt.save_steps"] * 15.81) == pytest.approx(0.0197, abs=0.0001)


def test_openrlhf_resumes_only_where_a_checkpoint_exists():
    """`--ckpt.load_enable` in a preset is safe on a first launch: OpenRLHF 0.11.2's actor loads
    only when `--ckpt.path/_actor` exists, and OPPO's Megatron actor only when its `latest` file does."""
    openrlhf = Path(importlib.util.find_spec("openrlhf").origin).parent  # read, not imported (it needs flash-attn)
    ppo_actor = (openrlhf / "trainer" / "ray" / "ppo_actor.py").read_text()
    megatron_actor = (REPO / "openrlhf_oppo" / "integrations" / "runtime" / "megatron_actor.py").read_text()
    assert "if args.ckpt.load_enable and os.path.exists(ckpt_path):" in ppo_actor
    assert "if args.ckpt.load_enable and (root / LATEST).is_file():" in megatron_actor
