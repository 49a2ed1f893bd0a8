"""The layers that talk across ranks, wrapped around a rank's locally sized modules after its weights load.

    RowParallelReduce        o_proj / down_proj: the partial sums of this rank's input columns, all-reduced;
                             a mixture-of-experts block whole: its sharded experts' (or, expert parallel, its own
                             experts') partial sum plus its shared expert's, all-reduced once
    VocabParallelEmbedding   each rank looks up the ids in its vocabulary rows (zeros elsewhere), all-reduced
    GatheredLMHead           each rank's logits over its vocabulary rows, all-gathered, the padding dropped

So per layer there are exactly two all-reduces (after attention and after the MLP), plus one for the embedding
and one all-gather of the logits per step. Every rank ends with the same full logits (gloo and NCCL give every
rank the same reduced bytes), so every rank samples the same token with the same seeded generators.
"""

from __future__ import annotations

import torch
from torch import nn

from steploop.gpu_worker.distributed.comm import TensorParallelComm
from steploop.gpu_worker.distributed.shapes import RankShare
from steploop.gpu_worker.model.moe import SparseMoE


class RowParallelReduce(nn.Module):
    def __init__(self, inner: nn.Module, comm: TensorParallelComm):
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """inner: an nn.Embedding of the rank's rows, or a GGUF file's BlockEmbedding of them (gguf/block_embedding.py)"""

    def __init__(self, inner: nn.Module, first_row: int, comm: TensorParallelComm):
        super().__init__()
        self.inner, self.first_row, self.comm = inner, first_row, comm

    @property
    def weight(self) -> torch.Tensor | None:
        return getattr(self.inner, "weight", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.inner.num_embeddings
        local = ids - self.first_row
        outside = (local < 0) | (local >= rows)
        x = self.inner(local.clamp(0, rows - 1))
        x[outside] = 0
        return self.comm.all_reduce(x)


class GatheredLMHead(nn.Module):
    def __init__(self, inner: nn.Module, vocab_size: int, comm: TensorParallelComm):
        super().__init__()
        self.inner, self.vocab_size, self.comm = inner, vocab_size, comm

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(self.inner(hidden).contiguous())[..., :self.vocab_size]


def make_tensor_parallel(model: nn.Module, share: RankShare, comm: TensorParallelComm, full_vocab: int) -> None:
    """Wraps a loaded rank-local model's cross-rank layers in place."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallelReduce(_split_input(layer.self_attn.o_proj, comm), comm)
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = RowParallelReduce(layer.mlp, comm)
        else:
            layer.mlp.down_proj = RowParallelReduce(_split_input(layer.mlp.down_proj, comm), comm)
    if model.model.embed_tokens is not None:     # a pipeline stage may hold neither (distributed/pipeline.py)
        model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, share.first_vocab_row, comm)
    if model.lm_head is not None:
        model.lm_head = GatheredLMHead(model.lm_head, full_vocab, comm)
    model.tp_comm = comm


def _split_input(linear: nn.Module, comm: TensorParallelComm) -> nn.Module:
    """A row-parallel quantized linear (model/quant/linear.py) learns that its input row is split across ranks."""
    if hasattr(linear, "split_input"):
        linear.split_input(comm.all_reduce_max)
    return linear
