"""SamplingParams: how to pick tokens for one request. Mirrors steploop.v1.SamplingParams; converts at the edge.

`max_tokens` None means what the proto's unset field means: as many as fit in the context. The engine resolves it
(and checks prompt + max_tokens against the context) once, at admission (scheduler/request_outputs.py); from there
on the scheduler sees an int.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steploop.common.pb.steploop.v1 import engine_pb2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0            # 0 = greedy
    top_p: float = 1.0                  # 1 = off
    top_k: int = 0                      # 0 or -1 = off
    seed: int | None = None             # same seed, same tokens, whatever else is in the batch
    max_tokens: int | None = None       # completion tokens at most; None = what fits in the context
    min_tokens: int = 0                 # stop ids / EOS ignored before this many tokens
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = -1                  # -1 none; 0 sampled token only; k = plus top k
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), sorted by id
    prompt_logprobs: int = -1           # -1 none; 0 each prompt token's own logprob; k = plus top k
    json_schema: str = ""               # structured output: a JSON schema (JSON text) the output must match
    json_object: bool = False           # structured output: any one JSON object
    regex: str = ""                     # structured output: a regular expression the output must match
    grammar: str = ""                   # structured output: an EBNF / GBNF grammar (start rule `root`)
    structural_tag: str = ""            # structured output: an xgrammar structural tag, as JSON text
    allowed_token_ids: tuple[int, ...] = ()   # only these may be sampled; () = any
    bad_words: tuple[tuple[int, ...], ...] = ()  # token ids of each bad word (last banned after its prefix)

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies (the sampler then reads the outputs)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def structured(self) -> bool:
        return bool(self.json_schema) or self.json_object or bool(self.regex) or bool(self.grammar) \
            or bool(self.structural_tag)

    @property
    def constraint_fields(self) -> list[str]:
        """The structured-output fields set (at most one may be: the engine refuses more)."""
        return [name for name in ("json_schema", "json_object", "regex", "grammar", "structural_tag")
                if getattr(self, name)]

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_pb(self) -> engine_pb2.SamplingParams:
        pb = engine_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens,
            min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=self.logprobs, logit_bias=dict(self.logit_bias),
            json_schema=self.json_schema, json_object=self.json_object, regex=self.regex, grammar=self.grammar,
            structural_tag=self.structural_tag, allowed_token_ids=list(self.allowed_token_ids),
            bad_words=[engine_pb2.BadWordTokenIds(token_ids=list(w)) for w in self.bad_words])
        if self.seed is not None:
            pb.seed = self.seed
        if self.prompt_logprobs >= 0:
            pb.prompt_logprobs = self.prompt_logprobs
        return pb

    @classmethod
    def from_pb(cls, pb: engine_pb2.SamplingParams) -> "SamplingParams":
        return cls(
            temperature=pb.temperature,
            top_p=pb.top_p if pb.top_p > 0 else 1.0,
            top_k=pb.top_k,
            seed=pb.seed if pb.HasField("seed") else None,
            max_tokens=pb.max_tokens if pb.HasField("max_tokens") else None,
            min_tokens=pb.min_tokens,
            stop_token_ids=tuple(pb.stop_token_ids),
            ignore_eos=pb.ignore_eos,
            min_p=pb.min_p,
            presence_penalty=pb.presence_penalty,
            frequency_penalty=pb.frequency_penalty,
            repetition_penalty=pb.repetition_penalty if pb.repetition_penalty > 0 else 1.0,
            logprobs=pb.logprobs,
            logit_bias=tuple(sorted(pb.logit_bias.items())),
            prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else -1,
            json_schema=pb.json_schema,
            json_object=pb.json_object,
            regex=pb.regex,
            grammar=pb.grammar,
            structural_tag=pb.structural_tag,
            allowed_token_ids=tuple(pb.allowed_token_ids),
            bad_words=tuple(tuple(w.token_ids) for w in pb.bad_words),
        )
