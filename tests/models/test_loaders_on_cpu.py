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


def streamed_rewards(model, pooling: str = "last") -> list[float]:
    scorer = StreamingRewardScorer(model, pooling=pooling)
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
    # SEQS[2] ends in the pad id: transformers' forward reads the rightmost non-pad token
    assert_close(streamed_rewards(loaded, pooling="non_pad"), want)


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
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a valid hub model id"):
        load_reward_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_reward_model(tmp_path / "empty")


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


# ---- pooling: where the head reads, against OpenRLHF's own one-shot forward ------------------

PAD = 0  # tests/models/conftest.py: the tiny models' pad_token_id
MAX_NEW_TOKENS = 12
_LONG_GENERATION = [(11 * k) % 96 + 1 for k in range(20)]  # no pad id; cut at MAX_NEW_TOKENS below

POOLING_CASES = {  # name -> (prompt_ids, response_ids)
    "ends in the pad id (EOS with pad == eos)": ([5, 6, 7], [8, 9, 10, PAD]),
    "only the pad id (immediate EOS)": ([5, 6, 7], [PAD]),
    "pad ids inside and at the end": ([40, 41], [PAD, 46, PAD, 47, PAD]),
    "truncated at max length, no EOS": ([5, 6, 7], _LONG_GENERATION[:MAX_NEW_TOKENS]),
    "truncated at max length, pad inside": ([3], [9, PAD, 9, PAD, 9, PAD, 9, 1, 2, 3, 4, 5][:MAX_NEW_TOKENS]),
    "ends in a non-pad EOS": ([5, 6, 7], [8, 9, 2]),
}
CHUNK_TOKENS = 3


def streamed_case_rewards(model, pooling: str | None = None) -> dict[str, float]:
    """Every case in one scorer, streamed CHUNK_TOKENS at a time with batched extend/finish;
    `pooling` None: the scorer's default."""
    scorer = StreamingRewardScorer(model) if pooling is None else StreamingRewardScorer(model, pooling=pooling)
    ids = dict(enumerate(POOLING_CASES))
    chunks = {}
    for i, name in ids.items():
        prompt, response = POOLING_CASES[name]
        scorer.open(i, prompt)
        chunks[i] = [response[a : a + CHUNK_TOKENS] for a in range(0, len(response), CHUNK_TOKENS)]
    while any(len(c) > 1 for c in chunks.values()):
        scorer.extend_many({i: c.pop(0) for i, c in chunks.items() if len(c) > 1})
    out = scorer.finish_many({i: c[0] for i, c in chunks.items()})
    return {name: out[i] for i, name in ids.items()}


def save_reward_model(tiny, layout: str, path, seed: int) -> None:
    if layout == "transformers":
        tiny.reward_model("qwen2", seed=seed).save_pretrained(path)
    else:
        save_openrlhf_value_model(tiny.openrlhf_model("reward", seed=seed, normalize=False), path)


def without_trailing_pads(ids: list[int]) -> list[int]:
    end = len(ids)
    while end > 1 and ids[end - 1] == PAD:
        end -= 1
    return ids[:end]


@pytest.mark.parametrize("layout", ["transformers", "openrlhf"])
def test_streamed_reward_reads_the_last_token_like_openrlhfs_forward(tiny, tmp_path, openrlhf_reward_forward, layout):
    """Default pooling: the head reads the last token of prompt+response, as OpenRLHF's reward model
    does for any checkpoint, also when the response ends in the pad id or is cut at a max length."""
    save_reward_model(tiny, layout, tmp_path, seed=20)
    theirs = openrlhf_reward_forward(tmp_path)
    got = streamed_case_rewards(load_reward_model(tmp_path))
    for name, (prompt, response) in POOLING_CASES.items():
        assert got[name] == pytest.approx(theirs(prompt + response), abs=1e-4), name


