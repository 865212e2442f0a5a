"""The fake CUDA device that lets a CPU test walk a GPU path (`compat/fake_cuda.py`)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
from transformers import Qwen2Config, Qwen2ForCausalLM

from openrlhf_oppo.compat.fake_cuda import CUDA, fake_cuda, is_fake_cuda


def _tiny_lm() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_a_forward_fed_cpu_ids_fails_as_on_a_gpu_and_runs_once_they_are_moved():
    model = _tiny_lm()
    ids = torch.randint(0, 64, (2, 8))
    with fake_cuda(model):
        assert torch.cuda.is_available() and torch.cuda.current_device() == 0
        with pytest.raises(FakeTensorDeviceMismatchError, match="cpu"):
            model(input_ids=ids)
        logits = model(input_ids=ids.to(torch.device("cuda", torch.cuda.current_device()))).logits
        assert is_fake_cuda(logits) and logits.shape == (2, 8, 64)
    assert not torch.cuda.is_available()  # the stubs are gone afterwards


def test_indexing_takes_cpu_indices_and_refuses_a_cpu_value():
    with fake_cuda() as _:
        t = torch.empty(4, 3, device=CUDA)
        assert is_fake_cuda(t[torch.tensor([0, 2])]) and t[None, :, 1].shape == (1, 4)
        t[0] = 1.0  # a Python scalar, as a GPU takes it
        with pytest.raises(FakeTensorDeviceMismatchError, match="CPU tensor"):
            t[0] = torch.ones(3)
        with pytest.raises(FakeTensorDeviceMismatchError):
            t + torch.ones(4, 3)


def test_cuda_without_an_index_is_the_current_device():
    with fake_cuda():
        x = torch.ones(2)
        assert x.to("cuda").device == CUDA and x.cuda().device == CUDA
        assert torch.zeros(2, device="cuda").device == CUDA
        assert x.to("cuda", non_blocking=True).device == CUDA
        assert torch.zeros(2, device=torch.cuda.current_device()).device == CUDA  # a bare index
        assert x.to(0).device == CUDA and x.to(torch.float64).dtype == torch.float64
