"""The cluster kit a user copies from: example scripts, presets and the Docker image.

Every script passes `bash -n`, prints its final command with `--dry-run` (no Ray, GPU or
SLURM needed), and that command parses with OpenRLHF 0.11.2's own parser (its
`train_ppo_ray` run as `__main__` up to `parse_args`) plus ours (`--config`, `--oppo.*`,
the refusals): a flag renamed upstream or misspelt in a script or preset fails here."""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from openrlhf_oppo.integrations.launch import driver, worker_hooks

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = sorted((REPO / "examples" / "scripts").glob("train_*.sh"))
ENTRY = "openrlhf_oppo.cli.train_ppo_ray"


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def openrlhf_parse(argv: list[str]) -> dict:
    """OpenRLHF's own `train_ppo_ray` parser on `argv` (its module runs as `__main__` and
    stops at `parse_args`): {dotted flag: value}. SystemExit(2) with argparse's message
    for an unknown flag."""
    from openrlhf_oppo import compat

    compat.apply()  # OpenRLHF's model module imports flash_attn: the stand-in where CUDA is absent
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), \
            mock.patch.object(sys, "argv", [driver.OPENRLHF_MODULE, *argv]):
        try:
            runpy.run_module(driver.OPENRLHF_MODULE, run_name="__main__")
        except _Parsed as parsed:
            return vars(parsed.namespace)
    raise AssertionError("OpenRLHF's train_ppo_ray did not parse its arguments")


def dry_run(script: Path, *extra: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(script), "--dry-run", *extra], capture_output=True, text=True, timeout=60,
                         env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if ENTRY in line]
    assert len(lines) == 1, out.stdout
    return shlex.split(lines[0])


