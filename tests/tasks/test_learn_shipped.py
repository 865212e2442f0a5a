"""The learn variants' shipped builds (openrlhf_oppo.tasks.learn.shipped): each matches its
variant's spec and installs into an asset directory in place of a build (models byte for byte,
the model-free splits written again); a spec with nothing shipped is refused with the lab's command."""

from __future__ import annotations

import json

import pytest

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


def test_a_spec_with_no_shipped_build_names_the_lab_command(tmp_path):
    from dataclasses import replace

    spec = replace(learn.VARIANTS["learn-longtail"], loop_share=0.05)
    with pytest.raises(ValueError, match="python -m oppo_lab build-learn"):
        learn.build(tmp_path / "assets", spec, log=lambda line: None)
