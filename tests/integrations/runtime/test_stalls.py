"""Stalls on the GPU path end the run within their bound (`--oppo.timeouts.*`, STYLE 28): an engine's weight
load, wake or poll that never returns, a landing that never ends, the actor group's sync that never returns,
a wake that cannot map its memory. Each is injected with fakes and small bounds; `within` runs the code
under test on a thread and fails the test, instead of hanging the suite, where a wait has no bound. The
ledger test shows that a stall leaves the ledger as a crash does: the resumed run trains every prompt group
exactly once."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from types import SimpleNamespace

import pytest
import ray

from openrlhf_oppo.config import TimeoutsConfig
from openrlhf_oppo.core import OverlapScheduler, ledger
from openrlhf_oppo.integrations.runtime.engine_pool import EnginePool
from openrlhf_oppo.integrations.runtime.generator import OppoSamplesGenerator
from openrlhf_oppo.integrations.runtime.ray_calls import Stalled
from openrlhf_oppo.integrations.runtime.reward_dispatch import REFERENCE, REWARD, ScorerDispatcher, Scorers
from openrlhf_oppo.integrations.runtime.step_meter import StepMeter
from openrlhf_oppo.integrations.runtime.step_mode import resolve_mode

BOUND_S = 0.3  # every bound of these tests
SLACK_S = 10.0  # what a bounded wait may take past its bound on a loaded machine; an unbounded one never ends
TIMEOUTS = TimeoutsConfig(weight_sync_s=BOUND_S, engine_call_s=BOUND_S)


def within(limit_s: float, fn):
    """Run `fn()` on a thread for `limit_s` seconds at most: (what it raised or None, seconds it took).
    Fails the test when it is still waiting then (the thread is left behind, a daemon)."""
    out: dict = {}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            out["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still waiting after {limit_s} s: the wait has no bound"
    return out.get("error"), time.monotonic() - start


class StallingCalls:
    """`FakeCalls` with time: `get` of a ref that never becomes ready waits `timeout_s` and raises Ray's
    `GetTimeoutError`, or with no timeout blocks for good, as `ray.get` does; `wait_any` likewise."""

    def __init__(self, fakes) -> None:
        self.inner = fakes.FakeCalls()
        self.never = threading.Event()

    def _wait(self, timeout_s: float | None) -> None:
        self.never.wait(timeout_s)

    def get(self, refs, timeout_s: float | None = None):
        pending = refs if isinstance(refs, list) else [refs]
        if not all(r.ready for r in pending):
            self._wait(timeout_s)
            raise ray.exceptions.GetTimeoutError(f"Get timed out: some object(s) not ready in {timeout_s} s")
        return self.inner.get(refs)

    def wait_any(self, refs: list, timeout_s: float | None = None) -> None:
        if not any(r.ready for r in refs):
            self._wait(timeout_s)

    def ready(self, refs: list) -> list:
        return [r for r in refs if r.ready]

    def kill(self, actor, *, no_restart: bool) -> None:
        self.inner.kill(actor, no_restart=no_restart)


def never(fakes):
    """A call that never returns (an engine blocked in an NCCL broadcast)."""
    return fakes.FakeRef(ready=False)


def engine_actor(fakes, **methods):
    base = dict(next_outputs=lambda *a: fakes.FakeRef([]), pause_generation=None, resume_generation=None,
                set_policy_version=None, reset_prefix_cache=None, wake_up=None)
    return fakes.make_actor(**{**base, **methods})


def stalled_message(error: BaseException | None, *parts: str) -> str:
    assert isinstance(error, Stalled), f"expected a Stalled error, got {error!r}"
    message = str(error)
    for part in parts:
        assert part in message
    assert "resume it from its last checkpoint with --ckpt.load_enable" in message
    return message


def test_a_background_weight_load_that_never_lands_ends_the_run_within_its_bound(fakes):
    pool = EnginePool([engine_actor(fakes), engine_actor(fakes)], StallingCalls(fakes), TIMEOUTS)
    pool.begin_step(4)
    pool.pause(keep_kv_cache=True)
    start = time.monotonic()
    pool.resume_when_loaded([fakes.FakeRef("loaded"), never(fakes)], policy_version=5, reset_prefix_cache=True)
    error, _ = within(SLACK_S, lambda: pool.pause(keep_kv_cache=True))  # the next sync's pause
    stalled_message(error, "OPPO step 4", "waited 0.3 s for the engines' weight loads (background sync)",
                    "--oppo.timeouts.weight_sync_s")
    assert time.monotonic() - start >= BOUND_S
    for engine in pool.engines:  # never resumed on half-loaded weights, nor paused again
        assert engine.resume_generation.calls == [] and engine.set_policy_version.calls == []
        assert len(engine.pause_generation.calls) == 1


def test_a_poll_meets_the_stalled_landing_and_ends_the_run(fakes):
    pool = EnginePool([engine_actor(fakes)], StallingCalls(fakes), TIMEOUTS)
    pool.pause(keep_kv_cache=True)
    pool.resume_when_loaded([never(fakes)], policy_version=1, reset_prefix_cache=False)

    def decode() -> None:
        while True:  # the generator's loop: the engines answer every poll, paused
            pool.poll(wake_tokens=4)

    error, _ = within(SLACK_S, decode)
    stalled_message(error, "the engines' weight loads (background sync)", "--oppo.timeouts.weight_sync_s")


def test_a_landing_stuck_past_its_own_waits_is_given_up_within_their_sum(fakes):
    """The landing's waits are bounded; should one not be (a call that ignores its timeout), the pause
    after it still ends, once the sum of their bounds has passed."""

    class DeafCalls(StallingCalls):
        def get(self, refs, timeout_s: float | None = None):
            if isinstance(refs, list) and refs and refs[0].value == "deaf":
                self.never.wait()
            return super().get(refs, timeout_s)

    pool = EnginePool([engine_actor(fakes)], DeafCalls(fakes), TIMEOUTS)
    pool.pause(keep_kv_cache=True)
    pool.resume_when_loaded([fakes.FakeRef("deaf")], policy_version=1, reset_prefix_cache=False)
    error, took = within(SLACK_S, pool.join_landing)
    bound = BOUND_S + 3 * BOUND_S + 1.0
    stalled_message(error, f"waited {bound:g} s for the landing of the engines' weight loads",
                    "--oppo.timeouts.weight_sync_s")
    assert took >= bound


def test_a_wake_that_never_returns_ends_the_run_naming_the_wake_and_is_not_retried(fakes):
    engines = [engine_actor(fakes), engine_actor(fakes, wake_up=lambda *a, **kw: never(fakes))]
    pool = EnginePool(engines, StallingCalls(fakes), TIMEOUTS)
    pool.begin_step(2)
    error, _ = within(SLACK_S, pool.wake)
    stalled_message(error, "waited 0.3 s for the engines' wake (weights, kv_cache) for the step's generation "
                           "in step 2", "--oppo.timeouts.engine_call_s")
    assert [len(e.wake_up.calls) for e in engines] == [1, 1]


def test_an_engine_that_stops_answering_polls_ends_the_run_naming_it(fakes):
    engines = [engine_actor(fakes, next_outputs=lambda *a: never(fakes)), engine_actor(fakes)]
    pool = EnginePool(engines, StallingCalls(fakes), TIMEOUTS)
    pool.begin_step(7)

    def decode() -> None:
        while True:  # engine 1 answers every poll: the loop would spin for good on engine 0's silence
            pool.poll(wake_tokens=4)

    error, took = within(SLACK_S, decode)
    stalled_message(error, "rollout engine(s) [0] to answer a poll (next_outputs, due within 1 s) in step 7",
                    "--oppo.timeouts.engine_call_s")
    assert took >= BOUND_S and len(engines[0].next_outputs.calls) == 1


# ------------------------------------------------------------------ a wake that cannot map its memory


def waking_pool(fakes, wake_errors: list[int], memory=((1.5 * 1024**3, 80 * 1024**3), None)):
    """Two engines whose wake fails `wake_errors[i]` times, then succeeds (as vLLM's CUDA out-of-memory
    error); `memory[i]`: engine i's (free, total) GPU bytes, None: not obtainable. Records the order of
    the wakes and the models' cache emptying in `events`."""
    events: list[str] = []

    def engine(i: int):
        failures = [wake_errors[i]]

        def wake_up(*args, **kwargs):
            events.append(f"wake {i} {kwargs.get('tags')}")
            if failures[0] > 0:
                failures[0] -= 1
                return fakes.FakeRef(error=RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:62"))
            return None

        return engine_actor(fakes, wake_up=wake_up, __ray_call__=lambda fn: memory[i])

    pool = EnginePool([engine(0), engine(1)], fakes.FakeCalls(), TIMEOUTS, gpu_memory_utilization=0.45)

    def empty_caches() -> list:
        events.append("empty caches")
        return [fakes.FakeRef(None), fakes.FakeRef(None)]  # the actor's and the critic's `empty_cache`

    pool.empty_caches = empty_caches
    return pool, events


def test_a_wake_that_fails_is_retried_once_after_the_models_beside_the_engines_empty_their_caches(fakes):
    pool, events = waking_pool(fakes, wake_errors=[1, 0])
    pool.wake(["weights"], phase="the weight sync")  # returns: the second try woke them
    assert events == ["wake 0 ['weights']", "wake 1 ['weights']", "empty caches",
                      "wake 0 ['weights']", "wake 1 ['weights']"]


def test_a_wake_that_fails_twice_ends_the_run_naming_the_phase_the_figures_and_the_flag(fakes):
    pool, events = waking_pool(fakes, wake_errors=[5, 5])
    pool.begin_step(3)
    with pytest.raises(RuntimeError) as caught:
        pool.wake(["weights"], phase="the weight sync")
    message = str(caught.value)
    assert message.startswith("OPPO step 3: the vLLM engines could not wake (weights) for the weight sync, twice, "
                              "the second time after the models beside them emptied their CUDA caches: "
                              "RuntimeError('CUDA Error: out of memory")
    assert "GPU memory now: engine 0: 1.5 of 80.0 GiB free; engine 1: free memory not obtainable." in message
    assert "vLLM takes --vllm.gpu_memory_utilization 0.45 of each GPU" in message
    assert "lower --vllm.gpu_memory_utilization" in message
    assert events.count("empty caches") == 1 and len(events) == 5  # one retry, no more


# ------------------------------------------------------------------ the driver's wait for the actor group


def test_an_actor_group_sync_that_never_returns_ends_the_run_without_another_call_to_the_engines(fakes):
    """OPPO's trainer: the engines wake their weights (--vllm.enable_sleep), the actor group's
    `broadcast_to_vllm` never returns (a rank blocked in the broadcast); the driver gives up within
    --oppo.timeouts.weight_sync_s and does not resume the engines, which may be blocked too."""
    from openrlhf_oppo.integrations.runtime.trainer import OppoPPOTrainerImpl

    woken = []
    engines = [engine_actor(fakes, wake_up=lambda *a, **kw: woken.append(kw.get("tags")))]
    calls: list[str] = []
    trainer = OppoPPOTrainerImpl.__new__(OppoPPOTrainerImpl)
    trainer.args = SimpleNamespace(vllm=SimpleNamespace(enable_sleep=True))
    trainer.actor_model_group = SimpleNamespace(async_run_method=lambda method_name: [never(fakes)])
    trainer.samples_generator = SimpleNamespace(
        mode=SimpleNamespace(background_sync=False),
        engines=EnginePool(engines, StallingCalls(fakes), TIMEOUTS),
        pause_for_weight_sync=lambda: calls.append("pause"),
        resume_after_weight_sync=lambda loads=None: calls.append("resume"),
    )
    error, took = within(SLACK_S, trainer.broadcast_to_vllm)
    stalled_message(error, "waited 0.3 s for the actor group's weight sync (broadcast_to_vllm: gather and send)",
                    "--oppo.timeouts.weight_sync_s")
    assert took >= BOUND_S and calls == ["pause"]
    assert woken == [["weights"]]  # the weights only, as OpenRLHF wakes them for the sync


# ------------------------------------------------------------------ the actor's wait for its last sender


@pytest.fixture
def one_rank(tmp_path):
    """torch.distributed with this process as the whole (gloo) group, as a one-GPU actor group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_next_sync_gives_up_on_a_sender_blocked_in_its_broadcast_within_its_bound(fakes, one_rank, monkeypatch):
    """The actor's `start_sync` waits for the last sync's sender thread; one blocked in a broadcast that an
    engine never receives cannot be freed, so the sync ends the run within --oppo.timeouts.weight_sync_s."""
    from openrlhf_oppo import config as oppo_config
    from openrlhf_oppo import run_env
    from openrlhf_oppo.integrations.runtime import background_sync

    cfg = oppo_config.from_dict({"timeouts": {"weight_sync_s": BOUND_S}})
    monkeypatch.setenv(run_env.CONFIG_JSON, json.dumps(oppo_config.to_dict(cfg)))
    blocked = threading.Event()
    sender = threading.Thread(target=blocked.wait, name="oppo-weight-send", daemon=True)  # the NCCL broadcast
    sender.start()
    trainer = SimpleNamespace(_oppo_send_thread=sender)
    error, took = within(SLACK_S, lambda: background_sync.start_sync(trainer))
    blocked.set()
    stalled_message(error, "waited 0.3 s for the last background weight sync's sender thread on actor rank 0 "
                           "(its broadcast to the engines)", "--oppo.timeouts.weight_sync_s")
    assert took >= BOUND_S


# ------------------------------------------------------------------ the ledger after a stall

B, N = 2, 2
PROMPTS = [f"p{i}" for i in range(6)]  # one pass
GENERATE_KWARGS = {"max_new_tokens": 8, "max_len": 64}


class DecodingEngine:
    """One rollout engine as the pool calls it: each `next_outputs` decodes one token of every started sample
    (token 10 * sample id + position) unless paused; a sample finishes at `length(sample id)` tokens."""

    def __init__(self, fakes, length) -> None:
        self.fakes = fakes
        self.length = length
        self.decoding: dict[int, int] = {}
        self.version = 0
        self.paused = False
        self.start_samples = fakes.FakeMethod(self._start)
        self.next_outputs = fakes.FakeMethod(self._next)
        self.pause_generation = fakes.FakeMethod(lambda keep: self._pause(True))
        self.resume_generation = fakes.FakeMethod(lambda: self._pause(False))
        self.set_policy_version = fakes.FakeMethod(self._version)
        self.reset_prefix_cache = fakes.FakeMethod()

    def _start(self, requests, params) -> None:
        for req in requests:
            self.decoding[req.sample_id] = len(req.held_ids)

    def _next(self, timeout_s, wake_tokens) -> list:
        if self.paused:
            return []
        deltas = []
        for sid, pos in list(self.decoding.items()):
            done = pos + 1 == self.length(sid)
            if done:
                del self.decoding[sid]
            else:
                self.decoding[sid] = pos + 1
            deltas.append(self.fakes.make_delta(sid, [10 * sid + pos], self.version, "stop" if done else None))
        return deltas

    def _pause(self, paused: bool) -> None:
        self.paused = paused

    def _version(self, version: int) -> None:
        self.version = version


class Loader(list):
    """OpenRLHF's prompt dataloader holding the rest of a pass of `per_pass` prompts."""

    def __init__(self, prompts, per_pass: int) -> None:
        super().__init__((None, [p], [f"label {p}"], [None]) for p in prompts)
        self.per_pass = per_pass

    def __len__(self) -> int:
        return self.per_pass


class Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool):
        return {"input_ids": [ord(c) for c in text]}


