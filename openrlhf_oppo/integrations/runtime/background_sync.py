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
    shards          (`--oppo.staleness.background_sync_buffer shards`, ZeRO-3) no gather: every rank
                    copies its own partition of each parameter and sends it, the engines reassemble
                    the parameters (`compat.weight_sync.reassemble`) and load them. On CPU each rank's
                    packed partitions go through Ray to every engine's `load_shards`; on GPUs point
                    to point over a group of every actor rank and every engine worker (`shard_group`)
                    into the workers' `receive_shards` (`worker_ext`). The trainer waits for the copy.

Waits (`--oppo.timeouts.weight_sync_s`): nothing can free an engine worker or a sender thread blocked
in an NCCL broadcast, so the waits for them are bounded instead and a stall ends the run: the driver's
for the engines' loads (`EnginePool.resume_when_loaded`), the actor's for the last sync's sender
(`start_sync`) and for the engines joining the sharded sync's group (`shard_group`; its rendezvous is
vLLM's `StatelessProcessGroup`, bounded by its store's timeout). Ending the driver ends every process
of the run; it resumes from its last checkpoint as after a crash.

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
from openrlhf_oppo.integrations.runtime.ray_calls import WEIGHT_SYNC_FLAG, RayCalls, bounded_get, stalled
from openrlhf_oppo.upstream import unwrap_ray_actor

NOT_INSTALLED = ("OPPO background weight sync: the policy actor returned no engine loads, so it is "
                 "OpenRLHF's own PolicyModelActor (trainer.patch_driver swaps it in the driver before "
                 "train_ppo_ray builds the actor group)")


class CpuSender:
    """Rank 0's buffer as the CPU sync's packed state dict; `start` submits it to every engine."""

    def __init__(self, owner) -> None:
        from openrlhf_oppo.compat import weight_sync

        self.owner = owner
        self.weight_sync = weight_sync
        self.packed = []

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
        self.owner = owner
        self.host = host
        self.buffer = []

    def add(self, name: str, tensor) -> None:
        tensor = tensor.detach()
        tensor.record_stream(torch.cuda.current_stream())  # ZeRO-3 frees it next: not reused before the copy
        if self.host:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            self.buffer.append((name, copy.copy_(tensor, non_blocking=True)))
        else:
            self.buffer.append((name, tensor.clone()))

    def start(self) -> tuple[list, threading.Thread]:
        owner = self.owner
        buffer = self.buffer
        metas = [(name, t.dtype, tuple(t.shape)) for name, t in buffer]
        loads = [engine.receive_weights.remote(metas) for engine in owner.vllm_engines]
        group = owner._model_update_group

        def broadcast(tensor, stream) -> None:
            if getattr(owner.strategy.args.vllm, "sync_with_ray", False):  # device buffer only: the launcher
                import ray.util.collective as collective  # refuses a host one (Ray's stream would not wait for it)

                collective.broadcast(tensor, 0, group_name=group)
            else:
                group.broadcast(tensor, src=0, stream=stream)

        return loads, _start_sending([t for _, t in buffer], broadcast, lambda: _cancel(loads))


class CpuShardSender:
    """This rank's ZeRO-3 partitions, packed (`--oppo.staleness.background_sync_buffer shards` on CPU); `start`
    hands them to every engine (`OppoRolloutActor.load_shards`), which loads the weights once every
    rank's have come. Every rank returns its calls: the driver waits for all of them."""

    def __init__(self, owner) -> None:
        from openrlhf_oppo.compat import weight_sync

        self.owner = owner
        self.weight_sync = weight_sync
        self.shapes = []
        self.packed = []

    def add(self, name: str, shard, shape: tuple) -> None:
        self.shapes.append(shape)
        self.packed.append(self.weight_sync.pack_tensor(name, shard))

    def start(self) -> tuple[list, None]:
        rank, senders = torch.distributed.get_rank(), torch.distributed.get_world_size()
        packed = ray.put(self.packed)
        loads = [engine.load_shards.remote(rank, senders, self.shapes, packed) for engine in self.owner.vllm_engines]
        if rank == 0:
            self.weight_sync.probe(self.owner)  # queued: the engines stay paused until every rank's loads finish
        return loads, None


