#!/usr/bin/env bash
# `clora bench experiments` on a GPU host: a random-weight model of Qwen3-4B's shape (`clora model random`),
# bf16, the real vLLM; the whole table (N = 1, 2, 4, 8). Results go to OUTDIR
# (experiments.json, experiments.png, experiments.md; logs under OUTDIR/work).
#
#   learner/bench_experiments_gpu.sh OUTDIR [more `clora bench experiments` options]
#
# Needs clora installed with its GPU engine and broker extras (pip install -e '.[gpu,broker]'); PYTHON picks
# the interpreter (default: python). The model is built once under OUTDIR/qwen3-4b-random (about 8 GB) and
# reused: `BUILD_ONLY=1 learner/bench_experiments_gpu.sh OUTDIR` builds it and stops, so a host with a per-command
# time limit can build in one command and measure in the next (six stack starts of a 4B model and the runs
# take roughly 8-15 minutes; `--n 1,8` for a quick check). Experiments 0 and 1 run alone (fresh processes, start-up included); the other experiments' alone
# time is their mean (--alone 2), and every stack's engine has one shape (--max-loras 9), so vLLM compiles
# it once and later stacks start from its cache: both keep the run short. `--learners 2` (an option passed
# through) gives the concurrent stacks two learner processes sharing the GPU, each training half the tenants.
set -euo pipefail
out=${1:?usage: learner/bench_experiments_gpu.sh OUTDIR [options]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
model="$out/qwen3-4b-random"
"$py" -c "import sys; from learner.tiny_model import is_complete; sys.exit(0 if is_complete('$model') else 1)" \
    || "$py" -m clora model random --shape qwen3-4b --dtype bfloat16 --out "$model" --force
[ -z "${BUILD_ONLY:-}" ] || exit 0
exec "$py" -m clora bench experiments --model "$model" --dtype bfloat16 --gpu \
    --n 1,2,4,8 --steps 6 --final-window 2 --batch-size 16 --max-tokens 32 --alone 2 --max-loras 9 --out "$out" "$@"
