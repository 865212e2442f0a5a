"""The ablation schedules: OPPO with one part switched off or changed, for studies of what each part
buys. Importing this module registers them (`openrlhf_oppo.integrations.launch.schedules.register`),
so that `python -m oppo_lab train|schedules` and the simulator accept them beside the product's.

    oppo-ref    OPPO with the reference streamed too (--oppo.streaming.reference true): streaming
                reference actors in OpenRLHF's reference group replace its reference forward
    oppo-decode OPPO with carried groups decoding through training wherever the engines are (on a
                host without CUDA `oppo` holds them from the batch to the weight sync)
    oppo-async-inter
                async admission without streaming: OpenRLHF's reward forward, so under
                --train.colocate_all --train.async_enable the reward model shares the DeepSpeed
                models' GPUs, as in OpenRLHF's async mode (oppo-async-bg without the background sync)
    oppo-eq4    OPPO with the paper's eq. 4 Δ rule (reward slope) instead of the system rule
    oppo-off    OPPO with Δ = 0, streaming, length buckets, vectorized advantages and rollout old
                log-probs off: synchronous PPO through OPPO's machinery (what it costs with nothing to
                overlap)
    oppo-padded OPPO with length buckets, vectorized advantages and rollout old log-probs off
                (--oppo.train.*): OpenRLHF's shuffled micro-batches, advantage loop and old-log-prob
                forward, so its gain over OpenRLHF's modes is the overlap alone
    oppo-recompute
                OPPO with the actor's old-log-prob forward over every sample (--oppo.train.old_logprobs
                recompute), as OpenRLHF makes experience: what taking fresh samples' rollout log-probs buys
    oppo-fixed  OPPO with Δ fixed at delta.init (first B of B+Δ with a constant pool, as
                other frameworks ship it): the adaptive Δ's baseline
    oppo-intra  OPPO with Δ = 0: streaming only
    oppo-inter  OPPO with streaming off: carry-over only (each response scored once, at its end)
"""

from __future__ import annotations

from openrlhf_oppo.config import ASYNC_POLICY_LAG
from openrlhf_oppo.integrations.launch.schedules import OPPO_ENTRY, Schedule, all_schedules, register

# OpenRLHF's own micro-batches, advantage loop and old-log-prob forward (--oppo.train.*)
OPENRLHFS_EXPERIENCE = {"length_buckets": False, "vectorized_advantages": False, "old_logprobs": "recompute"}

ABLATIONS: tuple[Schedule, ...] = (
        Schedule("oppo-decode", "OPPO with carried groups decoding while the trainer trains, also where they share "
                 "its devices (--oppo.staleness.carried_in_training decode; on a CPU host 'oppo' holds them)",
                 entry_module=OPPO_ENTRY, oppo={"staleness": {"carried_in_training": "decode"}}),
        Schedule("oppo-ref", "OPPO with the reference streamed too (streaming reference actors replace "
                 "OpenRLHF's reference forward)", entry_module=OPPO_ENTRY, oppo={"streaming": {"reference": True}}),
        Schedule("oppo-async-inter", f"OPPO with async admission (max_policy_lag {ASYNC_POLICY_LAG}) and carry-over, "
                 "no streaming: the reward model can share the DeepSpeed models' GPUs", entry_module=OPPO_ENTRY,
                 oppo={"staleness": {"max_policy_lag": ASYNC_POLICY_LAG}, "streaming": {"enable": False}}),
        Schedule("oppo-eq4", "OPPO with the paper's eq. 4 Δ rule (reward slope)", entry_module=OPPO_ENTRY,
                 oppo={"delta": {"rule": "eq4"}}),
        Schedule("oppo-off", "OPPO with Δ = 0, streaming, length buckets and vectorized advantages off: its machinery, "
                 "nothing to overlap",
                 entry_module=OPPO_ENTRY, oppo={"delta": {"enable": False}, "streaming": {"enable": False},
                                                "train": OPENRLHFS_EXPERIENCE}),
        Schedule("oppo-padded", "OPPO with OpenRLHF's micro-batches, advantage loop and old-log-prob forward: the "
                 "overlap alone", entry_module=OPPO_ENTRY, oppo={"train": OPENRLHFS_EXPERIENCE}),
        Schedule("oppo-recompute", "OPPO with the actor's old-log-prob forward over every sample, as OpenRLHF makes "
                 "experience", entry_module=OPPO_ENTRY, oppo={"train": {"old_logprobs": "recompute"}}),
        Schedule("oppo-fixed", "OPPO with a fixed Δ = delta.init (first B of B+Δ, as a saturated pool)",
                 entry_module=OPPO_ENTRY, oppo={"delta": {"adaptive": False}}),
        Schedule("oppo-intra", "OPPO intra-step streaming only (Δ = 0)", entry_module=OPPO_ENTRY,
                 oppo={"delta": {"enable": False}}),
        Schedule("oppo-inter", "OPPO inter-step carry-over only (no streaming)", entry_module=OPPO_ENTRY,
                 oppo={"streaming": {"enable": False}}),
)

register(*ABLATIONS)
ALL: dict[str, Schedule] = all_schedules()
"""The product's schedules and the ablations."""
