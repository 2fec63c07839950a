#!/usr/bin/env bash
# Set up a virtual environment (CPU torch, megatron-core, the package with its test extras) and run the tests.
#   bash tools/test.sh            # everything CI runs
#   bash tools/test.sh -k stream  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TSYNC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q -e ".[tests]"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec python -m pytest -q -p no:cacheprovider "$@" tests
