"""OpenRLHF setups a user brings, run with OPPO for real on CPU (tiny models, logical GPUs).
The cells ride on the session's runs (tests/cli/conftest.py) where their flags combine, since a
run costs about a minute of start-up here:

- `oppo_run`: `--train.colocate_all` with sleep mode (the hybrid engine), the reward model named
  by a hub id resolved from a local hub cache, `--reward.normalize_enable` (checked against
  OpenRLHF's reward forward in test_train_oppo_on_cpu), `--ds.attn_implementation eager`;
- `megatron_run`: a `.py` reward function with `group_norm`, wandb configured without a key
  (offline).

`slow` (left out of CI's run for time, `-m slow` runs them): a run with
`--train.colocate_actor_ref --train.colocate_critic_reward` and 2 vLLM engines with n=4 (whole
groups on one engine; colocate_all would need one engine per actor GPU), and the hybrid engine
with a reward function and `--eval.dataset` every step (`hybrid_rule_run`).

An HTTP reward endpoint goes through the same engine code as the `.py` function
(`OppoRolloutActor._reward`, OpenRLHF's executor): tests/integrations/runtime/test_rule_rewards.py
drives it against a real server on 127.0.0.1."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from openrlhf_oppo import timeline

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes

TWO_STEPS = ("--data.max_samples", "8")  # 8 prompts / 4 per step
RULE_STEPS = 3  # the hybrid_rule_run fixture (tests/cli/conftest.py): 12 prompts / 4 per step
OPPO_STEPS = 4  # the oppo_run and megatron_run fixtures: 16 prompts / 4 per step


def _trained(run) -> list[dict]:
    return [g for row in run.trace() for g in row["trained"]]


def _reward_loads(run) -> list[dict]:
    return [r for r in timeline.read(run.root / "timeline") if r["role"] == "reward" and r.get("stage") == "load"]


def _tokenizer(run):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(run.assets / "actor")


def _prompts(run) -> dict[str, str]:
    """prompt text (as the chat-free tiny task feeds it) -> label"""
    rows = [json.loads(line) for line in (run.assets / "prompts.jsonl").read_text().splitlines()]
    return {r["input"]: r["label"] for r in rows}


def _check_steps(run, steps: int) -> None:
    assert run.returncode == 0, run.failure()
    trace = run.trace()
    assert [row["step"] for row in trace] == list(range(steps))
    assert all(len(row["trained"]) == 4 for row in trace)


def _check_rule_rewards(run, reward_py: Path) -> int:
    """Every trained sample's reward is the run's reward function (`reward_py`) of its decoded query."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reward_func", reward_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok, labels = _tokenizer(run), _prompts(run)
    checked = 0
    for g in _trained(run):
        prompt = tok.decode(g["prompt_ids"], skip_special_tokens=False)
        label = labels[prompt]
        for s in g["samples"]:
            query = tok.decode(g["prompt_ids"] + s["tokens"], skip_special_tokens=False)
            expected = module.reward_func([query], [prompt], [label])["rewards"][0].item()
            assert s["reward"] == pytest.approx(expected, abs=1e-6), s["sample_id"]
            checked += 1
    return checked


# ---------------------------------------------------------------- the hybrid engine, a reward model by hub id


def test_colocate_all_places_the_streaming_reward_actor_in_openrlhfs_group(oppo_run):
    """OpenRLHF places its reward group inside the colocated placement group: a 0.2 GPU share,
    not a GPU of its own outside it (which waits forever once the placement groups hold every
    GPU). The streaming reward actor takes that place."""
    _check_steps(oppo_run, OPPO_STEPS)
    loads = _reward_loads(oppo_run)
    assert len(loads) == 1 and loads[0]["placement_group"] and loads[0]["gpus"] == pytest.approx(0.2)


def test_reward_model_flags_reach_the_streaming_actor(oppo_run):
    """--ds.param_dtype (bf16 by default) and --ds.attn_implementation load the streamed reward
    model as they load OpenRLHF's; the pooling is OpenRLHF's last-token rule by default."""
    (load,) = _reward_loads(oppo_run)
    assert (load["dtype"], load["attn_implementation"], load["pooling"]) == ("bfloat16", "eager", "last")


# ---------------------------------------------------------------- rule-based rewards, with the Megatron actor


def test_py_reward_function_scores_every_sample_as_openrlhf_does(megatron_run, reward_py):
    assert megatron_run.returncode == 0, megatron_run.failure()
    assert _check_rule_rewards(megatron_run, reward_py) == 8 * OPPO_STEPS  # 4 groups x n=2 a step


