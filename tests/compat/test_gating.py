"""The compat layer is inert where CUDA is present (the only test that mocks
torch.cuda.is_available), and where it acts it leaves torch.compile's trace rules whole."""

from __future__ import annotations

import subprocess
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


def test_cuda_calls_redirected_to_the_cpu_leave_torch_compiles_trace_rules_consistent():
    """torch.compile (Megatron's fused kernels at import, vLLM's sampler) maps each torch function to a
    trace rule and asserts when one object stands under two names with different rules: each replaced
    torch.cuda attribute gets a function of its own. In a subprocess: the patch stays out of this one."""
    code = ("import torch, torch._dynamo.trace_rules as rules\n"
            "from openrlhf_oppo.compat import patches\n"
            "patches.cuda_calls_to_cpu(None)\n"
            "assert torch.cuda.set_device is not torch.cuda.synchronize\n"
            "rules.lookup(torch.add)  # builds the rule map over every torch name\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
