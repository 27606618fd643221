"""Loading a saved folder runs no code from it unless the user opts in, and a changed byte is refused.

The payloads are real: a pickle whose unpickling writes a marker file, and a shared library whose constructor
writes one. Each test shows the payload runs when the opt-in (``trust_compiled=True``) lets the folder's compiled
artifacts in (after rewriting the manifest, as whoever planted it would), and never runs without it.
"""

import json
import logging
import pickle
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import infopt
from infopt.compile import compile_stats
from infopt.compile.aot import aot_available
from infopt.compile.saved import COMPILED_DIR, KERNELS, MANIFEST, can_save_steps
from infopt.core.errors import CheckpointError
from infopt.core.integrity import MANIFEST_FILE, write_manifest
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly

IDS = torch.tensor([[3, 17, 9, 41, 5, 11, 2, 8]])
COMPILED = {"steps": [{"kvcache": "static"}, {"compile": {"warmup_lengths": [64], "pack_linears": False,
                                                          "fuse_projections": False}}]}

needs_saved_steps = pytest.mark.skipif(not can_save_steps(), reason=f"torch {torch.__version__} saves no compiled "
                                       "steps (no torch.compile(...).aot_compile)")


class _Payload:
    """Unpickling this writes ``path``: what a planted step file could do with any code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _saved(tmp_path, recipe, name="saved"):
    torch.manual_seed(0)
    m = tiny_model("llama")
    infopt.optimize(m, recipe)
    want = m.generate(IDS, max_new_tokens=12, do_sample=False)
    return infopt.save_optimized(m, tmp_path / name), want


@pytest.fixture(scope="module")
def compiled_once(tmp_path_factory):
    if not can_save_steps():
        pytest.skip(f"torch {torch.__version__} saves no compiled steps")
    return _saved(tmp_path_factory.mktemp("compiled"), COMPILED)


@pytest.fixture
def compiled(compiled_once, tmp_path):
    folder, want = compiled_once
    return shutil.copytree(folder, tmp_path / "saved"), want


# -- code in the folder ------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_saved_steps
def test_a_planted_pickle_runs_only_with_the_opt_in(compiled, tmp_path):
    folder, want = compiled
    steps = json.loads((folder / COMPILED_DIR / MANIFEST).read_text())["steps"]
    marker = tmp_path / "pickle-ran"
    for name in steps:
        (folder / COMPILED_DIR / f"{name}.bin").write_bytes(pickle.dumps(_Payload(marker)))
    write_manifest(folder)  # whoever planted it rewrites the manifest too: it is no defence against code

    model, _ = infopt.load(folder)
    assert not marker.exists()
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)
    stats = compile_stats(model)
    assert stats.loaded == 0 and stats.compiles >= 1  # built here

    with pytest.warns(RuntimeWarning, match="did not load"):  # the payload ran; the load carries on compiling
        model, _ = infopt.load(folder, trust_compiled=True)
    assert marker.read_text() == "ran"


@needs_saved_steps
def test_without_the_opt_in_nothing_enters_the_compile_cache(compiled, tmp_path, monkeypatch):
    """kernels.zip is copied into Inductor's process-wide cache only for a trusted folder: a planted library under a
    real kernel's name would be loaded by any later compile that needs that kernel."""
    folder, want = compiled
    with zipfile.ZipFile(folder / COMPILED_DIR / KERNELS) as z:
        names = [n for n in z.namelist() if n.endswith(".main.so")]
    planted = folder / COMPILED_DIR / KERNELS
    with zipfile.ZipFile(planted, "w") as z:
        for n in names:
            z.writestr(n, b"planted")
    write_manifest(folder)
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    model, _ = infopt.load(folder)
    assert names and not any(p.read_bytes() == b"planted" for p in cache.rglob("*.so"))
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)

    other = tmp_path / "inductor-trusting"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(other))
    from infopt.compile import saved

    assert saved._restore_kernels(folder / COMPILED_DIR) == len(names)  # what the opt-in would do
    assert all((other / n).read_bytes() == b"planted" for n in names)


def _library_that_writes(marker, tmp_path):
    src = tmp_path / "payload.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {\n'
                   f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
    lib = tmp_path / "payload.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the payload library")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib.read_bytes()


