#!/usr/bin/env bash
# One GPU session's checks, in the order they matter, each under its own time limit:
# versions, run-to-run bits and ulps against the CPU (with and without XLA's
# deterministic-ops flag), the backend and core tests on the GPU, the table-batched
# step on the recsys shape (issue 42: one sort for all tables against one per table),
# then the accelerator benchmark. Each part's output is kept in $OUT.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh          # on a machine with a CUDA jax
#   PLATFORM=cpu SMALL=1 OUT=/tmp/gpu bash benchmarks/gpu_session.sh   # a CPU dry run
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_session}
PLATFORM=${PLATFORM:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  JAX_PLATFORMS=$PLATFORM $PY -c "import jax, jaxlib, optax, optax_sparse_adam as osa; \
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__, \
'optax_sparse_adam', osa.__version__, jax.devices())" || exit 1
  $PY -c "import torch, flax; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'flax', flax.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
if [ -n "${SMALL:-}" ]; then det=(--rows 5000 --batch 4096 --steps 4); bench=(--small); tables=(--small)
  tests=(tests/backends/test_accelerator.py tests/backends/test_table_batched.py)
else det=(); bench=(--repeats 3); tables=(--repeats 3); tests=(tests/backends tests/core); fi
for flags in "" "--xla_gpu_deterministic_ops=true"; do
  [ -n "${SKIP_DET:-}" ] && break
  JAX_PLATFORMS=$PLATFORM,cpu XLA_FLAGS=$flags timeout "${DET_S:-50}" \
    $PY -m benchmarks.gpu_determinism "${det[@]}" 2>&1 | tee -a "$OUT/determinism.txt"
done
JAX_PLATFORMS=$PLATFORM timeout "${TEST_S:-300}" $PY -m pytest -q -p no:cacheprovider -o addopts= \
  -p no:benchmark -m "not slow" --strict-markers -n "${WORKERS:-8}" --dist loadfile --maxfail=40 -rfEs \
  "${tests[@]}" > "$OUT/pytest.txt" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -3
XLA_PYTHON_CLIENT_MEM_FRACTION=.9 JAX_PLATFORMS=$PLATFORM timeout "${TABLES_S:-180}" \
  $PY -m benchmarks.bench_tables --batched "${tables[@]}" 2>&1 | tee "$OUT/tables.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=.9 JAX_PLATFORMS=$PLATFORM timeout "${BENCH_S:-300}" $PY -m benchmarks.bench_accelerator "${bench[@]}" \
  2>&1 | tee "$OUT/bench.txt"
