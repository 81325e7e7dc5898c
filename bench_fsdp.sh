#!/usr/bin/env bash
# torchrun + FSDP2 on GPUs (issue 10), from the repo root of a box with >= 2 GPUs (kind nvidia-h200-x2):
#   bash bench_fsdp.sh 7b [--key=value ...]         # random-weight Qwen2.5-7B-shaped model (no hub), 4 steps on
#                                                   # NPROC (2) GPUs: seconds per step (gen, update), GiB per GPU
#   NPROC=4 bash bench_fsdp.sh 14b | 32b            # ...Qwen2.5-14B / 32B-shaped (4 / 8 H200s)
#   bash bench_fsdp.sh smollm2 1 [--key=value ...]  # the default config (SmolLM2-135M), 100 steps, 1 GPU
#   bash bench_fsdp.sh smollm2 2 [--key=value ...]  # ...and on 2 GPUs at the same global batch: torchrun
#   bash bench_fsdp.sh summary                      # the smollm2 runs side by side (gen/update s per step, held-out)
# Each prints the per-step numbers from its log.jsonl (gen_s, update_s, peak_gib = rank 0's max_memory_allocated)
# and, per GPU, the most memory nvidia-smi saw in use (allocator cache and NCCL buffers included).
# 7b/14b/32b skip the final checkpoint (7b: ~90 GB of files: float32 weights + AdamW shards); BENCH_SAVE=1 keeps it.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
NPROC=${NPROC:-2}
TORCHRUN="$PY -m torch.distributed.run --standalone"
what=${1:-7b}
shift || true

smi_start() {  # nvidia-smi samples every 0.5 s into $1, in the background (its pid in SMI)
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$1" &
    SMI=$!
}
smi_stop() {  # stop our sampler (by its pid) and print the most memory each GPU had in use
    kill "$SMI" 2>/dev/null || true
    wait "$SMI" 2>/dev/null || true
    $PY - "$1" <<'EOF'
import sys
peak = {}
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak[parts[0]] = max(peak.get(parts[0], 0), int(parts[1]))
print("nvidia-smi peak memory.used per GPU: " + ", ".join(f"GPU{i} {m / 1024:.1f} GiB" for i, m in sorted(peak.items())))
EOF
}
steps() {  # per-step numbers of a run's log.jsonl
    $PY - "$1" <<'EOF'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
tr = [r for r in recs if "gen_s" in r]
for r in tr:
    print(f"step {r['step']}: gen {r['gen_s']:.2f}s update {r['update_s']:.2f}s tok/s {r['tokens_per_s']:.0f} "
          f"peak {r['peak_gib']:.1f} GiB (rank 0) len {r['completion_len_mean']:.0f} loss {r['loss']:.4f}")
late = tr[2:] or tr[1:] or tr  # step 1 compiles (Triton, CUDA graphs)
print(f"mean over steps {late[0]['step']}..{late[-1]['step']}: gen {statistics.fmean(r['gen_s'] for r in late):.2f}s "
      f"update {statistics.fmean(r['update_s'] for r in late):.2f}s "
      f"step {statistics.fmean(r['gen_s'] + r['update_s'] for r in late):.2f}s")
print("held-out greedy accuracy by step:", [(r["step"], r["eval_accuracy"]) for r in recs if "eval_accuracy" in r])
EOF
}

case "$what" in
7b|14b|32b)
    D=/tmp/nanogrpo_q$what
    $PY bench_e2e.py --model qwen2.5-$what "$D"  # built on GPU 0 in bf16, saved once (7b: ~15 GB); character tokenizer
    OUT=/tmp/nanogrpo_out$what
    # 7b/14b: 16384-token micro-batches; 32b (8 GPUs): auto (0), what fits beside the 122 GiB a rank that its state
    # and gathered bf16 weights take (~9k tokens on an H200)
    MBT=16384; [ "$what" = 32b ] && MBT=0
    smi_start /tmp/nanogrpo_smi$what.csv
    t0=$(date +%s)
    $TORCHRUN --nproc_per_node="$NPROC" bench_e2e.py --run-cell --fsdp=True --model="$D" --prompts_per_step=16 \
        --group_size=8 --max_completion_len=512 --temperature=1.0 --reward=task,bench_e2e.py:digit_share \
        --gradient_checkpointing=True --micro_batch_tokens=$MBT \
        --eval_every=0 --eval_size=4 --max_steps=4 --max_minutes=0 --lr=1e-6 --out_dir="$OUT" --overwrite=True "$@"
    echo "wall $(( $(date +%s) - t0 )) s (incl. loading)"
    smi_stop /tmp/nanogrpo_smi$what.csv
    steps "$OUT/log.jsonl"
    ;;
smollm2)
    n=${1:-1}
    shift || true
    OUT=/tmp/nanogrpo_out_smollm2_${n}gpu
    FIXED="--max_steps=100 --max_minutes=0 --group_size=8"  # 100 steps (not the default's 5 minutes) of 32 x 8, as README's rows: 1 and N GPUs do equal work
    smi_start "/tmp/nanogrpo_smi_smollm2_${n}.csv"
    if [ "$n" = 1 ]; then
        $PY grpo.py $FIXED --out_dir="$OUT" --overwrite=True "$@"
    else
        $TORCHRUN --nproc_per_node="$n" grpo.py --fsdp=True $FIXED --out_dir="$OUT" --overwrite=True "$@"
    fi
    smi_stop "/tmp/nanogrpo_smi_smollm2_${n}.csv"
    steps "$OUT/log.jsonl"
    ;;
summary)
    for f in /tmp/nanogrpo_out_smollm2_*gpu/log.jsonl; do echo "== $f"; steps "$f"; done
    ;;
*)
    echo "usage: bash bench_fsdp.sh 7b|14b|32b|smollm2 N|summary [--key=value ...]" >&2
    exit 2
    ;;
esac
