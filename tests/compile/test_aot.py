"""Decode shapes built as AOTInductor packages (``Compile(aot=...)``, infopt.compile.aot)."""

import json
import logging

import pytest
import torch

import infopt
from infopt.compile import Compile, compile_stats
from infopt.compile.aot import AotStep, aot_available
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.generate import decoder_for
from infopt.kvcache import Static
from infopt.models import tiny_model

pytestmark = pytest.mark.slow  # each test exports and compiles AOTInductor packages (15-50 s on 2 cores)

needs_aot = pytest.mark.skipif(not aot_available(), reason="torch without torch.export/AOTInductor constants API")


@pytest.fixture
def aot_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path))
    return tmp_path / "aoti"


def _recipe(**kw):
    return [Static(max_length=256), Compile(warmup_lengths=(64,), pack_linears=False, aot=True, **kw)]


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 1000, (b, n), generator=g) for b, n in ((1, 5), (1, 13), (1, 30))]


def test_aot_field_values():
    assert Compile().aot is False and Compile(aot="auto").to_dict()["compile"]["aot"] == "auto"
    with pytest.raises(RecipeError, match="aot"):
        Compile(aot="always")


def test_aot_true_is_refused_where_the_step_is_not_guard_free(llama):
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    with pytest.raises(IncompatibleModelError, match="module_guards is 'per_token'"):
        infopt.optimize(llama, [Static(), Compile(aot=True, module_guards="per_token")])
    with pytest.raises(IncompatibleModelError, match="backend is 'eager'"):
        infopt.optimize(llama, [Static(), Compile(aot=True, backend="eager")])
    assert decoder_for(llama) is None
    assert all(torch.equal(v, before[k]) for k, v in llama.state_dict().items())


@needs_aot
def test_aot_step_is_token_identical_reads_the_models_weights_and_is_cached(aot_cache):
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, _recipe())
    stats = compile_stats(m)
    assert stats.aot == 1 and stats.aot_cached == 0 and not stats.aot_failed and stats.compiles == 1
    fwd = decoder_for(m).forward_for(m)
    (key, step), = fwd._fns.items()
    assert isinstance(step.fn, AotStep) and step.aot
    packages = list(aot_cache.glob("*.pt2"))
    assert len(packages) == 1
    # the package holds no weights: the runner reads the model's own tensors
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    assert packages[0].stat().st_size < weights
    assert any(t is p for t in step.fn.constants.values() for p in m.parameters())
    for p in _prompts():
        kw = dict(max_new_tokens=10, do_sample=False)
        assert torch.equal(m.generate(p, **kw), ref.generate(p, **kw))
    assert stats.compiles_after_warmup == 0 and stats.calls >= 27

    # a weight changed in place is read by the package as it is (no copy was taken)
    with torch.no_grad():
        m.lm_head.weight[7] += 50.0
        ref.lm_head.weight[7] += 50.0
    ids = _prompts()[0]
    out = m.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=6, do_sample=False)) and (out[0, 5:] == 7).all()

    # a second model of the same shapes finds the package by describing itself, without an export, and the package
    # reads that model's own tensors: its weights and its fused projection groups' buffers (no module's tensors)
    again = tiny_model()
    infopt.optimize(again, _recipe())
    assert compile_stats(again).aot == 1 and compile_stats(again).aot_cached == 1
    assert compile_stats(again).aot_indexed == 1
    assert len(list(aot_cache.glob("*.pt2"))) == 1
    (_, step), = decoder_for(again).forward_for(again)._fns.items()
    groups = {id(m._infopt_fused): m._infopt_fused for m in again.modules() if "_infopt_fused" in m.__dict__}
    fused = [t for g in groups.values() for t in g.fused.values()]
    assert groups and all(any(c is t for c in step.fn.constants.values()) for t in fused)
    assert torch.equal(again.generate(ids, max_new_tokens=6, do_sample=False),
                       tiny_model().generate(ids, max_new_tokens=6, do_sample=False))


