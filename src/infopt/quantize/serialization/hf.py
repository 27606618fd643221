"""infopt's quantization in transformers' quantizer registry: plain ``from_pretrained`` rebuilds infopt's layers.

With ``import infopt``, a folder written by ``save_pretrained`` of an infopt-quantized model loads
with ``AutoModelForCausalLM.from_pretrained(path)``: transformers reads ``quantization_config``
(``quant_method: "infopt"``, see :mod:`infopt.quantize.serialization.serialize`), builds the model on the meta
device, and hands it to :class:`InfoptHfQuantizer`, which

1. checks the folder's files against their SHA-256 in ``infopt_manifest.json`` (:mod:`infopt.core.integrity`) and
   the checkpoint's safetensors headers: every tensor of every quantized layer present, with its shape and dtype
   (:class:`~infopt.core.errors.CheckpointError` naming the file or tensor otherwise);
2. swaps each listed ``nn.Linear`` (or ``Conv1D``) for an empty infopt layer whose ``state_dict``
   has the saved names and shapes, so transformers' loader fills its buffers like any weight; a head
   tied to the embedding but saved as its own quantized copy is untied;
3. after loading, checks that transformers really filled every quantized tensor (it only warns about
   missing keys, then initialises them at random), and rebuilds int4 layers in their kernel's layout.

Importing this module imports ``transformers.quantizers``, which is slow; ``import infopt`` registers
it only once transformers' loader is imported (:func:`infopt.core.import_hooks.after_import`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ...core.errors import CheckpointError, IncompatibleModelError
from ...core.integrity import verify_manifest
from ..formats.int8 import SharedInt8Embedding
from .serialize import (
    FORMAT_VERSION,
    KINDS,
    QUANT_METHOD,
    build_layer,
    check_checkpoint,
    check_spec,
    expected_tensors,
    finish_layer,
)

__all__ = ["InfoptQuantizationConfig", "InfoptHfQuantizer", "register"]


class InfoptQuantizationConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a model saved with infopt layers (see :mod:`infopt.quantize.serialization.serialize`).

    Args:
        modules: ``{fqn: layer spec}``, one entry per quantized layer.
        configs: the quantize step configs applied, as dicts (informative).
        infopt_version: the infopt version that saved the model.
        format: the layout version of ``modules``.

    Raises:
        CheckpointError: a ``format`` newer than this infopt reads, or malformed ``modules``.

    Example:
        >>> InfoptQuantizationConfig(modules={}).to_dict()["quant_method"]
        'infopt'
    """

    def __init__(self, modules: dict[str, dict[str, Any]] | None = None, configs: list[dict[str, Any]] | None = None,
                 infopt_version: str | None = None, format: int = FORMAT_VERSION, **kwargs):
        kwargs.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.format = format
        self.infopt_version = infopt_version
        self.configs = list(configs or [])
        self.modules = dict(modules or {})
        self.extra = kwargs  # fields of a newer infopt, kept so a re-save writes them back
        self.post_init()

    def post_init(self) -> None:
        if not isinstance(self.format, int) or self.format > FORMAT_VERSION:
            raise CheckpointError(
                f"the model was saved by infopt {self.infopt_version} in quantization format {self.format!r}; this "
                f"infopt reads format {FORMAT_VERSION} at most: upgrade infopt (pip install -U infopt)"
            )
        if not isinstance(self.modules, dict) or not all(isinstance(v, dict) for v in self.modules.values()):
            raise CheckpointError("quantization_config.modules must map module names to layer entries")

    def to_dict(self) -> dict[str, Any]:
        return {**self.extra, "quant_method": self.quant_method, "format": self.format,
                "infopt_version": self.infopt_version, "configs": list(self.configs), "modules": dict(self.modules)}


def _safetensors_header(files: list[str] | None) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """``{key: (shape, dtype name)}`` over the checkpoint files, or None when they are not all safetensors."""
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        return None
    header = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                header[key] = (tuple(sl.get_shape()), sl.get_dtype())
    return header


def _resolve(model: nn.Module, names: set[str], fqn: str) -> str | None:
    """The module name ``fqn`` (as saved) has in ``model`` (whose module names are ``names``); without the base-model
    prefix when ``model`` is the base model alone (``AutoModel`` on a causal-LM checkpoint); None for a head the
    base model does not have."""
    if fqn in names:
        return fqn
    prefix = getattr(model, "base_model_prefix", "") + "."
    if fqn.startswith(prefix) and fqn[len(prefix):] in names:
        return fqn[len(prefix):]
    if prefix != "." and not hasattr(model, prefix[:-1]) and not fqn.startswith(prefix):
        return None  # a head (lm_head) of the full model: a base model has no place for it
    raise CheckpointError(f"the quantization_config lists {fqn}, which {type(model).__name__} does not have; was the "
                          "folder saved from another architecture?")


