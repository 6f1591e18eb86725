"""One name per idea: no two modules of the package share a file name, so a name found in a
traceback, an import or a review names one module; and no module imports, even lazily inside a
function, a module that imports it back."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import blocktable

PACKAGE = Path(blocktable.__file__).resolve().parent
# a package's own entry point, and each layer's readable oracle, by convention
SHARED_BY_DESIGN = {"__init__.py", "reference.py"}


def test_module_names_are_unique() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        where[path.name].append(str(path.relative_to(PACKAGE)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    unexpected = {n: p for n, p in shared.items() if n not in SHARED_BY_DESIGN}
    assert not unexpected, unexpected
    assert len(where) > 50  # the walk found the package


def test_no_import_cycles() -> None:
    """Every import counts (inside functions too; typing-only imports do not): the layers'
    contract lets siblings such as the demos import each other, this keeps them one way."""
    grimp = __import__("pytest").importorskip("grimp", reason="grimp comes with import-linter")
    graph = grimp.build_graph("blocktable", exclude_type_checking_imports=True)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if module < imported and graph.chain_exists(importer=imported, imported=module):
                cycles.append((module, imported))
    assert not cycles, cycles
