"""``blocktable demo --dcp 2``: bad options exit 2, a failed rank 3, a signal 128 + its number.

The run itself (two spawned processes, verified, summarized, drawn) is tested once, as a fresh
``[demo]`` install runs it, without Triton: ``tests/test_install.py``.
"""

from __future__ import annotations

import pytest

from blocktable.cli import main
from blocktable.context_parallel import launch
from blocktable.dcp_demo import run_dcp_demo
from blocktable.demo import DemoOptions


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--dcp", "9"], "--dcp 9 is out of range [1, 8]"),
     (["--dcp", "2", "--cp-interleave", "3"], "--cp-interleave 3 must divide --block-size 4"),
     (["--dcp", "2", "--num-blocks", "2"], "--num-blocks 2 is too small"),
     (["--dcp", "2", "--merge-transport", "p2p"],
      "--merge-transport p2p needs --dcp 2 or more and --device cuda (got --dcp 2, --device cpu)"),
     (["--merge-transport", "p2p", "--device", "cuda"], "needs --dcp 2 or more"),
     (["--dcp", "2", "--merge-transport", "nvlink"], "invalid choice: 'nvlink'")],
)
def test_dcp_bad_options_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        main(["demo", *args])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_a_failed_rank_exits_3_and_blames_it_first(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise launch.RankFailedError(
            2, {1: "the process was killed by SIGABRT (exit code -6) without a result",
                0: "RuntimeError: Connection closed by peer"},
            cause="died", signal_name="SIGABRT", exit_code=-6, last_steps=[4, 3])

    monkeypatch.setattr(launch, "run_ranks", fail)
    assert run_dcp_demo(DemoOptions(dcp=2, quiet=True)) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("FAILED: rank 1 of 2 died: killed by SIGABRT (exit code -6); the last "
                        "step it finished: 3 (others: rank 0: 4)")
    assert "rank 0 of 2 failed:" in lines and "RuntimeError: Connection closed by peer" in lines


def test_an_interrupted_run_exits_128_plus_the_signal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise launch.Interrupted(15)

    monkeypatch.setattr(launch, "run_ranks", interrupted)
    assert run_dcp_demo(DemoOptions(dcp=2, quiet=True)) == 143
    assert capsys.readouterr().out == (
        "blocktable demo --dcp 2: interrupted by SIGTERM: every rank was ended\n")
