"""OPPO's OpenRLHF touch points exist with the shapes OPPO relies on (OpenRLHF 0.11.2).

Fails when upstream renames or reshapes any of them; imports OpenRLHF with the
CPU compat layer (flash-attn stand-in) where CUDA is absent.
"""

from __future__ import annotations

import inspect
import re

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


@pytest.mark.parametrize("stream_rewards,stream_reference,background", [
    (True, True, False), (True, False, False), (False, False, False), (False, False, True)])
def test_patch_driver_swaps_the_classes(stream_rewards, stream_reference, background):
    from openrlhf.trainer.ray import launcher, ppo_actor

    from openrlhf_oppo.integrations.runtime import trainer as oppo_trainer

    saved = (ppo_trainer.PPOTrainer, vllm_engine.RolloutRayActor, launcher.RewardModelActor,
             launcher.ReferenceModelActor, ppo_actor.PolicyModelActor)
    try:
        oppo_trainer.patch_driver(stream_rewards, stream_reference, sync_in_background=background)
        policy = ppo_actor.PolicyModelActor.__ray_metadata__.modified_class.__mro__[1]
        assert policy.__name__ == ("BackgroundSyncPolicyModelActor" if background else "PolicyModelActor")
        assert ppo_trainer.PPOTrainer is oppo_trainer.OppoPPOTrainer
        assert vllm_engine.RolloutRayActor.__ray_metadata__.modified_class.__mro__[1].__name__ == "OppoRolloutActor"
        reward = launcher.RewardModelActor.__ray_metadata__.modified_class
        assert reward.__name__ == ("StreamingRewardModelActor" if stream_rewards else "RewardModelActor")
        ref = launcher.ReferenceModelActor.__ray_metadata__.modified_class
        assert ref.__name__ == ("StreamingReferenceModelActor" if stream_reference else "ReferenceModelActor")
        impl = oppo_trainer.OppoPPOTrainerImpl
        for name in ("train_step", "broadcast_to_vllm", "save_logs_and_checkpoints", "restore_best_checkpoint_state"):
            assert name in vars(impl)  # overridden in the subclass, not patched in place
    finally:
        (ppo_trainer.PPOTrainer, vllm_engine.RolloutRayActor, launcher.RewardModelActor,
         launcher.ReferenceModelActor, ppo_actor.PolicyModelActor) = saved


def test_make_experience_takes_the_reference_from_dispatch_forward_and_flattens_it_by_duplicate_factor():
    """What `reference.streamed_reference_forward` relies on: the reference log-probs come from one
    `_dispatch_forward(self.initial_model_group, ...)` call with the padded micro-batches as
    keyword lists, through `_flatten_results(..., duplicate_factor)`."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    src = inspect.getsource(RemoteExperienceMaker.make_experience)
    assert "self._dispatch_forward(\n                self.initial_model_group," in src
    assert "sequences=sequences_list, action_mask=action_mask_list, attention_mask=attention_mask_list" in src
    assert "self._flatten_results(base_action_log_probs_ref, duplicate_factor)" in src
    assert "duplicate_factor = args.ds.ring_attn_size * args.ds.tensor_parallel_size" in src
    assert "ray.get(refs)[::duplicate_factor]" in inspect.getsource(RemoteExperienceMaker._flatten_results)


def test_openrlhfs_reward_group_is_built_from_the_launcher_module_name_and_placed_by_it():
    """train_ppo_ray imports RewardModelActor from the launcher module when it runs, and places
    the group as it places its own (colocated: a share of the placement group)."""
    from openrlhf.cli import train_ppo_ray
    from openrlhf.trainer.ray import launcher

    module_src = inspect.getsource(train_ppo_ray)
    assert "from openrlhf.trainer.ray.launcher import (" in module_src and "RewardModelActor," in module_src
    train_src = inspect.getsource(train_ppo_ray.train)
    assert "RewardModelActor,\n            pg=pg,\n            num_gpus_per_actor=0.2 if pg else 1," in train_src
    assert "reward_model.async_init_model_from_pretrained(strategy, args.reward.model_name_or_path)" in train_src
    assert "self._actor_handlers" in inspect.getsource(launcher.RayActorGroup._initiate_actors)
    from openrlhf_oppo.integrations.runtime.scorer import StreamingRewardModelActor

    assert issubclass(StreamingRewardModelActor, launcher.BaseModelActor)
    init = launcher.RewardModelActor.__ray_metadata__.modified_class.init_model_from_pretrained
    assert [p for p in inspect.signature(init).parameters if p != "_ray_trace_ctx"] == ["self", "strategy", "pretrain"]


def test_rule_rewards_come_from_openrlhfs_single_turn_executor():
    """The engines score a finished sample as OpenRLHF's executor does (oppo_rollout._reward)."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    for name in ("reward_func", "reward_endpoints", "_fetch_rewards_via_func", "_fetch_rewards_via_http"):
        assert name in inspect.getsource(SingleTurnAgentExecutor)
    execute = inspect.getsource(SingleTurnAgentExecutor.execute)
    assert 'hf_tokenizer.decode(output["observation_tokens"], skip_special_tokens=False)' in execute
    assert "self.executor = SingleTurnAgentExecutor(remote_rm_url)" in inspect.getsource(
        vllm_engine.RolloutRayActor.__ray_metadata__.modified_class.__init__)


