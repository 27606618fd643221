"""One router for ``model.generate``: a call parsed once, one decode loop over the parts the steps supply.

See docs/architecture.md for the path of one call, file by file.
"""

from .call import BEAM_KWARGS, GenerateCall, Unsupported, nondefault_fields, parse_call, sampling_field
from .forward import (
    Forward,
    croppable,
    full_length_dynamic_cache,
    in_packed_call,
    packed_call,
    rollback,
    static_length,
    takes_logits_to_keep,
)
from .lean import lean_decode, positions_of
from .router import (
    CachePart,
    Decoder,
    LoopPart,
    RoutingStats,
    decoder_for,
    install,
    routing_stats,
    set_part,
    tensors_bytes,
    uncounted,
)
from .sampling import choose_tokens, filter_logits, make_generator

__all__ = [
    "BEAM_KWARGS", "CachePart", "choose_tokens", "filter_logits", "make_generator", "Decoder", "Forward", "GenerateCall", "LoopPart", "RoutingStats", "Unsupported",
    "croppable", "decoder_for", "full_length_dynamic_cache", "in_packed_call", "packed_call", "install", "lean_decode", "nondefault_fields", "parse_call", "positions_of",
    "rollback", "routing_stats", "sampling_field", "set_part", "static_length", "takes_logits_to_keep",
    "tensors_bytes", "uncounted",
]
