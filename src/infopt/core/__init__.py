"""Ground floor of infopt: errors, recorded patches, model introspection, backend availability."""

from .availability import is_available, lazy_import, require
from .errors import IncompatibleModelError, InfoptError, MissingBackendError, QualityGateError, RecipeError
from .introspect import ModelInfo, inspect_model, param_bytes
from .moe import MoEBlock, is_moe, moe_blocks
from .patch import PatchHandle, get_handle, has_patches, undo

__all__ = [
    "InfoptError",
    "RecipeError",
    "IncompatibleModelError",
    "MissingBackendError",
    "QualityGateError",
    "is_available",
    "lazy_import",
    "require",
    "ModelInfo",
    "inspect_model",
    "param_bytes",
    "MoEBlock",
    "moe_blocks",
    "is_moe",
    "PatchHandle",
    "get_handle",
    "has_patches",
    "undo",
]
