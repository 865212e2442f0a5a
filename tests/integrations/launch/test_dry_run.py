"""`openrlhf-oppo train --dry-run` and the cluster entry's `--dry-run`: every check a launch runs,
the per-GPU, per-phase memory table with every model counted, and nothing started, on every
shipped cluster preset with the device memory of the GPU it names (this host has no GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from openrlhf_oppo import run_env
from openrlhf_oppo.cli.main import main
from openrlhf_oppo.integrations.launch import cluster_entry, driver, memory_check, preflight, yaml_config

REPO = Path(__file__).resolve().parents[3]
PRESETS = sorted((REPO / "configs" / "cluster").glob("*.yaml"))
TIGHTEST = re.compile(r"^  tightest \(\*\): \[\d+\] (?P<phase>[a-z ]+): [\d.]+ of (?P<gb>[\d.]+) GB, margin [-\d.]+ GB "
                      r"\((?P<margin>-?[\d.]+)%\): ok$", re.M)


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch, tmp_path):
    """Neither OPPO_DEVICE_MEMORY_GB nor a CUDA device: the preset's `device:` says; the input
    checks' report of the cluster entry goes to the test's folder."""
    import torch

    monkeypatch.delenv(run_env.DEVICE_MEMORY_GB, raising=False)
    monkeypatch.delenv(run_env.SKIP_INPUT_CHECKS, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(cluster_entry.REPORT_ENV, str(tmp_path / "preflight.json"))


def _models_in_run(preset: Path) -> set[str]:
    """The models OpenRLHF builds for the preset: the actor; the reference with a KL term; the critic
    with GAE; the reward model unless the reward is a rule or remote."""
    v, cfg = preflight.resolve({}, ["--config", str(preset)], oppo=True)
    models = {"actor"}
    if v["algo.kl.init_coef"] > 0:
        models.add("reference")
    if v["algo.advantage.estimator"] == "gae":
        models.add("critic")
    if not v["reward.remote_url"]:
        models.add("reward")
    return models


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_the_dry_run_counts_every_model_of_every_preset_with_8_percent_left(preset, tmp_path, capsys):
    assets = tmp_path / "assets"
    rc = main(["train", "--schedule", "oppo", "--config", str(preset), "--output", str(tmp_path / "run"),
               "--assets", str(assets), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    device = yaml_config.load(preset).device
    assert f"memory per GPU in GB, device {device['memory_gb']:.1f} GB ({preset} device: {device['name']})" in out
    (tight,) = TIGHTEST.finditer(out)
    assert float(tight["margin"]) >= 8.0
    assert "UNCOUNTED" not in out and "warning" not in out
    assert "dry run: every check passed; nothing started" in out
    assert not assets.exists() and not (tmp_path / "run" / "train.log").exists()  # nothing built or launched
    # every model of the run is on some GPU kind of the table
    v, cfg = preflight.resolve({}, ["--config", str(preset)], oppo=True)
    result = memory_check.count(v, cfg, memory_check.preset_device(device, str(preset)))
    counted = {i.what.split(" ")[0] for k in result.kinds for i in k.items}
    counted |= {i.what.split(" ")[1] for k in result.kinds for i in k.items if i.what.startswith("streaming ")}
    assert _models_in_run(preset) <= counted
    assert result.counted and result.margin() >= memory_check.MIN_MARGIN


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_the_cluster_entrys_dry_run_checks_and_starts_no_ray(preset, monkeypatch, capsys):
    def started(*args, **kwargs):
        raise AssertionError("the dry run started the run")

    monkeypatch.setattr(driver, "run_openrlhf", started)
    assert cluster_entry.main(["--config", str(preset), "--dry-run"]) == 0
    out = capsys.readouterr().out
    (tight,) = TIGHTEST.finditer(out)
    assert float(tight["margin"]) >= 8.0 and "UNCOUNTED" not in out
    assert "dry run: every check passed; Ray not started" in out


def test_a_dry_run_that_does_not_fit_exits_2_with_the_refusal(tmp_path, capsys):
    preset = REPO / "configs" / "cluster" / "qwen2.5-7b-hybrid-8gpu.yaml"
    rc = main(["train", "--schedule", "oppo", "--config", str(preset), "--output", str(tmp_path), "--dry-run",
               "--", "--vllm.gpu_memory_utilization", "0.7"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "would need" in err and "generating" in err and "--vllm.gpu_memory_utilization 0.58 or lower" in err


def test_a_dry_run_with_a_model_it_cannot_count_exits_2_naming_it(capsys):
    preset = REPO / "configs" / "cluster" / "qwen2.5-7b-8gpu.yaml"
    rc = cluster_entry.main(["--config", str(preset), "--reward.model_name_or_path", "someone/Unknown-RM",
                             "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "the layout is uncounted: --reward.model_name_or_path someone/Unknown-RM" in err


CPU_CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda p: p.stem)
def test_the_dry_run_of_every_cpu_config_checks_its_task_and_starts_nothing(config, tmp_path, capsys, monkeypatch):
    """The CPU configs' dry run builds or installs the task's assets (what the inputs check reads) and
    launches nothing; `learn-cpu`'s task is built by the lab only, which the refusal says."""
    from openrlhf_oppo.integrations.launch import launcher

    def started(*args, **kwargs):
        raise AssertionError("the dry run launched the run")

    monkeypatch.setattr(launcher, "launch", started)
    assets, out = tmp_path / "assets", tmp_path / "run"
    rc = main(["train", "--schedule", "oppo", "--config", str(config), "--output", str(out), "--assets", str(assets),
               "--dry-run"])
    captured = capsys.readouterr()
    if yaml_config.load(config).task.get("variant") == "learn":
        assert rc == 2 and "python -m oppo_lab build-learn --variant learn" in captured.err
        return
    assert rc == 0, captured.err
    assert "dry run: every check passed; nothing started. It would launch:" in captured.out
    assert "prompts counted, 0 over the" in captured.out and not (out / "train.log").exists()
