"""OPPO's drop-in for OpenRLHF's entry point: every OpenRLHF flag plus `--oppo.*`.

    python -m openrlhf_oppo.cli.train_ppo_ray [--config preset.yaml] <OpenRLHF 0.11.2 flags> \\
        --oppo.delta.init 8 --oppo.chunk.size_tokens 512

Launch it as OpenRLHF users launch `openrlhf.cli.train_ppo_ray` (e.g. `ray job
submit ... -- python -m openrlhf_oppo.cli.train_ppo_ray ...`). It resolves the
OPPO config (a `--config` YAML preset: OpenRLHF's sections as dotted flags plus
`oppo:`; flags on the command line override it), rejects flag combinations OPPO
cannot honour, makes wandb offline when it is configured without a key, starts Ray with a
worker set-up hook that installs OPPO's trainer touch points, swaps the rollout
actor class, and then runs OpenRLHF's own `train_ppo_ray` main unmodified.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import sys

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo import run_env, settings
from openrlhf_oppo.integrations.launch import worker_hooks

OPENRLHF_MODULE = "openrlhf.cli.train_ppo_ray"
ENTRY_MODULE = "openrlhf_oppo.cli.train_ppo_ray"  # the thin entry point over this module
PROG = f"python -m {ENTRY_MODULE}"

# (OpenRLHF flag, why OPPO cannot run with it)
INCOMPATIBLE_FLAGS = {
    "--train.partial_rollout_enable": "OPPO carries partial rollouts itself",
    "--algo.dynamic_filtering_enable": "OPPO trains the first B complete groups; filtering would change B",
    "--train.agent_func_path": "OPPO drives single-turn generation itself (agent executors are not streamed)",
    "--data.max_images_per_prompt": "OPPO's rollout streams text prompts; images would be dropped",
}
# refused only when OPPO streams into the reward model (its actors hold it on the device, bf16/fp16)
STREAMING_REWARD_INCOMPATIBLE = {
    "--reward.offload": "the streaming reward actors keep the reward model and its KV caches on the device",
    "--ds.load_in_4bit": "the streaming reward actors load the reward model in --ds.param_dtype, not 4-bit",
}
# refused only when OPPO streams into the reference (its actors hold the whole reference on the device)
STREAMING_REFERENCE_INCOMPATIBLE = {
    "--ref.offload": "the streaming reference actors keep the reference and its KV caches on the device",
    "--ds.load_in_4bit": "the streaming reference actors load the reference in --ds.param_dtype, not 4-bit",
}

# refused with --oppo.megatron.enable (the Megatron actor trains padded text batches with Adam)
MEGATRON_INCOMPATIBLE = {
    "--train.colocate_all": "the Megatron actor syncs weights through OpenRLHF's NCCL group, not CUDA IPC: "
                            "place vLLM on GPUs of its own",
    "--ds.enable_sleep": "the Megatron actor has no sleep mode",
    "--ds.tensor_parallel_size": "the Megatron actor's tensor parallelism is --oppo.megatron.tensor_parallel_size",
    "--ds.ring_attn_size": "the Megatron actor has no ring attention",
    "--ds.packing_samples": "the Megatron actor trains padded batches",
    "--train.dynamic_batch_enable": "the Megatron actor trains micro-batches of --train.micro_batch_size samples",
    "--train.enable_ema": "the Megatron actor keeps no EMA copy",
    "--ds.lora.rank": "the Megatron actor trains every weight",
    "--ds.load_in_4bit": "the Megatron actor loads the checkpoint in --ds.param_dtype",
    "--actor.entropy_coef": "the Megatron actor's loss is OpenRLHF's PPO and KL losses only",
    "--actor.aux_loss_coef": "the Megatron actor maps dense models only",
}


def streams_rewards(argv: list[str], cfg: oppo_config.OppoConfig) -> bool:
    """Whether OPPO's streaming reward actors take the place of OpenRLHF's reward group: a
    reward model and streaming on (a `--reward.remote_url` reward is scored by the engines)."""
    return not _given("--reward.remote_url", argv) and cfg.streaming.enable and cfg.streaming.reward


def _given(flag: str, argv: list[str]) -> bool:
    for i, arg in enumerate(argv):
        if arg == flag or arg.startswith(flag + "="):
            nxt = argv[i + 1] if i + 1 < len(argv) and arg == flag else "true"
            return nxt.lower() not in ("false", "0", "none", "")
    return False


def check_flags(argv: list[str], cfg: oppo_config.OppoConfig) -> None:
    """ValueError naming both flags for combinations OPPO cannot honour."""
    for flag, why in INCOMPATIBLE_FLAGS.items():
        if _given(flag, argv):
            raise ValueError(f"{flag} cannot be combined with OPPO ({PROG}): {why}")
    if _given("--train.async_enable", argv) and not cfg.staleness.max_policy_lag:
        raise ValueError(
            "--train.async_enable with OPPO needs --oppo.staleness.max_policy_lag >= 1: OPPO's async admission "
            "then takes the place of OpenRLHF's async trainer, in its layout (vLLM on GPUs of its own; with "
            "--train.colocate_all the DeepSpeed models share theirs). Add --oppo.staleness.max_policy_lag 2, "
            "or drop --train.async_enable for OPPO on top of synchronous PPO"
        )
    if cfg.streaming.critic:
        raise ValueError("--oppo.streaming.critic: this version streams into the reward model and the reference "
                         "only (OpenRLHF computes values one-shot); leave it false")
    if cfg.staleness.background_sync:
        _check_background_sync(cfg, argv)
    if "reference" in cfg.streaming.scorers():
        kl = flag_value("--algo.kl.init_coef", argv)
        if kl is not None and float(kl) <= 0:
            raise ValueError(f"--oppo.streaming.reference true needs --algo.kl.init_coef > 0 (got {kl}): "
                             f"OpenRLHF builds its reference group only then")
        for flag, why in STREAMING_REFERENCE_INCOMPATIBLE.items():
            if _given(flag, argv):
                raise ValueError(f"{flag} cannot be combined with --oppo.streaming.reference true: {why}")
    if _given("--vllm.enable_prefix_caching", argv) and cfg.staleness.keep_kv_cache:
        raise ValueError(
            "--vllm.enable_prefix_caching cannot be combined with --oppo.staleness.keep_kv_cache true: "
            "carried requests keeping their KV blocks across a weight sync stop vLLM's prefix-cache reset "
            "(new prompts would reuse the old policy's KV); set --oppo.staleness.keep_kv_cache false"
        )
    if _given("--vllm.enable_sleep", argv) and cfg.staleness.max_policy_lag:
        raise ValueError(
            f"--vllm.enable_sleep cannot be combined with --oppo.staleness.max_policy_lag "
            f"{cfg.staleness.max_policy_lag}: asleep, the engines decode nothing while the models train, "
            f"so nothing is admitted early; set --oppo.staleness.max_policy_lag 0 (async admission is for "
            f"vLLM on its own GPUs)"
        )
    if _given("--rollout.vllm_generate_batch_size", argv) and (cfg.delta.enable or
                                                                _given("--train.async_enable", argv)):
        raise ValueError(
            "--rollout.vllm_generate_batch_size cannot be combined with --oppo.delta.enable or "
            "--train.async_enable: OPPO's overcommit Δ replaces over-sampling (its generator admits B + Δ groups)"
        )
    if streams_rewards(argv, cfg):
        for flag, why in STREAMING_REWARD_INCOMPATIBLE.items():
            if _given(flag, argv):
                raise ValueError(f"{flag} cannot be combined with --oppo.streaming.enable: {why}; "
                                 f"--oppo.streaming.enable false scores with OpenRLHF's own reward forward")
    if cfg.megatron.enable:
        _check_megatron(argv, cfg.megatron)
    if _given("--eval.dataset", argv) and not _given("--reward.remote_url", argv):
        raise ValueError("--eval.dataset needs --reward.remote_url: OpenRLHF scores eval samples in the rollout "
                         "engines with a rule-based or remote reward only")


def _check_megatron(argv: list[str], megatron: oppo_config.MegatronConfig) -> None:
    for flag, why in MEGATRON_INCOMPATIBLE.items():
        if _given(flag, argv):
            raise ValueError(f"{flag} cannot be combined with --oppo.megatron.enable: {why}")
    optim = flag_value("--actor.optim", argv)
    if optim not in (None, "adam"):
        raise ValueError(f"--actor.optim {optim} cannot be combined with --oppo.megatron.enable: "
                         "the Megatron actor trains with Adam")
    nodes, gpus = flag_value("--actor.num_nodes", argv), flag_value("--actor.num_gpus_per_node", argv)
    if nodes is not None and gpus is not None and (int(nodes) * int(gpus)) % megatron.model_parallel_size:
        raise ValueError(f"--oppo.megatron.tensor_parallel_size {megatron.tensor_parallel_size} x "
                         f"--oppo.megatron.pipeline_parallel_size {megatron.pipeline_parallel_size} must divide the "
                         f"actor's {int(nodes) * int(gpus)} ranks (--actor.num_nodes x --actor.num_gpus_per_node)")


def flag_value(flag: str, argv: list[str]) -> str | None:
    """The flag's value as argparse reads it: the last occurrence wins."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


