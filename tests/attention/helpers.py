"""Test helpers for comparing greedy decodes whose kernels round differently."""

from __future__ import annotations

import torch


def assert_greedy_close(ref_model, prompt, tokens: list[int], max_new_tokens: int, *, ulps: float = 2.0) -> int:
    """Assert ``tokens`` are ``ref_model``'s greedy continuation of ``prompt``, parting from it only at a near-tie.

    Why a tolerance: two attention kernels that sum in a different order round a bf16 logit differently by a unit
    or two in the last place, and a tiny random model's top two logits are often that close (49,152 logits of std
    about 0.16 leave an average top gap near 0.03, some eight bf16 units at the top logit's magnitude), so exact
    identity over many bf16 tokens is luck. The rule: the tokens equal the reference's up to the first position
    where they differ; there, the reference's logit for its own token exceeds its logit for ours by at most
    ``ulps`` x the dtype's epsilon x the top logit's magnitude (with fp32 that is exact identity in practice). Later
    tokens continue a different prefix and are not compared.

    Args:
        ref_model: the plain model (same weights, dtype and device). prompt: token ids, a list or ``[1, T]``.
        tokens: the continuation under test. max_new_tokens: what both were asked for.

    Returns:
        How many leading tokens are identical (``len(tokens)`` when all are).
    """
    ids = torch.as_tensor(prompt, device=ref_model.device).reshape(1, -1)
    out = ref_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want = out.sequences[0, ids.shape[1]:].tolist()
    eps = torch.finfo(ref_model.dtype).eps
    for i, (mine, theirs) in enumerate(zip(tokens, want, strict=False)):
        if mine == theirs:
            continue
        logits = out.logits[i][0].float()
        gap = float(logits[theirs] - logits[mine])
        tol = ulps * eps * float(logits.abs().max())
        assert gap <= tol, (f"token {i} differs ({mine} vs the reference's {theirs}) with a reference logit gap of "
                            f"{gap:.4g} > {tol:.4g} ({ulps} x {ref_model.dtype} eps x top |logit|): not a near-tie")
        return i
    assert len(tokens) == len(want), f"{len(tokens)} tokens where the reference has {len(want)}, with no divergence"
    return len(tokens)
