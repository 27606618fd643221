#!/usr/bin/env bash
# Two commits of infopt, measured in one sitting: the maintained decode and engine benchmarks of THIS tree run
# against the library of an older commit (a git worktree, put first on PYTHONPATH) and of this tree, alternating
# old/new and new/old from round to round. Each decode figure is a ratio to plain transformers measured in the same
# process, so the machine's drift between processes cancels; the engine's are output tokens/s.
#
# Usage: bash benchmarks/studies/tree_ab.sh OLD_REV [ROUNDS] [OUT_DIR]
# Writes OUT_DIR/{old,new}-{decode,engine}-rN.json (default OUT_DIR: benchmarks/results/tree_ab).
set -euo pipefail
old_rev=${1:?usage: tree_ab.sh OLD_REV [ROUNDS] [OUT_DIR]}
rounds=${2:-2}
out=${3:-benchmarks/results/tree_ab}
py=${PYTHON:-.venv/bin/python}
wt=/tmp/infopt-tree-ab-$old_rev
[ -d "$wt" ] || git worktree add -f "$wt" "$old_rev" -q
mkdir -p "$out"

run() {  # run TREE_NAME SRC ROUND
    local name=$1 src=$2 r=$3
    echo "== $name round $r: decode (cpu-fast, cpu-lossless) $(date -u +%H:%M:%S)"
    PYTHONPATH="$src" "$py" benchmarks/decode_ab.py cpu-fast cpu-lossless --rounds 3 --tokens 128 \
        --json "$out/$name-decode-r$r.json"
    echo "== $name round $r: engine (throughput workload, compiled steps) $(date -u +%H:%M:%S)"
    PYTHONPATH="$src" "$py" benchmarks/engine_throughput.py --dtypes float32 bfloat16 --compile on \
        --json "$out/$name-engine-r$r.json"
}

for r in $(seq 1 "$rounds"); do
    if (( r % 2 )); then run old "$wt/src" "$r"; run new src "$r"; else run new src "$r"; run old "$wt/src" "$r"; fi
done
