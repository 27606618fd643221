"""Tensor, pipeline and expert parallelism on ``torch.distributed`` (recipe stage ``parallel``): gloo on CPU, nccl on GPU."""

from .dist import local_bytes
from .expert import DISPATCH, EPPlan, ExpertParallel, expert_parallel_, plan_expert_parallel
from .launch import launch
from .layers import GatherOutput, RowParallel, VocabParallelEmbedding
from .pipeline import check_pipeline, pipeline_parallel_, stage_bounds
from .step import Parallel
from .tensor import AUTO_PLAN, TP_FAMILIES, TPPlan, plan_tensor_parallel, tensor_parallel_

__all__ = [
    "Parallel",
    "tensor_parallel_",
    "pipeline_parallel_",
    "expert_parallel_",
    "launch",
    "plan_tensor_parallel",
    "check_pipeline",
    "plan_expert_parallel",
    "stage_bounds",
    "local_bytes",
    "TPPlan",
    "EPPlan",
    "ExpertParallel",
    "DISPATCH",
    "AUTO_PLAN",
    "TP_FAMILIES",
    "RowParallel",
    "GatherOutput",
    "VocabParallelEmbedding",
]
