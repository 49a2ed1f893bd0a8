"""The model folder's tokenizer: prompt encoding and chat templates, run off the event loop.

transformers imports torch at package import whenever torch is installed (transformers/utils/generic.py), and
the gateway must never load torch. USE_TORCH=0 tells transformers to act as if torch were absent; tokenizers,
chat templates and configs work without it. transformers reads it once, at its first import, so it is imported
only inside `load_tokenizer` (never at module level), with the variables set just for that import: processes
started later from the same environment (a worker) must still see torch. If transformers is already imported
(a test process), it is reused as it is.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# The advisory flag silences "None of PyTorch, TensorFlow or Flax found", which is exactly what we want.
_NO_FRAMEWORKS = {"USE_TORCH": "0", "USE_TF": "0", "USE_FLAX": "0", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def import_without_torch(name: str) -> Any:
    """transformers' `name` (AutoTokenizer, AutoImageProcessor), imported with every framework switched off, so the
    gateway process never loads torch."""
    saved = {key: os.environ.get(key) for key in _NO_FRAMEWORKS}
    os.environ.update(_NO_FRAMEWORKS)
    try:
        import transformers  # noqa: PLC0415 - deliberately lazy, see the module docstring
        return getattr(transformers, name)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _import_auto_tokenizer() -> Any:
    return import_without_torch("AutoTokenizer")


class Tokenizer:
    """Wraps a HuggingFace tokenizer. Encoding runs in one worker thread: long prompts and Jinja rendering are
    CPU work that would stall every stream on the loop, and one thread avoids the fast tokenizer's
    "Already borrowed" errors under concurrent use. Decoding is small and stays on the loop (detokenizer.py)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._rust = _rust_decoder(hf_tokenizer)
        self._clean_up = bool(getattr(hf_tokenizer, "clean_up_tokenization_spaces", False))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """What hf.decode returns. The detokenizer calls this twice per streamed token; transformers' wrapper
        around the Rust decoder cost ~6x the decode itself (0.44 of 0.85 s of gateway CPU while 64 streams ran)."""
        if self._rust is None:
            return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        text = self._rust.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.clean_up_tokenization(text) if self._clean_up else text

    def encode_sync(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def chat_template(self) -> Any:
        """The model's chat template source (None when the folder has none)."""
        return self.hf.chat_template

    def chat_sync(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                  add_generation_prompt: bool = True, continue_final_message: bool = False,
                  template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Renders messages as chat_template.py prepared them (`tools`: OpenAI tool specs for the template;
        `template_kwargs`: extra variables the template may read)."""
        if self.hf.chat_template is None:
            raise ValueError("the model folder has no chat template; use /v1/completions")
        ids = self.hf.apply_chat_template(list(messages), tools=tools, tokenize=True,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, **(template_kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):   # a BatchEncoding on some versions
            ids = ids["input_ids"]
        return list(ids)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.encode_sync, text, add_special_tokens)

    async def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                                  add_generation_prompt: bool = True, continue_final_message: bool = False,
                                  template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: self.chat_sync(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                   continue_final_message=continue_final_message,
                                                   template_kwargs=template_kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _rust_decoder(hf_tokenizer: Any) -> Any | None:
    """The `tokenizers` object behind a fast tokenizer whose decode is transformers' plain one (Rust decode, then
    the optional clean-up); None for slow tokenizers and for classes that override decoding."""
    if not getattr(hf_tokenizer, "is_fast", False):
        return None
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers is imported by now
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # noqa: PLC0415
    cls = type(hf_tokenizer)
    if cls._decode is not PreTrainedTokenizerFast._decode or cls.decode is not PreTrainedTokenizerBase.decode:
        return None
    return hf_tokenizer.backend_tokenizer


def load_tokenizer(model_dir: str | pathlib.Path) -> Tokenizer:
    """Loads the tokenizer saved in a local model folder; never downloads."""
    auto = _import_auto_tokenizer()
    return Tokenizer(auto.from_pretrained(str(model_dir), local_files_only=True))
