"""The Megatron backend's GPU paths walked without a GPU (STYLE.md 27): where a tensor on the
wrong device would fail on a GPU, it fails here.

On a CPU host every tensor is on the CPU, so a forgotten move cannot show. Here the actor is
built as on a CPU host (one gloo rank, TP = PP = 1, under `compat.megatron_cpu.on_cpu`), then its
weights become fake tensors on `cuda:0` (`compat.fake_cuda`), where Megatron's DDP puts them on a
GPU, and the GPU paths run on inputs on the CPU, as OpenRLHF hands them over: a CPU tensor that
meets a CUDA one in an op raises `FakeTensorDeviceMismatchError`, as the GPU would raise its
device-mismatch error. What runs:

- old log-probs: `MegatronPolicyModelActor.forward`, OpenRLHF's call, through Megatron's
  schedule, the model and the vocabulary-parallel log-probs, back to OpenRLHF on the CPU;
- the training step up to its loss: autograd cannot run through fake CUDA tensors on a CPU-only
  torch build (`compat/fake_cuda.py`), so `train_step`'s normalisers (`_step_norm`, its
  all-reduce spied) and its forward and loss (`_run` with `forward_only=True`) run here, and the
  backward pass and the optimizer step on a GPU (`test_gpu.py`);
- the export at TP = 1 (`hf_weights`, and `save_hf` handing the Hugging Face model CPU tensors);
- the TP = 2 / PP = 2 layout's export: fake tensors cannot pass through gloo, so the export runs
  in this process with one rank's parallel state faked and `torch.distributed`'s collectives
  spied; every tensor handed to a collective must be on the weights' device (NCCL takes no CPU
  tensor). The layout's values are checked on gloo processes by `test_equivalence.py`.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from openrlhf_oppo.compat.fake_cuda import CUDA, fake_cuda, is_fake_cuda

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a fake device for a CPU host (test_gpu.py: a GPU)")


@pytest.fixture(scope="module")
def megatron_rank(tmp_path_factory):
    """This process as the whole (gloo) training group, with Megatron's groups at TP = PP = 1."""
    import torch.distributed as dist

    from openrlhf_oppo.compat.megatron_cpu import on_cpu
    from openrlhf_oppo.megatron import parallel

    store = tmp_path_factory.mktemp("megatron_rank") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        with on_cpu():
            parallel.initialize(1, 1, seed=0)
        yield
        parallel.destroy()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def make_actor(megatron_rank, megatron_case):
    """A fresh actor with the case's settings or `settings`, built as on a CPU host (`fake_cuda`
    makes its weights fake for good)."""
    from openrlhf_oppo.compat.megatron_cpu import on_cpu
    from openrlhf_oppo.megatron.engine import MegatronActor

    def make(settings=None):
        with on_cpu():
            return MegatronActor(megatron_case.hf_config, megatron_case.hf_state, settings or megatron_case.settings)

    return make


@pytest.fixture
def actor(make_actor):
    return make_actor()


def _assert_fake_cuda(tensors: dict[str, torch.Tensor]) -> None:
    off = {name: t.device for name, t in tensors.items() if not is_fake_cuda(t)}
    assert not off, f"not on the fake {CUDA}: {off}"


def test_old_log_probs_run_on_the_weights_device_and_come_back_on_the_cpu(actor, megatron_case):
    """OpenRLHF's `forward` call, its tensors on the CPU: the log-probs reach OpenRLHF on the CPU."""
    from openrlhf_oppo.integrations.runtime.megatron_actor import MegatronPolicyModelActor

    runtime = MegatronPolicyModelActor.__new__(MegatronPolicyModelActor)  # what `forward` reads of it
    runtime.actor = actor
    mb = megatron_case.batches[0]
    assert mb.sequences.device.type == "cpu"
    with fake_cuda(actor.model):
        assert actor.device == CUDA
        out = runtime.forward(mb.sequences, mb.action_mask.long(), mb.attention_mask)
    assert out.device.type == "cpu" and out.dtype == torch.float32
    assert out.shape == mb.action_mask.shape


