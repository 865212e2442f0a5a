"""Timeline spans for OpenRLHF's own stages (written against OpenRLHF 0.11.2).

Wraps the named methods so that every schedule, OpenRLHF's and OPPO's, records the
same stages (`openrlhf_oppo.timeline`). Installed by the site hook in every process
of a run launched with OPPO_TIMELINE_DIR set (`openrlhf-oppo train` always sets it);
each wrapper fires when its module is imported, on any hardware.

    role      stage          method (OpenRLHF 0.11.2)
    driver    generate       SamplesGenerator.generate_samples (the driver waits for rollouts)
    driver    make_experience RemoteExperienceMaker.make_experience_batch
    driver    train          BasePPOTrainer.ppo_train
    driver    weight_sync    BasePPOTrainer.broadcast_to_vllm
    rollout   (sample)       RolloutRayActor.generate: one response, start to finish
    rollout   pause/resume/load_weights   RolloutRayActor.pause_generation/resume_generation/update_weight
    actor     old_logprobs / train / weight_sync   PolicyModelActor.forward / fit / broadcast_to_vllm
    critic    values / train CriticModelActor.forward / fit
    ref       ref_logprobs   ReferenceModelActor.forward
    reward    score          RewardModelActor.forward

`BasePPOTrainer.train_step` also adds `timing/idle/<role>` to the step's status: the
share of the step (previous step's end to this one's) in which no worker of that
role was busy, read back from the run's timeline files.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Iterator

from openrlhf_oppo import timeline
from openrlhf_oppo.hooks import Patch
from openrlhf_oppo.upstream import OPENRLHF_VERSION, ray_actor_classes


def _classes(owner) -> list:
    """The classes to set a method on: for a Ray actor class, the class under
    @ray.remote and Ray's subclass that holds a wrapper of every method."""
    if not hasattr(owner, "__ray_metadata__"):  # a plain class
        return [owner]
    return list(ray_actor_classes(owner))


def _wrap(owner, name: str, wrapper_factory) -> None:
    classes = _classes(owner)
    original = getattr(classes[0], name)
    wrapped = functools.wraps(original)(wrapper_factory(original))
    for cls in classes:
        setattr(cls, name, wrapped)


def _timed(role: str, stage: str):
    def factory(original):
        if inspect.iscoroutinefunction(original):
            async def method(self, *args, **kwargs):
                with timeline.RECORDER.timed(role, stage):
                    return await original(self, *args, **kwargs)
        else:
            def method(self, *args, **kwargs):
                with timeline.RECORDER.timed(role, stage):
                    return original(self, *args, **kwargs)
        return method

    return factory


def _sample(original):
    async def generate(self, *args, **kwargs):
        opened = timeline.RECORDER.open_sample("rollout")
        out = await original(self, *args, **kwargs)
        comp = out.outputs[0] if out is not None and out.outputs else None
        timeline.RECORDER.sample("rollout", opened, len(comp.token_ids) if comp else 0,
                                 comp.finish_reason if comp else None)
        return out

    return generate


IDLE_ROLES = ("rollout", "reward", "ref", "critic", "actor")


class StepWindow:
    """The driver's view of the timeline: idle share of each role since the last step
    (read incrementally: a step costs what the step wrote, not what the run did)."""

    def __init__(self) -> None:
        self.start_s: float | None = None
        self.tail = timeline.Tail(timeline.RECORDER.directory) if timeline.RECORDER.enabled else None

    def open(self) -> None:
        if self.start_s is None:
            self.start_s = time.time()

    def close(self) -> dict[str, float]:
        end = time.time()
        start = self.start_s or end
        self.start_s = end
        if self.tail is None:
            return {}
        idle = timeline.idle_fractions(self.tail.read(keep_after_s=start), start, end)
        return {f"timing/idle/{role}": idle[role] for role in IDLE_ROLES if role in idle}


STEP_WINDOW = StepWindow()


@contextlib.contextmanager
def generating() -> Iterator[None]:
    """The driver waits for a step's rollouts (every schedule's generator)."""
    STEP_WINDOW.open()
    with timeline.RECORDER.timed("driver", "generate"):
        yield


def samples_generator(module) -> None:
    def factory(original):
        def generate_samples(self, *args, **kwargs):
            with generating():
                return original(self, *args, **kwargs)

        return generate_samples

    _wrap(module.SamplesGenerator, "generate_samples", factory)


def experience_maker(module) -> None:
    _wrap(module.RemoteExperienceMaker, "make_experience_batch", _timed("driver", "make_experience"))


def _train_step(original):
    def train_step(self, *args, **kwargs):
        STEP_WINDOW.open()
        status, step = original(self, *args, **kwargs)
        status.update(STEP_WINDOW.close())
        return status, step

    return train_step


def ppo_trainer(module) -> None:
    base = module.BasePPOTrainer
    _wrap(base, "ppo_train", _timed("driver", "train"))
    _wrap(base, "broadcast_to_vllm", _timed("driver", "weight_sync"))
    _wrap(base, "train_step", _train_step)
    # @ray.remote wrapped PPOTrainer's inherited methods when the module ran: point
    # its actor class at the timed ones (subclasses made later inherit them)
    actor_cls = ray_actor_classes(module.PPOTrainer)[1]
    for name in ("ppo_train", "broadcast_to_vllm", "train_step"):
        setattr(actor_cls, name, getattr(base, name))


def vllm_engine(module) -> None:
    actor = module.RolloutRayActor
    _wrap(actor, "generate", _sample)
    _wrap(actor, "pause_generation", _timed("rollout", "pause"))
    _wrap(actor, "resume_generation", _timed("rollout", "resume"))
    _wrap(actor, "update_weight", _timed("rollout", "load_weights"))
    _wrap(actor, "update_weight_cuda_ipc", _timed("rollout", "load_weights"))  # colocated GPU runs


def model_actors(module) -> None:
    _wrap(module.ReferenceModelActor, "forward", _timed("ref", "ref_logprobs"))
    _wrap(module.RewardModelActor, "forward", _timed("reward", "score"))


def policy_actor(module) -> None:
    _wrap(module.PolicyModelActor, "forward", _timed("actor", "old_logprobs"))
    _wrap(module.PolicyModelActor, "fit", _timed("actor", "train"))
    _wrap(module.PolicyModelActor, "broadcast_to_vllm", _timed("actor", "weight_sync"))


def critic_actor(module) -> None:
    _wrap(module.CriticModelActor, "forward", _timed("critic", "values"))
    _wrap(module.CriticModelActor, "fit", _timed("critic", "train"))


_UPSTREAM = f"openrlhf {OPENRLHF_VERSION}"
PATCHES: tuple[Patch, ...] = (
    Patch("timeline_samples_generator", "openrlhf.trainer.ppo_utils.samples_generator", samples_generator, _UPSTREAM),
    Patch("timeline_experience_maker", "openrlhf.trainer.ppo_utils.experience_maker", experience_maker, _UPSTREAM),
    Patch("timeline_ppo_trainer", "openrlhf.trainer.ppo_trainer", ppo_trainer, _UPSTREAM),
    Patch("timeline_vllm_engine", "openrlhf.trainer.ray.vllm_engine", vllm_engine, _UPSTREAM),
    Patch("timeline_model_actors", "openrlhf.trainer.ray.launcher", model_actors, _UPSTREAM),
    Patch("timeline_policy_actor", "openrlhf.trainer.ray.ppo_actor", policy_actor, _UPSTREAM),
    Patch("timeline_critic_actor", "openrlhf.trainer.ray.ppo_critic", critic_actor, _UPSTREAM),
)
