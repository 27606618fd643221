"""Golden-file assertions for CI: exact greedy tokens, top-k KL / top-1 quality, benchmark ratios."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..eval.tokens import assert_same_tokens, greedy_outputs, prompt_ids
from .golden import UPDATE_HINT, GoldenMissingError, GoldenStore

__all__ = ["assert_generates_same", "assert_quality", "assert_no_regression", "topk_kl", "TOP_K"]

TOP_K = 16
_EPS = 1e-12


def _missing(golden: GoldenStore, section: str) -> GoldenMissingError:
    return GoldenMissingError(f"golden '{section}' for this test is missing ({golden.json_path}); {UPDATE_HINT}")


def assert_generates_same(model: nn.Module, tokenizer, prompts, golden: GoldenStore, max_new_tokens: int = 32, *,
                          reference: nn.Module | None = None) -> None:
    """Assert ``model``'s greedy continuations equal the golden ones, token for token.

    With ``--infopt-update-golden`` (``golden.update``) the continuations of ``reference`` (or of ``model``
    when none is given) are recorded, and ``model`` is then checked against them. A missing golden fails: it
    never passes silently.

    Args:
        model: a transformers causal LM, optimized or not.
        tokenizer: decodes the continuations in the failure message, and encodes string prompts; None with
            token-id prompts.
        prompts: as for :func:`infopt.eval.greedy_outputs` (strings, id lists or id tensors).
        golden: the test's :class:`GoldenStore` (the ``infopt_golden`` fixture).
        max_new_tokens: tokens generated per prompt.
        reference: the model to record from when updating (e.g. the unoptimized model, for a lossless step).

    Returns:
        None when every continuation matches.

    Raises:
        GoldenMissingError: nothing recorded yet (the message says to run with ``--infopt-update-golden``).
        AssertionError: the prompts differ from the recorded ones, or a continuation differs; the message gives
            the prompt, the first diverging generated-token position and both continuations (decoded with a
            tokenizer).

    Example:
        >>> def test_lossless(infopt_golden):  # doctest: +SKIP
        ...     model = tiny_model("llama")
        ...     optimize_(model, recipe)
        ...     assert_generates_same(model, None, [[1, 17, 400]], infopt_golden, max_new_tokens=16)
    """
    ids = prompt_ids(prompts, tokenizer)
    if golden.update:
        recorded = greedy_outputs(reference if reference is not None else model, ids, max_new_tokens)
        tensors = {f"prompt_{i:04d}": p[0] for i, p in enumerate(ids)}
        tensors.update({f"output_{i:04d}": torch.tensor(o, dtype=torch.long) for i, o in enumerate(recorded)})
        golden.write("generate", tensors, {"max_new_tokens": max_new_tokens, "prompts": len(ids)})
        if reference is None:
            return
    elif not golden.has("generate"):
        raise _missing(golden, "generate")
    tensors, meta = golden.read("generate")
    recorded = [tensors[f"prompt_{i:04d}"].tolist() for i in range(meta["prompts"])]
    if recorded != [p[0].tolist() for p in ids] or meta["max_new_tokens"] != max_new_tokens:
        raise AssertionError(f"the prompts or max_new_tokens differ from those recorded in {golden.json_path} "
                             f"({meta['prompts']} prompt(s), max_new_tokens={meta['max_new_tokens']}); {UPDATE_HINT}")
    expected = [tensors[f"output_{i:04d}"].tolist() for i in range(meta["prompts"])]
    actual = greedy_outputs(model, ids, max_new_tokens)
    assert_same_tokens(expected, actual, tokenizer=tokenizer, names=("golden", "model"),
                       prompt_lengths=[int(p.shape[-1]) for p in ids])


def topk_kl(ref_logp: torch.Tensor, ref_idx: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per-position KL(reference || model) on the reference's top-k support plus one "rest" bucket.

    Both distributions are coarsened to ``k + 1`` outcomes: the reference's top-k tokens and everything
    else. With ``p_i`` / ``q_i`` the reference / model probabilities of the top-k tokens and
    ``p_r = 1 - sum p_i``, ``q_r = 1 - sum q_i`` the remaining masses::

        KL_k = sum_i p_i (log p_i - log q_i) + p_r (log p_r - log q_r)

    By the data-processing inequality ``KL_k <= KL`` (coarsening never increases KL), so this is a lower
    bound of the full-vocabulary KL that is tight when the reference's top-k holds nearly all of its mass,
    the usual case for a trained LM (with k=16). Masses are clamped at 1e-12; ``0 log 0 = 0``.

    Args:
        ref_logp: ``[T, k]`` reference log-probabilities of its top-k tokens.
        ref_idx: ``[T, k]`` their token ids.
        logp: ``[T, V]`` the model's full log-probabilities (log-softmax).

    Returns:
        ``[T]`` fp32 KL estimates, nats.

    Example:
        >>> lp = torch.log_softmax(torch.randn(3, 50), -1)
        >>> v, i = lp.topk(16, dim=-1)
        >>> float(topk_kl(v, i, lp).abs().max()) < 1e-5
        True
    """
    ref_logp, logp = ref_logp.double(), logp.double()
    q_logp = logp.gather(-1, ref_idx)  # [T, k]
    p = ref_logp.exp()
    head = (p * (ref_logp - q_logp)).sum(-1)  # [T]
    p_r = (1 - p.sum(-1)).clamp_min(_EPS)
    q_r = (1 - q_logp.exp().sum(-1)).clamp_min(_EPS)
    tail = torch.where(p_r > _EPS, p_r * (p_r.log() - q_r.log()), torch.zeros_like(p_r))
    return (head + tail).float()


