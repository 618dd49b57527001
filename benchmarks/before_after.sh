#!/bin/bash
# The training step of another commit (BASE_DIR: a copy of its src/ and benchmarks/, e.g. made with
# `git archive OLD src benchmarks | tar -x -C base`) against this tree's, taking turns in one process each, on one
# GPU: a refactor that must not change the step time (issue 37) is timed this way. Tables and logs under $OUT.
#   OUT=/tmp/out DATA=data32k ROUNDS=2 CASES=trainer,trainer-lora bash benchmarks/before_after.sh
# DATA: a folder `anyseek prepare --source wiki-sample --vocab-size 32000` wrote (the results page's data).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; BASE_DIR=${BASE_DIR:-$PWD/base}; mkdir -p $OUT
A="--device cuda --flavor small --seqlen 2048 --dtype bf16 --vocab 32000 --data ${DATA:-$PWD/data32k} --skip-eager
   --steps 20 --warmup 8 --tokens ${TOKENS:-8192} --cases ${CASES:-trainer,trainer-lora}"
for r in $(seq ${ROUNDS:-2}); do
  for v in base new; do
    if [ $v = base ]; then SRC=$BASE_DIR/src; S=$BASE_DIR/benchmarks/train_step.py; else SRC=$PWD/src; S=benchmarks/train_step.py; fi
    PYTHONPATH=$SRC timeout ${T:-150} python3 $S $A --json $OUT/$v$r.json > $OUT/$v$r.log 2>&1
    echo "== $v round $r (rc $?)"; grep -E "^\|" $OUT/$v$r.log | tail -4
  done
done
