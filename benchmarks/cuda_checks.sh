#!/usr/bin/env bash
# The CUDA checks a session runs when it is lent a GPU (docs/cuda.md): the CUDA tests (tests/test_cuda.py and the
# cuda cases of the tests parametrized over devices), then the quantization benchmark, `llmrt bench quality` and `llmrt bench throughput` on the card.
# Usage: OUT=dir bash benchmarks/cuda_checks.sh [tests|bench|micro|all]...   (results and logs land in $OUT)
#   tests: the CUDA tests; bench: benchmarks/quantization.py, bench quality, bench throughput;
#   micro: benchmarks/fp8_gemm.py (fp8 vs bf16 layers) and benchmarks/cuda_profile.py (where a step's time goes)
# On a machine without internet, the Python packages its image lacks are installed from ./.whl first
# (wheels downloaded where pip works; docs/cuda.md lists them).
set -uo pipefail
cd "$(dirname "$0")/.."
what=" ${*:-all} "
has() { [[ "$what" == *" $1 "* || "$what" == *" all "* ]]; }
OUT=${OUT:-/tmp/llmrt-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'transformers', transformers.__version__, 'capability', torch.cuda.get_device_capability(), 'cpus', __import__('os').cpu_count())"
} 2>&1 | tee "$OUT/env.txt"

if has tests; then
  # The CPU references inside the tests use torch's ops: building llmrt's CPU kernels there costs device time.
  LLMRT_KERNELS=0 LLMRT_FUSED=0 LLMRT_ATTENTION_KERNEL=0 timeout 150 python3 -m pytest -q -rA -p no:cacheprovider \
    tests/test_cuda.py tests/test_models.py tests/test_quantization.py tests/test_sampler.py -k cuda 2>&1 \
    | tee "$OUT/cuda-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | tail -80
fi

if has bench; then
  timeout 120 python3 benchmarks/quantization.py --device cuda --rounds 3 --batch 64 --name quantization-h200 \
    2>&1 | tee "$OUT/bench-quantization.log" | grep -vE "^round" | tail -14
  timeout 60 python3 -m llmrt.cli bench quality --device cuda --quantization int8 --quantization int4 \
    --quantization fp8 --output "$OUT/quality-h200.json" 2>&1 | tail -8
  timeout 120 python3 -m llmrt.cli bench throughput --random-model 110m --device cuda --dtype bfloat16 \
    --hf-batch-sizes 32,64 --name throughput-random-110m-bfloat16-h200 2>&1 | tee "$OUT/bench-throughput.log" \
    | tail -25
  tar czf "$OUT/benchmarks.tgz" benchmarks/quantization-h200* benchmarks/throughput-random-110m-bfloat16-h200* \
    2>/dev/null
fi

if has micro; then
  mkdir -p "$OUT/micro"
  timeout 90 python3 benchmarks/fp8_gemm.py > "$OUT/micro/fp8_gemm.log" 2>&1
  timeout 60 python3 benchmarks/cuda_profile.py --prompts 16 --output-len 16 > "$OUT/micro/profile.log" 2>&1
  timeout 40 python3 benchmarks/cuda_profile.py --prompts 1 --output-len 64 --name cuda-profile-single \
    > "$OUT/micro/profile-single.log" 2>&1
  grep -h "NVIDIA H200\|Error" "$OUT"/micro/profile*.log | head -4
  cp benchmarks/fp8-gemm-* benchmarks/cuda-profile-* "$OUT/micro/" 2>/dev/null
  tar czf "$OUT/micro.tgz" -C "$OUT" micro && rm -r "$OUT/micro"
fi

if has fp8bench; then  # the fp8 configurations beside bf16 only
  timeout 90 python3 benchmarks/quantization.py --device cuda --rounds 3 --batch 64 --configs bf16 "fp8 (bf16)" \
    "bf16 + kv fp8" --name quantization-fp8-rerun-h200 2>&1 | grep -vE "^round" | tail -6
  tar czf "$OUT/fp8bench.tgz" benchmarks/quantization-fp8-rerun-h200* 2>/dev/null
fi

if has attn; then  # the attention-backend change: correctness against HF, then W1 beside HF generate
  LLMRT_KERNELS=0 LLMRT_FUSED=0 LLMRT_ATTENTION_KERNEL=0 timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/test_models.py tests/test_quantization.py tests/test_cuda.py \
    -k "cuda and (greedy_batch or swap_and_prefix or speculative or served)" 2>&1 | tail -3
  timeout 100 python3 -m llmrt.cli bench throughput --random-model 110m --device cuda --dtype bfloat16 \
    --hf-batch-sizes 64 --name throughput-random-110m-bfloat16-h200-flash 2>&1 | tail -12
  cp benchmarks/throughput-random-110m-bfloat16-h200-flash.* "$OUT/" 2>/dev/null
fi
