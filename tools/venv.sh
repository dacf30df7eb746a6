#!/usr/bin/env bash
# Create ./.venv with a Python >= 3.12 and install flashnext-jax into it.
#   bash tools/venv.sh         -> the package (CPU jax)
#   bash tools/venv.sh test    -> the package + test extras
# Versions are pinned by tools/constraints.txt (jax 0.11.2 = the GPU machine's, so Pallas APIs match).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

find_python() {
  for cand in python3.13 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | sort -rV); do
      if PYENV_VERSION="$v" pyenv exec python -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        echo "pyenv:$v"; return 0
      fi
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py="$(find_python)" || { echo "error: no Python >= 3.12 found (tried python3.13, python3.12, python3, pyenv)" >&2; exit 1; }
  echo "creating .venv with $py" >&2
  if [[ "$py" == pyenv:* ]]; then
    PYENV_VERSION="${py#pyenv:}" pyenv exec python -m venv .venv
  else
    "$py" -m venv .venv
  fi
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q --disable-pip-version-check -c tools/constraints.txt -e "$spec"
