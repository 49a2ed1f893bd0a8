"""The request flow both OpenAI endpoints share: check the model name, fit the prompt into the context, split
the request into engine choices, and run them (merged, in choice order of arrival)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from services.gateway.engine_client import EngineClient
from services.gateway.errors import APIError, bad_request
from services.gateway.generation import Choice, TextEvent, generate_choice, merge
from services.gateway.model_state import ModelState
from services.gateway.protocol import SamplingFields, choice_params
from services.gateway.tokenizer import Tokenizer


class Serving:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model: ModelState) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.served_model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.model.served_model_name}'", param="model", code="model_not_found")

    async def fit_max_tokens(self, prompt_len: int, sampling: SamplingFields, param: str) -> int:
        """max_tokens to send: the requested one if prompt + it fits the context, else what fits; 400 if none."""
        if prompt_len == 0:
            raise bad_request(f"'{param}' is empty (0 tokens)", param=param, code="empty_prompt")
        max_len = await self.model.require_max_model_len()
        if sampling.max_tokens == 0 and prompt_len < max_len:
            return 0     # echo only: the engine runs one token, which the gateway drops
        wanted = sampling.max_tokens if sampling.max_tokens is not None else max(max_len - prompt_len, 0)
        if prompt_len + max(wanted, 1) > max_len:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + wanted} tokens ({prompt_len} in the {param}, {wanted} in the completion). "
                f"Please reduce the length of the {param} or of max_tokens.",
                param=param if prompt_len >= max_len else "max_tokens",   # the part that does not fit
                code="context_length_exceeded")
        if sampling.min_tokens > wanted:   # also when max_tokens is implicit (what fits): EOS could never end it
            raise bad_request(f"'min_tokens' ({sampling.min_tokens}) must be <= max_tokens ({wanted}"
                              f"{'' if sampling.max_tokens is not None else ', what fits in the context'})",
                              param="min_tokens")
        return wanted

    async def make_choices(self, request_id: str, prompts: Sequence[Sequence[int]], sampling: SamplingFields,
                           param: str, prompt_texts: Sequence[str | None] | None = None) -> list[Choice]:
        """n choices per prompt, indexed prompt-major: prompt i's choices are i*n .. i*n+n-1. Seeded choices get
        seeds seed, seed+1, ... so the n samples differ (and repeat across runs)."""
        choices = []
        for p, prompt_ids in enumerate(prompts):
            max_tokens = await self.fit_max_tokens(len(prompt_ids), sampling, param)
            params = sampling.to_sampling_params(max_tokens)
            for k in range(sampling.n):
                index = p * sampling.n + k
                choices.append(Choice(index=index, request_id=f"{request_id}-{index}", prompt_ids=prompt_ids,
                                      params=choice_params(params, k), stop=sampling.stop,
                                      include_stop_str_in_output=sampling.include_stop_str_in_output,
                                      skip_special_tokens=sampling.skip_special_tokens, echo=sampling.echo,
                                      prompt_text=prompt_texts[p] if prompt_texts else None,
                                      drop_output=max_tokens == 0, priority=sampling.priority,
                                      cache_salt=sampling.cache_salt))
        return choices

    def run(self, choices: Sequence[Choice]) -> AsyncIterator[TextEvent]:
        return merge([generate_choice(self.engine, self.tokenizer, c) for c in choices])
