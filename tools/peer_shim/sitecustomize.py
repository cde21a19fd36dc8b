"""peer_shim: runs GPU/NPU peer test scripts (DeepEP, sgl-kernel-npu) unchanged on CPU against epcomm.

Python imports this module at start-up when tools/peer_shim is on PYTHONPATH (it is a `sitecustomize`).
Set PEER_SHIM=0 to turn it off. Everything lives in the _peer_shim package; see README.md."""
import os
import sys

if os.environ.get("PEER_SHIM", "1") != "0":
    try:
        import _peer_shim

        _peer_shim.install()
    except Exception as e:  # never leave the interpreter half-started without saying why
        print(f"[peer_shim] install failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
