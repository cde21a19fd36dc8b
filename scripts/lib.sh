# Shared by scripts/build, scripts/test and scripts/demo. Sourced, not run.
# The C++ side needs Debian's compiler, cmake, ninja, GoogleTest, Open MPI, UCX (internode) and iproute2 (the
# network-namespace test). The Python front (python/, tests/python) is built against the torch of the project
# virtual environment .venv (requirements-dev.txt: torch 2.13.0 CPU, numpy, pytest, pybind11, scikit-build-core),
# which ensure_venv creates with the machine's python3 (3.11) the first time, and again whenever
# requirements-dev.txt changes. Both steps do nothing when everything is there, so a second run starts at once.
EPCOMM_PACKAGES="cmake ninja-build g++ libgtest-dev libopenmpi-dev openmpi-bin libucx-dev iproute2 pkg-config
  ccache"
EPCOMM_VENV=${EPCOMM_VENV:-$PWD/.venv}
# Compiles go through ccache (cache in .cache/ccache, git-ignored), so that the second CMake build of the same
# sources (package.pip_install's) costs links, not compiles. The cache key leaves out the working directory
# (both builds use the same absolute source paths), so objects are shared between build directories.
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
export CCACHE_NOHASHDIR=1

ensure_packages() {
  local missing=()
  for p in $EPCOMM_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "epcomm: installing missing Debian packages: ${missing[*]}" >&2
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  ensure_venv
}

# The interpreter the venv is made from: python3.11 where there is one (the torch wheel is for 3.11), else python3.
venv_base_python() {
  if command -v python3.11 >/dev/null 2>&1; then echo python3.11; else echo python3; fi
}

ensure_venv() {
  local stamp="$EPCOMM_VENV/.epcomm-requirements"
  if [ -x "$EPCOMM_VENV/bin/python" ] && cmp -s requirements-dev.txt "$stamp"; then
    return 0
  fi
  echo "epcomm: setting up the virtual environment $EPCOMM_VENV (requirements-dev.txt)" >&2
  [ -x "$EPCOMM_VENV/bin/python" ] || "$(venv_base_python)" -m venv "$EPCOMM_VENV"
  "$EPCOMM_VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-dev.txt 2>&1 |
    { grep -v "^WARNING: Location .* is ignored" || true; } >&2
  cp requirements-dev.txt "$stamp"
}

build_project() {
  local dir=${EPCOMM_BUILD_DIR:-build}
  if [ ! -f "$dir/build.ninja" ]; then
    # The scripts install torch, so the Python package is required here (a silent skip would hide its tests).
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=${EPCOMM_BUILD_TYPE:-RelWithDebInfo} \
      -DEPCOMM_BUILD_PYTHON=${EPCOMM_BUILD_PYTHON:-ON} -DEPCOMM_PYTHON="$EPCOMM_VENV/bin/python" \
      -DEPCOMM_SANITIZE="${EPCOMM_SANITIZE:-}" \
      -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >/dev/null
  fi
  # EPCOMM_BUILD_TARGETS (space-separated) builds only those targets, e.g. what one test label needs.
  # shellcheck disable=SC2086
  cmake --build "$dir" -- -j"${EPCOMM_JOBS:-$(nproc)}" ${EPCOMM_BUILD_TARGETS:-} "$@"
}

# sanitize_setup address|thread: what a sanitized build and its runs need (docs/install.md, "Sanitizers"):
# its own build directory (build-asan, build-tsan), no Python package, and the runtime options: findings fail
# the process (ASan/UBSan exit 1, TSan 66), suppressions from tools/sanitizers/ (third-party code only).
sanitize_setup() {
  local tag
  case "${1:-}" in
    address) tag=asan ;;
    thread) tag=tsan ;;
    *) echo "epcomm: --sanitize expects address or thread, got '${1:-}'" >&2; return 2 ;;
  esac
  export EPCOMM_SANITIZE=$1
  export EPCOMM_BUILD_DIR=${EPCOMM_BUILD_DIR:-build-$tag}
  export EPCOMM_BUILD_PYTHON=OFF
  local supp="$PWD/tools/sanitizers"
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0:${ASAN_OPTIONS:-}"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-}"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
  export TSAN_OPTIONS="suppressions=$supp/tsan.supp:second_deadlock_stack=1:${TSAN_OPTIONS:-}"
  # UCX hooks the allocator (mmap/munmap/brk) to track registered memory; under the sanitizers' own
  # interceptors the hooks crash at thread exit. epcomm registers no memory that those events would cover.
  export UCX_MEM_EVENTS=no
}