def test_incompatible_flags_name_both_flags():
    from openrlhf_oppo.cli.train_ppo_ray import check_flags, parse

    cfg, rest = parse(["--train.async_enable", "--oppo.delta.init", "2"])
    assert cfg.delta.init == 2 and rest == ["--train.async_enable"]
    with pytest.raises(ValueError, match=r"--train\.async_enable with OPPO needs --oppo\.staleness\.max_policy_lag"):
        check_flags(rest, cfg)
    check_flags(["--train.async_enable", "--train.colocate_all"], parse(["--oppo.staleness.max_policy_lag", "2"])[0])
    cfg, rest = parse(["--train.async_enable", "--rollout.vllm_generate_batch_size", "8",
                       "--oppo.delta.enable", "false", "--oppo.staleness.max_policy_lag", "1"])
    with pytest.raises(ValueError, match=r"--rollout\.vllm_generate_batch_size cannot be combined .*async_enable"):
        check_flags(rest, cfg)  # OpenRLHF's over-sampling would be ignored, not refused by OpenRLHF's own check
    cfg, rest = parse(["--rollout.vllm_generate_batch_size", "8"])
    with pytest.raises(ValueError, match=r"--rollout\.vllm_generate_batch_size .* --oppo\.delta\.enable"):
        check_flags(rest, cfg)
    cfg, rest = parse(["--vllm.enable_sleep", "--oppo.staleness.max_policy_lag", "2"])
    with pytest.raises(ValueError, match=r"--vllm\.enable_sleep cannot .* --oppo\.staleness\.max_policy_lag 2"):
        check_flags(rest, cfg)
    check_flags(["--rollout.batch_size", "4", "--reward.model_name_or_path", "/rm"], cfg)  # fine


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
    from openrlhf_oppo.integrations.runtime.prompt_stream import PromptStream

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


