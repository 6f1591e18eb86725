"""``blocktable demo``: runs, verifies, draws a PNG; bad options exit 2, a mismatch exits 1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from blocktable.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Small, but with prefix hits, chunked prefill and preemptions (10 blocks are tight).
SMALL = ["--num-requests", "5", "--max-new-tokens", "6", "--num-blocks", "10",
         "--token-budget", "12"]
SRC = Path(__file__).resolve().parents[1] / "src"


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


def test_demo_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pics" / "x.png"
    assert main(["demo", *SMALL, "--out", str(out)]) == 0
    _assert_png(out)
    text = capsys.readouterr().out
    assert "5/5 requests match" in text and "summary" in text
    preemptions = re.search(r"preemptions\s*│\s*(\d+)", text)
    assert preemptions is not None and int(preemptions.group(1)) >= 1


def test_demo_picture_step_and_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.png"
    assert main(["demo", *SMALL, "--picture-step", "3", "--quiet", "--out", str(out)]) == 0
    _assert_png(out)
    text = capsys.readouterr().out
    assert "picture of step 3" in text and "summary" not in text


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


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no command
        ["demo", "--bogus"],
        ["demo", "--num-requests", "-1"],
        ["demo", "--num-requests", "two"],
        ["demo", "--block-size", "0"],
        ["demo", "--token-budget", "0"],
        ["demo", "--max-new-tokens", "0"],
        ["demo", "--num-blocks", "3"],  # the longest request cannot fit
        ["demo", "--picture-step", "-2"],
        ["demo", "--device", "tpu"],
        ["demo", "--out", "picture.jpg"],
    ],
)
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--num-requests", "--seed", "--block-size", "--num-blocks", "--max-new-tokens",
                   "--token-budget", "--device", "--out", "--picture-step", "--quiet"):
        assert option in text


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
