"""Weight sync from the DeepSpeed policy actor into vLLM's CPU engine.

OpenRLHF 0.11.2 syncs with an NCCL group (`_init_vllm_sync_group` +
`ActorPPOTrainer.broadcast_to_vllm` -> `WorkerWrap.update_weight`, which
`torch.empty(..., device="cuda")` and `model.load_weights`) or CUDA IPC. Neither
exists on CPU, and vLLM CPU repacks linear weights so `model.load_weights` fails
("'Parameter' object has no attribute 'weight_loader'").

Here rank 0 gathers each parameter (ZeRO-3: `deepspeed.zero.GatheredParameters`,
a collective every rank joins) and sends the whole state dict as raw bytes through
the engine's *existing* `update_weight` Ray method (the payload rides in its
`name` argument); the worker side rebuilds tensors with `torch.frombuffer` and calls
`model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`,
which re-runs vLLM's own loading + repacking. One RPC per sync is fine for tiny
models; real models would need chunking (and have NCCL anyway).

Optional probe (for tests and the CLI's sync check): with OPPO_SYNC_PROBE=<file>,
rank 0 asks engine 0 for a greedy completion of a fixed prompt after every sync and
appends {"sync", "prompt_token_ids", "token_ids", "logprobs"} to <file> (jsonl).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from openrlhf_oppo import run_env

PAYLOAD_TAG = "openrlhf_oppo.weights.v1"
PROBE_MAX_TOKENS = 16


def pack_tensor(name: str, tensor) -> tuple[str, bytes, tuple[int, ...], str]:
    import torch

    t = tensor.detach().to("cpu").contiguous()
    return name, t.view(torch.uint8).numpy().tobytes(), tuple(t.shape), str(t.dtype).removeprefix("torch.")


def unpack_tensor(item) -> tuple[str, Any]:
    import torch

    name, raw, shape, dtype = item
    dtype = getattr(torch, dtype)
    if len(raw) == 0:
        return name, torch.empty(shape, dtype=dtype)
    return name, torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def broadcast_to_vllm(self) -> None:
    """Replacement for `ActorPPOTrainer.broadcast_to_vllm` (OpenRLHF 0.11.2)."""
    send_weights(self, gathered_weights(self))


def gathered_weights(trainer):
    """(name, whole tensor) of each parameter OpenRLHF 0.11.2's `broadcast_to_vllm` syncs, on every
    rank of `trainer` (an `ActorPPOTrainer`), each valid only until the next is asked for: gathering
    is a collective every rank joins (ZeRO-3; `GatherReplacedLayerParams` with
    --ds.tensor_parallel_size > 1), and a VLM's frozen vision encoder is not synced."""
    import deepspeed

    ds = trainer.strategy.args.ds
    model = trainer.actor.model.module
    vlm = getattr(trainer.actor, "is_vlm", False)
    for name, param in model.named_parameters():
        if vlm and not param.requires_grad:
            continue
        if ds.tensor_parallel_size > 1:
            gathered = deepspeed.module_inject.layers.GatherReplacedLayerParams([param], model, enabled=True)
        else:
            gathered = deepspeed.zero.GatheredParameters([param], enabled=ds.zero_stage == 3)
        with gathered:
            yield name, param.data


SHARDS_NEED_ZERO3 = ("--oppo.staleness.background_sync_buffer shards sends each rank's ZeRO-3 partition, but {name} "
                     "{why}; use the device or host buffer")


def local_shards(trainer):
    """(name, this rank's ZeRO-3 partition, the parameter's shape) of each parameter `gathered_weights`
    yields, without a collective: rank r holds elements [r p, (r + 1) p) of the flattened parameter,
    p = ceil(numel / ranks), the last one zero-padded (DeepSpeed's `_partition_param`); `reassemble`
    undoes it. RuntimeError, naming the parameter, where the partition is not that: not ZeRO-3,
    released to NVMe, or partitioned over fewer ranks than the actor has (ring attention's groups)."""
    import torch

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = trainer.actor.model.module
    vlm = getattr(trainer.actor, "is_vlm", False)
    for name, param in model.named_parameters():
        if vlm and not param.requires_grad:
            continue
        shard = getattr(param, "ds_tensor", None)
        if shard is None or shard.numel() != getattr(shard, "ds_numel", -1):
            why = "has no partition (--ds.zero_stage 3?)" if shard is None else "has its partition on NVMe"
            raise RuntimeError(SHARDS_NEED_ZERO3.format(name=name, why=why))
        group = param.ds_process_group
        if torch.distributed.get_world_size(group) != world or torch.distributed.get_rank(group) != rank:
            raise RuntimeError(SHARDS_NEED_ZERO3.format(
                name=name, why=f"is partitioned over {torch.distributed.get_world_size(group)} of the actor's "
                               f"{world} ranks"))
        yield name, shard, tuple(param.ds_shape)


