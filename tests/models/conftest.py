"""Tiny fp32 models built from a config in code (no hub) for the streaming-scorer tests."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

VOCAB = 97
PAD_ID = 0


def tiny_config(family: str, pad_token_id: int | None = PAD_ID):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )
    config = Qwen2Config(**common) if family == "qwen2" else LlamaConfig(**common)
    config._attn_implementation = "sdpa"
    return config


def tiny_reward_model(family: str = "qwen2", seed: int = 0, pad_token_id: int | None = PAD_ID):
    torch.manual_seed(seed)
    cls = Qwen2ForSequenceClassification if family == "qwen2" else LlamaForSequenceClassification
    model = cls(tiny_config(family, pad_token_id)).float().eval()
    # The default head init (std 0.02) gives rewards ~1e-2; std 0.25 gives ~1, so 1e-4 is a real check.
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.25)
    return model


def tiny_causal_lm(family: str = "llama", seed: int = 1):
    torch.manual_seed(seed)
    cls = Qwen2ForCausalLM if family == "qwen2" else LlamaForCausalLM
    model = cls(tiny_config(family)).float().eval()
    with torch.no_grad():  # sharper distributions than the default init: log-probs far from uniform
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


def tiny_openrlhf_model(kind: str = "reward", seed: int = 2, normalize: bool = True, mean: float = 0.3,
                        std: float = 2.0, family: str = "qwen2"):
    from openrlhf_oppo.models.loaders import OpenRLHFCriticModel, OpenRLHFRewardModel

    torch.manual_seed(seed)
    config = tiny_config(family)
    config.mean, config.std = mean, std
    cls = OpenRLHFRewardModel if kind == "reward" else OpenRLHFCriticModel
    model = cls(config, value_head_prefix="value_head", normalize_reward=normalize).float().eval()
    with torch.no_grad():
        model.value_head.weight.normal_(0.0, 0.25)
    return model


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def hf_reward_model(request):
    return tiny_reward_model(request.param)


@pytest.fixture(scope="session")
def causal_lm():
    return tiny_causal_lm("llama")


@pytest.fixture(scope="session")
def openrlhf_reward_model():
    return tiny_openrlhf_model("reward")


@pytest.fixture(scope="session")
def openrlhf_critic_model():
    return tiny_openrlhf_model("critic", seed=3)


@pytest.fixture(scope="session")
def tiny():
    """The factories above, for tests that need a model other than the shared fixtures."""
    from types import SimpleNamespace

    return SimpleNamespace(
        reward_model=tiny_reward_model,
        causal_lm=tiny_causal_lm,
        openrlhf_model=tiny_openrlhf_model,
        config=tiny_config,
        VOCAB=VOCAB,
        PAD_ID=PAD_ID,
    )


@pytest.fixture(scope="session")
def openrlhf_reward_forward():
    """`load(path, normalize_reward=False) -> forward(ids) -> float`: OpenRLHF's own one-shot reward.

    The model is `openrlhf.models.get_llm_for_sequence_regression(path, "reward")`, as OpenRLHF's
    reward-model group loads it (value_head_prefix "score", the prefix in config.json wins), run on
    one unpadded sequence with an all-ones attention mask, in fp32.
    """
    from openrlhf_oppo import compat

    compat.apply()  # openrlhf.models imports flash_attn; the compat layer stands in for it on CPU
    import openrlhf.utils.utils
    from openrlhf.models import get_llm_for_sequence_regression

    def load(path, normalize_reward: bool = False):
        with pytest.MonkeyPatch.context() as mp:
            # its param_dtype takes bf16/fp16 only; fp32 keeps the comparison at 1e-4
            mp.setattr(openrlhf.utils.utils, "convert_to_torch_dtype", lambda _: torch.float32)
            model = get_llm_for_sequence_regression(
                str(path), "reward", param_dtype="bf16", attn_implementation="sdpa", value_head_prefix="score",
                normalize_reward=normalize_reward,
            ).eval()
        # openrlhf 0.11.2 + transformers 5.15: from_pretrained builds the model on the meta device, so the
        # non-persistent mean/std buffers its __init__ fills from config.json come out uninitialised.
        # Put back the values that __init__ means to set (config.mean/std when present, else 0/1).
        config = model.config
        with torch.no_grad():
            model.mean.fill_(config.mean if hasattr(config, "mean") else 0.0)
            model.std.fill_(config.std if hasattr(config, "mean") else 1.0)

        @torch.no_grad()
        def forward(ids: list[int]) -> float:
            t = torch.tensor([ids])
            return float(model(t, attention_mask=torch.ones_like(t))[0])

        return forward

    return load


@pytest.fixture(scope="session")
def hf_reward_forward_in_openrlhf(hf_reward_model, openrlhf_reward_forward, tmp_path_factory):
    """OpenRLHF's one-shot reward of `hf_reward_model` (saved, then loaded by OpenRLHF's own class)."""
    path = tmp_path_factory.mktemp("hf_reward_model")
    hf_reward_model.save_pretrained(path)
    return openrlhf_reward_forward(path)
