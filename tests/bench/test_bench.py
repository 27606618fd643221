import json
import math

import pytest
import torch

from infopt.bench import (
    WORKLOADS,
    append_csv,
    compare_runs,
    format_table,
    make_workload,
    measure_bandwidth,
    plot,
    run_bench,
    run_requests,
    summarize,
)
from infopt.models import tiny_model


@pytest.fixture(scope="module")
def tok():
    from infopt.models import load_default_tokenizer

    return load_default_tokenizer()


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_are_seeded_and_shaped(tok, name):
    a = make_workload(name, tok, seed=1)
    b = make_workload(name, tok, seed=1)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.input_ids, y.input_ids) and x.max_new_tokens == y.max_new_tokens
    if name == "decode":
        assert a[0].prompt_len == 32 and a[0].max_new_tokens == 128
    if name == "batch":
        assert len(a) == 64
        assert all(16 <= r.max_new_tokens <= 256 for r in a)
        assert min(r.prompt_len for r in a) >= 16
    if name == "throughput":
        assert len(a) == 64 and all(16 <= r.max_new_tokens <= 256 for r in a)
        assert all(53 <= r.prompt_len <= 512 for r in a)
        if seed_default := make_workload(name, tok):  # the default draw keeps the documented totals
            assert sum(r.prompt_len for r in seed_default) == 16_002
            assert sum(r.max_new_tokens for r in seed_default) == 9_094
    if name == "prefix":
        common = min(r.prompt_len for r in a)
        assert common > 900
        assert all(torch.equal(r.input_ids[0, :900], a[0].input_ids[0, :900]) for r in a)


def test_unknown_workload(tok):
    with pytest.raises(ValueError, match="allowed: decode"):
        make_workload("stress", tok)


def test_padded_and_sequential_serve_exact_lengths(tok):
    m = tiny_model("llama", max_positions=2048)
    reqs = make_workload("batch", tok, num_requests=3)
    seq = run_requests(m, reqs, mode="sequential")
    pad = run_requests(m, reqs, mode="padded", batch_size=2)
    for r, s, p in zip(reqs, seq["requests"], pad["requests"], strict=True):
        assert len(s["tokens"]) == len(p["tokens"]) == r.max_new_tokens
        assert 0 < s["ttft"] <= s["total"]
    m_seq = summarize(seq)
    assert m_seq["output_tokens"] == sum(r.max_new_tokens for r in reqs)
    assert m_seq["tokens_per_s"] > 0


@pytest.mark.slow
def test_run_bench_lossless_recipe_is_exact_and_reports_ratios(tok, tmp_path):
    m = tiny_model("llama", max_positions=2048)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    res = run_bench(m, tok, "cpu-lossless", "decode", repeats=2, progress=False)
    assert res["exact_greedy"] is True and res["lossless_claimed"] is True
    assert res["quality"]["kl"] == 0.0 and res["quality"]["top1"] == 1.0
    path = res["quality"]["decode_path"]  # the static cache and the compiled step, one token per step
    assert path["tokens"] == 32 and path["top1"] == 1.0 and path["kl"] < 1e-6
    assert set(res["ratios"]) == set(res["optimized"])
    assert res["ratios"]["model_mb"] == pytest.approx(1.0)
    assert res["machine"]["bandwidth_gbs"] > 0
    # a verify pass serves several tokens: bytes per step x tokens/s is no bandwidth, so none is given
    assert math.isnan(res["optimized"]["weight_gbs"]) and res["baseline"]["weight_gbs"] > 0
    assert "infopt: none (speculative decoding" in format_table(res)
    for k, v in m.state_dict().items():  # the model is handed back unoptimized
        assert torch.equal(v, before[k])
    assert "generate" not in m.__dict__
    text = format_table(res)
    assert "decode tokens/s" in text and "greedy outputs identical to baseline: yes" in text
    assert "decode path vs original's (32 greedy tokens, one step each): KL" in text
    json.loads(json.dumps(res))
    png = plot(res, tmp_path / "r.png")
    assert png.stat().st_size > 1000
    csv = append_csv(res, tmp_path / "hist.csv")
    append_csv(res, csv)
    assert len(csv.read_text().strip().splitlines()) == 3
    assert "B/A" in compare_runs(res, res)


def test_run_bench_lossy_recipe_measures_quality(tok):
    m = tiny_model("llama", max_positions=2048)
    # without the head: on this tiny model the 49k-row head is most of the weights, and an int8 head beside
    # the tied fp32 embedding would grow them
    recipe = [{"quantize": {"method": "int4", "group_size": 32}}]
    res = run_bench(m, tok, recipe, "batch", repeats=1, num_requests=3, progress=False)
    assert set(res["baseline_modes"]) == {"sequential", "padded"}
    assert res["lossless_claimed"] is False
    assert res["quality"]["kl"] > 0
    assert 0 < res["quality"]["decode_path"]["kl"] < 1 and res["quality"]["decode_path"]["tokens"] == 32
    assert res["ratios"]["model_mb"] < 1.0


