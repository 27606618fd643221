"""Quality against the original model: strided perplexity, KL divergence, top-1 agreement, exact greedy tokens.

Measured on text every Python has (``pydoc_data.topics``) unless told otherwise; references can be
cached on disk. See docs/eval.md.
"""

from .answers import CHAT_PROMPTS, AnswerAgreement, answer_agreement, chat_ids, reference_answers
from .metrics import (
    Reference,
    check_reference,
    compare,
    default_text,
    encode_text,
    gate_failures,
    logit_metrics,
    reference_logits,
    resolve_text,
)
from .quality import STORE_DTYPES, EvalResult, evaluate, make_reference, reference_for
from .store import load_reference, reference_meta, save_reference
from .tokens import (
    DECODE_PATH_PROMPT,
    DECODE_PATH_TOKENS,
    DecodePathReference,
    assert_same_tokens,
    assert_token_identical,
    decode_path_compare,
    decode_path_logits,
    decode_path_reference,
    first_difference,
    greedy_outputs,
)
from .windows import Window, window_layout

__all__ = [
    "AnswerAgreement",
    "CHAT_PROMPTS",
    "DECODE_PATH_PROMPT",
    "DECODE_PATH_TOKENS",
    "DecodePathReference",
    "EvalResult",
    "Reference",
    "STORE_DTYPES",
    "Window",
    "answer_agreement",
    "assert_same_tokens",
    "assert_token_identical",
    "chat_ids",
    "check_reference",
    "compare",
    "decode_path_compare",
    "decode_path_logits",
    "decode_path_reference",
    "default_text",
    "encode_text",
    "evaluate",
    "first_difference",
    "gate_failures",
    "greedy_outputs",
    "load_reference",
    "logit_metrics",
    "make_reference",
    "reference_answers",
    "reference_for",
    "reference_logits",
    "reference_meta",
    "resolve_text",
    "save_reference",
    "window_layout",
]