# --oppo.staleness.correction -> OpenRLHF 0.11.2's importance-sampling correction against
# the recorded rollout logprobs (its own naming: TIS = token clip, ICEPOP = token mask)
CORRECTIONS = {
    "tis": ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip"],
    "icepop": ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "mask"],
}


def _correction_flags(argv: list[str], cfg: oppo_config.OppoConfig) -> list[str]:
    correction = cfg.staleness.resolved_correction
    if correction == "none":
        return []
    if cfg.staleness.correction == "auto" and any(a.startswith("--algo.advantage.is_correction_") for a in argv):
        return []  # the user set OpenRLHF's own correction (even `off`): theirs wins
    if flag_value("--algo.advantage.is_correction_level", argv) not in (None, "off"):
        raise ValueError(
            "--oppo.staleness.correction cannot be combined with --algo.advantage.is_correction_level: "
            "set one of them"
        )
    return CORRECTIONS[correction]


def openrlhf_argv(rest: list[str], cfg: oppo_config.OppoConfig) -> list[str]:
    """OpenRLHF's flags for this run (all of them: `check_flags` may see a config before its
    task defaults): the user's, plus the importance-sampling correction
    `--oppo.staleness.correction` maps to."""
    argv = list(rest)
    if streams_rewards(argv, cfg) and flag_value("--reward.model_name_or_path", argv) is None:
        raise ValueError("--oppo.streaming.enable streams into a reward model: set --reward.model_name_or_path "
                         "(or --reward.remote_url for a rule-based or remote reward)")
    return argv + _correction_flags(argv, cfg)


