"""The actor side of the background weight sync (`integrations.runtime.background_sync`): what rank 0
buffers and sends, what the driver gets back. A one-process gloo group stands for the actor group
on CPU; the engines are fakes (the end-to-end run is tests/cli/test_train_oppo_async_on_cpu.py).
The GPU sender's stream ordering runs in the `gpu` tier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="OpenRLHF's trainer imports Ray (scripts/gpu_checks.sh carries none)")
import torch

from openrlhf_oppo.compat import weight_sync
from openrlhf_oppo.integrations.runtime import background_sync


@pytest.fixture
def one_rank(tmp_path):
    """torch.distributed with this process as the whole (gloo) group, as a one-GPU actor group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def sync_buffer(monkeypatch):
    """`--oppo.staleness.background_sync_buffer` as the launcher hands it to the actor."""
    import json

    from openrlhf_oppo import config as oppo_config
    from openrlhf_oppo import run_env

    def use(buffer: str) -> None:
        cfg = oppo_config.from_dict({"staleness": {"background_sync_buffer": buffer}})
        monkeypatch.setenv(run_env.CONFIG_JSON, json.dumps(oppo_config.to_dict(cfg)))

    use("device")
    return use


def make_trainer(fakes, model: torch.nn.Module, engines: int = 2):
    ns = SimpleNamespace
    args = ns(ds=ns(zero_stage=3, tensor_parallel_size=1), vllm=ns(enable_prefix_caching=False, sync_with_ray=False))
    engine = [fakes.make_actor(update_weight=lambda payload, *a: fakes.FakeRef(f"loaded {len(payload['weights'])}"))
              for _ in range(engines)]
    return ns(strategy=ns(args=args), actor=ns(model=ns(module=model)), vllm_engines=engine)


def test_rank0_sends_a_copy_of_the_gathered_weights_and_returns_the_engines_loads(fakes, one_rank, sync_buffer):
    model = torch.nn.Linear(3, 2)
    trainer = make_trainer(fakes, model)
    loads = background_sync.start_sync(trainer)
    assert [r.value for r in loads] == ["loaded 2", "loaded 2"]  # one load call per engine, not waited for
    (payload, *_), = trainer.vllm_engines[0].update_weight.calls
    assert payload["tag"] == weight_sync.PAYLOAD_TAG
    sent = dict(weight_sync.unpack_tensor(item) for item in payload["weights"])
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step trains on: what was sent does not change
    assert sent.keys() == before.keys() and all(torch.equal(sent[k], before[k]) for k in sent)


def test_a_parameter_is_its_zero3_partitions_end_to_end_less_the_last_ones_padding():
    # 15 elements over 2 ranks: DeepSpeed pads to 16, rank 0 holds 0..7, rank 1 holds 8..14 and a zero
    whole = torch.arange(15.0).view(5, 3)
    flat = torch.cat([torch.arange(8.0), torch.tensor([8.0, 9, 10, 11, 12, 13, 14, 0])])
    assert torch.equal(weight_sync.reassemble(flat, (5, 3)), whole)


