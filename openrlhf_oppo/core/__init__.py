"""OPPO's scheduling core: pure Python (stdlib only), driven by events, returning plans.

The same code is driven by the tests, the simulator and the OpenRLHF adapter on Ray.
"""

from openrlhf_oppo.core import ledger
from openrlhf_oppo.core.controllers import ChunkSizeController, DeltaController
from openrlhf_oppo.core.scheduler import OverlapScheduler
from openrlhf_oppo.core.types import (
    AdmitGroup,
    ChunkReady,
    StepPlan,
    StepReport,
    StepStats,
    TrainBatch,
    TrainGroup,
    TrainSample,
)

__all__ = [
    "AdmitGroup",
    "ChunkReady",
    "ChunkSizeController",
    "DeltaController",
    "OverlapScheduler",
    "StepPlan",
    "StepReport",
    "StepStats",
    "TrainBatch",
    "TrainGroup",
    "TrainSample",
    "ledger",
]
