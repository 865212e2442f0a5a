"""How the samples generator runs a step: the run's mode, and the state one step leaves the next.

`StepMode` is fixed for the run. `resolve_mode` makes it once, where `trainer.build_samples_generator`
builds the generator, from the OPPO config and OpenRLHF's flags; the generator's branches read it and
never look at those flags again. What each kind does differently, in the order of a step:

    kind                    step start          batch taken                          weight sync
    SYNC                    admit new groups    carried groups decode on (*)         pause if groups are carried
    SLEEP                   wake, admit         stop (park) carried samples, sleep   no pause: asleep
    ASYNC                   (begun at batch)    end the step, begin the next one     pause if groups are carried
    ASYNC_BACKGROUND_SYNC   (begun at batch)    end the step, begin the next one     always pause; resume once loaded

    (*) `Carried.HOLD` (lag 0): the engines pause as the batch is taken and resume after the weight
        sync; `Carried.DECODE`: they decode through training and pause for the weight sync only.

`StepState` is the runtime state between the generator's calls: what the next step starts from (its
`Phase`), the step begun early (async admission) and the batch awaiting training. Its transitions are
its four methods, one per event: a step starts, its batch is taken, `finish_step` closes it, a
checkpoint is loaded:

    READY ---------- generate_samples ----------> batch taken --+--> READY    (finish_step closes the batch)
    RESTORED (checkpoint loaded) ---^                           +--> PARKED   (sleep: carried samples stopped)
    PARKED (sleep mode) ------------^                           +--> BEGUN    (async: the next step began)
    BEGUN (async admission) --------^
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from openrlhf_oppo.config import StalenessConfig
from openrlhf_oppo.core import StepPlan, StepReport, TrainBatch


class StepKind(enum.Enum):
    """How a step overlaps with training, for the whole run."""

    SYNC = "sync"
    """`--oppo.staleness.max_policy_lag 0`: a step's new groups are admitted when it begins, after the
    previous step's weight sync."""

    SLEEP = "sleep"
    """`--vllm.enable_sleep` (OpenRLHF's hybrid engine; lag 0): the engines wake as a step begins; as its
    batch is taken, every carried request stops where it is (its tokens kept) and the engines sleep while
    the models train; the next step restarts those requests from their tokens."""

    ASYNC = "async"
    """`--oppo.staleness.max_policy_lag N >= 1`: a step ends as its batch is taken and the next step begins
    then, its new groups decoding while the trainer trains."""

    ASYNC_BACKGROUND_SYNC = "async-background-sync"
    """`ASYNC` with `--oppo.staleness.background_sync`: the engines pause for every weight sync, carried groups
    or not (nothing may start on half-loaded weights), and resume once they have loaded the new weights."""


class Carried(enum.Enum):
    """What carried groups do while the trainer trains (`--oppo.staleness.carried_in_training`)."""

    DECODE = "decode"
    """They decode on; the weight sync pauses them."""

    HOLD = "hold"
    """The engines pause as the batch is taken and resume after the weight sync (lag 0 only): where the
    engines share the trainer's devices, decoding would slow training down."""


