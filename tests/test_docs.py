"""The docs stand alone and stay true: no citations of documents a user does not have, every
page the README names exists, and every Python block of ``README.md`` and ``docs/*.md`` runs
as it stands (on the CPU here; examples pick the GPU where there is one).

A block runs in this process, in a fresh namespace, unless an HTML comment on the line just
before its opening fence names another way (the comment does not show on a rendered page):

- ``<!-- example: processes -->``: the block is a script that starts its own processes
  (``run_ranks``, with its ``if __name__ == "__main__":`` guard). It runs as
  ``python example.py`` in a new session, and the whole session is killed past a timeout.

Any other marker fails the collection test, so a typo cannot silently skip a block.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import blocktable

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
# "SPEC", "§", "issue 3", "issues #3", "issue-3" (not "host issue 258 us", a time)
CITATION = re.compile(r"\bSPEC\b|§|(?<!host )\b[Ii]ssues? #?[0-9]|\b[Ii]ssue-[0-9]")
MARKER = re.compile(r"<!--\s*example:\s*(.*?)\s*-->")
RUN_KINDS = ("here", "processes")
FENCE_LANGUAGES = ("", "python", "bash")  # "" is a diagram or a listing, never code
SCRIPT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    run: str  # how it runs: "here" (default) or a marker's value
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    """Every ```-fenced block of ``page``, with the marker on the line before it."""
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start, language = i, lines[i][3:].strip()
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        assert i < len(lines), f"{page.name}:{start + 1}: the fence is never closed"
        code = "\n".join(lines[start + 1:i]) + "\n"
        blocks.append(Block(page, start + 1, language, marker.group(1) if marker else "here",
                            code))
        i += 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.language == "python"]


def _user_facing_files() -> list[Path]:
    """Pages, sources, tests and benchmarks (this file spells the pattern out)."""
    code = [p for folder in ("src", "tests", "benchmarks")
            for p in sorted((ROOT / folder).rglob("*"))
            if p.suffix in (".py", ".pyx", ".pxi") and p != Path(__file__).resolve()]
    return [*PAGES, ROOT / "BENCHMARKS.md", *code]


def test_no_citations_a_user_cannot_follow() -> None:
    hits = []
    for path in _user_facing_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if CITATION.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_pages_the_readme_names_exist() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(docs/[\w.-]+\.md)`", readme))
    assert {"docs/integration.md", "docs/porting_from_vllm.md", "docs/layout.md"} <= named
    for page in named:
        assert (ROOT / page).is_file(), page


def test_every_python_block_is_collected_with_a_known_marker() -> None:
    """No block escapes the run below: every fence is Python, bash or a plain listing, every
    ```python fence of a page is collected, and every marker names a known way to run."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        collected = [b for b in PYTHON_BLOCKS if b.page == page]
        assert len(collected) == len(re.findall(r"^```python$", text, flags=re.MULTILINE))
        assert len(MARKER.findall(text)) == sum(b.run != "here" for b in collected), (
            f"{page.name}: a marker that is not on the line just before a ```python fence"
        )
    odd = [f"{b.name}: ```{b.language}" for b in ALL_BLOCKS if b.language not in FENCE_LANGUAGES]
    assert not odd, "\n".join(odd)
    unknown = [f"{b.name}: {b.run!r}" for b in PYTHON_BLOCKS if b.run not in RUN_KINDS]
    assert not unknown, "\n".join(unknown)
    # the pages whose examples users copy first
    for name in ("README.md", "integration.md", "attention.md", "context_parallel.md",
                 "context_parallel_engine.md", "porting_from_vllm.md"):
        assert any(b.page.name == name for b in PYTHON_BLOCKS), name


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if b.run == "here"],
                         ids=lambda b: b.name)
def test_example_runs(block: Block) -> None:
    exec(compile(block.code, block.name, "exec"), {"__name__": "__doc_example__"})  # noqa: S102


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if b.run == "processes"],
                         ids=lambda b: b.name)
def test_example_script_runs(block: Block, tmp_path: Path) -> None:
    """The block as a script: it spawns its ranks itself. The blocktable this test imports is
    the one the script imports; the whole process session is killed past the timeout."""
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    package_root = str(Path(blocktable.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{block.name}: still running after {SCRIPT_TIMEOUT_S} s, killed\n"
                    f"{output[-4000:]}")
    finally:
        try:  # a rank left behind by a crashed script ends with its session
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    assert proc.returncode == 0, f"{block.name}: exit code {proc.returncode}\n{output[-4000:]}"