def test_openrlhf_gets_the_users_flags_and_the_correction_oppo_maps_to():
    from openrlhf_oppo.cli.train_ppo_ray import openrlhf_argv, parse, streams_rewards

    cfg, rest = parse(["--reward.model_name_or_path", "/rm", "--oppo.staleness.correction", "icepop"])
    argv = openrlhf_argv(rest, cfg)
    assert argv[:2] == ["--reward.model_name_or_path", "/rm"] and "--reward.remote_url" not in argv
    assert argv[argv.index("--algo.advantage.is_correction_mode") + 1] == "mask"
    assert streams_rewards(rest, cfg)  # OpenRLHF's reward group is made of streaming actors
    cfg, rest = parse(["--reward.model_name_or_path", "/rm", "--oppo.streaming.enable", "false"])
    assert openrlhf_argv(rest, cfg) == rest and not streams_rewards(rest, cfg)  # OpenRLHF's own reward group
    cfg, rest = parse(["--reward.remote_url", "/r.py"])
    assert not streams_rewards(rest, cfg)  # the engines score with the function
    cfg, rest = parse(["--oppo.staleness.correction", "tis", "--algo.advantage.is_correction_level", "seq",
                       "--reward.model_name_or_path", "/rm"])
    with pytest.raises(ValueError, match=r"--oppo\.staleness\.correction .* --algo\.advantage\.is_correction_level"):
        openrlhf_argv(rest, cfg)


def test_unwired_critic_streaming_is_refused_and_the_simulators_projections_are_not_oppo_flags():
    from openrlhf_oppo.cli.train_ppo_ray import check_flags, parse

    cfg, rest = parse(["--oppo.streaming.critic", "true"])
    with pytest.raises(ValueError, match=r"--oppo\.streaming\.critic: this version streams into the reward model "
                                         r"and the reference only"):
        check_flags(rest, cfg)
    for projection in ("reference_actors", "experience_ahead"):  # the simulator's, not OPPO's settings
        cfg, rest = parse([f"--oppo.streaming.{projection}", "true"])
        assert rest == [f"--oppo.streaming.{projection}", "true"]  # left to OpenRLHF's parser, which refuses it
        assert not hasattr(cfg.streaming, projection)
    cfg, rest = parse(["--oppo.streaming.reference", "true"])
    check_flags(rest, cfg)  # streamed into OpenRLHF's reference group


LAG2 = ["--oppo.staleness.max_policy_lag", "2"]


@pytest.mark.parametrize("flags,refused", [
    ([], r"needs --oppo\.staleness\.max_policy_lag >= 1"),
    ([*LAG2, "--oppo.megatron.enable", "true"], r"cannot be combined with --oppo\.megatron"),
    ([*LAG2, "--train.colocate_all"], r"with --train\.colocate_all needs --train\.async_enable"),
    ([*LAG2, "--train.colocate_all", "--train.async_enable"], None),
    (["--oppo.staleness.max_policy_lag", "1", "--oppo.delta.enable", "false"], None),  # vLLM on GPUs of its own
])
def test_background_sync_runs_where_there_is_something_to_overlap_and_is_refused_by_name_elsewhere(flags, refused):
    from openrlhf_oppo.cli.train_ppo_ray import check_flags, parse

    cfg, rest = parse(["--oppo.staleness.background_sync", "true", *flags])
    if refused is None:
        check_flags(rest, cfg)
        return
    with pytest.raises(ValueError, match=r"--oppo\.staleness\.background_sync true " + refused):
        check_flags(rest, cfg)


