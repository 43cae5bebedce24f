# Shell pieces shared by the GPU proof scripts (sourced by acceptance.sh and ablation.sh).

# export_checked RUN_DIR EXPORT_DIR LOG: export a training run and check the folder against the contract.
export_checked() {
  python export.py ckpt_path="$1" output_dir="$2" max_shard_size=15MB overwrite=true > "$3" 2>&1 &&
    python export.py check="$2" >> "$3" 2>&1
}
