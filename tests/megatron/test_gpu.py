"""The Megatron actor at TP = 1 on one CUDA GPU: old log-probs, one PPO step and the export, fed
inputs on the CPU as OpenRLHF hands them over, against the same step by OpenRLHF's own actor on
the CPU (`equivalence.reference_step`, fp32), from the same weights and batch (`conftest.py`).
`test_device.py` walks the same paths on a fake device where no GPU is.

Needs torch with CUDA, transformers, megatron-core 0.16.1 and OpenRLHF 0.11.2 (pure-Python
wheels) with what OpenRLHF's losses import: `openrlhf.models` imports DeepSpeed (its sdist
builds without ops: `DS_BUILD_OPS=0`), peft, accelerate and pylatexenc at module top; flash-attn
is stood in for (`compat.flash_attn_standin`). No Ray or vLLM. Skipped without CUDA
(`conftest.py`), and, naming it, without a module it needs.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu

TOL_LOGPROBS = 1e-4  # fp32 with TF32 off: the GPU's kernels sum in other orders than the CPU's
TOL_REL = 1e-4  # loss and gradient norm, relative
TOL_WEIGHTS = 1e-3  # a tenth of the step (lr 1e-2): Adam's first step is near lr * sign(g), so a
# weight whose gradient is near eps moves by a share of lr that rounding decides


@pytest.fixture(scope="module")
def nccl_rank(tmp_path_factory):
    """This process as the whole (NCCL) training group on GPU 0, Megatron's groups at TP = PP = 1,
    TF32 off (the reference is fp32 on the CPU)."""
    import torch.distributed as dist

    from openrlhf_oppo.compat import flash_attn_standin

    flash_attn_standin.install()
    try:
        import megatron.core  # noqa: F401
        from openrlhf.models.loss import PolicyLoss  # noqa: F401
    except ModuleNotFoundError as e:
        pytest.skip(f"the Megatron actor needs {e.name!r} (megatron-core, OpenRLHF and its losses' imports)")
    from openrlhf_oppo.megatron import parallel

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("nccl_rank") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    try:
        parallel.initialize(1, 1, seed=0)
        yield
        parallel.destroy()
    finally:
        dist.destroy_process_group()
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.cpu() - y.cpu()).abs().max().item() for x, y in zip(a, b, strict=True))


def test_the_actor_on_a_gpu_takes_openrlhfs_step_from_inputs_on_the_cpu(nccl_rank, megatron_case, tmp_path):
    from transformers import AutoModelForCausalLM

    from openrlhf_oppo.megatron import equivalence, export
    from openrlhf_oppo.megatron.engine import MegatronActor

    case = megatron_case
    ref = equivalence.reference_step(case)
    actor = MegatronActor(case.hf_config, case.hf_state, case.settings)
    assert actor.device == torch.device("cuda", torch.cuda.current_device())  # where DDP put the weights
    assert all(t.device.type == "cpu" for mb in case.batches for t in (mb.sequences, mb.advantages))

    loaded = {name: t.clone() for name, t in export.hf_weights(actor.model.module, actor.shape)}  # views at TP = 1
    before = actor.log_probs(case.batches)
    stats = actor.train_step(case.batches)
    after = actor.log_probs(case.batches)
    weights = dict(export.hf_weights(actor.model.module, actor.shape))
    export.save_hf(actor.model.module, actor.shape, case.hf_config, str(tmp_path))

    assert all(t.is_cuda for t in [*before, *after, *loaded.values(), *weights.values()])
    assert _max_diff(before, ref["before"]) < TOL_LOGPROBS
    loss = stats["policy_loss"] + stats["kl"] * case.settings.kl_coef
    assert loss == pytest.approx(ref["loss"], rel=TOL_REL)
    assert stats["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL_REL)
    assert _max_diff(ref["before"], ref["after"]) > 100 * TOL_LOGPROBS  # the step moved the policy
    assert _max_diff(after, ref["after"]) < TOL_LOGPROBS
    assert loaded.keys() == case.hf_state.keys() == weights.keys()
    assert all(torch.equal(loaded[k].cpu(), case.hf_state[k]) for k in case.hf_state)
    assert max((weights[k].cpu() - ref["weights"][k]).abs().max().item() for k in weights) < TOL_WEIGHTS
    saved = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[k], weights[k].cpu()) for k in weights)
