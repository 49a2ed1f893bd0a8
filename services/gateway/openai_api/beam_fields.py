"""vLLM's beam search fields on /v1/completions and /v1/chat/completions: `use_beam_search`, `best_of` (the beam
width; `n` when unset), `n` (how many of the beams come back, best first), `length_penalty`, `early_stopping`.

Beam search ranks raw model logprobs (common/beam_ranking.py, run in the scheduler), so a field that would change
the distribution or cut the text (penalties, logit bias, token controls, a grammar, stop strings, min_tokens)
cannot be honoured: each is a 400 naming it, rather than beams computed as if it were not there. Sampling-only fields (temperature, top_p,
top_k, min_p, seed) have no effect: beam search is deterministic, as in transformers with do_sample false and in
vLLM. Streaming is served: each beam comes as one chunk once the search ends (vLLM's completions return the whole
body instead)."""

from __future__ import annotations

from typing import Any

from steploop.common.beam_ranking import BeamConfig
from steploop.gateway.errors import bad_request
from steploop.gateway.http_io import validation as v

MAX_BEAM_WIDTH = 16          # the engine is asked for K = 2..3 x width logprobs per beam and step


def parse_beam(body: dict[str, Any], n: int) -> BeamConfig | None:
    """None without use_beam_search (best_of above 1 is then a 400: parallel sampling's best_of is not built)."""
    best_of = v.get_int(body, "best_of", None, lo=1, hi=MAX_BEAM_WIDTH)
    if not v.get_bool(body, "use_beam_search", False):
        if best_of not in (None, 1):
            raise bad_request("'best_of' is not supported yet by steploop (except as the beam width with "
                              "'use_beam_search')", param="best_of", code="unsupported_parameter")
        return None
    width = n if best_of is None else best_of
    if n > width:
        raise bad_request(f"'n' ({n}) must be at most 'best_of' ({width}), the beam width", param="n")
    if width > MAX_BEAM_WIDTH:
        raise bad_request(f"beam search takes at most {MAX_BEAM_WIDTH} beams, got {width}", param="n")
    early = body.get("early_stopping", False)
    if early is None:
        early = False
    if not (isinstance(early, bool) or early == "never"):
        raise bad_request(f"'early_stopping' must be true, false or \"never\", got {early!r}", param="early_stopping")
    penalty = v.get_number(body, "length_penalty", 1.0, lo=-10.0, hi=10.0)
    return BeamConfig(width, float(penalty), early)


def refuse_with_beams(body: dict[str, Any], sampling: Any) -> None:
    """A 400 naming the first field beam search cannot honour (see the module docstring). The repetition penalty
    counts when the body sets it: the model's generation_config default is not applied to beams."""
    checks = [
        ("stop", bool(sampling.stop)),
        ("logit_bias", bool(sampling.logit_bias)),
        ("allowed_token_ids", bool(sampling.allowed_token_ids)),
        ("bad_words", bool(sampling.bad_words)),
        ("presence_penalty", sampling.presence_penalty != 0.0),
        ("frequency_penalty", sampling.frequency_penalty != 0.0),
        ("repetition_penalty", body.get("repetition_penalty") not in (None, 1, 1.0)),
        ("min_tokens", sampling.min_tokens > 0),
        ("prompt_logprobs", sampling.prompt_logprobs >= 0),
        ("echo", body.get("echo") is True),
        (sampling.constrained_by or "tool_choice",
         bool(sampling.json_schema or sampling.json_object or sampling.regex or sampling.grammar
              or sampling.structural_tag)),
    ]
    for name, used in checks:
        if used:
            raise bad_request(f"'{name}' cannot be used with 'use_beam_search' (beam search ranks the model's own "
                              f"logprobs)", param=name)
