"""Bad input to `openrlhf-oppo train` and the cluster entry: one line naming the file or flag and the
fix, exit 2, and nothing started (the launcher's `launch`, which starts Ray and vLLM, is never
called); a default that conflicts with the user's flag adapts and says so."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openrlhf_oppo.cli.main import main
from openrlhf_oppo.integrations.launch import cluster_entry, driver, launcher

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(launcher, "launch", started)
    monkeypatch.setattr(driver, "run_openrlhf", started)


def _train(tiny_assets: Path, out: Path, *extra: str, config: str = CONFIG, schedule: str = "oppo",
           dry_run: bool = False) -> list[str]:
    argv = ["train", "--schedule", schedule, "--config", config, "--assets", str(tiny_assets), "--output", str(out),
            *["--dry-run"] * dry_run]
    return [*argv, "--", *extra] if extra else argv


def _refusal(capsys, argv: list[str], entry=main) -> str:
    """The one line on stderr of a refused command (exit 2)."""
    rc = entry(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    return err[0]


def _deepspeed_checkpoint(ckpt: Path, tag: str = "global_step2") -> Path:
    """A checkpoint laid out as DeepSpeed's ZeRO-3 writes it under --ckpt.path/_actor; the optimizer file."""
    import torch

    folder = ckpt / "_actor" / tag
    folder.mkdir(parents=True)
    torch.save({"module": None, "client_state": {"oppo": {"groups": []}}},
               folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    optim = folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"state": torch.zeros(4096)}}, optim)
    (ckpt / "_actor" / "latest").write_text(tag)
    return optim


def test_a_truncated_checkpoint_is_refused_naming_the_file_before_anything_starts(tiny_assets, tmp_path):
    """As a user runs it (a process of its own, no stand-ins): exit 2 within seconds, one line naming the
    file and the fix, no traceback, no train.log (the launch writes it first)."""
    out = tmp_path / "run"
    optim = _deepspeed_checkpoint(out / "checkpoints")
    _deepspeed_checkpoint(out / "checkpoints", tag="global_step1")
    (out / "checkpoints" / "_actor" / "latest").write_text("global_step2")
    os.truncate(optim, optim.stat().st_size // 2)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "openrlhf_oppo.cli.main",
                           *_train(tiny_assets, out, "--ckpt.load_enable", schedule="sync")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"openrlhf-oppo train: error: --ckpt.load_enable: {optim} is truncated or not a torch checkpoint file "
        f"({optim.stat().st_size} bytes, no whole archive); write another tag (global_step1) into "
        f"{out / 'checkpoints' / '_actor' / 'latest'}, or move {out / 'checkpoints' / '_actor'} away to start afresh"]
    assert not (out / "train.log").exists() and time.monotonic() - t0 < 60


def test_a_checkpoint_without_optimizer_states_or_a_latest_naming_no_folder_is_refused(tiny_assets, tmp_path,
                                                                                      capsys):
    out = tmp_path / "run"
    optim = _deepspeed_checkpoint(out / "checkpoints")
    optim.unlink()
    line = _refusal(capsys, _train(tiny_assets, out, "--ckpt.load_enable"))
    assert line.endswith(f"--ckpt.load_enable: {optim.parent} holds no optimizer states (an interrupted save?); "
                         f"move {optim.parent.parent} away to start afresh")
    (out / "checkpoints" / "_actor" / "latest").write_text("global_step9\n")
    line = _refusal(capsys, _train(tiny_assets, out, "--ckpt.load_enable"))
    assert "latest names global_step9, which is not a folder of" in line
    assert "write another tag (global_step2) into" in line


def test_a_whole_checkpoint_passes_and_a_missing_one_is_a_note(tiny_assets, tmp_path, capsys):
    out = tmp_path / "run"
    _deepspeed_checkpoint(out / "checkpoints")
    assert main(_train(tiny_assets, out, "--ckpt.load_enable", dry_run=True)) == 0
    # the tiny task trains a critic (GAE): its checkpoint folder is missing, so it starts afresh, said so
    assert f"no checkpoint in {out / 'checkpoints' / '_critic'}; critic starts from its pretrained weights" in \
        capsys.readouterr().out


def test_a_missing_local_dataset_folder_is_refused_and_a_hub_id_is_not(tiny_assets, tmp_path, capsys):
    missing = tmp_path / "data" / "prompts"
    line = _refusal(capsys, _train(tiny_assets, tmp_path / "run", "--data.prompt_dataset", str(missing)))
    assert line == (f"openrlhf-oppo train: error: --data.prompt_dataset: no such file or folder: {missing} "
                    "(a hub id is 'name' or 'org/name')")
    for local in ("./prompts", "~/prompts", "a/b/c"):
        assert "no such file or folder" in _refusal(
            capsys, _train(tiny_assets, tmp_path / "run", "--data.prompt_dataset", local))
    assert main(_train(tiny_assets, tmp_path / "run", "--data.prompt_dataset", "someone/prompts", dry_run=True)) == 0
    assert "--data.prompt_dataset someone/prompts not checked: not a local" in capsys.readouterr().out


