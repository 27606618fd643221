"""``infopt.testing``: golden-file regression tests of optimized models, with a pytest plugin for CI.

The plugin (``infopt.testing.plugin``) is registered as a ``pytest11`` entry point and adds the fixtures
``infopt_device``, ``infopt_golden`` and ``infopt_deterministic`` and the ``--infopt-*`` options; the
assertions below compare a model against the test's golden files. See docs/testing.md.
"""

from __future__ import annotations

from .assertions import TOP_K, assert_generates_same, assert_no_regression, assert_quality, topk_kl
from .golden import (
    EnvironmentMismatchWarning,
    GoldenMissingError,
    GoldenStore,
    environment_record,
    sanitize_test_id,
)

__all__ = [
    "assert_generates_same",
    "assert_quality",
    "assert_no_regression",
    "topk_kl",
    "TOP_K",
    "GoldenStore",
    "GoldenMissingError",
    "EnvironmentMismatchWarning",
    "environment_record",
    "sanitize_test_id",
]
