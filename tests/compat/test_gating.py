"""The compat layer is inert where CUDA is present (the only test that mocks
torch.cuda.is_available)."""

from __future__ import annotations

import sys
import types
from unittest import mock

import torch

from openrlhf_oppo import compat, hooks


class _Untouchable(types.ModuleType):
    """A module that fails the test if a patch so much as reads an attribute."""

    def __getattr__(self, name):
        raise AssertionError(f"patch touched module attribute {name!r} although CUDA is present")


def test_every_patch_is_inert_when_cuda_is_present():
    set_device, current_device, synchronize = torch.cuda.set_device, torch.cuda.current_device, torch.cuda.synchronize
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        for patch in compat.PATCHES:
            patch.fn(_Untouchable(patch.module))
    assert (torch.cuda.set_device, torch.cuda.current_device, torch.cuda.synchronize) == (
        set_device,
        current_device,
        synchronize,
    )


def test_apply_installs_nothing_and_launch_env_is_empty_when_cuda_is_present():
    before = list(sys.meta_path)
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        assert compat.apply() is False
        assert compat.launch_env({"PYTHONPATH": "/x"}) == {}
    assert sys.meta_path == before
    assert hooks._FINDER not in sys.meta_path or hooks._FINDER in before


def test_launch_env_without_cuda_carries_the_compat_layer_to_every_process():
    env = compat.launch_env({"PYTHONPATH": "/already/there"})
    assert env["OPPO_COMPAT"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(compat.SITE_DIR) == str(hooks.SITE_DIR)
    assert "/already/there" in env["PYTHONPATH"].split(":")
    assert (compat.SITE_DIR / "sitecustomize.py").exists()
    assert '"GPU": 8' in env["RAY_OVERRIDE_RESOURCES"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