def test_group_norm_trains_on_the_rule_rewards(megatron_run):
    """OpenRLHF's train/reward of each global step is the mean of the rule rewards OPPO's trace
    says that step trained, and no critic trained (group_norm)."""
    from openrlhf_oppo.bench.schedules import tensorboard_scalars

    scalars = tensorboard_scalars(megatron_run.root / "tensorboard")
    logged = {step: value for _, step, value in scalars["train/reward"]}
    traced = {row["step"] + 1: [s["reward"] for g in row["trained"] for s in g["samples"]]
              for row in megatron_run.trace()}
    assert sorted(logged) == sorted(traced) == list(range(1, OPPO_STEPS + 1))
    for step, rewards in traced.items():
        assert logged[step] == pytest.approx(sum(rewards) / len(rewards), abs=1e-5), step
    assert not any(t.startswith("train/critic") for t in scalars)  # group_norm: no critic


# ---------------------------------------------------------------- wandb


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of a wandb run file (`run-*.wandb`: a ':W&B' header, then
    LevelDB-log records in 32 KiB blocks, each a protobuf `Record`)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, parts, rows = 32768, 7, [], []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a record header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_without_a_key_logs_offline_with_oppo_and_timing_keys(megatron_run):
    """`--logger.wandb.*` without a key: the run logs offline into RUN_DIR/wandb, every step
    with OpenRLHF's metrics, OPPO's `oppo/*` and the timeline's `timing/idle/*`."""
    (run_file,) = (megatron_run.root / "wandb").glob("offline-run-*/run-*.wandb")
    steps = [r for r in _wandb_history(run_file) if "train/oppo/delta" in r]
    assert [r["train/global_step"] for r in steps] == list(range(1, OPPO_STEPS + 1))
    for row in steps:
        for key in (
            "train/reward",
            "train/policy_loss",
            "train/oppo/deferred_fraction",
            "train/oppo/chunk_size",
            "train/timing/idle/rollout",
            "train/timing/idle/actor",
        ):
            assert isinstance(row.get(key), (int, float)), (key, sorted(row))


# ---------------------------------------------------------------- slow: runs of their own


@pytest.fixture(scope="module")
def model_run(train_runs, hub_reward):
    return train_runs(
        "oppo",
        *TWO_STEPS,
        "--train.colocate_actor_ref",
        "--train.colocate_critic_reward",
        "--reward.model_name_or_path",
        hub_reward.repo,
        "--reward.normalize_enable",
        "--ds.attn_implementation",
        "eager",
        "--vllm.num_engines",
        "2",
        "--rollout.n_samples_per_prompt",
        "4",
        "--train.batch_size",
        "16",
        env=hub_reward.env(),
    )


@pytest.mark.slow
def test_colocate_critic_reward_places_the_streaming_reward_actor_in_openrlhfs_group(model_run):
    """OpenRLHF places its reward group (as under colocate_all): a 0.2 GPU share of the
    critic-reward placement group, not a GPU of its own outside it."""
    _check_steps(model_run, 2)
    loads = _reward_loads(model_run)
    assert len(loads) == 1 and loads[0]["placement_group"] and loads[0]["gpus"] == pytest.approx(0.2)


@pytest.mark.slow
def test_two_engines_decode_whole_groups(model_run):
    rows = [r for r in timeline.read(model_run.root / "timeline") if r["kind"] == "sample" and "sample" in r]
    engine_of = {r["sample"]: r["pid"] for r in rows}
    assert len(set(engine_of.values())) == 2, "both engines decode"
    for g in _trained(model_run):
        assert len(g["samples"]) == 4
        assert len({engine_of[s["sample_id"]] for s in g["samples"]}) == 1, f"group {g['group_id']} split"


@pytest.mark.slow
def test_colocate_all_with_a_reward_function(hybrid_rule_run, reward_py):
    _check_steps(hybrid_rule_run, RULE_STEPS)
    assert _reward_loads(hybrid_rule_run) == []  # no reward model anywhere
    assert _check_rule_rewards(hybrid_rule_run, reward_py) == 8 * RULE_STEPS  # 4 groups x n=2 a step


@pytest.mark.slow
def test_eval_runs_with_a_reward_function(hybrid_rule_run):
    from openrlhf_oppo.bench.schedules import tensorboard_scalars

    tags = tensorboard_scalars(hybrid_rule_run.root / "tensorboard")
    evals = [t for t in tags if t.startswith("eval")]
    assert evals and all(len(tags[t]) == RULE_STEPS for t in evals), sorted(tags)  # --eval.steps 1: each step
