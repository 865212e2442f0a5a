"""OPPO's OpenRLHF touch points exist with the shapes OPPO relies on (OpenRLHF 0.11.2).

Fails when upstream renames or reshapes any of them; imports OpenRLHF with the
CPU compat layer (flash-attn stand-in) where CUDA is absent.
"""

from __future__ import annotations

import inspect

import pytest

from openrlhf_oppo import compat

compat.apply()

ppo_trainer = pytest.importorskip("openrlhf.trainer.ppo_trainer")
vllm_engine = pytest.importorskip("openrlhf.trainer.ray.vllm_engine")
samples_generator = pytest.importorskip("openrlhf.trainer.ppo_utils.samples_generator")


def test_train_ppo_ray_looks_up_the_trainer_class_at_call_time():
    from openrlhf.cli import train_ppo_ray

    src = inspect.getsource(train_ppo_ray.train)
    assert "from openrlhf.trainer.ppo_trainer import PPOTrainer" in src
    assert "PPOTrainer.remote(" in src and "create_vllm_engines(" in src
    base = ppo_trainer.PPOTrainer.__ray_metadata__.modified_class.__mro__[1]
    assert base.__name__ == "PPOTrainer" and issubclass(base, ppo_trainer.BasePPOTrainer)
    init = inspect.getsource(base.__init__)
    assert "self.samples_generator = SamplesGenerator(" in init
    for attr in ("strategy", "prompts_dataloader", "eval_dataloader", "tokenizer", "vllm_engines"):
        assert f"self.{attr}" in inspect.getsource(samples_generator.SamplesGenerator.__init__)


def test_create_vllm_engines_uses_the_module_level_rollout_actor():
    assert "RolloutRayActor.options(" in inspect.getsource(vllm_engine.create_vllm_engines)
    base = vllm_engine.RolloutRayActor.__ray_metadata__.modified_class
    for name in ("pause_generation", "resume_generation", "update_weight", "generate"):
        assert callable(getattr(base, name))
    assert "self.llm = vllm.AsyncLLMEngine" in inspect.getsource(base.__init__)


def test_base_trainer_methods_oppo_wraps():
    base = ppo_trainer.BasePPOTrainer

    def params(fn):  # Ray's tracing may append `_ray_trace_ctx`
        return [p for p in inspect.signature(fn).parameters if p != "_ray_trace_ctx"]

    assert params(base.train_step) == ["self", "rollout_samples", "global_step"]
    assert params(base.broadcast_to_vllm) == ["self"]
    assert params(base.save_logs_and_checkpoints) == ["self", "global_step", "logs_dict", "client_states"]
    assert params(base.restore_best_checkpoint_state) == ["self", "checkpoint_states"]
    # OpenRLHF skips its reward forward when samples carry rewards
    from openrlhf.trainer.ppo_utils import experience_maker

    assert "use_reward_model = samples_list[0].rewards is None" in inspect.getsource(
        experience_maker.RemoteExperienceMaker.make_experience
    )


def test_generator_contract():
    sg = samples_generator.SamplesGenerator
    assert list(inspect.signature(sg.generate_samples).parameters) == ["self", "generate_kwargs"]
    params = inspect.signature(sg._process_response_into_experience).parameters
    assert list(params) == ["self", "response", "generate_kwargs"]
    src = inspect.getsource(sg._process_response_into_experience)
    for key in ("observation_tokens", "action_ranges", "rollout_log_probs", "reward", "scores", "truncated"):
        assert f'"{key}"' in src


def test_patch_driver_swaps_both_classes():
    from openrlhf_oppo.integrations import oppo_trainer

    saved = ppo_trainer.PPOTrainer, vllm_engine.RolloutRayActor
    try:
        oppo_trainer.patch_driver()
        assert ppo_trainer.PPOTrainer is oppo_trainer.OppoPPOTrainer
        assert vllm_engine.RolloutRayActor.__ray_metadata__.modified_class.__mro__[1].__name__ == "OppoRolloutActor"
        impl = oppo_trainer.OppoPPOTrainerImpl
        for name in ("train_step", "broadcast_to_vllm", "save_logs_and_checkpoints", "restore_best_checkpoint_state"):
            assert name in vars(impl)  # overridden in the subclass, not patched in place
    finally:
        ppo_trainer.PPOTrainer, vllm_engine.RolloutRayActor = saved


