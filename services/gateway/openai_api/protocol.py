"""Request bodies of /v1/completions and /v1/chat/completions, parsed and validated into small frozen types.

Fields outside OpenAI's API that vLLM also accepts (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, add_generation_prompt, continue_final_message)
are accepted; unknown fields are ignored, as OpenAI's SDK passes extra_body through. Features not built (best_of
> 1 without beam search, suffix, the deprecated functions, vLLM's extras in vllm_extras.py) fail with a 400 naming the field, rather
than being silently ignored. Tools: tools.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from steploop.common.beam_ranking import BeamConfig
from steploop.common.generation_defaults import NO_DEFAULTS, GenerationDefaults
from steploop.common.sampling_params import SamplingParams
from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v
from steploop.gateway.media.parts import openai_image_part
from steploop.gateway.openai_api.beam_fields import parse_beam, refuse_with_beams
from steploop.gateway.openai_api.token_controls import parse_allowed_token_ids, parse_bad_words
from steploop.gateway.openai_api.vllm_extras import Constraint, not_supported, refuse_not_built, structured_output
from steploop.gateway.tool_parsers import ToolParser
from steploop.gateway.tool_parsers.tools import ToolRequest, parse_tools

MAX_N = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20        # top logprobs per token (OpenAI: 20 for chat, 5 for completions; vLLM allows 20)
MAX_LOGIT_BIAS = 100.0   # |bias| per token, as OpenAI
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class SamplingFields:
    """What both endpoints share; `max_tokens` None means "as many as fit in the context"."""
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    n: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    min_tokens: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    stream: bool
    include_usage: bool      # stream_options.include_usage: one extra chunk with usage before [DONE]
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = -1       # -1 none; k >= 0: the token's logprob plus the top k
    echo: bool = False       # completions: the prompt leads the text (with prompt logprobs when logprobs >= 0)
    json_schema: str = ""    # response_format json_schema: the schema as JSON text
    json_object: bool = False  # response_format json_object
    regex: str = ""          # vLLM's guided_regex, or guided_choice as a regex of the escaped alternatives
    grammar: str = ""        # vLLM's guided_grammar: EBNF / GBNF
    structural_tag: str = ""   # vLLM's structural_tag: xgrammar's JSON
    constrained_by: str = ""   # the request field that set the constraint above ("" when none did)
    priority: int = 0        # vLLM's extra: lower runs first under --scheduling-policy priority
    cache_salt: str = ""     # vLLM's extra: mixed into the prefix-cache hash, so tenants share no cached blocks
    disaggregation: str = ""  # steploop's extra: "disaggregated" / "local" forces where the prompt runs (P/D)
    truncate_prompt_tokens: int | None = None   # vLLM's extra: keep the prompt's last k tokens (-1: the context)
    prompt_logprobs: int = -1   # vLLM's extra: -1 none; k >= 0 each prompt token's logprob and rank, plus the top k
    allowed_token_ids: tuple[int, ...] = ()     # vLLM's extra: only these may be sampled (token_controls.py)
    bad_words: tuple[str, ...] = ()             # vLLM's extra: never generated (tokenized by Serving)
    beam: BeamConfig | None = None              # vLLM's use_beam_search (beam_fields.py); None: sampling

    def to_sampling_params(self, max_tokens: int | None,
                           bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        """max_tokens as the engine gets it (None: what fits; see Serving.engine_max_tokens). Echo with max_tokens
        0 runs one token that the gateway drops, so min_tokens does not apply to it. bad_words: the token ids of
        self.bad_words (token_controls.bad_words_token_ids)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=max_tokens, min_tokens=0 if self.max_tokens == 0 else self.min_tokens,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=self.logprobs, logit_bias=self.logit_bias,
            prompt_logprobs=max(self.logprobs if self.echo else -1, self.prompt_logprobs),   # both views, one run
            json_schema=self.json_schema, json_object=self.json_object, regex=self.regex, grammar=self.grammar,
            structural_tag=self.structural_tag, allowed_token_ids=self.allowed_token_ids, bad_words=bad_words)


