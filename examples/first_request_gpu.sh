#!/usr/bin/env bash
# What a first request pays on the GPU machine, one device call (docs/benchmarks.md, "A first
# request's seconds"), run from a frozen copy of the tree after the staging calls
# (.device-stage/c1, c2: MLX CUDA in $HOME/mlx-env.sh):
#   bash examples/first_request_gpu.sh MODEL [PART ...]
# MODEL: an mlx-lm folder or .gguf for the servers (e.g. $HOME/conv/q0.5b/model, made by
# quality_bounded_gpu.sh --convert). PARTS (default: all, in this order):
#   warmup    benchmark_warmup.py: kvfn-server with and without its warm-up, and mlx-lm's own
#             path, each from an empty and a filled kernel cache, capped at 2,048 rows
#   interval  the same, with --kv-decode-interval 256 and counting completions of 300 tokens
#   profile   profile_first_request.py (8B shape, bf16, 32K, 1,024 rows) in new processes over
#             one kernel cache: to fill it, filled, and filled with MLX_DISABLE_COMPILE=1 (no
#             mx.compile trace: what is left of the 6 s is not the host's tracing); then which
#             kvfn kernels the cache holds (custom_kernel_kvfn_*: read back, not compiled again)
# Each part runs at most LIMIT seconds (default 280: two parts a 600 s call).
# Results: $OUT/first-request/*.json and *.log.
set -u
cd "$(dirname "$0")/.."
source $HOME/mlx-env.sh
mkdir -p /tmp/pp && ln -sfn $PWD/models /tmp/pp/kvfn_models  # no install there
export PYTHONPATH=/tmp/pp:$PWD${PYTHONPATH:+:$PYTHONPATH}
LIMIT=${LIMIT:-280}
MODEL=$1; shift
PARTS=${*:-warmup interval profile}
R=$OUT/first-request; mkdir -p $R
FLAGS="--kv-eviction snapkv --kv-budget 1024 --kv-max-rows 2048 --prefill-step-size 512"
LENGTHS=3000,4700,6100,7900,9800
for part in $PARTS; do
  t=$(date +%s)
  case $part in
    warmup)
      timeout -k 10 $LIMIT python3 examples/benchmark_warmup.py --model "$MODEL" \
        --lengths $LENGTHS --flags "$FLAGS" --json $R/warmup.json > $R/warmup.log 2>&1 ;;
    interval)
      timeout -k 10 $LIMIT python3 examples/benchmark_warmup.py --model "$MODEL" \
        --lengths $LENGTHS --max-tokens 300 --count --kinds no-warmup,warmup \
        --flags "$FLAGS --kv-decode-interval 256" --json $R/interval.json > $R/interval.log 2>&1 ;;
    profile)
      export MLX_PTX_CACHE_DIR=$(mktemp -d)
      args="--shape 8b --dtype bfloat16 --prompt-tokens 32768 --rows 1024 --requests 2"
      for run in fill filled no-compile; do
        [ $run = no-compile ] && export MLX_DISABLE_COMPILE=1
        timeout -k 10 $(( LIMIT / 3 )) python3 examples/profile_first_request.py $args \
          --json $R/profile-$run.json > $R/profile-$run.log 2>&1
      done
      unset MLX_DISABLE_COMPILE
      ls $MLX_PTX_CACHE_DIR | grep -c '\.ptx$' > $R/ptx-modules.txt  # each with a .txt and .cu
      ls $MLX_PTX_CACHE_DIR | grep 'kvfn.*\.ptx$' >> $R/ptx-modules.txt ;;
    *) echo "unknown part $part (warmup, interval, profile)"; exit 2 ;;
  esac
  echo "$part: $(( $(date +%s) - t )) s"; tail -n 12 $R/$part*.log | cut -c1-200
done
