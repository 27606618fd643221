"""Compiled decode steps saved with the model: ``infopt.load(..., trust_compiled=True)`` runs them without compiling,
with the same tokens, and falls back to compiling when they do not fit (another setup, a changed dtype). Without the
opt-in they are never read (tests/test_safe_loading.py)."""

import json
import shutil
import zipfile

import pytest
import torch

import infopt
from infopt.compile import compile_stats
from infopt.compile.saved import COMPILED_DIR, KERNELS, MANIFEST, can_save_steps
from infopt.core.integrity import write_manifest
from infopt.models import tiny_model
from infopt.ops.packed_linear import can_pack

pytestmark = pytest.mark.slow  # each test compiles decode steps and saves or loads them

# packed fp32 linears would keep the steps unsaved (their graphs name this process's packed weights; see
# test_packed_models_keep_their_warm_up): these tests are about the saved steps
RECIPE = {"steps": [{"kvcache": "static"}, {"compile": {"warmup_lengths": [64], "pack_linears": False}}]}
IDS = torch.tensor([[3, 17, 9, 41, 5, 11, 2, 8]])


def _saved(tmp_path):
    torch.manual_seed(0)
    m = tiny_model("llama")
    infopt.optimize(m, RECIPE)
    want = m.generate(IDS, max_new_tokens=12, do_sample=False)
    folder = infopt.save_optimized(m, tmp_path / "saved")
    return folder, want


needs_aot = pytest.mark.skipif(not can_save_steps(), reason=f"torch {torch.__version__} has no "
                               "torch.compile(...).aot_compile: steps are not saved (see the test below)")


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """One saved folder for the module (saving builds the steps' kernels in a child process: seconds)."""
    if not can_save_steps():
        pytest.skip(f"torch {torch.__version__} has no torch.compile(...).aot_compile")
    return _saved(tmp_path_factory.mktemp("saved-once"))


@pytest.fixture
def saved(saved_once, tmp_path):
    """A copy of the module's saved folder this test may change, and the tokens the model gave before saving."""
    folder, want = saved_once
    return shutil.copytree(folder, tmp_path / "saved"), want


def test_without_aot_compile_no_step_is_saved_and_loading_compiles(tmp_path, monkeypatch):
    """On a torch without ahead-of-time compilation (2.11), saving says so and keeps no step; the loaded model
    compiles its step and gives the same tokens."""
    import infopt.compile.saved as saved

    monkeypatch.setattr(saved, "can_save_steps", lambda: False)
    with pytest.warns(RuntimeWarning, match="cannot compile a decode step ahead of time"):
        folder, want = _saved(tmp_path)
    assert not (folder / COMPILED_DIR).exists()
    m, _ = infopt.load(folder)
    assert torch.equal(m.generate(IDS, max_new_tokens=12, do_sample=False), want)
    assert compile_stats(m).loaded == 0 and compile_stats(m).compiles >= 1


@needs_aot
def test_load_runs_the_saved_step_without_compiling(saved):
    folder, want = saved
    manifest = json.loads((folder / COMPILED_DIR / MANIFEST).read_text())
    assert manifest["steps"] and all((folder / COMPILED_DIR / f"{n}.bin").is_file() for n in manifest["steps"])
    model, _ = infopt.load(folder, trust_compiled=True)
    stats = compile_stats(model)
    assert stats.loaded == len(manifest["steps"]) and stats.compiles == 0 and stats.warmed_up
    got = model.generate(IDS, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    assert stats.compiles == 0 and stats.calls > 0  # the decode steps ran the loaded graph


@needs_aot
def test_a_manifest_from_another_setup_compiles_instead(saved):
    folder, want = saved
    path = folder / COMPILED_DIR / MANIFEST
    meta = json.loads(path.read_text())
    meta["fingerprint"]["torch"] = "0.0.0"
    path.write_text(json.dumps(meta))
    write_manifest(folder)
    model, _ = infopt.load(folder, trust_compiled=True)
    stats = compile_stats(model)
    assert stats.loaded == 0 and stats.compiles >= 1  # warmed up as a folder without saved steps is
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)


@needs_aot
def test_a_saved_step_is_not_used_with_grad_enabled(saved):
    folder, _ = saved
    model, _ = infopt.load(folder, trust_compiled=True)
    from infopt.generate import decoder_for

    f = decoder_for(model).forward_for()
    key = next(iter(f._fns))
    saved = f._fns[key]
    with torch.enable_grad():
        cache = decoder_for(model).cache.cache_for(model, 1, 256)
        ids = torch.ones(1, 1, dtype=torch.long)
        f.prefill(ids, torch.zeros_like(ids), None, cache)
        pos = torch.tensor([1])
        saved(ids, pos[None], pos, None, cache)
    assert f._fns.get(key) is not saved  # replaced by a guarded compile of the shape
    assert compile_stats(model).compiles >= 1


