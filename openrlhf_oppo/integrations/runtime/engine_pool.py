"""OpenRLHF's rollout engines (`OppoRolloutActor`s) as one pool: where each group decodes,
starting and resuming its samples, polling their deltas, aborted requests, the pause
around a weight sync, sleep and wake (`--vllm.enable_sleep`), and the engine-side fault
injection.

Every wait on an engine is bounded (`--oppo.timeouts.*`): a call past its bound ends the
run with `ray_calls.Stalled`, naming what was waited for, as a dead engine does. A wake that
fails is tried once more after the CUDA caches of the models beside the engines are emptied
(vLLM's own wake empties the engine's first), then ends the run naming the memory figures."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from openrlhf_oppo import timeline
from openrlhf_oppo.config import TimeoutsConfig
from openrlhf_oppo.integrations.runtime import faults
from openrlhf_oppo.integrations.runtime.deltas import SampleDelta, SampleRequest
from openrlhf_oppo.integrations.runtime.log import get_logger
from openrlhf_oppo.integrations.runtime.ray_calls import (
    ENGINE_CALL_FLAG,
    WEIGHT_SYNC_FLAG,
    RayCalls,
    Stalled,
    bounded_get,
    stalled,
)

logger = get_logger(__name__)

POLL_S = 1.0  # an engine answers `next_outputs` when it has a chunk or a finished sample, or after this long
ABORT_RETRIES = 3  # an engine aborting one sample more often than this fails the step
GIB = 1024**3
MEMORY_FLAG = "--vllm.gpu_memory_utilization"


def gpu_memory(_actor=None) -> tuple[int, int] | None:
    """(free, total) bytes of the one GPU this process is given, read through NVML (no CUDA context is
    made: the GPU is short of memory already); None where the process sees no single GPU by index (an
    engine with --vllm.tensor_parallel_size > 1 leaves its GPUs to its workers). Run in an engine's
    process through Ray's `__ray_call__`."""
    import os

    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if len(visible) != 1 or not visible[0].isdigit():
        return None
    from vllm.utils.import_utils import import_pynvml

    pynvml = import_pynvml()
    pynvml.nvmlInit()
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(visible[0])))
        return int(info.free), int(info.total)
    finally:
        pynvml.nvmlShutdown()


def _no_models() -> list:
    """No model shares the engines' GPUs: nothing to empty before a wake is retried."""
    return []


