"""Import a few pure-Python modules of a released vLLM wheel, without installing vLLM.

``load_vllm(version)`` downloads the wheel with ``pip download --no-deps`` into a cache folder
outside the repository (``$BLOCKTABLE_BENCH_CACHE`` or ``~/.cache/blocktable-bench``), unpacks
its Python sources there, and installs an import hook for the ``vllm`` package:

- the modules named in ``REAL_MODULES`` run from the unpacked sources, unchanged;
- a few stubs carry the real values the real modules need (``GENERATED``): ``vllm.triton_utils``
  is Triton itself, ``vllm.distributed``'s group getters fail as they do before any group
  exists (one process, no context parallelism), ``PIN_MEMORY`` is what vLLM sets on this
  platform; and stubs take the literal constants named in ``CONSTANTS`` (``PAD_SLOT_ID``)
  from the wheel's own source;
- every other ``vllm.*`` module, and any third-party module those import that is not installed
  here (``zmq``, ``msgspec``, ``cbor2``...), is a stub built at import time: any attribute is
  another stub, calling a stub returns a stub (or, used as a decorator, the decorated
  function), subclassing one gives a class whose missing attributes are stubs, and a stub is
  false in a test (features gated on a stubbed flag stay off).

``load_vllm(version, root)`` imports an already unpacked tree instead, such as the one
``export_subset`` writes (only the files the hook reads), for a machine without network.

Nothing of vLLM is copied into this repository: the stubs are generated here, the code that
is measured is the wheel's own.
"""

from __future__ import annotations

import ast
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
        # the launch machinery of the worker's Triton slot-mapping kernel (CUDA rows)
        "vllm.model_executor.warmup.jit_warmup",
        "vllm.model_executor.warmup.jit_warmup_triton_helper",
    }
)
# third-party packages the real modules import at module level for features not measured here
# (stubbed only when they are not installed)
THIRD_PARTY = frozenset({"cbor2", "msgspec", "zmq", "uvloop", "xxhash", "psutil", "cachetools"})
# packages on the way to the real modules: empty packages (their __init__ is not run)
_PATH_PACKAGES = ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.worker", "vllm.model_executor",
                  "vllm.model_executor.warmup")
# stubbed modules whose literal module-level constants the real modules use as values: read
# from the wheel's source (not copied here) when the stub is made
CONSTANTS = {"vllm.v1.attention.backends.utils": ("PAD_SLOT_ID",)}


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
    def __init__(self, fill: Any = None) -> None:
        self.fill = fill  # sets the stub's real values, if it has any

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StubModule(spec.name)
        module.__path__ = []  # a package: deeper imports are stubs too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if self.fill is not None:
            self.fill(module)


# ----------------------------------------------------------- stubs with real values
def _triton_utils(module: Any) -> None:
    """``vllm.triton_utils`` guards vLLM's imports of Triton: here it is Triton itself."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return  # no Triton: stubs, and no kernel of vLLM's runs
    module.triton, module.tl, module.HAS_TRITON = triton, tl, True


def _not_initialized(what: str) -> Any:
    def get_group() -> Any:
        # what vLLM's own getter does before its group exists: one process, no parallelism
        raise AssertionError(f"{what} group is not initialized")

    return get_group


def _distributed(module: Any) -> None:
    module.get_dcp_group = _not_initialized("decode context parallel")
    module.get_pcp_group = _not_initialized("prefill context parallel")


def _torch_utils(module: Any) -> None:
    import torch

    # vLLM pins host buffers on a CUDA platform
    module.PIN_MEMORY = torch.cuda.is_available()


GENERATED = {"vllm.triton_utils": _triton_utils, "vllm.distributed": _distributed,
             "vllm.utils.torch_utils": _torch_utils}


def read_constants(source: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The literal values assigned to ``names`` at the top level of the Python file ``source``."""
    found = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name) and node.targets[0].id in names:
            found[node.targets[0].id] = ast.literal_eval(node.value)
    missing = set(names) - set(found)
    if missing:
        raise RuntimeError(f"{source} assigns no literal {sorted(missing)}")
    return found


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
            return importlib.machinery.ModuleSpec(name, _StubLoader(self._fill(name)),
                                                  is_package=True)
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

    def _fill(self, name: str) -> Any:
        generate = GENERATED.get(name)
        constants = CONSTANTS.get(name)
        if generate is None and constants is None:
            return None
        source = self.root.joinpath(*name.split(".")).with_suffix(".py")

        def fill(module: types.ModuleType) -> None:
            if generate is not None:
                generate(module)
            if constants is not None:
                for key, value in read_constants(source, constants).items():
                    setattr(module, key, value)

        return fill


def module_files(root: Path) -> list[Path]:
    """The files of ``root`` (a tree holding ``vllm/``) that the hook reads: the real modules
    and the sources of the stubs' constants."""
    files = []
    for name in sorted(REAL_MODULES) + sorted(CONSTANTS):
        rel = root.joinpath(*name.split("."))
        files.append(rel / "__init__.py" if (rel / "__init__.py").exists()
                     else rel.with_suffix(".py"))
    return files


def export_subset(root: Path, dest: Path) -> list[Path]:
    """Copy the files the hook reads from the unpacked tree ``root`` into ``dest`` (for a
    machine without network: ``load_vllm(version, dest)`` there). Returns the copies."""
    import shutil

    copies = []
    for src in module_files(root):
        if not src.exists():
            raise FileNotFoundError(f"{src}: not in the unpacked vLLM tree {root}")
        out = dest / src.relative_to(root)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out)
        copies.append(out)
    return copies


def load_vllm(version: str, root: Path | None = None) -> types.SimpleNamespace:
    """vLLM ``version``'s allocator and worker block-table modules, imported from its wheel
    (or from ``root``, an unpacked tree holding ``vllm/``: nothing is downloaded)."""
    if any(m == "vllm" or m.startswith("vllm.") for m in sys.modules):
        raise RuntimeError("a vllm package is already imported in this process")
    if root is None:
        root = fetch_wheel(version)
    elif not (root / "vllm").is_dir():
        raise FileNotFoundError(f"--vllm-dir {root}: no vllm/ folder in it")
    sys.meta_path.insert(0, VllmFinder(root))
    import importlib

    mods = {m.rsplit(".", 1)[-1]: importlib.import_module(m) for m in sorted(REAL_MODULES)}
    return types.SimpleNamespace(version=version, root=root, **mods)
