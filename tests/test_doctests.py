"""The runnable examples in the public docstrings pass."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "blocktable.multi_group",
    "blocktable.kv_write",
    "blocktable.attention.reference",
    "blocktable.attention.decode",
    "blocktable.flashinfer.device",
    "blocktable.flashinfer.host",
    "blocktable.allocator.manager",
    "blocktable.allocator.hashing",
    "blocktable.allocator.spec",
    "blocktable.group_layout",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