def overlay_flags(argv: list[str], base: oppo_config.OppoConfig) -> oppo_config.OppoConfig:
    """`base` with the `--oppo.*` flags among `argv` on top (the other flags are left alone)."""
    parser = argparse.ArgumentParser(add_help=False)
    oppo_config.add_cli_flags(parser)
    return oppo_config.from_cli(parser.parse_known_args(argv)[0], base)


def parse(argv: list[str]) -> tuple[oppo_config.OppoConfig, list[str]]:
    """(OPPO config, OpenRLHF's argv). A `--config` preset's OpenRLHF sections come first in
    the argv, so the user's flags after them win; its `oppo:` section is the base the
    `--oppo.*` flags overlay."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", dest="preset", default=None)
    parser.add_argument("--oppo.config", dest="oppo_config_file", default=None, help="YAML with an `oppo:` section")
    oppo_config.add_cli_flags(parser)
    known, rest = parser.parse_known_args(argv)
    if known.preset and known.oppo_config_file:
        raise ValueError("--config and --oppo.config both name OPPO's settings: "
                         "put them under `oppo:` in the --config file")
    preset_argv, in_file = [], {}
    if known.preset:
        from openrlhf_oppo.integrations.launch import yaml_config

        preset = yaml_config.load(known.preset)
        if preset.task:
            raise ValueError(f"{known.preset}: `task:` is the built-in CPU task's (openrlhf-oppo train --config); "
                             "a cluster preset names its models and data in OpenRLHF's sections")
        in_file, preset_argv = preset.oppo, yaml_config.to_argv(preset.flags)
    elif known.oppo_config_file:
        in_file = settings.read_yaml(known.oppo_config_file).get(oppo_config.FLAG_PREFIX) or {}
    cfg = oppo_config.from_cli(known, oppo_config.from_dict(in_file))
    cfg, note = oppo_config.fit_delta(cfg, rollout_batch(preset_argv + rest), delta_given(in_file, argv))
    if note:
        _notice(f"{ENTRY_MODULE}: {note}")
    return cfg, preset_argv + rest


def delta_given(section: dict, argv: list[str]) -> set[str]:
    """Which of Δ's `init` and `max` the user set: in an `oppo:` section or as `--oppo.delta.*` among `argv`
    (`oppo_config.fit_delta` adapts the others)."""
    return {k for k in ("init", "max")
            if k in (section.get("delta") or {}) or flag_value(f"--oppo.delta.{k}", argv) is not None}


def rollout_batch(argv: list[str]) -> int:
    """B, prompt groups a step: `--rollout.batch_size` among `argv` or OpenRLHF's default (0 where the
    value is no integer: OpenRLHF's parser refuses it, naming the flag)."""
    from openrlhf_oppo.integrations.launch import openrlhf_flags

    value = flag_value("--rollout.batch_size", argv) or openrlhf_flags.train_flags()["rollout.batch_size"].default
    return int(value) if str(value).isdigit() else 0