@torch.inference_mode()
def _log_probs(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits  # [1, T, V]
    return F.log_softmax(logits[0].float(), dim=-1).cpu()  # [T, V]


def _quality_ids(input_ids, text, tokenizer, max_tokens: int) -> torch.Tensor:
    if (input_ids is None) == (text is None):
        raise ValueError("pass exactly one of input_ids= or text= (with tokenizer=)")
    if text is not None:
        if tokenizer is None:
            raise ValueError("text= needs tokenizer=; or pass input_ids=")
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :max_tokens]
    else:
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.is_floating_point():
        raise ValueError(f"input_ids must be [T] or [1, T] integer token ids, got shape {tuple(ids.shape)}")
    return ids.long().cpu()


def assert_quality(model: nn.Module, golden: GoldenStore, *, input_ids=None, text: str | None = None, tokenizer=None,
                   max_kl: float = 0.05, min_top1: float = 0.9, reference: nn.Module | None = None,
                   k: int = TOP_K, max_tokens: int = 512) -> dict[str, float]:
    """Assert ``model``'s next-token distributions stay close to a recorded reference (for lossy steps).

    The golden stores, per position, the reference's top-``k`` log-probs and token ids (``[T, k]``, small
    rather than full-vocabulary) plus the token ids. The model's log-probs at those ids give a top-k KL
    estimate (:func:`topk_kl`, a lower bound of the full KL) and top-1 agreement (model argmax over the
    whole vocabulary == reference argmax).

    With ``--infopt-update-golden`` the golden is recorded from ``reference`` (or from ``model`` when no
    reference is given: record on the unoptimized model) and then checked as usual.

    Args:
        model: the (optimized) model.
        golden: the test's :class:`GoldenStore`.
        input_ids: ``[T]`` / ``[1, T]`` token ids; or
        text, tokenizer: a text to encode (first ``max_tokens`` tokens).
        max_kl: gate on the mean top-k KL, nats/token.
        min_top1: gate on the top-1 agreement fraction.
        reference: the model to record the golden from when updating.
        k: top-k kept per position when recording.
        max_tokens: cap on the encoded text.

    Returns:
        ``{"kl": mean, "kl_max": max, "kl_max_pos": position, "top1": agreement, "tokens": T}``.

    Raises:
        GoldenMissingError: nothing recorded yet.
        AssertionError: a gate fails (the message gives all figures), or the token ids differ from the golden's.
        ValueError: neither or both of ``input_ids`` / ``text``; bad ids.

    Example:
        >>> def test_int8(infopt_golden):  # doctest: +SKIP
        ...     ref, model = tiny_model("llama"), tiny_model("llama")
        ...     quantize_(model, Int8WeightOnly())
        ...     assert_quality(model, infopt_golden, input_ids=torch.arange(64), reference=ref, max_kl=0.05)
    """
    ids = _quality_ids(input_ids, text, tokenizer, max_tokens)
    if golden.update:
        ref_logp = _log_probs(reference if reference is not None else model, ids)  # [T, V]
        vals, idx = ref_logp.topk(min(k, ref_logp.shape[-1]), dim=-1)  # [T, k] each, sorted descending
        golden.write("quality", {"input_ids": ids[0], "topk_logp": vals.contiguous(), "topk_idx": idx.contiguous()},
                     {"k": int(idx.shape[-1]), "tokens": int(ids.shape[1])})
    elif not golden.has("quality"):
        raise _missing(golden, "quality")
    tensors, _ = golden.read("quality")
    if not torch.equal(tensors["input_ids"], ids[0]):
        raise AssertionError(f"the token ids differ from those recorded in {golden.json_path}; {UPDATE_HINT}")
    logp = _log_probs(model, ids)
    kl = topk_kl(tensors["topk_logp"], tensors["topk_idx"], logp)  # [T]
    top1 = (logp.argmax(-1) == tensors["topk_idx"][:, 0]).float().mean().item()
    figs = {"kl": kl.mean().item(), "kl_max": kl.max().item(), "kl_max_pos": int(kl.argmax()), "top1": top1,
            "tokens": int(ids.shape[1])}
    bad = []
    if not figs["kl"] <= max_kl:  # also catches NaN
        bad.append(f"mean KL {figs['kl']:.4g} > max_kl {max_kl:g}")
    if not figs["top1"] >= min_top1:
        bad.append(f"top-1 agreement {figs['top1']:.4f} < min_top1 {min_top1:g}")
    if bad:
        raise AssertionError(f"quality gate failed: {'; '.join(bad)}\n  mean KL {figs['kl']:.4g} nats/token (top-"
                             f"{tensors['topk_idx'].shape[-1]} estimate), max KL {figs['kl_max']:.4g} at position "
                             f"{figs['kl_max_pos']}, top-1 agreement {figs['top1']:.4f} over {figs['tokens']} tokens")
    return figs