def training_argv(command: list[str]) -> list[str]:
    return command[command.index(ENTRY) + 1:]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_n(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_every_setup_has_a_script():
    names = {p.name for p in SCRIPTS}
    assert {"train_oppo_qwen2.5_7b_8gpu.sh", "train_oppo_gsm8k_grpo.sh", "train_oppo_gsm8k_ppo.sh",
            "train_oppo_3b_8xa100.sh", "train_oppo_multinode.sh", "train_oppo_slurm.sh",
            "train_oppo_qwen2.5_7b_hybrid.sh", "train_oppo_qwen2.5_72b_megatron.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_with_openrlhfs_parser_and_ours(script, monkeypatch):
    monkeypatch.chdir(REPO)  # the scripts run from the repository root; presets are relative to it
    argv = training_argv(dry_run(script))
    cfg, rest = driver.parse(argv)
    driver.check_flags(rest, cfg)
    args = openrlhf_parse(driver.openrlhf_argv(rest, cfg))
    assert args["actor.model_name_or_path"] and args["data.prompt_dataset"]
    assert not [a for a in rest if a.startswith("--oppo.")]


def test_flags_after_the_script_override_its_preset(monkeypatch):
    monkeypatch.chdir(REPO)
    script = REPO / "examples" / "scripts" / "train_oppo_gsm8k_grpo.sh"
    argv = training_argv(dry_run(script, "--rollout.batch_size", "32", "--oppo.delta.init", "1"))
    cfg, rest = driver.parse(argv)
    assert cfg.delta.init == 1
    assert openrlhf_parse(driver.openrlhf_argv(rest, cfg))["rollout.batch_size"] == 32


def test_a_scripts_dry_run_runs_the_jobs_checks_and_exits_2_on_a_refusal():
    """`--dry-run` runs the cluster entry's own `--dry-run` here (on stderr, the command alone on stdout):
    an override the job would refuse is refused now, before `ray job submit`."""
    script = REPO / "examples" / "scripts" / "train_oppo_gsm8k_grpo.sh"
    ok = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "dry run: every check passed; Ray not started" in ok.stderr
    bad = subprocess.run(["bash", str(script), "--dry-run", "--rollout.batch_size", "8"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith(f"{ENTRY}: error: --rollout.batch_size x ")


def test_an_unknown_flag_fails_openrlhfs_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        openrlhf_parse(["--actor.model_name_or_path", "m", "--rollout.batch_sise", "8"])
    assert exc.value.code == 2 and "--rollout.batch_sise" in capsys.readouterr().err


def test_dockerfile_copies_what_exists_and_installs_the_gpu_stack():
    text = (REPO / "dockerfile" / "Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:26\.03-py3$", text, re.M)  # OpenRLHF 0.11.2's documented image
    for line in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in line.split():
            assert (REPO / source).exists(), f"Dockerfile COPY {source}: not in the repository"
    assert "OPPO_STACK=gpu" in text and "bash scripts/install.sh" in text


def _readme_cluster_section() -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index("## On a GPU cluster"):text.index("### OpenRLHF features with OPPO")]


def test_readme_gpu_example_parses_and_is_not_refused():
    """The README's `ray job submit` example is a command a user can paste."""
    blocks = re.findall(r"```bash\n(.*?)```", _readme_cluster_section(), re.S)
    (block,) = [b for b in blocks if ENTRY in b]
    argv = training_argv(shlex.split(block.replace("\\\n", " ")))
    assert "--reward.model_name_or_path" in argv and "--oppo.delta.init" in argv
    cfg, rest = driver.parse(argv)
    driver.check_flags(rest, cfg)
    args = openrlhf_parse(driver.openrlhf_argv(rest, cfg))
    assert args["reward.model_name_or_path"] == "OpenRLHF/Llama-3-8b-rm-700k"  # a hub id: resolved as OpenRLHF does
    assert driver.streams_rewards(rest, cfg)


def gpus_reserved(args: dict) -> int:
    """GPUs Ray must reserve for OpenRLHF 0.11.2's placement (`train_ppo_ray.train`): vLLM
    engines x TP; the actor's group, the reference's unless colocated with it; the critic's, the
    reward model's unless colocated with the critic; under --train.colocate_all (sync), the
    actor's group holds everything; with --train.async_enable too, everything but vLLM."""
    def group(name):
        return args[f"{name}.num_nodes"] * args[f"{name}.num_gpus_per_node"]

    with_ref = args["algo.kl.init_coef"] > 0
    with_rm = not args["reward.remote_url"]
    if args["train.colocate_all"] and not args["train.async_enable"]:
        critic_pg = group("critic") if args["critic.model_name_or_path"] and args["train.colocate_critic_reward"] else 0
        return group("actor") + critic_pg
    total = (args["vllm.num_engines"] or 0) * args["vllm.tensor_parallel_size"] + group("actor")
    if args["train.colocate_all"]:
        return total
    if with_ref and not args["train.colocate_actor_ref"]:
        total += group("ref")
    if args["critic.model_name_or_path"]:
        total += group("critic")
        if with_rm and not args["train.colocate_critic_reward"]:
            total += group("reward")
    elif with_rm:
        total += group("reward")
    return total


def test_the_72b_megatron_preset_fills_64_gpus_and_its_parallel_sizes_fit_qwen2_5_72b(monkeypatch):
    """The 72B script's command parses (as every script's), reserves the 8 nodes x 8 GPUs it
    names, trains the actor with Megatron at TP 8 x PP 4 over its 32 ranks, and those sizes
    divide Qwen2.5-72B's heads, key/value heads, vocabulary, MLP width and layers (its
    config.json's numbers, built in code: nothing is downloaded)."""
    from transformers import Qwen2Config

    from openrlhf_oppo.megatron.model import Shape

    monkeypatch.chdir(REPO)
    script = REPO / "examples" / "scripts" / "train_oppo_qwen2.5_72b_megatron.sh"
    cfg, rest = driver.parse(training_argv(dry_run(script)))
    driver.check_flags(rest, cfg)
    args = openrlhf_parse(driver.openrlhf_argv(rest, cfg))
    assert gpus_reserved(args) == 64
    assert cfg.megatron.enable and (cfg.megatron.tensor_parallel_size, cfg.megatron.pipeline_parallel_size) == (8, 4)
    assert args["actor.num_nodes"] * args["actor.num_gpus_per_node"] == cfg.megatron.model_parallel_size
    qwen_72b = Qwen2Config(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=32768)
    Shape.of(qwen_72b).check_parallel(cfg.megatron.tensor_parallel_size, cfg.megatron.pipeline_parallel_size)
    with pytest.raises(ValueError, match=r"pipeline-parallel size 3 must divide the layers \(80\)"):
        Shape.of(qwen_72b).check_parallel(8, 3)


def test_the_readme_gpu_example_fits_the_one_8_gpu_node_it_names():
    """Ray waits on a placement group that cannot be placed forever, silently: the example
    must ask for no more GPUs than the node the README says it runs on."""
    section = _readme_cluster_section()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if ENTRY in b]
    cfg, rest = driver.parse(training_argv(shlex.split(block.replace("\\\n", " "))))
    args = openrlhf_parse(driver.openrlhf_argv(rest, cfg))
    assert gpus_reserved(args) == 8
    assert "one\nnode of 8 GPUs" in section


def test_gpus_reserved_counts_the_old_40_gpu_example():
    args = {"vllm.num_engines": 4, "vllm.tensor_parallel_size": 2, "algo.kl.init_coef": 0.01,
            "reward.remote_url": None, "critic.model_name_or_path": "c", "train.colocate_all": False,
            "train.async_enable": False, "train.colocate_actor_ref": False, "train.colocate_critic_reward": False}
    args |= {f"{g}.{k}": v for g in ("actor", "ref", "critic", "reward")
             for k, v in (("num_nodes", 1), ("num_gpus_per_node", 8))}
    assert gpus_reserved(args) == 40
    assert gpus_reserved(args | {"train.colocate_all": True}) == 8
    assert gpus_reserved(args | {"train.colocate_all": True, "train.async_enable": True}) == 16


def test_the_async_preset_is_openrlhfs_async_layout_on_one_8_gpu_node():
    """configs/cluster/qwen2.5-7b-async-8gpu.yaml: OPPO's async admission, which the driver
    accepts with --train.async_enable, vLLM on 1 GPU and the DeepSpeed models on the other 7,
    at batch sizes DeepSpeed takes over 7 ranks."""
    from openrlhf_oppo.integrations.launch import preflight

    cfg, rest = driver.parse(["--config", str(REPO / "configs" / "cluster" / "qwen2.5-7b-async-8gpu.yaml")])
    driver.check_flags(rest, cfg)
    args = openrlhf_parse(driver.openrlhf_argv(rest, cfg))
    assert args["train.colocate_all"] and args["train.async_enable"] and cfg.staleness.max_policy_lag == 2
    assert gpus_reserved(args) == 8 and args["vllm.num_engines"] * args["vllm.tensor_parallel_size"] == 1
    assert not driver.streams_rewards(rest, cfg)
    preflight.check_config(args, [], oppo=True)


QWEN_72B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 29568, "vocab_size": 152064,
            "tie_word_embeddings": False}


def test_the_72b_async_preset_is_the_simulators_layout_and_fits_as_its_comment_says(tmp_path, monkeypatch, capsys):
    """configs/cluster/qwen2.5-72b-async-64gpu.yaml: vLLM on one node (4 engines x TP 2), the DeepSpeed
    models on 56 GPUs, the sharded background sync; the memory check (with Qwen2.5-72B's config.json
    for the actor and the reward model) prints the total its comment gives."""
    import json

    from openrlhf_oppo import run_env
    from openrlhf_oppo.integrations.launch import preflight

    cfg, rest = driver.parse(["--config", str(REPO / "configs" / "cluster" / "qwen2.5-72b-async-64gpu.yaml")])
    driver.check_flags(rest, cfg)
    args = openrlhf_parse(driver.openrlhf_argv(rest, cfg))
    assert args["train.colocate_all"] and args["train.async_enable"] and cfg.staleness.max_policy_lag == 2
    assert cfg.staleness.background_sync and cfg.staleness.background_sync_buffer == "shards"
    assert gpus_reserved(args) == 64 and args["vllm.num_engines"] * args["vllm.tensor_parallel_size"] == 8
    assert args["actor.num_nodes"] * args["actor.num_gpus_per_node"] == 56
    assert args["train.batch_size"] % (56 * args["train.micro_batch_size"]) == 0
    for name in ("actor", "reward"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(QWEN_72B))
    monkeypatch.setenv(run_env.DEVICE_MEMORY_GB, "141")
    from openrlhf_oppo import config as oppo_config

    preflight.check_config({**args, "actor.model_name_or_path": str(tmp_path / "actor"),
                            "reward.model_name_or_path": str(tmp_path / "reward")}, oppo_config.to_cli_args(cfg),
                           oppo=True)
    comment = (REPO / "configs" / "cluster" / "qwen2.5-72b-async-64gpu.yaml").read_text()
    total = re.search(r"= ([\d.]+) GB of 141", comment)[1]
    assert re.search(rf"^ +total .* {re.escape(total)} *$", capsys.readouterr().out, re.M)  # the training GPUs' row


@pytest.mark.parametrize("path", ["README.md", "docs/quickstart.md", "examples/scripts/train_oppo_multinode.sh",
                                  "examples/scripts/train_oppo_slurm.sh"])
def test_a_head_started_for_other_machines_serves_its_dashboard_beyond_loopback(path):
    """`ray job submit --address http://$HEAD_IP:8265` needs the dashboard on that address; Ray
    binds it to 127.0.0.1 unless `--dashboard-host` says otherwise, and the submission is refused."""
    text = (REPO / path).read_text().replace("\\\n", " ")
    heads = re.findall(r"ray start --head[^`\n]*", text)
    assert heads
    for head in heads:
        assert "--dashboard-host 0.0.0.0" in head, f"{path}: {head}"


def test_the_quickstart_gives_the_7b_presets_gpu_counts():
    import yaml

    preset = yaml.safe_load((REPO / "configs" / "cluster" / "qwen2.5-7b-8gpu.yaml").read_text())
    text = " ".join((REPO / "docs" / "quickstart.md").read_text().split())
    got = re.search(r"vLLM on (\d+) GPUs, actor and reference \(colocated\) on (\d+), and a 7B reward model alone "
                    r"on the (\w+) GPU", text)
    assert got, "docs/quickstart.md no longer describes the 7B preset's layout"
    vllm = preset["vllm"]["num_engines"] * preset["vllm"]["tensor_parallel_size"]
    actor = preset["actor"]["num_nodes"] * preset["actor"]["num_gpus_per_node"]
    assert preset["train"]["colocate_actor_ref"] and preset["reward"]["num_gpus_per_node"] == 1
    assert (int(got[1]), int(got[2]), got[3]) == (vllm, actor, "eighth") and vllm + actor + 1 == 8


def _readme_example_argv() -> list[str]:
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", _readme_cluster_section(), re.S) if ENTRY in b]
    return training_argv(shlex.split(block.replace("\\\n", " ")))


@pytest.mark.parametrize("where", ["README example", "multinode-16gpu.yaml", "qwen2.5-7b-hybrid-8gpu.yaml"])
def test_an_explicit_kv_budget_holds_every_sequence_in_flight_per_reward_actor(where, monkeypatch):
    """Chunks reach a reward actor round-robin over its samples in flight, LRU's worst case:
    with a budget below their tokens nearly every chunk re-prefills its whole sequence."""
    monkeypatch.chdir(REPO)
    argv = _readme_example_argv() if where == "README example" else ["--config", f"configs/cluster/{where}"]
    cfg, rest = driver.parse(argv)
    args = openrlhf_parse(driver.openrlhf_argv(rest, cfg))
    actors = args["reward.num_nodes"] * args["reward.num_gpus_per_node"]
    in_flight = -(-(args["rollout.batch_size"] + cfg.delta.max) * args["rollout.n_samples_per_prompt"] // actors)
    assert cfg.streaming.kv_budget_tokens >= in_flight * args["data.max_len"]


def test_every_path_the_readme_cluster_section_names_exists():
    paths = set(re.findall(r"`((?:examples/scripts|configs/cluster|dockerfile|docs)/[\w./-]+)`",
                           _readme_cluster_section()))
    section = _readme_cluster_section()
    paths |= {f"examples/scripts/{n}" for n in re.findall(r"`(train_oppo_[\w.]+\.sh)`", section)}
    paths |= {f"configs/cluster/{n}" for n in re.findall(r"`([\w.-]+\.yaml)`", section)}
    assert paths and [p for p in sorted(paths) if not (REPO / p).exists()] == []


def test_the_driver_runtime_env_leaves_out_what_the_submitted_job_sets():
    """`ray job submit --runtime-env-json` with env_vars (the scripts set NCCL_DEBUG and, when
    set, WANDB_API_KEY): Ray refuses a driver `ray.init` runtime env that sets one of them
    again, so the entry point leaves those to the job and forwards the rest."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    from ray.runtime_env.runtime_env import _merge_runtime_env

    assert driver.JOB_CONFIG_ENV == RAY_JOB_CONFIG_JSON_ENV_VAR
    job = {"runtime_env": {"working_dir": ".", "env_vars": {"NCCL_DEBUG": "INFO", "WANDB_API_KEY": "k"}}}
    environ = {"NCCL_DEBUG": "INFO", "WANDB_API_KEY": "k", "OPPO_CONFIG_JSON": "{}", "OPPO_TIMELINE_DIR": "/shared/t",
               "HOME": "/root", driver.JOB_CONFIG_ENV: json.dumps(job)}
    env = driver.driver_env_vars(environ)
    assert env == {"TOKENIZERS_PARALLELISM": "true", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
                   "OPPO_CONFIG_JSON": "{}", "OPPO_TIMELINE_DIR": "/shared/t",
                   "PYTHONPATH": worker_hooks.worker_pythonpath(environ)}
    # a job that sets PYTHONPATH itself keeps it (Ray would refuse both): the start-up check says what is lost
    job_path = {"runtime_env": {"working_dir": ".", "env_vars": {"PYTHONPATH": "/mine"}}}
    assert "PYTHONPATH" not in driver.driver_env_vars({**environ, driver.JOB_CONFIG_ENV: json.dumps(job_path)})
    assert _merge_runtime_env(job["runtime_env"], {"env_vars": env}) is not None  # what ray.init does with them
    assert _merge_runtime_env(job["runtime_env"], {"env_vars": {**env, "NCCL_DEBUG": "WARN"}}) is None
    outside_a_job = driver.driver_env_vars({k: v for k, v in environ.items() if k != driver.JOB_CONFIG_ENV})
    assert outside_a_job["NCCL_DEBUG"] == "INFO" and outside_a_job["WANDB_API_KEY"] == "k"


def test_wandb_without_a_key_is_offline_unless_wandb_api_key_is_set():
    from openrlhf_oppo.integrations.launch.wandb_offline import PLACEHOLDER_KEY, argv_flags, wandb_settings

    flags = argv_flags(["--actor.model_name_or_path", "m", "--logger.wandb.project", "p", "--logger.wandb.run_name=r"])
    assert flags == {"logger.wandb.project": "p", "logger.wandb.run_name": "r"}
    assert wandb_settings(flags, {}) == ({"logger.wandb.key": PLACEHOLDER_KEY}, {"WANDB_MODE": "offline"})
    assert wandb_settings(flags, {"WANDB_API_KEY": "k"}) == ({"logger.wandb.key": PLACEHOLDER_KEY}, {})  # online
    assert wandb_settings({**flags, "logger.wandb.key": "k"}, {}) == ({}, {})  # the user's key, as OpenRLHF
    assert wandb_settings({"actor.model_name_or_path": "m"}, {}) == ({}, {})  # no wandb


SLURM_SCRIPT = REPO / "examples" / "scripts" / "train_oppo_slurm.sh"


def _fake_slurm_bin(tmp_path: Path) -> Path:
    """srun, scontrol, ray and sleep stand-ins that log their arguments: scontrol names two nodes,
    srun runs its command (after its own options) with the stand-ins, `ray status` shows 16 GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    scripts = {
        "scontrol": 'printf "node-a\\nnode-b\\n"',
        "srun": f'echo "srun $*" >> {log}\nwhile [[ $1 == -* ]]; do if [[ $1 == -w ]]; then shift; fi; shift; done\n'
                'if [[ $1 == hostname ]]; then echo 10.0.0.1; else "$@"; fi',
        "ray": f'echo "ray $*" >> {log}\nif [[ $1 == status ]]; then echo " 0.0/16.0 GPU"; fi',
        "sleep": "true",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _slurm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CPUS_PER_NODE", "GPUS_PER_NODE"))}
    env.update(extra)
    return env


@pytest.mark.parametrize("given, cpus", [({"SLURM_CPUS_ON_NODE": "96"}, "96"),
                                         ({"SLURM_CPUS_ON_NODE": "96", "SLURM_CPUS_PER_TASK": "64"}, "64"),
                                         ({"SLURM_CPUS_ON_NODE": "96", "CPUS_PER_NODE": "32"}, "32")])
def test_under_slurm_each_ray_node_declares_the_cpus_its_step_holds(tmp_path, given, cpus):
    """Where SLURM confines a step's cores, `ray start` without `--num-cpus` counts what the step
    got, and OpenRLHF's {"GPU": 1, "CPU": 1} bundles can wait forever: every Ray node declares its
    CPUs and GPUs, and its srun step asks for those CPUs."""
    bin_dir = _fake_slurm_bin(tmp_path)
    env = _slurm_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node-[a-b]",
                     SLURM_GPUS_PER_TASK="8", **given)
    out = subprocess.run(["bash", str(SLURM_SCRIPT)], capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    starts = [c for c in calls if c.startswith("srun") and " ray start " in c]
    (head,) = [c for c in starts if "--head" in c]  # the steps run in the background: any order
    (worker,) = [c for c in starts if "--address 10.0.0.1:6379" in c]
    assert "-w node-a" in head and "-w node-b" in worker
    for call in starts:
        assert f"--cpus-per-task={cpus}" in call and f"--num-cpus {cpus} --num-gpus 8" in call, call
    assert [c for c in calls if c.startswith("ray job submit")]
    source = next(k for k in ("CPUS_PER_NODE", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE") if k in given)
    assert f"{cpus} CPUs (from {source})" in out.stderr


def test_under_slurm_fewer_cpus_than_gpus_per_node_is_refused_before_ray_starts(tmp_path):
    bin_dir = _fake_slurm_bin(tmp_path)
    env = _slurm_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node-[a-b]",
                     SLURM_GPUS_PER_TASK="8", SLURM_CPUS_ON_NODE="4")
    out = subprocess.run(["bash", str(SLURM_SCRIPT)], capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert out.returncode == 2
    assert "4 CPUs per node (from SLURM_CPUS_ON_NODE) for 8 GPUs" in out.stderr
    assert "#SBATCH --cpus-per-task" in out.stderr
    assert not (tmp_path / "calls.log").exists()  # neither srun nor ray ran


def test_the_slurm_dry_run_prints_the_ray_starts_with_their_cpus():
    env = _slurm_env(SLURM_CPUS_PER_TASK="48")
    out = subprocess.run(["bash", str(SLURM_SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60,
                         env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    starts = [shlex.split(line) for line in out.stdout.splitlines() if " ray start " in line]
    assert len(starts) == 2
    for words in starts:
        assert words[words.index("--num-cpus") + 1] == "48" and "--cpus-per-task=48" in words


def test_the_readme_job_uploads_this_checkout_as_the_scripts_do():
    """OpenRLHF's README submits from its container (`"working_dir": "/openrlhf"`); here the job's
    working_dir is the checkout the command runs in, as `examples/scripts/_common.sh` sets it."""
    import json

    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", _readme_cluster_section(), re.S) if ENTRY in b]
    words = shlex.split(block.replace("\\\n", " "))
    runtime_env = json.loads(words[words.index("--runtime-env-json") + 1] if "--runtime-env-json" in words else
                             next(w.split("=", 1)[1] for w in words if w.startswith("--runtime-env-json=")))
    assert runtime_env["working_dir"] == "."
    assert {"ckpt", "runs"} <= {e.rstrip("/") for e in runtime_env["excludes"]}
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        assert not re.search(r'"working_dir": *"/', doc.read_text()), f"{doc.name}: a working_dir outside the checkout"
