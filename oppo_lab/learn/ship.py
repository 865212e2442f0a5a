"""Shipping a learn build into the package (`openrlhf_oppo/tasks/learn/shipped/<variant>/`), and how
far a rebuild may land from what is shipped (`TOLERANCES`, checked by `oppo_lab/tests/tasks/test_learn_shipped.py`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from openrlhf_oppo.tasks.learn.assets import VARIANTS, LearnAssets, build_marker
from openrlhf_oppo.tasks.learn.shipped import SHIPPED, SHIPPED_DIR, copy_build

TOLERANCES = {
    "rm_heldout_accuracy": 0.06,
    "sft_policy.exact_match": 0.06,
    "sft_policy.response_tokens.at_cap": 0.03,
    "sft_loss_last": 0.15,
    "rm_train_pairs": 0.02,  # relative: the SFT policy's wrong samples vary with the policy
}
"""How far a rebuild may land from the shipped summary (absolute, `rm_train_pairs` relative):
about the spread of builds of one spec measured across machines and seeds (oppo_lab/docs/convergence.md)."""



def ship(variant: str, built: Path | str) -> Path:
    """Copy a finished build of `variant` (at `built`) into the package as its shipped build."""
    source, spec = LearnAssets(Path(built).expanduser()), VARIANTS[variant]
    if not source.is_built(spec):
        raise ValueError(f"{source.root}: not a finished build of {variant} ({build_marker(spec)[:40]}...)")
    target = SHIPPED_DIR / variant
    shutil.rmtree(target, ignore_errors=True)
    copy_build(source.root, target, SHIPPED)
    return target
