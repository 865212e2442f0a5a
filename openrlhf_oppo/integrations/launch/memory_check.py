"""Memory of a colocated layout (`--train.colocate_all`), checked before anything starts.

On every colocated GPU vLLM keeps `--vllm.gpu_memory_utilization` of the device beside the
DeepSpeed models and the streaming reward actor (with `--train.async_enable`, OPPO's async
admission in OpenRLHF's async layout, vLLM has GPUs of its own), unless it sleeps while they train
(`--vllm.enable_sleep`, the hybrid engine; `--ds.enable_sleep` moves the actor's and critic's
optimizer states and gradients to the host while vLLM generates). Per GPU
(`openrlhf_oppo.footprint`), in each phase::

    vLLM                     gpu_memory_utilization x device memory (generating; always without sleep)
    actor, critic            ZeRO-3: 16 B a parameter over their GPUs (2 B while generating with
                             --ds.enable_sleep: the bf16 weights stay)
    reference, reward (batch) ZeRO-3 inference: 2 B a parameter over their GPUs
    streaming reward actor   the whole reward model (--ds.param_dtype) + its KV budget
                             + the batched forward's 2 x STREAM_MAX_BATCH_TOKENS of KV
    streaming reference actor likewise, the whole reference (--oppo.streaming.reference)
    background sync buffer   the actor's whole weights (--ds.param_dtype) on its first GPU
                             (--oppo.staleness.background_sync); with
                             --oppo.staleness.background_sync_buffer host its largest parameter (the
                             weights wait in host memory); with shards each GPU's own partition
                             (1/N of the weights on each of the actor's N GPUs)
    ZeRO-3 live parameters (training and its forwards), reserve (CUDA contexts, NCCL, fragmentation)

Activations are left out: this is a lower bound, so whatever it refuses cannot fit.
Model sizes come from the local checkpoints' config.json (no weights are read); a hub id or a
missing checkpoint is not counted, with a note.

The streaming reward actor's automatic budget (0.5 of `mem_get_info()` at its load) would be
read while vLLM may still be allocating and before ZeRO-3 has gathered anything, so a
colocated run must give `--oppo.streaming.kv_budget_tokens` explicitly; this check then
proves it fits. (Measuring after the engines start would still miss the training side's
peak, which comes at the first update.)

The device's memory: `OPPO_DEVICE_MEMORY_GB`, else the launching host's first CUDA device;
without either (a CPU run: no device memory, vLLM's CPU KV cache is VLLM_CPU_KVCACHE_SPACE)
nothing is refused and a note says so.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from openrlhf_oppo import footprint, run_env
from openrlhf_oppo.config import OppoConfig

NOTE = "openrlhf-oppo: colocated memory check:"
DTYPE_BYTES = {"bf16": 2, "fp16": 2}  # --ds.param_dtype; anything else: fp32
# where an item is on the device: the whole step, or only while vLLM generates / the models train
ALWAYS = "always"
GENERATE = "while vLLM generates"
TRAIN = "while the models train"


def _note(message: str) -> None:
    print(f"{NOTE} {message}", flush=True)


def device_memory(environ: Mapping[str, str] | None = None) -> tuple[float | None, str]:
    """(bytes of one GPU, where the number came from); None on a host without CUDA and no override."""
    env = os.environ if environ is None else environ
    given = env.get(run_env.DEVICE_MEMORY_GB)
    if given:
        try:
            gb = float(given)
        except ValueError:
            gb = -1.0
        if not gb > 0:
            raise ValueError(f"{run_env.DEVICE_MEMORY_GB} must be a number of GB > 0, got {given!r}")
        return gb * footprint.GB, run_env.DEVICE_MEMORY_GB
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), "torch.cuda.get_device_properties(0)"
    return None, "no CUDA device on this host"


def _config(flag: str, path: str | None):
    """The transformers config of a local checkpoint; None (noted) when there is none to read."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        _note(f"--{flag} {path}: no local config.json, its size is not counted")
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=True)