class EnginePool:
    """A group stays on one engine (as OpenRLHF places a prompt's n samples); one
    `next_outputs` call per engine is in flight at a time, and it outlives a step."""

    def __init__(self, engines: list, calls: RayCalls | None = None, timeouts: TimeoutsConfig | None = None,
                 gpu_memory_utilization: float | None = None) -> None:
        """`timeouts` bound every wait on the engines (`--oppo.timeouts.*`); `gpu_memory_utilization`
        (`--vllm.gpu_memory_utilization`) is named when a wake cannot map its memory."""
        self.engines = list(engines)
        self.calls = calls if calls is not None else RayCalls()
        self.timeouts = timeouts if timeouts is not None else TimeoutsConfig()
        self.gpu_memory_utilization = gpu_memory_utilization
        # calls that empty the CUDA caches of the models sharing the engines' GPUs (set by the trainer)
        self.empty_caches: Callable[[], list] = _no_models
        self.engine_of: dict[int, int] = {}  # group id -> engine decoding its samples
        self.polls: dict[int, Any] = {}  # engine index -> its `next_outputs` call in flight
        self.polled_at: dict[int, float] = {}  # engine index -> when its call in flight was made (monotonic)
        self.aborts: dict[int, int] = {}  # sample id -> times its engine aborted it (restarted from its tokens)
        self.step = 0  # the step under way (fault injection, error messages)
        self.aborted_this_step = 0  # aborted requests restarted this step
        self.replies_this_step = 0  # engine replies this step (crash injection counts them)
        self.paused = False  # paused for the weight sync under way
        self.paused_at = 0.0  # when the engines paused
        self.paused_s = 0.0  # seconds paused since `take_paused_s`
        self.landing: threading.Thread | None = None  # background sync: waits for the loads, then resumes
        self.landing_error: BaseException | None = None

    def set_reward_tokenizer(self, tokenizer) -> None:
        """With `--reward.remote_url` the engines decode the query text as OpenRLHF's executor does."""
        self._get([e.set_reward_tokenizer.remote(tokenizer) for e in self.engines], "the engines' reward tokenizer")

    def begin_step(self, step: int) -> None:
        self.step = step
        self.aborted_this_step = self.replies_this_step = 0

    # ------------------------------------------------------------------ placement and starts

    def place(self, group_id: int) -> int:
        """Put a whole group on the engine decoding the fewest groups (the lowest index on a tie)."""
        load = [0] * len(self.engines)
        for idx in self.engine_of.values():
            load[idx] += 1
        idx = self.engine_of[group_id] = min(range(len(load)), key=load.__getitem__)
        return idx

    def release(self, group_id: int, sample_ids: list[int]) -> None:
        """A trained group: nothing of it decodes again."""
        self.engine_of.pop(group_id, None)
        for sid in sample_ids:
            self.aborts.pop(sid, None)

    def start(self, requests: list[tuple[int, SampleRequest]], params) -> None:
        """Start (group id, request) pairs on their groups' engines, one call per engine."""
        per_engine: dict[int, list[SampleRequest]] = {}
        for gid, req in requests:
            per_engine.setdefault(self.engine_of[gid], []).append(req)
        if per_engine:
            self._get([self.engines[i].start_samples.remote(reqs, params) for i, reqs in per_engine.items()],
                      "the engines' start of new requests")

    def restart_aborted(self, aborted: list[tuple[SampleDelta, int, SampleRequest]], params) -> None:
        """An aborted request (an engine-side failure) decodes on from the tokens it had, on
        its group's engine; a sample aborted `ABORT_RETRIES` times fails the step.
        `aborted`: (its last delta, group id, the request resuming it)."""
        per_engine: dict[int, list[SampleRequest]] = {}
        for d, gid, req in aborted:
            sid = d.sample_id
            self.aborts[sid] = self.aborts.get(sid, 0) + 1
            if self.aborts[sid] > ABORT_RETRIES:
                raise RuntimeError(f"OPPO step {self.step}: sample {sid} was aborted by its engine "
                                   f"{self.aborts[sid]} times; last error: {d.error}")
            per_engine.setdefault(self.engine_of[gid], []).append(req)
            logger.warning("OPPO: sample %d aborted by its engine (%s); decoding on from its %d tokens",
                           sid, d.error, len(req.held_ids))
        self.aborted_this_step += len(aborted)
        if per_engine:
            self._get([self.engines[i].start_samples.remote(reqs, params) for i, reqs in per_engine.items()],
                      "the engines' restart of aborted requests")

    # ------------------------------------------------------------------ polling

    def poll(self, wake_tokens: int, also: list = ()) -> list[SampleDelta]:
        """Sleep until an engine has output or one of `also` (reward calls) is done, whichever
        is first; the deltas of every engine that answered, engine by engine. An engine answers
        within `POLL_S`: one that has not for `--oppo.timeouts.engine_call_s` ends the run."""
        self._raise_landing_error()
        for idx, engine in enumerate(self.engines):
            if idx not in self.polls:
                self.polls[idx] = engine.next_outputs.remote(POLL_S, wake_tokens)
                self.polled_at[idx] = time.monotonic()
        bound = self.timeouts.engine_call_s
        left = bound - (time.monotonic() - min(self.polled_at.values(), default=time.monotonic()))
        self.calls.wait_any([*self.polls.values(), *also], timeout_s=max(left, 0.0))
        done = set(self.calls.ready(list(self.polls.values())))
        now = time.monotonic()
        silent = [idx for idx, ref in self.polls.items() if ref not in done and now - self.polled_at[idx] >= bound]
        if silent:
            raise stalled(f"rollout engine(s) {silent} to answer a poll (next_outputs, due within {POLL_S:g} s) "
                          f"in step {self.step}", bound, ENGINE_CALL_FLAG)
        deltas: list[SampleDelta] = []
        for idx, ref in list(self.polls.items()):
            if ref in done:
                del self.polls[idx]
                del self.polled_at[idx]
                deltas += self._reply(idx, ref)
        return deltas

    def _reply(self, idx: int, ref) -> list[SampleDelta]:
        """An engine's `next_outputs`. A dead engine stops the run: a new one would hold the
        initial weights and no weight-sync group, so the run resumes from its last checkpoint
        instead (`--ckpt.load_enable`; `openrlhf-oppo train --restarts N` relaunches it),
        where the samples carried at that checkpoint decode on from their recorded tokens."""
        try:
            outputs = self.calls.get(ref)  # ready: no wait
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(
                f"OPPO: rollout engine {idx} died in step {self.step} ({type(exc).__name__}). Resume from the last "
                f"checkpoint with --ckpt.load_enable (openrlhf-oppo train --restarts N does it): carried samples "
                f"decode on from their recorded tokens"
            ) from exc
        self.replies_this_step += 1
        if faults.due("rollout", self.step, self.replies_this_step):
            self.calls.kill(self.engines[idx], no_restart=True)
        if faults.due("abort", self.step, self.replies_this_step):
            logger.warning("OPPO fault injection: engine %d aborted sample %s", idx,
                           self._get(self.engines[idx].abort_one.remote(), f"engine {idx}'s abort"))
        return outputs

    # ------------------------------------------------------------------ sleep mode

    def park(self) -> None:
        """Stop every request where it is; their last ("abort") deltas wait in the outboxes."""
        self._get([e.park.remote() for e in self.engines], "the engines' park (requests stopped for the sleep)")

    def sleep(self) -> None:
        """OpenRLHF's `RolloutRayActor.sleep`: vLLM frees its KV cache and offloads its weights."""
        with timeline.RECORDER.timed("driver", "sleep"):
            self._get([e.sleep.remote() for e in self.engines], "the engines' sleep")

    def wake(self, tags: list[str] | None = None, phase: str = "the step's generation", span: bool = True) -> None:
        """OpenRLHF's `RolloutRayActor.wake_up`: weights and KV cache back on the device (`tags`, e.g.
        ["weights"]: those only), before `phase` (named in the error). A wake that fails (vLLM cannot map
        its memory: nothing in vLLM retries it) is tried once more after the models sharing the engines'
        GPUs empty their CUDA caches (vLLM's wake empties the engine's own first, and maps only what is
        still asleep); a second failure ends the run naming the phase, the engines' free memory and
        --vllm.gpu_memory_utilization. A stalled or dead engine is not retried. `span`: the wake is
        the timeline's driver span "wake" (False: a part of the caller's span, as in the weight sync)."""
        with timeline.RECORDER.timed("driver", "wake") if span else contextlib.nullcontext():
            for attempt in (1, 2):
                try:
                    self._wake_up(tags, phase)
                    return
                except (Stalled, ray.exceptions.RayActorError):
                    raise
                except Exception as error:
                    if attempt == 2:
                        raise RuntimeError(self._wake_failed(tags, phase, error)) from error
                    logger.warning("OPPO: the vLLM engines could not wake for %s (%r); emptying the CUDA caches "
                                   "of the models beside them and trying once more", phase, error)
                    self._get(self.empty_caches(), "the models' CUDA caches to empty (before a wake is retried)")

    def _wake_up(self, tags: list[str] | None, phase: str) -> None:
        refs = [e.wake_up.remote(tags=tags) for e in self.engines]  # OpenRLHF's: None wakes everything
        self._get(refs, f"the engines' wake ({', '.join(tags or ['weights', 'kv_cache'])}) for {phase}")

    def _wake_failed(self, tags: list[str] | None, phase: str, error: BaseException) -> str:
        """What a wake that failed twice says: the phase, the figures, the flag to change."""
        woken = ", ".join(tags or ["weights", "kv_cache"])
        figures = []
        for idx, memory in enumerate(self._engine_memory()):
            if memory is None:
                figures.append(f"engine {idx}: free memory not obtainable")
            else:
                free, total = memory
                figures.append(f"engine {idx}: {free / GIB:.1f} of {total / GIB:.1f} GiB free")
        if self.gpu_memory_utilization is None:
            share = f"vLLM takes {MEMORY_FLAG} of each GPU it runs on"
        else:
            share = f"vLLM takes {MEMORY_FLAG} {self.gpu_memory_utilization:g} of each GPU it runs on"
        return (f"OPPO step {self.step}: the vLLM engines could not wake ({woken}) for {phase}, twice, the second "
                f"time after the models beside them emptied their CUDA caches: {error!r}. GPU memory now: "
                f"{'; '.join(figures)}. {share} (weights and KV cache): lower {MEMORY_FLAG} so that the engines "
                f"fit beside the models sharing their GPUs (`openrlhf-oppo train --dry-run` shows the memory per "
                f"phase), or give vLLM GPUs of its own")

    def _engine_memory(self) -> list[tuple[int, int] | None]:
        """Each engine's (free, total) GPU bytes as its process sees them (`gpu_memory`); None where not
        obtainable (no single GPU, no answer within --oppo.timeouts.engine_call_s, an error)."""
        out: list[tuple[int, int] | None] = []
        for engine in self.engines:
            try:
                ref = engine.__ray_call__.remote(gpu_memory)
                out.append(self.calls.get(ref, timeout_s=self.timeouts.engine_call_s))
            except Exception:
                out.append(None)
        return out

    # ------------------------------------------------------------------ around a weight sync

    def pause(self, keep_kv_cache: bool) -> None:
        """Pause decoding, requests kept (and their KV cache with `keep_kv_cache`); after the last
        background sync's loads (`join_landing`)."""
        self.join_landing()
        self.paused = True
        self.paused_at = time.time()
        with timeline.RECORDER.timed("driver", "pause"):
            self._get([e.pause_generation.remote(keep_kv_cache) for e in self.engines], "the engines' pause")

    def resume(self, policy_version: int) -> None:
        """Tokens from here on are `policy_version`'s; decoding resumes if it was paused."""
        with timeline.RECORDER.timed("driver", "resume") if self.paused else contextlib.nullcontext():
            self._resume(policy_version)

    def _resume(self, policy_version: int) -> None:
        self._get([e.set_policy_version.remote(policy_version) for e in self.engines], "the engines' policy version")
        if self.paused:
            # OpenRLHF's `RolloutRayActor`'s
            self._get([e.resume_generation.remote() for e in self.engines], "the engines' resume")
            self.paused = False
            self.paused_s += time.time() - self.paused_at

    def take_paused_s(self) -> float:
        """Seconds the engines sat paused for weight syncs that ended since the last call (a background
        sync's pause ends when its loads land, often in the next step)."""
        paused_s, self.paused_s = self.paused_s, 0.0
        return paused_s

    def resume_when_loaded(self, loads: list, policy_version: int, reset_prefix_cache: bool) -> None:
        """Background weight sync: the engines stay paused until `loads` (their weight loads, Ray
        refs) finish; then a thread resets their prefix caches (`reset_prefix_cache`) and resumes
        them with `policy_version`. The caller goes on meanwhile. The loads are bounded by
        --oppo.timeouts.weight_sync_s, the calls after them by --oppo.timeouts.engine_call_s."""
        self.join_landing()

        def land() -> None:
            try:
                with timeline.RECORDER.timed("sync", "landing"):  # beside the driver's own spans
                    self.wait_weight_sync(loads, "the engines' weight loads (background sync)")
                    if reset_prefix_cache:
                        self._get([e.reset_prefix_cache.remote() for e in self.engines],
                                  "the engines' prefix cache reset")
                    self._resume(policy_version)
            except BaseException as exc:  # raised in the caller's thread by the next poll or pause
                self.landing_error = exc

        self.landing = threading.Thread(target=land, name="oppo-weight-landing", daemon=True)
        self.landing.start()

    def join_landing(self) -> None:
        """Wait for the last background sync's loads and resume (RuntimeError if they failed); the
        landing's own waits are bounded, and so is this one, by their sum and a second."""
        if self.landing is not None:
            bound = self.timeouts.weight_sync_s + 3 * self.timeouts.engine_call_s + 1.0
            self.landing.join(bound)
            if self.landing.is_alive():
                raise stalled(f"the landing of the engines' weight loads (background sync) in step {self.step}",
                              bound, WEIGHT_SYNC_FLAG)
            self.landing = None
        self._raise_landing_error()

    def _raise_landing_error(self) -> None:
        if self.landing_error is not None:
            exc, self.landing_error = self.landing_error, None
            if isinstance(exc, Stalled):
                raise Stalled(f"OPPO step {self.step}: {exc}") from exc
            raise RuntimeError(f"OPPO step {self.step}: the engines' weight load (background sync) failed: "
                               f"{exc!r}") from exc

    # ------------------------------------------------------------------ bounded waits

    def wait_weight_sync(self, refs: Any, what: str) -> Any:
        """`refs` of a weight sync, within --oppo.timeouts.weight_sync_s (`Stalled` naming `what` past it)."""
        return bounded_get(self.calls, refs, self.timeouts.weight_sync_s, what, WEIGHT_SYNC_FLAG)

    def _get(self, refs: Any, what: str) -> Any:
        """`refs` of a call to the engines, within --oppo.timeouts.engine_call_s."""
        return bounded_get(self.calls, refs, self.timeouts.engine_call_s, f"{what} in step {self.step}",
                           ENGINE_CALL_FLAG)
