#!/bin/bash
# Data settings side by side, judged on prompts that no benchmark holds: each variant prepares its own data (a
# variant whose generation settings equal the first one's re-tokenizes the first one's answers, since prepare
# resumes from the results files copied into its directory; others generate anew), captures its store and trains an
# EAGLE-3 draft with the preset's recipe. The trainings run side by side on one GPU, then the evals, also side by
# side: they report tau (acceptance does not depend on the GPU being shared), not speedup.
#
#   W=DIR bash bench/data_ablation.sh
#   env: CONFIG (default full),
#        VARIANTS ("NAME:--set ... --set ...", separated by '|'; default the three data.regen_loops policies keep,
#        mask and drop; e.g. "keep:|t07:--set data.regen_temperature=0.7|cap1k:--set data.regen_max_new_tokens=1024"),
#        SCALE (more --set for every stage; default a quarter of the preset's data: 375 corpus prompts and 6,375
#        own requests), PROMPTS (default bench/prompts/select.jsonl: 20 chat requests and 20 Python functions
#        written for choosing settings), EVX (more eval arguments; default chain-7 and the preset's tree),
#        PY (default python3)
#
# Each variant's held-out figures are in W/train-NAME/metrics.jsonl (val_tau_sim, val_tau_fresh) and its log, its
# eval in W/eval-NAME/, and W/table.md has every eval. Timestamps go to W/times.txt. A rerun in the same W skips
# the finished phases.
CONFIG=${CONFIG:-full}; PY=${PY:-python3}
VARIANTS=${VARIANTS:-keep:--set data.regen_loops=keep|mask:--set data.regen_loops=mask|drop:--set data.regen_loops=drop}
SCALE=${SCALE:---set data.num_prompts=375 --set data.self_prompts=6375}
W=${W:?set W to a work directory}; mkdir -p "$W"; cd "${REPO:-$(dirname "$0")/..}" || exit 1
PROMPTS=${PROMPTS:-$PWD/bench/prompts/select.jsonl}; EVX=${EVX:---set eval.steps=[7]}
t() { echo "$(date +%s) $(date +%T) $*" >> "$W/times.txt"; }
IFS='|' read -ra variants <<< "$VARIANTS"
names=(); sets=()
for v in "${variants[@]}"; do names+=("${v%%:*}"); sets+=("${v#*:}"); done
for i in "${!names[@]}"; do
  name=${names[$i]}; [ -f "$W/.prepared-$name" ] && continue
  if [ "$i" -gt 0 ]; then  # the first variant's results files: reused where the generation settings are the same
    mkdir -p "$W/prep-$name" && cp "$W/prep-${names[0]}"/.eyas.json "$W/prep-${names[0]}"/*.jsonl "$W/prep-$name/" || exit 1
  fi
  $PY -m eyas prepare --config "$CONFIG" $SCALE ${sets[$i]} --out "$W/prep-$name" > "$W/prepare-$name.log" 2>&1 \
    || { t "prepare-$name-FAILED"; exit 1; }
  touch "$W/.prepared-$name"; t "prepared-$name"
done
for i in "${!names[@]}"; do
  name=${names[$i]}; [ -f "$W/.captured-$name" ] && continue
  $PY -m eyas capture --config "$CONFIG" $SCALE ${sets[$i]} --data "$W/prep-$name" --out "$W/store-$name" \
    > "$W/capture-$name.log" 2>&1 || { t "capture-$name-FAILED"; exit 1; }
  touch "$W/.captured-$name"; t "captured-$name"
done
for i in "${!names[@]}"; do
  name=${names[$i]}; [ -f "$W/.trained-$name" ] && continue
  ( $PY -m eyas train --config "$CONFIG" $SCALE ${sets[$i]} --store "$W/store-$name" --out "$W/train-$name" \
      --resume > "$W/train-$name.log" 2>&1; rc=$?; t "trained-$name-rc$rc"; [ $rc = 0 ] && touch "$W/.trained-$name" ) &
done
wait
for name in "${names[@]}"; do
  [ -f "$W/.trained-$name" ] && [ ! -f "$W/.eval-$name" ] || continue
  ( $PY -m eyas eval --config "$CONFIG" --draft "$W/train-$name" --bench "$PROMPTS" --limit 0 --no-hf-baseline \
      $EVX --out-dir "$W/eval-$name" > "$W/eval-$name.log" 2>&1; rc=$?
    t "eval-$name-rc$rc"; [ $rc = 0 ] && touch "$W/.eval-$name" ) &
done
wait
$PY bench/eval_table.py "$W"/eval-*/ | tee "$W/table.md"
t ALL-DONE
