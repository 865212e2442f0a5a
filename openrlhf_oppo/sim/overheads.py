"""What a run's execution adds to, or takes from, the roofline: a rule reward in place of a
reward model, activation recompute, and parameter / optimizer offload to the host (verl's
FSDP `param_offload` / `optimizer_offload`) over PCIe. `costs.build` applies these last;
each is off by default, so a preset that sets none of them simulates as before.

Offload, per step (every device of the training pool moves its own shard at once)::

    old_logprobs   + 2 * 4 N_actor  / D / pcie    fp32 weights onloaded, then offloaded
    ref_logprobs   + 2 * 2 N_actor  / D / pcie    the reference model is kept in bf16
    values         + 2 * 4 N_critic / D / pcie
    train          + 2 * 4 (N_actor + N_critic) / D / pcie
                   + 2 * 8 (N_actor + N_critic) / D / pcie   with optimizer offload (Adam's two fp32 moments)
    weight_sync    + 2 * 4 N_actor  / D / pcie    the actor is onloaded to be resharded into the engines

with D the training devices and pcie = hardware.pcie_bytes_per_s * efficiency.link_efficiency.
"""

from __future__ import annotations

from typing import Any

from openrlhf_oppo.sim.presets import SimConfig

FP32_BYTES = 4
BF16_BYTES = 2
ADAM_BYTES = 8  # two fp32 moments per parameter
RECOMPUTE_FACTOR = 8.0 / 6.0  # activation recompute adds one forward: 8 N instead of 6 N flops per token


def updates(cfg: SimConfig, train_per_token_s: float, weight_sync_s: float) -> dict[str, Any]:
    """CostModel fields to replace: `train_per_token_s` and `weight_sync_s` are the model's values so far."""
    w = cfg.workload
    out: dict[str, Any] = {}
    if not w.reward_model:  # a rule reward: scoring costs nothing on the reward servers
        out.update(prefill_call_s=0.0, prefill_weights_read_s=0.0, prefill_per_token_s=0.0,
                   prefill_per_pair_s=0.0, prefill_per_chunk_s=0.0)
    if w.gradient_checkpointing and cfg.costs.train_per_token_s <= 0:  # a measured cost already includes it
        out["train_per_token_s"] = train_per_token_s * RECOMPUTE_FACTOR
    stages = offload_s(cfg)
    if stages:
        out["weight_sync_s"] = weight_sync_s + stages.pop("weight_sync", 0.0)
        out["fixed_stage_s"] = tuple(sorted(stages.items()))
    return out


def offload_s(cfg: SimConfig) -> dict[str, float]:
    """Seconds each stage spends moving weights and optimizer states over PCIe, per step (empty: no offload)."""
    w = cfg.workload
    if not (w.offload_params or w.offload_optimizer):
        return {}
    actor = cfg.actor.params
    critic = (cfg.critic or cfg.reward or cfg.actor).params if w.critic else 0
    devices = cfg.split.pattern_nodes * cfg.split.train_gpus
    pcie = cfg.hardware.pcie_bytes_per_s * cfg.efficiency.link_efficiency

    def there_and_back(params: int, bytes_per_param: int) -> float:
        return 2 * bytes_per_param * params / devices / pcie

    out = {"train": 0.0}
    if w.offload_params:
        out["old_logprobs"] = there_and_back(actor, FP32_BYTES)
        out["weight_sync"] = there_and_back(actor, FP32_BYTES)
        out["train"] += there_and_back(actor + critic, FP32_BYTES)
        if w.reference:
            out["ref_logprobs"] = there_and_back(actor, BF16_BYTES)
        if w.critic:
            out["values"] = there_and_back(critic, FP32_BYTES)
    if w.offload_optimizer:
        out["train"] += there_and_back(actor + critic, ADAM_BYTES)
    return out
