"""The ``parallel`` recipe step: ``{parallel: {tensor: N}}``, ``{pipeline: N}`` or ``{expert: N}`` over the initialized process group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from ..core.errors import IncompatibleModelError
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from .dist import local_bytes, require_not_parallel, require_process_group, world_size
from .expert import DISPATCH, expert_parallel_, plan_expert_parallel
from .pipeline import check_pipeline, pipeline_parallel_
from .tensor import plan_tensor_parallel, tensor_parallel_

__all__ = ["Parallel"]


def _positive_int_or_none(obj, name: str) -> None:
    v = getattr(obj, name)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise bad_field(obj, name, v, "null or a positive integer (the number of ranks)")


@register_step
@dataclass(frozen=True)
class Parallel(StepConfig):
    """Tensor, pipeline or expert parallelism over the ranks of the already-initialized ``torch.distributed`` group.

    Exactly one of ``tensor``, ``pipeline`` and ``expert`` is set, to the world size (``torchrun --nproc-per-node N``).

    Args:
        tensor: ranks for tensor parallelism (:func:`~infopt.parallel.tensor_parallel_`, ``plan="auto"``).
        pipeline: ranks (stages) for pipeline parallelism (:func:`~infopt.parallel.pipeline_parallel_`).
        expert: ranks for expert parallelism of a mixture-of-experts model
            (:func:`~infopt.parallel.expert_parallel_`: each rank keeps a slice of every block's experts).
        vocab_parallel: tensor parallelism only: split embedding and head over the vocabulary (null: when it divides).
        dtensor: tensor parallelism only: shard float linears as DTensors (``parallelize_module``) instead of
            plain local shards; same numbers, slower on CPU.
        micro_batches: pipeline only: chunks a prefill is cut into so the stages overlap.
        dispatch: expert only: ``"all_to_all"`` (tokens sent to their experts' ranks and back) or
            ``"all_reduce"`` (each rank runs its experts over the shared batch, partial outputs summed).

    Raises:
        RecipeError: not exactly one of tensor/pipeline/expert, a size that is not a positive integer, an unknown
            dispatch.

    Example:
        >>> Parallel.from_dict({"parallel": {"tensor": 3}}).tensor
        3
        >>> Parallel(pipeline=2).to_dict()  # doctest: +NORMALIZE_WHITESPACE
        {'parallel': {'tensor': None, 'pipeline': 2, 'expert': None, 'vocab_parallel': None, 'dtensor': False,
                      'micro_batches': 4, 'dispatch': 'all_to_all'}}
    """

    stage: ClassVar[str] = "parallel"
    fidelity: ClassVar[str] = "lossless"  # sums are split over ranks and reordered, not rounded
    tensor: int | None = None
    pipeline: int | None = None
    expert: int | None = None
    vocab_parallel: bool | None = None
    dtensor: bool = False
    micro_batches: int = 4
    dispatch: str = "all_to_all"

    def __post_init__(self):
        _positive_int_or_none(self, "tensor")
        _positive_int_or_none(self, "pipeline")
        _positive_int_or_none(self, "expert")
        sizes = (self.tensor, self.pipeline, self.expert)
        if sum(v is not None for v in sizes) != 1:
            raise bad_field(self, "tensor/pipeline/expert", sizes,
                            "exactly one of them, e.g. {parallel: {tensor: 2}}, {parallel: {pipeline: 2}} or "
                            "{parallel: {expert: 2}} (two kinds together are not supported)")
        if self.vocab_parallel is not None and not isinstance(self.vocab_parallel, bool):
            raise bad_field(self, "vocab_parallel", self.vocab_parallel, "null, true or false")
        if not isinstance(self.dtensor, bool):
            raise bad_field(self, "dtensor", self.dtensor, "true or false")
        if not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool) or self.micro_batches < 1:
            raise bad_field(self, "micro_batches", self.micro_batches, "a positive integer")
        if self.dispatch not in DISPATCH:
            raise bad_field(self, "dispatch", self.dispatch, ", ".join(DISPATCH))

    @property
    def mode(self) -> str:
        """``"tensor"``, ``"pipeline"`` or ``"expert"``: the field that is set."""
        return "tensor" if self.tensor is not None else "pipeline" if self.pipeline is not None else "expert"

    @property
    def size(self) -> int:
        return getattr(self, self.mode)

    def check(self, model: nn.Module, info, steps) -> list[str]:
        mode = self.mode
        require_process_group(f"parallel ({mode})")
        require_not_parallel(model, f"parallel ({mode})")
        world = world_size()
        if self.size != world:
            raise IncompatibleModelError(
                f"parallel {mode}={self.size} must equal the world size of the process group, {world}; "
                f"launch with torchrun --nproc-per-node {self.size}, or write {{parallel: {{{mode}: {world}}}}}"
            )
        if self.tensor is not None:
            for s in steps:  # bitsandbytes / smoothquant are refused by recipe RULES before this runs
                if s.stage == "quantize" and getattr(s, "act_order", False) and getattr(s, "bits", 4) == 4:
                    raise IncompatibleModelError(
                        f"parallel tensor cannot split the inputs of {s.key}(bits=4, act_order=True) layers (they "
                        "permute their input columns); use act_order=False with tensor parallelism"
                    )
            tp = plan_tensor_parallel(model, world, "auto", self.vocab_parallel, info)
            group = next((getattr(s, "group_size", None) for s in steps if s.stage == "quantize"), None)
            if isinstance(group, int) and group > 0:
                _check_row_groups(model, tp, group)
            return []
        if self.expert is not None:
            plan_expert_parallel(model, world)
            return []
        check_pipeline(model, world, info)
        return []


def _check_row_groups(model: nn.Module, tp, group: int) -> None:
    """Raise when a quantize group would straddle two ranks in a row-parallel layer (its input columns are split)."""
    for fqn, style in tp.layers:
        in_f = model.get_submodule(fqn).in_features
        if style == "rowwise" and (in_f // tp.world) % group:
            raise IncompatibleModelError(
                f"parallel tensor={tp.world} splits {fqn}'s {in_f} input features into slices of {in_f // tp.world}, "
                f"which the quantize group_size={group} does not divide; use a group size dividing {in_f // tp.world}"
            )


@register_transform(Parallel)
def _apply(model: nn.Module, config: Parallel, ctx: ApplyContext) -> None:
    before = local_bytes(model)
    if config.tensor is not None:
        tensor_parallel_(model, vocab_parallel=config.vocab_parallel, dtensor=config.dtensor, step=config.key)
        what = f"tensor parallel over {config.tensor} ranks"
    elif config.expert is not None:
        expert_parallel_(model, dispatch=config.dispatch, step=config.key)
        what = f"expert parallel over {config.expert} ranks ({config.dispatch})"
    else:
        pipeline_parallel_(model, config.pipeline, micro_batches=config.micro_batches, step=config.key)
        what = f"pipeline parallel over {config.pipeline} stages"
    after = local_bytes(model)
    info = model._infopt_parallel
    ctx.stats.update(world=info["world"], rank=info["rank"], local_bytes_before=before, local_bytes_after=after)
    ctx.notes.append(f"{what}; this rank (rank {info['rank']}) holds {after / 2**20:.1f} of {before / 2**20:.1f} MiB")
