"""A byte-level tokenizer built in code, so bench tests need no downloaded or converted model."""

from __future__ import annotations


def byte_tokenizer():
    """A fast tokenizer with one token per byte (ids 3..258) and ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2: it
    encodes any text, fits a tiny model's vocabulary, and saves / reloads with ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