@needs_aot
def test_a_package_is_found_by_describing_the_model_without_an_export(aot_cache, monkeypatch):
    """The index is keyed by what the exported program depends on: a model described the same way (other weights'
    values) loads the package without an export and reads its own weights; one of other settings (a module's
    attribute) misses it and is exported."""
    from infopt.compile import aot

    first = tiny_model()
    infopt.optimize(first, _recipe(fuse_projections=False))
    assert compile_stats(first).aot_indexed == 0 and len(list(aot_cache.glob("*.json"))) == 1
    exports = []
    real = aot.export_step
    monkeypatch.setattr(aot, "export_step", lambda *a, **k: exports.append(1) or real(*a, **k))
    same, plain = tiny_model(seed=9), tiny_model(seed=9)
    infopt.optimize(same, _recipe(fuse_projections=False))
    assert exports == [] and compile_stats(same).aot_indexed == 1 and compile_stats(same).aot == 1
    for ids in _prompts():
        assert torch.equal(same.generate(ids, max_new_tokens=8, do_sample=False),
                           plain.generate(ids, max_new_tokens=8, do_sample=False))

    other = tiny_model()
    for layer in other.model.layers:  # read by the norms when the step is exported: another program
        layer.input_layernorm.variance_epsilon = 1e-3
    infopt.optimize(other, _recipe(fuse_projections=False))
    assert exports == [1] and compile_stats(other).aot_indexed == 0
    ref = tiny_model()
    for layer in ref.model.layers:
        layer.input_layernorm.variance_epsilon = 1e-3
    ids = _prompts()[1]
    assert torch.equal(other.generate(ids, max_new_tokens=8, do_sample=False),
                       ref.generate(ids, max_new_tokens=8, do_sample=False))


@needs_aot
def test_packed_fused_groups_are_found_by_the_index_only_under_their_own_handles(aot_cache, monkeypatch):
    """fp32 steps on prepacked weights (cpu-lossless's verify steps) read fused q/k/v and gate/up buffers and name
    each packed copy by a handle baked into the package: a second model alive beside the first packs under other
    handles, so it exports a package of its own; once the first is gone, a new model takes its handles back and loads
    the first package from the index, without an export."""
    import gc

    from infopt.compile import aot, packed
    from infopt.ops.packed_linear import can_pack

    if not can_pack():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    real_pack = packed.pack_linears_
    monkeypatch.setattr(packed, "pack_linears_", lambda m, **kw: real_pack(m, **{**kw, "min_elements": 0}))
    exports = []
    real_export = aot.export_step
    monkeypatch.setattr(aot, "export_step", lambda *a, **k: exports.append(1) or real_export(*a, **k))
    recipe = [Static(max_length=256), Compile(warmup_lengths=(64,), pack_linears=True, aot=True)]
    ids = _prompts()[1]
    want = tiny_model().generate(ids, max_new_tokens=8, do_sample=False)

    first = tiny_model()
    infopt.optimize(first, recipe)
    groups = [m._infopt_fused for m in first.modules() if "_infopt_fused" in m.__dict__]
    assert groups and all(g.packed is not None for g in groups)
    second = tiny_model()
    infopt.optimize(second, recipe)
    assert exports == [1, 1] and compile_stats(second).aot_indexed == 0
    for m in (first, second):
        assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=False), want)

    del first, groups
    gc.collect()
    third = tiny_model()
    infopt.optimize(third, recipe)
    assert exports == [1, 1] and compile_stats(third).aot_indexed == 1
    assert torch.equal(third.generate(ids, max_new_tokens=8, do_sample=False), want)


