"""``enable_(model, config)``: make ``model.generate`` (and pipelines) decode speculatively, in place."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..core.errors import IncompatibleModelError, RecipeError
from ..core.introspect import attention_window, inspect_model, text_config
from ..core.patch import STATE_PREFIX, ModelSlot, get_handle, record_custom
from ..core.step import TRANSFORMS, ApplyContext, StepConfig, register_transform
from ..generate import LoopPart, Unsupported, croppable, set_part, static_length, tensors_bytes
from ..models import load_default
from .config import DraftModel, PromptLookup, SelfDraft, check_draft_folder
from .drafters import Drafter, LookupDrafter, ModelDrafter
from .loop import Controller, SpecStats, speculative_decode

__all__ = ["enable_", "stats", "build_self_draft", "load_draft"]

_STATS = ModelSlot("speculative_stats")


def stats(model: nn.Module) -> dict[str, Any]:
    """Speculative-decoding counts of ``model`` since it was enabled: calls, rounds, drafted and accepted tokens,
    ``acceptance_rate``, ``mean_accepted_length``, ``target_forwards_per_token`` (empty for a model without it).

    Example:
        >>> from infopt.models import tiny_model
        >>> stats(tiny_model())
        {}
    """
    s = _STATS.get(model)
    return s.as_dict() if s is not None else {}


def load_draft(draft: Any, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The draft model a :class:`DraftModel` names: the module itself (as it is), or ``"default"`` / a local
    folder loaded in ``dtype`` onto ``device`` (the target's, when :func:`enable_` loads it).

    Raises:
        RecipeError: a folder that does not hold a causal LM.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model(num_layers=1)
        >>> load_draft(m) is m
        True
    """
    if isinstance(draft, nn.Module):
        return draft
    if draft == "default":
        return load_default(dtype=dtype, device=device)[0]
    from transformers import AutoModelForCausalLM

    folder = check_draft_folder(draft)  # a clear error for a name that is no local folder, before transformers
    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    except (OSError, ValueError) as e:
        raise RecipeError(f"DraftModel.draft={draft!r} could not be loaded as a causal LM: {e}") from e


def _owned_bytes(draft: nn.Module, target: nn.Module) -> int:
    """Bytes of the draft's tensors that the target does not share."""
    shared = {t.data_ptr() for t in list(target.parameters()) + list(target.buffers()) if t.numel()}
    seen, total = set(), 0
    for t in list(draft.parameters()) + list(draft.buffers()):
        p = t.data_ptr()
        if t.numel() and p not in shared and p not in seen:
            seen.add(p)
            total += t.numel() * t.element_size()
    return total


def build_self_draft(model: nn.Module, config: SelfDraft) -> tuple[nn.Module, int]:
    """A cheaper copy of ``model`` for :class:`SelfDraft`: the module tree copied with every tensor shared,
    cut to ``num_layers`` and quantized through the registered quantize transform (so this package does not
    import :mod:`infopt.quantize`). Quantizing replaces the copy's linears only; the target is untouched.

    Returns:
        ``(draft, extra_bytes)``: the draft and the bytes of tensors it does not share with the target.

    Raises:
        IncompatibleModelError: no decoder-layer list to truncate.
        RecipeError: the quantize config does not apply to this model.
    """
    # every tensor shared with the target; parameters as new Parameter objects over the same storage, so the
    # quantize transform, which frees the storage of the parameters it replaces (moving them to disk for undo),
    # frees only the draft's handles, never the target's weights
    memo: dict[int, Any] = {id(b): b for b in model.buffers()}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    # instance-level patches and infopt state (decoder, caches, engine) stay with the target: not copied, then dropped
    own = [n for n in model.__dict__ if n in ("generate", "forward", "infopt") or n.startswith(STATE_PREFIX)]
    memo.update({id(model.__dict__[n]): model.__dict__[n] for n in own})
    draft = copy.deepcopy(model, memo)
    for name in own:
        draft.__dict__.pop(name, None)
    if config.num_layers is not None:
        info = inspect_model(draft)
        layers = draft.get_submodule(info.layer_fqns[0].rpartition(".")[0]) if info.layer_fqns else None
        if not isinstance(layers, nn.ModuleList):
            raise IncompatibleModelError(f"SelfDraft(num_layers=...) needs a decoder-layer list; {type(model).__name__} "
                                         "has none it recognises. Use SelfDraft(quantize=...) alone")
        del layers[config.num_layers:]
        tc = text_config(draft.config, decoder=True)
        for attr in ("num_hidden_layers", "n_layer"):
            if hasattr(tc, attr):
                setattr(tc, attr, config.num_layers)
        if getattr(tc, "layer_types", None):
            tc.layer_types = tc.layer_types[:config.num_layers]
    if config.quantize is not None:
        cfg: StepConfig = config.quantize
        fn = TRANSFORMS.get(type(cfg))
        if fn is None:
            raise IncompatibleModelError(f"SelfDraft.quantize={cfg!r} has no registered transform; import infopt.quantize")
        fn(draft, cfg, ApplyContext(info=inspect_model(draft)))
    # the draft's patch records hold the fp32 modules it replaced (shared with the target): drop them, the draft
    # is never undone, only discarded
    handle = get_handle(draft)
    handle.records.clear()
    handle.undo()  # with no records left, this only deletes the spill files
    draft.eval()
    return draft, _owned_bytes(draft, model)


