"""The learn variants' built assets, shipped in the package (`shipped/<variant>/`, about 3.5 MB
each): what a run needs of a build (tokenizer, SFT policy, reward model, RL prompts, the SFT
policy's baseline, the build's summary and BUILD_OK), so that every machine trains from the
same models. A build is not reproducible across machines: float reductions differ with the
CPU's kernels, and 300+ optimizer steps amplify the difference (the same spec gave held-out
reward-model accuracy 0.81, 0.84 and 0.89 on three machines of one kind).

`build` installs the shipped copy (`install`, seconds) when its BUILD_OK matches the
variant's spec, and builds from scratch otherwise or with `force` (`openrlhf-oppo prepare
--force`). `ship` copies a fresh build here (`python -m openrlhf_oppo.tasks.learn.shipped
VARIANT DIR`); `tests/tasks/test_learn_shipped.py` checks a rebuild against the shipped
summary within `TOLERANCES`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from openrlhf_oppo.tasks.learn.assets import VARIANTS, LearnAssets, LearnSpec, build_marker, write_data

SHIPPED_DIR = Path(__file__).parent / "shipped"
SHIPPED_VARIANTS = ("learn-longtail",)
"""Variants with a shipped build. `learn` is built on first use (~7 min)."""
SHIPPED = ("BUILD_OK", "summary.json", "data/sft_baseline.jsonl", "tokenizer", "actor", "reward")
"""What is shipped of a build; the model-free splits (`write_data`: SFT records, held-out
pairs, RL prompts) are written again on install, all but the reward model's training pairs."""

TOLERANCES = {
    "rm_heldout_accuracy": 0.06,
    "sft_policy.exact_match": 0.06,
    "sft_policy.response_tokens.at_cap": 0.03,
    "sft_loss_last": 0.15,
    "rm_train_pairs": 0.02,  # relative: the SFT policy's wrong samples vary with the policy
}
"""How far a rebuild may land from the shipped summary (absolute, `rm_train_pairs` relative):
about the spread of builds of one spec measured across machines and seeds (docs/convergence.md)."""


def _copy(source: Path, target: Path, names: tuple[str, ...]) -> None:
    """Copy files and directories `names` from `source` to `target` (a directory's checkpoint
    leftovers stay behind)."""
    for name in names:
        src, dst = source / name, target / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.bin", "training_args*"))
        else:
            shutil.copyfile(src, dst)


def variant_of(spec: LearnSpec) -> str | None:
    return next((name for name, s in VARIANTS.items() if s == spec), None)


def shipped(spec: LearnSpec) -> LearnAssets | None:
    """The shipped build of `spec`'s variant, if there is one and it was built with `spec`."""
    name = variant_of(spec)
    found = LearnAssets(SHIPPED_DIR / name) if name else None
    return found if found is not None and found.is_built(spec) else None


def install(assets: LearnAssets, spec: LearnSpec, log=print) -> bool:
    """Copy the shipped build of `spec` into `assets.root` (the model-free splits written
    again from the spec); False if none is shipped for it."""
    source = shipped(spec)
    if source is None:
        return False
    log(f"learn: installing the shipped {variant_of(spec)} build into {assets.root} (its measurements: "
        f"summary.json there; `prepare --force` rebuilds it)")
    assets.root.mkdir(parents=True, exist_ok=True)
    (assets.root / "BUILD_OK").unlink(missing_ok=True)
    _copy(source.root, assets.root, SHIPPED[1:])
    from transformers import AutoTokenizer

    write_data(assets, spec, AutoTokenizer.from_pretrained(assets.tokenizer).eos_token, rm_training_pairs=False)
    shutil.copyfile(source.root / "BUILD_OK", assets.root / "BUILD_OK")  # last: the install is whole
    return True


def ship(variant: str, built: Path | str) -> Path:
    """Copy a finished build of `variant` (at `built`) into the package as its shipped build."""
    source, spec = LearnAssets(Path(built).expanduser()), VARIANTS[variant]
    if not source.is_built(spec):
        raise ValueError(f"{source.root}: not a finished build of {variant} ({build_marker(spec)[:40]}...)")
    target = SHIPPED_DIR / variant
    shutil.rmtree(target, ignore_errors=True)
    _copy(source.root, target, SHIPPED)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in VARIANTS:
        sys.exit(f"usage: python -m openrlhf_oppo.tasks.learn.shipped {{{','.join(VARIANTS)}}} BUILT_DIR")
    print(ship(sys.argv[1], sys.argv[2]))