@needs_aot
def test_aot_padded_batches_and_a_replaced_weight(aot_cache):
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), Compile(warmup_lengths=(64,), warmup_batch_sizes=(2,),
                                                        pack_linears=False, aot=True)])
    ids = torch.tensor([[0, 0, 5, 17, 400], [1, 17, 400, 23, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    assert compile_stats(m).aot == 1  # the warm-up's package serves every batch of 2-32, padded or not
    # a parameter replaced by another tensor: the per-call module check drops the packages, the step is rebuilt
    # for the new weights
    before = m.generate(ids, **kw)
    with torch.no_grad():
        new = torch.randn(m.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
        m.lm_head.weight = torch.nn.Parameter(new.clone())
        ref.lm_head.weight = torch.nn.Parameter(new.clone())  # (the tiny model's head is tied: both untie it)
    out = m.generate(ids, **kw)
    assert torch.equal(out, ref.generate(ids, **kw)) and not torch.equal(out, before)
    assert compile_stats(m).aot == 2


@needs_aot
def test_an_export_failure_falls_back_to_torch_compile(aot_cache, monkeypatch, caplog):
    from infopt.compile import aot

    def refuse(*a, **k):
        raise RuntimeError("export refused this model")

    monkeypatch.setattr(aot, "export_step", refuse)
    ref, m = tiny_model(), tiny_model()
    with caplog.at_level("WARNING", logger="infopt.compile"):
        infopt.optimize(m, _recipe())
    stats = compile_stats(m)
    assert stats.aot == 0 and list(stats.aot_failed.values()) == ["RuntimeError: export refused this model"]
    assert "could not be built with AOTInductor" in caplog.text
    fwd = decoder_for(m).forward_for(m)
    (key, step), = fwd._fns.items()
    assert step.fn is not None and not step.aot and stats.compiles == 1
    ids = _prompts()[1]
    assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=False),
                       ref.generate(ids, max_new_tokens=8, do_sample=False))


@needs_aot
def test_a_cache_of_other_layout_is_refused_by_the_package(aot_cache):
    import copy

    m = tiny_model()
    infopt.optimize(m, _recipe())
    dec = decoder_for(m)
    fwd = dec.forward_for(m)
    (key, step), = fwd._fns.items()
    with torch.no_grad():
        cache = dec.cache.cache_for(m, 1, key[2])
        tok = torch.tensor([[5]])
        fwd.prefill(tok, torch.zeros_like(tok), None, cache)
        odd = copy.deepcopy(cache)
        for layer in odd.layers:
            layer.keys = layer.keys.transpose(1, 2).contiguous().transpose(1, 2)
        with pytest.raises(RuntimeError, match="differ from those the AOTInductor package"):
            step.fn(tok, tok, torch.tensor([1]), None, odd)


@needs_aot
def test_an_unwritable_cache_folder_keeps_the_packages_in_a_folder_of_the_process(tmp_path, monkeypatch, caplog):
    from infopt.compile import aot

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(blocker))  # <file>/aoti cannot be created (as a read-only home)
    monkeypatch.setattr(aot, "_SCRATCH", [])
    ref, m = tiny_model(), tiny_model()
    with caplog.at_level(logging.WARNING, logger="infopt.compile"):
        infopt.optimize(m, _recipe())
    stats = compile_stats(m)
    assert stats.aot == 1 and not stats.aot_failed  # before: the step fell back to torch.compile
    assert "cannot be written" in caplog.text and "INFOPT_CACHE_DIR" in caplog.text
    scratch = aot._SCRATCH[0]
    assert len(list(scratch.glob("*.pt2"))) == 1 and not (blocker.parent / "aoti").exists()
    ids = _prompts()[1]
    assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False),
                       ref.generate(ids, max_new_tokens=6, do_sample=False))
    again = tiny_model()  # the same process finds the package it built
    infopt.optimize(again, _recipe())
    assert compile_stats(again).aot_cached == 1


def _load_without_export(monkeypatch, folder):
    """``infopt.load`` of a saved folder with every export refused (its packages must load as saved): the model and
    its compile stats."""
    from infopt.compile import aot

    def refuse(*a, **k):
        raise AssertionError("a saved package must load without an export")

    monkeypatch.setattr(aot, "export_step", refuse)
    loaded, _ = infopt.load(folder, trust_compiled=True)
    return loaded, compile_stats(loaded)