def partitions(tensor: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """A tensor's ZeRO-3 partitions as DeepSpeed's `_partition_param` lays them out."""
    size = -(-tensor.numel() // ranks)
    padded = torch.cat([tensor.flatten(), tensor.new_zeros(size * ranks - tensor.numel())])
    return list(padded.split(size))


class Zero3Linear(torch.nn.Linear):
    """nn.Linear whose parameters carry the ZeRO-3 attributes `local_shards` reads, as rank `rank` of
    `ranks` would hold them (`param.data` emptied, as ZeRO-3 leaves it between gathers)."""

    def __init__(self, rank: int, ranks: int, group) -> None:
        super().__init__(3, 5)
        torch.manual_seed(0)
        with torch.no_grad():
            self.weight.copy_(torch.randn(5, 3))
            self.bias.copy_(torch.randn(5))
        self.whole = {name: p.detach().clone() for name, p in self.named_parameters()}
        for name, param in self.named_parameters():
            shard = partitions(self.whole[name], ranks)[rank].clone()
            shard.ds_numel = shard.numel()
            param.ds_tensor, param.ds_shape, param.ds_process_group = shard, self.whole[name].shape, group
            param.data = torch.empty(0)


def test_each_rank_sends_its_own_partitions_and_the_engine_loads_once_every_ranks_came(fakes, one_rank,
                                                                                        sync_buffer, monkeypatch):
    """`shards` on CPU: the rank hands its packed partitions to every engine and returns the calls; the
    engine (`OppoRolloutActor.load_shards`, on a stand-in with a recording vLLM) waits for the other
    rank's, then loads the reassembled weights through the CPU sync's `update_weight`, once."""
    from openrlhf_oppo.integrations.runtime.rollout import OppoRolloutActor

    sync_buffer("shards")
    monkeypatch.setattr(background_sync.ray, "put", lambda obj: obj)  # the object store: no Ray here
    model = Zero3Linear(rank=0, ranks=1, group=torch.distributed.group.WORLD)
    sent = []
    trainer = make_trainer(fakes, model)
    for engine in trainer.vllm_engines:
        engine.load_shards = fakes.FakeMethod(lambda *args: sent.append(args) or "queued")
    loads = background_sync.start_sync(trainer)
    assert [r.value for r in loads] == ["queued", "queued"] and len(sent) == 2
    rank, senders, shapes, packed = sent[0]
    assert (rank, senders, shapes) == (0, 1, [(5, 3), (5,)]) and sent[1] == sent[0]
    assert [name for name, *_ in packed] == ["weight", "bias"]

    # the engine: two ranks' partitions of the same weights, rank 1's first
    loaded = []

    class LLM:
        async def collective_rpc(self, method, args):
            loaded.append((method, args))

    engine = SimpleNamespace(_shards={}, llm=LLM())
    both = {r: [weight_sync.pack_tensor(n, partitions(model.whole[n], 2)[r]) for n in ("weight", "bias")]
            for r in (0, 1)}
    import asyncio

    asyncio.run(OppoRolloutActor.load_shards(engine, 1, 2, shapes, both[1]))
    assert loaded == [] and list(engine._shards) == [1]  # the engine stays paused: half a state dict
    asyncio.run(OppoRolloutActor.load_shards(engine, 0, 2, shapes, both[0]))
    (method, (payload, *_)), = loaded
    assert method == "update_weight" and payload["tag"] == weight_sync.PAYLOAD_TAG and engine._shards == {}
    weights = dict(weight_sync.unpack_tensor(item) for item in payload["weights"])
    assert weights.keys() == model.whole.keys() and all(torch.equal(weights[k], model.whole[k]) for k in weights)


def test_a_parameter_without_a_zero3_partition_is_named(fakes, one_rank, sync_buffer):
    sync_buffer("shards")
    with pytest.raises(RuntimeError, match=r"background_sync_buffer shards sends each rank's ZeRO-3 partition, "
                                           r"but weight has no partition \(--ds\.zero_stage 3\?\)"):
        background_sync.start_sync(make_trainer(fakes, torch.nn.Linear(3, 2)))


def test_the_driver_takes_every_ranks_loads_and_names_a_missing_actor_swap():
    assert background_sync.engine_loads([["load 0", "load 1"], [], []]) == ["load 0", "load 1"]
    assert background_sync.engine_loads([["a 0", "a 1"], ["b 0", "b 1"]]) == ["a 0", "a 1", "b 0", "b 1"]
    with pytest.raises(RuntimeError, match=r"OpenRLHF's own PolicyModelActor \(trainer\.patch_driver swaps it"):
        background_sync.engine_loads([None, None])  # OpenRLHF's actor returns nothing


@pytest.mark.gpu
@pytest.mark.parametrize("host", [False, True], ids=["device-buffer", "host-buffer"])
def test_the_gpu_sender_broadcasts_the_buffer_as_gathered_while_the_trainer_updates_the_weights(host):
    """NcclSender on a CUDA device with a recording group in place of OpenRLHF's NCCL one: each
    tensor is sent on the sender's stream, after the copy (on the GPU, or to pinned host memory and
    staged back), whatever the trainer's stream does next."""
    received: list[torch.Tensor] = []

    class Group:
        def broadcast(self, tensor, src, stream):
            assert src == 0 and stream == torch.cuda.current_stream()
            received.append(tensor.clone())

    class Engine:
        class receive_weights:  # noqa: N801 - a Ray actor method's shape
            metas = None

            @classmethod
            def remote(cls, metas):
                cls.metas = metas
                return "load"

    weight = torch.randn(4096, 4096, device="cuda")
    owner = SimpleNamespace(strategy=SimpleNamespace(args=SimpleNamespace(vllm=SimpleNamespace(sync_with_ray=False))),
                            vllm_engines=[Engine], _model_update_group=Group())
    sender = background_sync.NcclSender(owner, host=host)
    sender.add("w", weight)
    (_, kept), = sender.buffer
    assert (kept.device.type, kept.is_pinned()) == (("cpu", True) if host else ("cuda", False))
    expected = weight.clone()
    loads, thread = sender.start()
    weight.mul_(3.0)  # the next step, on the trainer's stream
    thread.join(60)
    torch.cuda.synchronize()
    assert loads == ["load"] and Engine.receive_weights.metas == [("w", torch.float32, (4096, 4096))]
    assert len(received) == 1 and received[0].is_cuda and torch.equal(received[0], expected)


@pytest.mark.gpu
def test_the_gpu_shard_sender_sends_each_partition_to_every_engine_worker_as_copied(one_rank):
    """NcclShardSender on a CUDA device with a recording group of this rank and two engine workers:
    each partition goes point to point to both workers, inside one NCCL group call, on the sender's
    stream, with the value it had when the trainer copied it."""
    calls: list = []

    class Group:
        world_size = 3  # this rank, then the engines' two workers

        def group_start(self):
            calls.append("start")

        def send(self, tensor, dst, stream):
            assert stream == torch.cuda.current_stream()
            calls.append((dst, tensor.clone()))

        def group_end(self):
            calls.append("end")

    engine = SimpleNamespace(receive_shards=SimpleNamespace(remote=lambda metas, senders: ("load", metas, senders)))
    owner = SimpleNamespace(vllm_engines=[engine])
    shard = torch.randn(1 << 20, device="cuda")
    expected = shard.clone()
    sender = background_sync.NcclShardSender(owner, Group())
    sender.add("w", shard, (1024, 1024))
    loads, thread = sender.start()
    shard.mul_(3.0)  # the next step writes the partition, on the trainer's stream
    thread.join(60)
    torch.cuda.synchronize()
    assert loads == [("load", [("w", torch.float32, (1024, 1024), 1 << 20)], 1)]
    assert [c if isinstance(c, str) else c[0] for c in calls] == ["start", 1, 2, "end"]
    assert all(torch.equal(c[1], expected) for c in calls if not isinstance(c, str))


@pytest.mark.gpu
def test_a_send_failing_on_a_rank_without_the_engines_calls_kills_the_engines(one_rank, monkeypatch):
    """Rank 1 has no handle on the engines' `receive_shards` calls, whose workers would wait for its
    partitions forever: a failed send kills the engines, so the sync's loads fail and the run stops."""
    killed = []

    class Group:
        world_size = 3

        def group_start(self):
            pass

        def send(self, tensor, dst, stream):
            raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 1)
    monkeypatch.setattr(background_sync.ray, "kill", killed.append)
    owner = SimpleNamespace(vllm_engines=["engine 0", "engine 1"])
    sender = background_sync.NcclShardSender(owner, Group())
    sender.add("w", torch.randn(16, device="cuda"), (4, 4))
    loads, thread = sender.start()
    thread.join(60)
    assert loads == [] and killed == ["engine 0", "engine 1"]


@pytest.mark.gpu
def test_an_engine_worker_reassembles_every_ranks_partition_and_loads_the_parameter():
    """`OppoWorkerWrap.receive_shards` with a group whose receives hand out two ranks' partitions of a
    5 x 3 weight (8 elements each, the last one padded): the worker loads the whole weight."""
    from openrlhf_oppo.integrations.runtime.worker_ext import OppoWorkerWrap

    whole = torch.arange(15.0, device="cuda").view(5, 3)
    parts = list(torch.cat([whole.flatten(), whole.new_zeros(1)]).split(8))
    loaded: list = []

    class Group:
        def group_start(self):
            pass

        def recv(self, tensor, src, stream):
            tensor.copy_(parts[src])

        def group_end(self):
            pass

    worker = SimpleNamespace(_model_update_group=Group(), model_config=SimpleNamespace(dtype=torch.float32),
                             model_runner=SimpleNamespace(model=SimpleNamespace(
                                 load_weights=lambda weights: loaded.extend((n, w.clone()) for n, w in weights))))
    OppoWorkerWrap.receive_shards(worker, [("w", torch.float32, (5, 3), 8)], 2)
    (name, weight), = loaded
    assert name == "w" and torch.equal(weight, whole)


# ------------------------------------------------------------------ the packing on a fake GPU (STYLE 27)


class SpyGroup:
    """The NCCL group a sync sends through (OpenRLHF's weight-update group, `shard_group`'s): records what
    reaches each collective and refuses a tensor that is not on the GPU, as NCCL does (the sender's thread
    catches the error and cancels the loads: `refused` keeps it for the check)."""

    world_size = 2  # the sharded sync's: this rank, then one engine worker

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple]] = []
        self.refused: list[str] = []

    def _take(self, op: str, tensor: torch.Tensor) -> None:
        from openrlhf_oppo.compat.fake_cuda import is_fake_cuda

        if not is_fake_cuda(tensor):
            self.refused.append(f"NCCL {op}: a {tuple(tensor.shape)} tensor on {tensor.device}, not on the GPU")
            raise RuntimeError(self.refused[-1])
        self.sent.append((op, tuple(tensor.shape)))

    def broadcast(self, tensor, src, stream) -> None:
        self._take("broadcast", tensor)

    def send(self, tensor, dst, stream) -> None:
        self._take(f"send to {dst}", tensor)

    def group_start(self) -> None:
        pass

    def group_end(self) -> None:
        pass


