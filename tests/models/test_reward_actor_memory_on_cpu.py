"""The streaming reward actor's memory: it refuses a model its GPU cannot hold before moving
it there, gives freed cache blocks back to the colocated models when samples finish, and goes
through the restart path when a chunk does not fit even alone."""

from __future__ import annotations

import pytest
import torch

from openrlhf_oppo.models.device_memory import OutOfMemoryError, check_fits_device

GIB = 2**30


def _actor_module():
    from openrlhf_oppo import compat

    compat.apply()  # the scorer module imports openrlhf, whose model module imports flash_attn
    from openrlhf_oppo.integrations.runtime import scorer

    return scorer


@pytest.fixture
def saved_reward(tiny, tmp_path):
    tiny.reward_model("qwen2").save_pretrained(tmp_path)
    return tmp_path


def test_a_model_larger_than_its_gpu_is_refused_naming_the_flag_and_tensor_parallelism():
    with pytest.raises(ValueError) as exc:
        check_fits_device(140 * GIB, 79 * GIB, 80 * GIB, "--reward.model_name_or_path meta-llama/Llama-3-70B-rm")
    msg = str(exc.value)
    assert "--reward.model_name_or_path meta-llama/Llama-3-70B-rm" in msg and "140.0 GiB" in msg
    assert "79.0 GiB free of 80.0 GiB" in msg
    assert "tensor parallelism for the streamed reward model is not supported" in msg
    assert "--oppo.streaming.enable false" in msg
    check_fits_device(16 * GIB, 79 * GIB, 80 * GIB, "fits")


def test_the_actor_checks_the_size_before_moving_the_model_to_the_gpu(saved_reward, monkeypatch):
    scorer = _actor_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1024, 2048))  # a 2 KiB "GPU"
    moved = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a) or self)
    with pytest.raises(ValueError, match=f"--reward.model_name_or_path {saved_reward}: .* 0.0 GiB free"):
        scorer.StreamingRewardActor(str(saved_reward), 0, False, "score")
    assert moved == []


def test_finishing_samples_empties_the_cuda_cache(saved_reward, monkeypatch):
    scorer = _actor_module()
    actor = scorer.StreamingRewardActor(str(saved_reward), 64, False, "score")
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    actor.open_many({1: [5, 6, 7], 2: [8, 9]})
    actor.process({1: [10], 2: [11]}, {})
    assert emptied == []  # nothing freed: no allocator call on the hot path
    reply = actor.process({}, {1: [12]})
    assert set(reply.scores) == {1} and emptied == [1]


def test_an_out_of_memory_that_survives_eviction_exits_for_rays_restart(saved_reward, monkeypatch):
    scorer = _actor_module()
    actor = scorer.StreamingRewardModelActor.__new__(scorer.StreamingRewardModelActor)
    actor.streaming = scorer.StreamingRewardActor(str(saved_reward), 64, False, "score")
    actor.streaming.open_many({1: [5, 6, 7]})

    def out_of_memory(*args, **kwargs):
        raise OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(actor.streaming.scorer.parts.backbone, "forward", out_of_memory)

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(scorer.os, "_exit", exit_)
    with pytest.raises(Exited) as exc:
        actor.process({1: [10, 11]}, {})
    assert exc.value.args == (1,)
