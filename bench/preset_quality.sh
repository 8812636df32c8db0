#!/bin/bash
# The full preset's draft on the whole benchmarks, and a DFlash draft from the same store beside it, on one GPU:
# prepare and capture once, train the families asked for side by side (same store, same epochs, same GPU), then
# evaluate in the order given, one process per entry, each writing one JSON per setting as it finishes (an eval
# cut short keeps its finished requests in a journal, and a rerun decodes only the rest). Ends with the table of
# every result (bench/eval_table.py). A rerun in the same W skips the finished phases.
#
#   W=DIR bash bench/preset_quality.sh
#   env: CONFIG (default full), FAMILIES (default "eagle3 dflash"; each trains into W/<family>),
#        DSET (more --set for the DFlash training; default "--set dflash.layers=5", the released drafts' depth),
#        XSET (more --set for every stage), PY (default python3),
#        EVALS (what to evaluate, in order, "FAMILY:BENCH:EXTRA ARGS" separated by '|'; EXTRA ARGS may add a
#        --bench, which the same process evaluates next with the same loaded target and draft; default: EAGLE-3 on
#        MT-bench then HumanEval with the preset's chains and tree, then DFlash on both with chains 3, 7 and its
#        block, then EAGLE-3 on both in fp32: no turn may differ from plain decoding there; FAMILY may join
#        families with '+', e.g. "eagle3+dflash", to evaluate their drafts in one process against one plain
#        decoding baseline, each into its own subdirectory), EVX (extra arguments for every eval, e.g.
#        "--max-new-tokens 128"); entry i writes its results to W/eval-i-FAMILY-BENCH
#
# Each trained draft is also exported for vLLM in bf16 to W/export-<family> (eval reads it with --draft there).
# Timestamps of each phase go to W/times.txt, each command's output to W/<phase>.log. Evals run one at a time on a
# quiet GPU, so their speedups stand; the trainings share it, so their rates do not (rerun one alone for that).
CONFIG=${CONFIG:-full}; FAMILIES=${FAMILIES:-eagle3 dflash}; DSET=${DSET:---set dflash.layers=5}; PY=${PY:-python3}
EVALS=${EVALS:-eagle3:mt-bench:--bench humaneval|dflash:mt-bench:--bench humaneval --set eval.steps=[3,7]|eagle3:humaneval:--set target.dtype=fp32 --bench mt-bench}
W=${W:?set W to a work directory}; mkdir -p "$W"; cd "${REPO:-$(dirname "$0")/..}" || exit 1
t() { echo "$(date +%s) $(date +%T) $*" >> "$W/times.txt"; }
t start "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
[ -f "$W/.prepared" ] || { $PY -m eyas prepare --config "$CONFIG" ${XSET:-} --out "$W/prep" > "$W/prepare.log" 2>&1 \
  || { t prepare-FAILED; exit 1; }; touch "$W/.prepared"; }
t prepared
[ -f "$W/.captured" ] || { $PY -m eyas capture --config "$CONFIG" ${XSET:-} --data "$W/prep" --out "$W/store" \
  > "$W/capture.log" 2>&1 || { t capture-FAILED; exit 1; }; touch "$W/.captured"; }
t captured
for family in $FAMILIES; do
  [ -f "$W/.trained-$family" ] && continue
  extra=""; [ "$family" = dflash ] && extra="--set train.method=dflash $DSET"
  ( $PY -m eyas train --config "$CONFIG" ${XSET:-} $extra --store "$W/store" --out "$W/$family" --resume \
      > "$W/train-$family.log" 2>&1; rc=$?; t "trained-$family-rc$rc"
    # the draft in bf16 as vLLM loads it: small enough to take elsewhere, and `eyas eval --draft` reads it
    if [ $rc = 0 ]; then $PY -m eyas export "$W/$family" --to vllm --dtype bf16 --out "$W/export-$family" \
      > "$W/export-$family.log" 2>&1 && touch "$W/.trained-$family" || t "export-$family-FAILED"; fi ) &
done
wait
IFS='|' read -ra evals <<< "$EVALS"
for i in "${!evals[@]}"; do
  IFS=':' read -r family bench args <<< "${evals[$i]}"
  drafts=""; missing=""
  for f in ${family//+/ }; do drafts="$drafts --draft $W/$f"; [ -f "$W/.trained-$f" ] || missing="$missing-$f"; done
  [ -z "$missing" ] || { t "eval-$i-skipped-no$missing-draft"; continue; }
  [ -f "$W/.eval-$i" ] && continue
  name="eval-$i-${family//+/-}-$bench"
  $PY -m eyas eval --config "$CONFIG" ${XSET:-} $drafts --bench "$bench" --limit 0 --no-hf-baseline \
    $args ${EVX:-} --out-dir "$W/$name" > "$W/$name.log" 2>&1; rc=$?
  t "$name-rc$rc"; [ $rc = 0 ] && touch "$W/.eval-$i"
done
$PY bench/eval_table.py "$W"/eval-*/ | tee "$W/table.md"
t ALL-DONE