def _load_bench(bench_json) -> tuple[dict[str, float], set[str] | None]:
    # -> (ratios, metrics where higher is better; None = all higher is better)
    if isinstance(bench_json, (str, os.PathLike)):
        bench_json = json.loads(Path(bench_json).read_text(encoding="utf-8"))
    if not isinstance(bench_json, dict):
        raise ValueError(f"bench_json must be a path, an `infopt bench` result dict or a {{name: ratio}} dict, got "
                         f"{type(bench_json).__name__}")
    if "ratios" in bench_json:
        ratios = bench_json["ratios"]
        if ratios is None:
            raise ValueError("the benchmark result has no ratios (it ran the baseline alone); pass a recipe")
        higher = set(bench_json.get("higher_is_better", ratios))
    else:
        ratios, higher = bench_json, None
    out = {k: float(v) for k, v in ratios.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
    return out, higher


def assert_no_regression(bench_json, golden: GoldenStore, tolerance: float = 0.1,
                         metrics: Sequence[str] | None = None) -> None:
    """Assert benchmark ratios (optimized / baseline) did not regress beyond ``tolerance`` against the golden.

    Opt-in: skipped unless pytest runs with ``--infopt-bench`` (timings are noisy; run it on a quiet,
    fixed runner). A ratio where higher is better (tokens/s) fails below ``golden * (1 - tolerance)``;
    one where lower is better (latency, memory) fails above ``golden * (1 + tolerance)``.

    Args:
        bench_json: an ``infopt bench`` result (path or dict, with ``ratios`` and ``higher_is_better``) or a
            plain ``{name: ratio}`` dict (all higher-is-better).
        golden: the test's :class:`GoldenStore`; ratios go in its JSON.
        tolerance: allowed relative regression (0.1 = 10%).
        metrics: the ratio names to check (default: every recorded one).

    Raises:
        GoldenMissingError: nothing recorded yet.
        AssertionError: one or more ratios regressed (all are listed), or a recorded ratio is missing.
        ValueError: a malformed result or tolerance.

    Example:
        >>> def test_speed(infopt_golden):  # doctest: +SKIP
        ...     assert_no_regression("bench/int8.json", infopt_golden, tolerance=0.15)
    """
    import pytest

    if not golden.bench:
        pytest.skip("benchmark regression checks run only with --infopt-bench")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r} must be in [0, 1)")
    ratios, higher = _load_bench(bench_json)
    if metrics is not None:
        ratios = {k: v for k, v in ratios.items() if k in set(metrics)}
    if golden.update:
        golden.write("bench", {}, {"ratios": ratios,
                                   "higher_is_better": sorted(ratios if higher is None else higher & set(ratios))})
        return
    if not golden.has("bench"):
        raise _missing(golden, "bench")
    _, meta = golden.read("bench")
    up = set(meta["higher_is_better"])
    bad = []
    for name in sorted(meta["ratios"] if metrics is None else set(metrics) & set(meta["ratios"])):
        want, now = meta["ratios"][name], ratios.get(name)
        if now is None:
            bad.append(f"{name}: recorded {want:.4g}, missing now")
        elif name in up and now < want * (1 - tolerance):
            bad.append(f"{name}: {now:.4g}x < {want:.4g}x * (1 - {tolerance:g}) (higher is better)")
        elif name not in up and now > want * (1 + tolerance):
            bad.append(f"{name}: {now:.4g}x > {want:.4g}x * (1 + {tolerance:g}) (lower is better)")
    if bad:
        raise AssertionError("benchmark regression:\n  " + "\n  ".join(bad))
