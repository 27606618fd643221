"""Benchmarks: the same workload through plain transformers and through a recipe, in one run."""

from .harness import machine_info, measure_bandwidth, run_bench, run_requests, summarize, weight_bytes_per_token
from .report import append_csv, compare_runs, format_table, plot
from .workloads import WORKLOADS, Request, make_workload

__all__ = [
    "WORKLOADS",
    "Request",
    "make_workload",
    "run_bench",
    "run_requests",
    "summarize",
    "measure_bandwidth",
    "machine_info",
    "weight_bytes_per_token",
    "format_table",
    "compare_runs",
    "plot",
    "append_csv",
]
