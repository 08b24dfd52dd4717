#!/usr/bin/env bash
# One GPU session's batch for issue #27, run from the project root on the lent machine (device tool, with
# `.gpu-wheels` carried; ../shared/gpu/README.md): the issue's bench-speed lines (prefill, then decode
# apart so that a failing decode loses only itself), the CUDA tests, and a
# 1M-token stream. Each step has its own time limit and writes into $OUT, so a slow step loses only itself.
#   bash docs/results/gpu_batch.sh [bench] [bench2048] [decode] [tests] [stream] [profile] [blockprofile] [documents]
#   (default: bench decode tests stream, in order)
#   bash docs/results/gpu_batch.sh setup                      (only the install, before commands of your own)
# `documents` (issue #56: a folder scored one at a time and with --batch auto) needs the default model's tokenizer
# carried as .gpu-tokenizer/: mkdir .gpu-tokenizer && cp ~/.cache/kvcli/models/SmolLM2-*-float32-*/{tokenizer*,chat*} .gpu-tokenizer/
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --find-links .gpu-wheels --target /tmp/site \
    transformers regex gguf accelerate 2>&1 | tail -2
# The tests step needs pytest, which ../shared/gpu/wheels.sh does not fetch: on a machine with network,
# `pip download --no-deps -d .gpu-wheels pytest pluggy iniconfig` (unless the card's Python has it already).
python3 -m pytest --version >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps \
    --find-links .gpu-wheels --target /tmp/site pytest pluggy iniconfig 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
steps=${*:-bench decode tests stream}
for step in $steps; do
  started=$(date +%s)
  case $step in
    setup)  ;;
    bench)  timeout 180 python3 -m kvcli bench-speed --shape llama-3.1-8b \
              --methods streamingllm,treekv,snapkv,pyramidkv,h2o,tova,pyramidinfer --json >"$OUT/speed-8b.json" ;;
    bench2048) timeout 150 python3 -m kvcli bench-speed --shape llama-3.1-8b --block 2048 --tokens 32768 \
              --methods streamingllm,treekv,snapkv,pyramidkv,h2o,tova,pyramidinfer --json >"$OUT/speed-8b-block2048.json" ;;
    blockprofile) timeout 120 python3 docs/results/profile_gpu_block.py llama-3.1-8b streamingllm h2o treekv pyramidkv \
              >"$OUT/block-profile.txt" 2>&1 ;;
    decode) timeout 150 python3 -m kvcli bench-speed --shape llama-3.1-8b \
              --methods streamingllm,treekv,snapkv,pyramidkv,h2o,tova,pyramidinfer --tokens 8192 --decode 64 --json \
              >"$OUT/decode-8b.json" ;;
    profile) timeout 120 python3 docs/results/decode_profile.py llama-3.1-8b streamingllm,snapkv,treekv,h2o 64 \
              >"$OUT/decode-profile.jsonl" 2>"$OUT/decode-profile.txt"
            timeout 120 python3 docs/results/profile_gpu_block.py llama-3.1-8b h2o snapkv treekv \
              >"$OUT/block-profile.txt" 2>&1 ;;
    tests)  timeout 100 python3 -m pytest -q -p no:cacheprovider -rs \
              tests/test_decode.py tests/test_attention.py tests/test_overhead.py >"$OUT/tests.txt" 2>&1
            tail -5 "$OUT/tests.txt" ;;
    stream) timeout 150 python3 -m kvcli bench-speed --shape llama-3.1-8b --methods treekv \
              --tokens 1048576 --json >"$OUT/stream-1m-8b.json" ;;
    documents) timeout 400 python3 docs/results/documents_batch.py .gpu-tokenizer --documents 300 --batches 1,auto \
              >"$OUT/documents.jsonl" 2>"$OUT/documents.txt"; cat "$OUT/documents.jsonl" ;;
    *)      echo "unknown step $step (bench, bench2048, decode, tests, stream, profile, blockprofile, documents or setup)" >&2
            exit 2 ;;
  esac
  echo "== $step: rc $? in $(( $(date +%s) - started )) s"
done
