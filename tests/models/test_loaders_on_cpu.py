"""A reward model saved in transformers' layout and one in OpenRLHF's both load and stream-score
exactly like their one-shot forward."""

from __future__ import annotations

import importlib
import json
import sys
import types

import pytest
import torch

from openrlhf_oppo.models import (
    OpenRLHFCriticModel,
    OpenRLHFRewardModel,
    StreamingCriticScorer,
    StreamingRewardScorer,
    detect_layout,
    load_critic_model,
    load_reward_model,
    save_openrlhf_value_model,
)

SEQS = [([5, 6, 7], [8, 9, 10, 11, 12]), ([1], [2]), ([40, 41, 42, 43, 44, 45], [46, 0, 47, 0])]


def streamed_rewards(model) -> list[float]:
    scorer = StreamingRewardScorer(model)
    for i, (prompt, response) in enumerate(SEQS):
        scorer.open(i, prompt)
        scorer.extend(i, response[:1])
    out = scorer.finish_many({i: response[1:] for i, (_, response) in enumerate(SEQS)})
    return [out[i] for i in range(len(SEQS))]


@torch.no_grad()
def one_shot_rewards(model) -> list[float]:
    out = []
    for prompt, response in SEQS:
        r = model(torch.tensor([prompt + response]))
        out.append(float(r.logits[0, 0] if hasattr(r, "logits") else r[0]))
    return out


def assert_close(a, b, tol=1e-4):
    assert max(abs(x - y) for x, y in zip(a, b)) <= tol, (a, b)


def test_transformers_layout_loads_and_scores_like_one_shot(tiny, tmp_path):
    original = tiny.reward_model("qwen2", seed=4)
    original.save_pretrained(tmp_path)
    assert detect_layout(tmp_path) == "transformers"
    loaded = load_reward_model(tmp_path)
    assert type(loaded).__name__ == "Qwen2ForSequenceClassification" and not loaded.training
    want = one_shot_rewards(original)
    assert_close(one_shot_rewards(loaded), want, tol=1e-5)
    assert_close(streamed_rewards(loaded), want)


def test_openrlhf_layout_loads_and_scores_like_one_shot(tiny, tmp_path):
    original = tiny.openrlhf_model("reward", seed=5, normalize=True, mean=0.5, std=3.0)
    save_openrlhf_value_model(original, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["value_head_prefix"] == "value_head" and config["mean"] == 0.5 and config["std"] == 3.0
    assert detect_layout(tmp_path) == "openrlhf"

    loaded = load_reward_model(tmp_path, normalize_reward=True)
    assert isinstance(loaded, OpenRLHFRewardModel) and loaded.value_head_prefix == "value_head"
    want = one_shot_rewards(original)
    assert_close(one_shot_rewards(loaded), want, tol=1e-5)
    assert_close(streamed_rewards(loaded), want)

    # As OpenRLHF: normalisation is the loader's flag (--reward.normalize_enable), mean/std from config.json.
    raw = load_reward_model(tmp_path, normalize_reward=False)
    assert_close([(r - 0.5) / 3.0 for r in streamed_rewards(raw)], want)


def test_openrlhf_critic_layout_loads_and_streams_like_one_shot(tiny, tmp_path):
    original = tiny.openrlhf_model("critic", seed=6, normalize=True)
    save_openrlhf_value_model(original, tmp_path)
    loaded = load_critic_model(tmp_path, normalize_reward=True)
    assert isinstance(loaded, OpenRLHFCriticModel)
    critic = StreamingCriticScorer(loaded, version=0)
    for i, (prompt, response) in enumerate(SEQS):
        critic.open(i, prompt)
        got = critic.finish(i, response)
        with torch.no_grad():
            want = original(torch.tensor([prompt + response]), action_mask=torch.ones(1, len(response)))[0]
        assert_close(got, want.tolist())


def test_unrecognisable_layout_and_bad_arguments_are_clear_errors(tiny, tmp_path):
    tiny.causal_lm("qwen2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot tell the reward-model layout"):
        load_reward_model(tmp_path)
    with pytest.raises(ValueError, match="layout must be one of"):
        load_reward_model(tmp_path, layout="hf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_reward_model(tmp_path / "missing")


def _flash_attn_stand_in() -> dict[str, types.ModuleType]:
    """The two flash_attn modules openrlhf.models imports at top level; unused on the non-packed path."""

    def unused(*args, **kwargs):
        raise NotImplementedError("flash_attn stand-in")

    bert_padding = types.ModuleType("flash_attn.bert_padding")
    for name in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
        setattr(bert_padding, name, unused)
    distributed = types.ModuleType("flash_attn.utils.distributed")
    distributed.all_gather = unused
    return {
        "flash_attn": types.ModuleType("flash_attn"),
        "flash_attn.bert_padding": bert_padding,
        "flash_attn.utils": types.ModuleType("flash_attn.utils"),
        "flash_attn.utils.distributed": distributed,
    }


def test_openrlhf_own_reward_model_loads_our_save_and_agrees(tiny, tmp_path, monkeypatch):
    """Ground truth: openrlhf 0.11.2's own RewardModel class loading the directory we wrote."""
    if importlib.util.find_spec("openrlhf") is None:
        pytest.skip("openrlhf is not installed")
    if importlib.util.find_spec("flash_attn") is None:
        for name, module in _flash_attn_stand_in().items():
            monkeypatch.setitem(sys.modules, name, module)
    try:
        from openrlhf.models.model import _get_reward_model
    except Exception as exc:  # noqa: BLE001 - any import failure of the optional ground truth
        pytest.skip(f"openrlhf.models.model does not import here: {exc}")
    from transformers import AutoConfig, AutoModel

    original = tiny.openrlhf_model("reward", seed=7, normalize=True, mean=-1.0, std=0.5)
    save_openrlhf_value_model(original, tmp_path)
    # get_llm_for_sequence_regression's steps, in fp32 (its param_dtype accepts bf16/fp16 only).
    config = AutoConfig.from_pretrained(tmp_path)
    config.normalize_reward = True
    config._attn_implementation = "sdpa"
    base_class = AutoModel._model_mapping[type(config)]
    cls = _get_reward_model(base_class.__base__, base_class, getattr(config, "value_head_prefix", "score"))
    theirs = cls.from_pretrained(tmp_path, config=config, dtype=torch.float32).eval()
    # openrlhf 0.11.2 + transformers 5.15: from_pretrained builds the model on the meta device, so the
    # non-persistent mean/std buffers that RewardModel.__init__ fills from config.json come out
    # uninitialised (seen: mean -2e27, std 1e-38). Put back the values its __init__ means to set.
    with torch.no_grad():
        theirs.mean.fill_(config.mean)
        theirs.std.fill_(config.std)
    assert theirs.value_head_prefix == "value_head"
    want = []
    with torch.no_grad():
        for prompt, response in SEQS:
            ids = torch.tensor([prompt + response])
            want.append(float(theirs(ids, attention_mask=torch.ones_like(ids))[0]))
    assert_close(one_shot_rewards(original), want, tol=1e-5)
    assert_close(streamed_rewards(load_reward_model(tmp_path, normalize_reward=True)), want)
    assert_close(streamed_rewards(theirs), want)  # our scorer reads OpenRLHF's own class too
