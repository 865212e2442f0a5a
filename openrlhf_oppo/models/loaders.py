"""Load a reward (or critic) model, in either layout the scorers read.

A model is named by a local directory or a Hugging Face hub id, resolved as
transformers does (`resolve_model_path`): a directory if one exists at that
path, else the id through the hub cache (HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE honoured), downloading what is missing when online.

- **transformers layout**: a `*ForSequenceClassification` checkpoint with
  `num_labels=1` (`config.architectures[0]` ends with `ForSequenceClassification`).
- **OpenRLHF layout** (what `openrlhf.cli.train_rm` saves, openrlhf 0.11.2):
  `config.json` of the base model plus `value_head_prefix`, `mean`, `std`
  (written by `RewardModelTrainer`) and `architectures: ["RewardModel"]`; weights
  `{base_model_prefix}.*` for the base decoder and `{value_head_prefix}.weight`
  for a bias-free `Linear(hidden, 1)`.

`OpenRLHFRewardModel` / `OpenRLHFCriticModel` mirror openrlhf's `RewardModel` /
`CriticModel` (`openrlhf/models/model.py`: `_get_reward_model`,
`_get_critic_model`) without importing openrlhf, whose model module imports
flash-attn at top level. Their `forward` is OpenRLHF's, line for line, for the
non-packed path; a test compares them with OpenRLHF's own classes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, PretrainedConfig

LAYOUTS = ("auto", "transformers", "openrlhf")
_OPENRLHF_ARCHITECTURES = ("RewardModel", "CriticModel")
# What a hub snapshot needs for loading: configs and safetensors weights; pytorch_model*.bin only
# when a repository has no safetensors (fetching both would double a multi-GB download).
_HUB_PATTERNS = ("*.json", "*.safetensors")
_HUB_FALLBACK_PATTERNS = ("pytorch_model*.bin",)


class _OpenRLHFValueModel(nn.Module):
    """Base decoder + bias-free linear value head + reward normalisation buffers (OpenRLHF's layout)."""

    def __init__(self, config: PretrainedConfig, value_head_prefix: str = "score", normalize_reward: bool = False,
                 attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        base = AutoModel.from_config(config, attn_implementation=attn_implementation)
        # OpenRLHF stores the decoder under the PreTrainedModel's base_model_prefix ("model" for Llama/Qwen2).
        self.base_model_prefix = type(base).base_model_prefix
        setattr(self, self.base_model_prefix, base)
        self.value_head_prefix = value_head_prefix
        setattr(self, value_head_prefix, nn.Linear(config.hidden_size, 1, bias=False))
        self.normalize_reward = normalize_reward
        self.register_buffer("mean", torch.zeros(1), persistent=False)
        self.register_buffer("std", torch.ones(1), persistent=False)
        if hasattr(config, "mean"):
            self.mean[0] = config.mean
            self.std[0] = config.std

    def _position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        # https://github.com/OpenRLHF/OpenRLHF/issues/217 (left padding)
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        return position_ids


class OpenRLHFRewardModel(_OpenRLHFValueModel):
    """Mirror of openrlhf 0.11.2 `RewardModel` (non-packed path)."""

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
        outputs = getattr(self, self.base_model_prefix)(
            input_ids, attention_mask=attention_mask, position_ids=self._position_ids(attention_mask)
        )
        values = getattr(self, self.value_head_prefix)(outputs["last_hidden_state"]).squeeze(-1)
        reward = values.gather(dim=1, index=eos_indices).squeeze(1)
        if not self.training and self.normalize_reward:
            reward = (reward - self.mean) / self.std
        return reward  # (B,)


class OpenRLHFCriticModel(_OpenRLHFValueModel):
    """Mirror of openrlhf 0.11.2 `CriticModel` (non-packed path)."""

    def forward(self, input_ids: torch.LongTensor, action_mask: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        outputs = getattr(self, self.base_model_prefix)(
            input_ids, attention_mask=attention_mask, position_ids=self._position_ids(attention_mask)
        )
        values = getattr(self, self.value_head_prefix)(outputs["last_hidden_state"]).squeeze(-1)
        values = values[:, :-1]
        if self.normalize_reward:
            values = (values - self.mean) / self.std
        return values[:, -action_mask.shape[1] :] * action_mask.float()  # (B, A)


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """The local directory holding `name_or_path`: itself if it is a directory, else the
    hub snapshot of that model id (from the cache, downloaded when online and missing).

    Raises FileNotFoundError naming the id when neither exists (e.g. offline and not cached).
    """
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo_id = str(name_or_path)
    try:
        return _hub_snapshot(repo_id)
    except HFValidationError as exc:
        raise FileNotFoundError(f"{repo_id!r} is neither a local directory nor a valid hub model id") from exc
    except (LocalEntryNotFoundError, RepositoryNotFoundError) as exc:
        raise FileNotFoundError(
            f"{repo_id!r} is not a local directory, and the hub model id was not found "
            f"(HF_HUB_CACHE={constants.HF_HUB_CACHE}, HF_HUB_OFFLINE={int(constants.HF_HUB_OFFLINE)}): {exc}"
        ) from exc


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(repo_id, allow_patterns=list(_HUB_PATTERNS)))
    if any(folder.glob("*.safetensors")):
        return folder
    return Path(snapshot_download(repo_id, allow_patterns=list(_HUB_PATTERNS + _HUB_FALLBACK_PATTERNS)))


def detect_layout(path: str | os.PathLike) -> str:
    """'transformers' or 'openrlhf' for the checkpoint directory at `path`."""
    config = json.loads((Path(path) / "config.json").read_text())
    architectures = config.get("architectures") or []
    if architectures and architectures[0].endswith("ForSequenceClassification"):
        return "transformers"
    if "value_head_prefix" in config or (architectures and architectures[0] in _OPENRLHF_ARCHITECTURES):
        return "openrlhf"
    raise ValueError(
        f"{path}: cannot tell the reward-model layout (architectures={architectures}, no value_head_prefix); "
        "pass layout='transformers' or layout='openrlhf'"
    )


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_file(str(path / name)))
        return state
    if (path / "model.safetensors").exists():
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: no model.safetensors(.index.json) or pytorch_model.bin")


def _load_openrlhf(path: Path, cls: type[_OpenRLHFValueModel], normalize_reward: bool, value_head_prefix: str,
                   dtype: torch.dtype, attn_implementation: str) -> _OpenRLHFValueModel:
    from accelerate import init_empty_weights

    config = AutoConfig.from_pretrained(path)
    # As OpenRLHF: the prefix saved in the config wins over the argument.
    prefix = getattr(config, "value_head_prefix", value_head_prefix)
    # Parameters on the meta device (no fp32 random init on the host: ~32 GB for an 8B model),
    # buffers real (rotary inv_freq, mean/std are computed, not saved); the checkpoint's
    # tensors are then assigned in `dtype`. Built under `dtype` as torch's default, as
    # transformers' `from_pretrained` builds OpenRLHF's reward model: its buffers then come out
    # in OpenRLHF's dtypes (mean/std in `dtype`, rotary inv_freq in fp32, which the model asks for).
    with init_empty_weights(include_buffers=False), _default_dtype(dtype):
        model = cls(config, value_head_prefix=prefix, normalize_reward=normalize_reward,
                    attn_implementation=attn_implementation)
    state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
             for name, tensor in _load_state_dict(path).items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match the OpenRLHF layout with value_head_prefix={prefix!r} "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    # No `model.to(dtype)`: it would cast the fp32 inv_freq too, and a bf16 inv_freq turns
    # each rotary angle by up to 2**-9 of itself: tenths of a radian by position 2,000.
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside (what `torch.zeros(1)` makes), restored after."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _load_transformers(path: Path, normalize_reward: bool, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    # num_labels=1: a reward model has one output, and a config without id2label
    # defaults to 2 labels and would not load a (1, H) head. A checkpoint whose head is not
    # where the class expects it (`score` for transformers' classes) would load with a random
    # head and a warning: the run would train on noise, so missing weights are an error.
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True
        )
    except RuntimeError as exc:  # a head of another shape (num_labels != 1): transformers' size mismatch
        raise ValueError(f"{path}: the weights do not load as a reward model with num_labels=1 "
                         f"(a reward model has one output): {exc}") from exc
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ValueError(
            f"{path}: {type(model).__name__} found no weights for {sorted(info['missing_keys'])[:5]} "
            f"(mismatched {sorted(info['mismatched_keys'])[:5]}; unexpected in the checkpoint: "
            f"{sorted(info['unexpected_keys'])[:5]}); transformers would initialise them at random. A "
            "transformers-layout reward model needs its head saved as `score`; an OpenRLHF-layout one "
            "names it in config.json's value_head_prefix"
        )
    # As get_llm_for_sequence_regression: the flag goes on the config; the scorers apply it with the
    # config's mean/std (heads.value_model_parts), since this model's own forward does not normalise.
    model.config.normalize_reward = normalize_reward
    return model.eval()