def reassemble(flat, shape):
    """A parameter from its ZeRO-3 partitions laid end to end in rank order (`local_shards`)."""
    import math

    return flat[:math.prod(shape)].view(shape)


def send_weights(owner, named) -> None:
    """Send `(name, tensor)` pairs to `owner.vllm_engines` as one packed state dict from global
    rank 0 and wait until every engine has loaded it. Every rank iterates `named` (gathering a
    weight is a collective), then all meet at a barrier. `owner` holds `strategy` and
    `vllm_engines` (the DeepSpeed trainer or the Megatron actor)."""
    import ray
    import torch

    rank0 = torch.distributed.get_rank() == 0
    packed = []
    for name, tensor in named:
        if rank0:
            packed.append(pack_tensor(name, tensor))
    if rank0:
        ray.get(submit(owner, packed))
        if owner.strategy.args.vllm.enable_prefix_caching:
            ray.get([engine.reset_prefix_cache.remote() for engine in owner.vllm_engines])
        probe(owner)
    torch.distributed.barrier()


def submit(owner, packed: list) -> list:
    """Start every engine loading the packed state dict (`pack_tensor`'s items); their calls' refs."""
    payload = {"tag": PAYLOAD_TAG, "weights": packed}
    return [engine.update_weight.remote(payload, None, None, True) for engine in owner.vllm_engines]


def init_vllm_sync_group(self, backend: str) -> None:
    """Replacement for `ActorPPOTrainer._init_vllm_sync_group`: nothing to set up;
    weights travel through Ray (see module docstring)."""


def worker_update_weight(self, name, dtype=None, shape=None, empty_cache=False) -> None:
    """Replacement for `WorkerWrap.update_weight` (runs inside vLLM's worker)."""
    if not (isinstance(name, dict) and name.get("tag") == PAYLOAD_TAG):
        raise RuntimeError(
            "openrlhf_oppo CPU weight sync expects a packed state dict; the NCCL path of "
            "OpenRLHF's WorkerWrap.update_weight cannot run without CUDA"
        )
    weights = [unpack_tensor(item) for item in name["weights"]]
    self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


def worker_init_process_group(self, *args, **kwargs) -> None:
    """Replacement for `WorkerWrap.init_process_group`: no NCCL group on CPU."""


def probe(trainer) -> None:
    """With OPPO_SYNC_PROBE set: a greedy completion of the probe prompt on engine 0, recorded when
    it returns (asked once the weights are loaded, or while the engines stay paused until they are)."""
    path = run_env.path(run_env.SYNC_PROBE)
    if not path:
        return
    from vllm import SamplingParams

    prompt = run_env.sync_probe_prompt()
    params = SamplingParams(temperature=0.0, max_tokens=PROBE_MAX_TOKENS, logprobs=0, ignore_eos=True)
    ref = trainer.vllm_engines[0].generate.remote(prompt, params)
    # Partial rollout (OpenRLHF) and OPPO pause the engine around this sync and resume
    # it after we return: waiting here would deadlock, so the probe is recorded once
    # it completes. Probes queue in the engine in sync order.
    threading.Thread(target=_record_probe, args=(path, prompt, ref), daemon=True).start()


def _record_probe(path: str, prompt: list[int], ref) -> None:
    import ray

    completion = ray.get(ref).outputs[0]
    logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, completion.token_ids, strict=False)]
    done = sum(1 for _ in open(path)) if os.path.exists(path) else 0
    record = {"sync": done + 1, "prompt_token_ids": prompt, "token_ids": list(completion.token_ids),
              "logprobs": logprobs}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
