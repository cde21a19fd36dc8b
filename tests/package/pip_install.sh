#!/usr/bin/env bash
# tests/package/pip_install.sh SOURCE_DIR WORK_DIR PROJECT_PYTHON: `pip install --no-build-isolation .` into a
# fresh virtual environment, as a user would, then checks that epcomm and deep_ep import from it with
# dist-info, that a 1-rank dispatch and combine round-trips, and that `pip uninstall` removes both packages.
# The fresh environment sees the project venv's torch (and build tools) through a .pth file, so nothing is
# downloaded; the CMake build directory persists in WORK_DIR/build, so a second run is incremental.
set -euo pipefail
src=$1 work=$2 project_python=$3
venv=$work/venv
rm -rf "$venv"
mkdir -p "$work"
"$project_python" -m venv "$venv"
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
"$project_python" -c "import sysconfig; print(sysconfig.get_path('purelib'))" > "$site/project-venv.pth"

# The main build's compiler and launcher (ccache, when CMake was given one), so that its objects are reused:
# ccache keys on the compiler command as written.
launcher=()
[ -n "${EPCOMM_CXX:-}" ] && launcher+=(-C "cmake.define.CMAKE_CXX_COMPILER=$EPCOMM_CXX")
[ -n "${EPCOMM_CXX_LAUNCHER:-}" ] && launcher+=(-C "cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=$EPCOMM_CXX_LAUNCHER")
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}  # not nproc + 2: torch's headers are big
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
  -C build-dir="$work/build" "${launcher[@]}" "$src" 2>&1 | { grep -v "^WARNING: Location .* is ignored" || true; }

cd "$work"  # away from the source tree, whose python/ must not be what gets imported
"$venv/bin/python" - "$site" <<'PY'
import os, sys, tempfile
import torch, torch.distributed as dist
import epcomm, deep_ep
site = sys.argv[1]
for m in (epcomm, deep_ep, epcomm._C):
    assert m.__file__.startswith(site), f"{m.__name__} imported from {m.__file__}, not from {site}"
from importlib.metadata import version, files
assert version("epcomm") == epcomm.__version__, (version("epcomm"), epcomm.__version__)
listed = {str(f) for f in files("epcomm")}
for want in ("epcomm/__init__.py", "deep_ep/__init__.py"):
    assert want in listed, f"{want} missing from the dist-info RECORD"
assert any(f.startswith("epcomm/_C") for f in listed), "the extension is missing from the RECORD"
with tempfile.TemporaryDirectory() as d:
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
    buf = deep_ep.Buffer(dist.group.WORLD)
    x = torch.arange(4 * 16, dtype=torch.float32).reshape(4, 16).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    w = torch.full((4, 2), 0.5)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 4)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    y, _, _ = buf.combine(recv_x, handle)
    assert torch.equal(y, x), "combine of the unchanged rows with weights 0.5 + 0.5 is not x"
    buf.destroy()
    dist.destroy_process_group()
print(f"pip-installed epcomm {epcomm.__version__} (torch {torch.__version__}) from {site}: round trip correct")
PY

"$venv/bin/python" -m pip uninstall -q -y epcomm
for pkg in epcomm deep_ep; do
  if [ -e "$site/$pkg" ]; then
    echo "FAIL: pip uninstall left $site/$pkg" >&2
    exit 1
  fi
done
if "$venv/bin/python" -c "import epcomm" 2>/dev/null; then
  echo "FAIL: epcomm still imports after pip uninstall" >&2
  exit 1
fi
echo "pip uninstall removed epcomm and deep_ep"
