"""OpenRLHF 0.11.2 imports flash_attn at module top (openrlhf.models.ring_attn_utils);
tests that import its modules on a CPU machine need the stand-in registered. It only
adds modules to sys.modules; it changes no torch behaviour."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _flash_attn_standin():
    if not torch.cuda.is_available():
        from openrlhf_oppo.compat import flash_attn_standin

        flash_attn_standin.install()
