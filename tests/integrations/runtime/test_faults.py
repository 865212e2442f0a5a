"""Crash injection's schedule (`faults.due`): a planned fault fires once per run directory, at a
call number seeded by its step, and a step that makes too few calls of its kind hands it to the
next step that makes enough (with async admission a step can take its batch without one engine
reply: the rollout fault of a CI launch never fired so)."""

from __future__ import annotations

import random

import pytest

from openrlhf_oppo import run_env
from openrlhf_oppo.integrations.runtime import faults


@pytest.fixture
def plan(tmp_path, monkeypatch):
    monkeypatch.setenv(run_env.LEDGER_JSONL, str(tmp_path / "ledger.jsonl"))

    def set_plan(text: str) -> None:
        monkeypatch.setenv(run_env.FAULTS, text)

    return set_plan


def test_a_fault_fires_once_in_its_step_at_its_seeded_call(plan):
    plan("rollout@2")
    k = random.Random(2).randint(1, 3)
    assert not faults.due("rollout", 1, k)  # not before its step
    assert [faults.due("rollout", 2, calls) for calls in range(1, 4)] == [calls == k for calls in range(1, 4)]
    assert not faults.due("rollout", 2, k) and not faults.due("rollout", 3, k)  # once per run directory


def test_a_step_with_too_few_calls_hands_the_fault_to_the_next_step_that_makes_them(plan):
    plan("rollout@2,reward@1")
    k = random.Random(2).randint(1, 3)
    assert not any(faults.due("rollout", 2, calls) for calls in range(1, k))  # step 2 ends short of k calls
    assert faults.due("rollout", 3, k)
    assert not faults.due("rollout", 4, k)
    assert faults.due("reward", 5, random.Random(1).randint(1, 3))  # another kind keeps its own plan


def test_a_fault_without_a_call_count_fires_at_its_step_or_the_first_after(plan):
    plan("driver@3")
    assert not faults.due("driver", 2)
    assert faults.due("driver", 4)  # step 3's checkpoint was not written: the next one's
    assert not faults.due("driver", 5)


def test_a_bad_plan_names_the_variable(plan):
    plan("rollout@two")
    with pytest.raises(ValueError, match="OPPO_FAULTS: expected KIND@STEP"):
        faults.due("rollout", 1, 1)
