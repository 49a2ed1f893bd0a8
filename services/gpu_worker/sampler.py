"""Batched sampling over the rows that sample this step: greedy, temperature, min-p, top-k, top-p, seeds.

Order (as vLLM V1): logit edits (logit_bias, min_tokens, grammar) -> penalties -> temperature -> min-p -> top-k/top-p -> sample. Sampling uses the
exponential-race trick: argmax(probs / E) with E ~ Exp(1) i.i.d. per token draws exactly from `probs`.
A seeded row draws its E from a torch.Generator seeded by mix(seed, output index), so its token depends only on
its own logits, seed and position in the output: not on the batch it shares, nor on preemption and
recompute. Unseeded rows share one generator. Greedy rows (temperature 0) take argmax of the raw logits.

Logprobs come from the raw model distribution, log_softmax of the logits before penalties, temperature and
truncation (as vLLM's default "raw_logprobs"): they describe the model, not the sampling transform.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.logits_processors import LogitsEdits, apply_logits_edits
from steploop.gpu_worker.model.ops import TorchOps
from steploop.gpu_worker.penalties import PenaltyInputs, apply_penalties
from steploop.gpu_worker.staging import StepStaging

_MASK64 = (1 << 63) - 1


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor     # [S] fp32, 0 for greedy rows
    top_k: torch.Tensor           # [S] int64, vocab size when off
    top_p: torch.Tensor           # [S] fp32, 1.0 when off
    min_p: torch.Tensor           # [S] fp32, 0.0 when off
    greedy: torch.Tensor          # [S] bool
    seeds: list[int | None]       # [S] per-row seed (None: shared generator)
    output_index: list[int]       # [S] index in the request's output of the token this row samples
    num_logprobs: list[int]       # [S] -1 none, else top-k size
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    penalties: PenaltyInputs | None = None
    edits: LogitsEdits | None = None      # logit_bias, min_tokens bans, grammar masks (logits_processors.py)

    @classmethod
    def from_rows(cls, params: list[SamplingParams], output_index: list[int], vocab_size: int,
                  device: torch.device, penalties: PenaltyInputs | None = None,
                  edits: LogitsEdits | None = None) -> SamplingMetadata:
        """Built with its own copies (tests; the runner stages them: stage_sampling)."""
        arrays, flags = _host_rows(params, vocab_size)
        tensors = {name: torch.from_numpy(a).to(device) for name, a in arrays.items()}
        return cls(**tensors, seeds=[p.seed for p in params], output_index=list(output_index),
                   num_logprobs=[p.logprobs for p in params], **flags, penalties=penalties, edits=edits)


def _host_rows(params: list[SamplingParams], vocab_size: int) -> tuple[dict[str, np.ndarray], dict[str, bool]]:
    """The per-row arrays ([S] each) and the batch-wide flags, on the host."""
    top_k = np.fromiter((p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params), np.int64,
                        len(params))
    greedy = np.fromiter((p.greedy for p in params), np.bool_, len(params))
    arrays = {"temperature": np.fromiter((max(p.temperature, 0.0) for p in params), np.float32, len(params)),
              "top_k": top_k, "top_p": np.fromiter((p.top_p for p in params), np.float32, len(params)),
              "min_p": np.fromiter((p.min_p for p in params), np.float32, len(params)), "greedy": greedy}
    sampled = ~greedy
    flags = {"all_greedy": bool(greedy.all()), "use_top_k": bool(((top_k < vocab_size) & sampled).any()),
             "use_top_p": bool(((arrays["top_p"] < 1.0) & sampled).any()),
             "use_min_p": bool(((arrays["min_p"] > 0.0) & sampled).any())}
    return arrays, flags


@dataclass
class StagedSampling:
    """The sampling rows' arrays put in a step's staging buffer; finish() after its copy gives the metadata."""
    params: list[SamplingParams]
    output_index: list[int]
    slots: dict[str, int]
    flags: dict[str, bool]

    @classmethod
    def stage(cls, params: list[SamplingParams], output_index: list[int], vocab_size: int,
              staging: StepStaging) -> StagedSampling:
        arrays, flags = _host_rows(params, vocab_size)
        return cls(params, list(output_index), {name: staging.put(a) for name, a in arrays.items()}, flags)

    def finish(self, staging: StepStaging, penalties: PenaltyInputs | None = None,
               edits: LogitsEdits | None = None) -> SamplingMetadata:
        p = self.params
        return SamplingMetadata(**{name: staging.get(slot) for name, slot in self.slots.items()},
                                seeds=[x.seed for x in p], output_index=self.output_index,
                                num_logprobs=[x.logprobs for x in p], **self.flags, penalties=penalties, edits=edits)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor               # [S] int64
    logprobs: torch.Tensor | None         # [S] fp32 logprob of the sampled token (None: nobody asked)
    top_token_ids: torch.Tensor | None    # [S, max_k] int64
    top_logprobs: torch.Tensor | None     # [S, max_k] fp32

    def to_host(self) -> HostSamplerOutput:
        """Everything the step reports, in ONE device-to-host transfer (one sync per step, not per row)."""
        return self.start_copy().wait()

    def start_copy(self) -> HostCopy:
        """Start the step's one device-to-host transfer without waiting for it: the tensors concatenated (as
        float64, exact for token ids < 2**53 and for fp32 logprobs, when logprobs come too) and copied into pinned
        memory behind an event. The GPU goes on with whatever is queued next; HostCopy.wait() waits for this copy
        only (a `.tolist()` would also wait for the next step's kernels: step_overlap.py)."""
        s = self.token_ids.shape[0]
        k = self.top_token_ids.shape[1] if self.top_token_ids is not None else 0
        if self.logprobs is None:
            flat = self.token_ids
        else:
            parts = [self.token_ids, self.logprobs] + ([self.top_token_ids.flatten(), self.top_logprobs.flatten()]
                                                       if k else [])
            flat = torch.cat([t.to(torch.float64) for t in parts])
        if flat.device.type != "cuda":
            return HostCopy(flat, None, s, k, self.logprobs is not None)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return HostCopy(host, event, s, k, self.logprobs is not None)


@dataclass
class HostCopy:
    """A sampler output on its way to the host (SamplerOutput.start_copy)."""
    flat: torch.Tensor            # host memory once `event` has fired
    event: object | None          # None: already on the host
    num_rows: int
    k: int                        # top-k width (0: none)
    with_logprobs: bool

    def wait(self) -> HostSamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        flat = self.flat.tolist()
        if not self.with_logprobs:
            return HostSamplerOutput(flat, None, None, None)
        s, k = self.num_rows, self.k
        ids = [int(x) for x in flat[:s]]
        top_ids = [[int(x) for x in flat[2 * s + r * k:2 * s + (r + 1) * k]] for r in range(s)] if k else None
        top_lps = [flat[2 * s + s * k + r * k:2 * s + s * k + (r + 1) * k] for r in range(s)] if k else None
        return HostSamplerOutput(ids, flat[s:2 * s], top_ids, top_lps)


@dataclass
class HostSamplerOutput:
    token_ids: list[int]                      # [S]
    logprobs: list[float] | None              # [S]
    top_token_ids: list[list[int]] | None     # [S][max_k]
    top_logprobs: list[list[float]] | None    # [S][max_k]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", argmax_rows=None):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # greedy rows' argmax: the plan's ops (CpuOps: a C kernel, ~0.5 vs ~2.4 ms on [64, 49152]); same answer
        self.argmax_rows = argmax_rows or TorchOps.argmax_rows

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [S, vocab] fp32 -> sampled token ids (and logprobs from the raw logits)."""
        raw = logits
        if meta.edits is not None:
            logits = apply_logits_edits(logits, meta.edits)
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        greedy_ids = self.argmax_rows(logits)
        if meta.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = torch.where(meta.greedy, greedy_ids, self._sample(logits, meta))
        return _with_logprobs(raw, token_ids, meta)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(meta.greedy, 1.0, meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if meta.use_min_p:
            logits = apply_min_p(logits, meta.min_p)
        if meta.use_top_k or meta.use_top_p:
            logits = apply_top_k_top_p(logits, meta.top_k if meta.use_top_k else None,
                                       meta.top_p if meta.use_top_p else None)
        probs = logits.softmax(dim=-1)
        return (probs / self._exponential_noise(probs, meta)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """[S, vocab] i.i.d. Exp(1); seeded rows drawn from their own (seed, output index) generator."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in enumerate(meta.seeds):
            if seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(mix_seed(seed, meta.output_index[row]))
                noise[row].exponential_(generator=gen)
        return noise


def mix_seed(seed: int, index: int) -> int:
    """A 63-bit seed from (request seed, output index): splitmix64-style, so nearby pairs do not collide."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK64


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [S] times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k [S] largest logits (ties at the k-th kept) and the smallest set whose probability reaches
    p [S]; everything else becomes -inf. One ascending sort serves both."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if k is not None:
        kth = sorted_logits.gather(1, (vocab - k.clamp(1, vocab)).unsqueeze(1))   # [S, 1] k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)        # ascending: mass of tokens up to this one
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False                                       # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(-1, order, sorted_logits)


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    max_k = max(meta.num_logprobs)
    if max_k < 0:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = raw.log_softmax(dim=-1)                            # [S, vocab]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_lp, top_ids = logprobs.topk(max_k, dim=-1) if max_k > 0 else (None, None)
    return SamplerOutput(token_ids, sampled, top_ids, top_lp)
