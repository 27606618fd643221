"""Save an optimized model with its recipe, and load it back optimized (quantized weights included).

Loading runs no code from the folder: weights come from safetensors, settings from JSON and YAML, and the compiled
decode steps a folder may carry (``infopt_compiled/``: pickled graphs and shared libraries) are used only with
``infopt.load(path, trust_compiled=True)``; otherwise the steps are rebuilt here, from this machine's own caches
where they hold them. Every file a save writes is listed with its SHA-256 in ``infopt_manifest.json``
(:mod:`infopt.core.integrity`) and checked on load. See ``SECURITY.md``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_model
from torch import nn

from ._version import __version__
from .compile.saved import COMPILED_DIR, load_steps, save_steps, skipping_warmup, steps_fit
from .compile.step import Compile, warmup
from .core.errors import CheckpointError
from .core.integrity import MANIFEST_FILE, verify_async, verify_manifest, write_manifest
from .core.save_hook import install_save_hook, register_save_writer
from .optimize import optimize
from .quantize.formats.int8 import saving_compact
from .quantize.serialization.serialize import restore_saved_names
from .recipe import Recipe

__all__ = ["save_optimized", "load_optimized", "load", "install_save_hook", "write_manifest", "RECIPE_FILE",
           "WEIGHTS_FILE", "META_FILE", "README_FILE"]

log = logging.getLogger("infopt")

RECIPE_FILE = "infopt_recipe.yaml"
WEIGHTS_FILE = "infopt_model.safetensors"
META_FILE = "infopt_meta.json"
README_FILE = "README.md"
_README_MARK = "<!-- written by infopt: rewritten at each save; delete this line to keep your own text -->"


def save_optimized(model: nn.Module, directory: str | Path, tokenizer=None, *, compiled: bool = True) -> Path:
    """Write an optimized model so :func:`load_optimized` restores it exactly.

    The folder holds the HF ``config.json`` (and ``generation_config.json``), the tokenizer if
    given, the recipe as ``infopt_recipe.yaml``, and the model's state dict *as optimized*
    (int8 weights stay int8) in ``infopt_model.safetensors``. With a ``compile`` step on CPU and
    ``compiled=True``, each decode shape the model has compiled is also compiled ahead of time into
    ``infopt_compiled/`` (about a minute per shape for the default model), which :func:`load_optimized`
    loads instead of compiling (:mod:`infopt.compile.saved`).

    Raises:
        ValueError: the model was not optimized with :func:`infopt.optimize`.
    """
    report = model.__dict__.get("infopt")
    if report is None:
        raise ValueError("save_optimized needs a model optimized with infopt.optimize(); use save_pretrained otherwise")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    _write_recipe(model, out)
    with saving_compact():  # tensors rebuilt from others at load (a shared embedding) are not written
        save_model(model, str(out / WEIGHTS_FILE))
    _normal_mode(out / WEIGHTS_FILE)
    if compiled:
        if save_steps(model, out):
            _normal_mode(*(out / COMPILED_DIR).iterdir())
    _write_readme(model, out, how="infopt.save_optimized")
    _seal(out, [p for p in out.rglob("*") if p.is_file() and p.name not in (README_FILE, MANIFEST_FILE)])
    return out


def _seal(folder: Path, files: list[Path]) -> None:
    _normal_mode(write_manifest(folder, files))
    size = sum(f.stat().st_size for f in files)
    log.info("infopt: saved %s: %d files, %.1f MB (%s)", folder, len(files), size / 1e6,
             ", ".join(f"{f.name} {f.stat().st_size / 1e6:.1f} MB" for f in sorted(files, key=lambda f: -f.stat().st_size)[:3]))


def _write_readme(model: nn.Module, out: Path, *, how: str) -> None:
    """A README saying what the folder is and how to load it, unless the folder has a README of the user's own."""
    path = out / README_FILE
    if path.is_file() and not path.read_text(errors="replace").startswith(_README_MARK):
        return
    report = model.__dict__.get("infopt")
    recipe = Recipe(report.applied_steps()).to_yaml() if report is not None else ""
    quantized = "quantization_config" in json.loads((out / "config.json").read_text()) if (
        out / "config.json").is_file() else False
    lines = [_README_MARK, "# A model optimized with infopt", "",
             f"Written by `{how}` (infopt {__version__}). Load it with:", "", "```python", "import infopt", "",
             'model, tokenizer = infopt.load("path/to/this/folder")  # the model as it was optimized', "```", ""]
    if quantized:
        lines += ["Its layers are quantized: `import infopt` before `AutoModelForCausalLM.from_pretrained(folder)` "
                  "rebuilds them. A loader that does not know infopt refuses the folder (each quantized layer's "
                  "`weight` holds a placeholder that no float layer fits), rather than loading random weights.", ""]
    lines += ["`infopt_manifest.json` lists every file infopt wrote here with its SHA-256; loading refuses a "
              "changed file.", ""]
    if (out / "infopt_compiled").is_dir():
        lines += ["`infopt_compiled/` holds compiled decode steps (pickled graphs, shared libraries): machine code. "
                  "They run only with `infopt.load(folder, trust_compiled=True)`; without it the steps are rebuilt on "
                  "the loading machine. Pass it only for a folder you or someone you trust made.", ""]
    if recipe:
        lines += ["The recipe applied:", "", "```yaml", recipe.rstrip(), "```", ""]
    path.write_text("\n".join(lines))
    _normal_mode(path)


