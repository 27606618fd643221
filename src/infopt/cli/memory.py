"""``infopt memory``: print (and optionally save as JSON) the memory estimate of a model, from its config alone."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..memory.arch import KNOWN_CONFIGS
from ..memory.estimate import DTYPE_BITS, MemoryEstimate, estimate_memory

__all__ = ["register", "format_estimate", "run"]

_GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f}"


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def format_estimate(est: MemoryEstimate) -> str:
    """The human-readable table ``infopt memory`` prints.

    Args:
        est: an estimate from :func:`~infopt.memory.estimate_memory`.

    Returns:
        A multi-line string: sizes in GiB (2**30 bytes), then per GPU whether it fits and the max batch.

    Example:
        >>> from infopt.memory import estimate_memory
        >>> print(format_estimate(estimate_memory("llama-3-8b")).splitlines()[0])
        infopt memory: llama-3-8b (llama) 8.03B params, 32 layers, 32 heads / 8 KV heads x 128
    """
    s = est.spec
    lines = [
        f"infopt memory: {est.name} ({est.model_type}) {_count(est.num_params)} params, {s.num_layers} layers, "
        f"{s.num_heads} heads / {s.num_kv_heads} KV heads x {s.head_dim}"
        + (f"; MoE: {s.num_experts} experts, {s.experts_per_token} per token, {_count(est.active_params)} params "
           "active per token (all resident)" if s.num_experts > 1 else ""),
        f"weights {est.weight_dtype}, KV cache {est.kv_dtype}, activations {est.float_dtype}; "
        f"batch {est.batch}, seq_len {est.seq_len}, tp {est.tp}",
        "",
        f"{'':<16}{'GiB':>10}{'GiB/device':>12}",
    ]
    pd = est.per_device
    lines.append(f"{'weights':<16}{_gib(est.weights_bytes):>10}{_gib(pd['weights']):>12}")
    for part, n in est.weights_breakdown.items():
        if n:
            lines.append(f"{'  ' + part:<16}{_gib(n):>10}")
    lines += [
        f"{'KV cache':<16}{_gib(est.kv_cache_bytes):>10}{_gib(pd['kv_cache']):>12}",
        f"{'activations':<16}{_gib(est.activations_bytes):>10}{_gib(pd['activations']):>12}",
        f"{'total':<16}{_gib(est.total_bytes):>10}{_gib(pd['total']):>12}",
        "",
        f"{'GPU':<16}{'usable GiB':>11}{'fits':>6}  max batch at seq_len {est.seq_len}"
        + (f" (x{est.tp} GPUs)" if est.tp > 1 else ""),
    ]
    for f in est.fits.values():
        lines.append(f"{f.gpu:<16}{_gib(f.usable_bytes):>11}{'yes' if f.fits else 'no':>6}  {f.max_batch}")
    lines.append(f"(usable = {est.usable_fraction:.0%} of capacity; the rest is left for the CUDA context, "
                 "allocator and temporaries)")
    if est.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in est.notes]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``infopt memory`` with parsed arguments: print the table, write JSON when ``--json`` is given.

    Args:
        args: the namespace :func:`register`'s parser produces.

    Returns:
        0 (errors raise :class:`~infopt.memory.MemoryInputError`, which the ``infopt`` CLI prints with exit 2).

    Raises:
        MemoryInputError: an invalid model or option value.

    Example:
        >>> from infopt.cli import main
        >>> main(["memory", "--model", "llama-3-8b"])  # doctest: +SKIP
        0
    """
    est = estimate_memory(
        args.model,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        batch=args.batch,
        seq_len=args.seq_len,
        tp=args.tp,
        prefill_chunk=args.prefill_chunk,
        usable_fraction=args.usable_fraction,
    )
    text = json.dumps(est.to_dict(), indent=2) + "\n" if args.json else None
    if args.json == "-":
        sys.stdout.write(text)
        return 0
    print(format_estimate(est))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"\nwrote {out}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``memory`` subcommand to the ``infopt`` CLI (found by :mod:`infopt.cli`'s plugin list).

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The new subparser (its ``fn`` default is :func:`run`).

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); sub = p.add_subparsers(dest="command")
        >>> _ = register(sub)
        >>> p.parse_args(["memory", "--model", "mistral-7b", "--tp", "2"]).tp
        2
    """
    dtypes = ("auto",) + tuple(DTYPE_BITS)
    m = subparsers.add_parser(
        "memory",
        help="estimate weights/KV cache/activation memory and which GPUs a model fits (no weights loaded)",
        description="Estimate inference memory from a model's config: weights, KV cache, activations, total, "
                    "and per GPU whether it fits and the largest batch at --seq-len.",
    )
    m.add_argument("--model", default="default",
                   help=f"'default' (embedded SmolLM2-135M), a known name ({', '.join(KNOWN_CONFIGS)}), "
                        "a model folder or a config.json")
    m.add_argument("--weight-dtype", default="auto", choices=dtypes,
                   help="weight storage; auto: the config's dtype (default: auto)")
    m.add_argument("--kv-dtype", default="auto", choices=dtypes, help="KV cache dtype; auto: activation dtype")
    m.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    m.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence, prompt + output (default: 2048)")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    m.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per forward during prefill (default: whole sequence)")
    m.add_argument("--usable-fraction", type=float, default=0.9,
                   help="share of each GPU's memory to plan for (default: 0.9)")
    m.add_argument("--json", metavar="OUT", help="also write the estimate as JSON to OUT ('-': JSON only, to stdout)")
    m.set_defaults(fn=run)
    return m