SELF_DRAFT_PRIOR = 0.85
"""The acceptance a self draft starts from: a quantized copy of the target agrees with it on most tokens (0.94-0.99
per token for int4 g32 on the default model, ``infopt bench --workload decode --recipe cpu-lossless``)."""

VERIFY_COST = 0.06
"""Extra cost of one more verified token in a target forward, in decode steps (see ``_self_draft_cost``)."""


def _self_draft_cost(model: nn.Module, config: SelfDraft) -> float:
    """A self draft's one-token forward time relative to the target's.

    Measured with ``benchmarks/studies/speculative_profile.py`` on the default model (fp32, 2-core CPU): see
    docs/speculative.md. Truncation scales the layers' share.
    """
    q = config.quantize.kind if config.quantize is not None else None
    cost = {"int4": 0.35, "int8": 0.5}.get(q, 1.0 if q is None else 0.5)
    if config.num_layers is not None:  # the layers' share shrinks; the head (~15% of a small model's time) stays
        cost *= 0.15 + 0.85 * min(1.0, config.num_layers / inspect_model(model).num_layers)
    return cost


def _drafter(model: nn.Module, config: StepConfig) -> tuple[Drafter, dict[str, Any]]:
    if isinstance(config, PromptLookup):
        return LookupDrafter(config.ngram), {}
    if isinstance(config, DraftModel):
        info = inspect_model(model)
        draft = load_draft(config.draft, device=info.device, dtype=info.dtype)
        where = next(draft.parameters()).device
        if where != info.device:  # the draft reads the target's token and position tensors as they are
            raise IncompatibleModelError(f"the draft model is on {where} but the target on {info.device}; move the "
                                         f"draft there first: DraftModel(draft.to('{info.device}'))")
        tv, dv = text_config(model.config).vocab_size, text_config(draft.config).vocab_size
        if dv < tv:
            raise IncompatibleModelError(f"the draft model's vocabulary ({dv}) is smaller than the target's ({tv}); "
                                         "a draft model must share the target's tokenizer")
        ratio = sum(p.numel() for p in draft.parameters()) / max(1, sum(p.numel() for p in model.parameters()))
        return ModelDrafter(draft, draft_cost=min(1.0, ratio)), {"draft_parameters": sum(p.numel() for p in
                                                                                          draft.parameters())}
    if isinstance(config, SelfDraft):
        draft, extra = build_self_draft(model, config)
        # no confidence stop: a copy of the target agrees with it even where both are unsure
        return ModelDrafter(draft, draft_cost=_self_draft_cost(model, config), confidence=0.0,
                            prior_acceptance=SELF_DRAFT_PRIOR), {
            "draft_extra_bytes": extra}
    raise RecipeError(f"speculative.enable_ takes DraftModel, PromptLookup or SelfDraft; got {type(config).__name__}: "
                      f"{config!r}")


def _round_costs(forward, decoder, drafter: Drafter, batch: int, length: int | None,
                 cap: int) -> tuple[float, list[float] | None]:
    """The draft and verify costs (in target decode steps) a call's controller uses: the compiled forwards'
    warm-up timings of this batch and cache length where they exist, else the drafter's estimate and None."""
    draft_cost = drafter.draft_cost
    one = forward.step_seconds(batch, 1, length) if length is not None else None
    if not one:
        return draft_cost, None
    verify = [1.0]
    for k in range(1, cap + 1):
        t = forward.step_seconds(batch, k + 1, length)
        verify.append(t / one if t else 1.0 + VERIFY_COST * k)
    draft = getattr(drafter, "draft", None)
    if draft is not None:
        t = decoder.forward_for(draft).step_seconds(batch, 1, length)
        draft_cost = t / one if t else draft_cost
    return draft_cost, verify


