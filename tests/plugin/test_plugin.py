"""The infopt pytest plugin, driven end to end through ``pytester`` on generated test projects."""

from __future__ import annotations

import json

import pytest
import torch

from infopt.testing import GoldenStore, sanitize_test_id, topk_kl

pytest_plugins = ["pytester"]

GENERATE = """
import torch
from infopt.models import tiny_model
from infopt.testing import assert_generates_same

PROMPTS = [[1, 17, 400, 23], torch.tensor([5, 6, 7, 8, 9])]

def test_generate(infopt_golden):
    model = tiny_model("llama")
    if {perturb}:
        with torch.no_grad():
            model.lm_head.weight[{token}] += 100.0  # the golden's token 0 of prompt 0 loses to {token}
    assert_generates_same(model, None, PROMPTS, infopt_golden, max_new_tokens=8)
"""

QUALITY = """
import pytest
import torch
from infopt.models import tiny_model
from infopt.quantize import Int8WeightOnly, quantize_
from infopt.testing import assert_quality

IDS = torch.arange(1, 97) * 37 % 5000

@pytest.mark.parametrize("gate", [{gates}])
def test_int8(infopt_golden, gate):
    max_kl, min_top1 = gate
    model = tiny_model("llama")
    quantize_(model, Int8WeightOnly())
    figs = assert_quality(model, infopt_golden, input_ids=IDS, reference=tiny_model("llama"),
                          max_kl=max_kl, min_top1=min_top1)
    print("FIGS", figs)
"""


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    # in-process pytester runs drop modules first imported inside them; a second import of torch._dynamo
    # re-registers its torch.library namespaces and fails, so import everything the projects use up front
    import torch._dynamo  # noqa: F401

    from infopt.eval import greedy_outputs
    from infopt.models import tiny_model
    from infopt.quantize import Int8WeightOnly, quantize_

    model = tiny_model("llama")
    greedy_outputs(model, [[1, 2, 3]], max_new_tokens=2)
    quantize_(model, Int8WeightOnly())
    model(torch.tensor([[1, 2, 3]]))


def _generate(pytester, perturb: bool = False, token: int = 0) -> None:
    pytester.makepyfile(test_gen=GENERATE.format(perturb=perturb, token=token))


def _goldens(pytester) -> dict[str, bytes]:
    d = pytester.path / "tests" / "golden"
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.is_dir() else {}


def test_missing_golden_fails_with_hint(pytester):
    _generate(pytester)
    res = pytester.runpytest("-p", "no:cacheprovider")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*GoldenMissingError*--infopt-update-golden*"])
    assert _goldens(pytester) == {}


def test_update_writes_then_passes(pytester):
    _generate(pytester)
    pytester.runpytest("--infopt-update-golden").assert_outcomes(passed=1)
    files = _goldens(pytester)
    assert sorted(files) == ["test_gen.py__test_generate.json", "test_gen.py__test_generate.safetensors"]
    doc = json.loads(files["test_gen.py__test_generate.json"])
    assert doc["sections"]["generate"] == {"max_new_tokens": 8, "prompts": 2}
    assert {"torch", "transformers", "infopt", "device", "device_name", "dtype", "threads"} <= set(doc["env"])
    assert doc["env"]["dtype"] == "float32" and doc["env"]["threads"] == 1
    pytester.runpytest().assert_outcomes(passed=1)


def test_perturbed_model_fails_at_first_divergence(pytester):
    _generate(pytester)
    pytester.runpytest("--infopt-update-golden").assert_outcomes(passed=1)
    golden = json.loads((pytester.path / "tests/golden/test_gen.py__test_generate.json").read_text())
    assert golden["sections"]["generate"]["prompts"] == 2
    # push one output row so far up that the model emits that token at every step
    _generate(pytester, perturb=True, token=4242)
    res = pytester.runpytest()
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*greedy outputs differ for prompt 0 at generated token 0 (sequence position 4): "
                              "golden has *, model has 4242*",
                              "*golden: [[]*", "*model: [[]4242, 4242*"])


