#!/usr/bin/env bash
# quality_bounded.py on the GPU machine, several processes sharing the GPU, one device call
# (docs/benchmarks.md, "Evicting while prefilling on the Qwen models"), run from a frozen copy of
# the tree after the staging calls (.device-stage/c1, c2: MLX CUDA in $HOME/mlx-env.sh),
# evaluate.py's pybible copied to pp/ beside this tree, and one call per model chunk
# (.ship/NAME/cNNN copied to $HOME/ship/NAME/):
#   bash examples/quality_bounded_gpu.sh TAG END "SHORT:LENGTH:MODE:FIRST:SAMPLES[:POLICY[:CAP[:RATIOS]]];..."
#   bash examples/quality_bounded_gpu.sh --convert SHIP SHORT   # alone (setsid: in the background)
# SHORT: q0.5b | q1.5b (qwen2.5-coder-0.5b-gguf | qwen2.5-coder-1.5b-gguf, converted once a
# machine to bf16 at $HOME/conv/SHORT/model; a second caller waits for the first). END: seconds
# from the start by which every process has ended (no question starts after END - LONGEST).
# POLICY: the policy each process runs (default snapkv), e.g. POLICY=kvzip bash ... TAG END SPECS;
# CAP: quality_bounded.py's --cap-factor (default 1: the cap is the budget). A spec's own POLICY
# and CAP (its 6th and 7th fields) override these for its process; RATIOS (8th, comma-separated,
# default 0.125,0.25) the kept fractions it asks, e.g. 0.125 alone where 4x 0.25 is the prompt.
# PROBE=1: every process's bounded config scored by the prompt's last window (--probe).
# Results: /tmp/qb-TAG/*.json (every answer and the table), packed into $OUT/qb-TAG.tgz.
set -u
cd "$(dirname "$0")/.."
source $HOME/mlx-env.sh
export PYTHONPATH=$PWD/pp:$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -e pp/kvfn_models ] || ln -s $PWD/models pp/kvfn_models
convert() {  # SHIP SHORT
  local D=$HOME/conv/$2 t=$(date +%s)
  mkdir -p $HOME/conv
  [ -f $D.done ] && return 0
  if [ -f $D.running ]; then
    while [ ! -f $D.done ] && [ ! -f $D.failed ]; do sleep 2; done
    [ -f $D.done ]; return
  fi
  touch $D.running
  { python3 examples/ship_model.py --join $HOME/ship/$1 --out $HOME/models/$2 --no-check &&
    python3 examples/ship_model.py $HOME/models/$2/*.gguf --dtype bfloat16 --out $D \
      --keep-folder; } > $D.log 2>&1 && touch $D.done || { touch $D.failed; tail -5 $D.log; return 1; }
  echo "$2 converted in $(( $(date +%s) - t )) s"
}
if [ "$1" = --convert ]; then convert $2 $3; exit; fi
T0=$(date +%s); TAG=$1; END=$2; SPECS=$3; LONGEST=${LONGEST:-70}
IFS=';' read -ra specs <<< "$SPECS"
if [ ${#specs[@]} -gt ${MAXP:-4} ]; then  # ten 0.5B processes at 32K ran an H100 out of memory
  echo "at most ${MAXP:-4} processes a call (MAXP), got ${#specs[@]}"; exit 2
fi
R=/tmp/qb-$TAG; mkdir -p $R
(while true; do
  echo "$(( $(date +%s) - T0 )) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
  sleep 10
done) > $R/smi.log 2>&1 &
SMI=$!
case "$SPECS" in *q0.5b*) convert qwen2.5-coder-0.5b-gguf q0.5b ;; esac
case "$SPECS" in *q1.5b*) convert qwen2.5-coder-1.5b-gguf q1.5b ;; esac
echo "models ready at $(( $(date +%s) - T0 )) s"
for sp in "${specs[@]}"; do
  IFS=':' read -r short L mode first n policy cap ratios <<< "$sp"
  policy=${policy:-${POLICY:-snapkv}}; cap=${cap:-${CAP:-1}}; ratios=${ratios:-0.125,0.25}
  now=$(( $(date +%s) - T0 )); left=$(( END - now )); dl=$(( left - LONGEST ))
  name=$short-$L-$mode-$first-$policy-cap$cap
  [ "$ratios" = 0.125,0.25 ] || name=$name-r${ratios//,/_}  # two specs apart by ratios alone
  [ "${PROBE:-0}" = 1 ] && name=$name-probe
  echo "$name: samples $first..$((first + n - 1)) deadline $dl timeout $left"
  timeout -k 10 $left python3 examples/quality_bounded.py --model $HOME/conv/$short/model \
    --grid --lengths $L --modes $mode --ratios ${ratios//,/ } --policy $policy \
    --cap-factor $cap $([ "${PROBE:-0}" = 1 ] && echo --probe) \
    --prefill-step-size 2048 --samples $n --first-sample $first --deadline $dl \
    --cache-limit-gb 2 --out $R/$name.json > $R/$name.log 2>&1 &
done
wait $(jobs -p | grep -v "^$SMI$") 2>/dev/null
kill $SMI
echo "done at $(( $(date +%s) - T0 )) s"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__)"
for f in $R/*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], len(d['rows']), d['seconds'])" $f
done
tail -n 2 $R/*.log | cut -c1-300
tar -C $R -czf $OUT/qb-$TAG.tgz .