@pytest.mark.parametrize("layout", ["transformers", "openrlhf"])
def test_non_pad_pooling_reads_the_rightmost_non_pad_token(tiny, tmp_path, openrlhf_reward_forward, layout):
    """pooling='non_pad' is transformers' rule: a transformers checkpoint scores as its own forward;
    any checkpoint scores as OpenRLHF's forward on the sequence without its trailing pad ids (the
    model is causal: the hidden state there does not see what follows)."""
    save_reward_model(tiny, layout, tmp_path, seed=21)
    model = load_reward_model(tmp_path)
    theirs = openrlhf_reward_forward(tmp_path)
    got = streamed_case_rewards(model, pooling="non_pad")
    for name, (prompt, response) in POOLING_CASES.items():
        ids = prompt + response
        if layout == "transformers":
            with torch.no_grad():
                own = float(model(torch.tensor([ids])).logits[0, 0])
            assert got[name] == pytest.approx(own, abs=1e-4), name
        assert got[name] == pytest.approx(theirs(without_trailing_pads(ids)), abs=1e-4), name


def test_unknown_pooling_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match=r"pooling must be one of \('last', 'non_pad'\), got 'first'"):
        StreamingRewardScorer(tiny.reward_model(), pooling="first")


# ---- normalize_reward with a transformers-layout checkpoint ------------------------------------


@pytest.mark.parametrize("stats", [(0.5, 3.0), None], ids=["mean_std_in_config", "no_mean_std"])
def test_normalize_reward_with_transformers_layout_matches_openrlhf(tiny, tmp_path, openrlhf_reward_forward, stats):
    """OpenRLHF accepts --reward.normalize_enable for any checkpoint: (r - mean) / std with mean/std
    from config.json, 0/1 when absent."""
    model = tiny.reward_model("llama", seed=22)
    if stats is not None:
        model.config.mean, model.config.std = stats
    model.save_pretrained(tmp_path)
    theirs = openrlhf_reward_forward(tmp_path, normalize_reward=True)
    got = streamed_case_rewards(load_reward_model(tmp_path, normalize_reward=True))
    raw = streamed_case_rewards(load_reward_model(tmp_path, normalize_reward=False))
    mean, std = stats or (0.0, 1.0)
    for name, (prompt, response) in POOLING_CASES.items():
        assert got[name] == pytest.approx(theirs(prompt + response), abs=1e-4), name
        assert got[name] == pytest.approx((raw[name] - mean) / std, abs=1e-5), name


# ---- hub ids, resolved through the Hugging Face cache -------------------------------------------

_REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """An empty hub cache directory, with HF_HUB_CACHE pointing at it and HF_HUB_OFFLINE=1."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads both variables once, when imported: a process started with them set
    # (a reward actor) sees them there; this process imported it already.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_snapshot(cache, repo_id: str):
    """The cache layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / _REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(_REVISION)
    return snapshot


@pytest.mark.parametrize("layout", ["transformers", "openrlhf"])
def test_hub_id_resolves_through_the_offline_cache_and_scores_like_the_directory(tiny, tmp_path, offline_hub_cache,
                                                                               layout):
    from openrlhf_oppo.models import resolve_model_path

    local = tmp_path / "local"
    save_reward_model(tiny, layout, local, seed=23)
    snapshot = cache_snapshot(offline_hub_cache, "org/name")
    save_reward_model(tiny, layout, snapshot, seed=23)

    assert resolve_model_path("org/name") == snapshot
    assert resolve_model_path(local) == local
    want = streamed_case_rewards(load_reward_model(local))
    got = streamed_case_rewards(load_reward_model("org/name"))
    for name in POOLING_CASES:
        assert got[name] == pytest.approx(want[name], abs=1e-6), name


def test_unknown_hub_id_offline_is_a_clear_error(offline_hub_cache, tmp_path):
    from openrlhf_oppo.models import resolve_model_path

    with pytest.raises(FileNotFoundError, match=r"'org/missing'.*HF_HUB_OFFLINE"):
        resolve_model_path("org/missing")
    with pytest.raises(FileNotFoundError, match=r"'org/missing'"):
        load_reward_model("org/missing")
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a valid hub model id"):
        load_reward_model(tmp_path / "missing")  # a path, not a model id: no hub look-up