def test_the_training_steps_forward_and_loss_run_on_the_weights_device(make_actor, megatron_case, monkeypatch):
    """`fit`'s micro-batches (`_micro_batch` of OpenRLHF's experiences, on the CPU) through
    `train_step`'s normalisers and its forward and loss (up to the loss: see the module doc)."""
    import torch.distributed as dist

    from openrlhf_oppo.integrations.runtime.megatron_actor import _micro_batch

    reduced = []

    def all_reduce(t, *args, **kwargs):  # one rank: a sum or a max over it is the tensor itself
        reduced.append(t)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    experiences = [SimpleNamespace(sequences=mb.sequences, attention_mask=mb.attention_mask,
                                   action_mask=mb.action_mask.long(), action_log_probs=mb.old_log_probs,
                                   advantages=mb.advantages, base_action_log_probs=mb.base_log_probs,
                                   rollout_log_probs=mb.old_log_probs - 0.1)
                   for mb in megatron_case.batches]
    batches = [_micro_batch(exp) for exp in experiences]
    # the KL loss (the case's kl_coef) and the importance-sampling correction read their tensors too
    actor = make_actor(dataclasses.replace(megatron_case.settings, loss_kwargs=dict(
        is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[0.5, 1.05])))
    with fake_cuda(actor.model):
        norm = actor._step_norm(batches)
        assert len(reduced) == 2  # the step's tokens and samples
        stats = actor._run(batches, lambda logits, mb: actor._loss(logits, mb, norm), forward_only=True)
    assert len(reduced) > 2  # and the vocabulary-parallel cross entropy's, over the tensor-parallel group
    _assert_fake_cuda({f"all_reduce {i}": t for i, t in enumerate(reduced)})
    _assert_fake_cuda({k: v for k, v in norm.items() if isinstance(v, torch.Tensor)})
    assert len(stats) == len(batches)
    for s in stats:
        assert set(s) == {"policy_loss", "ppo_clip_ratio", "ppo_kl", "kl"}
        _assert_fake_cuda(s)


def test_the_export_at_tp1_yields_every_weight_on_the_weights_device(actor, megatron_case):
    from openrlhf_oppo.megatron import export

    with fake_cuda(actor.model):
        named = dict(export.hf_weights(actor.model.module, actor.shape))
    assert len(named) == export.weight_count(actor.shape)
    hf_shapes = {k: tuple(v.shape) for k, v in megatron_case.hf_state.items()}
    assert {k: tuple(v.shape) for k, v in named.items()} == hf_shapes
    _assert_fake_cuda(named)


def test_save_hf_hands_the_hugging_face_model_cpu_tensors(actor, monkeypatch, tmp_path):
    """Rank 0 builds the Hugging Face model on the CPU and copies each gathered weight there."""
    from transformers import AutoModelForCausalLM

    from openrlhf_oppo.megatron import export

    loaded = {}

    class Recorder:
        def load_state_dict(self, state, strict):
            loaded.update(state)

        def save_pretrained(self, out_dir):
            pass

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", lambda config, dtype: Recorder())
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)  # one rank; no collective runs on fake tensors
    with fake_cuda(actor.model):
        export.save_hf(actor.model.module, actor.shape, None, str(tmp_path))
    assert len(loaded) == export.weight_count(actor.shape)
    off = {name: t.device for name, t in loaded.items() if t.device.type != "cpu"}
    assert not off, f"the Hugging Face model (on the CPU) was handed {off}"


def _cpu_mask(inputs):
    def planted(mb):
        ids, positions, blocked = inputs(mb)
        return ids, positions, blocked.cpu()

    return planted


@pytest.mark.parametrize("plant", ["no move", "cpu attention mask"])
def test_a_cpu_tensor_in_the_forward_fails_the_check(actor, megatron_case, monkeypatch, plant):
    """The check can fail: with the boundary's move taken away, or a CPU tensor planted in the
    model's inputs, the forward raises as a GPU would."""
    from openrlhf_oppo.megatron import engine

    if plant == "no move":
        monkeypatch.setattr(engine.MicroBatch, "to", lambda self, device, non_blocking=False: self)
    else:
        monkeypatch.setattr(engine, "_inputs", _cpu_mask(engine._inputs))
    with fake_cuda(actor.model), pytest.raises(FakeTensorDeviceMismatchError):
        actor.log_probs(megatron_case.batches)


