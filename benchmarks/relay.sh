#!/usr/bin/env bash
# Carries a training run from one GPU session to the next, so that a run longer than a session's device time resumes
# where it stopped (`ckpt_path=<run dir>/checkpoints/last.ckpt`, or rerunning ablation.sh / acceptance.sh). A DFlash2
# drafter for SmolLM2 with its AdamW state is about 400 MB, and one call to the GPU machine returns at most 64 MiB and
# takes at most 64 MiB with the checkout: the run travels as folders of RELAY_PARTS parts (3) of RELAY_PART_BYTES
# (16,000,000) each: 48 MB, which leaves room for the checkout in what a call carries.
#
#   on the GPU, once:       bash benchmarks/relay.sh pack RUN_DIR STORE      # STORE/0, STORE/1, ...; prints the count
#   on the GPU, per folder: bash benchmarks/relay.sh send STORE K "$OUT"     # one call each, K = 0, 1, ...
#   here:                   copy each call's files into .relay/NAME/K/ (ignored by git)
#   next session, per K:    carry .relay/NAME/K; bash benchmarks/relay.sh receive .relay/NAME/K STORE
#   then, once:             bash benchmarks/relay.sh unpack STORE RUN_PARENT  # checks every part, restores RUN_DIR
#
# The run folder travels whole except its checkpoints other than last.ckpt (the best one by val/tau_sim is another
# 400 MB; a resume and export.py read last.ckpt). unpack refuses a missing or damaged part and writes nothing then.
set -euo pipefail
PART=${RELAY_PART_BYTES:-16000000} PER=${RELAY_PARTS:-3}
usage() { sed -n '8,12p' "$0" >&2; exit 2; }
case "${1:-}" in
  pack)
    [ $# -eq 3 ] || usage
    run=$(realpath "$2") store=$3
    [ -f "$run/checkpoints/last.ckpt" ] || { echo "relay: $run/checkpoints/last.ckpt does not exist" >&2; exit 1; }
    rm -rf "$store.tmp" && mkdir -p "$store.tmp"
    parent=$(dirname "$run") name=$(basename "$run")
    (cd "$parent" && find "$name" -path "$name/checkpoints" -prune -o -type f -print && echo "$name/checkpoints/last.ckpt") |
      tar -C "$parent" -cf - -T - | split -b "$PART" -d -a 4 - "$store.tmp/part."
    (cd "$store.tmp" && sha256sum part.* > SHA256SUMS)
    k=0 i=0
    for p in "$store.tmp"/part.*; do
      mkdir -p "$store.tmp/$k" && mv "$p" "$store.tmp/$k/"
      i=$((i + 1)); [ $((i % PER)) -eq 0 ] && k=$((k + 1))
    done
    mv "$store.tmp/SHA256SUMS" "$store.tmp/0/"
    rm -rf "$store" && mv "$store.tmp" "$store"
    echo "relay: $(find "$store" -name 'part.*' | wc -l) parts in $(find "$store" -mindepth 1 -type d | wc -l) folders: send K = 0 .. $(( $(find "$store" -mindepth 1 -type d | wc -l) - 1 ))"
    ;;
  send)
    [ $# -eq 4 ] || usage
    [ -d "$2/$3" ] || { echo "relay: $2/$3 does not exist (pack first)" >&2; exit 1; }
    cp "$2/$3"/* "$4/"
    ;;
  receive)
    [ $# -eq 3 ] || usage
    mkdir -p "$3" && cp "$2"/* "$3/"
    ;;
  unpack)
    [ $# -eq 3 ] || usage
    store=$(realpath "$2")
    [ -f "$store/SHA256SUMS" ] || { echo "relay: $store/SHA256SUMS is missing (folder 0 not received)" >&2; exit 1; }
    (cd "$store" && sha256sum --quiet -c SHA256SUMS) || { echo "relay: a part is missing or damaged" >&2; exit 1; }
    mkdir -p "$3"
    cat $(awk '{print $2}' "$store/SHA256SUMS" | sed "s|^|$store/|") | tar -C "$3" -xf -
    echo "relay: restored into $3"
    ;;
  *) usage ;;
esac
