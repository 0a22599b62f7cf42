#!/usr/bin/env bash
# The Qwen grid on the GPU machine (docs/evaluation.md, "How the grid runs"), one device call:
#   bash examples/qwen_grid.sh TAG END
# after the staging calls (../shared/device/stage.sh --no-model; evaluate.py's pybible copied to
# $HOME/pp) and one call per model chunk (examples/ship_model.py NAME --as-is; each chunk copied
# to $HOME/ship/NAME). The first call joins and converts each model (about 120 s for both);
# later calls on the same machine reuse them, skip the warm-up process and count the results
# of earlier calls (/tmp/r-*) in --fill. Results and logs: $OUT/r-TAG.tgz, to merge here with
# `evaluate.py --merge`.
#   END: seconds from the script's start by which every evaluation has ended (the packing follows)
#   env G15 / G05: groups "LENGTHS:WORKERS:BATCH;..." for the 1.5B / 0.5B (unset: none)
#   env EXTRA15 / EXTRA05: evaluate.py's sample arguments (default: the grid's --fill 20)
#   env LONGEST: a sample's longest seconds (default 110): none starts later than END less it
#   env METHODS / BUDGETS / MODES: evaluate.py's (default: the grid's twelve methods, three
#     budgets, both modes)
set -u
TAG=${1:?TAG} END=${2:?END} LONGEST=${LONGEST:-110}
METHODS=${METHODS:-"full snapkv pyramidkv chunkkv streaming random expected kvzip adakv adakvzip
  adakvzip-global duo-r50-snapkv"}
BUDGETS=${BUDGETS:-"0.25 0.125 0.0625"} MODES=${MODES:-"aware agnostic"}
T0=$(date +%s)
source $HOME/mlx-env.sh
export PYTHONPATH=$HOME/pp${PYTHONPATH:+:$PYTHONPATH}
R=/tmp/r-$TAG; mkdir -p $R
(while true; do echo "$(( $(date +%s) - T0 )) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) | $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"; sleep 10; done) > $R/smi.log 2>&1 &
SMI=$!
[ -e $HOME/pp/kvfn_models ] || ln -s $PWD/models $HOME/pp/kvfn_models  # no install there
source examples/prepare_model.sh  # prepare SHIP SHORT
launch() {  # SHORT HEADS GROUPS EXTRA OUTNAME
  local short=$1 heads=$2 groups=$3 extra=$4 name=$5 g=0
  IFS=';' read -ra gs <<< "$groups"
  for grp in "${gs[@]}"; do
    IFS=':' read -r lengths workers batch <<< "$grp"
    g=$((g+1))
    local now=$(( $(date +%s) - T0 ))
    local left=$(( END - now )) dl=$(( END - now - LONGEST ))
    [ $dl -gt 30 ] || { echo "$name g$g: no time left ($left s)"; continue; }
    echo "$name g$g: lengths $lengths workers $workers batch $batch deadline $dl timeout $left"
    timeout -k 10 $left python3 examples/evaluate.py --model $HOME/conv/$short/model \
      --head-pattern examples/results/heads/$heads --dtype bfloat16 --lengths $lengths \
      --budgets $BUDGETS --modes $MODES --questions 2 --seed 1 \
      --tasks niah_single niah_multikey niah_multivalue variable_tracking --methods $METHODS \
      --prefill-step-size 2048 --workers $workers --batch $batch --deadline $dl $WARM \
      $extra --out $R/$name-g$g > $R/$name-g$g.log 2>&1 &
  done
}
WARM=${WARM-}; [ -f $HOME/.kernels-warm ] && WARM=--no-warm-up  # an earlier call compiled them
prior() {  # NAME: this machine's results from earlier calls, which --fill counts too
  ls /tmp/r-*/$1-g*.json 2>/dev/null | grep -v "^$R/" | tr '\n' ' '
}
EXTRA15=${EXTRA15:-"--first-sample 92 --samples 40 --fill 20 --have examples/results/qwen15-gpu.json.gz $(prior q15)"}
EXTRA05=${EXTRA05:-"--first-sample 113 --samples 60 --fill 20 --have examples/results/qwen05-gpu.json.gz $(prior q05)"}
echo "EXTRA15: $EXTRA15"; echo "EXTRA05: $EXTRA05"
if [ -n "${G05:-}" ]; then
  prepare qwen2.5-coder-0.5b-gguf q0.5b && launch q0.5b qwen2.5-coder-0.5b "$G05" "${EXTRA05:-}" q05
fi
if [ -n "${G15:-}" ]; then
  prepare qwen2.5-coder-1.5b-gguf q1.5b && launch q1.5b qwen2.5-coder-1.5b "$G15" "${EXTRA15:-}" q15
fi
wait $(jobs -p | grep -v "^$SMI$") 2>/dev/null
sleep 1; pkill -f "[-]-shard" && echo "killed leftover workers"
kill $SMI
ls $R/*.json > /dev/null 2>&1 && touch $HOME/.kernels-warm  # a call that made samples compiled
echo "done at $(( $(date +%s) - T0 )) s"
tail -n 3 $R/*.log
tar -C $R -czf $OUT/r-$TAG.tgz .
ls -la $OUT