@dataclass(frozen=True)
class StepMode:
    """The generator's mode for the whole run; `resolve_mode` makes it from the flags."""

    kind: StepKind
    """How a step overlaps with training."""

    carried: Carried
    """What carried groups do while the trainer trains ('auto' already resolved by the layout)."""

    keep_kv_cache: bool
    """Carried requests keep their vLLM KV cache when the engines pause (`--oppo.staleness.keep_kv_cache`;
    false in sleep mode: asleep, the engines drop every KV cache)."""

    max_policy_lag: int
    """`--oppo.staleness.max_policy_lag`: 0 for SYNC and SLEEP, the bound on a trained token's age in policy
    versions (>= 1) for the async kinds."""

    def __post_init__(self) -> None:
        asynchronous = self.kind in (StepKind.ASYNC, StepKind.ASYNC_BACKGROUND_SYNC)
        if asynchronous != (self.max_policy_lag >= 1):
            raise ValueError(f"step kind {self.kind.value} with --oppo.staleness.max_policy_lag "
                             f"{self.max_policy_lag}: the async kinds need a lag >= 1, the others a lag of 0")
        if asynchronous and self.carried is Carried.HOLD:
            raise ValueError("--oppo.staleness.carried_in_training hold needs --oppo.staleness.max_policy_lag 0: "
                             "with async admission the next step's groups decode while the trainer trains")
        if self.kind is StepKind.SLEEP and self.keep_kv_cache:
            raise ValueError("sleep mode keeps no KV cache: asleep, the engines drop it (keep_kv_cache false)")

    @property
    def admits_at_batch(self) -> bool:
        """A step ends as its batch is taken (its Δ and C set then), and the next step begins and admits its
        groups at once (async admission)."""
        return self.kind in (StepKind.ASYNC, StepKind.ASYNC_BACKGROUND_SYNC)

    @property
    def sleeps_while_training(self) -> bool:
        """The engines wake as a step begins and sleep from its batch on, carried requests stopped (parked)."""
        return self.kind is StepKind.SLEEP

    @property
    def background_sync(self) -> bool:
        """The trainer waits for the gather of the weights only; the engines resume once they have loaded them."""
        return self.kind is StepKind.ASYNC_BACKGROUND_SYNC

    def pauses_at_batch(self, carrying: bool) -> bool:
        """Whether the engines pause as the batch is taken; `carrying`: groups are in flight."""
        return self.carried is Carried.HOLD and carrying

    def pauses_for_weight_sync(self, carrying: bool) -> bool:
        """Whether the engines pause for the weight sync; `carrying`: groups are in flight.

        Held carried groups were paused at the batch already, and asleep engines decode nothing. Otherwise
        the engines pause when something decodes, and for every background sync: nothing may start on
        half-loaded weights."""
        if self.carried is Carried.HOLD or self.kind is StepKind.SLEEP:
            return False
        return carrying or self.background_sync


def carried_in_training(staleness: StalenessConfig, args, cpu_host: bool) -> Carried:
    """`--oppo.staleness.carried_in_training` with 'auto' resolved by the layout: HOLD where the engines share
    devices with the trainer (`cpu_host`: a run of the CPU compat layer, every role on one host's cores;
    `--train.colocate_all`) and the lag is 0, else DECODE. The trainer's actor holds no GPU, so it cannot
    ask CUDA itself."""
    if staleness.carried_in_training != "auto":
        return Carried(staleness.carried_in_training)
    shared = cpu_host or bool(args.train.colocate_all)
    if shared and staleness.max_policy_lag == 0:
        return Carried.HOLD
    return Carried.DECODE


def resolve_mode(staleness: StalenessConfig, args, cpu_host: bool) -> StepMode:
    """The run's `StepMode` from the OPPO staleness settings and OpenRLHF's flags `args`; `cpu_host` as in
    `carried_in_training`. Raises ValueError, naming the flags, on a combination the launcher refuses."""
    lag = staleness.max_policy_lag
    sleep = bool(args.vllm.enable_sleep)  # OpenRLHF ignores it without --train.colocate_all
    if sleep and lag:
        raise ValueError(f"--vllm.enable_sleep cannot be combined with --oppo.staleness.max_policy_lag {lag}: "
                         f"set --oppo.staleness.max_policy_lag 0")
    if staleness.background_sync and not lag:
        raise ValueError("--oppo.staleness.background_sync true needs --oppo.staleness.max_policy_lag >= 1")
    if sleep:
        kind = StepKind.SLEEP
    elif lag == 0:
        kind = StepKind.SYNC
    elif staleness.background_sync:
        kind = StepKind.ASYNC_BACKGROUND_SYNC
    else:
        kind = StepKind.ASYNC
    return StepMode(
        kind=kind,
        carried=carried_in_training(staleness, args, cpu_host),
        keep_kv_cache=staleness.keep_kv_cache and not sleep,
        max_policy_lag=lag,
    )