def test_quality_int8_gates(pytester):
    pytester.makepyfile(test_q=QUALITY.format(gates="(0.5, 0.5), (1e-12, 1.0)"))
    res = pytester.runpytest("--infopt-update-golden", "-s")
    # the golden comes from the fp32 reference; int8 passes the generous gate, fails the strict one
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*quality gate failed: mean KL * > max_kl 1e-12*",
                              "*mean KL * nats/token (top-16 estimate), max KL * at position *, top-1 agreement "
                              "* over 96 tokens*"])
    files = _goldens(pytester)
    assert len(files) == 4  # one golden pair per parametrized test id
    res = pytester.runpytest()  # compare against the recorded goldens, without a reference at hand
    res.assert_outcomes(passed=1, failed=1)


GPU_PROJECT = """
import os

import pytest
import torch

@pytest.mark.gpu
def test_needs_cuda():
    assert torch.cuda.is_available()

def test_device(infopt_device):
    assert infopt_device == "cpu" or infopt_device.startswith("cuda:")
    if infopt_device == "cpu" or not os.environ.get("INFOPT_TEST_FAKE_GPUS"):  # a faked GPU holds no memory
        torch.zeros(1, device=infopt_device)
"""


def _gpu_outcomes(gpus: int) -> dict[str, dict[str, int]]:
    """What each run of :data:`GPU_PROJECT` gives with ``gpus`` visible CUDA devices. Collected: test_needs_cuda
    (marked gpu) and test_device once on cpu and once per GPU (marked gpu), so ``2 + gpus`` tests."""
    if gpus:
        return {"all": {"passed": 2 + gpus},  # every test runs
                "-m gpu": {"passed": 1 + gpus, "deselected": 1},  # test_needs_cuda and the CUDA parameters
                "--infopt-device cpu": {"passed": 2}}  # test_needs_cuda and test_device[cpu]
    return {"all": {"passed": 1, "skipped": 1},  # test_device[cpu]; test_needs_cuda skipped
            "-m gpu": {"skipped": 1, "deselected": 1},
            "--infopt-device cpu": {"passed": 1, "skipped": 1}}


@pytest.mark.parametrize("fake_gpus", [None, 0, 1, 2], ids=["this-machine", "0-gpus", "1-gpu", "2-gpus"])
def test_gpu_marker_and_device_parameters(pytester, monkeypatch, fake_gpus):
    """The gpu marker skips without CUDA and infopt_device gives cpu plus one parameter per GPU: on this machine, and
    with 0, 1 and 2 GPUs faked (torch.cuda's count and availability, read by the in-process run), so every branch's
    counts are checked on a CPU-only machine too."""
    if fake_gpus is not None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: fake_gpus)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: fake_gpus > 0)
        monkeypatch.setenv("INFOPT_TEST_FAKE_GPUS", "1")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = _gpu_outcomes(gpus)
    pytester.makepyfile(test_g=GPU_PROJECT)
    res = pytester.runpytest("--strict-markers", "-rs", "-v")
    res.assert_outcomes(**want["all"])
    res.stdout.fnmatch_lines(["*test_device?cpu? PASSED*"])
    if gpus:
        res.stdout.fnmatch_lines(["*test_needs_cuda PASSED*"])
        res.stdout.fnmatch_lines([f"*test_device?cuda{i}? PASSED*" for i in range(gpus)])
    else:
        res.stdout.fnmatch_lines(["*SKIPPED*needs a CUDA device; none is visible*"])
        res.stdout.no_fnmatch_line("*test_device?cuda*")
    res = pytester.runpytest("-m", "gpu", "-v")  # the CUDA parameters carry the gpu marker
    res.assert_outcomes(**want["-m gpu"])
    res = pytester.runpytest("--infopt-device", "cpu", "-v")
    res.assert_outcomes(**want["--infopt-device cpu"])
    res.stdout.fnmatch_lines(["*test_device?cpu? PASSED*"])
    res.stdout.no_fnmatch_line("*test_device?cuda*")


@pytest.mark.slow
def test_goldens_byte_identical_across_processes(pytester):
    _generate(pytester)
    pytester.makepyfile(test_q=QUALITY.format(gates="(0.5, 0.5)"))
    pytester.runpytest_subprocess("--infopt-update-golden").assert_outcomes(passed=2)
    first = _goldens(pytester)
    assert len(first) == 4
    pytester.runpytest_subprocess("--infopt-update-golden").assert_outcomes(passed=2)
    assert _goldens(pytester) == first