def per_device_items(v: dict[str, Any], cfg: OppoConfig | None, capacity: float) -> list[tuple[str, float, str]]:
    """(what, bytes, when: ALWAYS, GENERATE or TRAIN) on each colocated GPU, as OpenRLHF 0.11.2
    places a `--train.colocate_all` run (every group in the actor's placement group; vLLM too
    unless `--train.async_enable`)."""
    def gpus(group: str) -> int:
        return max(1, v[f"{group}.num_nodes"] * v[f"{group}.num_gpus_per_node"])

    dtype_bytes = DTYPE_BYTES.get(v["ds.param_dtype"], 4)

    def streamed(name: str, model_cfg, params: int, group: str) -> list[tuple[str, float, str]]:
        per_token = footprint.kv_bytes_per_token(model_cfg, dtype_bytes)
        here = math.ceil(gpus(group) / gpus("actor"))  # streaming actors of this group on one GPU
        budget = cfg.streaming.kv_budget_tokens
        return [(f"streaming {name} weights x {here}", here * dtype_bytes * params, ALWAYS),
                (f"streaming KV budget x {here} ({name}, --oppo.streaming.kv_budget_tokens {budget})",
                 here * budget * per_token, ALWAYS),
                (f"streaming {name} forward x {here}", here * 2 * footprint.STREAM_MAX_BATCH_TOKENS * per_token,
                 ALWAYS)]

    def trained(name: str, params: int, devices: int) -> list[tuple[str, float, str]]:
        if not v.get("ds.enable_sleep"):
            return [(f"{name} ZeRO-3 states", footprint.zero3_bytes(params, True, devices), ALWAYS)]
        weights = footprint.zero3_bytes(params, False, devices)
        return [(f"{name} ZeRO-3 weights", weights, ALWAYS),
                (f"{name} optimizer states and gradients", footprint.zero3_bytes(params, True, devices) - weights,
                 TRAIN)]

    util = v["vllm.gpu_memory_utilization"]
    items = []
    if not v.get("train.async_enable"):  # with it OpenRLHF gives vLLM GPUs of its own
        items.append((f"vLLM (--vllm.gpu_memory_utilization {util:g})", util * capacity,
                      GENERATE if v.get("vllm.enable_sleep") else ALWAYS))
    actor_cfg = _config("actor.model_name_or_path", v["actor.model_name_or_path"])
    if actor_cfg is not None:
        actor = footprint.params_of_config(actor_cfg)
        items += trained("actor", actor, gpus("actor"))
        if cfg is not None and cfg.staleness.background_sync:  # on the actor's first GPU: counted on each
            if cfg.staleness.background_sync_buffer == "shards":
                items.append(("background sync partitions (--oppo.staleness.background_sync_buffer shards: 1/"
                              f"{gpus('actor')} of the actor's weights)", dtype_bytes * actor / gpus("actor"), ALWAYS))
            elif cfg.staleness.background_sync_buffer == "host":
                largest = footprint.largest_param(actor_cfg.hidden_size, actor_cfg.intermediate_size,
                                                  actor_cfg.vocab_size)
                items.append(("background sync staging (--oppo.staleness.background_sync_buffer host: the "
                              "largest parameter)", dtype_bytes * largest, ALWAYS))
            else:
                items.append(("background sync buffer (--oppo.staleness.background_sync: the actor's weights)",
                              dtype_bytes * actor, ALWAYS))
        if v["algo.kl.init_coef"] > 0 and streams_reference(cfg):
            items += streamed("reference", actor_cfg, actor, "ref")
        elif v["algo.kl.init_coef"] > 0:
            items.append(("reference", footprint.zero3_bytes(actor, False, gpus("ref")), ALWAYS))
    reward_path = None  # the first of --reward.model_name_or_path's models; none with a remote reward
    if not v["reward.remote_url"]:
        reward_path = (v["reward.model_name_or_path"] or "").split(",")[0] or None
    if v["algo.advantage.estimator"] == "gae":  # OpenRLHF's critic: given, else the reward model, else the actor
        flag, path = "critic.model_name_or_path", v["critic.model_name_or_path"]
        if not path and reward_path:
            flag, path = "reward.model_name_or_path", reward_path
        elif not path:
            flag, path = "actor.model_name_or_path", v["actor.model_name_or_path"]
        critic_cfg = _config(flag, path)
        if critic_cfg is not None:
            critic = footprint.params_of_config(critic_cfg, lm_head=False)
            items += trained("critic", critic, gpus("critic"))
    reward_cfg = _config("reward.model_name_or_path", reward_path) if reward_path else None
    if reward_cfg is not None:
        reward = footprint.params_of_config(reward_cfg, lm_head=False)
        if streams_reward(v, cfg):
            items += streamed("reward", reward_cfg, reward, "reward")
        else:
            items.append(("reward model", footprint.zero3_bytes(reward, False, gpus("reward")), ALWAYS))
    items += [("ZeRO-3 live parameters", footprint.WEIGHT_BYTES_PER_PARAM * footprint.LIVE_PARAMETERS, TRAIN),
              ("reserve", footprint.RESERVE_BYTES, ALWAYS)]
    return items


