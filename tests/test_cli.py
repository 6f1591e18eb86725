"""The command line: help, --version and every refusal answer fast (no torch), with the
demo's usage and one error line, exit 2; every number has a bound checked before the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blocktable import cli
from blocktable.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"

# Runs each argv through main() in one fresh interpreter and reports, per argv, the exit code
# and whether torch or numpy had been imported by then.
_PROBE = """
import json, sys
from blocktable.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out.append([code, "torch" in sys.modules, "numpy" in sys.modules])
print("PROBE" + json.dumps(out))
"""


def _probe(argvs: list[list[str]], cwd: Path) -> list[list[object]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs)], capture_output=True,
                          text=True, env=env, timeout=120, cwd=cwd, check=False)
    line = [x for x in proc.stdout.splitlines() if x.startswith("PROBE")]
    assert line, proc.stdout + proc.stderr
    return json.loads(line[0][5:])  # type: ignore[no-any-return]


def test_help_version_and_refusals_never_import_torch(tmp_path: Path) -> None:
    argvs = [
        ["--help"], ["demo", "--help"], ["--version"], [], ["demo", "--bogus"],
        ["demo", "--num-blocks", "99999999999999999999"], ["demo", "--token-budget", "99999999999"],
        ["demo", "--block-size", "100000"], ["demo", "--num-requests", "100000"],
        ["demo", "--out", "/proc/x.png"], ["demo", "--dcp", "9"],
        ["demo", "--model", "no-such-model"], ["demo", "--model", "smollm2", "--dcp", "9"],
        ["demo", "--model", "smollm2", "--temperature", "-1"],
        ["demo", "--disaggregate", "--model", "smollm2", "--dcp", "2"],
    ]
    results = _probe(argvs, tmp_path)
    for argv, (code, torch_loaded, numpy_loaded) in zip(argvs, results):
        assert code == (0 if argv in (["--help"], ["demo", "--help"], ["--version"]) else 2), argv
        assert not torch_loaded and not numpy_loaded, argv


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import blocktable

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    from blocktable._compiled_loader import describe

    assert capsys.readouterr().out.strip() == (
        f"blocktable {blocktable.__version__} (CPU slot mapping: {describe()})")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--num-blocks", "1000000000000"], "--num-blocks 1000000000000 is out of range [2, 1024]"),
        (["--num-blocks", "99999999999999999999"], "out of range [2, 1024]"),
        (["--token-budget", "99999999999"], "--token-budget 99999999999 is out of range"),
        (["--block-size", "100000"], "prompts grow to 6 blocks"),
        (["--num-requests", "100000"], "--num-requests 100000 is out of range [1, 32]"),
        (["--max-new-tokens", "100000"], "out of range [1, 64]"),
        (["--num-requests", "32", "--max-new-tokens", "64"], "generated tokens is over 1024"),
        (["--seed", "-1"], "--seed -1 is out of range"),
        (["--seed", str(2**40)], "seeds are 32-bit"),
        (["--picture-step", "-2"], "--picture-step -2 is out of range"),
        (["--dcp", "0"], "--dcp 0 is out of range [1, 8]"),
        (["--dcp", "9"], "--dcp 9 is out of range [1, 8]"),
        (["--cp-interleave", "3"], "--cp-interleave 3 must divide --block-size 4"),
        (["--num-requests", "-1"], "--num-requests -1 is out of range"),
        (["--block-size", "0"], "--block-size 0 is out of range"),
        (["--token-budget", "0"], "--token-budget 0 is out of range"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0 is out of range"),
        (["--num-blocks", "3"], "the longest request needs"),  # needs the workload
        (["--out", "picture.jpg"], "must name a .png file"),
        (["--out", "/proc/x.png"], "cannot be written"),
        (["--out", "/no/such/folder/x.png"], "does not exist"),
        (["--device", "tpu"], "invalid choice"),
        (["--num-requests", "two"], "invalid int value"),
        (["--model", "no-such-model"], "unknown model 'no-such-model': not a known name (smollm2)"),
        (["--model", "smollm2", "--dcp", "9"], "--dcp 9 is out of range [1, 8]"),
        (["--model", "smollm2", "--num-requests", "3"], "with --model use --prompt"),
        (["--prompt", "hi"], "--prompt needs --model"),
        (["--model-cache", "/tmp"], "--model-cache needs --model"),
        (["--model", "smollm2", "--prompt", " "], "--prompt must not be empty"),
        (["--model", "smollm2", "--temperature", "nan"], "--temperature nan is out of range"),
        (["--model", "smollm2", "--top-p", "0"], "--top-p 0.0 is out of range (0, 1]"),
        (["--model", "smollm2", "--top-k", "-1"], "--top-k -1 must be >= 0"),
        (["--model", "smollm2", "--threads", "-1"], "--threads -1 is out of range"),
        (["--model", "smollm2", "--max-new-tokens", "65"], "out of range [1, 64]"),
        (["--disaggregate", "--dcp", "2"],
         "--disaggregate runs one prefill and one decode process; it does not take --dcp"),
        (["--disaggregate", "--model", "smollm2", "--dcp", "2"], "it does not take --dcp"),
        (["--disaggregate", "--model", "smollm2", "--temperature", "0.7"],
         ("--disaggregate decodes greedily (a sampler's state does not move with the KV): "
          "drop --temperature 0.7")),
        (["--disaggregate", "--max-new-tokens", "1"],
         "--disaggregate needs --max-new-tokens >= 2 (the prefill side samples the first"),
        (["--disaggregate", "--model", "smollm2", "--max-new-tokens", "1"],
         "--disaggregate needs --max-new-tokens >= 2"),
        (["--disaggregate", "--offload"], "--offload and --disaggregate are separate demos"),
    ],
)
def test_bad_option_exits_2_with_the_demo_usage(argv: list[str], needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: blocktable demo ")
    error_lines = [x for x in err.splitlines() if "error:" in x]
    assert len(error_lines) == 1 and error_lines[0].startswith("blocktable demo: error: ")
    assert needle in error_lines[0]


def test_out_directory_and_probe_leaves_nothing(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "is a directory" in capsys.readouterr().err
    # a valid --out with a bad option after the probe: the probe's file is removed again
    out = tmp_path / "x.png"
    with pytest.raises(SystemExit):
        main(["demo", "--out", str(out), "--num-blocks", "3"])
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cuda", "--out", "/tmp/never.png"])
    assert exc.value.code == 2 and "torch sees no CUDA device" in capsys.readouterr().err


def test_no_top_level_heavy_imports() -> None:
    names = set(vars(cli))
    assert not {"torch", "numpy", "np", "DemoOptions", "run_demo"} & names


def test_help_documents_every_option_and_the_prompt_growth(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--num-requests", "--seed", "--block-size", "--num-blocks", "--max-new-tokens",
                   "--token-budget", "--device", "--dcp", "--cp-interleave", "--merge-transport", "--out",
                   "--picture-step", "--quiet", "--model", "--model-cache", "--prompt",
                   "--temperature", "--top-p", "--top-k", "--threads"):
        assert option in text
    assert "prompt lengths grow with it" in text
    assert "Exit codes: 0" in text
    assert "smollm2" in text and "blocktable[models]" in text


@pytest.mark.parametrize("model", [None, "smollm2"])
def test_disaggregate_takes_the_tiny_model_or_a_real_one(
        model: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--disaggregate`` reaches the disaggregated demo with the model's name (each process
    loads it), the real model's sizes and the prompts; nothing is loaded here."""
    from blocktable import demo
    from blocktable.transfer import transfer_demo

    seen = []
    monkeypatch.setattr(transfer_demo, "run_disaggregated_demo",
                        lambda opts, console: seen.append(opts) or 0)
    argv = ["demo", "--disaggregate", "--out", str(tmp_path / "x.png")]
    if model is not None:
        argv += ["--model", model, "--prompt", "Hi there", "--threads", "1"]
    assert main(argv) == 0
    (opts,) = seen
    assert opts.disaggregate and opts.model == model and opts.dcp == 1
    if model is None:
        assert (opts.block_size, opts.max_new_tokens) == (4, 12)
    else:
        assert opts.prompts == ("Hi there",) and opts.threads == 1
        sizes = {k: getattr(opts, k) for k in demo.MODEL_DEFAULTS}
        assert sizes == demo.MODEL_DEFAULTS


def test_disaggregate_with_a_model_that_cannot_load_is_one_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Resolved in the parent before any process starts: one error line, exit 2."""
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"nope, not a model")
    code = main(["demo", "--disaggregate", "--model", str(fake), "--prompt", "hi",
                 "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"blocktable demo: error: {fake}: not a GGUF file (it starts with "
                      "b'nope', not b'GGUF')")
