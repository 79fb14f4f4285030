#!/usr/bin/env bash
# The test command (README): installs what it needs, builds with warnings as errors, runs ctest,
# then the Python tests (pytest) against the module built by the same CMake build.
#   scripts/test.sh            # build/ci, all CPU tests; GPU tests reported as skipped
#   EPMOE_TEST_PIP=0 scripts/test.sh   # skip the `pip install .` check (about 1 min on 2 cores)
#   EPMOE_TEST_TSAN=0 scripts/test.sh  # skip the protocol tests under ThreadSanitizer
#   EPMOE_TEST_TORCH=0 scripts/test.sh # pytest without torch / transformers (their tests skip)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# Each stage's wall time, so a slow CI run shows where its time went (CI's budget: 30 min).
stage_start=$SECONDS
stage_done() {
  echo "== $1: $((SECONDS - stage_start)) s (total $SECONDS s)"
  stage_start=$SECONDS
}
scripts/setup.sh
export PATH=/usr/local/cuda/bin:$PATH
build=${EPMOE_BUILD_DIR:-build/ci}
case $build in /*) ;; *) build=$root/$build ;; esac

# Python packages of the module's build (nanobind) and of its tests, where missing.
python=$(command -v "${PYTHON:-python3}")
if ! "$python" -c "import nanobind, scikit_build_core, numpy, pytest, ml_dtypes" 2>/dev/null; then
  echo "setup: pip installing nanobind scikit-build-core numpy pytest ml_dtypes"
  "$python" -m pip install --quiet --disable-pip-version-check \
    nanobind scikit-build-core numpy pytest ml_dtypes
fi
python=$("$python" -c "import sys; print(sys.executable)")
stage_done "setup (system and Python packages)"

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPMOE_WERROR=ON -DEPMOE_BUILD_TESTS=ON \
  -DEPMOE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$python"
cmake --build "$build" -j "$(nproc)"
stage_done "build ($build)"

status=0
(cd "$build" && ctest --output-on-failure -j "$(nproc)" "$@") || status=$?
stage_done "ctest"

# The Python tests run where torch (CPU) and transformers are importable, so the Hugging Face
# parity tests (test_hf_models.py: transformers' own MoE blocks against epmoe's CPU executor) and
# the torch-tensor tests run in CI too: a venv over this Python with the pinned versions (about
# 75 s and 5.6 GB on a fresh machine, reused after). EPMOE_TEST_TORCH=0, or no PyPI, runs them with
# this Python alone, where those tests are skipped with the reason.
pytest_python=$python
if [ "${EPMOE_TEST_TORCH:-1}" = 1 ]; then
  torch_venv="$build/torch-venv"
  torch_pins=(torch==2.15.0 transformers==5.25.0)
  if ! "$torch_venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
    echo "setup: pip installing ${torch_pins[*]} into $torch_venv"
    rm -rf "$torch_venv"
    "$python" -m venv --system-site-packages "$torch_venv" &&
      "$torch_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "${torch_pins[@]}" || echo "setup: torch / transformers NOT installed: their tests skip"
  fi
  if "$torch_venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
    pytest_python="$torch_venv/bin/python"
  fi
  stage_done "setup (torch and transformers for pytest)"
fi

# The module is assembled in $build/python/epmoe (python/CMakeLists.txt).
echo "pytest tests/python (PYTHONPATH=$build/python, $pytest_python)"
PYTHONPATH="$build/python" EPMOE_CLI="${EPMOE_CLI:-$build/tools/epmoe}" \
  "$pytest_python" -m pytest tests/python -q -p no:cacheprovider -rs || status=$?
stage_done "pytest"

if [ "${EPMOE_TEST_PIP:-1}" = 1 ]; then
  # `pip install .` (pyproject.toml) into a fresh venv, CPU executor only, build dependencies from
  # this Python; then the same tests against the installed package (no fault switches there).
  venv="$build/pip-venv"
  rm -rf "$venv"
  echo "pip install . (venv $venv)"
  if "$python" -m venv --system-site-packages "$venv"; then
    CMAKE_ARGS="-DEPMOE_ENABLE_CUDA=OFF" "$venv/bin/python" -m pip install --quiet \
      --disable-pip-version-check --no-build-isolation "$root" || status=$?
    (cd "$root/tests/python" && "$venv/bin/python" -m pytest -q -p no:cacheprovider .) \
      || status=$?
  else
    echo "pip install . NOT checked: $python cannot create a venv"
  fi
  stage_done "pip install . and pytest against it"
fi
if [ "${EPMOE_TEST_TSAN:-1}" = 1 ]; then
  # The round protocol's real threads (and rank processes) under ThreadSanitizer: the CPU
  # executor's tests, no CUDA. A data race between ranks fails the run.
  tsan="$root/build/tsan"
  echo "ThreadSanitizer: protocol tests ($tsan)"
  cmake -S . -B "$tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPMOE_WERROR=ON -DEPMOE_ENABLE_CUDA=OFF \
    -DEPMOE_BUILD_TOOLS=OFF -DCMAKE_CXX_FLAGS=-fsanitize=thread \
    -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread >/dev/null
  cmake --build "$tsan" -j "$(nproc)" \
    --target host_executor_test faults_test multiprocess_test bad_input_test creation_test
  (cd "$tsan" && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" ctest \
    --output-on-failure -j "$(nproc)" \
    -R '^(HostExecutor|FaultTest|ReceivedCounts|MultiProcess|BadInput|BadArguments|RejectedForward|AfterAnError|LayerCreation|CreationSession)') \
    || status=$?
  stage_done "ThreadSanitizer build and tests"
fi
exit $status