@needs_aot
def test_the_saved_kernels_fill_an_empty_compile_cache(saved, tmp_path, monkeypatch):
    """Saving keeps the shared libraries that loading the steps builds; loading with an empty Inductor cache puts
    them there (so Inductor finds them instead of compiling), keeps files it already has, and gives the same
    tokens."""
    folder, want = saved
    with zipfile.ZipFile(folder / COMPILED_DIR / KERNELS) as z:
        names = z.namelist()
    assert any(n.endswith(".main.so") for n in names)  # the steps' kernels, beside the vector-ISA probes
    cache = tmp_path / "inductor-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    kept = cache / names[0]
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"already here")
    model, _ = infopt.load(folder, trust_compiled=True)
    assert all((cache / n).is_file() for n in names)
    assert kept.read_bytes() == b"already here"
    with zipfile.ZipFile(folder / COMPILED_DIR / KERNELS) as z:
        assert (cache / names[-1]).read_bytes() == z.read(names[-1])
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)
    assert compile_stats(model).compiles == 0


@needs_aot
def test_a_kernels_file_with_unexpected_entries_restores_only_kernel_names(saved, tmp_path, monkeypatch, caplog):
    folder, want = saved
    with zipfile.ZipFile(folder / COMPILED_DIR / KERNELS, "a") as z:
        z.writestr("../escaped.so", b"x")
        z.writestr("ab/not_a_library.py", b"x")
    write_manifest(folder)
    cache = tmp_path / "cache" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    with caplog.at_level("WARNING", logger="infopt.compile"):
        model, _ = infopt.load(folder, trust_compiled=True)
    assert "unexpected entry '../escaped.so'" in caplog.text
    assert not (tmp_path / "cache" / "escaped.so").exists() and not (cache / "ab").exists()
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)


@needs_aot
def test_when_the_kernels_cannot_be_built_ahead_the_steps_are_saved_without_them(tmp_path, monkeypatch):
    import subprocess

    import infopt.compile.saved as saved_module

    def fail(*args, **kwargs):
        raise subprocess.CalledProcessError(1, args[0], stderr="no compiler here")

    monkeypatch.setattr(saved_module.subprocess, "run", fail)
    with pytest.warns(RuntimeWarning, match="kernels could not be built ahead of time.*no compiler here"):
        folder, want = _saved(tmp_path)
    assert not (folder / COMPILED_DIR / KERNELS).exists()
    model, _ = infopt.load(folder, trust_compiled=True)
    assert compile_stats(model).loaded >= 1
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)


def test_no_compile_step_writes_no_compiled_folder(tmp_path):
    m = tiny_model("llama")
    infopt.optimize(m, {"steps": [{"kvcache": "static"}]})
    folder = infopt.save_optimized(m, tmp_path / "plain")
    assert not (folder / COMPILED_DIR).exists()
    folder = infopt.save_optimized(m, tmp_path / "plain2", compiled=False)
    assert not (folder / COMPILED_DIR).exists()


def test_speculative_models_keep_their_warm_up(tmp_path):
    m = tiny_model("llama")
    infopt.optimize(m, {"steps": [{"speculative": {"method": "prompt_lookup"}}, {"kvcache": "static"},
                                  {"compile": {"warmup_lengths": [64]}}]})
    folder = infopt.save_optimized(m, tmp_path / "spec")
    assert not (folder / COMPILED_DIR).exists()
    model, _ = infopt.load(folder)
    assert compile_stats(model).warmed_up and compile_stats(model).loaded == 0


@pytest.mark.skipif(not can_pack(), reason="this torch build has no oneDNN prepacked linear")
def test_packed_models_keep_their_warm_up(tmp_path):
    torch.manual_seed(0)
    m = tiny_model("llama")
    infopt.optimize(m, {"steps": [{"kvcache": "static"}, {"compile": {"warmup_lengths": [64]}}]})
    assert any("_infopt_packed" in x.__dict__ for x in m.modules())
    want = m.generate(IDS, max_new_tokens=12, do_sample=False)
    folder = infopt.save_optimized(m, tmp_path / "saved")
    assert not (folder / COMPILED_DIR / MANIFEST).exists()
    model, _ = infopt.load(folder)
    assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False), want)
    assert compile_stats(model).loaded == 0 and any("_infopt_packed" in x.__dict__ for x in model.modules())


@needs_aot
def test_a_loaded_step_is_not_used_over_a_cache_laid_out_otherwise(saved):
    """A loaded step was compiled over a contiguous cache of the model's dtype: a cache in another layout makes
    that shape compile with guards, and the logits are the eager step's."""
    import copy

    from infopt.compile.guard_free import GuardFreeStep
    from infopt.generate import decoder_for

    folder, _ = saved
    model, _ = infopt.load(folder, trust_compiled=True)
    dec = decoder_for(model)
    f = dec.forward_for()
    (key, step), = f._fns.items()
    assert isinstance(step, GuardFreeStep) and step.fn is not None
    with torch.no_grad():
        cache = dec.cache.cache_for(model, key[0], key[2])
        tok = torch.ones(key[0], 1, dtype=torch.long)
        f.prefill(tok, torch.zeros_like(tok), None, cache)
        odd, plain = copy.deepcopy(cache), copy.deepcopy(cache)
        for layer in odd.layers:
            layer.keys = layer.keys.transpose(1, 2).contiguous().transpose(1, 2)
            layer.values = layer.values.transpose(1, 2).contiguous().transpose(1, 2)
        pos = torch.ones(key[0], 1, dtype=torch.long)
        got = f.step(tok, pos, torch.tensor([1]), None, odd, first=1)
        want = f._forward(tok, pos, torch.tensor([1]), None, plain)
    torch.testing.assert_close(got, want)
    assert not isinstance(f._fns[key], GuardFreeStep) and compile_stats(model).compiles == 1
