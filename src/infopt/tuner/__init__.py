"""The recipe tuner: measure presets and step variants on this machine, keep the fastest within a quality gate."""

from .candidates import Candidate, default_candidates
from .result import STATUSES, Trial, TuneResult
from .search import WORKLOAD_METRIC, parse_gate, tune

__all__ = ["tune", "TuneResult", "Trial", "Candidate", "default_candidates", "parse_gate", "STATUSES",
           "WORKLOAD_METRIC"]