def test_a_host_sync_buffer_is_refused_with_rays_collective_and_named(capsys):
    from openrlhf_oppo.cli.train_ppo_ray import check_flags, parse

    host = ["--oppo.staleness.background_sync", "true", "--oppo.staleness.background_sync_buffer", "host", *LAG2,
            "--train.colocate_all", "--train.async_enable"]
    check_flags(*reversed(parse(host)))  # OpenRLHF's own NCCL group: runs
    cfg, rest = parse([*host, "--vllm.sync_with_ray"])
    with pytest.raises(ValueError, match=r"--oppo\.staleness\.background_sync_buffer host cannot be combined with "
                                         r"--vllm\.sync_with_ray"):
        check_flags(rest, cfg)
    with pytest.raises(SystemExit):
        parse(["--oppo.staleness.background_sync_buffer", "disk"])
    assert "--oppo.staleness.background_sync_buffer: invalid choice: 'disk' (choose from 'device', 'host', " \
           "'shards')" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "refused"), [
    (["--ds.zero_stage", "3"], None),
    ([], r"needs --ds\.zero_stage 3 \(got 2 \(OpenRLHF's default\)\)"),
    (["--ds.zero_stage", "2"], r"needs --ds\.zero_stage 3 \(got 2\)"),
    (["--ds.zero_stage", "3", "--ds.tensor_parallel_size", "2"],
     r"cannot be combined with --ds\.tensor_parallel_size 2: AutoTP's sliced layers are not ZeRO-3 partitions"),
    (["--ds.zero_stage", "3", "--vllm.sync_with_ray"], r"cannot be combined with --vllm\.sync_with_ray"),
], ids=["zero3", "default-stage", "zero2", "autotp", "ray-collective"])
def test_a_sharded_sync_buffer_needs_zero3_partitions_and_openrlhfs_nccl_group(flags, refused):
    from openrlhf_oppo.cli.train_ppo_ray import check_flags, parse

    cfg, rest = parse(["--oppo.staleness.background_sync", "true", "--oppo.staleness.background_sync_buffer",
                       "shards", *LAG2, *flags])
    if refused is None:
        check_flags(rest, cfg)
        return
    with pytest.raises(ValueError, match=r"--oppo\.staleness\.background_sync_buffer shards " + refused):
        check_flags(rest, cfg)


REFUSALS = [  # (flag and value, text of the refusal, flags beside it)
    (["--train.async_enable"], r"--train\.async_enable with OPPO needs --oppo\.staleness\.max_policy_lag >= 1", []),
    (["--train.partial_rollout_enable"], r"--train\.partial_rollout_enable cannot be combined with OPPO", []),
    (["--vllm.enable_sleep"], r"--vllm\.enable_sleep cannot be combined with --oppo\.staleness\.max_policy_lag",
     ["--oppo.staleness.max_policy_lag", "2"]),
    (["--algo.dynamic_filtering_enable"], r"--algo\.dynamic_filtering_enable cannot be combined with OPPO", []),
    (["--train.agent_func_path", "/a.py"], r"--train\.agent_func_path cannot be combined with OPPO", []),
    (["--data.max_images_per_prompt", "2"], r"--data\.max_images_per_prompt cannot be combined with OPPO.*images", []),
    (["--reward.offload"], r"--reward\.offload cannot be combined with --oppo\.streaming\.enable",
     ["--reward.model_name_or_path", "/rm"]),
    (["--ds.load_in_4bit"], r"--ds\.load_in_4bit cannot be combined with --oppo\.streaming\.enable",
     ["--reward.model_name_or_path", "/rm"]),
    (["--eval.dataset", "/e.jsonl"], r"--eval\.dataset needs --reward\.remote_url",
     ["--reward.model_name_or_path", "/rm"]),
    (["--vllm.enable_prefix_caching"], r"--vllm\.enable_prefix_caching cannot be combined", []),
    (["--algo.kl.init_coef", "0"], r"--oppo\.streaming\.reference true needs --algo\.kl\.init_coef > 0 \(got 0\)",
     ["--oppo.streaming.reference", "true"]),
    (["--ref.offload"], r"--ref\.offload cannot be combined with --oppo\.streaming\.reference true",
     ["--oppo.streaming.reference", "true"]),
    (["--ds.load_in_4bit"], r"--ds\.load_in_4bit cannot be combined with --oppo\.streaming\.reference true",
     ["--oppo.streaming.reference", "true", "--oppo.streaming.reward", "false"]),
    (["--rollout.vllm_generate_batch_size", "8"], r"--rollout\.vllm_generate_batch_size cannot be combined", []),
    *[([flag, *value], re.escape(flag) + r" cannot be combined with --oppo\.megatron\.enable",
       ["--oppo.megatron.enable", "true", "--oppo.streaming.enable", "false"])
      for flag, *value in (["--train.colocate_all"], ["--ds.enable_sleep"], ["--ds.tensor_parallel_size", "2"],
                           ["--ds.ring_attn_size", "2"], ["--ds.packing_samples"], ["--train.dynamic_batch_enable"],
                           ["--train.enable_ema"], ["--ds.lora.rank", "8"], ["--ds.load_in_4bit"],
                           ["--actor.entropy_coef", "0.01"], ["--actor.aux_loss_coef", "0.01"])],
]


