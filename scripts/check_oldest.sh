#!/usr/bin/env bash
# Run scripts/check_versions.py on the oldest transformers that pyproject.toml claims, in a virtual environment of
# its own (.venv-oldest): that transformers is installed there, and the main .venv's packages (torch and the rest)
# that transformers does not bring, and infopt's source, are reached through a .pth file placed after it on the path, so nothing but transformers
# differs from the main environment. Needs `make setup` first; CI runs it after the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
OLD="${OLD_VENV:-.venv-oldest}"
floor=$(sed -n 's/^ *"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml | head -1)
[ -n "$floor" ] || { echo "check_oldest: no transformers>=X in pyproject.toml" >&2; exit 2; }
base_site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ ! -f "$OLD/.transformers-$floor" ]; then
  rm -rf "$OLD"
  "$VENV/bin/python" -m venv --without-pip "$OLD"
  old_site=$("$OLD/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # transformers with the dependencies of that version (huggingface-hub, tokenizers, ...); torch comes from .venv
  "$VENV/bin/python" -m pip install -q --target "$old_site" "transformers==$floor" 2>&1 | grep -v '^WARNING' || true
  printf '%s\n%s\n' "$base_site" "$(pwd)/src" > "$old_site/zz_infopt_base.pth"
  "$OLD/bin/python" -c "import transformers, torch" || { echo "check_oldest: installing transformers $floor failed" >&2; exit 2; }
  touch "$OLD/.transformers-$floor"
fi
echo "check_oldest: transformers $floor in $OLD"
"$OLD/bin/python" scripts/check_versions.py