class Phase(enum.Enum):
    """What the next `generate_samples` starts from."""

    READY = "ready"
    """The engines and scorers hold every carried sample: the step begins with its admission."""

    RESTORED = "restored"
    """A checkpoint was loaded: the engines and scorer actors hold nothing. The step reopens every carried
    sample on both, or, resumed at a pass's end with nothing carried, ends OpenRLHF's episode."""

    PARKED = "parked"
    """Sleep mode: the carried samples were stopped at the last batch; the step restarts them on the engines
    from their tokens."""

    BEGUN = "begun"
    """Async admission: the step began as the last batch was taken; its groups are decoding."""

    @property
    def engines_lost_carried(self) -> bool:
        """The engines hold none of the carried samples: the step starts them again from their tokens."""
        return self in (Phase.RESTORED, Phase.PARKED)

    @property
    def scorers_lost_carried(self) -> bool:
        """The scorer actors hold none of the carried samples: the step opens them again (and re-sends
        their tokens, `StepPlan.restream`); the engine pool places them again."""
        return self is Phase.RESTORED


@dataclass(frozen=True)
class BegunStep:
    """A step the scheduler began and the engines started."""

    plan: StepPlan
    """The scheduler's plan of the step."""

    pass_end: int
    """The prompt index where the pass the step admits from ends: no prompt at or past it was admitted."""


@dataclass(frozen=True)
class TakenBatch:
    """A step's batch, taken by `generate_samples` and awaiting training; `finish_step` closes it."""

    batch: TrainBatch
    """The trained groups, as the scheduler handed them over."""

    sample_ids: list[int]
    """Its sample ids in the order its experiences were handed to OpenRLHF."""

    report: StepReport | None
    """Async admission: the step's report, made as the batch was taken; otherwise None (`finish_step` ends
    the step with the trained batch's mean reward)."""


@dataclass(frozen=True)
class StepState:
    """The generator's state between calls; each event makes the next state by one of the methods below."""

    phase: Phase = Phase.READY
    """What the next `generate_samples` starts from."""

    begun: BegunStep | None = None
    """BEGUN only: the next step, begun as the last batch was taken."""

    taken: TakenBatch | None = None
    """From `generate_samples` taking a batch to `finish_step`: the batch awaiting training."""

    def __post_init__(self) -> None:
        if (self.phase is Phase.BEGUN) != (self.begun is not None):
            raise ValueError(f"phase {self.phase.value} with begun step {self.begun}: a begun step is "
                             f"held in phase begun, and only there")

    def started(self) -> StepState:
        """`generate_samples` began a step: from here on the engines and scorers hold what it (re)starts."""
        if self.taken is not None:
            raise RuntimeError("generate_samples called before finish_step closed the previous step")
        return StepState()

    def batch_taken(self, mode: StepMode, taken: TakenBatch, parked: bool, begun: BegunStep | None) -> StepState:
        """The step's batch was taken: `parked`, the carried samples were stopped for the engines' sleep;
        `begun`, the next step began (async admission, unless the pass ended)."""
        if parked and not mode.sleeps_while_training:
            raise ValueError(f"step kind {mode.kind.value} parks nothing: only sleep mode stops carried samples")
        if begun is not None and not mode.admits_at_batch:
            raise ValueError(f"step kind {mode.kind.value} begins no step at the batch: only async admission does")
        if (taken.report is not None) != mode.admits_at_batch:
            raise ValueError(f"step kind {mode.kind.value}: a step's report is made at the batch with async "
                             f"admission, and only then")
        if begun is not None:
            return StepState(Phase.BEGUN, begun=begun, taken=taken)
        if parked:
            return StepState(Phase.PARKED, taken=taken)
        return StepState(Phase.READY, taken=taken)

    def finished(self) -> StepState:
        """`finish_step` closed the step: its batch was trained; the phase stands for the next step."""
        if self.taken is None:
            raise RuntimeError("finish_step called with no batch taken: generate_samples takes it")
        return dataclasses.replace(self, taken=None)

    def restored(self) -> StepState:
        """A checkpoint was loaded: the engines and scorer actors start empty."""
        return StepState(Phase.RESTORED)
