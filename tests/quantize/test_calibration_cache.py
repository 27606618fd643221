"""The calibration cache: a second calibration of the same weights, config and data reuses the first's layers."""

import pytest
import torch

import infopt
from infopt.models import tiny_model
from infopt.quantize import AWQ, CALIBRATED, GPTQ, QAT, SmoothQuantW8A8, quantize_
from infopt.quantize.algorithms import qat as qat_mod
from infopt.quantize.calibration.cache import CACHE, ENV_VAR, CalibrationCache, weights_fingerprint

VOCAB = 49152

CONFIGS = {
    "gptq-g32": GPTQ(group_size=32, samples=4, seq_len=32),
    "awq-g32": AWQ(group_size=32, samples=4, seq_len=32),
    "smoothquant": SmoothQuantW8A8(samples=4, seq_len=32),
}


def calib(n=4, seq=32, seed=0):
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def memory_cache(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("INFOPT_CALIBRATION_CACHE", raising=False)
    CACHE.clear()
    yield
    CACHE.clear()


@pytest.fixture
def count(monkeypatch):
    """Wrap the calibrated quantizers' plans (and QAT's training) to count the calibrations that really run."""
    calls = []
    for cls in (GPTQ, AWQ, SmoothQuantW8A8):
        inner = CALIBRATED[cls]

        def wrapped(model, config, targets, ids, rebuild, inner=inner):
            if not rebuild:
                calls.append(type(config).__name__)
            return inner(model, config, targets, ids, rebuild)

        monkeypatch.setitem(CALIBRATED, cls, wrapped)
    run = qat_mod._run

    def counted_run(model, config, targets, ids, rebuild):
        if not rebuild:
            calls.append("QAT")
        return run(model, config, targets, ids, rebuild)

    monkeypatch.setattr(qat_mod, "_run", counted_run)
    return calls


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hit_is_bit_identical_and_skips_calibration(name, count, prompt):
    cfg = CONFIGS[name]
    m = tiny_model()
    ref = m(prompt).logits
    quantize_(m, cfg, calibration=calib())
    first, first_state = m(prompt).logits, _state(m)
    assert count == [type(cfg).__name__]
    assert infopt.undo(m) > 0
    assert torch.equal(m(prompt).logits, ref)  # undo restored the weights, so the key matches again
    quantize_(m, cfg, calibration=calib())
    assert count == [type(cfg).__name__]  # not re-run
    assert CACHE.hits == 1 and CACHE.misses == 1
    assert torch.equal(m(prompt).logits, first)
    _assert_same(_state(m), first_state)
    # a second model with the same weights shares the entry; the modules are fresh copies, not shared objects
    m2 = quantize_(tiny_model(), cfg, calibration=calib())
    assert count == [type(cfg).__name__]
    assert m2.model.layers[0].mlp.up_proj is not m.model.layers[0].mlp.up_proj
    assert torch.equal(m2(prompt).logits, first)


def _bump_weight(m):
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3


@pytest.mark.parametrize("change", ["weight", "config", "calibration", "targets", "norm"])
def test_each_key_part_misses(change, count):
    m = tiny_model()
    quantize_(m, GPTQ(group_size=32, samples=4, seq_len=32), calibration=calib())
    infopt.undo(m)
    cfg, ids, kw = GPTQ(group_size=32, samples=4, seq_len=32), calib(), {}
    if change == "weight":
        _bump_weight(m)
    elif change == "norm":  # not a quantized layer, but it shapes the calibration activations
        with torch.no_grad():
            m.model.norm.weight[3] *= 1.5
            m.model.layers[0].input_layernorm.weight[0] *= 1.5
    elif change == "config":
        cfg = GPTQ(group_size=32, samples=4, seq_len=32, damp=0.02)
    elif change == "calibration":
        ids = ids.clone()
        ids[2, 5] = (ids[2, 5] + 1) % VOCAB
    elif change == "targets":
        kw = {"exclude": ["*.self_attn.*"]}
    quantize_(m, cfg, calibration=ids, **kw)
    assert count == ["GPTQ", "GPTQ"]
    assert CACHE.hits == 0 and CACHE.misses == 2


def test_optimize_undo_reoptimize_uses_cache(count, prompt):
    m = tiny_model()
    recipe = [GPTQ(group_size=32, samples=4, seq_len=32), infopt.kvcache.Static(max_length=64)]
    infopt.optimize(m, recipe, calibration=calib())
    out = m.generate(prompt, max_new_tokens=6, do_sample=False)
    for _ in range(2):
        infopt.undo(m)
        infopt.optimize(m, recipe, calibration=calib())
        assert torch.equal(m.generate(prompt, max_new_tokens=6, do_sample=False), out)
    assert count == ["GPTQ"]
    assert CACHE.hits == 2


def test_qat_trains_once(count, prompt):
    cfg = QAT(group_size=32, steps=3, lr=1e-3, batch_size=4, samples=4, seq_len=32)
    m = tiny_model()
    infopt.optimize(m, [cfg], calibration=calib())
    first, stats = m(prompt).logits, dict(m.infopt.steps[0].stats)
    infopt.undo(m)
    infopt.optimize(m, [cfg], calibration=calib())
    assert count == ["QAT"]
    assert torch.equal(m(prompt).logits, first)
    assert m.infopt.steps[0].stats["loss_log"] == stats["loss_log"]  # the training record comes with the layers


def test_off_recalibrates(count, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "off")
    m = tiny_model()
    for _ in range(2):
        quantize_(m, GPTQ(group_size=32, samples=4, seq_len=32), calibration=calib())
        infopt.undo(m)
    assert count == ["GPTQ", "GPTQ"]
    assert len(CACHE) == 0


@pytest.mark.parametrize("name", ["gptq-g32", "awq-g32", "smoothquant", "qat"])
def test_disk_cache_survives_the_process_cache(name, count, monkeypatch, tmp_path, prompt):
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(ENV_VAR, "disk")
    cfg = CONFIGS.get(name) or QAT(group_size=32, steps=2, lr=1e-3, batch_size=4, samples=4, seq_len=32)
    m = tiny_model()
    infopt.optimize(m, [cfg], calibration=calib())
    first, first_state = m(prompt).logits, _state(m)
    infopt.undo(m)
    assert len(list((tmp_path / "calibration").glob("*.safetensors"))) == 1
    CACHE.clear()  # as a new process would start
    infopt.optimize(m, [cfg], calibration=calib())
    assert len(count) == 1 and CACHE.hits == 1
    assert torch.equal(m(prompt).logits, first)
    _assert_same(_state(m), first_state)


def test_fingerprint_covers_dtype_and_module_types():
    m = tiny_model()
    fp = weights_fingerprint(m)
    assert weights_fingerprint(tiny_model()) == fp
    assert weights_fingerprint(tiny_model(dtype=torch.bfloat16)) != fp
    _bump_weight(m)
    assert weights_fingerprint(m) != fp
    infopt.optimize(m, [infopt.attention.Attention("eager")])
    assert weights_fingerprint(m) != weights_fingerprint(tiny_model())


def test_lru_bound():
    cache = CalibrationCache(max_entries=2, mode="memory")
    for k in "abc":
        cache.get_or_compute(k, lambda: ({"x": torch.nn.Linear(2, 2)}, {}))
    assert len(cache) == 2
    calls = []
    cache.get_or_compute("a", lambda: calls.append(1) or ({}, {}))
    assert calls == [1]  # "a" was evicted first


def test_the_disk_cache_keeps_under_its_size_limit(count, monkeypatch, tmp_path):
    """INFOPT_CACHE_CALIBRATION_MB bounds the folder: a new entry pushes out the one used longest ago."""
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(ENV_VAR, "disk")
    monkeypatch.setenv("INFOPT_CACHE_CALIBRATION_MB", "0.000001")  # room for the newest entry only
    m = tiny_model()
    for group in (32, 64):
        quantize_(m, GPTQ(group_size=group, samples=4, seq_len=32), calibration=calib())
        infopt.undo(m)
        entries = sorted(p.name.split(".")[0] for p in (tmp_path / "calibration").iterdir())
        assert len(entries) == 2 and len(set(entries)) == 1  # one entry: weights and their description
    assert count == ["GPTQ", "GPTQ"]