def make_generator(fakes, prompts, ledger_path: str) -> OppoSamplesGenerator:
    """Async admission (lag 2) with the background sync, OpenRLHF's reward forward (nothing streamed), one
    real `EnginePool` over a `DecodingEngine` with the stall tests' bounds; group 1 (samples 2, 3) needs 3
    tokens, every other sample 2."""
    args = fakes.make_args(B=B, n=N)
    config = fakes.make_config(delta=1, chunk=2, stream=False, max_lag=2)
    staleness = dataclasses.replace(config.staleness, background_sync=True)
    mode = resolve_mode(staleness, args, cpu_host=False)
    staleness = dataclasses.replace(staleness, carried_in_training=mode.carried.value,
                                    keep_kv_cache=mode.keep_kv_cache)
    config = dataclasses.replace(config, staleness=staleness, timeouts=TIMEOUTS)
    scheduler = OverlapScheduler(config, batch_groups=B, samples_per_group=N, scorers=())
    meter = StepMeter(0, show_progress=False)
    engine = DecodingEngine(fakes, lambda sid: 3 if sid in (2, 3) else 2)
    gen = OppoSamplesGenerator(
        SimpleNamespace(args=args), Loader(prompts, len(PROMPTS)), None, Tokenizer(), [], oppo=config, mode=mode,
        scheduler=scheduler, engines=EnginePool([engine], StallingCalls(fakes), config.timeouts), meter=meter,
        scorers=Scorers(ScorerDispatcher([], scheduler, meter, None, None, name=REWARD),
                        ScorerDispatcher([], scheduler, meter, None, None, name=REFERENCE)),
    )
    gen.ledger.path = ledger_path
    return gen