# ---------------------------------------------------------------- TP = 2 / PP = 2, one rank faked


def _fake_layout(monkeypatch, tp: int, pp: int, stage: int) -> None:
    """Megatron's parallel state as tensor-parallel rank 0 of pipeline stage `stage` sees it."""
    from megatron.core import parallel_state as ps

    answers = {
        "get_tensor_model_parallel_world_size": lambda: tp, "get_tensor_model_parallel_rank": lambda: 0,
        "get_pipeline_model_parallel_world_size": lambda: pp, "get_pipeline_model_parallel_rank": lambda: stage,
        "is_pipeline_first_stage": lambda *a, **k: stage == 0,
        "is_pipeline_last_stage": lambda *a, **k: stage == pp - 1,
        "get_tensor_model_parallel_group": lambda: "tp-group", "get_pipeline_model_parallel_group": lambda: "pp-group",
    }
    for name, answer in answers.items():
        monkeypatch.setattr(ps, name, answer)


class _Collectives:
    """`torch.distributed`'s broadcast and all_gather, recorded, not sent (values are fake)."""

    def __init__(self, monkeypatch):
        import torch.distributed as dist

        self.sent: list[tuple[str, torch.Tensor]] = []
        monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 2])  # TP rank 0 of each stage
        monkeypatch.setattr(dist, "broadcast", self.broadcast)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)

    def broadcast(self, t, src, group=None):
        self.sent.append(("broadcast", t))

    def all_gather(self, parts, t, group=None):
        self.sent += [("all_gather", p) for p in [*parts, t]]


@pytest.mark.parametrize("stage", [0, 1])
def test_the_export_at_tp2_pp2_hands_collectives_only_tensors_on_the_weights_device(megatron_case, monkeypatch,
                                                                                      stage):
    """Each stage receives the other stage's weights into buffers on its own weights' device, and
    gathers its tensor-parallel shards there."""
    from openrlhf_oppo.megatron import export, model

    shape = model.Shape.of(megatron_case.hf_config)
    _fake_layout(monkeypatch, tp=2, pp=2, stage=stage)
    shards = {k: (v.shape, v.dtype) for k, v in model.megatron_state(megatron_case.hf_state, shape).items()}
    collectives = _Collectives(monkeypatch)
    with fake_cuda():
        own = {k: torch.empty(s, dtype=dtype, device="cuda") for k, (s, dtype) in shards.items()}
        module = SimpleNamespace(state_dict=lambda: own)
        named = dict(export.hf_weights(module, shape))
    assert len(named) == export.weight_count(shape)
    assert sum(kind == "broadcast" for kind, _ in collectives.sent) == len(named)
    assert any(kind == "all_gather" for kind, _ in collectives.sent)
    off = [(kind, tuple(t.shape), t.device) for kind, t in collectives.sent if not is_fake_cuda(t)]
    assert not off, f"tensors a collective would refuse (NCCL takes CUDA tensors): {off[:4]}"
    _assert_fake_cuda(named)


def test_log_probs_from_the_last_stage_travel_on_the_device_and_come_back_on_the_cpu(monkeypatch):
    """With PP = 2 the stages before the last receive the log-probs into a buffer on the device."""
    from openrlhf_oppo.integrations.runtime import megatron_actor

    _fake_layout(monkeypatch, tp=1, pp=2, stage=0)
    collectives = _Collectives(monkeypatch)
    with fake_cuda():
        out = megatron_actor._from_last_stage(None, (2, 5))
    assert [kind for kind, _ in collectives.sent] == ["broadcast"] and is_fake_cuda(collectives.sent[0][1])
    assert out.device.type == "cpu" and out.shape == (2, 5)
