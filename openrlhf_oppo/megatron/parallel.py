"""Model-parallel groups for the Megatron backend over an initialised `torch.distributed`."""

from __future__ import annotations


def initialize(tp: int, pp: int, seed: int) -> None:
    """Megatron's tensor-, pipeline- and data-parallel groups over this process group's ranks
    (world size = tp * pp * dp) and its model-parallel RNG (no CUDA RNG is drawn: dropout is 0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"tensor-parallel size {tp} x pipeline-parallel size {pp} must divide "
                         f"the {world} training ranks")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
