#!/bin/bash
# One device call for issue 41 (4-bit frozen bases), one H100/H200: the GPU tests of the 4-bit kernels, then the
# 16B fine-tuning memory/speed rows, the load's host memory, and (PEER=1, bitsandbytes importable) the peer. Logs
# under $OUT. ACC_DATA=DIR (a prepared corpus at vocab 32000) adds the 300-step accuracy comparison on `small`.
set -x
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -q -m cuda tests/test_quant4.py 2>&1 | tail -5
timeout 420 python3 benchmarks/finetune_4bit.py --layers ${LAYERS:-27} --ckpt ${CKPT:-full} --steps 5 \
    --out $OUT/finetune_4bit.json > $OUT/finetune_4bit.log 2>&1; grep -vE "^\{" $OUT/finetune_4bit.log | tail -16
timeout 420 python3 benchmarks/load_4bit.py --layers ${LOAD_LAYERS:-8} --device cuda > $OUT/load_4bit.log 2>&1
tail -5 $OUT/load_4bit.log
[ -n "$PEER" ] && timeout 500 python3 benchmarks/finetune_4bit.py --layers 4 --peer --steps 3 \
    --out $OUT/peer.json > $OUT/peer.log 2>&1; [ -n "$PEER" ] && grep -vE "^\{" $OUT/peer.log | tail -12
[ -n "$ACC_DATA" ] && timeout 540 python3 benchmarks/base4_accuracy.py --data $ACC_DATA --out /tmp/base4-acc \
    > $OUT/accuracy.log 2>&1; [ -n "$ACC_DATA" ] && grep -vE "^\[" $OUT/accuracy.log | tail -10
