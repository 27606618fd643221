"""Batching (recipe stage ``batching``): a continuous-batching engine on the paged KV cache, and a timeout batcher."""

from .core import CoreEvent, EngineCore
from .dynamic import DynamicBatcher, StaticBatcher, pad_collate, trim_split
from .engine import DEFAULT_KV_BUDGET, Engine, RequestHandle
from .params import FINISH_REASONS, RequestMetrics, RequestOutput, SamplingParams
from .scheduler import Scheduler
from .step import Batching, batching_engine, enable_

__all__ = ["Batching", "enable_", "batching_engine", "Engine", "EngineCore", "CoreEvent", "RequestHandle", "SamplingParams", "RequestOutput", "RequestMetrics", "Scheduler",
           "FINISH_REASONS", "DEFAULT_KV_BUDGET", "DynamicBatcher", "StaticBatcher", "pad_collate", "trim_split"]
