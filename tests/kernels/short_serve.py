"""Two short prompts through the worker's test driver and through transformers: the interpreter's budget for an
end-to-end check (tests/worker/test_families.py's prompts are too long to run interpreted in CI)."""

from __future__ import annotations

import torch

from steploop.common.sampling_params import SamplingParams
from tests.worker.driver import Driver

PROMPTS = ([5, 17, 300, 41, 9, 2048, 77, 12, 600, 33, 8, 1000, 3, 71, 99, 100, 4, 23, 5],
           [11, 250, 7, 9000, 64, 31, 2, 18, 404, 5, 80, 6, 1200, 44, 15, 3, 700, 28, 90, 16, 8, 47, 300])
NEW_TOKENS = 6


def generate(hf_model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's logprob."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]


def serve(runner, chunk: int, preempt_after: int | None) -> dict[int, tuple[list[int], list[float]]]:
    """Both prompts at once, prompt chunks of `chunk` tokens, prompt 1 preempted at step `preempt_after`."""
    driver = Driver(runner)
    for handle, prompt in enumerate(PROMPTS):
        driver.add(handle, list(prompt), NEW_TOKENS,
                   SamplingParams(temperature=0.0, logprobs=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    logprobs: dict[int, list[float]] = {h: [] for h in range(len(PROMPTS))}
    for step in range(200):
        if not driver.requests:
            break
        if step == preempt_after and 1 in driver.requests:
            driver.preempt(1)
        for handle, lps in driver.step(chunk).logprobs.items():
            logprobs[handle].extend(lp.logprob for lp in lps)
    runner.reset()
    return {h: (driver.outputs[h], logprobs[h][-NEW_TOKENS:]) for h in logprobs}
