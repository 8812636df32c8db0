#!/bin/bash
# SpecForge's trainer beside eyas's on one store, then whole-benchmark evals: both drafts in bf16 (tree 16,6,80)
# and the eyas draft in fp32 (every turn must equal plain decoding). One GPU; the trainers and the evals run two
# or three at a time, so their tau figures stand and their times and speedups do not (rerun eval alone for those).
#
#   bash bench/peer_pipeline.sh [CONFIG=full] [SELF_PROMPTS=6000] [EPOCHS=2] [LIMIT=0]
#   env: W (work dir, default ~/peer-work), SF (folder holding specforge and its missing dependencies,
#        bench/peer_specforge.py --specforge-path), PY (python, default python3), EVX (extra eval arguments),
#        FP32_CHAIN (the fp32 eval's chain, default --steps 3; set it empty for the tree alone),
#        FP32=0 (no fp32 eval: where the target already runs in fp32, as on the CPU), EVAL=0 (no benchmark evals
#        at all: the held-out scores alone),
#        XSET (more --set KEY=VALUE for every stage and both trainers, e.g. "--set train.val_samples=40"),
#        ABLATE (more eyas trainings on the same store, one after another once the first is trained, each
#        "NAME:--set KEY=VALUE ..." and separated by '|'; their own last held-out scoring is in W/abl-NAME.log)
#
# Both trainers get the same objective (the SpecForge-fixed knobs set on the eyas side) and the same samples (eyas's
# held-out ones stay out of both); both drafts are then scored on those held-out samples by eyas. Timestamps of
# each phase go to W/times.txt, each command's output to W/<phase>.log.
CONFIG=${1:-full}; SELF=${2:-6000}; EPOCHS=${3:-2}; LIMIT=${4:-0}; SF=${SF:?set SF to the folder holding specforge and its missing dependencies}
W=${W:-$HOME/peer-work}; mkdir -p $W; cd "${REPO:-$(dirname "$0")/..}"
PY=${PY:-python3}
t() { echo "$(date +%s) $(date +%T) $*" >> $W/times.txt; }
MATCH="--set train.min_lr_ratio=0 --set train.loss_mask_token=position --set train.loss_norm=all --set train.mask_oov_target=true --set train.epochs=$EPOCHS ${XSET:-}"
EV="--config $CONFIG --bench mt-bench --bench humaneval --limit $LIMIT --no-hf-baseline ${XSET:-} ${EVX:-}"
t start
# a rerun in the same W keeps a finished prepare and capture
[ -f $W/.prepared ] || { $PY -m eyas prepare --config $CONFIG --set data.self_prompts=$SELF ${XSET:-} --out $W/prep > $W/prepare.log 2>&1 || { t prepare-FAILED; exit 1; }; touch $W/.prepared; }
t prepared
[ -f $W/.captured ] || { $PY -m eyas capture --config $CONFIG ${XSET:-} --data $W/prep --out $W/store > $W/capture.log 2>&1 || { t capture-FAILED; exit 1; }; touch $W/.captured; }
t captured
$PY bench/peer_specforge.py --store $W/store --out $W/peer --config $CONFIG $MATCH --specforge-path $SF --stage convert > $W/convert.log 2>&1 || { t convert-FAILED; exit 1; }
t converted
STEPS=$($PY -c "import json;print(json.load(open('$W/peer/peer.json'))['plan']['steps'])")
t steps=$STEPS
( $PY -m eyas train --config $CONFIG $MATCH --store $W/store --out $W/eyas-run --steps $STEPS > $W/eyas-train.log 2>&1; t eyas-trained-rc$?
  touch $W/.eyas-trained
  [ "${EVAL:-1}" = 0 ] || $PY -m eyas eval $EV --draft $W/eyas-run --tree 16,6,80 --out-dir $W/eval-eyas > $W/eval-eyas.log 2>&1; t eval-eyas-rc$? ) &
[ "${FP32:-1}" = 0 ] || [ "${EVAL:-1}" = 0 ] || ( while [ ! -f $W/.eyas-trained ]; do sleep 5; done  # fp32: plain decoding is the reference, every turn must equal it
  $PY -m eyas eval $EV --draft $W/eyas-run ${FP32_CHAIN---steps 3} --tree 16,6,80 --set target.dtype=fp32 --out-dir $W/eval-eyas-fp32 \
    > $W/eval-eyas-fp32.log 2>&1; t eval-eyas-fp32-rc$? ) &
( $PY bench/peer_specforge.py --store $W/store --out $W/peer --config $CONFIG $MATCH --specforge-path $SF --stage train > $W/sf-train.log 2>&1; rc=$?; t sf-trained-rc$rc
  if [ $rc != 0 ] && grep -q flex_attention $W/peer/specforge.yaml; then  # once more with SDPA attention
    sed -i 's/flex_attention/sdpa/' $W/peer/specforge.yaml
    $PY bench/peer_specforge.py --store $W/store --out $W/peer --config $CONFIG $MATCH --specforge-path $SF --stage train > $W/sf-train-sdpa.log 2>&1; t sf-trained-sdpa-rc$?
  fi
  $PY bench/peer_specforge.py --store $W/store --out $W/peer --config $CONFIG $MATCH --specforge-path $SF --stage export > $W/sf-export.log 2>&1; t sf-exported-rc$?
  touch $W/.sf-exported
  [ "${EVAL:-1}" = 0 ] || $PY -m eyas eval $EV --draft $W/peer/draft --tree 16,6,80 --out-dir $W/eval-sf > $W/eval-sf.log 2>&1; t eval-sf-rc$? ) &
( while [ ! -f $W/.eyas-trained ] || [ ! -f $W/.sf-exported ]; do sleep 5; done
  # both drafts scored on eyas's held-out samples by one command: a training step at lr 1e-12 reports them
  for d in eyas:$W/eyas-run sf:$W/peer/draft; do
    $PY -m eyas train --config $CONFIG $MATCH --store $W/store --out $W/score-${d%%:*} --set train.init_from=${d#*:} \
      --steps 1 --set train.lr=1e-12 --set train.warmup_steps=0 --set train.val_every=1 --set train.compile=false \
      --set train.compile_loss=false > $W/score-${d%%:*}.log 2>&1; t scored-${d%%:*}-rc$?
  done ) &
( [ -n "${ABLATE:-}" ] || exit 0
  while [ ! -f $W/.eyas-trained ]; do sleep 5; done
  IFS='|' read -ra runs <<< "$ABLATE"
  for r in "${runs[@]}"; do
    name=${r%%:*}
    $PY -m eyas train --config $CONFIG $MATCH ${r#*:} --store $W/store --out $W/abl-$name --steps $STEPS \
      > $W/abl-$name.log 2>&1; t abl-$name-rc$?
  done ) &
wait
t ALL-DONE
