#!/usr/bin/env bash
# The one recipe for motor's image: the Dockerfile's build and install steps both run this
# script, and so does tests/deploy/test_image_recipe.py (no drift between the two).
#
#   deploy/docker/build.sh wheel OUT_DIR [SRC_DIR]
#       build motor's wheel, Cython hot path compiled (needs a C compiler and the Python
#       headers), into OUT_DIR. SRC_DIR (default: this checkout) is copied first, only what
#       the wheel is made of, so build outputs of the checkout (in-place .so, build/) are
#       neither used nor touched. The build requirements (pyproject.toml [build-system]) are
#       installed in an isolated build environment by pip.
#   deploy/docker/build.sh install WHEEL_DIR
#       install the motor wheel of WHEEL_DIR into $PYTHON's environment from wheels only
#       (no compiler needed, none used), without changing any package already installed
#       there (the base image's vLLM, torch...: a conflict fails the install instead), then
#       check that `motor run` starts. With MOTOR_LINK_DIR set, `motor` is linked there too.
#
# PYTHON: the interpreter to build for / install into (default python3). Wheels come from
# PyPI or the index pip is configured with (PIP_INDEX_URL).
set -euo pipefail
PY=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)

usage() {
    echo "usage: $0 wheel OUT_DIR [SRC_DIR] | install WHEEL_DIR" >&2
    exit 2
}

build_wheel() {
    local out=$1 src=${2:-$here/../..}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    src=$(cd "$src" && pwd)
    tmp=""
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/motor-wheel-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    # what the wheel is made of (pyproject's packages and readme), not what a build left
    tar -C "$src" -cf - --exclude=__pycache__ --exclude='*.so' --exclude='*.pyc' \
        --exclude='motor/_fast/*.c' --exclude='motor/_fast/*.html' \
        pyproject.toml setup.py README.md motor | tar -C "$tmp" -xf -
    "$PY" -m pip wheel --no-deps --wheel-dir "$out" "$tmp"
    ls -l "$out"/motor-*.whl
}

install_wheel() {
    local dir=$1
    local wheels=("$dir"/motor-*.whl)
    [ -f "${wheels[0]}" ] || { echo "no motor-*.whl in $dir" >&2; exit 1; }
    [ "${#wheels[@]}" -eq 1 ] || { echo "more than one motor-*.whl in $dir" >&2; exit 1; }
    pins=""
    pins=$(mktemp "${TMPDIR:-/tmp}/motor-pins-XXXXXX")
    trap 'rm -f "$pins"' EXIT
    # every installed package stays at its version (pip list, not pip freeze: name==version
    # even for packages installed from a directory)
    "$PY" -m pip list --format=freeze --disable-pip-version-check | grep -iv '^motor==' > "$pins" || true
    "$PY" -m pip install --no-cache-dir --disable-pip-version-check --only-binary :all: \
        --constraint "$pins" "${wheels[0]}"
    "$PY" -m motor run --help > /dev/null
    if [ -n "${MOTOR_LINK_DIR:-}" ]; then
        local scripts
        scripts=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
        if [ "$scripts/motor" != "$MOTOR_LINK_DIR/motor" ]; then
            ln -sf "$scripts/motor" "$MOTOR_LINK_DIR/motor"
        fi
    fi
    echo "motor installed: $("$PY" -c 'import motor, os; print(os.path.dirname(motor.__file__))')"
}

case "${1:-}" in
    wheel) [ $# -ge 2 ] && [ $# -le 3 ] || usage; build_wheel "$2" "${3:-}" ;;
    install) [ $# -eq 2 ] || usage; install_wheel "$2" ;;
    *) usage ;;
esac
