"""OPPO's settings as the Ray-side processes read them: the config the launcher put in the
environment, how a sample gets its reward, and how often a reward actor may die.

Read by the samples generator, the reward dispatcher and the streaming reward actors;
it imports none of them (so none of them imports another for a setting).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo import run_env

SCORER_RESTARTS = 3  # Ray restarts a dead reward actor this often (the reward dispatcher then reloads its model)


def config_from_env() -> oppo_config.OppoConfig:
    config = config_or_none()
    if config is None:
        raise RuntimeError(
            f"{run_env.CONFIG_JSON} is not set: launch OPPO with `python -m openrlhf_oppo.cli.train_ppo_ray`")
    return config


def config_or_none(environ: Mapping[str, str] | None = None) -> oppo_config.OppoConfig | None:
    """The config the launcher put in the environment (`environ`, default the process's); None outside an OPPO run."""
    raw = run_env.config_json(environ)
    return None if raw is None else oppo_config.from_dict(json.loads(raw))


def reward_mode(args, oppo: oppo_config.OppoConfig) -> str:
    """How OPPO gets a sample's reward: "rule" (`--reward.remote_url`, a `.py` reward function
    or an HTTP endpoint: the engine scores each sample the moment it finishes, through
    OpenRLHF's own executor; nothing to prefill), "stream" (chunks prefilled by the reward
    model while the actor decodes) or "batch" (OpenRLHF's reward forward on the batch)."""
    if args.reward.remote_url:
        return "rule"
    return "stream" if oppo.streaming.enable and oppo.streaming.reward else "batch"


def engine_text_needed(args) -> bool:
    """Whether OPPO's engines must detokenise (vLLM `SamplingParams.detokenize`). Only OpenRLHF
    0.11.2's multi-turn agent executor (`--train.agent_func_path`) reads vLLM's text (its
    `action_text`); its rule / remote reward (`SingleTurnAgentExecutor.execute`) decodes the
    token ids with the HF tokenizer, as OPPO's rule path does (`rollout._reward`), and OPPO's
    sampling parameters carry no stop strings (they need text). So text is off but for an agent."""
    return bool(args.train.agent_func_path)