def peak(items: list[tuple[str, float, str]]) -> tuple[str, list[tuple[str, float]]]:
    """The phase that needs the most memory, and what is on the device then."""
    phases = {when: [(what, b) for what, b, w in items if w in (ALWAYS, when)] for when in (GENERATE, TRAIN)}
    when = max(phases, key=lambda w: sum(b for _, b in phases[w]))
    return when, phases[when]


def streams_reward(v: dict[str, Any], cfg: OppoConfig | None) -> bool:
    return cfg is not None and not v["reward.remote_url"] and cfg.streaming.enable and cfg.streaming.reward


def streams_reference(cfg: OppoConfig | None) -> bool:
    return cfg is not None and "reference" in cfg.streaming.scorers()


def check_colocated(v: dict[str, Any], cfg: OppoConfig | None, environ: Mapping[str, str] | None = None) -> None:
    """ValueError naming the flags when a `--train.colocate_all` layout cannot fit its GPUs."""
    if not v["train.colocate_all"] or cfg is None:
        return
    capacity, where = device_memory(environ)
    if capacity is None:
        _note(f"{where}: no device memory to check (a CPU run; on a GPU cluster whose launching host has "
              f"no GPU, set {run_env.DEVICE_MEMORY_GB})")
        return
    if (streams_reward(v, cfg) or streams_reference(cfg)) and cfg.streaming.kv_budget_tokens == 0:
        raise ValueError(
            "--train.colocate_all with a streaming reward or reference needs an explicit "
            "--oppo.streaming.kv_budget_tokens: "
            "the automatic one takes half of the GPU's free memory at load, while vLLM may still be allocating "
            "and before the DeepSpeed models peak. Pick a budget (this check then proves it fits)")
    when, items = peak(per_device_items(v, cfg, capacity))
    total = sum(b for _, b in items)
    if total <= capacity:
        _note(f"{total / footprint.GB:.1f} of {capacity / footprint.GB:.1f} GB per GPU at most ({when}; {where}), "
              "activations not counted")
        return
    raise ValueError(_refusal(v, cfg, when, items, capacity, where))


def _refusal(v: dict[str, Any], cfg: OppoConfig, when: str, items: list[tuple[str, float]], capacity: float,
             where: str) -> str:
    gb = footprint.GB
    total = sum(b for _, b in items)
    parts = ", ".join(f"{what} {b / gb:.1f}" for what, b in items if b > 0)
    fits = []
    vllm = next((b for what, b in items if what.startswith("vLLM")), None)
    if vllm is not None:  # vLLM is on the device in the phase that overflows
        max_util = math.floor((capacity - total + vllm) / capacity * 100) / 100
        if max_util > 0:
            fits.append(f"--vllm.gpu_memory_utilization {max_util:.2f} or lower (vLLM's weights and KV cache must "
                        "fit in it)")
    kv = sum(b for what, b in items if what.startswith("streaming KV budget"))  # one budget per streamed model
    if kv > 0 and total - kv <= capacity:
        per_token = kv / cfg.streaming.kv_budget_tokens
        fits.append(f"--oppo.streaming.kv_budget_tokens {int((capacity - total + kv) // per_token):,} or lower")
    if not (v.get("vllm.enable_sleep") and v.get("ds.enable_sleep")) and not v.get("train.async_enable"):
        fits.append("--vllm.enable_sleep --ds.enable_sleep (OpenRLHF's hybrid engine: vLLM sleeps while the models "
                    "train, the optimizer states leave the GPU while vLLM generates)")
    fits.append("more GPUs (--actor/--critic/--ref/--reward .num_gpus_per_node with vLLM's engines x TP), or no "
                "--train.colocate_all")
    return (f"--train.colocate_all: each GPU ({capacity / gb:.1f} GB, {where}) would need at least "
            f"{total / gb:.1f} GB {when} ({parts}; activations not counted). What would fit: " + "; or ".join(fits))