@needs_aot
def test_a_saved_package_loads_over_the_loaded_weights_without_export(aot_cache, tmp_path, monkeypatch):
    """save_optimized keeps each shape's package with the model-relative names of the weights it reads;
    infopt.load installs it without exporting or compiling, and it gives the tokens of the model that was saved."""
    from infopt.compile.saved import COMPILED_DIR, MANIFEST, can_save_steps

    if not can_save_steps():
        pytest.skip(f"torch {torch.__version__} saves no compiled steps")
    ids = torch.tensor([[3, 17, 9, 41, 5, 11, 2, 8]])
    recipe = {"steps": [{"kvcache": "static"}, {"compile": {"warmup_lengths": [64], "pack_linears": False,
                                                            "fuse_projections": False, "aot": True}}]}
    torch.manual_seed(0)
    m = tiny_model("llama")
    infopt.optimize(m, recipe)
    want = m.generate(ids, max_new_tokens=12, do_sample=False)
    folder = infopt.save_optimized(m, tmp_path / "saved")
    manifest = json.loads((folder / COMPILED_DIR / MANIFEST).read_text())
    (name, form), = manifest["aot_packages"].items()
    assert (folder / COMPILED_DIR / f"{name}.pt2").is_file() and "lm_head.weight" in form["constants"].values()

    loaded, stats = _load_without_export(monkeypatch, folder)
    assert stats.loaded == 1 and stats.aot == 1 and stats.compiles == 0
    fwd = decoder_for(loaded).forward_for(loaded)
    (key, step), = fwd._fns.items()
    assert isinstance(step.fn, AotStep) and step.aot
    assert all(any(t is p for p in (*loaded.parameters(), *loaded.buffers())) for t in step.fn.constants.values())
    assert torch.equal(loaded.generate(ids, max_new_tokens=12, do_sample=False), want)
    assert stats.compiles == 0 and stats.calls >= 11

    # a replaced weight is seen by the per-call module check, which drops the loaded package for a new export
    monkeypatch.undo()
    new = torch.randn(loaded.lm_head.weight.shape, generator=torch.Generator().manual_seed(2))
    for model in (loaded, m):
        model.lm_head.weight = torch.nn.Parameter(new.clone())
    out = loaded.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, m.generate(ids, max_new_tokens=12, do_sample=False)) and not torch.equal(out, want)
    assert stats.aot == 2


@needs_aot
def test_a_saved_package_of_fused_projections_reads_the_loaded_models_fused_buffers(aot_cache, tmp_path, monkeypatch):
    """A package that reads fused q/k/v and gate/up buffers (no module's tensors) names them by the group's first
    layer; infopt.load fuses the rebuilt model's projections and hands the package those buffers, no export."""
    from infopt.compile import aot
    from infopt.compile.saved import COMPILED_DIR, MANIFEST, can_save_steps

    if not can_save_steps():
        pytest.skip(f"torch {torch.__version__} saves no compiled steps")
    ids = torch.tensor([[3, 17, 9, 41, 5, 11, 2, 8]])
    torch.manual_seed(0)
    m = tiny_model("llama")
    infopt.optimize(m, {"steps": [{"kvcache": "static"}, {"compile": {"warmup_lengths": [64], "pack_linears": False,
                                                                      "aot": True}}]})
    want = m.generate(ids, max_new_tokens=12, do_sample=False)
    folder = infopt.save_optimized(m, tmp_path / "saved")
    (form,) = json.loads((folder / COMPILED_DIR / MANIFEST).read_text())["aot_packages"].values()
    names = set(form["constants"].values())
    assert "model.layers.0.self_attn.q_proj#fused.weight" in names and "model.layers.0.mlp.gate_proj#fused.weight" in names

    loaded, stats = _load_without_export(monkeypatch, folder)
    assert stats.loaded == 1 and stats.aot == 1 and stats.compiles == 0
    (_, step), = decoder_for(loaded).forward_for(loaded)._fns.items()
    q = loaded.model.layers[0].self_attn.q_proj
    assert any(t is q._infopt_fused.weight for t in step.fn.constants.values())
    assert torch.equal(loaded.generate(ids, max_new_tokens=12, do_sample=False), want)
    assert stats.compiles == 0

    # the names say which tensor they are: one the model lacks is a clear error, not another tensor
    with pytest.raises(LookupError, match="no tensor 'nothing'"):
        aot.tensor_named(loaded, "model.layers.0.self_attn.q_proj#fused.nothing")
    with pytest.raises(LookupError, match="no fused projection group"):
        aot.tensor_named(loaded, "model.layers.0.self_attn.o_proj#fused.weight")


