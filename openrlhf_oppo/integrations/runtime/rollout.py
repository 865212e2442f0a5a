"""Streaming rollout actor: OpenRLHF's vLLM `RolloutRayActor` that keeps vLLM's
partial outputs instead of discarding them.

Written against OpenRLHF 0.11.2 (`openrlhf.trainer.ray.vllm_engine.RolloutRayActor`)
and vLLM 0.29.0 (`AsyncLLM.generate` with `RequestOutputKind.DELTA`).

With `--reward.remote_url` (a `.py` reward function or an HTTP endpoint) a finished
sample is scored right here, through OpenRLHF's own `SingleTurnAgentExecutor` reward
code, before its last delta is handed over: scoring runs while other samples decode.

Requests run as asyncio tasks inside the actor and outlive the call that started
them, so a carried sample keeps decoding while the trainer trains; every delta
(new token ids, their logprobs, the policy version that produced them, and the
finish reason at the end) lands in an outbox that the OPPO samples generator
drains with `next_outputs`, merged per sample and version (`deltas.merge_deltas`).
Chunking and routing to the scorers are decided by the scheduler core on the generator's side.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from copy import deepcopy

import ray
from openrlhf.trainer.ray import vllm_engine as _vllm_engine

from openrlhf_oppo import timeline
from openrlhf_oppo.integrations.runtime import worker_ext
from openrlhf_oppo.integrations.runtime.deltas import Outbox, SampleDelta, SampleRequest
from openrlhf_oppo.integrations.runtime.run_config import config_or_none
from openrlhf_oppo.upstream import unwrap_ray_actor

_BASE = unwrap_ray_actor(_vllm_engine.RolloutRayActor)
__all__ = ["OppoRolloutActor", "OppoRolloutRayActor", "SampleDelta", "SampleRequest"]


def rollout_old_logprobs() -> bool:
    """The run's config (in the environment) takes old log-probs from the rollout (`--oppo.train.old_logprobs`)."""
    config = config_or_none()
    return config is not None and config.train.old_logprobs == "rollout"


