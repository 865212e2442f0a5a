"""`python -m oppo_lab convergence`: does OPPO learn what sync PPO learns, per step and per second?

Runs every schedule for every seed, seed-major (sync s0, partial s0, oppo s0, oppo-tis s0,
sync s1, ...) so that a shared machine's drift hits every schedule alike, each through
`openrlhf-oppo train` as `bench schedules` runs it, with `--train.seed <seed>` on the
config's task assets (one SFT policy, one reward model for every run) and, by default,
`--train.full_determinism_enable` (within a seed every schedule draws the same prompt
order and seeded requests). `oppo-tis` and `oppo-icepop` are the `oppo` schedule with
`--oppo.staleness.correction tis` / `icepop` (OpenRLHF's token-level importance sampling
against the recorded rollout logprobs: clipped / masked); `oppo` itself runs with the
configured correction (default `none`).

Then it reads every run directory (nothing is re-run; `--report-only` reads only):

- per step: the learned reward of the trained samples (TensorBoard
  `train/rollout/reward_mean`, else `train/reward`, else the mean of `rollouts.jsonl`'s
  rewards), the step's end (its `train/policy_loss` event) in seconds since the run's
  first driver `generate` span (timeline), the trained response lengths and their
  exact-match rate (`rollouts.jsonl`: the prompt's tokens are cut off the sequence and the
  response decoded with the task's tokenizer, then `tasks.learn.exact_match`), OPPO's
  off-policy token fraction (`oppo_metrics.jsonl`) and OpenRLHF's `vllm_kl` (logged only
  with an importance-sampling correction), `is_filter_ratio` and actor-vs-reference `kl`;
- length bias, per step: the KS distance between a schedule's trained response lengths
  and the first schedule's (`sync`) at the same step, both pooled over seeds; and, for
  OPPO runs (`oppo_trace.jsonl`), between the trained lengths and all lengths finished by
  the step's end (trained + finished but carried, pooled over seeds);
- per schedule, over seeds: final reward (mean of the last W steps, `--window`) and its
  difference to sync, seed by seed; time-to-reward (the first step end at which the W-step
  moving average of the reward reaches the threshold) and sync's time / this one's, seed
  by seed; final exact match; and whether the schedule's median moving-average reward
  stays within sync's min-max over seeds at every step;
- learn task: the SFT policy and every run's final actor on held-out prompts (`final_eval`).

Writes `convergence.json` and four PNGs under --output; asserts nothing. Results:
docs/convergence.md.

Modules, lowest first (each imports only those above it in this list, never this package):

    runs        what a name on --schedules runs, the config's task, running every run
    numbers     KS distance, moving averages, time-to-reward, bands over seeds
    read        one run directory as per-step series
    summary     per schedule over seeds, per step across seeds
    final_eval  the learn task's final actors on held-out prompts
    report      the printed table and the PNGs
    cli         `main`, the command line
"""

from __future__ import annotations

from openrlhf_oppo.tasks.learn.rollouts import Baseline, ResponseText, load_baseline, load_tokenizer, trained_samples
from oppo_lab.convergence.cli import main
from oppo_lab.convergence.numbers import (
    THRESHOLD_FRACTION,
    WINDOW_STEPS,
    band,
    final,
    ks_distance,
    ks_trained_vs_finished,
    moving_average,
    sync_threshold,
    time_to_reward,
    within_band,
)
from oppo_lab.convergence.read import DRIFT_TAGS, OFFPOLICY_KEY, REWARD_TAGS, read_run, step_baseline, trace_lengths
from oppo_lab.convergence.report import PLOTS, plot, print_report
from oppo_lab.convergence.runs import (
    DEFAULT_SCHEDULES,
    VARIANTS,
    Variant,
    default_tokenizer,
    resolve,
    run_all,
    task_root,
)
from oppo_lab.convergence.summary import summarize

__all__ = [
    "DEFAULT_SCHEDULES", "DRIFT_TAGS", "OFFPOLICY_KEY", "PLOTS", "REWARD_TAGS", "THRESHOLD_FRACTION", "VARIANTS",
    "WINDOW_STEPS", "Baseline", "ResponseText", "Variant", "band", "default_tokenizer", "final", "ks_distance",
    "ks_trained_vs_finished", "load_baseline", "load_tokenizer", "main", "moving_average", "plot", "print_report",
    "read_run", "resolve", "run_all", "step_baseline", "summarize", "sync_threshold", "task_root", "time_to_reward",
    "trace_lengths", "trained_samples", "within_band",
]
