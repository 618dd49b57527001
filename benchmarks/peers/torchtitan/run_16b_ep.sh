#!/usr/bin/env bash
# torchtitan 0.3.0 training anyseek's 16B (or a cut of it) with expert parallelism on NGPU GPUs of one host,
# timed the way `benchmarks/scale.py --config 16B --set "--parallel.ep=EP"` times anyseek. Run from the repo root
# after copying the shared peer folder into the checkout (it holds the wheels, the shims and the tokenizer):
#
#     cp -r ../shared/peers/torchtitan .peers/            # here, before the device call; carry ".peers"
#     bash benchmarks/peers/torchtitan/run_16b_ep.sh NGPU EP [LAYERS] [VARIANT ...]
#
#     bash benchmarks/peers/torchtitan/run_16b_ep.sh 4 4                    # whole 16B (27 layers), eager + compile
#     bash benchmarks/peers/torchtitan/run_16b_ep.sh 2 2 6 eager compile    # a 6-layer cut on 2 GPUs
#
# VARIANT = BASE[-acsel|-acfull]; default: eager compile
#     eager     nothing compiled but FlexAttention (torchtitan always compiles it)
#     compile   --compile.enable, components model + loss (each TransformerBlock compiled with fullgraph=True)
#     closs     --compile.enable, loss only (torchtitan's own 16B recipe)
#     -acsel    torchtitan's SelectiveAC (its 16B recipe's default), -acfull: FullAC; default: no recomputation
# Every run: FSDP2 over all NGPU ranks (bf16 params, fp32 master weights, fp32 reduce), routed experts over EP
# ranks (torchtitan's "standard" all-to-all dispatcher; its CUDA-graphed step is off, as torchtitan requires for
# this dispatcher), fused AdamW, 4 x 2048 random tokens per rank (8,192), no checkpoints.
# Knobs (env):
#     TT_STEPS=30 TT_FIRST=10 TT_LAST=30   steps, median window (inclusive)
#     TT_BATCH=4 TT_SEQ=2048               tokens per rank = TT_BATCH x TT_SEQ
#     TT_VOCAB=32000                       the data's vocabulary in anyseek's run (data32k); 163840 = Moonlight's
#     TT_VARIANT_TIMEOUT=300               seconds per variant (hard cap); TT_TOTAL_BUDGET=560 for the whole script
#     TT_FLEX_AUTOTUNE=1                   torchtitan's default (FlexAttention compiled with max_autotune); 0 starts faster
#     TT_LOSS=chunked                      torchtitan's ChunkedLossWrapper; plain = one CE over all logits
#     TT_EXTRA_ARGS="..."                  more torchtitan CLI overrides for every run
#     TT_PEER_DIR=.peers/torchtitan        the copied shared peer folder
#     PYTHON=python3                       the interpreter (the one with torch)
# Output: the markdown table on stdout; logs, summary.md and summary.json in $OUT (if set) else a temporary folder.
set -u
T0=$(date +%s)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(pwd)"
usage() { echo "usage: $0 NGPU EP [LAYERS] [eager|compile|closs[-acsel|-acfull] ...]"; exit 2; }
[[ $# -ge 2 && $1 =~ ^[0-9]+$ && $2 =~ ^[0-9]+$ ]] || usage
NGPU=$1; EP=$2; shift 2
LAYERS=27
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then LAYERS=$1; shift; fi
VARIANTS=("$@"); [[ ${#VARIANTS[@]} -eq 0 ]] && VARIANTS=(eager compile)
(( NGPU >= 1 && EP >= 1 && NGPU % EP == 0 )) || { echo "ERROR: EP ($EP) must divide NGPU ($NGPU)"; exit 2; }
(( 64 % EP == 0 )) || { echo "ERROR: EP ($EP) must divide the 64 routed experts"; exit 2; }
for v in "${VARIANTS[@]}"; do
  [[ $v =~ ^(eager|compile|closs)(-acsel|-acfull)?$ ]] || { echo "ERROR: unknown variant $v"; usage; }
done
PEER="${TT_PEER_DIR:-$ROOT/.peers/torchtitan}"
if [[ ! -f $PEER/launch.py || ! -d $PEER/wheels ]]; then
  echo "ERROR: no torchtitan peer folder at $PEER: run 'cp -r ../shared/peers/torchtitan .peers/' and carry .peers"
  exit 2
fi
export TT_PEER_DIR="$(cd "$PEER" && pwd)"
WORK=$(mktemp -d -t tt16b.XXXXXX)
OUTDIR="${OUT:-$WORK/out}"
mkdir -p "$WORK/logs" "$OUTDIR"
STEPS="${TT_STEPS:-30}"; FIRST="${TT_FIRST:-10}"; LAST="${TT_LAST:-30}"
BATCH="${TT_BATCH:-4}"; SEQ="${TT_SEQ:-2048}"
VAR_TIMEOUT="${TT_VARIANT_TIMEOUT:-300}"; BUDGET="${TT_TOTAL_BUDGET:-560}"
export TT_LAYERS="$LAYERS" TT_VOCAB="${TT_VOCAB:-32000}"
export TT_FLEX_AUTOTUNE="${TT_FLEX_AUTOTUNE:-1}" TT_LOSS="${TT_LOSS:-chunked}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY="${PYTHON:-python3}"
elapsed() { echo $(( $(date +%s) - T0 )); }

# ---- 1. wheels -> $WORK/site (torchtitan and its pure-Python dependencies; torch is the machine's) -------------
WHEELS=(torchtitan-0.3.0 torchdata-0.11.0 torch_checkpointing-0.1.1 spmd_types-0.2.3 tyro-1.0.17
        docstring_parser-0.18.0 typeguard-4.6.0 datasets-4.7.0 dill-0.4.0)
files=()
for w in "${WHEELS[@]}"; do
  f=$(ls "$TT_PEER_DIR"/wheels/"$w"-*.whl 2>/dev/null | head -1)
  [[ -n $f ]] || { echo "ERROR: wheel $w-*.whl not in $TT_PEER_DIR/wheels"; exit 2; }
  files+=("$f")
done
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site" "${files[@]}" 2>&1 \
  | grep -v -i "already exists\|WARNING: Target directory" || true
# multiprocess (for HF datasets, which the synthetic data never uses) is a cp312 wheel: where it does not install,
# launch.py puts an empty stand-in for datasets and logs it
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site" \
  "$TT_PEER_DIR"/wheels/multiprocess-*.whl > /dev/null 2>&1 || echo "note: multiprocess wheel not installed here"
export PYTHONPATH="$WORK/site:$TT_PEER_DIR:$HERE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, importlib.metadata as md; print('torch', torch.__version__, '| torchtitan',
md.version('torchtitan'), '| gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if
torch.cuda.is_available() else 'NO GPU')" || { echo "ERROR: torch/torchtitan not importable"; exit 2; }
GPUS_SEEN=$("$PY" -c "import torch; print(torch.cuda.device_count())")
(( GPUS_SEEN >= NGPU )) || echo "WARNING: $NGPU ranks asked, $GPUS_SEEN GPUs visible"

# ---- 2. pre-flight: the command line parses and torchtitan's model is anyseek's 16B (meta device) ---------------
CHECK="$OUTDIR/check.json"
"$PY" "$HERE/check_16b.py" --ep "$EP" --layers "$LAYERS" --vocab "$TT_VOCAB" --seqlen "$SEQ" --json "$CHECK" \
  > "$WORK/check.log" 2>&1
rc=$?
grep -v "initial_load_model_only" "$WORK/check.log" | tail -n 16
if [[ $rc -ne 0 ]]; then echo "ERROR: pre-flight failed (rc=$rc), see above"; exit 1; fi
echo "setup done at $(elapsed)s: $NGPU ranks, EP $EP, $LAYERS layers, vocab $TT_VOCAB, $BATCH x $SEQ tokens per" \
     "rank, $STEPS steps (median over $FIRST-$LAST), budget ${BUDGET}s, per variant ${VAR_TIMEOUT}s"

# ---- 3. variants ---------------------------------------------------------------------------------------------
MANIFEST="$WORK/manifest.tsv"; : > "$MANIFEST"
COMBINED="$OUTDIR/variants.log"; : > "$COMBINED"
for v in "${VARIANTS[@]}"; do
  base=${v%%-*}; ac=none
  [[ $v == *-acsel ]] && ac=selective
  [[ $v == *-acfull ]] && ac=full
  log="$WORK/logs/$v.log"
  left=$(( BUDGET - $(elapsed) - 20 )); t=$VAR_TIMEOUT; (( left < t )) && t=$left
  if (( t < 60 )); then
    echo "== $v: SKIPPED (${left}s of the budget left)"
    printf '%s\t%d\t%s\t%s\t%d\t%d\t%s\n' "$v" $((BATCH * SEQ)) "$base" "$ac" 125 0 "$log" >> "$MANIFEST"
    continue
  fi
  args=(--module tt_dsv3_16b --config deepseek_v3_16b_ep --parallelism.expert_parallel_degree "$EP"
        --training.local_batch_size "$BATCH" --training.seq_len "$SEQ" --training.steps "$STEPS"
        --metrics.log_freq 1 --metrics.disable_color_printing)
  case $base in
    compile) args+=(--compile.enable) ;;
    closs) args+=(--compile.enable --compile.components loss) ;;
  esac
  # shellcheck disable=SC2206
  [[ -n "${TT_EXTRA_ARGS:-}" ]] && args+=(${TT_EXTRA_ARGS})
  echo "== $v: compile=$base AC=$ac, timeout ${t}s (t=$(elapsed)s)"
  s0=$(date +%s)
  TT_AC=$ac TT_DUMP_FOLDER="$WORK/dump/$v" timeout -k 15 "$t" \
    "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" "$HERE/launch_16b.py" "${args[@]}" \
    > "$log" 2>&1
  rc=$?
  wall=$(( $(date +%s) - s0 ))
  printf '%s\t%d\t%s\t%s\t%d\t%d\t%s\n' "$v" $((BATCH * SEQ)) "$base" "$ac" "$rc" "$wall" "$log" >> "$MANIFEST"
  { echo "######## $v rc=$rc wall=${wall}s args: ${args[*]}"; cat "$log"; echo; } >> "$COMBINED"
  grep -E "\[launch\] shim|step: *(1|2|5|10|20|30) " "$log" \
    | sed -E 's/^(\[rank0\]:)?\[titan\] [0-9-]+ ([0-9:]+),[0-9]+ - root - INFO - /  \2 /' | cut -c1-160
  if [[ $rc -ne 0 ]]; then
    echo "   -> rc=$rc after ${wall}s; root cause / last lines:"
    { grep -E "^\[rank[0-9]+\]: *[A-Za-z_.]*(Error|Exception|Unsupported)|OutOfMemory|out of memory" "$log" \
        | sort -u | tail -n 3
      grep -v -i "warn" "$log" | tail -n 4; } | cut -c1-260 | sed 's/^/   | /'
  fi
done

# ---- 4. table ------------------------------------------------------------------------------------------------
echo
echo "==================== torchtitan 0.3.0 / anyseek 16B / $NGPU GPUs, EP $EP (total $(elapsed)s) ===================="
"$PY" "$HERE/summarize_16b.py" "$MANIFEST" --check "$CHECK" --ranks "$NGPU" --ep "$EP" --first "$FIRST" \
  --last "$LAST" --json "$OUTDIR/summary.json" | tee "$OUTDIR/summary.md"
echo "(logs: $COMBINED)"