def test_strict_env_fails_on_mismatch(pytester):
    _generate(pytester)
    pytester.runpytest("--infopt-update-golden").assert_outcomes(passed=1)
    path = pytester.path / "tests/golden/test_gen.py__test_generate.json"
    doc = json.loads(path.read_text())
    doc["env"]["torch"] = "0.0.0"
    path.write_text(json.dumps(doc))
    res = pytester.runpytest()
    res.assert_outcomes(passed=1, warnings=1)
    res.stdout.fnmatch_lines(["*EnvironmentMismatchWarning*torch: recorded '0.0.0'*"])
    res = pytester.runpytest("--infopt-strict-env")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*--infopt-strict-env is set*"])


def test_bench_opt_in(pytester, tmp_path):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"ratios": {"tokens_per_s": 2.0, "latency_s": 0.5},
                                 "higher_is_better": ["tokens_per_s"]}))
    pytester.makepyfile(test_b=f"""
        import json
        from infopt.testing import assert_no_regression

        def test_speed(infopt_golden):
            assert_no_regression({str(bench)!r}, infopt_golden, tolerance=0.1)
    """)
    pytester.runpytest().assert_outcomes(skipped=1)
    pytester.runpytest("--infopt-bench", "--infopt-update-golden").assert_outcomes(passed=1)
    pytester.runpytest("--infopt-bench").assert_outcomes(passed=1)
    bench.write_text(json.dumps({"ratios": {"tokens_per_s": 1.5, "latency_s": 0.6},
                                 "higher_is_better": ["tokens_per_s"]}))
    res = pytester.runpytest("--infopt-bench")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*benchmark regression:*", "*latency_s: 0.6x > 0.5x * (lower is better)*",
                              "*tokens_per_s: 1.5x < 2x * (higher is better)*"])


def test_golden_dir_option(pytester):
    _generate(pytester)
    pytester.runpytest("--infopt-update-golden", "--infopt-golden-dir", "gold").assert_outcomes(passed=1)
    assert sorted(p.suffix for p in (pytester.path / "gold").iterdir()) == [".json", ".safetensors"]


# --- unit tests of the pieces -------------------------------------------------------------------------------


@pytest.mark.parametrize("nodeid, stem", [
    ("tests/test_a.py::test_x[cpu]", "tests_test_a.py__test_x_cpu"),
    ("t.py::TestC::test_y[int8-g128]", "t.py__TestC__test_y_int8-g128"),
], ids=["param", "class"])
def test_sanitize_test_id(nodeid, stem):
    assert sanitize_test_id(nodeid) == stem


def test_sanitize_long_ids_stay_unique():
    a, b = sanitize_test_id("t.py::test[" + "a" * 300 + "]"), sanitize_test_id("t.py::test[" + "a" * 299 + "b]")
    assert a != b and len(a) <= 160


def test_topk_kl_exact_when_topk_is_everything_and_lower_bound_otherwise():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 40, generator=g) * 3, -1)
    q = torch.log_softmax(torch.randn(5, 40, generator=g) * 3, -1)
    full = (p.exp() * (p - q)).sum(-1)
    v, i = p.topk(40, dim=-1)
    torch.testing.assert_close(topk_kl(v, i, q), full, atol=1e-5, rtol=1e-5)
    v, i = p.topk(4, dim=-1)
    est = topk_kl(v, i, q)
    assert bool((est <= full + 1e-6).all()) and bool((est >= -1e-6).all())


def test_store_keeps_other_sections(tmp_path):
    g = GoldenStore(tmp_path, "s", update=True, env={"torch": "1"})
    g.write("a", {"x": torch.tensor([1])}, {"n": 1})
    g.write("b", {"x": torch.tensor([2])}, {"n": 2})
    g.write("a", {"x": torch.tensor([3])}, {"n": 3})
    assert g.read("a")[0]["x"].tolist() == [3] and g.read("a")[1] == {"n": 3}
    assert g.read("b")[0]["x"].tolist() == [2] and g.read("b")[1] == {"n": 2}


def test_ci_example_records_then_passes(pytester):
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "examples" / "ci" / "test_regression.py"
    pytester.makepyfile(test_regression=src.read_text())
    res = pytester.runpytest("--infopt-update-golden", "--infopt-device", "cpu", "-rs")
    res.assert_outcomes(passed=2, skipped=0 if torch.cuda.is_available() else 1)
    res = pytester.runpytest("--infopt-device", "cpu", "--infopt-strict-env")
    res.assert_outcomes(passed=2, skipped=0 if torch.cuda.is_available() else 1)