@pytest.mark.slow
@needs_saved_steps
@pytest.mark.skipif(not aot_available(), reason="torch without torch.export/AOTInductor constants API")
def test_a_planted_shared_library_runs_only_with_the_opt_in(tmp_path, monkeypatch):
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path / "cache"))
    recipe = {"steps": [{"kvcache": "static"}, {"compile": {"warmup_lengths": [64], "pack_linears": False,
                                                            "fuse_projections": False, "aot": True}}]}
    folder, want = _saved(tmp_path, recipe)
    packages = sorted((folder / COMPILED_DIR).glob("*.pt2"))
    assert packages
    marker = tmp_path / "library-ran"
    payload = _library_that_writes(marker, tmp_path)
    for pkg in packages:
        tampered = pkg.with_suffix(".new")
        with zipfile.ZipFile(pkg) as src, zipfile.ZipFile(tampered, "w") as dst:
            libs = [i.filename for i in src.infolist() if i.filename.endswith(".so")]
            assert libs
            for item in src.infolist():
                dst.writestr(item, payload if item.filename.endswith(".so") else src.read(item.filename))
        tampered.replace(pkg)
    write_manifest(folder)

    model, _ = infopt.load(folder)
    assert not marker.exists()
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)
    assert compile_stats(model).aot >= 1  # its package was built here (or found in this machine's cache)

    with pytest.warns(RuntimeWarning, match="did not load"):
        infopt.load(folder, trust_compiled=True)
    assert marker.read_text() == "ran"


@needs_saved_steps
def test_with_the_opt_in_a_folder_loads_its_steps_as_before(compiled, caplog):
    folder, want = compiled
    with caplog.at_level(logging.WARNING, logger="infopt"):
        model, _ = infopt.load(folder)
    assert "not used without trust_compiled=True" in caplog.text  # one line saying so, and the time it took
    stats = compile_stats(model)
    assert stats.loaded == 0 and stats.compiles >= 1
    assert "built on this machine" in "; ".join(next(s for s in model.infopt.steps if s.key == "compile").notes)

    model, _ = infopt.load(folder, trust_compiled=True)
    stats = compile_stats(model)
    assert stats.loaded >= 1 and stats.compiles == 0
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)
    assert stats.compiles == 0


