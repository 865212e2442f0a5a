"""The learn variants' shipped builds (openrlhf_oppo.tasks.learn.shipped): each matches its
variant's spec, installs into an asset directory in place of a build (models byte for byte,
the model-free splits written again), and (slow) a rebuild from scratch lands within the
stated tolerances of the shipped summary."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo import tasks
from openrlhf_oppo.tasks import learn
from openrlhf_oppo.tasks.learn import shipped


@pytest.mark.parametrize("variant", shipped.SHIPPED_VARIANTS)
def test_every_shipped_variant_ships_a_build_of_its_spec(variant):
    spec = learn.VARIANTS[variant]
    found = shipped.shipped(spec)
    assert found is not None, f"no shipped build of {variant} for its spec: rebuild and ship it (see shipped.py)"
    summary = json.loads(found.summary.read_text())
    assert summary["version"] == learn.ASSET_VERSION
    size = sum(f.stat().st_size for f in found.root.rglob("*") if f.is_file())
    assert size < 5e6  # a few MB: models, tokenizer, prompts, baseline


def test_a_changed_spec_has_no_shipped_build():
    spec = learn.VARIANTS["learn-longtail"]
    from dataclasses import replace

    assert shipped.shipped(replace(spec, loop_share=0.05)) is None
    assert shipped.variant_of(replace(spec, loop_share=0.05)) is None


def test_build_installs_the_shipped_build(tmp_path):
    spec = learn.VARIANTS["learn-longtail"]
    lines = []
    assets = learn.build(tmp_path / "assets", spec, log=lines.append)
    assert assets.is_built(spec) and "installing the shipped learn-longtail build" in lines[0]
    source = shipped.shipped(spec)
    for name in ("actor/model.safetensors", "reward/model.safetensors", "tokenizer/tokenizer.json",
                 "data/sft_baseline.jsonl", "summary.json"):
        assert (assets.root / name).read_bytes() == (source.root / name).read_bytes(), name
    # the model-free splits, written again from the spec: the RL prompts the shipped baseline was made on
    baseline = learn.read_jsonl(assets.sft_baseline)
    assert [r["input"] for r in baseline] == [r["input"] for r in learn.read_jsonl(assets.prompts)]
    sft = learn.read_jsonl(assets.data / "sft.jsonl")
    assert len(sft) == spec.sft_samples and len(learn.read_jsonl(assets.data / "rm_heldout.jsonl")) == 512
    assert sum(not r["output"].endswith("<|eos|>") for r in sft) == pytest.approx(spec.loop_share * len(sft), rel=0.2)
    # installed: the next call finds it built
    lines.clear()
    assert learn.build(tmp_path / "assets", spec, log=lines.append).root == assets.root and not lines


def test_ship_refuses_an_unfinished_build(tmp_path):
    with pytest.raises(ValueError, match="not a finished build of learn-longtail"):
        shipped.ship("learn-longtail", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["learn-longtail"])
def test_a_rebuild_matches_the_shipped_summary(tmp_path, variant):
    """`prepare --force`: a build from scratch (~10 min on 2 cores) lands within TOLERANCES
    of the shipped summary."""
    spec = learn.VARIANTS[variant]
    rebuilt = json.loads(tasks.build(variant, tmp_path / variant, force=True).summary.read_text())
    ship = json.loads(shipped.shipped(spec).summary.read_text())

    def get(summary, key):
        for part in key.split("."):
            summary = summary[part]
        return summary

    for key, tolerance in shipped.TOLERANCES.items():
        a, b = get(rebuilt, key), get(ship, key)
        allowed = tolerance * b if key == "rm_train_pairs" else tolerance
        assert abs(a - b) <= allowed, f"{key}: rebuilt {a}, shipped {b}, tolerance {allowed}"
