# Shell pieces shared by the GPU proof scripts (sourced by acceptance.sh and ablation.sh).

# export_checked RUN_DIR EXPORT_DIR LOG: export a training run and check the folder against the contract.
export_checked() {
  python export.py ckpt_path="$1" output_dir="$2" max_shard_size=15MB overwrite=true > "$3" 2>&1 &&
    python export.py check="$2" >> "$3" 2>&1
}

# check_benches LIST: every benchmark named in LIST (separated by , or ;) loads its prompts now, before hours of
# training: a machine without PyPI needs the bench cache (~/.cache/dflash2/bench, about 1.3 MB) copied in beforehand,
# or DFLASH2_CACHE pointed at a copy (dflash2/data/benches.py says where each file comes from).
check_benches() {
  # shellcheck disable=SC2086  # one word per bench
  python -c "import sys; from dflash2.data.benches import load_prompts; [load_prompts(b, limit=1) for b in sys.argv[1:]]" \
    ${1//[,;]/ }
}

# extra_data_arg: EXTRA_DATA as train.py's override (unset: nothing, the experiment's own data.extra_paths; none: [],
# data.path alone; else its ','-separated files).
extra_data_arg() {
  if [ "${EXTRA_DATA:-}" = none ]; then echo "data.extra_paths=[]"
  elif [ -n "${EXTRA_DATA:-}" ]; then echo "data.extra_paths=[${EXTRA_DATA}]"; fi
}