def _umask() -> int:
    """The process umask: from /proc on Linux, else by setting it and putting it back (the portable way, which
    another thread creating a file in between would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _normal_mode(*paths: Path) -> None:
    """Give files the mode a plain ``open(path, "w")`` would: safetensors writes through a temporary file,
    created 0600, and renames it, so a saved model would be unreadable to the group and others (a shared cache,
    a serving user) where every other file of the folder is not."""
    mode = 0o666 & ~_umask()
    for p in paths:
        if p.is_file() and stat.S_IMODE(p.stat().st_mode) != mode:
            p.chmod(mode)


def _write_recipe(model: nn.Module, out: Path) -> None:
    report = model.__dict__["infopt"]
    (out / RECIPE_FILE).write_text(Recipe(report.applied_steps()).to_yaml())
    (out / META_FILE).write_text(json.dumps({"dtype": str(next(model.parameters()).dtype)}))


def _finish_pretrained_save(model: nn.Module, out: Path, written: list[Path]) -> None:
    """After a hooked ``save_pretrained`` (:func:`install_save_hook`): the weights readable as any file is, then
    the recipe, a README and the manifest beside transformers' files."""
    _normal_mode(*written)
    if model.__dict__.get("infopt") is not None:
        _write_recipe(model, out)
    if out.is_dir() and (out / "config.json").is_file():  # (not on a rank that does not write)
        _write_readme(model, out, how="save_pretrained")
        _seal(out, _pretrained_files(out))


register_save_writer(_finish_pretrained_save)


def _pretrained_files(d: Path) -> list[Path]:
    """The files a ``save_pretrained`` of an optimized model writes and :func:`load` (or ``from_pretrained``)
    reads: config, generation config, recipe, weights (one file or the shards of an index)."""
    files = [d / n for n in ("config.json", "generation_config.json", RECIPE_FILE, META_FILE)]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files += [index] + [d / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files.append(d / "model.safetensors")
    return [f for f in files if f.is_file()]


def _state_files(d: Path) -> list[Path]:
    if (d / WEIGHTS_FILE).is_file():
        return [d / WEIGHTS_FILE]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / s for s in shards]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    raise FileNotFoundError(f"{d} has no {WEIGHTS_FILE}, model.safetensors or model.safetensors.index.json")