class OppoRolloutActor(_BASE):
    """`RolloutRayActor` plus streaming starts, an outbox and a policy-version counter."""

    async def __init__(self, *args, **kwargs):
        if kwargs.get("worker_extension_cls") == worker_ext.OPENRLHF_WORKER:  # plus a sharded sync's receiver
            kwargs["worker_extension_cls"] = worker_ext.OPPO_WORKER
        if not kwargs.get("logprobs_mode") and rollout_old_logprobs():
            # old log-probs from the rollout (`old_logprobs`): the temperature-scaled distribution's, as
            # OpenRLHF asks for them when its importance-sampling correction reads them
            kwargs.update(logprobs_mode="processed_logprobs", max_logprobs=1)
        await super().__init__(*args, **kwargs)
        self._shards: dict[int, list] = {}  # a CPU sharded sync's partitions by actor rank, until all came
        self._outbox = Outbox()
        self._tasks: dict[int, asyncio.Task] = {}
        self._request_ids: dict[int, str] = {}  # sample id -> its vLLM request while it decodes
        self._policy_version = 0
        self._reward_tokenizer = None  # the trainer's tokenizer: reward queries are decoded with it, as OpenRLHF does

    async def pause_generation(self, keep_kv_cache: bool = False) -> None:
        """OpenRLHF's pause (mode "keep": requests stay queued), optionally keeping their
        KV cache: vLLM 0.29 otherwise clears it and re-prefills every carried request."""
        with timeline.RECORDER.timed("rollout", "pause"):
            await self.llm.pause_generation(mode="keep", clear_cache=not keep_kv_cache)

    async def abort_one(self) -> int | None:
        """Abort one request still decoding, as vLLM aborts a request (crash injection,
        `integrations.runtime.faults`); its sample id, or None when none decodes."""
        for sid, rid in list(self._request_ids.items()):
            await self.llm.abort(rid)
            return sid
        return None

    async def park(self) -> list[int]:
        """Stop every request where it is (before the engine sleeps, `--vllm.enable_sleep`):
        each is aborted and its task ends with a last "abort" delta holding every token it
        decoded; the generator records them and decodes the sample on from its tokens
        after the wake. Returns the sample ids stopped."""
        stopped: set[int] = set()
        with timeline.RECORDER.timed("rollout", "park"):
            while self._tasks:  # a task started a moment ago may not have its vLLM request yet
                stopped.update(self._tasks)
                if self._request_ids:
                    await self.llm.abort(list(self._request_ids.values()))
                await asyncio.wait(list(self._tasks.values()), timeout=0.05)
        return sorted(stopped)

    def set_reward_tokenizer(self, tokenizer) -> None:
        self._reward_tokenizer = tokenizer

    async def receive_weights(self, metas: list[tuple]) -> None:
        """The engine side of a background weight sync on GPUs (`background_sync.NcclSender`): each
        (name, dtype, shape) in order through vLLM's worker `update_weight`, as OpenRLHF's
        `update_weight` receives one parameter, in one call instead of a Ray round trip each."""
        for i, (name, dtype, shape) in enumerate(metas):
            await self.llm.collective_rpc("update_weight", args=(name, dtype, shape, i == len(metas) - 1))

    async def receive_shards(self, metas: list[tuple], senders: int) -> None:
        """The engine side of a sharded background sync on GPUs (`background_sync.NcclShardSender`): its
        workers receive each parameter's partitions from the actor's `senders` ranks and load it."""
        await self.llm.collective_rpc("receive_shards", args=(metas, senders))

    async def load_shards(self, rank: int, senders: int, shapes: list[tuple], packed: list) -> None:
        """The engine side of a sharded background sync on CPU (`background_sync.CpuShardSender`): rank
        `rank`'s packed partitions; the call that brings the last of `senders` ranks' reassembles every
        parameter and loads them through the CPU sync's `update_weight` (the engine stays paused until
        every rank's call returns)."""
        import torch

        from openrlhf_oppo.compat import weight_sync

        self._shards[rank] = packed
        if len(self._shards) < senders:
            return
        shards, self._shards = self._shards, {}
        weights = []
        for i, shape in enumerate(shapes):
            name = shards[0][i][0]
            flat = torch.cat([weight_sync.unpack_tensor(shards[r][i])[1] for r in range(senders)])
            weights.append(weight_sync.pack_tensor(name, weight_sync.reassemble(flat, shape)))
        payload = {"tag": weight_sync.PAYLOAD_TAG, "weights": weights}
        await self.llm.collective_rpc("update_weight", args=(payload, None, None, True))

    def set_policy_version(self, version: int) -> None:
        """Called while generation is paused for a weight sync: later tokens carry `version`."""
        self._policy_version = version

    async def start_samples(self, requests: list[SampleRequest], sampling_params) -> None:
        from vllm.sampling_params import RequestOutputKind

        for req in requests:
            if req.sample_id in self._tasks:
                raise ValueError(f"sample {req.sample_id} is already decoding on this engine")
            if req.reward_query is not None and self._reward_tokenizer is None:
                raise ValueError("set_reward_tokenizer must be called before samples scored by --reward.remote_url")
            params = deepcopy(sampling_params)
            params.output_kind = RequestOutputKind.DELTA
            params.max_tokens = req.max_tokens - len(req.held_ids)
            if req.exact:
                params.min_tokens = max(0, params.max_tokens)
            params.seed = req.seed
            self._tasks[req.sample_id] = asyncio.create_task(self._decode(req, params))

    async def _decode(self, req: SampleRequest, params) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        sid = req.sample_id
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_ids) + list(req.held_ids))
        finish_reason = "abort"
        error = None
        response = list(req.held_ids) if req.reward_query is not None else None  # kept only to be scored
        last = None  # the finishing delta (token ids, logprobs, policy version), pushed once its reward is known
        opened = timeline.RECORDER.open_sample("rollout")
        decoded = 0
        self._outbox.begin(sid, len(req.held_ids))
        try:
            if params.max_tokens <= 0:  # its budget was used up before a restart: finished as it is
                finish_reason = "length"
                last = (array("i"), array("d") if params.logprobs else None, self._policy_version)
            else:
                rid = self._request_ids[sid] = f"oppo-{sid}-{random_uuid()}"
                async for out in self.llm.generate(prompt, params, request_id=rid):
                    comp = out.outputs[0]
                    logprobs = None
                    if params.logprobs is not None and comp.logprobs is not None:
                        pairs = zip(comp.token_ids, comp.logprobs)
                        logprobs = array("d", [d[t].logprob if t in d else 0.0 for t, d in pairs])
                    decoded += len(comp.token_ids)
                    if response is not None:
                        response += comp.token_ids
                    if not out.finished:
                        self._push(SampleDelta(sid, array("i", comp.token_ids), logprobs, self._policy_version, None,
                                               time.time()))
                        continue
                    reason = comp.finish_reason
                    finish_reason = reason if reason in ("length", "abort") else "stop"
                    last = (array("i", comp.token_ids), logprobs, self._policy_version)
                    break
            if last is None:  # the stream ended without a finished output
                finish_reason = "abort"
                last = (array("i"), None, self._policy_version)
            reward = None
            if response is not None and finish_reason != "abort":
                reward, error = await self._reward(req, response)
            self._push(SampleDelta(sid, last[0], last[1], last[2], finish_reason, time.time(), reward, error))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surface engine failures to the generator, do not lose the sample silently
            self._push(SampleDelta(sid, array("i"), None, self._policy_version, "abort", time.time(), error=repr(exc)))
            raise RuntimeError(f"OPPO rollout: sample {sid} failed: {exc!r}") from exc
        finally:
            self._tasks.pop(sid, None)
            self._request_ids.pop(sid, None)
            timeline.RECORDER.sample("rollout", opened, decoded, finish_reason, sample=sid, held=len(req.held_ids))

    async def _reward(self, req: SampleRequest, tokens: list[int]) -> tuple[dict | None, str | None]:
        """The sample's reward from --reward.remote_url, as OpenRLHF's `SingleTurnAgentExecutor.execute`
        gets it (query = prompt + response decoded with special tokens; a `.py` reward_func or HTTP)."""
        prompt, label = req.reward_query
        query = self._reward_tokenizer.decode(list(req.prompt_ids) + tokens, skip_special_tokens=False)
        executor = self.executor
        try:
            if executor.reward_func:
                infos = await executor._fetch_rewards_via_func([query], [prompt], [label])
            else:
                infos = await executor._fetch_rewards_via_http([query], [prompt], [label])
            info = infos[0] if infos else None
            if not info:
                return None, f"{executor.reward_endpoints[0]} returned nothing"
            reward = _scalar(info.get("rewards"))
            scores = info.get("scores")
            return {"reward": reward, "scores": reward if scores is None else _scalar(scores),
                    "extra_logs": {k: _scalar(v) for k, v in (info.get("extra_logs") or {}).items()}}, None
        except Exception as exc:  # named with the sample by the generator
            return None, f"{executor.reward_endpoints[0]}: {exc!r}"

    def _push(self, delta: SampleDelta) -> None:
        self._outbox.push(delta)

    async def next_outputs(self, timeout_s: float, wake_tokens: int = 1) -> list[SampleDelta]:
        """Drain the outbox once something in it is worth a round trip: a sample finished
        or has `wake_tokens` unsent tokens (the chunk size when streaming; a large value
        when only finished samples matter), or `timeout_s` passed. Waking per token
        would cost a driver round trip and a pickle per token. One delta per sample and
        policy version, not one per vLLM step."""
        return await self._outbox.drain(timeout_s, wake_tokens)


def _scalar(value) -> float:
    """A reward function's value (a float, or a one-element tensor / list) as a float."""
    if hasattr(value, "reshape"):
        value = value.reshape(-1)[0]
    elif isinstance(value, (list, tuple)):
        value = value[0]
    return float(value)


OppoRolloutRayActor = ray.remote(OppoRolloutActor)