class InlineThread:
    """A thread that runs its target as it starts, in the caller's thread: the fake CUDA device's modes are
    the caller thread's own."""

    def __init__(self, target, name, daemon) -> None:
        self.target = target

    def start(self) -> None:
        self.target()

    def join(self, timeout=None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


@pytest.fixture
def cuda_runtime(monkeypatch):
    """CUDA's streams and events as no-ops (a CPU build has none), `record_stream` and the sender's thread
    spied: what a GPU would refuse (a stream recorded on a host tensor) is recorded in `refused`."""
    import contextlib

    from openrlhf_oppo.compat.fake_cuda import is_fake_cuda

    spy = SimpleNamespace(refused=[], recorded=0, cancelled=[], allocations=[])

    class Stream:
        def wait_event(self, event) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class Event:
        def record(self, stream=None) -> None:
            pass

    def record_stream(tensor, stream) -> None:
        if not is_fake_cuda(tensor):
            spy.refused.append(f"record_stream on a {tuple(tensor.shape)} tensor on {tensor.device}")
        spy.recorded += 1

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream, raising=False)
    monkeypatch.setattr(background_sync, "threading", SimpleNamespace(Thread=InlineThread))
    monkeypatch.setattr(background_sync.ray, "cancel", spy.cancelled.append)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **kw: None)  # gloo cannot take a fake tensor
    return spy


