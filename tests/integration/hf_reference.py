"""The correctness oracle: HuggingFace transformers' LlamaForCausalLM on the same weights, greedy."""

from __future__ import annotations

import functools


class HFReference:
    def __init__(self, model_dir):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def chat_ids(self, messages) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    @functools.lru_cache(maxsize=None)
    def _greedy(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
        with self.torch.no_grad():
            out = self.model.generate(self.torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=self.tokenizer.eos_token_id,
                                      pad_token_id=self.tokenizer.eos_token_id)
        new = out[0, len(prompt_ids):].tolist()
        if self.tokenizer.eos_token_id in new:        # generate stops at EOS and includes it
            new = new[:new.index(self.tokenizer.eos_token_id)]
        return tuple(new)

    def greedy_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        return list(self._greedy(tuple(prompt_ids), max_new_tokens))

    def greedy_text(self, prompt_ids: list[int], max_new_tokens: int) -> str:
        return self.tokenizer.decode(self.greedy_ids(prompt_ids, max_new_tokens), skip_special_tokens=True)