@pytest.mark.parametrize("cold", ["compile", "eager"])
def test_a_run_that_compiles_in_its_timed_part_is_not_valid(tok, cold, monkeypatch):
    """The bench warms up with the first request; a later one here lands in a cache bucket the warm-up did not
    compile (guarded graphs: one per bucket). Compiled on first use, that compile lands in the timed run: the result
    says it is not valid, the table says why, and ``infopt bench`` would exit with 1. Run eagerly instead (the CPU
    default), the run is valid and the table counts the eager steps."""
    from infopt.bench import harness, workloads
    from infopt.bench.report import format_table

    short, long = (workloads.Request(torch.randint(3, 1000, (1, n)), 6) for n in (20, 300))
    monkeypatch.setattr(harness, "make_workload", lambda *a, **k: [short, long])
    m = tiny_model("llama", max_positions=2048)
    recipe = [{"kvcache": {"kind": "static", "max_length": 1024}},
              {"compile": {"backend": "aot_eager", "cold_shapes": cold}}]
    res = run_bench(m, tok, recipe, "decode", repeats=1, progress=False)
    c = res["compile"]
    text = format_table(res)
    if cold == "compile":
        assert c["compiles_in_timed_run"] >= 1 and res["valid"] is False and "NOT VALID" in text
    else:
        assert c["compiles_in_timed_run"] == 0 and c["cold_eager_calls_in_timed_run"] > 0 and res["valid"] is True
        assert "NOT VALID" not in text and "decode steps run eagerly on shapes the warm-up did not compile" in text
    assert res["exact_greedy"] is True


def test_baseline_only(tok):
    m = tiny_model("llama", max_positions=2048)
    res = run_bench(m, tok, "none", "decode", repeats=1, progress=False)
    assert res["optimized"] is None and res["ratios"] is None and res["exact_greedy"] is None
    assert "none (baseline only)" in format_table(res)


def test_a_decode_path_the_recipe_does_not_serve_is_reported_as_not_measured():
    # decode_path_compare gives {"tokens": 0} where the recipe hands every call that long to transformers' generate
    from infopt.bench.report import _foot_lines

    q = {"kl": 0.1, "kl_max": 0.2, "top1": 0.9, "ppl": 2.0, "ppl_ref": 2.0, "decode_path": {"tokens": 0}}
    lines = _foot_lines({"machine": {}, "quality": q})
    assert lines[-1].startswith("decode path: not measured") and not any("KL" in x for x in lines[1:])


def test_bandwidth_is_a_host_copy_rate_in_gb_per_s():
    """The CPU figure is in GB/s: inside the range of any host's memory, even on a machine busy with other work (a
    figure in MB/s or bytes/s misses it by a factor of 1,000 or more; the exact formula is the fake-timer test below).
    No comparison with a copy timed here: two timings on a shared machine are not a test."""
    figure = measure_bandwidth(size_mb=16, repeats=5)
    assert 0.05 < figure < 5000, figure  # one copy of DRAM or cache on any CPU this runs on


@pytest.mark.slow
def test_cli_bench_and_compare(tmp_path, tok, capsys):
    from infopt.cli import main

    src = tmp_path / "tiny"
    m = tiny_model("llama", max_positions=2048)
    m.save_pretrained(src)
    tok.save_pretrained(src)
    out = tmp_path / "a.json"
    assert main(["bench", "--model", str(src), "--workload", "decode", "--recipe", "cpu-lossless", "--repeats", "1",
                 "--json", str(out), "--quiet"]) == 0
    assert "decode tokens/s" in capsys.readouterr().out
    assert main(["bench", "--compare", str(out), str(out)]) == 0
    assert "1x" in capsys.readouterr().out


# -- devices: the bandwidth, the machine record and the CLI options -----------------------------------


def test_bandwidth_times_the_copy_on_the_device_it_is_given(monkeypatch):
    from infopt.bench import harness

    assert harness._copy_timer(torch.device("cpu")) is harness._copy_seconds_cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert harness._copy_timer(torch.device("cuda")) is harness._copy_seconds_cuda
    assert harness._copy_timer(torch.device("cuda:1")) is harness._copy_seconds_cuda
    with pytest.raises(ValueError, match="allowed: cpu, cuda"):
        harness._copy_timer(torch.device("meta"))


def test_bandwidth_on_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        measure_bandwidth(size_mb=1, repeats=1, device="cuda")