def test_incompatible_flags_name_both_flags():
    from openrlhf_oppo.cli.train_ppo_ray import check_flags, parse

    cfg, rest = parse(["--train.async_enable", "--oppo.delta.init", "2"])
    assert cfg.delta.init == 2 and rest == ["--train.async_enable"]
    with pytest.raises(ValueError, match=r"--train\.async_enable cannot be combined with OPPO"):
        check_flags(rest, cfg)
    cfg, rest = parse(["--rollout.vllm_generate_batch_size", "8"])
    with pytest.raises(ValueError, match=r"--rollout\.vllm_generate_batch_size .* --oppo\.delta\.enable"):
        check_flags(rest, cfg)
    cfg, rest = parse(["--vllm.enable_sleep"])
    with pytest.raises(ValueError, match=r"--vllm\.enable_sleep"):
        check_flags(rest, cfg)
    check_flags(["--rollout.batch_size", "4"], cfg)  # fine


def _prompt_loader(seed: int):
    """A prompt dataloader built as OpenRLHF's `setup_dataloader` builds it on the driver."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    def collate(items):
        return [None] * len(items), [p for p, _ in items], [lb for _, lb in items], [None] * len(items)

    torch.manual_seed(seed)  # OpenRLHF's strategy.set_seed(train.seed)
    data = [(f"prompt {i}", f"label {i}") for i in range(6)]
    return StatefulDataLoader(data, batch_size=1, shuffle=True, drop_last=True, collate_fn=collate)


def test_prompt_stream_draws_openrlhfs_prompt_order_and_resumes_from_the_dataloader_state():
    from openrlhf_oppo.integrations.oppo_generator import PromptStream

    stream = PromptStream(_prompt_loader(42))
    drawn = [stream.next() for _ in range(12)]
    # what OpenRLHF's SamplesGenerator draws, one pass per iterator
    loader = _prompt_loader(42)
    expected = []
    for _ in range(2):
        it = iter(loader)
        while True:
            prompts, labels, _, exhausted = samples_generator._collect_prompt_batch(it, 1)
            if exhausted:
                break
            expected += list(zip(prompts, labels))
    assert drawn == expected
    assert sorted(drawn[:6]) == sorted(drawn[6:]) and drawn[:6] != drawn[6:]  # each pass reshuffles

    # a checkpoint between steps holds the dataloader state; a fresh run loads it
    first = PromptStream(_prompt_loader(42))
    head = [first.next() for _ in range(4)]
    resumed_loader = _prompt_loader(0)  # a different RNG: the state alone must restore the order
    resumed_loader.load_state_dict(first.dataloader.state_dict())
    resumed = PromptStream(resumed_loader)
    assert head + [resumed.next() for _ in range(2)] == drawn[:6]


def test_streaming_replaces_openrlhfs_reward_group_and_correction_maps_to_openrlhf_flags():
    from openrlhf_oppo.cli.train_ppo_ray import STREAMING_REWARD_URL, openrlhf_argv, parse

    cfg, rest = parse(["--reward.model_name_or_path", "/rm", "--oppo.staleness.correction", "icepop"])
    argv = openrlhf_argv(rest, cfg)
    assert argv[argv.index("--reward.remote_url") + 1] == STREAMING_REWARD_URL
    assert argv[argv.index("--critic.model_name_or_path") + 1] == "/rm"  # OpenRLHF's default kept
    assert argv[argv.index("--algo.advantage.is_correction_mode") + 1] == "mask"
    cfg, rest = parse(["--reward.model_name_or_path", "/rm", "--oppo.streaming.enable", "false"])
    assert openrlhf_argv(rest, cfg) == rest  # OpenRLHF's own reward group scores
    cfg, rest = parse(["--oppo.staleness.correction", "tis", "--algo.advantage.is_correction_level", "seq"])
    with pytest.raises(ValueError, match=r"--oppo\.staleness\.correction .* --algo\.advantage\.is_correction_level"):
        openrlhf_argv(rest, cfg)


def test_unwired_reference_and_critic_streaming_are_refused_by_name():
    from openrlhf_oppo.cli.train_ppo_ray import check_flags, parse

    for name in ("reference", "critic"):
        cfg, rest = parse([f"--oppo.streaming.{name}", "true"])
        with pytest.raises(ValueError, match=rf"--oppo\.streaming\.{name}: this version streams into the reward model only"):
            check_flags(rest, cfg)