# -- changed bytes -------------------------------------------------------------------------------------------------
def _flip_a_tensor_byte(path):
    """Flip one bit inside the data of the file's largest tensor (the header, shapes and dtypes stay as they are)."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name, info = max(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
    start, end = info["data_offsets"]
    raw[8 + n + (start + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return name


@pytest.mark.parametrize("how", ["save_optimized", "save_pretrained"])
def test_a_flipped_byte_in_a_tensor_is_refused_naming_the_file(how, tmp_path):
    m = infopt.optimize(tiny_model("llama"), [Int8WeightOnly()])
    folder = tmp_path / how
    if how == "save_optimized":
        infopt.save_optimized(m, folder)
        weights = folder / "infopt_model.safetensors"
    else:
        m.save_pretrained(folder)
        weights = folder / "model.safetensors"
    infopt.load(folder)  # as saved: loads
    _flip_a_tensor_byte(weights)
    with pytest.raises(CheckpointError, match=rf"{weights.name} does not hold the bytes that were saved"):
        infopt.load(folder)
    if how == "save_pretrained":
        from transformers import AutoModelForCausalLM

        with pytest.raises(CheckpointError, match=rf"{weights.name} does not hold the bytes"):
            AutoModelForCausalLM.from_pretrained(folder)


def test_changed_settings_and_missing_files_are_refused(tmp_path):
    m = infopt.optimize(tiny_model("llama"), [Int4WeightOnly(group_size=32)])
    folder = infopt.save_optimized(m, tmp_path / "saved")
    listed = json.loads((folder / MANIFEST_FILE).read_text())["files"]
    assert {"config.json", "infopt_model.safetensors", "infopt_recipe.yaml", "infopt_meta.json"} <= set(listed)
    recipe = (folder / "infopt_recipe.yaml").read_text()
    (folder / "infopt_recipe.yaml").write_text(recipe.replace("group_size: 32", "group_size: 64"))
    with pytest.raises(CheckpointError, match="infopt_recipe.yaml has .* bytes where|infopt_recipe.yaml does not"):
        infopt.load(folder)
    (folder / "infopt_recipe.yaml").write_text(recipe)
    infopt.load(folder)
    (folder / "infopt_meta.json").unlink()
    with pytest.raises(CheckpointError, match="infopt_meta.json is listed in infopt_manifest.json but missing"):
        infopt.load(folder)


def test_an_edit_made_on_purpose_is_recorded_with_write_manifest(tmp_path):
    m = infopt.optimize(tiny_model("llama"), [Int8WeightOnly()])
    folder = infopt.save_optimized(m, tmp_path / "saved")
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["max_new_tokens"] = 7
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(CheckpointError, match=r"run infopt\.io\.write_manifest\(folder\)"):
        infopt.load(folder)
    infopt.io.write_manifest(folder)
    assert infopt.load(folder)[0].generation_config.max_new_tokens == 7


def test_a_folder_without_a_manifest_loads_and_says_it_was_not_checked(tmp_path, caplog):
    m = infopt.optimize(tiny_model("llama"), [Int8WeightOnly()])
    folder = infopt.save_optimized(m, tmp_path / "old")
    (folder / MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="infopt"):
        loaded, _ = infopt.load(folder)
    assert "has no infopt_manifest.json" in caplog.text
    assert torch.equal(loaded(IDS).logits, m(IDS).logits)


def test_the_folder_readme_says_how_to_load_and_keeps_a_users_own(tmp_path):
    m = infopt.optimize(tiny_model("llama"), [Int8WeightOnly()])
    m.save_pretrained(tmp_path / "a")
    text = (tmp_path / "a" / "README.md").read_text()
    assert "infopt.load(" in text and "import infopt" in text and "quantized" in text
    mine = tmp_path / "b" / "README.md"
    mine.parent.mkdir()
    mine.write_text("# my model card\n")
    m.save_pretrained(tmp_path / "b")
    assert mine.read_text() == "# my model card\n"


# -- loaders that do not know infopt -----------------------------------------------------------------------------
_PLAIN_LOADER = r"""
import json, sys
from transformers import AutoModelForCausalLM
out = {}
for folder in sys.argv[1:]:
    try:
        AutoModelForCausalLM.from_pretrained(folder)
        out[folder] = "loaded"
    except Exception as e:
        out[folder] = f"{type(e).__name__}: {e}"
print(json.dumps({"infopt imported": "infopt" in sys.modules, "results": out}))
"""


@pytest.mark.slow
def test_plain_from_pretrained_without_infopt_refuses_every_saved_layout(tmp_path):
    """A process that never imports infopt: transformers skips the unknown quant_method with a warning, and would
    then fill the quantized projections at random; each layer's placeholder makes it refuse the folder instead."""
    from tests.quantize.test_hf_quantizer import LAYOUTS, quantized

    folders = []
    for layout in LAYOUTS:
        folder = tmp_path / layout
        quantized(layout).save_pretrained(folder)
        folders.append(folder)
    extra = {"cpu-fast-quantize": [Int4WeightOnly(group_size=32, include_lm_head=True, share_embedding=True,
                                                 activations="auto")]}
    try:
        import bitsandbytes  # noqa: F401

        from infopt.quantize import BnbInt8, BnbNF4

        extra.update({"bnb-int8": [BnbInt8()], "bnb-nf4": [BnbNF4()]})
    except ImportError:
        pass
    from infopt.quantize import QAT

    extra["qat"] = [QAT(group_size=32, steps=1, samples=2, seq_len=16, batch_size=2)]
    for name, recipe in extra.items():
        folder = tmp_path / name
        infopt.optimize(tiny_model("llama"), recipe).save_pretrained(folder)
        folders.append(folder)
    out = subprocess.run([sys.executable, "-c", _PLAIN_LOADER, *map(str, folders)], capture_output=True, text=True,
                         check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["infopt imported"] is False
    loaded = [f for f, r in report["results"].items() if r == "loaded"]
    assert not loaded, f"loaded without infopt (random weights): {loaded}"
    assert all("mismatch" in r.lower() for r in report["results"].values()), report["results"]
    for folder in folders:  # and each folder says how to load it
        assert "import infopt" in (folder / "README.md").read_text()