@functools.cache
def _notice(line: str) -> None:
    """`line` on stderr, once a process (the flags are parsed by every check)."""
    print(line, file=sys.stderr, flush=True)


def _check_background_sync(cfg: oppo_config.OppoConfig, argv: list[str]) -> None:
    """`--oppo.staleness.background_sync true` needs something to overlap the sync with and engines
    whose weights travel through OpenRLHF's weight-update group (or the CPU sync), not CUDA IPC."""
    flag = "--oppo.staleness.background_sync true"
    if not cfg.staleness.max_policy_lag:
        raise ValueError(f"{flag} needs --oppo.staleness.max_policy_lag >= 1: without async admission the "
                         f"trainer waits for the engines' next batch, and with it for their weights, anyway")
    if cfg.megatron.enable:
        raise ValueError(f"{flag} cannot be combined with --oppo.megatron.enable: the Megatron actor syncs its "
                         f"weights in the foreground; set --oppo.staleness.background_sync false")
    if _given("--train.colocate_all", argv) and not _given("--train.async_enable", argv):
        raise ValueError(f"{flag} with --train.colocate_all needs --train.async_enable: otherwise vLLM shares the "
                         f"training GPUs (weights sent by CUDA IPC, nothing beside the sync to overlap with)")
    if cfg.staleness.background_sync_buffer == "host" and _given("--vllm.sync_with_ray", argv):
        raise ValueError("--oppo.staleness.background_sync_buffer host cannot be combined with --vllm.sync_with_ray: "
                         "each parameter is staged back to the GPU on a stream Ray's collective does not wait for; "
                         "drop --vllm.sync_with_ray (OpenRLHF's own NCCL group) or use the device buffer")
    if cfg.staleness.background_sync_buffer == "shards":
        _check_sharded_sync(argv)


def _check_sharded_sync(argv: list[str]) -> None:
    """`--oppo.staleness.background_sync_buffer shards` sends each rank's ZeRO-3 partition: there must be
    one, laid out as ZeRO-3 lays it out (no AutoTP), sent over the NCCL group the engines join."""
    flag = "--oppo.staleness.background_sync_buffer shards"
    stage = flag_value("--ds.zero_stage", argv) or "2 (OpenRLHF's default)"
    if stage != "3":
        raise ValueError(f"{flag} needs --ds.zero_stage 3 (got {stage}): below stage 3 no rank holds a "
                         f"partition of the weights to send; use the device or host buffer")
    tp = flag_value("--ds.tensor_parallel_size", argv)
    if tp is not None and int(tp) > 1:
        raise ValueError(f"{flag} cannot be combined with --ds.tensor_parallel_size {tp}: AutoTP's sliced "
                         f"layers are not ZeRO-3 partitions; use the device or host buffer")
    if _given("--vllm.sync_with_ray", argv):
        raise ValueError(f"{flag} cannot be combined with --vllm.sync_with_ray: the partitions go point to "
                         f"point over OpenRLHF's own NCCL group; drop --vllm.sync_with_ray")


JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # Ray's job manager sets it in a submitted job's driver
FORWARDED_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY")  # and every OPPO_* variable


