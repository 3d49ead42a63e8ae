#!/usr/bin/env bash
# Build motor's Cython extensions in place and a wheel under dist/.
#   ./build.sh            # in-place extensions + wheel
#   MOTOR_DEBUG=1 ./build.sh   # with invariant checks compiled in
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
$PY -m pip install -q "setuptools>=77" wheel "Cython>=3.0,<3.3" "numpy>=1.26" build
$PY setup.py build_ext --inplace
$PY -m pip wheel --no-deps --no-build-isolation -w dist .
ls -l dist/