def test_bandwidth_is_bytes_read_and_written_over_the_median_time(monkeypatch):
    from infopt.bench import harness

    seconds = iter([1e-3, 4e-3, 2e-3])  # three repeats: the median rate is the 2 ms copy's
    devices = []

    def fake_timer(device):
        devices.append(device)
        return lambda src, dst: next(seconds)

    monkeypatch.setattr(harness, "_copy_timer", fake_timer)
    gbs = measure_bandwidth(size_mb=4, repeats=3)
    assert devices == [torch.device("cpu")]
    assert gbs == pytest.approx(2 * 4 * 2**20 / 2e-3 / 1e9)


def test_machine_info_records_the_gpu(monkeypatch):
    from types import SimpleNamespace

    from infopt.bench import harness

    cpu = harness.machine_info()
    assert cpu["device"] == "cpu" and cpu["gpu"] is None and cpu["nvidia_driver"] is None
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, major=9, minor=0)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: asked.append(i) or props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(harness, "_nvidia_driver", lambda: "580.65.06")
    gpu = harness.machine_info("cuda:1")
    assert asked == [1]
    assert gpu["device"] == "cuda:1" and gpu["gpu"] == "NVIDIA H100 80GB HBM3"
    assert gpu["gpu_memory_gib"] == 80.0 and gpu["gpu_capability"] == "9.0"
    assert gpu["cuda_runtime"] == torch.version.cuda and gpu["nvidia_driver"] == "580.65.06"
    assert harness.machine_info("cuda")["gpu"] == props.name and asked == [1, 0]  # no index: the current device


def test_nvidia_driver_read_from_nvidia_smi(monkeypatch):
    import subprocess

    from infopt.bench import harness

    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    assert harness._nvidia_driver() is None
    monkeypatch.setattr(harness.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="580.65.06\n580.65.06\n", stderr="")

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    assert harness._nvidia_driver() == "580.65.06"
    assert "--query-gpu=driver_version" in calls[0]
    monkeypatch.setattr(harness.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 9, stdout="", stderr="no devices"))
    assert harness._nvidia_driver() is None


def _result(**machine):
    base = {"decode_tokens_per_s": 10.0, "tokens_per_s": 10.0, "ttft_p50_ms": 5.0, "model_mb": 1.0,
            "peak_rss_mb": 100.0, "weight_gbs": 1.0}
    return {"machine": {"cpu": "host cpu", "threads": 2, "torch": "t", "transformers": "tf", "infopt": "i",
                        "date": "2026-01-01T00:00:00+00:00", "bandwidth_gbs": 3000.0, **machine},
            "model": "tiny", "workload": {"name": "decode", "description": "d", "requests": 1, "prompt_tokens": 32,
                                          "output_tokens": 128, "dtype": "torch.bfloat16", "repeats": 1, "seed": 0},
            "recipe": None, "baseline": dict(base), "baseline_modes": {"sequential": dict(base)}, "optimized": None,
            "ratios": None, "ratios_by_mode": None, "ratio_baseline": "sequential", "quality": None,
            "compile": None, "exact_greedy": None}


def test_table_and_csv_name_the_gpu(tmp_path):
    cpu = _result(device="cpu", gpu=None)
    text = format_table(cpu)
    assert "measured copy bandwidth 3000.0 GB/s" in text and "peak GPU memory" not in text
    gpu = _result(device="cuda:0", gpu="NVIDIA H100", gpu_memory_gib=79.2, cuda_runtime="13.0",
                  nvidia_driver="580.65.06")
    gpu["baseline"]["peak_gpu_mb"] = gpu["baseline_modes"]["sequential"]["peak_gpu_mb"] = 321.0
    text = format_table(gpu)
    assert "machine: NVIDIA H100 (79.2 GiB, CUDA 13.0, driver 580.65.06), host host cpu" in text
    assert "device-to-device copy bandwidth 3000.0 GB/s" in text
    assert any(line.startswith("peak GPU memory MiB") and "321" in line for line in text.splitlines())

    import csv

    path = append_csv(cpu, tmp_path / "hist.csv")
    append_csv(gpu, path)  # new columns: the header is extended and the CPU row keeps its cells
    append_csv(cpu, path)
    rows = list(csv.DictReader(path.open()))
    assert [r["gpu"] for r in rows] == ["", "NVIDIA H100", ""]
    assert rows[1]["nvidia_driver"] == "580.65.06" and rows[1]["device"] == "cuda:0"
    assert [r["cpu"] for r in rows] == ["host cpu"] * 3 and rows[2]["bandwidth_gbs"] == "3000.0"


