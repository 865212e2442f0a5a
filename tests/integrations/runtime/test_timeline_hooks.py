"""The timeline wrappers fit OpenRLHF 0.11.2's names and record what they wrap.

Applied here to the real OpenRLHF modules (the CPU compat layer imports them where
CUDA is absent); fails when upstream renames a wrapped class or method. With this
process's recorder off (no OPPO_TIMELINE_DIR) a wrapper only calls through.
"""

from __future__ import annotations

import asyncio
import importlib

import pytest

from openrlhf_oppo import compat, timeline
from openrlhf_oppo.integrations.runtime import timeline_hooks

compat.apply()
pytest.importorskip("openrlhf.trainer.ppo_trainer")


@pytest.fixture(scope="module")
def patched():
    modules = {p.module: importlib.import_module(p.module) for p in timeline_hooks.PATCHES}
    for patch in timeline_hooks.PATCHES:
        patch.fn(modules[patch.module])
    return modules


def test_ray_actor_methods_are_timed_on_the_class_ray_calls(patched, tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "RECORDER", timeline.Recorder(str(tmp_path)))
    engine = patched["openrlhf.trainer.ray.vllm_engine"].RolloutRayActor.__ray_metadata__.modified_class

    class FakeLLM:
        async def pause_generation(self, mode):
            assert mode == "keep"

    fake = engine.__new__(engine)
    fake.llm = FakeLLM()
    asyncio.run(engine.pause_generation(fake))
    [row] = timeline.read(tmp_path)
    assert (row["role"], row["stage"]) == ("rollout", "pause") and row["t1"] >= row["t0"]


def test_ppo_trainers_inherit_the_timed_driver_stages(patched):
    ppo_trainer = patched["openrlhf.trainer.ppo_trainer"]
    actor_cls = ppo_trainer.PPOTrainer.__ray_metadata__.modified_class
    for name in ("ppo_train", "broadcast_to_vllm", "train_step"):
        timed = getattr(ppo_trainer.BasePPOTrainer, name)
        assert timed.__wrapped__.__qualname__ == f"BasePPOTrainer.{name}"  # wrapped once, the original inside
        assert getattr(actor_cls, name) is timed  # not Ray's copy of the untimed original


def test_every_wrapped_method_exists_upstream(patched):
    names = {
        "openrlhf.trainer.ray.launcher": {"ReferenceModelActor": ["forward"], "RewardModelActor": ["forward"]},
        "openrlhf.trainer.ray.ppo_actor": {"PolicyModelActor": ["forward", "fit", "broadcast_to_vllm"]},
        "openrlhf.trainer.ray.ppo_critic": {"CriticModelActor": ["forward", "fit"]},
        "openrlhf.trainer.ppo_utils.experience_maker": {"RemoteExperienceMaker": ["make_experience_batch"]},
        "openrlhf.trainer.ppo_utils.samples_generator": {"SamplesGenerator": ["generate_samples"]},
    }
    for module, classes in names.items():
        for cls_name, methods in classes.items():
            owner = getattr(patched[module], cls_name)
            for cls in timeline_hooks._classes(owner):
                for method in methods:
                    assert hasattr(getattr(cls, method), "__wrapped__"), f"{module}.{cls_name}.{method} not timed"
