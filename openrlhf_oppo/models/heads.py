"""What the streaming scorers need from a model: its decoder backbone and its head.

Two reward/critic layouts are understood:

- transformers `*ForSequenceClassification` (num_labels=1): the `score` head.
- OpenRLHF's `RewardModel` / `CriticModel` (openrlhf 0.11.2
  `openrlhf/models/model.py`, `_get_reward_model` / `_get_critic_model`), and
  our mirror of it in `loaders.py`: base model under `base_model_prefix`, a
  bias-free linear head under `value_head_prefix`.

OpenRLHF loads either layout into its `RewardModel` (a transformers checkpoint's
`score` becomes the value head), so both are read by its rules unless told
otherwise:

- pooling (reward only): 'last' (default), OpenRLHF's rule, the hidden state
  of the last real token, i.e. the last token of an unpadded prompt+response;
  'non_pad', transformers' `*ForSequenceClassification.forward` rule, the
  rightmost token that is not `pad_token_id`. They differ when a response
  ends in the pad id (EOS-terminated responses where pad == eos).
- normalisation: `(x - mean) / std` when `normalize_reward`, with mean/std from
  the config (0/1 when absent), as `RewardModel.__init__` sets its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

POOLINGS = ("last", "non_pad")  # OpenRLHF's rule, transformers' rule


@dataclass(frozen=True)
class ValueModelParts:
    """A reward or critic model taken apart for incremental scoring."""

    backbone: nn.Module  # base decoder returning last_hidden_state
    value_head: nn.Module  # (…, H) -> (…, 1)
    normalize: bool  # apply (x - mean) / std to the head's output
    mean: float
    std: float
    # The reward head reads the rightmost position whose token differs from this
    # id (pooling 'non_pad'); None: the last token (pooling 'last').
    ignore_token_id: int | None
    layout: str  # "openrlhf" or "transformers"


@dataclass(frozen=True)
class CausalLMParts:
    """A causal LM taken apart: backbone hidden states, then `lm_head` for logits."""

    backbone: nn.Module
    lm_head: nn.Module  # (…, H) -> (…, V)


def value_model_parts(model: nn.Module, pooling: str = "last") -> ValueModelParts:
    """Split a reward/critic model of either supported layout into backbone and head.

    `pooling` says which position a reward head reads: 'last' (OpenRLHF's rule)
    or 'non_pad' (transformers' rule); see the module docstring.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    prefix = getattr(model, "value_head_prefix", None)
    if isinstance(prefix, str):  # OpenRLHF layout (theirs or our mirror)
        return ValueModelParts(
            backbone=getattr(model, model.base_model_prefix),
            value_head=getattr(model, prefix),
            normalize=bool(model.normalize_reward),
            mean=float(model.mean.reshape(-1)[0]),
            std=float(model.std.reshape(-1)[0]),
            ignore_token_id=_ignore_token_id(model.config, pooling),
            layout="openrlhf",
        )
    score = getattr(model, "score", None)
    config = getattr(model, "config", None)
    if (
        isinstance(score, nn.Linear)
        and config is not None
        and type(model).__name__.endswith("ForSequenceClassification")
    ):
        if score.out_features != 1:
            raise ValueError(
                f"{type(model).__name__} has num_labels={score.out_features}; a reward model needs num_labels=1"
            )
        # As OpenRLHF's RewardModel.__init__ on this config: the flag is config.normalize_reward
        # (the loader sets it), mean/std come from the config when it has them.
        has_stats = hasattr(config, "mean")
        return ValueModelParts(
            backbone=getattr(model, model.base_model_prefix),
            value_head=score,
            normalize=bool(getattr(config, "normalize_reward", False)),
            mean=float(config.mean) if has_stats else 0.0,
            std=float(config.std) if has_stats else 1.0,
            ignore_token_id=_ignore_token_id(config, pooling),
            layout="transformers",
        )
    raise TypeError(
        f"cannot score with {type(model).__name__}: expected a transformers *ForSequenceClassification "
        "(num_labels=1) or an OpenRLHF-layout reward/critic model (attributes base_model_prefix, value_head_prefix)"
    )


def _ignore_token_id(config, pooling: str) -> int | None:
    """The token id 'non_pad' pooling skips (None when the config sets no pad id: the last token)."""
    if pooling == "last":
        return None
    return config.get_text_config().pad_token_id


def causal_lm_parts(model: nn.Module) -> CausalLMParts:
    """Split a transformers `*ForCausalLM` into backbone and `lm_head`."""
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if lm_head is None or not hasattr(model, "base_model_prefix"):
        raise TypeError(f"{type(model).__name__} is not a transformers *ForCausalLM (no output embeddings)")
    config = model.config.get_text_config()
    # These models post-process logits in forward(); lm_head alone would differ.
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1.0):
            raise NotImplementedError(f"{type(model).__name__}: {name}={getattr(config, name)} is not supported")
    return CausalLMParts(backbone=getattr(model, model.base_model_prefix), lm_head=lm_head)


def normalized(values: torch.Tensor, parts: ValueModelParts) -> torch.Tensor:
    """OpenRLHF's reward normalisation `(x - mean) / std` when the model asks for it."""
    if not parts.normalize:
        return values
    return (values - parts.mean) / parts.std
