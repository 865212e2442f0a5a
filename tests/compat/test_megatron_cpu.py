"""The Megatron CPU shim (`compat.megatron_cpu`): what it maps, that it undoes itself, and that
every call site it exists for is still in megatron-core's source (fails when upstream moves one)."""

from __future__ import annotations

import importlib
import inspect
import threading

import pytest
import torch

from openrlhf_oppo import compat
from openrlhf_oppo.compat import megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim does nothing where CUDA is present")


def test_cuda_devices_become_the_cpu_inside_and_nothing_changes_outside():
    compat.apply()  # on_cpu applies OpenRLHF's CPU patches; what it undoes is what it stubbed on top
    before = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize")}
    with megatron_cpu.on_cpu():
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(1, device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.ones(3)
        assert t.cuda() is t
        assert t.to("cuda:0").device.type == "cpu"
        assert t.to(device="cuda").device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64  # a conversion stays a conversion
        torch.cuda.synchronize()
    assert torch.ones(3).type() == "torch.FloatTensor"
    assert {name: getattr(torch.cuda, name) for name in before} == before
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.ones(3).cuda()


def test_the_mode_is_per_thread():
    seen = {}

    def other():
        try:
            torch.zeros(1, device="cuda")
            seen["other"] = "cpu"
        except (RuntimeError, AssertionError):
            seen["other"] = "refused"

    with megatron_cpu.on_cpu():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=30)
    assert not thread.is_alive(), "the other thread's CUDA call did not return in 30 s"
    assert seen["other"] == "refused"


# (module, function or class, a fragment of its source the shim exists for)
CALL_SITES = [
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining", 'device="cuda"'),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving",
     'device="cuda"'),
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate",
     "torch.cuda.synchronize()"),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer", "torch.cuda.current_device()"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb",
     "torch.cuda.current_device()"),
    ("megatron.core.utils", "GlobalMemoryBuffer.get_tensor", "torch.cuda.current_device()"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "device='cuda'"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "'torch.cuda.FloatTensor'"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups",
     "'torch.cuda.FloatTensor'"),
]


def test_megatron_core_is_the_version_the_shim_targets():
    from megatron.core import package_info

    assert package_info.__version__ == megatron_cpu.MEGATRON_CORE_VERSION


@pytest.mark.parametrize(("module", "name", "fragment"), CALL_SITES, ids=[f"{m.rsplit('.', 1)[1]}.{n}"
                                                                         for m, n, _ in CALL_SITES])
def test_each_patched_call_site_is_still_upstream(module, name, fragment):
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    assert fragment in inspect.getsource(obj)