def load_optimized(directory: str | Path, *, device: str | torch.device = "cpu", trust_compiled: bool = False):
    """Load an optimized model written by :func:`save_optimized` or by ``save_pretrained`` of an optimized
    model: ``(model, tokenizer_or_None)``, optimized, same outputs.

    The model is built from its config, the recipe re-applied without calibrating (which creates
    the quantized modules), then the saved state dict loaded over it. Every saved tensor must find
    its place, and every tensor of the model must be saved except heads tied to the embedding. Each file the
    folder's manifest lists is checked against its SHA-256 first.

    Nothing in the folder runs: weights are read from safetensors, settings from JSON/YAML. A ``compile`` step's
    decode graphs are warmed up here once the weights are in (from this machine's own compile caches where they
    hold them: seconds; a cold compile otherwise), and one log line says how long it took.

    Args:
        directory: the saved folder (local; nothing is downloaded).
        device: where to build the model.
        trust_compiled: use the compiled decode steps saved in the folder (``infopt_compiled/``: pickled graphs and
            shared libraries, machine code that runs in this process, and kernels copied into Inductor's cache)
            instead of building them here. Only for a folder you, or someone you trust, made: it skips the compile,
            and it runs whatever the folder holds.

    Returns:
        ``(model, tokenizer)``; the tokenizer is None when the folder has none.

    Raises:
        FileNotFoundError: the folder does not exist, has no recipe (it was not saved from an optimized model)
            or no weights.
        CheckpointError: a file differs from the one saved (the manifest's size or SHA-256), or the saved tensors do
            not fit the rebuilt model.

    Example:
        >>> import infopt, tempfile
        >>> from infopt.models import tiny_model
        >>> model = infopt.optimize(tiny_model(), [{"quantize": {"method": "int8"}}])
        >>> folder = infopt.save_optimized(model, tempfile.mkdtemp())
        >>> model, _ = infopt.load(folder)
        >>> [s.key for s in model.infopt.steps]
        ['quantize:int8']
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    d = Path(directory)
    if not d.exists():
        where = "" if d.is_absolute() else f" ({d.absolute()})"
        raise FileNotFoundError(
            f"the folder '{d}' does not exist{where}; give the folder written by "
            "infopt.save_optimized or by save_pretrained of an optimized model. infopt loads local folders only, "
            "it never downloads"
        )
    if not d.is_dir():
        raise FileNotFoundError(f"'{d}' is a file, not a folder; give the folder written by infopt.save_optimized")
    if not (d / RECIPE_FILE).is_file():
        raise FileNotFoundError(
            f"{d} has no {RECIPE_FILE}; save an optimized model with infopt.save_optimized or its save_pretrained"
        )
    # the small files (config, recipe, tokenizer, compiled steps) are checked before they are read; the weights
    # while the model is built (hashing releases the GIL), and before they are used
    listed = _manifest_names(d)
    weights = [n for n in listed if n.endswith(".safetensors")] if listed is not None else []
    if listed is None:
        verify_manifest(d)  # logs that the folder has no manifest
    else:
        verify_manifest(d, only=[n for n in listed if n not in weights])
    check = verify_async(d, only=weights) if weights else None
    try:
        config = AutoConfig.from_pretrained(str(d), local_files_only=True)
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config  # the recipe rebuilds the quantized layers here, not transformers' quantizer
        meta = json.loads((d / META_FILE).read_text())
        dtype = getattr(torch, meta["dtype"].replace("torch.", ""))
        recipe = Recipe.from_yaml((d / RECIPE_FILE).read_text())
        model = _blank_model(config, dtype).to(device).eval()
        if (d / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(str(d), local_files_only=True)
        saved_steps = (d / COMPILED_DIR).is_dir()
        # the compile step warms up after the weights are in (below), or loads the folder's steps when trusted
        use_saved = trust_compiled and saved_steps and steps_fit(model, d)
        with skipping_warmup():
            optimize(model, recipe, rebuild=True)
        state: dict[str, torch.Tensor] = {}
        for f in _state_files(d):
            state.update(load_file(str(f), device=str(device)))
        state = restore_saved_names(state)
    finally:
        if check is not None:
            check.result()  # raises CheckpointError naming a changed file
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(model, k)}
    bad_missing = sorted(set(missing) - tied)
    if bad_missing or unexpected:
        raise CheckpointError(
            f"the weights in {d} do not fit the rebuilt model: missing {bad_missing[:5]}, unexpected {unexpected[:5]}"
        )
    _finish_compile(model, d, use_saved=use_saved, saved_steps=saved_steps, trust_compiled=trust_compiled,
                    load_steps=load_steps)
    tok = None
    if (d / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    return model, tok


def _manifest_names(d: Path) -> list[str] | None:
    path = d / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        return list(json.loads(path.read_text())["files"])
    except (ValueError, KeyError, TypeError):
        return []  # verify_manifest names the problem


def _finish_compile(model: nn.Module, d: Path, *, use_saved: bool, saved_steps: bool, trust_compiled: bool,
                    load_steps) -> None:
    """Give a loaded model with a ``compile`` step its decode graphs: the folder's (trusted), or warmed up here."""
    report = model.__dict__.get("infopt")
    step = next((s for s in report.steps if s.key == "compile"), None) if report is not None else None
    if step is None:
        return
    config = Compile.from_dict(step.config)
    t0 = time.perf_counter()
    if use_saved:
        n = load_steps(model, d)
        step.notes.append(f"{n} decode step(s) loaded from {d.name}/infopt_compiled (trust_compiled=True), not "
                          "compiled")
        step.seconds += time.perf_counter() - t0
        return
    if not (config.warmup_batch_sizes and config.warmup_lengths):
        step.notes.append("decode step compiled lazily: the first call of each shape compiles")
        return
    stats = warmup(model, batch_sizes=config.warmup_batch_sizes, lengths=config.warmup_lengths)
    seconds = time.perf_counter() - t0
    step.seconds += seconds
    step.notes.append(f"decode forwards built on this machine after loading: {stats.compiles} graph(s) in "
                      f"{seconds:.1f} s ({stats.aot_cached} from this machine's package cache)")
    if saved_steps and not trust_compiled:
        log.warning("infopt.load: %s holds compiled decode steps (machine code), not used without "
                    "trust_compiled=True; built here instead in %.1f s. Pass trust_compiled=True only for a folder "
                    "you or someone you trust made", d, seconds)
    else:
        log.info("infopt.load: decode steps built here in %.1f s", seconds)


load = load_optimized


def _blank_model(config, dtype: torch.dtype) -> nn.Module:
    """The model of ``config`` with zero parameters (every one is overwritten by the saved state): skipping
    transformers' random initialisation saves about 3 s for the default model. Ties are made as ``from_config``
    makes them; buffers computed at construction (rotary frequencies) are kept."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise as usual (then zeroed as below)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _is_tied(model: nn.Module, key: str) -> bool:
    """True when parameter ``key`` shares its storage with another parameter (a head tied to the embedding)."""
    try:
        t = model.get_parameter(key)
    except AttributeError:
        return False
    ptr = t.data_ptr()
    return sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p.data_ptr() == ptr) > 1
