"""What the loaders refuse or build differently from a plain `from_pretrained`: a reward model
is one output read from a head the checkpoint holds (never a random init), and an
OpenRLHF-layout model is built without materialising fp32 random weights on the host."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from openrlhf_oppo.models import load_reward_model, loaders, save_openrlhf_value_model


def _rewrite(path, config_edit=None, state_edit=None):
    if config_edit:
        config = json.loads((path / "config.json").read_text())
        config_edit(config)
        (path / "config.json").write_text(json.dumps(config))
    if state_edit:
        state = load_file(str(path / "model.safetensors"))
        state_edit(state)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_a_transformers_config_without_id2label_loads_as_one_label(tiny, tmp_path):
    """A config that does not say num_labels defaults to 2; the (1, H) head must still load."""
    tiny.reward_model("qwen2", seed=4).save_pretrained(tmp_path)
    _rewrite(tmp_path, config_edit=lambda c: [c.pop(k, None) for k in ("id2label", "label2id", "num_labels")])
    loaded = load_reward_model(tmp_path)
    assert loaded.config.num_labels == 1 and loaded.score.weight.shape[0] == 1


def test_a_transformers_head_not_named_score_is_an_error_not_a_random_init(tiny, tmp_path):
    tiny.reward_model("qwen2", seed=4).save_pretrained(tmp_path)
    _rewrite(tmp_path, state_edit=lambda s: s.__setitem__("v_head.weight", s.pop("score.weight")))
    with pytest.raises(ValueError, match=r"found no weights for \['score.weight'\].*v_head.weight.*random"):
        load_reward_model(tmp_path)


def test_a_transformers_head_with_two_labels_is_an_error(tiny, tmp_path):
    tiny.reward_model("qwen2", seed=4).save_pretrained(tmp_path)
    _rewrite(tmp_path, config_edit=lambda c: c.update(id2label={"0": "a", "1": "b"}, label2id={"a": 0, "b": 1}),
             state_edit=lambda s: s.__setitem__("score.weight", torch.zeros(2, s["score.weight"].shape[1])))
    with pytest.raises(ValueError, match="num_labels=1"):
        load_reward_model(tmp_path)


def test_openrlhf_layout_is_built_on_meta_and_loaded_in_the_requested_dtype(tiny, tmp_path, monkeypatch):
    original = tiny.openrlhf_model("reward", seed=5, normalize=True, mean=0.5, std=3.0)
    save_openrlhf_value_model(original, tmp_path)
    built_on = []
    from_config = loaders.AutoModel.from_config

    def spy(*args, **kwargs):
        base = from_config(*args, **kwargs)
        built_on.append(next(base.parameters()).device.type)
        return base

    monkeypatch.setattr(loaders.AutoModel, "from_config", spy)
    loaded = load_reward_model(tmp_path, normalize_reward=True, dtype=torch.bfloat16)
    assert built_on == ["meta"]  # no fp32 random weights on the host
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    assert all(b.device.type == "cpu" for b in loaded.buffers())  # rotary inv_freq, mean/std: computed
    assert float(loaded.mean[0]) == 0.5 and float(loaded.std[0]) == 3.0
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert abs(float(loaded(ids)[0]) - float(original(ids)[0])) < 0.05  # bf16 vs fp32
