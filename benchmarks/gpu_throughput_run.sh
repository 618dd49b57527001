#!/bin/bash
# One device call for issue 9: GPU correctness of the fused kernels, then the training step before (BASE_SRC) and
# after (this tree), the transformers peer in the same run. Results under $OUT.
set -x
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/new8k $OUT/base8k $OUT/new32k
NEW_SRC=$PWD/src; BASE_SRC=${BASE_SRC:-$PWD/base/src}
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
[ -n "$GPU_TESTS" ] && PYTHONPATH=$NEW_SRC timeout 150 python3 -m pytest -q -m cuda tests/test_fused_*.py 2>&1 | tail -5
DATA=${DATA:-$PWD/data32k}
B="python3 benchmarks/train_step.py --device cuda --flavor small --seqlen 2048 --dtype bf16 --vocab 32000 --data $DATA --skip-eager --steps ${STEPS:-20} --warmup 5"
# the 8k target against a peer whose speed follows the host: the two take turns three times (each round's ratio printed)
PYTHONPATH=$NEW_SRC timeout 360 $B --tokens 8192 --cases hf,trainer --repeat ${REPEAT:-3} --profile $OUT/new8k --json $OUT/new8k.json > $OUT/new8k.log 2>&1; grep -E "^round|^\|" $OUT/new8k.log | tail -8
PYTHONPATH=$BASE_SRC timeout 120 $B --tokens 8192 --cases trainer --profile $OUT/base8k --json $OUT/base8k.json > $OUT/base8k.log 2>&1; tail -8 $OUT/base8k.log
ANYSEEK_NORM=reference PYTHONPATH=$NEW_SRC timeout 100 $B --tokens 8192 --cases trainer --json $OUT/newref.json > $OUT/newref.log 2>&1; tail -5 $OUT/newref.log
PYTHONPATH=$NEW_SRC timeout 200 $B --tokens 32768 --cases hf,trainer --profile $OUT/new32k --json $OUT/new32k.json > $OUT/new32k.log 2>&1; tail -10 $OUT/new32k.log
