"""One name per idea: no two modules of the package share a file name, so a name found in a
traceback, an import or a review names one module."""

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
