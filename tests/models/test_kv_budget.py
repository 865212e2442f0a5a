"""The default KV budget (`--oppo.streaming.kv_budget_tokens 0`): derived from the device's memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo.models import budget
from openrlhf_oppo.models.budget import CPU_FRACTION, CUDA_FRACTION, budget_from_free_bytes, kv_bytes_per_token

GIB = 2**30


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer(tiny):
    cfg = tiny.config("qwen2")  # 2 layers, 1 kv head (GQA), head_dim 32
    assert kv_bytes_per_token(cfg, 4) == 2 * 2 * 1 * 32 * 4
    assert kv_bytes_per_token(cfg, 2) == 2 * 2 * 1 * 32 * 2


def test_head_dim_and_kv_heads_default_like_transformers():
    cfg = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, hidden_size=256)  # MHA, no head_dim
    assert kv_bytes_per_token(cfg, 2) == 2 * 3 * 4 * 64 * 2


def test_budget_is_a_fraction_of_free_memory_over_bytes_per_token(tiny):
    cfg = tiny.config("qwen2")
    per_token = kv_bytes_per_token(cfg, 2)
    assert budget_from_free_bytes(8 * GIB, cfg, 2, 0.5) == 4 * GIB // per_token
    assert budget_from_free_bytes(8 * GIB, cfg, 2, 0.5, share=4) == GIB // per_token
    assert budget_from_free_bytes(0, cfg, 2, 0.5) == 1  # never 0: 0 would mean "derive" again
    assert budget_from_free_bytes(-5, cfg, 2, 0.5) == 1


@pytest.mark.parametrize("fraction, share", [(0.0, 1), (1.5, 1), (0.5, 0)])
def test_bad_fraction_or_share_is_refused(tiny, fraction, share):
    with pytest.raises(ValueError):
        budget_from_free_bytes(GIB, tiny.config("qwen2"), 2, fraction, share)


def test_cpu_budget_uses_available_host_memory_split_among_scorers(tiny, monkeypatch):
    monkeypatch.setattr(budget, "host_available_bytes", lambda: 10 * GIB)
    cfg = tiny.config("qwen2")
    got = budget.auto_kv_budget(cfg, torch.float32, "cpu", share=2)
    assert got.tokens == int(10 * GIB * CPU_FRACTION / 2) // kv_bytes_per_token(cfg, 4)
    assert "available host memory" in got.how and "/ 2 scorers" in got.how


def test_host_available_bytes_is_positive():
    assert budget.host_available_bytes() > 0


def test_flag_help_names_the_fractions():
    from dataclasses import fields

    help_ = next(f for f in fields(oppo_config.StreamingConfig) if f.name == "kv_budget_tokens").metadata["help"]
    assert f"{CUDA_FRACTION:g} of the GPU" in help_ and f"{CPU_FRACTION:g} of the available" in help_


def _actor(path, kv_budget_tokens=0, scorers_per_host=1):
    from openrlhf_oppo import compat

    compat.apply()  # oppo_scorer imports openrlhf, whose model module imports flash_attn
    from openrlhf_oppo.integrations.runtime.scorer import StreamingRewardActor

    return StreamingRewardActor(str(path), kv_budget_tokens, False, "score", scorers_per_host)


@pytest.fixture
def saved_reward(tiny, tmp_path):
    tiny.reward_model("qwen2").save_pretrained(tmp_path)
    return tmp_path


def test_reward_actor_derives_its_budget_on_cpu_and_reports_kv_tokens(saved_reward, tiny, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("the actor takes the GPU here")
    monkeypatch.setattr(budget, "host_available_bytes", lambda: 4 * GIB)
    actor = _actor(saved_reward, scorers_per_host=2)
    from openrlhf_oppo.integrations.runtime.scorer import MAX_BATCH_TOKENS

    per_token = kv_bytes_per_token(tiny.config("qwen2"), 4)
    # each of the 2 scorers keeps room for its batched forward's copies (2 x MAX_BATCH_TOKENS)
    expected = int((4 * GIB - 2 * 2 * MAX_BATCH_TOKENS * per_token) * CPU_FRACTION / 2) // per_token
    assert actor.scorer.kv_budget_tokens == expected
    assert f"KV budget {expected:,} tokens (auto: " in capsys.readouterr().out
    actor.open_many({1: [5, 6, 7], 2: [8, 9]})
    reply = actor.process({1: [10, 11], 2: [12]}, {})
    assert (reply.kv_tokens, reply.kv_budget_tokens) == (5 + 3, expected)
    reply = actor.process({}, {1: [13]})
    assert reply.kv_tokens == 3 and set(reply.scores) == {1}  # a scored sample's cache is freed


def test_explicit_budget_stays(saved_reward, capsys):
    actor = _actor(saved_reward, kv_budget_tokens=123)
    assert actor.scorer.kv_budget_tokens == 123
    assert "KV budget 123 tokens (--oppo.streaming.kv_budget_tokens)" in capsys.readouterr().out


@pytest.mark.gpu
def test_reward_actor_budget_comes_from_cuda_mem_get_info(saved_reward, tiny, monkeypatch):
    seen = []
    real = torch.cuda.mem_get_info

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(torch.cuda, "mem_get_info", spy)
    actor = _actor(saved_reward, scorers_per_host=8)  # a GPU is the actor's own: no split
    assert seen, "the budget was not derived from torch.cuda.mem_get_info"
    free = seen[-1][0]
    bf16 = kv_bytes_per_token(tiny.config("qwen2"), 2)
    from openrlhf_oppo.integrations.runtime.scorer import MAX_BATCH_TOKENS

    free -= 2 * MAX_BATCH_TOKENS * bf16  # the batched forward's copies
    assert actor.scorer.kv_budget_tokens == budget_from_free_bytes(free, tiny.config("qwen2"), 2, CUDA_FRACTION)
    assert actor.scorer.kv_budget_tokens == int(free * CUDA_FRACTION) // bf16
