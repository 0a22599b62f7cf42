# Sourced by the device scripts (qwen_grid.sh, reuse_gpu.sh): prepare SHIP SHORT joins the
# chunks copied to $HOME/ship/SHIP (examples/ship_model.py's calls) and converts the GGUF to a
# bf16 mlx-lm folder, $HOME/conv/SHORT/model, once a machine; the conversion's log goes to
# $R/convert-SHORT.log, and T0 is the caller's start (its seconds are printed).
prepare() {
  [ -d $HOME/conv/$2/model ] && return 0
  python3 examples/ship_model.py --join $HOME/ship/$1 --out $HOME/models/$2 --no-check || return 1
  python3 examples/ship_model.py $HOME/models/$2/*.gguf --dtype bfloat16 --out $HOME/conv/$2 \
    --keep-folder > $R/convert-$2.log 2>&1 || return 1
  echo "$2 ready at $(( $(date +%s) - T0 )) s"
}
