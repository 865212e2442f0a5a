"""Every CPU patch of the compat layer, one function each, listed in `PATCHES`.

Each names the upstream version it was written against and why it exists; each
has a test in tests/compat/ that fails when upstream changes the patched thing.
A patch runs when its module is imported (after it executes, or before with
`before_exec`), only in processes where CUDA is absent (`_gated`). Patches that run
on any hardware have their own lists: `compat.caches.PATCHES`,
`integrations.runtime.seeding.PATCHES`, `integrations.runtime.timeline_hooks.PATCHES`
(`integrations.runtime.startup` installs them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from openrlhf_oppo.hooks import Patch
from openrlhf_oppo.upstream import OPENRLHF_VERSION, ray_actor_classes

DEEPSPEED_VERSION = "0.19.6"
VLLM_VERSION = "0.29.0"
TORCH_VERSION = "2.13.0"


def _gated(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(module) -> None:
        from openrlhf_oppo.compat.env import cuda_available

        if cuda_available():
            return
        fn(module)

    return wrapper


@_gated
def flash_attn_standin(module) -> None:
    """openrlhf 0.11.2 `models/ring_attn_utils.py` imports `flash_attn.bert_padding`
    and `flash_attn.utils.distributed` at module top; flash-attn is CUDA-only.
    Register pure-torch stand-ins just before that module executes."""
    from openrlhf_oppo.compat import flash_attn_standin as standin

    standin.install()


# one function per torch attribute replaced: torch.compile's trace rules map each torch function to a rule
# and assert when one object stands under two names with different rules (set_device, synchronize)
def _set_device_on_cpu(*args, **kwargs) -> None:
    return None


def _synchronize_on_cpu(*args, **kwargs) -> None:
    return None


def _cpu_device() -> str:
    return "cpu"


@_gated
def cuda_calls_to_cpu(module) -> None:
    """openrlhf 0.11.2 calls `torch.cuda.set_device(local_rank)` (DeepspeedStrategy.
    setup_distributed), `torch.cuda.current_device()` as a tensor device (critic,
    reward, reference, actor, strategy all_reduce/all_gather) and
    `torch.cuda.synchronize()` (torch_dist_barrier_and_cuda_sync, offload paths).
    On a CPU torch these raise; redirect them to the CPU. Triggered by the import of
    `openrlhf.utils.deepspeed.deepspeed`, so only training processes are touched."""
    import torch

    torch.cuda.set_device = _set_device_on_cpu
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _synchronize_on_cpu


@_gated
def replay_buffer_on_cpu(module) -> None:
    """openrlhf 0.11.2 `NaiveReplayBuffer.__init__` builds
    `torch.device(f"cuda:{torch.cuda.current_device()}")`: keep its batches on CPU."""
    import torch

    cls = module.NaiveReplayBuffer
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0  # makes "cuda:0", a valid (unused) device string
        try:
            original_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current_device
        self.target_device = torch.device("cpu")

    cls.__init__ = __init__


def _sequential_allgather(make_config: Callable) -> Callable:
    @functools.wraps(make_config)
    def wrapper(*args, **kwargs):
        config = make_config(*args, **kwargs)
        config["zero_optimization"]["stage3_allgather_sequential"] = True
        return config

    return wrapper


@_gated
def zero3_sequential_allgather(module) -> None:
    """deepspeed 0.19.6 `Init._allgather_params_coalesced` waits only on the last of
    several async all-gathers; gloo completes them out of order, which silently
    corrupts ZeRO-3 weights at load with >= 2 ranks (1-7 corrupt loads in 12 two-rank runs
    without the fix, 0 in 36 with it). Set `stage3_allgather_sequential` in the configs
    openrlhf 0.11.2's strategy builds (`get_train_ds_config` / `get_eval_ds_config`,
    imported by name into `openrlhf.utils.deepspeed.deepspeed`)."""
    module.get_train_ds_config = _sequential_allgather(module.get_train_ds_config)
    module.get_eval_ds_config = _sequential_allgather(module.get_eval_ds_config)


@_gated
def weight_sync_sender(module) -> None:
    """openrlhf 0.11.2 `ActorPPOTrainer` syncs weights over NCCL / CUDA IPC; send
    them through Ray instead (see `openrlhf_oppo.compat.weight_sync`)."""
    from openrlhf_oppo.compat import weight_sync

    module.ActorPPOTrainer.broadcast_to_vllm = weight_sync.broadcast_to_vllm
    module.ActorPPOTrainer._init_vllm_sync_group = weight_sync.init_vllm_sync_group


@_gated
def weight_sync_receiver(module) -> None:
    """openrlhf 0.11.2 `WorkerWrap` (vLLM worker extension) receives weights over
    NCCL into a CUDA tensor and calls `model.load_weights`, which vLLM 0.29 CPU's
    repacked linears reject; receive the Ray payload and `reload_weights` instead."""
    from openrlhf_oppo.compat import weight_sync

    module.WorkerWrap.update_weight = weight_sync.worker_update_weight
    module.WorkerWrap.init_process_group = weight_sync.worker_init_process_group


@_gated
def master_port_held_until_bound(module) -> None:
    """openrlhf 0.11.2 `BaseDistributedActor._get_free_port` binds port 0, closes the socket
    and returns the port; torch.distributed's TCPStore binds it only when the model actor
    initialises, seconds later (after every group has drawn its port; under
    `--train.colocate_all`, after vLLM has started). Meanwhile an outgoing connection (Ray,
    gloo, vLLM) or another group's draw may take the same port, and the store fails with
    `DistNetworkError: ... EADDRINUSE` (seen in CI twice: the compat matrix's colocate_all run,
    then a sync run whose critic drew a port outside the ephemeral range). Draw the port outside
    that range and hold it bound until `_setup_distributed` has bound the store."""
    from openrlhf_oppo.compat import ports

    module.BaseDistributedActor._get_free_port = staticmethod(functools.partial(ports.free_port, hold=True))
    setup = module.BaseModelActor._setup_distributed

    @functools.wraps(setup)
    def _setup_distributed(self, strategy) -> None:
        try:
            setup(self, strategy)
        finally:
            ports.release(self._master_port)

    module.BaseModelActor._setup_distributed = _setup_distributed


ALL_TAGS = ("weights", "kv_cache")  # vLLM's sleep-mode tags


@_gated
def vllm_sleep_standin(module) -> None:
    """vllm 0.29's CPU build has no sleep mode (`is_sleep_mode_available` is CUDA/ROCm/XPU
    only: `enable_sleep_mode` fails the engine's start), and openrlhf 0.11.2's hybrid engine
    (`--vllm.enable_sleep`) starts `RolloutRayActor`s with it and calls their `sleep` /
    `wake_up`. Stand in for what a run must survive: the engine starts without it; `sleep`
    aborts whatever still decodes and drops the KV and prefix caches (vLLM's level 1 discards
    the KV cache and moves the weights to host memory, where they are already); scheduling
    resumes once every tag is awake, and a second `sleep` or `wake_up` does nothing, as vLLM's
    executor behaves. Set on the class under `@ray.remote` (what OPPO's rollout actor
    subclasses) and on Ray's subclass, whose wrappers OpenRLHF's own engines run."""
    plain, wrapped = ray_actor_classes(module.RolloutRayActor)
    init = plain.__init__

    @functools.wraps(init)
    async def __init__(self, *args, **kwargs):
        self._sleeping_tags = set()
        kwargs.pop("enable_sleep_mode", None)
        await init(self, *args, **kwargs)

    async def sleep(self, level: int = 1) -> None:
        if not self._sleeping_tags:
            await self.llm.pause_generation(mode="abort", clear_cache=True)
            self._sleeping_tags = set(ALL_TAGS)

    async def wake_up(self, tags=None) -> None:
        if self._sleeping_tags:
            self._sleeping_tags -= set(tags or ALL_TAGS)
            if not self._sleeping_tags:
                await self.llm.resume_generation()

    for cls in (plain, wrapped):
        cls.__init__ = __init__
        cls.sleep = sleep
        cls.wake_up = wake_up


# The columns each dataset class keeps (openrlhf 0.11.2, `self.<attr> = processed_dataset[...]`).
DATASET_COLUMNS = {
    "RewardDataset": ("prompts", "chosens", "rejects", "extras"),
    "SFTDataset": ("prompts", "responses", "prompt_ids_lens", "response_ranges"),
}


@_gated
def dataset_columns_as_lists(module) -> None:
    """openrlhf 0.11.2 `RewardDataset` / `SFTDataset` keep `processed_dataset["prompt"]` & co.,
    written when `datasets` returned a list there. datasets >= 4 returns a lazy `Column`, so
    `__getitem__` does four Arrow selects per sample: about 2 ms a pair here, a third of
    train_rm's step on the learn task (64 pairs: 0.41 -> 0.28 s). Keep them as lists."""
    for name, attrs in DATASET_COLUMNS.items():
        cls = getattr(module, name, None)
        if cls is None:
            continue
        original_init = cls.__init__

        def __init__(self, *args, _init=original_init, _attrs=attrs, **kwargs):
            _init(self, *args, **kwargs)
            for attr in _attrs:
                column = getattr(self, attr, None)
                if column is not None and not isinstance(column, list):
                    setattr(self, attr, list(column))

        cls.__init__ = functools.wraps(original_init)(__init__)


