"""The ranks live no longer than their parent, and a signal ends them all cleanly.

Three parents run at once, each with two spawned ranks: ``blocktable demo --dcp 2`` gets a
terminal's Ctrl-C (SIGINT to its whole process group), a small ``run_ranks`` script gets
SIGTERM, another gets SIGKILL. The first two must exit 130 / 143 with one line and leave no
rank and no file behind; after the third, no rank may outlive its parent by more than 10 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90.0  # to see both ranks started (process start is slow on a busy CI box)
EXIT_TIMEOUT_S = 10.0

SCRIPT = """
import sys, time
from blocktable.context_parallel.launch import Interrupted, run_ranks

def wait(rank, world):
    time.sleep(3600)

if __name__ == "__main__":
    try:
        run_ranks(wait, 2, timeout_s=300)
    except Interrupted as err:
        print(err)
        sys.exit(err.exit_code)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _ranks_of(parent: int) -> list[int]:
    """Pids of the spawned children of ``parent`` (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_ranks(proc: subprocess.Popen[str]) -> list[int]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ranks = _ranks_of(proc.pid)
        if len(ranks) == 2:
            return ranks
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the ranks of {proc.args} did not start within {START_TIMEOUT_S} s")


def _wait_gone(pids: list[int]) -> float:
    start = time.monotonic()
    while any(map(_alive, pids)) and time.monotonic() - start < EXIT_TIMEOUT_S:
        time.sleep(0.05)
    return time.monotonic() - start


def test_sigint_sigterm_and_a_killed_parent_leave_nothing_running(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    tmp = {name: tmp_path / f"tmp-{name}" for name in ("int", "term", "kill")}
    procs = {}
    for name, cmd in (
        ("int", [sys.executable, "-m", "blocktable", "demo", "--dcp", "2", "--quiet",
                 "--out", str(tmp_path / "never.png")]),
        ("term", [sys.executable, str(script)]),
        ("kill", [sys.executable, str(script)]),
    ):
        tmp[name].mkdir()
        env = {**os.environ, "TMPDIR": str(tmp[name]),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=env, start_new_session=True)
    try:
        ranks = {name: _wait_for_ranks(proc) for name, proc in procs.items()}
        os.killpg(procs["int"].pid, signal.SIGINT)  # Ctrl-C: the terminal's whole group
        procs["term"].send_signal(signal.SIGTERM)
        procs["kill"].kill()
        outputs = {name: proc.communicate(timeout=60)[0] for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    assert procs["int"].returncode == 130, outputs["int"]
    assert outputs["int"].strip() == ("blocktable demo --dcp 2: interrupted by SIGINT: every "
                                      "rank was ended"), outputs["int"]
    assert procs["term"].returncode == 143, outputs["term"]
    assert outputs["term"].strip() == "interrupted by SIGTERM: every rank was ended"
    assert procs["kill"].returncode == -signal.SIGKILL
    for name in ("int", "term", "kill"):
        assert _wait_gone(ranks[name]) < EXIT_TIMEOUT_S, f"{name}: a rank outlived its parent"
    for name in ("int", "term"):  # nothing on disk: the rendezvous is served by the parent
        left = [p.name for p in tmp[name].iterdir() if not p.name.startswith("torchinductor")]
        assert left == [], name  # (torch's own compile cache may appear; it is not ours)
