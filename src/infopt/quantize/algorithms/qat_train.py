"""The fine-tune behind :class:`~infopt.quantize.algorithms.qat.QAT`: the float model's top-k distribution (the teacher), the
distillation loss against it, and the AdamW loop with warm-up and cosine decay over the prepared
:class:`~infopt.quantize.algorithms.qat.QATLinear` layers. ``config`` below is a ``QAT`` (not imported: ``qat`` imports this
module)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm  # widget bars in a notebook, text bars elsewhere

__all__ = ["DISTILL_TOP_K", "teacher_topk", "distill_loss", "finetune", "param_groups"]

DISTILL_TOP_K = 64
"""Tokens of the float model's distribution kept per position for the ``distill`` loss (the rest is one bucket)."""


@torch.no_grad()
def teacher_topk(model: nn.Module, ids: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float model's top-k next-token log-probabilities: ``(indices int32 [n, S, k], log-probs fp32 [n, S, k])``."""
    idx, logp = [], []
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # the reference distribution, without dropout
    try:
        for b0 in tqdm(range(0, ids.shape[0], batch_size), desc="QAT teacher", unit="batch"):
            logits = model(input_ids=ids[b0:b0 + batch_size], use_cache=False).logits  # [b, S, V]
            lp = logits.float().log_softmax(-1)
            v, i = lp.topk(min(DISTILL_TOP_K, lp.shape[-1]), dim=-1)
            idx.append(i.to(torch.int32))
            logp.append(v)
    finally:
        for m, t in modes:
            m.training = t
    return torch.cat(idx), torch.cat(logp)


def distill_loss(logits: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens plus one bucket for all the others, nats per token.

    logits: [b, S, V] student; top_idx, top_logp: [b, S, k] teacher. Coarsening both distributions to
    k + 1 outcomes gives a KL that is >= 0 and at most the full one.

    Example:
        >>> logits = torch.tensor([[[2.0, 1.0, 0.0]]])
        >>> teacher = logits.log_softmax(-1)[..., :2]  # the same distribution's top two
        >>> float(distill_loss(logits, torch.tensor([[[0, 1]]]), teacher))
        0.0
    """
    logq = logits.float().log_softmax(-1)
    logq_k = logq.gather(-1, top_idx.long())  # [b, S, k]
    p_k = top_logp.exp()
    kl_top = (p_k * (top_logp - logq_k)).sum(-1)  # [b, S]
    p_rest = (1 - p_k.sum(-1)).clamp_min(0)
    q_rest = (1 - logq_k.exp().sum(-1)).clamp_min(1e-12)
    kl_rest = torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
    return (kl_top + kl_rest).mean()


def _lr_factor(steps: int) -> Callable[[int], float]:
    warm = max(1, steps // 10)

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        t = (i - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


def finetune(model: nn.Module, layers: dict[str, nn.Module], ids: torch.Tensor, teacher, config) -> list[float]:
    """Run ``config.steps`` AdamW steps on the prepared model; the loss of each step."""
    groups = param_groups(layers.values(), config)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(config.steps))
    gen = torch.Generator().manual_seed(config.seed)
    n = ids.shape[0]
    bs = min(config.batch_size, n)
    order: list[int] = []
    log: list[float] = []
    device = ids.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
        torch.manual_seed(config.seed)  # dropout, where the model has any
        bar = tqdm(range(config.steps), desc=f"QAT int{config.bits}", unit="step")
        for _ in bar:
            if len(order) < bs:
                order += torch.randperm(n, generator=gen).tolist()
            pick, order = order[:bs], order[bs:]
            batch = ids[pick]  # [b, S]
            logits = model(input_ids=batch, use_cache=False).logits  # [b, S, V]
            if teacher is None:
                loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            else:
                rows = torch.tensor(pick, device=teacher[0].device)
                loss = distill_loss(logits, teacher[0][rows], teacher[1][rows])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            opt.step()
            sched.step()
            log.append(float(loss.detach()))
            bar.set_postfix(loss=f"{log[-1]:.4g}")
    return log


def param_groups(layers, config) -> list[dict[str, Any]]:
    weights = [p for layer in layers for name, p in layer.named_parameters() if name != "log_scale"]
    scales = [layer.log_scale for layer in layers if layer.log_scale is not None]
    return [{"params": weights, "lr": config.lr}] + ([{"params": scales, "lr": config.scale_lr}] if scales else [])