def choice_params(params: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n parallel samples: a seeded request gets seed + k (as vLLM), so the n differ yet repeat."""
    if k == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + k) % 2**64)


def _parse_logit_bias(body: dict[str, Any], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """{"token id as a string": bias in [-100, 100]}."""
    value = v.get_object(body, "logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
        if token < 0 or (vocab_size and token >= vocab_size):
            raise bad_request(f"'logit_bias' token id {token} is out of range", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} for {key}",
                              param="logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))


def _parse_response_format(body: dict[str, Any]) -> Constraint | None:
    """response_format, or vLLM's structured_outputs / guided_json / guided_choice (vllm_extras.py): what
    constrains the reply, or None."""
    fmt = v.get_object(body, "response_format")
    kind = fmt.get("type", "text") if fmt else "text"
    vllm = structured_output(body)
    if vllm is not None:
        if kind != "text":
            raise bad_request(f"'response_format' and '{vllm.field}' name the same constraint: give one",
                              param=vllm.field)
        return vllm
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("response_format", json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                              param="response_format")
        v.check_json_schema(schema, "response_format.json_schema.schema", "response_format")
        return Constraint("response_format", schema=schema)
    raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      param="response_format")


def parse_sampling(body: dict[str, Any], max_tokens: int | None, vocab_size: int | None,
                   defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingFields:
    """`defaults`: the model's (generation_config.json) for the fields the body leaves unset."""
    stream = v.get_bool(body, "stream", False)
    stream_options = v.get_object(body, "stream_options")
    if stream_options and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    refuse_not_built(body)
    stop_token_ids = body.get("stop_token_ids")
    constraint = _parse_response_format(body) or Constraint("")
    n = v.get_int(body, "n", 1, lo=1, hi=MAX_N)
    fields = SamplingFields(
        max_tokens=max_tokens,
        temperature=v.get_number(body, "temperature", defaults.get("temperature", 1.0), lo=0.0, hi=2.0),
        top_p=v.get_number(body, "top_p", defaults.get("top_p", 1.0), lo=0.0, hi=1.0, lo_exclusive=True),
        top_k=v.get_int(body, "top_k", defaults.get("top_k", 0), lo=-1, hi=v.MAX_INT32),
        min_p=v.get_number(body, "min_p", defaults.get("min_p", 0.0), lo=0.0, hi=1.0),
        seed=v.get_int(body, "seed", None, lo=0, hi=2**64 - 1),
        presence_penalty=v.get_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=v.get_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=v.get_number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0), lo=0.0,
                                        lo_exclusive=True),
        n=n,
        stop=v.get_stop(body),
        stop_token_ids=() if stop_token_ids is None else v.get_token_ids(stop_token_ids, "stop_token_ids", vocab_size),
        ignore_eos=v.get_bool(body, "ignore_eos", False),
        min_tokens=v.get_int(body, "min_tokens", 0, lo=0, hi=v.MAX_UINT32),   # <= max_tokens: the engine checks
        include_stop_str_in_output=v.get_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=v.get_bool(body, "skip_special_tokens", True),
        stream=stream,
        include_usage=stream and v.get_bool(stream_options, "include_usage", False),
        logit_bias=_parse_logit_bias(body, vocab_size),
        json_schema="" if constraint.schema is None else json.dumps(constraint.schema),
        json_object=constraint.json_object,
        regex=constraint.regex,
        grammar=constraint.grammar,
        structural_tag=constraint.structural_tag,
        constrained_by=constraint.field,
        priority=v.get_int(body, "priority", 0, lo=-2**31, hi=2**31 - 1),
        cache_salt=v.get_str(body, "cache_salt", "") or "",
        disaggregation=_parse_disaggregation(body),
        truncate_prompt_tokens=_parse_truncation(body),
        prompt_logprobs=_parse_prompt_logprobs(body, stream),
        allowed_token_ids=parse_allowed_token_ids(body, vocab_size),
        bad_words=parse_bad_words(body),
        beam=parse_beam(body, n),
    )
    if fields.beam is not None:
        refuse_with_beams(body, fields)
    return fields


def _parse_prompt_logprobs(body: dict[str, Any], stream: bool) -> int:
    """vLLM's prompt_logprobs: null = none, k in [0, 20]. As vLLM, not with stream (they would all come first) and
    not -1 (the whole vocabulary: over the top-k limit)."""
    k = v.get_int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if k is not None and stream:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    return -1 if k is None else k


def _parse_disaggregation(body: dict[str, Any]) -> str:
    mode = v.get_str(body, "disaggregation", "") or ""
    if mode not in ("", "disaggregated", "local"):
        raise bad_request(f"'disaggregation' must be 'disaggregated' or 'local', got {mode!r}", param="disaggregation")
    return mode


def _parse_truncation(body: dict[str, Any]) -> int | None:
    value = v.get_int(body, "truncate_prompt_tokens", None, lo=-1, hi=v.MAX_UINT32)
    if value == 0:
        raise bad_request("'truncate_prompt_tokens' must be -1 (the context length) or at least 1, got 0",
                          param="truncate_prompt_tokens")
    return value


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]   # text or token ids; each prompt gets n choices, in order
    sampling: SamplingFields
    user: str | None