class NcclShardSender:
    """This rank's ZeRO-3 partitions (`--oppo.staleness.background_sync_buffer shards` on GPUs), copied where
    they live (1/ranks of the weights); `start` has rank 0 call each engine's `receive_shards`, and
    every rank send its partitions point to point to every engine worker of `shard_group`'s group,
    from a thread on a stream of its own. The workers (`worker_ext.OppoWorkerWrap`) take every rank's
    partition of a parameter, reassemble it and load it. A send that fails cancels the engines' calls
    on rank 0; another rank has no handle on them and kills the engines instead, whose workers would
    wait for its partitions forever: the sync's loads fail and the run stops, to resume from its
    last checkpoint, instead of hanging."""

    def __init__(self, owner, group) -> None:
        self.owner = owner
        self.group = group
        self.metas = []
        self.buffer = []

    def add(self, name: str, shard, shape: tuple) -> None:
        self.metas.append((name, shard.dtype, shape, shard.numel()))
        self.buffer.append(shard.detach().clone())  # on the trainer's stream: before the next step writes it

    def start(self) -> tuple[list, threading.Thread]:
        senders = torch.distributed.get_world_size()
        group = self.group
        engines = self.owner.vllm_engines
        loads = []
        if torch.distributed.get_rank() == 0:
            loads = [engine.receive_shards.remote(self.metas, senders) for engine in engines]

        def scatter(shard, stream) -> None:
            group.group_start()
            for dst in range(senders, group.world_size):  # the engines' workers follow the actor's ranks
                group.send(shard, dst, stream)
            group.group_end()

        def fail() -> None:
            _cancel(loads)
            for engine in [] if loads else engines:
                ray.kill(engine)

        return loads, _start_sending(self.buffer, scatter, fail)


def _cancel(refs: list) -> None:
    for ref in refs:
        ray.cancel(ref)


def _start_sending(buffer: list, send, fail) -> threading.Thread:
    """A thread that calls `send(tensor, stream)` on each tensor of `buffer` in order (a host one staged
    to this GPU first), on a CUDA stream of its own that waits for what the trainer's stream has
    queued so far (the buffer's copies). On a failure it prints it and calls `fail()`, which must end
    the engines' loads: they would wait for the rest forever."""
    copied = torch.cuda.Event()
    copied.record()
    stream = torch.cuda.Stream()
    device = torch.device("cuda", torch.cuda.current_device())  # a thread starts on device 0: send from the trainer's

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            stream.wait_event(copied)
            with torch.cuda.stream(stream), timeline.RECORDER.timed("sync", "send"):  # beside the actor's spans
                for tensor in buffer:
                    send(tensor.to(device, non_blocking=True), stream)
                stream.synchronize()
        except BaseException:
            traceback.print_exc()
            fail()

    thread = threading.Thread(target=run, name="oppo-weight-send", daemon=True)
    thread.start()
    return thread