def test_cli_device_and_dtype_options(tmp_path, monkeypatch, capsys):
    from infopt.cli import build_parser, main

    from .helpers import byte_tokenizer

    args = build_parser().parse_args(["bench", "--workload", "decode", "--recipe", "gpu-fast", "--device", "cuda",
                                      "--dtype", "bfloat16"])
    assert (args.device, args.dtype, args.recipe) == ("cuda", "bfloat16", "gpu-fast")
    defaults = build_parser().parse_args(["bench"])
    assert (defaults.device, defaults.dtype) == ("cpu", "float32")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--dtype", "int8"])

    src = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--model", str(src), "--device", "cuda", "--quiet"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert main(["bench", "--model", str(src), "--device", "tpu", "--quiet"]) == 2
    assert "--device 'tpu'" in capsys.readouterr().err

    out = tmp_path / "bf16.json"
    assert main(["bench", "--model", str(src), "--device", "auto", "--dtype", "bfloat16", "--recipe", "none",
                 "--requests", "1", "--repeats", "1", "--json", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["workload"]["dtype"] == "torch.bfloat16"
    assert res["machine"]["device"] == "cpu" and res["machine"]["gpu"] is None


def test_bench_measures_the_device(device):
    from tests.devices import DEVICES

    from .helpers import byte_tokenizer

    dev = DEVICES[device]
    m = tiny_model("llama").to(device)
    res = run_bench(m, byte_tokenizer(), [{"kvcache": {"kind": "static"}}], "decode", repeats=1, progress=False)
    mach = res["machine"]
    # CUDA: a host copy reaches tens of GB/s at most, so only a device-to-device copy in HBM clears the floor
    assert mach["bandwidth_gbs"] > dev.min_copy_gbs
    assert mach["device"].startswith(device) and (mach["gpu"], mach["cuda_runtime"]) == dev.gpu()
    assert res["exact_greedy"] is True and res["quality"]["top1"] == 1.0  # a static cache is lossless
    for side in (res["baseline"], res["optimized"]):
        assert side["decode_tokens_per_s"] > 0 and side[dev.peak_memory] > 0
        assert side["weight_gbs"] < mach["bandwidth_gbs"]
    # handed back unoptimized, on the device
    assert next(m.parameters()).device.type == device and "generate" not in m.__dict__
    assert dev.copy_label in format_table(res)


def test_bandwidth_figure_is_the_devices(device):
    from tests.devices import DEVICES

    figure = measure_bandwidth(size_mb=256, repeats=5, device=device)
    assert figure > DEVICES[device].min_copy_gbs
    if device == "cuda":
        # the GPU's own copy, not the host's: a 16-core host copies 64 MB at 255 GB/s (partly from its caches, above
        # the CUDA floor), an H200 at about 4,000; HBM is several times any host's memory
        assert figure > 3 * measure_bandwidth(size_mb=64, repeats=3, device="cpu")


@pytest.mark.slow
def test_cli_bench_fast_preset_bf16(tmp_path, device):
    """``infopt bench`` with the device's fast preset (gpu-fast: CUDA graphs; cpu-fast: int4 and an inductor step) in
    bf16: the compiled step served the run, and the machine record is the device's."""
    from infopt.cli import main
    from tests.devices import DEVICES

    from .helpers import byte_tokenizer

    dev = DEVICES[device]
    src = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    out = tmp_path / "fast.json"
    assert main(["bench", "--model", str(src), "--workload", "decode", "--recipe", dev.fast_preset, "--device", device,
                 "--dtype", "bfloat16", "--repeats", "1", "--json", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["workload"]["dtype"] == "torch.bfloat16"
    assert (res["machine"]["gpu"], res["machine"]["cuda_runtime"]) == dev.gpu()
    assert res["machine"]["bandwidth_gbs"] > dev.min_copy_gbs
    assert res["recipe"]["steps"][-1]["compile"]["mode"] == dev.decode_compile_mode
    assert res["compile"] is not None and res["compile"]["compiles"] >= 1  # the compiled step served the run
    assert res["optimized"]["decode_tokens_per_s"] > 0 and res["optimized"][dev.peak_memory] > 0


def test_engine_mode_reports_prompt_rate_and_kv_utilisation(tok):
    import infopt
    from infopt.batching import Batching

    m = tiny_model("llama", max_positions=2048)
    reqs = make_workload("throughput", tok, num_requests=3)
    infopt.optimize(m, [Batching(max_seqs=4, num_blocks=256)])
    try:
        run = run_requests(m, reqs, mode="engine")
    finally:
        infopt.undo(m)
    s = summarize(run)
    assert run["prompt_tokens"] == sum(r.prompt_len for r in reqs)
    assert s["prompt_tokens_per_s"] == pytest.approx(run["prompt_tokens"] / run["wall"])
    assert 0 < s["kv_util_mean"] <= 1
    assert [len(r["tokens"]) for r in run["requests"]] == [r.max_new_tokens for r in reqs]
