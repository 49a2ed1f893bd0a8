"""The request flow both OpenAI endpoints share: check the model name, map OpenAI's max_tokens onto the engine's
(the engine checks it against the context), split the request into engine choices, and run them (merged, in
choice order of arrival)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from steploop.common.lora_config import LoraConfig
from steploop.gateway.engine.engine_client import EngineClient
from steploop.gateway.errors import APIError, bad_request
from steploop.gateway.grammar_check import check_constraint, constraint_field
from steploop.gateway.model_state import ModelState
from steploop.gateway.openai_api.protocol import SamplingFields, choice_params
from steploop.gateway.openai_api.token_controls import bad_words_token_ids
from steploop.gateway.pause_gate import PauseGate
from steploop.gateway.text.beam_generation import beam_choices
from steploop.gateway.text.generation import Choice, TextEvent, generate_choice, merge
from steploop.gateway.text.tokenizer import Tokenizer

# The API a generation request came through, by the field its prompt is in (vLLM names it when refusing).
API_BY_PARAM = {"prompt": "Completions", "messages": "Chat Completions", "input": "Responses"}


class Serving:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model: ModelState,
                 lora: LoraConfig | None = None, gate: PauseGate | None = None,
                 keep_special_tokens: bool = False) -> None:
        self.engine = engine
        self.keep_special_tokens = keep_special_tokens   # the reasoning parser reads special tokens (harmony)
        self.tokenizer = tokenizer
        self.model = model
        self.lora = lora or LoraConfig()     # --enable-lora, --allow-runtime-lora-updating
        self.gate = gate or PauseGate(0.0)   # POST /pause: new requests wait here (pause_gate.py)

    def check_model(self, name: str | None) -> str:
        """The LoRA adapter a request's `model` names ("" = the base model), or 404 model_not_found. With
        --enable-lora an adapter this gateway has not heard of yet (loaded through another gateway) goes to the
        engine, which knows: it answers 404 in the same shape for a name it does not serve."""
        if name is None or name == self.model.served_model_name:
            return ""
        if self.lora.enable_lora or name in self.model.lora_adapters:
            return name
        raise APIError(404, f"The model '{name}' does not exist; this server serves "
                            f"'{self.model.served_model_name}'", param="model", code="model_not_found")

    def engine_max_tokens(self, prompt_len: int, sampling: SamplingFields, param: str) -> int | None:
        """OpenAI's max_tokens as the engine takes it: None (unset) is what fits; completions' default of 16 came
        from the parser. Echo with max_tokens 0 asks for one token, which the gateway drops. The model's
        generation_config max_new_tokens caps it, set or not (as vLLM's get_max_tokens). The engine alone checks
        prompt + max_tokens against the context (and min_tokens against what fits, when max_tokens is unset)."""
        if prompt_len == 0:
            raise bad_request(f"'{param}' is empty (0 tokens)", param=param, code="empty_prompt")
        if sampling.max_tokens and sampling.min_tokens > sampling.max_tokens:   # wrong whatever the context
            raise bad_request(f"'min_tokens' ({sampling.min_tokens}) must be <= max_tokens ({sampling.max_tokens})",
                              param="min_tokens")
        if sampling.max_tokens == 0:
            return 1
        cap = self.model.generation_defaults.max_tokens
        return sampling.max_tokens if cap is None else min(cap, sampling.max_tokens or cap)

    async def make_choices(self, request_id: str, prompts: Sequence[Sequence[int]], sampling: SamplingFields,
                           param: str, prompt_texts: Sequence[str | None] | None = None, *,
                           api: str | None = None, lora_name: str = "", mm_features: Sequence = ()) -> list[Choice]:
        """n choices per prompt, indexed prompt-major: prompt i's choices are i*n .. i*n+n-1. Seeded choices get
        seeds seed, seed+1, ... so the n samples differ (and repeat across runs). A pooling model (embeddings
        only) refuses them: a 400 naming `api` (by default the API whose prompt field is `param`)."""
        await self.gate.wait_open()
        await self.model.check_serves("generate", api or API_BY_PARAM.get(param, "Completions"))
        await check_constraint(sampling)     # a grammar that cannot be enforced as written: 400 before any work
        keep = sampling.truncate_prompt_tokens
        if keep == -1:                       # vLLM's "the model's context length" (unknown yet: nothing to cut)
            keep = await self.model.known_max_model_len()
        bad_words = await bad_words_token_ids(self.tokenizer, sampling.bad_words, self.model.vocab_size or None) \
            if sampling.bad_words else ()
        self.model.check_queueable(len(prompts) * (1 if sampling.beam is not None else sampling.n),
                                   "n" if len(prompts) == 1 else param)
        choices = []
        for p, prompt_ids in enumerate(prompts):
            prompt_text = prompt_texts[p] if prompt_texts else None
            if keep is not None and len(prompt_ids) > keep:      # left truncation: the last `keep` tokens stay
                prompt_ids, prompt_text = list(prompt_ids)[-keep:], None   # echo shows what the model saw
            params = sampling.to_sampling_params(self.engine_max_tokens(len(prompt_ids), sampling, param), bad_words)
            for k in range(sampling.n):
                index = p * sampling.n + k
                choices.append(Choice(index=index, request_id=f"{request_id}-{index}", prompt_ids=prompt_ids,
                                      params=choice_params(params, k), stop=sampling.stop,
                                      include_stop_str_in_output=sampling.include_stop_str_in_output,
                                      skip_special_tokens=sampling.skip_special_tokens and not self.keep_special_tokens,
                                      echo=sampling.echo,
                                      prompt_text=prompt_text,
                                      drop_output=sampling.max_tokens == 0, priority=sampling.priority,
                                      cache_salt=sampling.cache_salt, prompt_param=param, lora_name=lora_name,
                                      disaggregation=sampling.disaggregation,
                                      constraint_param=constraint_field(sampling),
                                      prompt_logprobs=sampling.prompt_logprobs, mm_features=tuple(mm_features),
                                      beam=sampling.beam, prompt_index=p))
        return choices

    def run(self, choices: Sequence[Choice]) -> AsyncIterator[TextEvent]:
        if choices and choices[0].beam is not None:
            groups: dict[int, list[Choice]] = {}
            for c in choices:
                groups.setdefault(c.prompt_index, []).append(c)
            return merge([self._beams(group) for group in groups.values()])
        return merge([generate_choice(self.engine, self.tokenizer, c) for c in choices])

    def _beams(self, choices: Sequence[Choice]) -> AsyncIterator[TextEvent]:
        """One prompt's beam search, run by the scheduler (beam_generation.py): it ends beams on EOS (unless
        ignore_eos) and stop_token_ids, as sampled choices end; max_tokens unset is what fits in the context."""
        params = choices[0].params
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.model.max_model_len - len(choices[0].prompt_ids)
        if max_tokens < 1:
            raise bad_request(f"the prompt ({len(choices[0].prompt_ids)} tokens) leaves no room in the context "
                              f"({self.model.max_model_len}) for a beam", param=choices[0].prompt_param)
        if self.model.max_model_len and len(choices[0].prompt_ids) + max_tokens > self.model.max_model_len:
            raise bad_request(f"'max_tokens' ({max_tokens}) and the prompt ({len(choices[0].prompt_ids)} tokens) "
                              f"exceed the context ({self.model.max_model_len})", param="max_tokens")
        return beam_choices(self.engine, self.tokenizer, choices, choices[0].beam, max_tokens)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
