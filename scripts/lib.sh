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
  cmake --build "$dir" -- -j"${EPCOMM_JOBS:-$(nproc)}" "$@"
}