def _parse_prompts(value: Any, vocab_size: int | None) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            if "" in value:
                raise bad_request("'prompt' must not be empty", param="prompt", code="empty_prompt")
            return tuple(value)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return (v.get_token_ids(value, "prompt", vocab_size),)
        if all(isinstance(p, list) for p in value):
            return tuple(v.get_token_ids(p, "prompt", vocab_size) for p in value)
    if value is None:
        raise bad_request("'prompt' is required", param="prompt", code="missing_required_parameter")
    raise v.type_error("prompt", "a string, an array of strings, or an array of token ids (non-empty)", value)


def parse_completion(body: Any, vocab_size: int | None = None,
                     defaults: GenerationDefaults = NO_DEFAULTS) -> CompletionRequest:
    body = v.require_object(body)
    if v.get_str(body, "suffix"):
        raise not_supported("suffix")
    echo = v.get_bool(body, "echo", False)
    logprobs = v.get_int(body, "logprobs", -1, lo=0, hi=MAX_LOGPROBS)
    # OpenAI's legacy completions API and vLLM default to 16 tokens (chat's default is what fits the context).
    max_tokens = v.get_int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, lo=0, hi=v.MAX_UINT32)
    if max_tokens == 0 and not echo:
        raise bad_request("'max_tokens' must be >= 1 (0 is allowed only with 'echo')", param="max_tokens")
    sampling = parse_sampling(body, max_tokens, vocab_size, defaults)
    return CompletionRequest(
        model=v.get_str(body, "model"),
        prompts=_parse_prompts(body.get("prompt"), vocab_size),
        sampling=replace(sampling, logprobs=logprobs, echo=echo),
        user=v.get_str(body, "user"),
    )


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, Any], ...]   # {"role", "content"} with content flattened to text (+ tool fields)
    sampling: SamplingFields
    add_generation_prompt: bool
    continue_final_message: bool           # extend the last (assistant) message instead of starting a new one
    user: str | None
    tools: ToolRequest | None = None       # None: no tool may be called (no tools, or tool_choice "none")
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # chat_template_kwargs
    echo: str = ""                         # vLLM's `echo`: the last assistant message, put in front of the reply


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user message's text, or (with image_url parts) its parts in image_prompts.py's shared form."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url"
                                                for p in content):
        return _message_text(content, where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "image_url":
            parts.append({"type": "image", "image": openai_image_part(part, f"{where}.content[{i}]")})
        else:
            parts.append({"type": "text", "text": _message_text([part], f"{where}.content[{i}]")})
    return parts


def _message_text(content: Any, where: str, role: str = "user") -> str:
    """A message's text. An assistant turn may hold OpenAI's refusal parts too; the template gets their text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
            else:
                raise bad_request(f"{where}.content[{i}] must be a text part {{'type': 'text', 'text': str}}"
                                  + (" or a refusal part {'type': 'refusal', 'refusal': str}" if role == "assistant"
                                     else "") + _part_problem(part, kind, role), param="messages")
        return "".join(texts)
    raise v.type_error(f"{where}.content", "a string or an array of text parts", content, param="messages")


def _part_problem(part: Any, kind: Any, role: str) -> str:
    if not isinstance(part, dict):
        return f", got {v.json_type(part)}"
    if kind == "text" or (kind == "refusal" and role == "assistant"):
        return f"; its '{kind}' is not a string"
    return f"; got type {kind!r} (images and audio are not supported here)"


def _parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
    """Errors name param "messages" (clients branch on that); the message text says which one and why."""
    if not isinstance(value, list):
        raise v.type_error("messages", "an array of messages", value)
    if not value:
        raise bad_request("'messages' must contain at least one message", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise v.type_error(where, "an object", message, param="messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            got = "is missing" if "role" not in message else f"is {role!r}"
            raise bad_request(f"{where}.role {got}; it must be one of {sorted(CHAT_ROLES)}", param="messages",
                              code="missing_required_parameter" if "role" not in message else "invalid_value")
        if role == "assistant" and (message.get("tool_calls") or message.get("content") is None):
            content = message.get("content")   # null: an assistant turn that only called tools
            entry = {"role": role, "content": "" if content is None else _message_text(content, where, role)}
            if message.get("tool_calls"):
                entry["tool_calls"] = _parse_tool_calls(message["tool_calls"], where)
            out.append(entry)
            continue
        entry = {"role": "system" if role == "developer" else role,   # OpenAI's newer name; templates know "system"
                 "content": (_user_content(message.get("content"), where) if role == "user"
                             else _message_text(message.get("content"), where, role))}
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise v.type_error(f"{where}.tool_call_id", "a string", call_id, param="messages")
            entry["tool_call_id"] = call_id
        out.append(entry)
    return tuple(out)


def _parse_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(value, list):
        raise v.type_error(f"{where}.tool_calls", "an array of tool calls", value, param="messages")
    out = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad_request(f"{where}.tool_calls[{i}] must be {{'id': str, 'type': 'function', 'function': "
                              f"{{'name': str, 'arguments': str}}}}", param="messages")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


# apply_chat_template's own arguments: chat_template_kwargs must not override them (each has its request field)
TEMPLATE_RESERVED = frozenset({
    "self", "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def parse_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: extra variables for the chat template (e.g. Qwen3's enable_thinking)."""
    kwargs = v.get_object(body, "chat_template_kwargs")
    clash = sorted(TEMPLATE_RESERVED & set(kwargs))
    if clash:
        raise bad_request(f"'chat_template_kwargs' must not set {', '.join(clash)} (the request has its own field, "
                          f"or the template cannot take it)", param="chat_template_kwargs")
    return dict(kwargs)


def parse_chat_messages(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], bool, bool]:
    """messages, add_generation_prompt, continue_final_message (chat and /tokenize share them)."""
    messages = _parse_messages(body.get("messages"))
    continue_final = v.get_bool(body, "continue_final_message", False)
    if continue_final and messages[-1]["role"] != "assistant":
        raise bad_request("'continue_final_message' needs the last message to be from the assistant",
                          param="continue_final_message")
    add_generation_prompt = v.get_bool(body, "add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          param="add_generation_prompt")
    return messages, add_generation_prompt, continue_final


def _refuse_audio_output(body: dict[str, Any]) -> None:
    """OpenAI's `modalities: ["text", "audio"]` and `audio` ask for a spoken reply in `message.audio`; a text-only
    answer to them would be silently other than asked, so they are a 400 (["text"] and null are accepted)."""
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise v.type_error("modalities", "an array of strings", modalities)
        if any(m != "text" for m in modalities):
            raise bad_request(f"'modalities' {modalities} asks for output steploop cannot produce: only 'text' is "
                              "supported", param="modalities", code="unsupported_parameter")
    if body.get("audio") is not None:
        raise not_supported("audio")


def parse_chat(body: Any, vocab_size: int | None, tool_parser: ToolParser,
               defaults: GenerationDefaults = NO_DEFAULTS) -> ChatRequest:
    """`tool_parser`: the format an "auto" tool call is written in (--tool-call-parser)."""
    body = v.require_object(body)
    echo = v.get_bool(body, "echo", False)
    _refuse_audio_output(body)
    logprobs = v.get_bool(body, "logprobs", False)
    top_logprobs = v.get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
    messages, add_generation_prompt, continue_final = parse_chat_messages(body)
    # max_completion_tokens is OpenAI's newer name; it wins when both are given.
    max_tokens = v.get_int(body, "max_completion_tokens", None, lo=1, hi=v.MAX_UINT32)
    if max_tokens is None:
        max_tokens = v.get_int(body, "max_tokens", None, lo=1, hi=v.MAX_UINT32)
    sampling = parse_sampling(body, max_tokens, vocab_size, defaults)
    tools = parse_tools(body, sampling.constrained_by, tool_parser)
    forced = tools.guided_schema() if tools is not None else ""
    if forced and sampling.beam is not None:
        raise bad_request("a forced tool call ('tool_choice') cannot be used with 'use_beam_search' (beam search "
                          "ranks the model's own logprobs)", param="tool_choice")
    if forced:   # a forced call: the worker's grammar writes valid calls
        sampling = replace(sampling, json_schema=forced)
    elif tools is not None and tool_parser.needs_special_tokens:   # its marker must survive detokenizing
        sampling = replace(sampling, skip_special_tokens=False)
    return ChatRequest(
        model=v.get_str(body, "model"),
        messages=messages,
        sampling=replace(sampling, logprobs=(top_logprobs or 0) if logprobs else -1),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        user=v.get_str(body, "user"),
        tools=tools,
        template_kwargs=parse_template_kwargs(body),
        echo=_echo_text(messages) if echo else "",
    )


def _echo_text(messages: tuple[dict[str, Any], ...]) -> str:
    """vLLM's chat `echo`: the reply starts with the last message when it is the assistant's own (the turn a
    `continue_final_message` request extends); after any other last message there is nothing to echo."""
    last = messages[-1]
    return (last.get("content") or "") if last["role"] == "assistant" and isinstance(last.get("content"), str) else ""