@pytest.mark.parametrize("flag, message, beside", REFUSALS, ids=[r[0][0] for r in REFUSALS])
def test_every_refused_flag_is_openrlhfs_and_is_refused_by_name(flag, message, beside):
    from openrlhf_oppo.cli import train_ppo_ray
    from openrlhf_oppo.integrations.launch.openrlhf_flags import train_flags

    assert flag[0][2:] in train_flags(), f"{flag[0]} is not a flag of OpenRLHF's train_ppo_ray"
    cfg, rest = train_ppo_ray.parse(beside + flag)
    with pytest.raises(ValueError, match=message):
        train_ppo_ray.check_flags(rest, cfg)


def test_the_refusal_tables_are_all_tested():
    from openrlhf_oppo.cli import train_ppo_ray

    tested = {r[0][0] for r in REFUSALS}
    assert (set(train_ppo_ray.INCOMPATIBLE_FLAGS) | set(train_ppo_ray.STREAMING_REWARD_INCOMPATIBLE)
            | set(train_ppo_ray.STREAMING_REFERENCE_INCOMPATIBLE) | set(train_ppo_ray.MEGATRON_INCOMPATIBLE)) <= tested


def test_megatron_refuses_another_optimizer_and_a_group_its_parallel_sizes_do_not_divide():
    from openrlhf_oppo.cli import train_ppo_ray

    on = ["--oppo.megatron.enable", "true", "--oppo.megatron.tensor_parallel_size", "2"]
    cfg, rest = train_ppo_ray.parse([*on, "--actor.optim", "muon"])
    with pytest.raises(ValueError, match=r"--actor\.optim muon cannot be combined with --oppo\.megatron\.enable"):
        train_ppo_ray.check_flags(rest, cfg)
    cfg, rest = train_ppo_ray.parse([*on, "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "3"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 x .*pipeline_parallel_size 1 must divide the "
                                         r"actor's 3 ranks"):
        train_ppo_ray.check_flags(rest, cfg)
    cfg, rest = train_ppo_ray.parse([*on, "--actor.num_nodes", "2", "--actor.num_gpus_per_node", "1"])
    train_ppo_ray.check_flags(rest, cfg)  # 2 ranks: one tensor-parallel pair


def test_what_oppo_accepts_that_it_used_to_refuse():
    from openrlhf_oppo.cli import train_ppo_ray

    for argv in (["--reward.remote_url", "/r.py"], ["--reward.remote_url", "http://127.0.0.1:5000/get_reward"],
                 ["--reward.remote_url", "/r.py", "--eval.dataset", "/e.jsonl"],
                 ["--reward.model_name_or_path", "/rm", "--oppo.streaming.enable", "false", "--reward.offload"],
                 ["--reward.model_name_or_path", "/rm", "--data.max_images_per_prompt", "0"],
                 ["--reward.model_name_or_path", "/rm", "--train.colocate_all", "--vllm.enable_sleep",
                  "--ds.enable_sleep"]):
        cfg, rest = train_ppo_ray.parse(argv)
        train_ppo_ray.check_flags(rest, cfg)
    cfg, rest = train_ppo_ray.parse([])
    with pytest.raises(ValueError, match=r"set --reward\.model_name_or_path \(or --reward\.remote_url"):
        train_ppo_ray.openrlhf_argv(rest, cfg)
