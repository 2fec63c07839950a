#!/usr/bin/env bash
# Set up (CPU torch, megatron-core, this package) and train the tiny calculator agent with streaming GRPO.
#   bash tools/quickstart.sh                      # ~2 min on 2 CPU cores (the first time + ~1 min of set-up)
#   bash tools/quickstart.sh --rl-mode sync       # extra flags override examples/tiny_agent/config.yaml
#   TSYNC_CPU_SPLIT=1 bash tools/quickstart.sh    # trainer on the first half of the allowed cores, rollout workers
#                                                 # (engine + sandboxed tools) on the rest (--trainer-cpus/--rollout-cpus)
# The split is not the default: on the 2-core dev box (shared) it made steps slower or no faster — `tools/bench_live.py
# --cpus split --cpus none --modes sync,stream-trajectory --repeats 2 --steps 4` at load 2.5-4: sync 1.27 s/step
# split vs 1.11 unpinned, stream-trajectory 1.25 vs 1.07 (earlier, at load 6-10: sync 1.83-1.94 vs 1.57-1.60). Sync
# waits on rollouts 86-88 % of a step: with one core each, the rollouts cannot use the learner's idle core.
# Output: runs/tiny_agent/{model,ckpt,tb}: ckpt/learning_curve.png (train and held-out success), ckpt/history.json and
# eval.json; `tensorboard --logdir runs/tiny_agent/tb` shows the curves. Run it again: it says there is nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TSYNC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
# install once per version of setup.py (the package itself is an editable install: code changes need none)
STAMP="$VENV/.tsync-quickstart-$(python -c "import hashlib; print(hashlib.sha256(open('setup.py','rb').read()).hexdigest()[:16])")"
if [ ! -e "$STAMP" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  python -m pip install -q -e ".[plot]"
  touch "$STAMP"
fi
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
CPU_FLAGS=()
if [ "${TSYNC_CPU_SPLIT:-0}" = 1 ]; then  # e.g. 2 cores: --trainer-cpus 0 --rollout-cpus 1
  read -r -a CPU_FLAGS < <(python -c "import os; from megatron_tsync.runtime.affinity import fmt; c = sorted(os.sched_getaffinity(0)); h = len(c) // 2; print(f'--trainer-cpus {fmt(c[:h])} --rollout-cpus {fmt(c[h:])}' if h else '')")
fi
exec python -m megatron_tsync.train --config examples/tiny_agent/config.yaml \
  --tensorboard-dir runs/tiny_agent/tb --load runs/tiny_agent/ckpt "${CPU_FLAGS[@]}" "$@"