def load_reward_model(
    path: str | os.PathLike,
    *,
    layout: str = "auto",
    normalize_reward: bool = False,
    value_head_prefix: str = "score",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """Load a reward model, in eval mode, for `StreamingRewardScorer`.

    Args:
        path: a local directory or a hub model id (see `resolve_model_path`).
        layout: 'auto' (from config.json), 'transformers' or 'openrlhf'.
        normalize_reward: as OpenRLHF's `--reward.normalize_enable`, for either layout:
            the scorers apply `(r - mean) / std` with `mean`/`std` from config.json (0/1 if
            absent). A transformers model's own forward stays unnormalised.
        value_head_prefix: OpenRLHF layout only; `value_head_prefix` in config.json wins.
    """
    return _load_value_model(
        path, OpenRLHFRewardModel, layout, normalize_reward, value_head_prefix, dtype, attn_implementation
    )


def load_critic_model(
    path: str | os.PathLike,
    *,
    layout: str = "auto",
    normalize_reward: bool = False,
    value_head_prefix: str = "score",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """Load a critic (same layouts as `load_reward_model`), in eval mode, for `StreamingCriticScorer`."""
    return _load_value_model(
        path, OpenRLHFCriticModel, layout, normalize_reward, value_head_prefix, dtype, attn_implementation
    )


def _load_value_model(path, cls, layout, normalize_reward, value_head_prefix, dtype, attn_implementation) -> nn.Module:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    path = resolve_model_path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a model directory)")
    if layout == "auto":
        layout = detect_layout(path)
    if layout == "transformers":
        return _load_transformers(path, normalize_reward, dtype, attn_implementation)
    return _load_openrlhf(path, cls, normalize_reward, value_head_prefix, dtype, attn_implementation)


def save_openrlhf_value_model(model: _OpenRLHFValueModel, path: str | os.PathLike) -> None:
    """Write `model` in OpenRLHF's layout (as `openrlhf.cli.train_rm` does): config.json + model.safetensors.

    `mean`/`std` go to config.json (they are non-persistent buffers), as
    OpenRLHF's `RewardModelTrainer` writes them.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.update(
        architectures=["CriticModel" if isinstance(model, OpenRLHFCriticModel) else "RewardModel"],
        value_head_prefix=model.value_head_prefix,
        normalize_reward=bool(model.normalize_reward),
        mean=float(model.mean[0]),
        std=float(model.std[0]),
    )
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
