"""The actor side of the background weight sync (`integrations.runtime.background_sync`): what rank 0
buffers and sends, what the driver gets back. A one-process gloo group stands for the actor group
on CPU; the engines are fakes (the end-to-end run is tests/cli/test_train_oppo_async_on_cpu.py).
The GPU sender's stream ordering runs in the `gpu` tier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from openrlhf_oppo.compat import weight_sync
from openrlhf_oppo.integrations.runtime import background_sync


@pytest.fixture
def one_rank(tmp_path):
    """torch.distributed with this process as the whole (gloo) group, as a one-GPU actor group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_trainer(fakes, model: torch.nn.Module, engines: int = 2):
    ns = SimpleNamespace
    args = ns(ds=ns(zero_stage=3, tensor_parallel_size=1), vllm=ns(enable_prefix_caching=False, sync_with_ray=False))
    engine = [fakes.make_actor(update_weight=lambda payload, *a: fakes.FakeRef(f"loaded {len(payload['weights'])}"))
              for _ in range(engines)]
    return ns(strategy=ns(args=args), actor=ns(model=ns(module=model)), vllm_engines=engine)


def test_rank0_sends_a_copy_of_the_gathered_weights_and_returns_the_engines_loads(fakes, one_rank):
    model = torch.nn.Linear(3, 2)
    trainer = make_trainer(fakes, model)
    loads = background_sync.start_sync(trainer)
    assert [r.value for r in loads] == ["loaded 2", "loaded 2"]  # one load call per engine, not waited for
    (payload, *_), = trainer.vllm_engines[0].update_weight.calls
    assert payload["tag"] == weight_sync.PAYLOAD_TAG
    sent = dict(weight_sync.unpack_tensor(item) for item in payload["weights"])
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step trains on: what was sent does not change
    assert sent.keys() == before.keys() and all(torch.equal(sent[k], before[k]) for k in sent)


def test_the_driver_takes_rank0s_loads_and_names_a_missing_actor_swap():
    assert background_sync.engine_loads([["load 0", "load 1"], [], []]) == ["load 0", "load 1"]
    with pytest.raises(RuntimeError, match=r"OpenRLHF's own PolicyModelActor \(trainer\.patch_driver swaps it"):
        background_sync.engine_loads([None, None])  # OpenRLHF's actor returns nothing


@pytest.mark.gpu
@pytest.mark.parametrize("host", [False, True], ids=["device-buffer", "host-buffer"])
def test_the_gpu_sender_broadcasts_the_buffer_as_gathered_while_the_trainer_updates_the_weights(host):
    """NcclSender on a CUDA device with a recording group in place of OpenRLHF's NCCL one: each
    tensor is sent on the sender's stream, after the copy (on the GPU, or to pinned host memory and
    staged back), whatever the trainer's stream does next."""
    received: list[torch.Tensor] = []

    class Group:
        def broadcast(self, tensor, src, stream):
            assert src == 0 and stream == torch.cuda.current_stream()
            received.append(tensor.clone())

    class Engine:
        class receive_weights:  # noqa: N801 - a Ray actor method's shape
            metas = None

            @classmethod
            def remote(cls, metas):
                cls.metas = metas
                return "load"

    weight = torch.randn(4096, 4096, device="cuda")
    owner = SimpleNamespace(strategy=SimpleNamespace(args=SimpleNamespace(vllm=SimpleNamespace(sync_with_ray=False))),
                            vllm_engines=[Engine], _model_update_group=Group())
    sender = background_sync.NcclSender(owner, host=host)
    sender.add("w", weight)
    (_, kept), = sender.buffer
    assert (kept.device.type, kept.is_pinned()) == (("cpu", True) if host else ("cuda", False))
    expected = weight.clone()
    loads, thread = sender.start()
    weight.mul_(3.0)  # the next step, on the trainer's stream
    thread.join(60)
    torch.cuda.synchronize()
    assert loads == ["load"] and Engine.receive_weights.metas == [("w", torch.float32, (4096, 4096))]
    assert len(received) == 1 and received[0].is_cuda and torch.equal(received[0], expected)
