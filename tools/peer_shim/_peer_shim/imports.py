"""Import hooks.

* `deep_ep.utils` / `deep_ep.utils.<mod>`: when PEER_SHIM_DEEPEP_SRC names a directory holding a DeepEP
  source tree (<dir>/deep_ep/utils/*.py, put there by run.py from DeepEP's git), `deep_ep.utils` becomes a
  package whose submodules are DeepEP's own files (math, testing, envs, ...), under epcomm's `deep_ep`
  (which has no utils). DeepEP's utils/__init__.py is not run (it needs the CUDA extension).
* `deep_ep._C`: a stub, so that DeepEP's Python files that `import deep_ep._C` load; using any of its
  attributes raises, naming the attribute.
* Test helper modules (`utils`, `deep_ep.utils.testing`, `test_utils`, and PEER_SHIM_PATCH_MODULES,
  comma-separated): after they load, a `bench_kineto` they define is replaced by bench.bench_kineto."""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

from . import log

_PATCH = {"utils", "deep_ep.utils.testing", "test_utils"}


class _StubC(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"deep_ep._C.{name}: DeepEP's CUDA extension is not available under epcomm "
                             f"(peer_shim stub)")


class _Loader(importlib.abc.Loader):
    def __init__(self, kind, path=None):
        self.kind, self.path = kind, path

    def create_module(self, spec):
        if self.kind == "stub":
            return _StubC(spec.name)
        return None

    def exec_module(self, module):
        if self.kind == "pkg":
            module.__path__ = [self.path]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        if callable(getattr(module, "bench_kineto", None)):
            from . import bench
            module._peer_shim_orig_bench_kineto = module.bench_kineto
            module.bench_kineto = bench.bench_kineto
            log(f"{module.__name__}.bench_kineto -> peer_shim wall-time version")

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Finder(importlib.abc.MetaPathFinder):
    def __init__(self):
        src = os.environ.get("PEER_SHIM_DEEPEP_SRC", "")
        self.utils_dir = os.path.join(src, "deep_ep", "utils") if src else ""
        if self.utils_dir and not os.path.isdir(self.utils_dir):
            log(f"PEER_SHIM_DEEPEP_SRC={src}: no deep_ep/utils there; deep_ep.utils not provided")
            self.utils_dir = ""
        extra = os.environ.get("PEER_SHIM_PATCH_MODULES", "")
        self.patch = _PATCH | {m.strip() for m in extra.split(",") if m.strip()}
        self._busy = set()

    def find_spec(self, name, path=None, target=None):
        if self.utils_dir and name == "deep_ep.utils":
            spec = importlib.util.spec_from_loader(name, _Loader("pkg", self.utils_dir), is_package=True)
            spec.submodule_search_locations = [self.utils_dir]
            return spec
        if name == "deep_ep._C" and self.utils_dir:
            return importlib.util.spec_from_loader(name, _Loader("stub"))
        if name in self.patch and name not in self._busy:
            self._busy.add(name)
            try:
                spec = importlib.machinery.PathFinder.find_spec(name, path)
            finally:
                self._busy.discard(name)
            if spec is not None and spec.loader is not None and spec.origin and "site-packages" not in spec.origin:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install():
    sys.meta_path.insert(0, Finder())