# every fn already gated on CUDA absence
PATCHES: tuple[Patch, ...] = (
    Patch("flash_attn_standin", "openrlhf.models.ring_attn_utils", flash_attn_standin,
          f"openrlhf {OPENRLHF_VERSION}", before_exec=True),
    Patch("cuda_calls_to_cpu", "openrlhf.utils.deepspeed.deepspeed", cuda_calls_to_cpu, f"openrlhf {OPENRLHF_VERSION}"),
    Patch("replay_buffer_on_cpu", "openrlhf.trainer.ppo_utils.replay_buffer", replay_buffer_on_cpu,
          f"openrlhf {OPENRLHF_VERSION}"),
    Patch("zero3_sequential_allgather", "openrlhf.utils.deepspeed.deepspeed", zero3_sequential_allgather,
          f"deepspeed {DEEPSPEED_VERSION}, openrlhf {OPENRLHF_VERSION}"),
    Patch("weight_sync_sender", "openrlhf.trainer.ray.ppo_actor", weight_sync_sender, f"openrlhf {OPENRLHF_VERSION}"),
    Patch("weight_sync_receiver", "openrlhf.trainer.ray.vllm_worker_wrap", weight_sync_receiver,
          f"openrlhf {OPENRLHF_VERSION}, vllm {VLLM_VERSION}"),
    Patch("vllm_sleep_standin", "openrlhf.trainer.ray.vllm_engine", vllm_sleep_standin,
          f"openrlhf {OPENRLHF_VERSION}, vllm {VLLM_VERSION}"),
    Patch("master_port_held_until_bound", "openrlhf.trainer.ray.launcher", master_port_held_until_bound,
          f"openrlhf {OPENRLHF_VERSION}"),
    # one name per target module: install_hooks installs a name once per process
    *(Patch(f"dataset_columns_as_lists.{module}", f"openrlhf.datasets.{module}", dataset_columns_as_lists,
            f"openrlhf {OPENRLHF_VERSION}, datasets >= 4") for module in ("reward_dataset", "sft_dataset")),
)
