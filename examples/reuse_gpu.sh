#!/usr/bin/env bash
# examples/benchmark_reuse.py on the GPU machine (issue 54, item 4), one device call:
#   bash examples/reuse_gpu.sh END
# after the staging calls (../shared/device/stage.sh --no-model; the evaluation's pybible copied
# to $HOME/pp: carry .venv/lib/python3.11/site-packages/pybible) and one call per model chunk
# (examples/ship_model.py qwen2.5-coder-0.5b --as-is, each chunk copied to
# $HOME/ship/qwen2.5-coder-0.5b-gguf; the 1.5B's to $HOME/ship/qwen2.5-coder-1.5b-gguf), as
# examples/qwen_grid.sh's header says. The first call on a machine joins and converts each model
# to a bf16 folder, $HOME/conv/SHORT/model (examples/prepare_model.sh, which qwen_grid.sh uses
# too: a machine that ran the grid has them); later calls reuse it. Then, per model and length, one run of
# benchmark_reuse.py --task niah_multikey: kvfn-server with $POLICY at $BUDGET of each context
# and the same server without eviction (mlx-lm's prompt cache), both up at once, $K contexts of
# $Q questions sent to each in turn. Results: $OUT/reuse-SHORT-LENGTH.json (every turn and the
# table's rows; rewritten after each context, so a run cut short keeps what it did) and
# $OUT/reuse-logs.tgz (each run's output and its servers' stderr); the tables are printed last.
#   END: seconds from the script's start by which every run has ended (at most ~580 in a call)
#   env MODELS: q0.5b and/or q1.5b (default "q0.5b")
#   env LENGTHS: context tokens (default "8192 32768")
#   env K: contexts a run (default 20); Q: questions a context (default 10)
#   env POLICY / BUDGET: the evicting server's (default adakvzip-global / 0.125)
#   env TAG: appended to the result files' names (two runs in one call keep both)
# Each run gets a share of the time left (by weight: 8 for its servers' start, plus its length
# in 1K tokens, x3 for the 1.5B; the last run all that is left): it starts no context past its
# share less about one context's time (benchmark_reuse.py --deadline), and is killed at END (its
# JSON then holds the contexts it finished).
set -u
END=${1:?END}
MODELS=${MODELS:-q0.5b} LENGTHS=${LENGTHS:-"8192 32768"} K=${K:-20} Q=${Q:-10}
POLICY=${POLICY:-adakvzip-global} BUDGET=${BUDGET:-0.125} TAG=${TAG:-}
T0=$(date +%s)
source $HOME/mlx-env.sh
mkdir -p /tmp/pp && ln -sfn $PWD/models /tmp/pp/kvfn_models  # no install there
export PYTHONPATH=/tmp/pp:$HOME/pp:$PWD${PYTHONPATH:+:$PYTHONPATH}
R=/tmp/reuse-logs$TAG; mkdir -p $R
now() { echo $(( $(date +%s) - T0 )); }
source examples/prepare_model.sh  # prepare SHIP SHORT
weight() {  # SHORT LENGTH: a run's share of the time (its servers' start, then its contexts)
  case $1 in q1.5b) echo $(( 3 * $2 / 1024 + 8 ));; *) echo $(( $2 / 1024 + 8 ));; esac
}
margin() {  # SHORT LENGTH: about one context's seconds (10 questions to each server)
  case $1 in q1.5b) echo $(( 3 * $2 / 2048 + 5 ));; *) echo $(( $2 / 2048 + 3 ));; esac
}
RUNS=""
for m in $MODELS; do
  case $m in
    q0.5b) prepare qwen2.5-coder-0.5b-gguf q0.5b || { echo "q0.5b: no model"; continue; } ;;
    q1.5b) prepare qwen2.5-coder-1.5b-gguf q1.5b || { echo "q1.5b: no model"; continue; } ;;
    *) echo "unknown model $m (q0.5b, q1.5b)"; continue ;;
  esac
  for L in $LENGTHS; do RUNS="$RUNS $m:$L"; done
done
left_weight=0
for run in $RUNS; do left_weight=$(( left_weight + $(weight ${run%%:*} ${run##*:}) )); done
for run in $RUNS; do
  m=${run%%:*} L=${run##*:} w=$(weight ${run%%:*} ${run##*:})
  case $m in q0.5b) grid=examples/results/qwen05-gpu.json.gz;; *) grid=examples/results/qwen15-gpu.json.gz;; esac
  left=$(( END - $(now) - 5 ))
  share=$(( left * w / left_weight ))
  left_weight=$(( left_weight - w ))
  dl=$(( share - $(margin $m $L) ))
  [ $dl -gt 30 ] || { echo "$m $L: no time left ($left s)"; continue; }
  echo "$m $L: at $(now) s, deadline $dl s, killed after $left s"
  timeout -k 10 $left python3 examples/benchmark_reuse.py --model $HOME/conv/$m/model \
    --task niah_multikey --tokens $L --contexts $K --questions $Q --policy $POLICY \
    --budget $BUDGET --prefill-step-size 2048 --grid $grid --deadline $dl \
    --out $OUT/reuse-$m-$L$TAG.json --log $R/servers-$m-$L.log > $R/$m-$L.log 2>&1
  echo "$m $L: exit $? at $(now) s"
done
echo "done at $(now) s"
for run in $RUNS; do
  m=${run%%:*} L=${run##*:}
  echo "== $m $L"
  if grep -q "^niah_multikey, " $R/$m-$L.log 2>/dev/null; then
    sed -n '/^niah_multikey, /,$p' $R/$m-$L.log
  else
    tail -n 8 $R/$m-$L.log 2>/dev/null; tail -n 5 $R/servers-$m-$L.log 2>/dev/null
  fi
done
tar -C $R -czf $OUT/reuse-logs$TAG.tgz .
ls -la $OUT