class SpeculativePart(LoopPart):
    """The speculative loop as a part of the target's decoder: drafts with ``drafter``, verifies through the
    decoder's forward (compiled beside a compile step) on the decoder's cache (static beside ``kvcache.Static``)."""

    def __init__(self, config: StepConfig, drafter: Drafter, stats: SpecStats, key: str, window: int | None = None):
        self.config, self.drafter, self.stats, self.key = config, drafter, stats, key
        self.window = window  # the model's narrowest attention window (tokens), None without one

    def resident(self, seen: set) -> dict[str, int]:
        draft = getattr(self.drafter, "draft", None)
        if not isinstance(draft, nn.Module):
            return {}
        n = tensors_bytes([*draft.parameters(), *draft.buffers()], seen)  # what it shares with the target: once
        return {"speculative draft model": n} if n else {}

    def takes(self, call, decoder) -> bool:
        # penalties, stop strings, scores: the lean loop applies and returns them (one token per step on the
        # target's forward, as plain decoding would), where the verify would have to work per drafted position
        if call.penalties or call.stop_strings or call.outputs:
            return False
        # a batch whose verify widths the compile step's warm-up left out (warmup_batch_sizes: auto warms them for
        # batch 1) decodes token by token on its warmed graph rather than verify eagerly
        return decoder.forward_for().drafts(call.batch)

    def serve(self, call, decoder) -> torch.Tensor:
        cap = self.config.cap
        B, T, N = call.batch, call.prompt_length, call.max_new_tokens
        needed = T + N + (0 if B == 1 else N) + cap + 2
        if B > 1 and self.window is not None and needed > self.window:
            # rows of a batch keep their own accept lengths, the rest of the round's slots left as holes; a sliding
            # window counts cache slots, holes included, so past the window a row would see fewer keys than in
            # generate (batch 1 never has holes: a rollback crops)
            raise Unsupported("a batch on a sliding-window model whose call may run past the window")
        cache = decoder.open_cache(call, needed, rollback=True)
        out = None
        try:
            if cache.layers and not croppable(cache):
                raise Unsupported("a cache that cannot roll back")
            capacity = static_length(cache)
            forward = decoder.forward_for()
            draft_cost, verify_costs = _round_costs(forward, decoder, self.drafter, B, capacity, cap)
            controller = Controller(self.config.fixed_tokens, cap, draft_cost, VERIFY_COST,
                                    self.drafter.prior_acceptance, self.drafter.probe_every,
                                    verify_costs=verify_costs)
            out = speculative_decode(call, cache, forward, self.drafter, controller, self.stats,
                                     capacity=capacity, decoder=decoder)
        finally:
            decoder.close_cache(call, out)
        return out


def enable_(model: nn.Module, config: StepConfig, *, step: str | None = None) -> dict[str, Any]:
    """Make ``model.generate`` decode speculatively with ``config``, in place (:func:`infopt.undo` reverts).

    Greedy calls and sampling calls (temperature, top-k, top-p) run in infopt's speculative loop; anything
    else (beam search, logits processors, repetition penalty, ...) goes to the original ``generate`` (or to
    transformers' loop on the recipe's KV cache) and :func:`infopt.generate.routing_stats` counts it. Verification
    runs on the model's KV cache step when it has one (a static cache rolls back by moving its fill point) and
    through its compiled forward when it has a compile step.

    Args:
        model: a transformers causal LM.
        config: :class:`DraftModel`, :class:`PromptLookup` or :class:`SelfDraft`.
        step: recipe step key for the report (default ``config.key``).

    Returns:
        A dict of build facts (``draft_extra_bytes`` for a self draft, ...); live counts are in :func:`stats`.

    Raises:
        RecipeError: ``config`` is not a speculative config.
        IncompatibleModelError: a draft model with a smaller vocabulary, an unsupported architecture.

    Example:
        >>> import torch
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> _ = enable_(m, PromptLookup(num_tokens=4))
        >>> m.generate(torch.tensor([[1, 2, 3, 1, 2]]), max_new_tokens=4, do_sample=False).shape
        torch.Size([1, 9])
    """
    inspect_model(model)
    drafter, facts = _drafter(model, config)
    spec_stats = SpecStats()
    _STATS[model] = spec_stats
    key = step or config.key
    set_part(model, "speculative", SpeculativePart(config, drafter, spec_stats, key, attention_window(model)),
             step=key)
    record_custom(model, "speculative drafter and stats", lambda: (_STATS.pop(model, None), facts.clear()), step=key)
    return facts


def _static_step(steps) -> StepConfig | None:
    return next((s for s in steps if s.key == "kvcache:static"), None)


def _apply(model: nn.Module, config: StepConfig, ctx: ApplyContext) -> None:
    facts = enable_(model, config)
    live = _STATS[model]

    class _LiveStats(dict):
        """The report's stats dict, reading the live counts each time it is looked at."""

        def _fresh(self):
            dict.update(self, facts)
            dict.update(self, live.as_dict())

        def __getitem__(self, k):
            self._fresh()
            return dict.__getitem__(self, k)

        def __iter__(self):
            self._fresh()
            return dict.__iter__(self)

        def items(self):
            self._fresh()
            return dict.items(self)

        def __repr__(self):
            self._fresh()
            return dict.__repr__(self)

    ctx.stats = _LiveStats()
    ctx.stats._fresh()
    n = config.fixed_tokens
    ctx.notes.append(f"{config.kind}: drafts {'adaptive (0..' + str(config.cap) + ')' if n is None else n} tokens "
                     f"per round, verified in one target forward{' on the static cache' if _static_step(ctx.steps) else ''}")
    if "draft_extra_bytes" in facts:
        ctx.notes.append(f"self draft ({config.quantize.kind if config.quantize else 'fp'} weights"
                         f"{', ' + str(config.num_layers) + ' layers' if config.num_layers else ''}) costs "
                         f"{facts['draft_extra_bytes'] / 2**20:.1f} MiB beyond the target (embedding and unquantized "
                         "tensors shared)")


for _cls in (DraftModel, PromptLookup, SelfDraft):
    register_transform(_cls)(_apply)
