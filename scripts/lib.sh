# Shared by scripts/build, scripts/test and scripts/demo. Sourced, not run.
# The Python front (python/, tests/python) needs Debian's torch 1.13, its C++ headers, pybind11 and pytest:
# about 240 packages with their recommends, ~820 MB installed, 3-4 minutes on 2 cores (once). UCX (internode)
# and iproute2 (the network-namespace test) come along.
EPCOMM_PACKAGES="cmake ninja-build g++ libgtest-dev python3-torch libtorch-dev pybind11-dev python3-pytest
  libopenmpi-dev openmpi-bin libucx-dev iproute2"

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
}

build_project() {
  local dir=${EPCOMM_BUILD_DIR:-build}
  if [ ! -f "$dir/build.ninja" ]; then
    # The scripts install torch, so the Python package is required here (a silent skip would hide its tests).
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=${EPCOMM_BUILD_TYPE:-RelWithDebInfo} \
      -DEPCOMM_BUILD_PYTHON=${EPCOMM_BUILD_PYTHON:-ON} >/dev/null
  fi
  cmake --build "$dir" -- -j"${EPCOMM_JOBS:-$(nproc)}" "$@"
}
