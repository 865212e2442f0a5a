"""The weight sync off the trainer's path (`--oppo.staleness.background_sync`, with async admission).

OpenRLHF 0.11.2's trainer waits for the whole sync: `PolicyModelActor.broadcast_to_vllm` gathers
each parameter (ZeRO-3: a collective every rank joins) and sends it to every engine, one Ray
round trip per parameter, before the next step's experience making may start. Here the trainer
waits only for the gather:

    actor     `BackgroundSyncPolicyModelActor.broadcast_to_vllm` (every rank): the gathered weights
              go into a buffer on global rank 0, which starts sending them and returns the engines'
              load calls (Ray refs) to the driver; the other ranks return none. The actor's next
              step starts at once.
    engines   stay paused from the sync's start until their loads finish: nothing decodes on
              half-loaded weights (`EnginePool.resume_when_loaded`).
    driver    `OppoPPOTrainerImpl.broadcast_to_vllm` hands the loads to the engine pool, whose thread
              resumes the engines with the new policy version when they finish. The next sync
              (and any pause) waits for the last one's loads first.

Transports of the buffer:
    CPU (no CUDA)   the packed state dict through the engines' `update_weight` (`compat.weight_sync`);
                    the packing is the trainer's share, the engines' reload runs beside its next step
    GPU             OpenRLHF's NCCL weight-update group: one `receive_weights` call per engine
                    (`OppoRolloutActor`) runs vLLM's worker `update_weight` for each parameter in
                    order, while a thread on rank 0 broadcasts the buffered parameters on a CUDA
                    stream of its own. The buffer is a whole copy of the actor's weights on that
                    GPU (the launcher's memory check charges it), or with
                    `--oppo.staleness.background_sync_buffer host` pinned host memory, staged back
                    to the GPU a parameter at a time as it is sent. CUDA IPC (vLLM on the training
                    GPUs) is refused by the launcher: with nothing to overlap there is no gain.

The driver swaps OpenRLHF's `PolicyModelActor` for this one (`trainer.patch_driver`), as it swaps
the Megatron actor in, so a cluster's workers need nothing on their PYTHONPATH for it.
"""

from __future__ import annotations

import threading
import traceback

import ray
import torch
from openrlhf.trainer.ray import ppo_actor as _ppo_actor

from openrlhf_oppo import timeline
from openrlhf_oppo.upstream import unwrap_ray_actor

NOT_INSTALLED = ("OPPO background weight sync: the policy actor returned no engine loads, so it is "
                 "OpenRLHF's own PolicyModelActor (trainer.patch_driver swaps it in the driver before "
                 "train_ppo_ray builds the actor group)")


class CpuSender:
    """Rank 0's buffer as the CPU sync's packed state dict; `start` submits it to every engine."""

    def __init__(self, owner) -> None:
        from openrlhf_oppo.compat import weight_sync

        self.owner, self.weight_sync, self.packed = owner, weight_sync, []

    def add(self, name: str, tensor) -> None:
        self.packed.append(self.weight_sync.pack_tensor(name, tensor))

    def start(self) -> tuple[list, None]:
        loads = self.weight_sync.submit(self.owner, self.packed)
        self.weight_sync.probe(self.owner)  # queued: the engines stay paused until the loads finish
        return loads, None


class NcclSender:
    """Rank 0's buffer on its GPU, or (`host`) in pinned host memory; `start` calls each engine's
    `receive_weights` and broadcasts the buffer through OpenRLHF's weight-update group from a thread
    on a stream of its own (from host memory, each parameter copied back to the GPU just before it
    is sent, so the GPU holds one at a time)."""

    def __init__(self, owner, host: bool = False) -> None:
        self.owner, self.host, self.buffer = owner, host, []

    def add(self, name: str, tensor) -> None:
        tensor = tensor.detach()
        tensor.record_stream(torch.cuda.current_stream())  # ZeRO-3 frees it next: not reused before the copy
        if self.host:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            self.buffer.append((name, copy.copy_(tensor, non_blocking=True)))
        else:
            self.buffer.append((name, tensor.clone()))

    def start(self) -> tuple[list, threading.Thread]:
        owner, buffer = self.owner, self.buffer
        metas = [(name, t.dtype, tuple(t.shape)) for name, t in buffer]
        loads = [engine.receive_weights.remote(metas) for engine in owner.vllm_engines]
        copied = torch.cuda.Event()
        copied.record()  # the copies above, on the trainer's stream
        stream = torch.cuda.Stream()
        use_ray = getattr(owner.strategy.args.vllm, "sync_with_ray", False)

        device = torch.cuda.current_device()  # a thread starts on device 0: send from the trainer's

        def send() -> None:
            try:
                torch.cuda.set_device(device)
                stream.wait_event(copied)
                with torch.cuda.stream(stream), timeline.RECORDER.timed("sync", "send"):  # beside the actor's spans
                    for _, tensor in buffer:
                        tensor = tensor.to(device, non_blocking=True)  # host buffer: staged; else itself
                        if use_ray:  # device buffer only: the launcher refuses a host one with it (Ray's
                            import ray.util.collective as collective  # stream would not wait for the staging)

                            collective.broadcast(tensor, 0, group_name=owner._model_update_group)
                        else:
                            owner._model_update_group.broadcast(tensor, src=0, stream=stream)
                    stream.synchronize()
            except BaseException:  # the engines would wait for the rest forever: fail their loads instead
                traceback.print_exc()
                for ref in loads:
                    ray.cancel(ref)

        thread = threading.Thread(target=send, name="oppo-weight-send", daemon=True)
        thread.start()
        return loads, thread


def start_sync(trainer) -> list:
    """The actor side of a background sync on `trainer` (OpenRLHF's `ActorPPOTrainer` on this rank):
    gather every parameter to sync into rank 0's buffer and start sending it; rank 0 returns the
    engines' load calls, the other ranks []."""
    from openrlhf_oppo.compat.weight_sync import gathered_weights
    from openrlhf_oppo.integrations.runtime.run_config import config_from_env

    previous = getattr(trainer, "_oppo_send_thread", None)
    if previous is not None:  # the driver waited for its loads; the sender's last calls return with them
        previous.join()
        trainer._oppo_send_thread = None
    rank0 = torch.distributed.get_rank() == 0
    sender = None
    if rank0 and torch.cuda.is_available():
        sender = NcclSender(trainer, host=config_from_env().staleness.background_sync_buffer == "host")
    elif rank0:
        sender = CpuSender(trainer)  # host memory either way
    for name, tensor in gathered_weights(trainer):
        if rank0:
            sender.add(name, tensor)  # a copy: the gathered tensor is released with the next
    loads = []
    if rank0:
        loads, trainer._oppo_send_thread = sender.start()
    torch.distributed.barrier()
    return loads


def engine_loads(replies: list) -> list:
    """The load calls in the actor group's replies to `broadcast_to_vllm` (rank 0's; [] from the
    others). RuntimeError when no rank returned a list: OpenRLHF's own actor ran."""
    if not any(isinstance(r, list) for r in replies):
        raise RuntimeError(NOT_INSTALLED)
    return [ref for r in replies for ref in (r or [])]


class BackgroundSyncPolicyModelActor(unwrap_ray_actor(_ppo_actor.PolicyModelActor)):
    """OpenRLHF's policy actor whose weight sync returns once the weights are gathered."""

    def broadcast_to_vllm(self) -> list:
        with timeline.RECORDER.timed("actor", "weight_sync"):
            return start_sync(self.trainer)


BackgroundSyncPolicyModelRayActor = ray.remote(num_gpus=1)(BackgroundSyncPolicyModelActor)
