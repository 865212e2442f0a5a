"""Streaming scorers (incremental prefill for reward / reference / critic) and their loaders.

Importing this package imports torch and transformers; `openrlhf_oppo.core` never does.
"""

from openrlhf_oppo.models.heads import POOLINGS
from openrlhf_oppo.models.loaders import (
    OpenRLHFCriticModel,
    OpenRLHFRewardModel,
    detect_layout,
    load_critic_model,
    load_reward_model,
    resolve_model_path,
    save_openrlhf_value_model,
)
from openrlhf_oppo.models.prefill import PrefillStats, SequenceStateError, TokenIdError, UnknownSequenceError
from openrlhf_oppo.models.streaming import (
    CriticVersionError,
    StreamingCriticScorer,
    StreamingReferenceScorer,
    StreamingRewardScorer,
)

__all__ = [
    "CriticVersionError",
    "OpenRLHFCriticModel",
    "OpenRLHFRewardModel",
    "POOLINGS",
    "PrefillStats",
    "SequenceStateError",
    "StreamingCriticScorer",
    "StreamingReferenceScorer",
    "StreamingRewardScorer",
    "TokenIdError",
    "UnknownSequenceError",
    "detect_layout",
    "load_critic_model",
    "load_reward_model",
    "resolve_model_path",
    "save_openrlhf_value_model",
]
