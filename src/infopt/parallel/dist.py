"""Process-group and mesh helpers shared by tensor and pipeline parallelism, and per-rank byte counts."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..core.errors import IncompatibleModelError

__all__ = ["require_not_parallel", "require_process_group", "world_size", "rank", "resolve_mesh", "divisors",
           "local_bytes", "is_bnb_module"]


def require_process_group(what: str) -> None:
    """Raise :class:`IncompatibleModelError` unless ``torch.distributed`` has an initialized default process group."""
    if not dist.is_available():
        raise IncompatibleModelError(f"{what} needs torch.distributed, which this torch build does not include")
    if not dist.is_initialized():
        raise IncompatibleModelError(
            f"{what} needs an initialized torch.distributed process group and there is none. Fix: start the script "
            "with `torchrun --nproc-per-node N script.py` and call torch.distributed.init_process_group() "
            "(backend 'gloo' on CPU, 'nccl' on GPU) before optimizing, or run the function through "
            "infopt.parallel.launch(fn, nprocs=N)"
        )


def require_not_parallel(model: nn.Module, what: str) -> None:
    """Raise :class:`IncompatibleModelError` when ``model`` is already split by infopt (sharding twice would
    split the shards)."""
    done = model.__dict__.get("_infopt_parallel")
    if done is not None:
        raise IncompatibleModelError(
            f"{what}: the model is already {done['kind']}-parallel over {done['world']} ranks; call "
            "infopt.undo(model) first to restore the full model"
        )


def world_size() -> int:
    """World size of the default process group (1 when none is initialized)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """Rank in the default process group (0 when none is initialized)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def resolve_mesh(mesh: Any, model: nn.Module, what: str):
    """The 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` to shard over.

    Args:
        mesh: a 1-D DeviceMesh, or None for one over the whole default process group on the model's device type.
        model: the model (its device type picks the mesh's).
        what: the caller's name, for messages.

    Raises:
        IncompatibleModelError: no process group, a mesh that is not 1-D, or a model on a device the backend cannot use.
    """
    require_process_group(what)
    device = next(model.parameters()).device
    backend = dist.get_backend()
    if backend == "nccl" and device.type != "cuda":
        raise IncompatibleModelError(
            f"{what}: the process group uses nccl but the model is on {device}; move it first with "
            "model.to(f'cuda:{LOCAL_RANK}'), or use backend 'gloo' for CPU"
        )
    if mesh is None:
        return init_device_mesh(device.type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise IncompatibleModelError(f"{what}: mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise IncompatibleModelError(
            f"{what}: mesh has {mesh.ndim} dimensions; pass its tensor-parallel dimension, e.g. mesh['tp']"
        )
    if mesh.device_type != device.type:
        raise IncompatibleModelError(f"{what}: mesh is on '{mesh.device_type}' but the model is on {device}")
    return mesh


def divisors(*sizes: int) -> list[int]:
    """World sizes (> 0) dividing every one of ``sizes``: the sizes a tensor-parallel plan can use."""
    top = min(sizes)
    return [n for n in range(1, top + 1) if all(s % n == 0 for s in sizes)]


def local_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers this rank holds: a DTensor counts its local shard, tied tensors count once.

    Example:
        >>> local_bytes(nn.Linear(4, 2))  # 8 weights + 2 biases, fp32
        40
    """
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def is_bnb_module(module: nn.Module) -> bool:
    """True for a bitsandbytes layer (found by class module, so bitsandbytes is never imported here)."""
    return any(c.__module__.split(".")[0] == "bitsandbytes" for c in type(module).__mro__)
