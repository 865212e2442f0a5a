"""The vLLM worker extension of OPPO's rollout engines: OpenRLHF 0.11.2's `WorkerWrap` (weight-update
group, `update_weight`) plus the receiving side of a sharded background sync on GPUs.

`OppoRolloutActor` names this class as vLLM's `worker_extension_cls` in place of OpenRLHF's, so every
worker of an engine has these methods for `collective_rpc`; on CPU the compat layer's patches of
`WorkerWrap` reach it through the base class.
"""

from __future__ import annotations

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

OPENRLHF_WORKER = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
OPPO_WORKER = f"{__name__}.OppoWorkerWrap"


class OppoWorkerWrap(WorkerWrap):
    def receive_shards(self, metas: list[tuple], senders: int) -> None:
        """Each (name, dtype, shape, partition numel) in order: one partition from each of the actor's
        `senders` ranks (group ranks 0 .. senders - 1, `background_sync.shard_group`), received side by
        side in one NCCL group call, reassembled and loaded as OpenRLHF's `update_weight` loads one."""
        import torch

        from openrlhf_oppo.compat.weight_sync import reassemble

        group = self._model_update_group
        stream = torch.cuda.current_stream()
        for name, dtype, shape, numel in metas:
            if dtype != self.model_config.dtype:
                raise ValueError(f"weight sync: {name} arrives as {dtype}, the engine runs {self.model_config.dtype}")
            flat = torch.empty(senders * numel, dtype=dtype, device="cuda")
            group.group_start()
            for rank in range(senders):
                group.recv(flat.narrow(0, rank * numel, numel), rank, stream)
            group.group_end()
            self.model_runner.model.load_weights(weights=[(name, reassemble(flat, shape))])
            del flat