def test_an_output_folder_that_cannot_be_written_is_refused(tiny_assets, capsys):
    # /sys refuses new entries even to root; /proc/self/x does not exist and cannot be made
    for out, why in ((Path("/sys/oppo-run"), "Operation not permitted"), (Path("/proc/self/x/run"), None)):
        line = _refusal(capsys, _train(tiny_assets, out))
        assert line.startswith("openrlhf-oppo train: error: --output /") and ": cannot write there (" in line
        assert line.endswith("); name a writable folder") and (why is None or why in line)


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  batch_size: 4: 8\ntrain: {}\n")
    line = _refusal(capsys, ["train", "--schedule", "oppo", "--config", str(bad)])
    assert line == (f"openrlhf-oppo train: error: {bad}: line 2, column 16: not valid YAML (mapping values are not "
                    "allowed here)")
    line = _refusal(capsys, ["--config", str(bad), "--dry-run"], entry=cluster_entry.main)
    assert line.startswith(f"{driver.ENTRY_MODULE}: error: {bad}: line 2, column 16: not valid YAML")


@pytest.mark.parametrize("extra, expected", [
    (["--oppo.delta.mx", "3"], "--oppo.delta.mx: not an OPPO flag (did you mean '--oppo.delta.max'?); "
                               "docs/flags.md lists them"),
    (["--rollout.batchsize", "8"], "--rollout.batchsize: not a flag of OpenRLHF's train_ppo_ray (did you mean "
                                   "'--rollout.batch_size'?); openrlhf-oppo train --help-openrlhf lists them"),
])
def test_a_misspelt_flag_is_named_with_the_flag_it_resembles(tiny_assets, tmp_path, capsys, extra, expected):
    assert _refusal(capsys, _train(tiny_assets, tmp_path, *extra)) == f"openrlhf-oppo train: error: {expected}"
    assert _refusal(capsys, [*extra, "--dry-run"], entry=cluster_entry.main) == \
        f"{driver.ENTRY_MODULE}: error: {expected}"


def test_an_oppo_flag_under_an_openrlhf_schedule_is_blamed_on_the_schedule(tiny_assets, tmp_path, capsys):
    line = _refusal(capsys, _train(tiny_assets, tmp_path, "--oppo.delta.max", "2", schedule="sync"))
    assert line.endswith("--oppo.delta.max: an OPPO flag; --oppo.* flags apply to the oppo* schedules only")


def test_misspelt_names_elsewhere_get_the_closest(tmp_path, capsys):
    assert "unknown schedule 'opo' (did you mean 'oppo'?); allowed:" in _refusal(
        capsys, ["train", "--schedule", "opo", "--config", CONFIG])
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {batchsize: 4}\n")
    assert "(did you mean 'rollout.batch_size'?)" in _refusal(capsys, ["train", "--schedule", "sync", "--config",
                                                                        str(bad)])
    assert _refusal(capsys, ["trian"]) == ("openrlhf-oppo: unknown command 'trian' (did you mean 'train'?); choose "
                                           "one of: train, bench, plot, config, prepare, ledger, simulate")
    bad.write_text("opo: {delta: {max: 2}}\n")
    assert "unknown top-level key 'opo' (did you mean 'oppo'?)" in _refusal(
        capsys, ["train", "--schedule", "sync", "--config", str(bad)])


def test_deltas_defaults_fit_a_small_rollout_batch_and_a_users_own_value_does_not(tiny_assets, tmp_path, capsys):
    """No `delta:` in the YAML: Δ_max's default 16 (and Δ's start 4) are lowered to B = 2, said so; the same
    from the cluster entry with OpenRLHF's flags alone; a Δ_max the user set above B is refused, naming it."""
    own = tmp_path / "own.yaml"
    own.write_text("rollout: {batch_size: 2, n_samples_per_prompt: 2, max_new_tokens: 32}\n"
                   "train: {batch_size: 4, micro_batch_size: 2}\ndata: {max_samples: 8, max_len: 128, input_key: "
                   "input, label_key: label}\nactor: {num_gpus_per_node: 1}\ncritic: {num_gpus_per_node: 1}\n"
                   "algo: {advantage: {estimator: reinforce_baseline}}\ntask: {variant: tiny}\n")
    argv = ["train", "--schedule", "oppo", "--config", str(own), "--assets", str(tiny_assets), "--output",
            str(tmp_path / "run"), "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("--oppo.delta.max 16 (the default) lowered to --rollout.batch_size (2): at most B prompt groups can be "
            "carried; --oppo.delta.init 4 too") in out
    assert "--oppo.delta.init 2 --oppo.delta.min 0 --oppo.delta.max 2 " in out
    assert main([*argv, "--", "--oppo.delta.max", "1"]) == 0  # Δ's default start follows the user's bound
    assert "--oppo.delta.init 1 --oppo.delta.min 0 --oppo.delta.max 1 " in capsys.readouterr().out
    assert _refusal(capsys, [*argv, "--", "--oppo.delta.max", "3"]).endswith(
        "--oppo.delta.max (3) must be <= --rollout.batch_size (2): at most B prompt groups can be carried into the "
        "next step")
    cfg, _ = driver.parse(["--rollout.batch_size", "8"])
    assert (cfg.delta.init, cfg.delta.max) == (4, 8)
    assert "--oppo.delta.max 16 (the default) lowered to --rollout.batch_size (8)" in capsys.readouterr().err