def test_a_saved_package_of_any_batch_serves_every_batch_after_load(aot_cache, tmp_path, monkeypatch):
    """The package of every batch of 2-32 keeps that in its saved form: loaded, it serves batches of 3 and 5 (one
    row padded) without an export, with the saved model's tokens."""
    from infopt.compile.saved import COMPILED_DIR, MANIFEST, can_save_steps

    if not can_save_steps():
        pytest.skip(f"torch {torch.__version__} saves no compiled steps")
    recipe = {"steps": [{"kvcache": "static"}, {"compile": {"warmup_lengths": [64], "warmup_batch_sizes": [2],
                                                            "pack_linears": False, "fuse_projections": False,
                                                            "aot": True}}]}
    torch.manual_seed(0)
    m = tiny_model("llama")
    infopt.optimize(m, recipe)
    g = torch.Generator().manual_seed(5)
    calls = []
    for rows in (3, 5):
        ids = torch.randint(3, 1000, (rows, 6), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        calls.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0))
    want = [m.generate(**kw) for kw in calls]
    folder = infopt.save_optimized(m, tmp_path / "saved")
    (form,) = json.loads((folder / COMPILED_DIR / MANIFEST).read_text())["aot_packages"].values()
    assert form["free_length"] and form["free_batch"]

    loaded, stats = _load_without_export(monkeypatch, folder)
    assert stats.loaded == 1 and stats.shapes == ["any batch 2-32, any cache length, padded"]
    assert all(torch.equal(loaded.generate(**kw), w) for kw, w in zip(calls, want, strict=True))
    assert stats.compiles == 0 and stats.calls >= 2 * 6


def test_the_package_cache_drops_the_packages_used_longest_ago(tmp_path, monkeypatch):
    import os

    from infopt.compile.aot import cache_limit_bytes, prune_cache

    for i, name in enumerate(("old", "mid", "new", "kept")):
        f = tmp_path / f"{name}.pt2"
        f.write_bytes(b"x" * 400_000)
        os.utime(f, (1000 + i, 1000 + i))
    os.utime(tmp_path / "kept.pt2", (10, 10))  # the oldest, but the one just written
    (tmp_path / ".other.pt2.tmp").write_bytes(b"x" * 10_000_000)  # a write in progress: never counted or deleted
    monkeypatch.setenv("INFOPT_CACHE_AOTI_MB", "1")
    assert cache_limit_bytes() == 1_000_000
    gone = prune_cache(tmp_path, keep=tmp_path / "kept.pt2")
    assert sorted(p.name for p in gone) == ["mid.pt2", "old.pt2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt2.tmp", "kept.pt2", "new.pt2"]
    monkeypatch.setenv("INFOPT_CACHE_AOTI_MB", "lots")
    with pytest.raises(ValueError, match="INFOPT_CACHE_AOTI_MB='lots'"):
        cache_limit_bytes()


