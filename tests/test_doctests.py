"""The runnable examples in the docstrings pass: every module of the package that holds one
(found by its ``>>>`` prompts, so a new module's examples run without being listed here)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import blocktable

PACKAGE = Path(blocktable.__file__).resolve().parent


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found() -> None:
    assert {"blocktable.multi_group", "blocktable.compat", "blocktable.engine.engine"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