class InfoptHfQuantizer(HfQuantizer):
    """Loads models whose ``quantization_config`` has ``quant_method: "infopt"`` (pre-quantized only: quantize with
    :func:`infopt.optimize` or :func:`infopt.quantize.quantize_`, not through ``from_pretrained``)."""

    requires_calibration = True  # from_pretrained(quantization_config=...) on a float checkpoint is refused

    def __init__(self, quantization_config: InfoptQuantizationConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._built: dict[str, tuple[dict[str, Any], nn.Module]] = {}  # model fqn -> (spec, layer being loaded)
        self._conv1d: set[str] = set()

    def validate_environment(self, *args, device_map=None, **kwargs) -> None:
        for fqn, spec in self.quantization_config.modules.items():
            check_spec(fqn, spec)
        places = {str(v) for v in device_map.values()} if isinstance(device_map, dict) else set()
        if len(places) > 1 or "disk" in places:
            # int4 layers are packed for one device's kernel; offload hooks would move their buffers behind their back
            raise IncompatibleModelError(
                f"infopt's quantized layers need the whole model on one device; device_map spreads it over "
                f"{sorted(places)}. Load with device_map='cpu' or device_map='cuda'"
            )

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        modules = self.quantization_config.modules
        names = {n for n, _ in model.named_modules()}
        resolved = {fqn: name for fqn in modules if (name := _resolve(model, names, fqn)) is not None}
        layers = {}
        for fqn, name in resolved.items():  # all built before any is swapped in or any file is read
            original = model.get_submodule(name)
            layers[fqn] = build_layer(fqn, modules[fqn], original, device=original.weight.device)
            # some models' _init_weights reach a child's weight through its parent (GPT-2 rescales
            # mlp.c_proj.weight when it initialises GPT2MLP): a stand-in marked loaded, which init skips,
            # keeps that from failing; it is dropped once the weights are in
            stand_in = torch.empty_like(original.weight, device="meta")
            stand_in._is_hf_initialized = True
            layers[fqn].weight = stand_in
            if type(original).__name__ == "Conv1D":
                self._conv1d.add(name)
        if checkpoint_files:
            # every file the save listed (config, weights) as it was written: a changed value is refused by name
            verify_manifest(Path(checkpoint_files[0]).parent)
        header = _safetensors_header(checkpoint_files)
        if header is not None:
            check_checkpoint({fqn: modules[fqn] for fqn in resolved}, header)
        # the placeholder each quantized layer's dense key holds (serialize.with_placeholders) is not a tensor of
        # the model: not reported as unexpected
        ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
        ignore = set(ignore or ())
        ignore.update(rf"(^|\.){re.escape(name)}\.weight$" for name in resolved.values())
        model._keys_to_ignore_on_load_unexpected = ignore
        if any(modules[fqn].get("shares_embedding") for fqn in resolved):
            # the embedding reads the int8 head's codes (rebuilt after loading): a folder need not hold its weight
            embed = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
            name = next((n for n, m in model.named_modules() if m is embed), None)
            if name is not None:
                missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
                missing.add(rf"(^|\.){re.escape(name)}\.weight$")
                model._keys_to_ignore_on_load_missing = missing
        tied = getattr(model, "all_tied_weights_keys", None)
        for fqn, name in resolved.items():
            model.set_submodule(name, layers[fqn])
            self._built[name] = (modules[fqn], layers[fqn])
            if tied is not None:
                # the head was saved as its own quantized copy: tying it to the embedding would fail (no .weight)
                tied.pop(f"{name}.weight", None)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        problems = []
        for name, (spec, layer) in self._built.items():
            layer.__dict__.pop("weight", None)  # the init stand-in
            for tname, (shape, want) in expected_tensors(spec).items():
                t = getattr(layer, tname)
                # transformers flags each tensor it loaded; a missing one is allocated and left uninitialised
                loaded = t.device.type != "meta" and getattr(t, "_is_hf_initialized", False)
                if not loaded:
                    problems.append(f"{name}.{tname} was not loaded")
                elif tuple(t.shape) != shape or (want is not None and t.dtype != want):
                    problems.append(f"{name}.{tname} is {t.dtype} {list(t.shape)}, expected {want} {list(shape)}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CheckpointError(f"infopt could not rebuild the quantized layers: {'; '.join(problems[:5])}{more}; the "
                                  "checkpoint does not match its quantization_config. Save the model again")
        for name, (spec, layer) in self._built.items():
            final = finish_layer(spec, layer)
            if final is not layer:
                model.set_submodule(name, final)
            if spec.get("shares_embedding"):
                _share_embedding(model, final)
        self._built.clear()
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    def _dequantize(self, model, dtype=None):
        """Replace every infopt layer with a float ``nn.Linear`` (``Conv1D`` where the model had one) holding its
        dequantized weight, in ``dtype``."""
        for name, mod in list(model.named_modules()):
            if type(mod) not in KINDS.values():
                continue
            w = mod.dequantize()  # [out, in] fp32
            if getattr(mod, "input_scale", None) is not None:  # W8A8: x * input_scale folded into the columns
                w = w * mod.input_scale.float()[None, :]
            bias = mod.bias
            wd = dtype or (bias.dtype if bias is not None else torch.float32)
            if name in self._conv1d:
                from transformers.pytorch_utils import Conv1D

                new = Conv1D(mod.out_features, mod.in_features)
                new.weight.data = w.t().contiguous().to(wd)
            else:
                new = nn.Linear(mod.in_features, mod.out_features, bias=bias is not None, device=w.device, dtype=wd)
                new.weight.data = w.to(wd)
            if bias is not None:
                new.bias.data = bias.detach().to(wd)
            model.set_submodule(name, new.to(w.device))
        return model


def _share_embedding(model: nn.Module, head: nn.Module) -> None:
    """Let the embedding read the int8 head's codes again (it was saved as their float values, so lookups are
    unchanged) and free its float weight."""
    shared = SharedInt8Embedding.for_head(head, model.get_input_embeddings())
    if shared is not None:
        model.set_input_embeddings(shared)


def register() -> None:
    """Register :class:`InfoptQuantizationConfig` and :class:`InfoptHfQuantizer` as ``quant_method: "infopt"``
    (idempotent). Importing this module calls it; ``import infopt`` arranges that import."""
    from transformers.quantizers.auto import (
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )

    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is InfoptHfQuantizer:
        return
    register_quantization_config(QUANT_METHOD)(InfoptQuantizationConfig)
    register_quantizer(QUANT_METHOD)(InfoptHfQuantizer)


register()  # importing this module registers it (transformers' import of its registry, via infopt.quantize, too)
