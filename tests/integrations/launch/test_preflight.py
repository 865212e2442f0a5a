"""Input checks before launch (integrations.launch.preflight): each bad input is an error
naming the flag, file or row; long prompts are counted in RUN_DIR/preflight.json.
Tokenizers are built in code (tiny BPE and word-level); no model, no Ray."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from openrlhf_oppo.integrations.launch import preflight, yaml_config
from openrlhf_oppo.integrations.launch.schedules import SCHEDULES
from openrlhf_oppo.tasks import tiny

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"


def _wordlevel(path: Path, words: list[str], eos: str = "<|eos|>") -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<|pad|>", "<|eos|>", "<|end|>", *words]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|pad|>",
                            eos_token=eos).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    tiny.build_tokenizer(root / "actor", 512)
    shutil.copytree(root / "actor", root / "reward")
    with (root / "prompts.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in tiny.prompt_records())
    return root


@pytest.fixture
def flags(assets):
    out = dict(yaml_config.load(CONFIG).flags)
    out.update({"actor.model_name_or_path": str(assets / "actor"), "reward.model_name_or_path": str(assets / "reward"),
                "data.prompt_dataset": str(assets / "prompts.jsonl")})
    return out


def _inputs(flags, tmp_path, *extra, oppo=False):
    return preflight.check_inputs(flags, list(extra), tmp_path / "run" / "preflight.json", oppo)


def _dataset(tmp_path, lines: list[str], name="data.jsonl") -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# ------------------------------------------------------------------ dataset rows


def test_line_that_is_not_json_names_file_and_line(flags, tmp_path):
    flags["data.prompt_dataset"] = path = _dataset(tmp_path, ['{"input": "a", "label": "1"}', "", '{"input": "b",'])
    with pytest.raises(ValueError, match=rf"--data.prompt_dataset {path}: line 3 is not valid JSON"):
        _inputs(flags, tmp_path)


def test_row_without_input_key_names_file_row_flag_and_its_keys(flags, tmp_path):
    flags["data.prompt_dataset"] = path = _dataset(
        tmp_path, ['{"input": "a", "label": "1"}', '{"question": "b", "label": "2"}'])
    with pytest.raises(ValueError) as err:
        _inputs(flags, tmp_path)
    assert str(err.value) == (f"--data.prompt_dataset {path}: row 2 (line 2) has no --data.input_key 'input'; "
                              "its keys: 'question', 'label'")


def test_row_without_label_key_names_the_flag(flags, tmp_path):
    flags["data.prompt_dataset"] = path = _dataset(tmp_path, ['{"input": "a", "label": "1"}', '{"input": "b"}'])
    message = rf"{path}: row 2 \(line 2\) has no --data.label_key 'label'; its keys: 'input'"
    with pytest.raises(ValueError, match=message):
        _inputs(flags, tmp_path)


@pytest.mark.parametrize("value", ['""', "42", '["x"]', "null"])
def test_input_that_is_not_a_non_empty_string_is_refused(flags, tmp_path, value):
    flags["data.prompt_dataset"] = path = _dataset(tmp_path, ['{"input": "a", "label": "1"}',
                                                             f'{{"input": {value}, "label": "2"}}'])
    with pytest.raises(ValueError, match=rf"{path}: row 2 \(line 2\).*--data.input_key 'input'"):
        _inputs(flags, tmp_path)


def test_json_array_file_and_row_that_is_not_an_object(flags, tmp_path):
    flags["data.prompt_dataset"] = path = _dataset(tmp_path, ['[{"input": "a", "label": "1"},', ' ["b"]]'], "d.json")
    with pytest.raises(ValueError, match=rf"{path}: row 2 is a JSON list, not an object"):
        _inputs(flags, tmp_path)


def test_directory_reads_the_split_files_as_openrlhf_does(flags, tmp_path):
    _dataset(tmp_path / "ds", ['{"input": "a", "label": "1"}'], "train.jsonl")
    bad = _dataset(tmp_path / "ds", ['{"input": "a", "label": "1"}', '{"label": "2"}'], "train-2.jsonl")
    _dataset(tmp_path / "ds", ["not json"], "test.jsonl")  # another split: not read
    flags["data.prompt_dataset"] = str(tmp_path / "ds")
    with pytest.raises(ValueError, match=rf"{bad}: row 2 \(line 2\) has no --data.input_key"):
        _inputs(flags, tmp_path)
    with pytest.raises(ValueError, match=r"--data.prompt_split 'dev': .* has the splits train, test"):
        _inputs(flags, tmp_path, "--data.prompt_split", "dev")


def test_hub_dataset_and_hub_models_are_skipped_with_a_notice(flags, tmp_path, capsys):
    flags["data.prompt_dataset"] = "OpenRLHF/prompt-collection-v0.1"
    report = _inputs(flags, tmp_path)
    out = capsys.readouterr().out
    assert "--data.prompt_dataset OpenRLHF/prompt-collection-v0.1 not checked: not a local" in out
    assert report["rows"] == 0 and report["prompts_counted"] == 0
    flags["reward.model_name_or_path"] = "OpenRLHF/Llama-3-8b-rm-mixture"
    report = _inputs(flags, tmp_path)
    assert "--reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-mixture not checked" in capsys.readouterr().out
    assert report["tokenizers_compared"] == []


# ----------------------------------------------------------------- prompt lengths


def _token_counts(assets, texts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "actor")
    return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def test_prompts_over_the_budget_are_counted_warned_and_written(flags, tmp_path, assets, capsys):
    lengths = _token_counts(assets, [r["input"] for r in tiny.prompt_records()[:16]])
    limit = sorted(lengths)[len(lengths) // 2]
    over = sum(n > limit for n in lengths)
    assert 0 < over < 16
    report = _inputs(flags, tmp_path, "--data.max_len", str(192 + limit))  # tiny-cpu: max_new_tokens 192
    written = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert written == report
    assert (report["prompts_counted"], report["prompts_over_limit"], report["prompt_limit_tokens"]) == (16, over, limit)
    assert report["longest_prompt_tokens"] == max(lengths)
    out = capsys.readouterr().out
    assert (f"warning: {over} of 16 prompts are longer than the prompt budget of {limit} tokens "
            f"(--data.max_len {192 + limit} - --rollout.max_new_tokens 192)") in out
    assert f"longest: {max(lengths)} tokens" in out


def test_budget_without_max_new_tokens_is_max_len_minus_one(flags, tmp_path, assets):
    del flags["rollout.max_new_tokens"]
    lengths = _token_counts(assets, [r["input"] for r in tiny.prompt_records()[:16]])
    report = _inputs(flags, tmp_path, "--data.max_len", str(max(lengths)))
    assert report["prompt_limit_tokens"] == max(lengths) - 1
    assert report["prompts_over_limit"] == lengths.count(max(lengths))


def test_input_template_is_applied_before_counting(flags, tmp_path):
    report = _inputs(flags, tmp_path, "--data.input_template", "red cat red cat red cat red cat {}",
                     "--data.max_len", "208")  # budget 16 tokens
    assert report["prompt_text"] == "input template"
    assert report["longest_prompt_tokens"] > _inputs(flags, tmp_path)["longest_prompt_tokens"]


def test_every_prompt_over_the_budget_is_an_error(flags, tmp_path):
    with pytest.raises(ValueError, match=r"all 16 prompts are longer than the prompt budget of 1 tokens "
                                         r"\(--data.max_len 193 - --rollout.max_new_tokens 192\)"):
        _inputs(flags, tmp_path, "--data.max_len", "193")


def test_chat_template_missing_names_the_flag(flags, tmp_path):
    with pytest.raises(ValueError, match=r"--data.apply_chat_template: the actor's tokenizer cannot apply"):
        _inputs(flags, tmp_path, "--data.apply_chat_template")


# --------------------------------------------------------------------- tokenizers


WORDS = ["Hello", "world", "The", "quick", "brown", "fox", ",", "!", "."]


def test_same_tokenizer_passes(flags, tmp_path):
    assert _inputs(flags, tmp_path)["tokenizers_compared"] == [flags["reward.model_name_or_path"]]


@pytest.mark.parametrize(
    "reward_words, reward_eos, difference",
    [
        (WORDS[:-1], "<|eos|>", "vocabulary size 13 (actor) vs 12 (reward)"),
        (WORDS, "<|end|>", "eos_token_id 2 (actor) vs 3 (reward)"),
        ([WORDS[1], WORDS[0], *WORDS[2:]], "<|eos|>",
         "token ids of 'Hello, world!' [4, 10, 5, 11] (actor) vs [5, 10, 4, 11] (reward)"),
    ],
)
def test_reward_tokenizer_that_differs_names_both_paths_and_the_difference(flags, tmp_path, reward_words, reward_eos,
                                                                           difference):
    flags["actor.model_name_or_path"] = actor = _wordlevel(tmp_path / "a", WORDS)
    flags["reward.model_name_or_path"] = reward = _wordlevel(tmp_path / "r", reward_words, reward_eos)
    with pytest.raises(ValueError) as err:
        _inputs(flags, tmp_path)
    assert str(err.value).startswith(f"--reward.model_name_or_path {reward}: its tokenizer differs from the actor's "
                                     f"(--actor.model_name_or_path {actor}): {difference};")


# ---------------------------------------------------------------- flags and config


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rollout.batch_size", "3"], "--rollout.batch_size x --rollout.n_samples_per_prompt = 3 x 2 = 6 samples "
                                        "per step must be a multiple of --train.batch_size (8)"),
        (["--train.batch_size", "16"], "= 8 samples per step must be a multiple of --train.batch_size (16)"),
        (["--train.micro_batch_size", "3"], "--train.batch_size (8) must be a multiple of --train.micro_batch_size (3)"
                                            " x the actor's data-parallel size (1 = --actor.num_nodes"),
        (["--actor.num_gpus_per_node", "4"], "--train.micro_batch_size (4) x the actor's data-parallel size (4 = "),
        (["--rollout.max_new_tokens", "256"], "--rollout.max_new_tokens (256) must be >= 1 and < --data.max_len (256)"),
        (["--rollout.n_samples_per_prompt", "0"], "--rollout.n_samples_per_prompt must be an integer >= 1, got 0"),
        (["--rollout.batch_size", "four"], "argument --rollout.batch_size: invalid int value: 'four'"),
        (["--rollout.batchsize", "4"], "--rollout.batchsize: not a flag of OpenRLHF's train_ppo_ray"),
        (["--oppo.delta.max", "2"], "--oppo.delta.max: an OPPO flag; --oppo.* flags apply "
                                    "to the oppo* schedules only"),
    ],
)
def test_inconsistent_flags_name_the_flags(flags, extra, message):
    with pytest.raises(ValueError) as err:
        preflight.check_config(flags, extra, oppo=False)
    assert message in str(err.value)


def test_delta_max_above_the_rollout_batch_is_refused_with_both_flags(flags):
    with pytest.raises(ValueError, match=r"--oppo.delta.max \(5\) must be <= --rollout.batch_size \(4\)"):
        preflight.check_config(flags, ["--oppo.delta.max", "5"], oppo=True)
    preflight.check_config(flags, ["--oppo.delta.max", "5", "--oppo.delta.enable", "false"], oppo=True)


@pytest.mark.parametrize("config", ["tiny-cpu.yaml", "longtail-cpu.yaml"])
def test_shipped_configs_pass(config):
    cfg = yaml_config.load(REPO / "configs" / config)
    from openrlhf_oppo.config import to_cli_args
    from openrlhf_oppo.integrations.launch import schedules

    for name in SCHEDULES:
        oppo = schedules.oppo_config(name, cfg.oppo)
        flags = {**cfg.flags, **schedules.schedule_flags(name, cfg.flags)}
        preflight.check_config(flags, to_cli_args(oppo) if oppo else [], oppo=oppo is not None)


# ------------------------------------------------------------------ the CLI path


def _config_with(tmp_path, flags) -> str:
    raw = yaml.safe_load(CONFIG.read_text())
    raw["actor"]["model_name_or_path"] = flags["actor.model_name_or_path"]
    raw["reward"]["model_name_or_path"] = flags["reward.model_name_or_path"]
    raw["data"]["prompt_dataset"] = flags["data.prompt_dataset"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_runs_the_checks_before_launch(flags, tmp_path, monkeypatch, schedule):
    from openrlhf_oppo.cli.main import main
    from openrlhf_oppo.integrations.launch import launcher

    launched = []
    monkeypatch.setattr(launcher, "launch", lambda flags, paths, *a, **k: launched.append(paths) or
                        launcher.RunResult(0, 0.0, paths))
    argv = ["train", "--schedule", schedule, "--config", _config_with(tmp_path, flags), "--output", str(tmp_path / "r")]
    assert main(argv) == 0 and launched
    assert json.loads((tmp_path / "r" / "preflight.json").read_text())["prompts_counted"] == 16


def test_cli_error_is_one_line_and_nothing_is_launched(flags, tmp_path, monkeypatch, capsys):
    from openrlhf_oppo.cli.main import main
    from openrlhf_oppo.integrations.launch import launcher

    launched = []
    monkeypatch.setattr(launcher, "launch", lambda flags, paths, *a, **k: launched.append(paths) or
                        launcher.RunResult(0, 0.0, paths))
    flags["data.prompt_dataset"] = path = _dataset(tmp_path, ['{"prompt": "a", "label": "1"}'])
    argv = ["train", "--schedule", "oppo", "--config", _config_with(tmp_path, flags), "--output", str(tmp_path / "r")]
    assert main(argv) == 2 and not launched
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{path}: row 1 (line 1) has no --data.input_key 'input'; its keys: 'prompt', 'label'" in err
    # --skip-input-checks skips the file checks only; flag checks still run
    assert main([*argv, "--skip-input-checks"]) == 0 and launched
    assert not (tmp_path / "r" / "preflight.json").exists()
    assert main([*argv, "--skip-input-checks", "--", "--rollout.batch_size", "3"]) == 2
    assert "must be a multiple of --train.batch_size" in capsys.readouterr().err
