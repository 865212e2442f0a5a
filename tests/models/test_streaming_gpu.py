"""On a CUDA GPU, in bf16 (how the streaming reward actor loads a model by default):
streamed scores equal a one-shot forward of the same model on the same device, within
bf16's rounding; and the weight sync is OpenRLHF's own CUDA path (the CPU compat layer
stays out). Skipped without CUDA (tests/conftest.py). Tiny models built in code."""

from __future__ import annotations

import random

import pytest
import torch

from openrlhf_oppo.models import StreamingReferenceScorer, StreamingRewardScorer

pytestmark = pytest.mark.gpu
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: the spacing of bf16 numbers in [1, 2)
ULPS = 8  # a chunked forward rounds in a different order than a one-shot forward: a few bf16 steps


def _tol(value: float) -> float:
    return ULPS * BF16_EPS * max(1.0, abs(value))


VOCAB = 97  # tests/models/conftest.py


def _cases(n: int = 24, seed: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 24))]
        response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 96))]
        cuts = sorted(rng.sample(range(1, len(response)), k=min(len(response) - 1, rng.randint(0, 6))))
        bounds = [0, *cuts, len(response)]
        out.append((prompt, [response[a:b] for a, b in zip(bounds, bounds[1:])]))
    return out


def test_streamed_reward_equals_one_shot_in_bf16_on_cuda(tiny):
    model = tiny.reward_model("qwen2").to("cuda", torch.bfloat16).eval()
    scorer = StreamingRewardScorer(model)
    for i, (prompt, chunks) in enumerate(_cases()):
        scorer.open(i, prompt)
        for chunk in chunks[:-1]:
            scorer.extend(i, chunk)
        reward = scorer.finish(i, chunks[-1])
        ids = torch.tensor([prompt + [t for c in chunks for t in c]], device="cuda")
        with torch.no_grad():
            want = float(model(ids).logits[0, 0].float())
        assert abs(reward - want) <= _tol(want), (i, reward, want)


def test_streamed_reference_logprobs_equal_one_shot_in_bf16_on_cuda(tiny):
    lm = tiny.causal_lm("llama").to("cuda", torch.bfloat16).eval()
    ref = StreamingReferenceScorer(lm)
    for i, (prompt, chunks) in enumerate(_cases(seed=1)):
        ref.open(i, prompt)
        for chunk in chunks[:-1]:
            ref.extend(i, chunk)
        got = ref.finish(i, chunks[-1])
        response = [t for c in chunks for t in c]
        with torch.no_grad():
            logits = lm(torch.tensor([prompt + response], device="cuda")).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        want = [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(response)]
        assert len(got) == len(want)
        assert all(abs(a - b) <= _tol(b) for a, b in zip(got, want)), i


def test_weight_sync_is_openrlhfs_own_cuda_path():
    """With CUDA present the compat layer patches nothing: the actor broadcasts with
    OpenRLHF's NCCL / CUDA-IPC code and vLLM's workers receive with theirs."""
    from openrlhf_oppo import compat
    from openrlhf_oppo.compat import weight_sync

    compat.apply()
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    assert ActorPPOTrainer.broadcast_to_vllm is not weight_sync.broadcast_to_vllm
    assert ActorPPOTrainer._init_vllm_sync_group is not weight_sync.init_vllm_sync_group
    assert WorkerWrap.update_weight is not weight_sync.worker_update_weight
    assert callable(getattr(WorkerWrap, "update_weight_cuda_ipc", None))
