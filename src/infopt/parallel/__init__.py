"""Tensor and pipeline parallelism on ``torch.distributed`` (recipe stage ``parallel``): gloo on CPU, nccl on GPU."""

from .dist import local_bytes
from .launch import launch
from .layers import GatherOutput, RowParallel, VocabParallelEmbedding
from .pipeline import check_pipeline, pipeline_parallel_, stage_bounds
from .step import Parallel
from .tensor import AUTO_PLAN, TP_FAMILIES, TPPlan, plan_tensor_parallel, tensor_parallel_

__all__ = [
    "Parallel",
    "tensor_parallel_",
    "pipeline_parallel_",
    "launch",
    "plan_tensor_parallel",
    "check_pipeline",
    "stage_bounds",
    "local_bytes",
    "TPPlan",
    "AUTO_PLAN",
    "TP_FAMILIES",
    "RowParallel",
    "GatherOutput",
    "VocabParallelEmbedding",
]
