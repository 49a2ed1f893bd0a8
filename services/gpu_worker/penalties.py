"""Presence, frequency and repetition penalties (OpenAI / vLLM semantics), batched over the sampling rows.

presence:   logits -= presence * (token appeared in the output)
frequency:  logits -= frequency * (times the token appeared in the output)
repetition: for tokens seen in the prompt or output, positive logits /= r, negative logits *= r
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from steploop.common.sampling_params import SamplingParams


@dataclass
class PenaltyInputs:
    presence: torch.Tensor        # [S] fp32
    frequency: torch.Tensor       # [S] fp32
    repetition: torch.Tensor      # [S] fp32, 1.0 = off
    output_counts: torch.Tensor   # [S, vocab] fp32: occurrences of each token in the row's output
    prompt_mask: torch.Tensor     # [S, vocab] bool: token occurs in the row's prompt

    @classmethod
    def build(cls, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]],
              vocab_size: int, device: torch.device) -> "PenaltyInputs | None":
        """None when no row uses a penalty (the common case: nothing is built)."""
        if not any(p.penalized for p in params):
            return None
        rows = len(params)
        counts = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        counts.index_put_(_coords(outputs, device), torch.ones((), device=device), accumulate=True)
        prompt_mask = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        prompt_mask[_coords(prompts, device)] = True

        def vec(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(presence=vec([p.presence_penalty for p in params]),
                   frequency=vec([p.frequency_penalty for p in params]),
                   repetition=vec([p.repetition_penalty for p in params]), output_counts=counts,
                   prompt_mask=prompt_mask)


def _coords(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [r for r, tokens in enumerate(token_lists) for _ in tokens]
    cols = [t for tokens in token_lists for t in tokens]
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device))


def apply_penalties(logits: torch.Tensor, pen: PenaltyInputs) -> torch.Tensor:
    """logits [S, vocab] -> penalized copy."""
    seen_output = pen.output_counts > 0
    rep = pen.repetition.unsqueeze(1)
    seen = pen.prompt_mask | seen_output
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - pen.frequency.unsqueeze(1) * pen.output_counts - pen.presence.unsqueeze(1) * seen_output