def shard_group(trainer, timeout_s: float):
    """The NCCL group of a sharded sync, made on the first one: every actor rank (group rank = its own)
    and every engine worker after them, as OpenRLHF's `_init_vllm_sync_group` makes its group of rank 0
    and the workers (the workers' group is replaced by this one). The engines' joining is waited for
    `timeout_s` seconds at most."""
    group = getattr(trainer, "_oppo_shard_group", None)
    if group is not None:
        return group
    import socket

    from openrlhf.utils.distributed_util import stateless_init_process_group

    rank, senders = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tp = trainer.strategy.args.vllm.tensor_parallel_size
    world = senders + len(trainer.vllm_engines) * tp
    address = [None]
    if rank == 0:
        with socket.socket() as sock:
            sock.bind(("", 0))
            address = [(ray.util.get_node_ip_address(), sock.getsockname()[1])]
    torch.distributed.broadcast_object_list(address, src=0)
    host, port = address[0]
    joined = []
    if rank == 0:
        joined = [engine.init_process_group.remote(host, port, senders + i * tp, world, "openrlhf-oppo-shards",
                                                   backend="nccl", use_ray=False)
                  for i, engine in enumerate(trainer.vllm_engines)]
    trainer._oppo_shard_group = stateless_init_process_group(host, port, rank, world, torch.cuda.current_device())
    bounded_get(RayCalls(), joined, timeout_s, "the engines' workers joining the sharded sync's NCCL group",
                WEIGHT_SYNC_FLAG)
    return trainer._oppo_shard_group


def join_sender(trainer, timeout_s: float) -> None:
    """Wait for the last sync's sender thread on this rank (the driver waited for the engines' loads, so
    its last calls have returned) for `timeout_s` seconds at most: a thread blocked in a broadcast to an
    engine that never receives it cannot be freed, so the run ends (`Stalled`)."""
    previous = getattr(trainer, "_oppo_send_thread", None)
    if previous is None:
        return
    previous.join(timeout_s)
    if previous.is_alive():
        raise stalled(f"the last background weight sync's sender thread on actor rank {torch.distributed.get_rank()} "
                      f"(its broadcast to the engines)", timeout_s, WEIGHT_SYNC_FLAG)
    trainer._oppo_send_thread = None


def start_sync(trainer) -> list:
    """The actor side of a background sync on `trainer` (OpenRLHF's `ActorPPOTrainer` on this rank):
    gather every parameter to sync into rank 0's buffer and start sending it; rank 0 returns the
    engines' load calls, the other ranks []. With the `shards` buffer every rank buffers and sends its
    own partitions, and returns its calls (on GPUs, rank 0 the engines' only one). The last sync's sender
    is waited for --oppo.timeouts.weight_sync_s at most (`Stalled` past it)."""
    from openrlhf_oppo.compat.weight_sync import gathered_weights
    from openrlhf_oppo.integrations.runtime.run_config import config_from_env

    config = config_from_env()
    timeout_s = config.timeouts.weight_sync_s
    join_sender(trainer, timeout_s)
    buffer = config.staleness.background_sync_buffer
    if buffer == "shards":  # every rank sends its own partitions: no gather
        from openrlhf_oppo.compat.weight_sync import local_shards

        cuda = torch.cuda.is_available()
        sender = NcclShardSender(trainer, shard_group(trainer, timeout_s)) if cuda else CpuShardSender(trainer)
        for name, shard, shape in local_shards(trainer):
            sender.add(name, shard, shape)
        loads, trainer._oppo_send_thread = sender.start()
        torch.distributed.barrier()
        return loads
    rank0 = torch.distributed.get_rank() == 0
    sender = None
    if rank0 and torch.cuda.is_available():
        sender = NcclSender(trainer, host=buffer == "host")
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
    """The load calls in the actor group's replies to `broadcast_to_vllm` (every rank's list).
    RuntimeError when no rank returned a list: OpenRLHF's own actor ran."""
    if not any(isinstance(r, list) for r in replies):
        raise RuntimeError(NOT_INSTALLED)
    return [ref for r in replies for ref in (r or [])]


class BackgroundSyncPolicyModelActor(unwrap_ray_actor(_ppo_actor.PolicyModelActor)):
    """OpenRLHF's policy actor whose weight sync returns once the weights are gathered."""

    def broadcast_to_vllm(self) -> list:
        with timeline.RECORDER.timed("actor", "weight_sync"):
            return start_sync(self.trainer)


BackgroundSyncPolicyModelRayActor = ray.remote(num_gpus=1)(BackgroundSyncPolicyModelActor)
