"""``blocktable demo``: runs, verifies, draws a PNG; a mismatch exits 1; the report and the
picture explain themselves. (Option errors: tests/test_cli.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from blocktable.cli import main
from blocktable.demo import REQUEST_COLUMNS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Small, but with prefix hits, chunked prefill and preemptions (10 blocks are tight).
SMALL = ["--num-requests", "5", "--max-new-tokens", "6", "--num-blocks", "10",
         "--token-budget", "12"]
SRC = Path(__file__).resolve().parents[1] / "src"


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


def test_demo_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.png"
    assert main(["demo", *SMALL, "--out", str(out)]) == 0
    _assert_png(out)
    text = capsys.readouterr().out
    assert "5/5 requests match" in text and "summary" in text
    preemptions = re.search(r"preemptions\s*│\s*(\d+)", text)
    assert preemptions is not None and int(preemptions.group(1)) >= 1
    # The request table at rich's default 80 columns: whole headers, one legend line each.
    header = next(line for line in text.splitlines() if line.startswith("┃"))
    cells = [c.strip() for c in header.strip("┃").split("┃")]
    assert cells == [h for h, _ in REQUEST_COLUMNS]
    assert all(len(line) <= 80 for line in text.splitlines())
    for name, meaning in REQUEST_COLUMNS:
        assert f"{name}: {meaning.split()[0]}" in text
    # hits (first admission) never exceed the prompt, even for requests preempted and resumed
    rows = [[c.strip() for c in line.strip("│").split("│")]
            for line in text.splitlines() if re.match(r"│\s*req\d", line)]
    assert len(rows) == 5
    index = {h: i for i, (h, _) in enumerate(REQUEST_COLUMNS)}
    for row in rows:
        assert 0 <= int(row[index["hits"]]) < int(row[index["prompt"]])
    assert any(int(row[index["hits"]]) > 0 for row in rows)
    assert any(int(row[index["preempt"]]) > 0 for row in rows)


def test_demo_picture_step_and_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.png"
    assert main(["demo", *SMALL, "--picture-step", "3", "--quiet", "--out", str(out)]) == 0
    _assert_png(out)
    text = capsys.readouterr().out
    assert "picture of step 3" in text and "summary" not in text


def test_picture_step_past_the_last_step(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.png"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--num-requests", "2", "--max-new-tokens", "2", "--picture-step", "999",
              "--quiet", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: blocktable demo ")
    assert re.search(r"--picture-step 999 is past the last step: this run took \d+ steps", err)
    assert not out.exists()


def test_one_request_block_size_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "one.png"
    assert main(["demo", "--num-requests", "1", "--max-new-tokens", "2", "--block-size", "1",
                 "--out", str(out)]) == 0
    _assert_png(out)
    text = " ".join(capsys.readouterr().out.split())
    assert "1 request on a tiny Llama" in text and "1/1 request matches" in text
    assert "1 requests" not in text


def test_demo_reports_a_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from blocktable.engine import verify

    real = verify.verify_requests

    def wrong(model, requests):  # type: ignore[no-untyped-def]
        return [
            verify.Verification(c.req_id, False, c.max_logits_diff, c.logits_bound)
            for c in real(model, requests)
        ]

    monkeypatch.setattr(verify, "verify_requests", wrong)
    assert main(["demo", *SMALL, "--quiet", "--out", str(tmp_path / "x.png")]) == 1


def _snapshot(block_size: int):  # type: ignore[no-untyped-def]
    from blocktable.picture import TableSnapshot

    table = np.zeros((3, 8), dtype=np.int32)
    table[0, :3] = [1, 2, 5]   # blocks 1, 2 shared with row 1
    table[1, :3] = [1, 2, 0]   # a filled entry holding the null block
    table[2, :1] = [6]
    ref = np.zeros(8, dtype=np.int32)
    ref[[1, 2]] = 2
    ref[[5, 6]] = 1
    return TableSnapshot(step=4, block_size=block_size, req_of_row={0: "a", 1: "b", 2: "c"},
                         num_new_tokens_of_row={0: 3, 2: 1}, block_table=table,
                         num_kernel_blocks=np.array([3, 3, 1], dtype=np.int32),
                         ref_counts=ref, cached=np.isin(np.arange(8), [1, 2, 3]))


def test_picture_legend_and_marks() -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from blocktable.picture import snapshot_figure

    fig = snapshot_figure(_snapshot(1))
    try:
        ax_table, ax_pool = fig.axes
        assert ax_table.get_xlabel() == "logical block j = token j"
        assert "+N tok: tokens the row computes in this step" in ax_table.get_title()
        labels = [t.get_text() for t in ax_pool.get_legend().get_texts()]
        for want in ("shared: 'id ×n' = block id held by n requests", "free",
                     "filled entry holding the null block", "empty: past the row's filled entries",
                     "null block 0 (never handed out)"):
            assert any(label.startswith(want) for label in labels), want
        texts = {t.get_text() for t in ax_table.texts}
        assert {"1 ×2", "2 ×2", "5", "6"} <= texts
        cells = {(round(p.get_x()), round(p.get_y())): p for p in ax_table.patches
                 if isinstance(p, Rectangle)}
        shared, own, null_entry, empty = cells[(0, 2)], cells[(2, 2)], cells[(2, 1)], cells[(1, 0)]
        assert shared.get_hatch() and not own.get_hatch()
        assert shared.get_facecolor() == cells[(0, 1)].get_facecolor()  # same in both rows
        assert len({shared.get_facecolor(), own.get_facecolor(), null_entry.get_facecolor(),
                    empty.get_facecolor()}) == 4
        assert empty.get_linestyle() != own.get_linestyle()
    finally:
        plt.close(fig)
    fig = snapshot_figure(_snapshot(16))
    try:
        assert fig.axes[0].get_xlabel() == "logical block j (tokens 16·j .. 16·j+15)"
    finally:
        plt.close(fig)


def test_python_dash_m(tmp_path: Path) -> None:
    out = tmp_path / "m.png"
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "blocktable", "demo", *SMALL, "--quiet", "--out", str(out)],
        check=False, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5/5 requests match" in proc.stdout
    _assert_png(out)
