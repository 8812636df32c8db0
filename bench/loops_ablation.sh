#!/bin/bash
# What to do with regenerated answers that end in a repetition loop (data.regen_loops: keep, mask, drop), judged
# on prompts that no benchmark holds: the target regenerates once, each policy re-tokenizes those same answers
# (prepare resumes from the results files, so no answer is generated twice), and each policy's store trains an
# EAGLE-3 draft with the preset's recipe. The trainings run side by side on one GPU, then the evals, also side by
# side: they report tau (acceptance does not depend on the GPU being shared), not speedup.
#
#   W=DIR bash bench/loops_ablation.sh
#   env: CONFIG (default full), POLICIES (default "keep mask drop"), SCALE (more --set for every stage; default a
#        quarter of the preset's data: 375 corpus prompts and 6,375 own requests), PROMPTS (default
#        bench/prompts/select.jsonl: 20 chat requests and 20 Python functions written for choosing settings),
#        EVX (more eval arguments; default chain-7 and the preset's tree), PY (default python3)
#
# Each policy's held-out figures are in W/train-POLICY/metrics.jsonl (val_tau_sim, val_tau_fresh), its eval in
# W/eval-POLICY/. Timestamps go to W/times.txt. A rerun in the same W skips the finished phases.
CONFIG=${CONFIG:-full}; POLICIES=${POLICIES:-keep mask drop}; PY=${PY:-python3}
SCALE=${SCALE:---set data.num_prompts=375 --set data.self_prompts=6375}
W=${W:?set W to a work directory}; mkdir -p "$W"; cd "${REPO:-$(dirname "$0")/..}" || exit 1
PROMPTS=${PROMPTS:-$PWD/bench/prompts/select.jsonl}; EVX=${EVX:---set eval.steps=[7]}
t() { echo "$(date +%s) $(date +%T) $*" >> "$W/times.txt"; }
set -- $POLICIES; first=$1
for policy in $POLICIES; do
  [ -f "$W/.prepared-$policy" ] && continue
  if [ "$policy" != "$first" ]; then  # the first policy's answers, re-tokenized: only the results files are copied
    mkdir -p "$W/prep-$policy" && cp "$W/prep-$first"/.eyas.json "$W/prep-$first"/*.jsonl "$W/prep-$policy/" || exit 1
  fi
  $PY -m eyas prepare --config "$CONFIG" $SCALE --set data.regen_loops="$policy" --out "$W/prep-$policy" \
    > "$W/prepare-$policy.log" 2>&1 || { t "prepare-$policy-FAILED"; exit 1; }
  touch "$W/.prepared-$policy"; t "prepared-$policy"
done
for policy in $POLICIES; do
  [ -f "$W/.captured-$policy" ] && continue
  $PY -m eyas capture --config "$CONFIG" $SCALE --data "$W/prep-$policy" --out "$W/store-$policy" \
    > "$W/capture-$policy.log" 2>&1 || { t "capture-$policy-FAILED"; exit 1; }
  touch "$W/.captured-$policy"; t "captured-$policy"
done
for policy in $POLICIES; do
  [ -f "$W/.trained-$policy" ] && continue
  ( $PY -m eyas train --config "$CONFIG" $SCALE --store "$W/store-$policy" --out "$W/train-$policy" --resume \
      > "$W/train-$policy.log" 2>&1; rc=$?; t "trained-$policy-rc$rc"; [ $rc = 0 ] && touch "$W/.trained-$policy" ) &
done
wait
for policy in $POLICIES; do
  [ -f "$W/.trained-$policy" ] && [ ! -f "$W/.eval-$policy" ] || continue
  ( $PY -m eyas eval --config "$CONFIG" --draft "$W/train-$policy" --bench "$PROMPTS" --limit 0 --no-hf-baseline \
      $EVX --out-dir "$W/eval-$policy" > "$W/eval-$policy.log" 2>&1; rc=$?
    t "eval-$policy-rc$rc"; [ $rc = 0 ] && touch "$W/.eval-$policy" ) &
done
wait
$PY bench/eval_table.py "$W"/eval-*/ | tee "$W/table.md"
t ALL-DONE
