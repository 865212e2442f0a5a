"""The OpenRLHF 0.11.2 symbols the lab touches beyond the product's (`openrlhf_oppo.upstream`):
building the learn task's SFT policy and reward model with OpenRLHF's own trainers, in fp32.
`oppo_lab/tests/test_upstream.py` resolves each against the installed OpenRLHF."""

from __future__ import annotations

from openrlhf_oppo.upstream import Touch

TOUCH_POINTS: tuple[Touch, ...] = (
    Touch("openrlhf.cli.train_sft", "called", "learn.trainers"),
    Touch("openrlhf.cli.train_rm", "called", "learn.trainers"),
    Touch("openrlhf.utils.utils.convert_to_torch_dtype", "patched", "learn.trainers"),
    Touch("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy.setup_dataloader", "patched", "learn.trainers"),
    Touch("openrlhf.datasets.SFTDataset", "patched", "learn.trainers"),  # __getitem__: a loop record has no end
)