def train_step(gen: OppoSamplesGenerator, loads: list) -> bool:
    """One step as OPPO's trainer runs it with the background sync: the batch, the sync's pause, the engines'
    `loads` handed to the pool, the step closed. Whether the batch ended the pass."""
    _, _, _, exhausted = gen.generate_samples(**GENERATE_KWARGS)
    gen.pause_for_weight_sync()
    gen.resume_after_weight_sync(loads)
    gen.finish_step(0.0)
    return exhausted


def test_a_stalled_sync_ends_the_run_as_a_crash_would_and_the_resume_trains_every_group_once(fakes, tmp_path):
    path = str(tmp_path / ledger.LEDGER_FILE)
    first = make_generator(fakes, PROMPTS, path)
    train_step(first, [fakes.FakeRef("loaded")])
    checkpoint = json.loads(json.dumps(first.state_dict()))  # OpenRLHF's checkpoint after step 0
    first.ledger_checkpoint()
    resume_at = first.scheduler.next_prompt_index
    train_step(first, [never(fakes)])  # step 1's weights never land on the engines

    def step_2() -> None:
        first.generate_samples(**GENERATE_KWARGS)
        first.pause_for_weight_sync()

    error, _ = within(SLACK_S, step_2)
    stalled_message(error, "the engines' weight loads (background sync)", "--oppo.timeouts.weight_sync_s")
    assert [e["step"] for e in ledger.read_events(path) if e["event"] == "step"] == [0, 1]  # step 2 never ended

    resumed = make_generator(fakes, PROMPTS[resume_at:], path)  # a new run: fresh engines, the dataloader restored
    resumed.load_state_dict(checkpoint)
    resumed.resume_after_weight_sync()  # the checkpoint's weights
    exhausted = False
    while not exhausted:
        exhausted = train_step(resumed, [fakes.FakeRef("loaded")])
    report = ledger.check_run(tmp_path)
    assert report.ok, report.summary()
    assert (report.restarts, report.rolled_back_steps) == (1, 1)  # step 1 left the lineage with its weights
    assert report.admitted == report.trained == len(PROMPTS) and report.held == 0