def walk_sync(fakes, model: torch.nn.Module, spy, monkeypatch, shards: bool = False):
    """`start_sync` on the actor's rank 0 with `model`'s weights on the fake GPU, up to the collectives (a
    `SpyGroup`): the loads, the sender made, its group; the allocations it made land in `spy`."""
    import deepspeed  # noqa: F401 - its accelerator is chosen at import: a CPU one, before the fake GPU
    from torch.overrides import TorchFunctionMode

    from openrlhf_oppo.compat.fake_cuda import fake_cuda

    class Allocations(TorchFunctionMode):
        """Records the (device, pinned) of every `torch.empty`."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.empty:
                spy.allocations.append((str(kwargs.get("device")), kwargs.get("pin_memory", False)))
            return func(*args, **kwargs)

    senders = []
    for kind in (background_sync.NcclSender, background_sync.NcclShardSender):
        def start(self, _start=kind.start):
            senders.append(self)
            return _start(self)

        monkeypatch.setattr(kind, "start", start)
    trainer = make_trainer(fakes, model, engines=1)
    group = SpyGroup()
    trainer._model_update_group = group
    trainer._oppo_shard_group = group
    trainer.vllm_engines[0].receive_weights = fakes.FakeMethod(lambda metas: "load")
    trainer.vllm_engines[0].receive_shards = fakes.FakeMethod(lambda metas, senders: "load")
    with fake_cuda(model):
        if shards:
            for param in model.parameters():  # this rank's ZeRO-3 partition, where DeepSpeed keeps it: the GPU
                param.ds_tensor = torch.empty(param.numel(), dtype=param.dtype, device="cuda")
                param.ds_tensor.ds_numel = param.numel()
                param.ds_shape = param.shape
                param.ds_process_group = torch.distributed.group.WORLD
        with Allocations():
            loads = background_sync.start_sync(trainer)
    (sender,) = senders
    return SimpleNamespace(loads=loads, sender=sender, group=group)


def check_devices(walk, spy, buffer: str) -> None:
    """What a GPU would refuse, and a buffer in the wrong place: every collective got a tensor on the GPU,
    no stream was recorded on a host tensor, no load was cancelled; the `device` and `shards` buffers hold
    GPU copies, the `host` one tensors in host memory, each allocated pinned (what the copies to and from
    the GPU overlap with)."""
    from openrlhf_oppo.compat.fake_cuda import is_fake_cuda

    problems = walk.group.refused + spy.refused
    assert not problems, "; ".join(problems)
    assert spy.cancelled == [], "the sender failed and cancelled the engines' loads"
    kept = [entry if buffer == "shards" else entry[1] for entry in walk.sender.buffer]
    if buffer == "host":
        misplaced = [f"{tuple(t.shape)} on {t.device}" for t in kept if t.device.type != "cpu"]
        assert not misplaced, f"host buffer: {misplaced} not in host memory"
        assert spy.allocations == [("cpu", True)] * len(kept), f"host buffer allocated as {spy.allocations}: " \
                                                               f"each must be pinned host memory"
    else:
        misplaced = [f"{tuple(t.shape)} on {t.device}" for t in kept if not is_fake_cuda(t)]
        assert not misplaced, f"{buffer} buffer: {misplaced} not on the GPU"


@pytest.mark.parametrize("buffer", ["device", "host"])
def test_the_gpu_sender_packs_and_sends_the_weights_on_the_gpu(fakes, one_rank, sync_buffer, cuda_runtime,
                                                                 monkeypatch, buffer):
    """`--oppo.staleness.background_sync_buffer device|host` on a fake GPU: the actor's gathered weights are
    copied to the buffer where intended and every broadcast gets them on the GPU (a host copy staged back)."""
    sync_buffer(buffer)
    walk = walk_sync(fakes, torch.nn.Linear(3, 2), cuda_runtime, monkeypatch)
    check_devices(walk, cuda_runtime, buffer)
    assert isinstance(walk.sender, background_sync.NcclSender) and walk.sender.host == (buffer == "host")
    assert [r.value for r in walk.loads] == ["load"]
    assert walk.group.sent == [("broadcast", (2, 3)), ("broadcast", (2,))]
    assert cuda_runtime.recorded == 2  # each gathered tensor kept from reuse until its copy ran


def test_the_gpu_shard_sender_copies_and_sends_the_partitions_on_the_gpu(fakes, one_rank, sync_buffer,
                                                                         cuda_runtime, monkeypatch):
    sync_buffer("shards")
    walk = walk_sync(fakes, torch.nn.Linear(3, 2), cuda_runtime, monkeypatch, shards=True)
    check_devices(walk, cuda_runtime, "shards")
    assert isinstance(walk.sender, background_sync.NcclShardSender)
    assert [r.value for r in walk.loads] == ["load"]
    assert walk.group.sent == [("send to 1", (6,)), ("send to 1", (2,))]


def test_the_device_check_fails_on_a_buffer_planted_in_host_memory(fakes, one_rank, sync_buffer, cuda_runtime,
                                                                    monkeypatch):
    def add(self, name, tensor):  # the device buffer copied to the host (staged back before each send)
        self.buffer.append((name, tensor.detach().to("cpu")))

    monkeypatch.setattr(background_sync.NcclSender, "add", add)
    walk = walk_sync(fakes, torch.nn.Linear(3, 2), cuda_runtime, monkeypatch)
    with pytest.raises(AssertionError, match=r"device buffer: \['\(2, 3\) on cpu', '\(2,\) on cpu'\] not on the GPU"):
        check_devices(walk, cuda_runtime, "device")


def test_the_device_check_fails_on_a_host_tensor_planted_before_the_collective(fakes, one_rank, sync_buffer,
                                                                               cuda_runtime, monkeypatch):
    sync_buffer("host")
    send_from_host = background_sync._start_sending

    def start_sending(buffer, send, fail):  # the host buffer sent as it is, not staged to the GPU
        return send_from_host(buffer, lambda tensor, stream: send(tensor.to("cpu"), stream), fail)

    monkeypatch.setattr(background_sync, "_start_sending", start_sending)
    walk = walk_sync(fakes, torch.nn.Linear(3, 2), cuda_runtime, monkeypatch)
    with pytest.raises(AssertionError, match=r"NCCL broadcast: a \(2, 3\) tensor on cpu, not on the GPU"):
        check_devices(walk, cuda_runtime, "host")
    assert [r.value for r in cuda_runtime.cancelled] == ["load"]  # the sender failed as on a GPU: loads cancelled
