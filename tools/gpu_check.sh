#!/usr/bin/env bash
# tools/gpu_check.sh DIR [PYTEST ARGS...]: the GPU check, on a machine with an NVIDIA GPU and
# jax, flax, optax and torch preinstalled (no network needed). Within 8 minutes it
#   1. installs this checkout without dependencies (pip install --no-deps
#      --no-build-isolation -e .),
#   2. runs the tests that make sense on one GPU: the suite under JAXPG_TEST_PLATFORM=gpu
#      (JAX keeps its default platform) minus those marked cpu_only (tests/conftest.py),
#      or only PYTEST ARGS when given,
#   3. runs bench/gpu.py (bench/gpu.py --smoke where JAX has no GPU),
# and writes every log and figure under DIR: env.txt, install.log, tests.log, junit.xml,
# bench.log, gpu.json, summary.txt. Exit status: 0 when every step passed.
# Environment: PYTHON (default python), TESTS_TIMEOUT_S (240), BENCH_TIMEOUT_S (180),
# TEST_WORKERS (6, with pytest-xdist), BENCH_ARGS (e.g. "--parts moe zb"): with the install,
# under 8 minutes in all.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: tools/gpu_check.sh DIR [PYTEST ARGS...]" >&2; exit 2; }
DIR=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
START=$(date +%s)
say() { echo "== $*" | tee -a "$DIR/summary.txt"; }
: > "$DIR/summary.txt"

{
    date -u
    git rev-parse HEAD 2>/dev/null
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" - <<'PYEOF'
import sys, jax
print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, backend {jax.default_backend()}")
print("devices:", jax.devices())
PYEOF
} > "$DIR/env.txt" 2>&1
PLATFORM=$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)
say "platform: ${PLATFORM:-unknown} ($(tail -n 2 "$DIR/env.txt" | head -n 1))"

"$PY" -m pip install --no-deps --no-build-isolation -e . > "$DIR/install.log" 2>&1
INSTALL=$?
say "install: exit $INSTALL (install.log)"

if [ $# -eq 0 ]; then set -- tests; fi
# Several pytest workers share the one GPU (pytest-xdist where installed): none may take 75%
# of its memory up front. The tests compare with numpy and one-device references in float32,
# as torch does by default: no TF32 in float32 matmuls (JAX's GPU default allows it).
WORKERS=()
if [ "${TEST_WORKERS:-6}" -gt 1 ] && "$PY" -c 'import xdist' 2>/dev/null; then
    WORKERS=(-n "${TEST_WORKERS:-6}")
fi
JAXPG_TEST_PLATFORM=gpu XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest \
    timeout "${TESTS_TIMEOUT_S:-240}" "$PY" -m pytest -q -rfEs "${WORKERS[@]}" \
    -m "not cpu_only" --timeout 120 --durations=25 -p no:cacheprovider -p no:benchmark \
    --junitxml "$DIR/junit.xml" "$@" > "$DIR/tests.log" 2>&1
TESTS=$?
say "tests: exit $TESTS, $(tail -n 1 "$DIR/tests.log") (tests.log)"

SMOKE=()
[ "$PLATFORM" = gpu ] || SMOKE=(--smoke)  # no GPU here: toy sizes, CPU figures
timeout "${BENCH_TIMEOUT_S:-180}" "$PY" bench/gpu.py "${SMOKE[@]}" ${BENCH_ARGS:-} --out "$DIR/gpu.json" \
    > "$DIR/bench.log" 2>&1
BENCH=$?
say "bench/gpu.py ${SMOKE[*]}: exit $BENCH (bench.log, gpu.json)"
say "done in $(( $(date +%s) - START )) s"
[ "$INSTALL" -eq 0 ] && [ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
