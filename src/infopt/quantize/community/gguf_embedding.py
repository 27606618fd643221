"""A GGUF file's quantized token embedding kept in its blocks: a lookup decodes the rows it reads.

llama.cpp's quantizer writes an untied token embedding in the file's main type (Q4_0 in a Q4_0 file, Q4_K in a
Q4_K_M one): a Llama 3.1 8B file holds 128,256 x 4,096 of them in 0.3 GB, which decoded dense in fp32 are 2.1 GB the
process would hold to read a few rows a token. :class:`BlockEmbedding` keeps the file's bytes (a copy-on-write mapping
of them where the loader maps, see :func:`infopt.quantize.community.gguf_ckpt._mapped`) and decodes a lookup's rows
with :func:`~infopt.quantize.community.gguf_blocks.dequantize_blocks`, the function the dense path decodes the whole
matrix with: every row is bit for bit the dense one.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats.int8 import shareable_embedding
from ..formats.primitives import KeepsFormat
from .gguf_blocks import BLOCKS, dequantize_blocks

__all__ = ["BlockEmbedding"]


class BlockEmbedding(KeepsFormat):
    """An input embedding over GGUF blocks (``kind``: Q4_0, Q4_1, Q4_K, Q8_0 or Q6_K): ``blocks`` is uint8
    ``[num_embeddings, bytes per row]``, and a lookup is the looked-up rows decoded in ``out_dtype``, times the
    embedding's own ``embed_scale`` where it has one (Gemma's scaled embeddings), as the module it stands in for.

    Its ``state_dict`` holds the decoded float matrix as ``weight`` (the layout of a plain embedding), so
    ``save_pretrained`` writes a folder any loader reads (the embedding dense); it cannot take a float weight back
    (a state dict loaded into it must hold the very matrix its blocks decode to).

    Example:
        >>> import numpy as np
        >>> row = np.concatenate([np.array([0.5], np.float16).view(np.uint8), np.arange(32, dtype=np.int8).view(np.uint8)])
        >>> emb = BlockEmbedding(torch.from_numpy(np.stack([row, row])), "Q8_0", nn.Embedding(2, 32))
        >>> emb(torch.tensor([[1]]))[0, 0, :4].tolist(), emb.blocks.shape
        ([0.0, 0.5, 1.0, 1.5], torch.Size([2, 34]))
    """

    saves_float_weight = True  # serialization: no quantized spec; the state dict's "weight" is a float embedding's

    def __init__(self, blocks: torch.Tensor, kind: str, embedding: nn.Embedding):
        super().__init__()
        per, size = BLOCKS[kind]
        rows, dim = embedding.num_embeddings, embedding.embedding_dim
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (rows, dim // per * size) or dim % per:
            raise ValueError(f"BlockEmbedding: {kind} blocks of a {rows} x {dim} embedding are uint8 "
                             f"[{rows}, {dim // per * size}]; got {blocks.dtype} {list(blocks.shape)}")
        self.register_buffer("blocks", blocks)
        self.kind = kind
        self.num_embeddings, self.embedding_dim = rows, dim
        self.padding_idx = embedding.padding_idx
        self.out_dtype = embedding.weight.dtype
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = float(scale) if scale is not None else None

    @classmethod
    def for_embedding(cls, blocks: torch.Tensor, kind: str, embedding: nn.Module) -> BlockEmbedding | None:
        """The module standing in for ``embedding`` over ``blocks``, or None where its lookups would differ (an
        embedding with ``max_norm``, a scaled one whose scale is no scalar, a ``kind`` with no decoder)."""
        if kind not in BLOCKS or not shareable_embedding(embedding):
            return None
        return cls(blocks, kind, embedding)

    def dense(self) -> torch.Tensor:
        """The whole matrix decoded, ``[num_embeddings, embedding_dim]`` in ``out_dtype``."""
        return dequantize_blocks(self.blocks, self.kind, self.out_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_blocks(self.blocks.index_select(0, input_ids.reshape(-1)), self.kind, self.out_dtype)
        out = rows.view(*input_ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            out = out * torch.tensor(self.embed_scale, dtype=self.out_dtype)
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dense()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        if tuple(value.shape) != (self.num_embeddings, self.embedding_dim) or \
                not torch.equal(value.to(self.out_dtype), self.dense()):
            error_msgs.append(f"{key}: a {self.kind} block embedding keeps the file's rows and cannot take other "
                              "values; load this state dict into the model with a plain nn.Embedding "
                              "(load_quantized(..., activations='float') builds one)")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} blocks, rows decoded per lookup"
