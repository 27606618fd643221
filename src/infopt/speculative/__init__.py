"""Speculative decoding (recipe stage ``speculative``): a draft model, prompt lookup, or a quantized self-draft
proposes tokens that one target forward verifies; greedy output stays token-identical, sampling keeps the
target's distribution."""

from .api import build_self_draft, enable_, load_draft, stats
from .config import DraftModel, PromptLookup, SelfDraft
from .drafters import Drafter, LookupDrafter, ModelDrafter, rollback
from .loop import Controller, SpecStats, speculative_decode
from .sampling import Warp, verify_greedy, verify_sample

__all__ = ["enable_", "stats", "build_self_draft", "load_draft", "DraftModel", "PromptLookup", "SelfDraft",
           "Drafter", "LookupDrafter", "ModelDrafter", "rollback", "Controller", "SpecStats", "speculative_decode",
           "Warp", "verify_greedy", "verify_sample"]