def driver_env_vars(environ: dict[str, str]) -> dict[str, str]:
    """The env vars of the run's Ray workers that this driver sets: OpenRLHF's own `ray.init`
    defaults (it skips its `ray.init` once Ray is up), every `OPPO_*` variable (OPPO's config,
    run files, faults), wandb's, and a PYTHONPATH with the site hook first (`worker_hooks`).
    Under `ray job submit` a variable the job's runtime env already sets is left out: the job's
    value reaches the workers, and Ray refuses a driver runtime env that sets it again."""
    env = {
        "TOKENIZERS_PARALLELISM": environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
        "PYTHONPATH": worker_hooks.worker_pythonpath(environ),
    }
    env.update({k: v for k, v in environ.items() if k.startswith("OPPO_") or k in FORWARDED_ENV})
    job = json.loads(environ.get(JOB_CONFIG_ENV) or "{}")
    taken = (job.get("runtime_env") or {}).get("env_vars") or {}
    return {k: v for k, v in env.items() if k not in taken}


def print_help() -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="YAML preset: OpenRLHF's sections (nested keys = dotted "
                        "flags) and `oppo:`; flags on the command line override it")
    parser.add_argument("--dry-run", action="store_true", help="run every check the launch runs, print the per-GPU, "
                        "per-phase memory table and exit (0: every check passed) without starting Ray or vLLM")
    oppo_config.add_cli_flags(parser)
    parser.print_help()
    print("\nWhich schedule: the defaults are `oppo` (streamed reward, B+Δ groups admitted, the rest\n"
          "carried), for vLLM sharing the GPUs with training (--train.colocate_all, the hybrid engine).\n"
          "Where vLLM has GPUs of its own (OpenRLHF's async layout, --train.colocate_all\n"
          "--train.async_enable), admit asynchronously as `openrlhf-oppo train --schedule oppo-async-bg`\n"
          "does: --oppo.staleness.max_policy_lag 2 --oppo.staleness.background_sync true\n"
          "--oppo.streaming.enable false (configs/cluster/*-async-*.yaml).")
    print("\nAll other flags are OpenRLHF's: --help-openrlhf lists them with their defaults and help")


def resolve(argv: list[str]) -> tuple[oppo_config.OppoConfig, list[str]]:
    """(OPPO config, OpenRLHF's argv), every check done; ValueError names the flag."""
    cfg, rest = parse(argv)
    check_flags(rest, cfg)
    return cfg, openrlhf_argv(rest, cfg)


def run_openrlhf(cfg: oppo_config.OppoConfig, rest: list[str]) -> None:
    """Hand the config to the run's processes, start Ray, swap OpenRLHF's classes in this
    driver, then run OpenRLHF's own `train_ppo_ray` as `__main__`."""
    import ray

    from openrlhf_oppo.integrations.launch import wandb_offline
    from openrlhf_oppo.integrations.runtime.trainer import patch_driver

    os.environ[run_env.CONFIG_JSON] = json.dumps(oppo_config.to_dict(cfg))
    wandb_flags, wandb_env = wandb_offline.wandb_settings(wandb_offline.argv_flags(rest), os.environ)
    if wandb_env:
        print(f"{ENTRY_MODULE}: wandb is configured without a key (--logger.wandb.key or "
              "WANDB_API_KEY): logging offline; `wandb sync` uploads the run later", file=sys.stderr)
    os.environ.update(wandb_env)
    rest = rest + [arg for name, value in wandb_flags.items() for arg in (f"--{name}", value)]
    if not ray.is_initialized():
        # the trainer actor reads the OPPO config from these env vars
        ray.init(runtime_env={"env_vars": driver_env_vars(os.environ)})
    # where the site hook runs in the workers; worker_hooks.SiteHookMissing where the run needs it and it does not
    given = {flag for flag in worker_hooks.FLAGS if _given(flag, rest)}
    print(f"{ENTRY_MODULE}: {worker_hooks.check(cfg.train.length_buckets, given)}", file=sys.stderr)
    patch_driver(streams_rewards(rest, cfg), "reference" in cfg.streaming.scorers(), cfg.megatron.enable,
                 cfg.staleness.background_sync)
    sys.argv = [OPENRLHF_MODULE, *rest]
    runpy.run_module(OPENRLHF_MODULE, run_name="__main__", alter_sys=True)