@needs_aot
def test_one_package_serves_every_batch_from_two_rows(aot_cache):
    """Exported at two rows, the package keeps the batch symbolic too (``Dim`` from 2): batches of 2, 3 and 4, padded
    or not, in two cache buckets, run the warm-up's two packages, token-identical, exporting nothing more."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=512), Compile(pack_linears=False, aot=True, warmup_batch_sizes=(1, 2))])
    stats = compile_stats(m)
    assert stats.aot == 2 and not stats.aot_failed
    assert stats.shapes == ["batch 1, any cache length, unpadded", "any batch 2-32, any cache length, padded"]
    fwd = decoder_for(m).forward_for(m)
    assert [s.fn.free_batch for s in fwd._fns.values()] == [False, True]
    g = torch.Generator().manual_seed(3)
    for rows, length, pad in ((3, 7, 2), (4, 5, 0), (2, 270, 1)):
        ids = torch.randint(3, 1000, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        mask[-1, :pad] = 0
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw)), (rows, length, pad)
    assert stats.compiles == 2 and stats.compiles_after_warmup == 0 and not stats.eager_shapes
    assert len(list(aot_cache.glob("*.pt2"))) == 2


def test_one_package_serves_every_cache_bucket(aot_cache):
    """The exported step keeps the cache length symbolic (in whole buckets): calls that reach the 512 bucket
    run the warm-up's package, export nothing, and stay token-identical; a cache of another length (a capped last
    bucket) is refused by that package's own check."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=512), Compile(pack_linears=False, aot=True)])
    stats = compile_stats(m)
    assert stats.aot == 1 and stats.shapes == ["batch 1, any cache length, unpadded"] and not stats.aot_failed
    fwd = decoder_for(m).forward_for(m)
    (key, step), = fwd._fns.items()
    assert step.fn.free and fwd.is_free(key)
    g = torch.Generator().manual_seed(8)
    for n in (5, 300, 400):
        ids = torch.randint(3, 1000, (1, n), generator=g)
        assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=False),
                           ref.generate(ids, max_new_tokens=8, do_sample=False))
    assert decoder_for(m).cache.allocation().length == 512
    assert stats.compiles == 1 and stats.compiles_after_warmup == 0 and stats.calls >= 21 and not stats.eager_shapes
    assert len(list(aot_cache.glob("*.pt2"))) == 1

    from infopt.kvcache.static import full_length_static_cache

    with torch.no_grad():  # a 96-slot cache is no whole bucket: the package refuses it rather than misread it
        cache = full_length_static_cache(m.config, 96)
        tok = torch.ones(1, 1, dtype=torch.long)
        fwd.prefill(tok, torch.zeros_like(tok), None, cache)
        with pytest.raises(RuntimeError, match="differ from those the AOTInductor package"):
            step.fn(tok, tok, torch.tensor([1]), None, cache)


@needs_aot
def test_building_a_package_keeps_no_copy_of_the_quantized_layers_buffers(aot_cache):
    """infopt's quantized layers keep their codes and scales as buffers, and AOTInductor copies every buffer it
    compiles as its "original value" and keeps the copies: at 8B that was a second copy of the weights for the rest of
    the process. The step hands them over as parameters: after the build, no tensor alive holds a buffer's bytes
    anywhere but in the model's own storage."""
    import gc

    from infopt.quantize import Int8WeightOnly, quantize_

    ref, m = tiny_model(), tiny_model()
    quantize_(ref, Int8WeightOnly())
    quantize_(m, Int8WeightOnly())
    buffers = [b for b in m.buffers() if b.nbytes >= 4096]
    assert buffers
    infopt.optimize(m, _recipe())
    assert compile_stats(m).aot == 1 and compile_stats(m).aot_cached == 0
    gc.collect()
    own = {t.untyped_storage().data_ptr() for t in (*m.parameters(), *m.buffers(), *ref.parameters(), *ref.buffers())}
    sizes = {b.nbytes: b for b in buffers}
    copies = []
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor) or o.is_meta or o.device.type != "cpu":
            continue
        try:
            storage = o.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # fake and functional tensors of the export: no data
            continue
        b = sizes.get(storage.nbytes())
        if storage.device.type != "cpu":  # a fake tensor's
            continue
        if ptr not in own and b is not None and torch.equal(
                torch.empty(0, dtype=torch.uint8).set_(storage), b.contiguous().view(-1).view(torch.uint8)):
            copies.append(tuple(o.shape))
    assert not copies, copies
    ids = _prompts()[1]
    assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=False),
                       ref.generate(ids, max_new_tokens=8, do_sample=False))
