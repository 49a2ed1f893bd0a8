"""LoRA adapters made with peft on the default model, and the oracle: transformers + peft, greedy.

Each adapter has random, non-zero B matrices (peft initializes B to zero, which would make the adapter a no-op
and every comparison trivial), scaled so the text changes but stays language.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

ATTENTION_ONLY = ("q_proj", "k_proj", "v_proj", "o_proj")
WITH_MLP = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterRecipe:
    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    seed: int
    b_std: float = 0.05
    use_rslora: bool = False


RECIPES = (AdapterRecipe("attn8", 8, 16, ATTENTION_ONLY, seed=1, b_std=0.3),
           AdapterRecipe("mlp16", 16, 32, WITH_MLP, seed=2, b_std=0.1, use_rslora=True))


def make_adapter(model_dir: pathlib.Path, out_dir: pathlib.Path, recipe: AdapterRecipe) -> pathlib.Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.targets),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", use_rslora=recipe.use_rslora)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * recipe.b_std)
    path = out_dir / recipe.name
    model.save_pretrained(path)
    return path


class PeftReference:
    """transformers + peft on the same base weights: greedy ids per adapter (None = the base model)."""

    def __init__(self, model_dir: pathlib.Path, adapters: dict[str, pathlib.Path]) -> None:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.cache: dict[tuple, tuple[int, ...]] = {}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)

    def greedy_ids(self, adapter: str | None, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
        key = (adapter, prompt_ids, max_new_tokens)
        if key not in self.cache:
            self.cache[key] = self._generate(adapter, prompt_ids, max_new_tokens)
        return self.cache[key]

    def _generate(self, adapter: str | None, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": eos, "pad_token_id": eos}
        with self.torch.no_grad():
            ids = self.torch.tensor([prompt_ids])
            if adapter is None:
                with self.model.disable_adapter():
                    out = self.model.generate(input_ids=ids, **kwargs)
            else:
                self.model.set_adapter(adapter)
                out = self.model.generate(input_ids=ids, **kwargs)
        new = out[0, len(prompt_ids):].tolist()
        return tuple(new[:new.index(eos)] if eos in new else new)

    def greedy_text(self, adapter: str | None, prompt_ids: list[int], max_new_tokens: int) -> str:
        return self.tokenizer.decode(self.greedy_ids(adapter, tuple(prompt_ids), max_new_tokens),
                                     skip_special_tokens=True)
