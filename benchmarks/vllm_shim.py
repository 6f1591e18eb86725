"""Import a few pure-Python modules of a released vLLM wheel, without installing vLLM.

``load_vllm(version)`` downloads the wheel with ``pip download --no-deps`` into a cache folder
outside the repository (``$BLOCKTABLE_BENCH_CACHE`` or ``~/.cache/blocktable-bench``), unpacks
its Python sources there, and installs an import hook for the ``vllm`` package:

- the modules named in ``REAL_MODULES`` run from the unpacked sources, unchanged;
- every other ``vllm.*`` module, and any third-party module those import that is not installed
  here (``zmq``, ``msgspec``, ``cbor2``...), is a stub built at import time: any attribute is
  another stub, calling a stub returns a stub (or, used as a decorator, the decorated
  function), subclassing one gives a class whose missing attributes are stubs, and a stub is
  false in a test (features gated on a stubbed flag stay off).

Nothing of vLLM is copied into this repository: the stubs are generated here, the code that
is measured is the wheel's own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

# modules executed from the wheel: the allocator (KVCacheManager and what it is built from),
# the request that carries its block hashes, and the worker's block table
REAL_MODULES = frozenset(
    {
        "vllm.utils",
        "vllm.utils.math_utils",
        "vllm.utils.hashing",
        "vllm.v1.request",
        "vllm.v1.utils",
        "vllm.v1.kv_cache_interface",
        "vllm.v1.kv_cache_layout",
        "vllm.v1.kv_cache_spec_registry",
        "vllm.v1.core.kv_cache_manager",
        "vllm.v1.core.kv_cache_coordinator",
        "vllm.v1.core.single_type_kv_cache_manager",
        "vllm.v1.core.block_pool",
        "vllm.v1.core.kv_cache_utils",
        "vllm.v1.core.kv_cache_metrics",
        "vllm.v1.worker.block_table",
    }
)
# third-party packages the real modules import at module level for features not measured here
# (stubbed only when they are not installed)
THIRD_PARTY = frozenset({"cbor2", "msgspec", "zmq", "uvloop", "xxhash", "psutil", "cachetools"})
# packages on the way to the real modules: empty packages (their __init__ is not run)
_PATH_PACKAGES = ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.worker")


def cache_dir() -> Path:
    return Path(os.environ.get("BLOCKTABLE_BENCH_CACHE", Path.home() / ".cache/blocktable-bench"))


def fetch_wheel(version: str) -> Path:
    """The unpacked Python sources of vLLM ``version`` (downloaded and unpacked once)."""
    root = cache_dir() / f"vllm-{version}"
    marker = root / ".unpacked"
    if marker.exists():
        return root
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(wheels), f"vllm=={version}"]
        print("fetching:", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download left no vllm-{version} wheel in {wheels}")
    root.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[-1]) as wheel:  # Python sources only: the binaries stay zipped
        wheel.extractall(root, [n for n in wheel.namelist()
                                if n.startswith("vllm/") and n.endswith(".py")])
    marker.touch()
    return root


class Stub:
    """Stands for any object of a stubbed module (see the module docstring)."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_stub_name", name)

    def __repr__(self) -> str:
        return f"<stub {self._stub_name}>"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = Stub(f"{self._stub_name}.{attr}")
        object.__setattr__(self, attr, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(
            args[0], (types.FunctionType, type, staticmethod, classmethod, property)
        ):
            return args[0]  # used as a decorator
        return Stub(f"{self._stub_name}()")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (type(f"Stub_{self._stub_name}", (StubBase,), {}),)

    def __getitem__(self, key: Any) -> Any:
        return Stub(f"{self._stub_name}[]")

    def __or__(self, other: Any) -> Any:
        return self

    __ror__ = __or__

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())


class StubBase:
    """Base of classes that subclass a stub: accepts any arguments; missing attributes are stubs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass

    def __class_getitem__(cls, item: Any) -> type:
        return cls

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Stub(f"{type(self).__name__}.{attr}")


class StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = Stub(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StubModule(spec.name)
        module.__path__ = []  # a package: deeper imports are stubs too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _EmptyPackageLoader(_StubLoader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)


class VllmFinder(importlib.abc.MetaPathFinder):
    """Serves ``vllm.*`` (real modules from ``root``, stubs otherwise) and absent third-party
    modules that the real ones import."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._busy = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        top = name.partition(".")[0]
        if top == "vllm":
            rel = self.root.joinpath(*name.split("."))
            if name in REAL_MODULES:
                if (rel / "__init__.py").exists():
                    return importlib.util.spec_from_file_location(
                        name, rel / "__init__.py", submodule_search_locations=[str(rel)])
                return importlib.util.spec_from_file_location(name, rel.with_suffix(".py"))
            if name in _PATH_PACKAGES:
                spec = importlib.machinery.ModuleSpec(name, _EmptyPackageLoader(), is_package=True)
                spec.submodule_search_locations = [str(rel)]
                return spec
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        if top not in THIRD_PARTY or self._busy:
            return None
        self._busy = True  # is it installed? ask the other finders
        try:
            installed = importlib.util.find_spec(top) is not None
        finally:
            self._busy = False
        if installed:
            return None
        return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)


def load_vllm(version: str) -> types.SimpleNamespace:
    """vLLM ``version``'s allocator and worker block-table modules, imported from its wheel."""
    if any(m == "vllm" or m.startswith("vllm.") for m in sys.modules):
        raise RuntimeError("a vllm package is already imported in this process")
    root = fetch_wheel(version)
    sys.meta_path.insert(0, VllmFinder(root))
    import importlib

    mods = {m.rsplit(".", 1)[-1]: importlib.import_module(m) for m in sorted(REAL_MODULES)}
    return types.SimpleNamespace(version=version, root=root, **mods)
