#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (no network there: the Python packages it lacks travel
# as wheels in .whl/, see docs/benchmarks.md "On one GPU"). Run from the repository root; figures go to stdout
# and, with their JSON, to $OUT (default /tmp/gpu-out). Not a test: it prints what it measures.
#
#   1. the learner's update alone (bench/learner_ranks.py --ranks 1) on cuda against the same host's CPU;
#   2. `zclaw train` end to end with the learner on cuda and the workers' inference on cuda, and the same run
#      all on CPU, in one invocation, each with a `zclaw status --json` read mid-run (the resource view's
#      GPU utilisation and memory through NVML);
#   3. two NCCL ranks asked for on a host with one GPU: the clear refusal (one GPU per rank).
set -u
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
# no rendering here: the GPU image has no EGL loader (libEGL) unless it is carried in, and with
# MUJOCO_GL=egl `import mujoco` itself fails there
export PYTHONUNBUFFERED=1 MUJOCO_GL="${MUJOCO_GL:-disable}"
WHL="${GPU_CHECK_WHEELS:-.whl}"
if [ -d "$WHL" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHL"/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! command -v zclaw >/dev/null; then  # run from source: the console script is `python -m zclaw.cli`
  mkdir -p /tmp/zbin && printf '#!/bin/sh\nexec python3 -m zclaw.cli "$@"\n' >/tmp/zbin/zclaw
  chmod +x /tmp/zbin/zclaw && export PATH="/tmp/zbin:$PATH"
fi
TIME="${GPU_CHECK_TIME:-75}"
WORKERS="${GPU_CHECK_WORKERS:-4}"

echo "== host"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc
python3 -c "import sys, torch, zmq, mujoco, gymnasium, pynvml; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.cuda.is_available(), 'zmq', zmq.__version__, 'mujoco', mujoco.__version__)" \
  || exit 1

echo "== 1. learner update alone: cuda against this host's CPU"
for segments in 8 64; do  # x 16 envs x 64 steps: 8,192 and 65,536 steps per update
  timeout 120 python3 bench/learner_ranks.py --ranks 1 --device cuda --segments "$segments" --updates 10 \
    --warmup 3
  timeout 120 python3 bench/learner_ranks.py --ranks 1 --device cpu --threads "$(nproc)" --segments "$segments" \
    --updates 5 --warmup 1
done

echo "== 2. zclaw train, ${TIME} s each, configs/reacher.toml, ${WORKERS} workers"
for kind in cuda cpu; do
  if [ "$kind" = cuda ]; then extra=(--set learner.device=cuda --set worker.gpu=0); else extra=(); fi
  dir="/tmp/run-$kind"
  rm -rf "$dir"
  (sleep "$((TIME * 2 / 3))"; zclaw status --run-dir "$dir" --json >"$OUT/status_$kind.json" 2>&1) &
  timeout "$((TIME + 90))" zclaw train --config configs/reacher.toml --time "$TIME" --workers "$WORKERS" \
    --run-dir "$dir" "${extra[@]}" >"$dir.out" 2>&1
  echo "exit $? ($kind)"
  wait
  tail -n 25 "$dir.out"
  cp "$dir/summary.json" "$OUT/summary_$kind.json" 2>/dev/null || tail -n 40 "$dir"/logs/*.log
done

echo "== 3. two NCCL ranks on one GPU"
timeout 60 python3 bench/learner_ranks.py --ranks 2 --device cuda --segments 2 --updates 1 --warmup 0 2>&1 \
  | tail -n 3
echo "== done"
