"""A GGUF file's weights into a built LlamaForCausalLM, tensor by tensor from the memory-mapped file.

Each linear layer whose tensors are block-quantized (blocks.BLOCK_TYPES) and fit the packed layout (whole groups
of 16 output rows) takes its packed form straight from the blocks (packed_forms.py): no fp32 copy of it is ever
made; one whose tensors are all F16 (or all BF16) keeps their 16 bits (packed_weights.F16 / BF16), and so does an
F16 / BF16 embedding table (HalfEmbedding, shared by a tied lm_head). Everything else (norms, an F32 table, F32
linears, layers of mixed types or off the packed grid, and every tensor when the plan has no packed linears) is
dequantized one tensor at a time by gguf-py's own dequantize into its fp32 parameter: the values the transformers
oracle computes with.
The embedding stays in its blocks too (block_embedding.py) when it is block-quantized and no fp32 lm_head shares
it; a tied lm_head packs from the same blocks. A mixture-of-experts file's stacked experts tensors ([experts, rows,
k]: ffn_{gate,up,down}_exps) split into one part per expert, named as the HF checkpoint names that expert; on the
CPU each expert of a SparseMoE packs on its own (its gate and up rows fused), one expert's blocks at a time.
A tensor-parallel rank packs its share, cut from the raw blocks (block_shards.py), as one rank packs the whole.
A packed weight is decoded and packed a chunk of rows at a time into its own tensors (packed_chunks.py), each
chunk's file pages dropped once read (file_pages.py): the load holds about the weights plus a chunk's temporaries.
With the Triton kernels (CUDA), a block-quantized dense linear becomes a GgufLinear instead (triton_linear.py: the
file's integer values and fp32 block scales on the device, read by the GGUF GEMM), not a bf16 weight; the embedding
stays in its blocks on the device too (a tied lm_head then becomes a GgufLinear of the same blocks); experts and
float tensors are read as before.

GGUF names map onto the HF names with transformers' own map (get_gguf_hf_weights_map), and llama-arch files get
llama.cpp's q/k row permutation undone on the raw rows (it permutes whole rows, so it applies to blocks as to
floats), as transformers' LlamaTensorProcessor does.
"""

from __future__ import annotations

import logging
import pathlib
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import quants as gguf_quants

from steploop.gpu_worker.cpu_kernels.packed_weights import (GROUP, KIND_NAMES, SPLIT, W16_DTYPES, PackedWeight,
                                                               empty_w16, packable_shape, w16_rows)
from steploop.gpu_worker.gguf import blocks
from steploop.gpu_worker.gguf.block_shards import cut_inside_blocks, shard_raw
from steploop.gpu_worker.gguf.file_pages import FilePages
from steploop.gpu_worker.gguf.packed_chunks import RowAssembler
from steploop.gpu_worker.gguf.packed_forms import common_form, runs, to_packed
from steploop.gpu_worker.gguf.reader import GGUFFileError, architecture, open_gguf
from steploop.gpu_worker.model.moe import NOT_HELD

log = logging.getLogger(__name__)

SOURCE_FILE = "gguf_source.json"        # in a converted folder: {"path": the GGUF file} (no weights beside it)


def _reverse_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order back to HF's (transformers' _reverse_permute_weights), rows first."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


@dataclass
class _Part:
    tensor: object                       # gguf ReaderTensor
    hf_name: str
    rows: tuple[int, int] | None         # row slice of the target parameter (fused layers)
    expert: int | None                   # the target's (local) expert index
    index: int | None = None             # a stacked experts tensor [experts, rows, k]: the expert read from it


@dataclass
class LoadStats:
    """Bytes per GGUF type: in the file, and in memory per form (a packed form's name, or fp32)."""
    file_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    memory_bytes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, qtype: str, file_bytes: int, memory_bytes: int, form: str) -> None:
        self.file_bytes[qtype] += file_bytes
        self.memory_bytes[qtype][form] += memory_bytes

    def summary(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:.1f} MiB"
        parts = [f"{t} {mib(self.file_bytes[t])} -> " + " + ".join(
            f"{mib(n)} {form}" for form, n in sorted(self.memory_bytes[t].items())) for t in sorted(self.file_bytes)]
        total_file = sum(self.file_bytes.values())
        total_mem = sum(n for forms in self.memory_bytes.values() for n in forms.values())
        return (f"GGUF weights in memory: {mib(total_mem)} (the file's tensors: {mib(total_file)}); per type, file "
                f"-> memory: " + "; ".join(parts))


def _rows(part: _Part, arch: str, cfg) -> np.ndarray:
    """The part's raw data as [rows, row items] (2-D weights, one expert of a stacked 3-D one) or [items] (1-D),
    llama's q/k rows unpermuted (by cfg's head counts: the whole model's, also on a tensor-parallel rank)."""
    tensor = part.tensor
    data = tensor.data if part.index is None else tensor.data[part.index]
    if arch == "llama" and data.ndim == 2 and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        heads = cfg.num_attention_heads
        if ".attn_k." in tensor.name and cfg.num_key_value_heads != heads:
            heads = cfg.num_key_value_heads
        data = _reverse_permute(data, heads)
    return data


def _shape(tensor, stacked: bool = False) -> tuple[int, ...]:
    """The tensor's shape, rows first; stacked: one expert's of a [experts, rows, k] tensor"""
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    return shape[1:] if stacked else shape


_STACKED = re.compile(r"\.experts\.(?!\d)")  # an experts tensor's HF name without the expert index
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def _split_experts(tensor, hf: str) -> list[tuple[int | None, str]]:
    """(index in the tensor, HF name) per expert of a stacked [experts, rows, k] tensor (llama.cpp's
    ffn_{gate,up,down}_exps), named as the HF checkpoint names each expert; [(None, hf)] for any other tensor."""
    if not _STACKED.search(hf) or len(tensor.shape) != 3:
        return [(None, hf)]
    return [(e, _STACKED.sub(f".experts.{e}.", hf)) for e in range(int(tensor.shape[-1]))]


# architectures whose norm weights llama.cpp stores as 1 + w (transformers' Gemma2TensorProcessor subtracts 1)
_NORM_PLUS_ONE = ("gemma2", "gemma3")


def _fp32(part: _Part, data: np.ndarray, arch: str) -> torch.Tensor:
    """gguf-py's dequantize (the oracle's own) of one part's rows, shaped as stored; Gemma's norms less 1 in
    fp32, as transformers' reader computes them."""
    tensor = part.tensor
    w = np.array(gguf_quants.dequantize(data, tensor.tensor_type), dtype=np.float32)   # a copy: F32 data is a
    if arch in _NORM_PLUS_ONE and "norm.weight" in tensor.name:                        # view of the read-only map
        w = w - np.float32(1)
    return torch.from_numpy(w).reshape(_shape(tensor, part.index is not None))


def hf_name_map(folder: pathlib.Path) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from transformers' map over a meta-device model of the config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    if config.model_type == "mixtral":       # a llama-arch file with experts (transformers' map knows no mixtral)
        return _llama_names(hf_model)
    return get_gguf_hf_weights_map(hf_model)


def _llama_names(hf_model) -> dict[str, str]:
    """gguf-py's llama tensor names for a Mixtral model, each expert's name collapsed into its stacked tensor's
    (experts.N.w1 -> ffn_gate_exps), as transformers' map does for Qwen2/3-MoE."""
    from gguf import MODEL_ARCH, get_tensor_name_map
    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, hf_model.config.num_hidden_layers)
    out = {}
    for hf_name in hf_model.state_dict():
        collapsed = _EXPERT_INDEX.sub(".experts.", hf_name)
        base, suffix = collapsed.rsplit(".", 1)
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            out[f"{gguf_name}.{suffix}"] = collapsed
    return out


def load_gguf_weights(model, cfg, folder: pathlib.Path, gguf_path: pathlib.Path, packed: bool, target_of,
                      sharder=None) -> tuple[set[str], str]:
    """Fill `model` from the file; returns (the parameters filled, as loader._check_complete counts them; the log
    line of weights in memory per GGUF type). packed: give PackedLinear layers their packed forms from the blocks.
    target_of: loader._target (HF name -> our parameter, expert, row slice)."""
    from steploop.gpu_worker.model.moe import SparseMoE
    from steploop.gpu_worker.model.packed_linear_layer import PackedLinear

    plan = getattr(model, "plan", None)
    triton_blocks = plan is not None and plan.attention_backend == "triton" and not packed
    reader = open_gguf(gguf_path)
    pages = FilePages(reader)
    arch = architecture(reader)
    names = hf_name_map(folder)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    tied = cfg.tie_word_embeddings
    groups: dict[str, list[_Part]] = defaultdict(list)
    for tensor in reader.tensors:
        hf = names.get(tensor.name)
        if hf is None:
            log.info("GGUF tensor %s is not a weight of this model (skipped)", tensor.name)
            continue
        if hf == "lm_head.weight" and tied:
            continue
        for index, hf_name in _split_experts(tensor, hf):
            target, expert, rows = target_of(hf_name, cfg)
            if (target, expert, rows) == NOT_HELD:      # expert parallel: another rank's expert
                continue
            if target not in params:
                raise GGUFFileError(f"{gguf_path.name}: unexpected tensor {tensor.name!r} ({hf_name}: not a weight "
                                    f"of this model_type)")
            groups[target].append(_Part(tensor, hf_name, rows, expert, index))
        if tied and hf == "model.embed_tokens.weight" and (packed or triton_blocks):
            groups["lm_head.weight"].append(_Part(tensor, hf, None, None))     # packed from the same blocks
    filled: set[str] = set()
    stats = LoadStats()
    embed = groups.pop(_EMBED, None)
    cfg = cfg if sharder is None else sharder.cfg   # from here: the file's whole shapes (q/k row order, vocabulary)
    for target, parts in groups.items():
        module = modules[target.rsplit(".", 1)[0]]
        if target == "lm_head.weight" and tied:       # packed from the embedding's blocks, or left tied to its table
            if packed:
                _pack(module, parts, arch, cfg, stats, PackedLinear, packed, sharder, pages, count_file=False)
            else:
                _triton_blocks(model, target, module, parts, arch, cfg, stats, sharder, pages, count_file=False)
            continue                                  # its bytes are the embedding's: released after it
        if isinstance(module, SparseMoE):
            done = packed and _pack_moe(module, target.rsplit(".", 1)[1], parts, arch, cfg, stats, sharder, pages)
        else:
            done = _pack(module, parts, arch, cfg, stats, PackedLinear, packed and target.endswith(".weight"),
                         sharder, pages)
            if not done and triton_blocks and target.endswith(".weight"):
                done = _triton_blocks(model, target, module, parts, arch, cfg, stats, sharder, pages)
        if not done:
            for part in parts:
                _copy_fp32(params[target], part, arch, cfg, sharder, stats)
        filled.update(_filled_names(target, parts))
        pages.drop_tensors(p.tensor for p in parts)
    if embed is not None:        # last: a tied lm_head that did not pack reads the fp32 table
        table_free = not tied or getattr(modules["lm_head"], "packed", None) is not None or \
            getattr(model.lm_head, "runs", None) is not None                # a GgufLinear of the same blocks
        if (packed or triton_blocks) and table_free and \
                _embed_in_blocks(model, embed[0], arch, cfg, stats, pages, sharder, params[_EMBED]):
            filled.add(_EMBED)
        elif packed and _embed_half(model, embed[0], arch, cfg, stats, sharder):
            filled.add(_EMBED)
        else:
            _copy_fp32(params[_EMBED], embed[0], arch, cfg, sharder, stats)
            filled.add(_EMBED)
        pages.drop_tensors(p.tensor for p in embed)
    del reader
    return filled, stats.summary()


_EMBED = "model.embed_tokens.weight"


def _embed_in_blocks(model, part: _Part, arch: str, cfg, stats: LoadStats, pages: FilePages | None = None,
                     sharder=None, like: torch.Tensor | None = None) -> bool:
    """Replace the embedding by a BlockEmbedding of the file's blocks (block types only); a tensor-parallel rank
    keeps its vocabulary rows. cfg: the whole model's. like: the table it replaces (its device and dtype)."""
    from steploop.gpu_worker.gguf.block_embedding import BlockEmbedding
    if part.tensor.tensor_type not in blocks.BLOCK_TYPES:
        return False
    vocab, hidden = _shape(part.tensor)
    if (vocab, hidden) != (cfg.vocab_size, cfg.hidden_size):
        raise GGUFFileError(f"tensor {part.tensor.name!r}: shape {[vocab, hidden]} != "
                            f"{[cfg.vocab_size, cfg.hidden_size]} expected for {part.hf_name}")
    rows, _ = shard_raw(sharder, part.hf_name, _rows(part, arch, cfg), part.tensor.tensor_type, hidden)
    table = BlockEmbedding.from_blocks(rows, part.tensor.tensor_type, hidden,
                                       done=None if pages is None else lambda r0, r1: pages.drop_view(rows[r0:r1]))
    if like is not None:
        table = table.to(like.device)
        table.out_dtype = like.dtype
    model.model.embed_tokens = table
    stats.add(part.tensor.tensor_type.name, int(part.tensor.n_bytes), table.nbytes, "embedding blocks")
    return True


def _embed_half(model, part: _Part, arch: str, cfg, stats: LoadStats, sharder=None) -> bool:
    """An F16 / BF16 table kept at 16 bits (model/half_weights.py's HalfEmbedding); a tied lm_head that took the
    16-bit form of the same rows (_half) lends the table its tensor. False: the fp32 path."""
    from steploop.gpu_worker.model.half_weights import HalfEmbedding
    name = part.tensor.tensor_type.name
    table = model.model.embed_tokens
    if name not in _HALF or not isinstance(table, torch.nn.Embedding) or table.num_embeddings % GROUP:
        return False
    head = getattr(model.lm_head, "packed", None) if cfg.tie_word_embeddings else None
    if head is not None and head.kind in W16_DTYPES:        # the same rows, already laid out
        weight, memory = head, 0
    else:
        n, k = table.num_embeddings, table.embedding_dim
        weight = empty_w16(_HALF[name], n, k)
        raw, _ = shard_raw(sharder, part.hf_name, _rows(part, arch, cfg), part.tensor.tensor_type, k)
        if raw.shape[0] != n:
            raise GGUFFileError(f"tensor {part.tensor.name!r}: {raw.shape[0]} rows (this rank's) != {n} expected "
                                f"for {part.hf_name}")
        weight.qs.copy_(w16_rows(_half_tensor(raw, _HALF[name])))
        memory = weight.nbytes
    embedding = HalfEmbedding(table.num_embeddings, table.embedding_dim)
    embedding.packed = weight
    model.model.embed_tokens = embedding
    stats.add(name, int(part.tensor.n_bytes), memory, KIND_NAMES[weight.kind] + " table")
    return True


def _filled_names(target: str, parts: list[_Part]) -> list[str]:
    return [target + ("" if p.expert is None else f"[{p.expert}]") +
            ("" if p.rows is None else f"[{p.rows[0]}:{p.rows[1]}]") for p in parts]


def _pack(module, parts: list[_Part], arch: str, cfg, stats: LoadStats, packed_linear_type, packed: bool,
          sharder, pages: FilePages | None = None, count_file: bool = True) -> bool:
    """Give a PackedLinear its packed form straight from its parts (this rank's share of them: sharder): from their
    blocks if they all are block types that fit the layout and cover the whole weight, else their 16 bits if they
    all are F16 (or all BF16: _half); False leaves it to the fp32 path."""
    if not packed or not isinstance(module, packed_linear_type) or any(p.expert is not None for p in parts):
        return False
    if not _packable(parts, module.out_features, module.in_features, sharder):
        return _half(module, parts, arch, cfg, stats, sharder, count_file)
    module.use_packed(_packed_weight(parts, module.out_features, module.in_features, arch, cfg, stats, count_file,
                                     sharder, pages))
    return True


_HALF = {"F16": torch.float16, "BF16": torch.bfloat16}


def _half_tensor(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """An F16 / BF16 tensor's raw rows (float16, or BF16's bytes) as a torch tensor of `dtype`, the same bits."""
    with warnings.catch_warnings():     # the file's read-only map: only read, into the packed layout's copy
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.int16)).view(dtype)


def _half(module, parts: list[_Part], arch: str, cfg, stats: LoadStats, sharder, count_file: bool = True) -> bool:
    """_pack's second form: a PackedLinear whose parts are all F16 (or all BF16) tensors tiling its rows in whole
    16-row groups takes the 16-bit form of their stored bits (packed_weights.BF16 / F16: widened exactly in the
    kernel, as gguf-py's dequantize widens them); False leaves it to the fp32 path."""
    types = {p.tensor.tensor_type.name for p in parts}
    if len(types) != 1 or next(iter(types)) not in _HALF:
        return False
    n, k = module.out_features, module.in_features
    if not _tile_rows(parts, n, GROUP):
        return False
    dtype = _HALF[types.pop()]
    ordered = sorted(parts, key=lambda p: (p.rows or (0, n))[0])
    weight = empty_w16(dtype, n, k)
    for p, raw in zip(ordered, _raw_parts(ordered, n, k, arch, cfg, sharder)):
        r0, r1 = p.rows or (0, n)
        weight.qs[r0 // GROUP:r1 // GROUP].copy_(w16_rows(_half_tensor(raw, dtype)))
        stats.add(p.tensor.tensor_type.name, int(p.tensor.n_bytes) if count_file else 0, 2 * (r1 - r0) * k,
                  KIND_NAMES[weight.kind])
    module.use_packed(weight)
    return True


def _pack_moe(module, name: str, parts: list[_Part], arch: str, cfg, stats: LoadStats, sharder=None,
              pages: FilePages | None = None) -> bool:
    """A SparseMoE's experts (w13 [E, 2I, hidden], w2 [E, hidden, I]) or shared expert (shared_w13, shared_w2),
    each expert packed on its own from its parts' blocks (an expert's gate and up rows fused as a dense gate/up
    is); False (all experts left to the fp32 path) unless every expert packs. The router stays fp32."""
    if name not in ("w13", "w2", "shared_w13", "shared_w2"):
        return False
    shape = tuple(getattr(module, name).shape)
    n, k = shape[-2:]
    if name.startswith("shared"):
        if not _packable(parts, n, k, sharder):
            return False
        module.use_packed(name, _packed_weight(parts, n, k, arch, cfg, stats, sharder=sharder, pages=pages))
        return True
    by_expert: dict[int, list[_Part]] = defaultdict(list)
    for p in parts:
        by_expert[p.expert].append(p)
    if sorted(by_expert) != list(range(shape[0])) or \
            not all(_packable(ps, n, k, sharder) for ps in by_expert.values()):
        return False
    module.use_packed(name, [_packed_weight(by_expert[e], n, k, arch, cfg, stats, sharder=sharder, pages=pages)
                             for e in range(shape[0])])
    return True


def _packable(parts: list[_Part], n: int, k: int, sharder=None) -> bool:
    """All parts block types, tiling the [n, k] weight's rows in whole 16-row groups, the shape the layout takes,
    and (tensor parallel) this rank's columns whole blocks: a cut inside them is read as fp32 (stored_split.py)."""
    return packable_shape(n, k) and _blocks_tile(parts, n, sharder, 16)


def _blocks_tile(parts: list[_Part], n: int, sharder, rows_multiple: int) -> bool:
    """All parts block types, this rank's columns whole blocks, tiling the weight's n rows in order (q, k, v /
    gate, up; or one whole), each part ending on a multiple of rows_multiple."""
    if any(p.tensor.tensor_type not in blocks.BLOCK_TYPES or cut_inside_blocks(sharder, p.hf_name, p.tensor.tensor_type)
           for p in parts):
        return False
    return _tile_rows(parts, n, rows_multiple)


def _tile_rows(parts: list[_Part], n: int, rows_multiple: int) -> bool:
    """The parts' rows tile the weight's n rows in order (q, k, v / gate, up; or one whole), each part ending on a
    multiple of rows_multiple."""
    covered = 0
    for r0, r1 in sorted((p.rows or (0, n)) for p in parts):
        if r0 != covered or r1 % rows_multiple:
            return False
        covered = r1
    return covered == n


# weights packed per chunk of rows (packed_chunks.py): a chunk's decode temporaries are a few MB, not the tensor's
CHUNK_WEIGHTS = 1 << 22


def _packed_weight(parts: list[_Part], n: int, k: int, arch: str, cfg, stats: LoadStats, count_file: bool = True,
                   sharder=None, pages: FilePages | None = None):
    """The [n, k] packed form of _packable parts, from their blocks (never an fp32 copy); with a sharder, of this
    rank's share of them (block_shards.py). Packed a chunk of rows at a time into the whole weight's tensors, each
    chunk's file pages dropped once read; a SPLIT weight (packed_forms.py) one run of parts at a time, as to_packed
    builds it."""
    ordered = sorted(parts, key=lambda p: (p.rows or (0, n))[0])
    raws = _raw_parts(ordered, n, k, arch, cfg, sharder)
    qtypes = [p.tensor.tensor_type for p in ordered]
    kind = common_form(qtypes)
    run_forms = runs(qtypes) if kind == SPLIT else [(0, len(ordered), kind)]
    blocks_of_runs = [_assembled(raws[a:b], qtypes[a:b], form, k, pages) for a, b, form in run_forms]
    weight = PackedWeight.split(blocks_of_runs) if kind == SPLIT else blocks_of_runs[0]
    holders = [block for block, (a, b, _) in zip(blocks_of_runs, run_forms) for _ in range(a, b)]   # each part's form
    for p, raw, holder in zip(ordered, raws, holders):
        share = raw.shape[0] / holder.out_features
        file_bytes = int(p.tensor.n_bytes) // (1 if p.index is None else int(p.tensor.shape[-1]))
        stats.add(p.tensor.tensor_type.name, file_bytes if count_file else 0, int(holder.nbytes * share),
                  KIND_NAMES[holder.kind])
    return weight


def _raw_parts(ordered: list[_Part], n: int, k: int, arch: str, cfg, sharder) -> list[np.ndarray]:
    """Each part's raw blocks (this rank's share of them), checked against the [n, k] weight's rows."""
    raws = []
    for p in ordered:
        r0, r1 = p.rows or (0, n)
        full = _shape(p.tensor, p.index is not None)
        raw, local_k = shard_raw(sharder, p.hf_name, _rows(p, arch, cfg), p.tensor.tensor_type, full[-1])
        if (raw.shape[0], local_k) != (r1 - r0, k):
            local = [raw.shape[0], local_k]
            raise GGUFFileError(f"tensor {p.tensor.name!r}: shape {list(full)} (this rank's part {local}) != "
                                f"{[r1 - r0, k]} expected for {p.hf_name}")
        raws.append(raw)
    return raws


def _triton_blocks(model, target: str, module, parts: list[_Part], arch: str, cfg, stats: LoadStats, sharder=None,
                   pages: FilePages | None = None, count_file: bool = True) -> bool:
    """Replace a dense linear by a GgufLinear of its parts' blocks (this rank's share), decoded a chunk of rows at a
    time onto its device; False (the dense path) unless every part is a block type tiling the rows, whole blocks
    on this rank."""
    from steploop.gpu_worker.gguf.triton_linear import GgufBlocks, GgufLinear
    if not isinstance(module, torch.nn.Linear):
        return False
    n, k = module.out_features, module.in_features
    if any(p.expert is not None for p in parts) or not _blocks_tile(parts, n, sharder, 1):
        return False
    ordered = sorted(parts, key=lambda p: (p.rows or (0, n))[0])
    device = module.weight.device
    runs, pending = [], []
    step = max(1, CHUNK_WEIGHTS // k)
    for p, raw in zip(ordered, _raw_parts(ordered, n, k, arch, cfg, sharder)):
        for c0 in range(0, raw.shape[0], step):
            piece = blocks.decode(raw[c0:c0 + step], p.tensor.tensor_type, k)
            if pending and GgufBlocks.form(piece) != GgufBlocks.form(pending[0]):
                runs.append(GgufBlocks.from_decoded(pending, device))
                pending = []
            pending.append(piece)
            if pages is not None:
                pages.drop_view(raw[c0:c0 + step])
    runs.append(GgufBlocks.from_decoded(pending, device))
    layer = GgufLinear(runs, module.bias)
    parent, _, child = target.removesuffix(".weight").rpartition(".")
    setattr(model.get_submodule(parent), child, layer)
    for p in ordered:
        r0, r1 = p.rows or (0, n)
        stats.add(p.tensor.tensor_type.name, int(p.tensor.n_bytes) if count_file else 0,
                  layer.nbytes * (r1 - r0) // n, "triton blocks")
    return True


def _assembled(raws: list[np.ndarray], qtypes: list, form: int, k: int, pages: FilePages | None) -> PackedWeight:
    """to_packed(decoded raws, form) of parts stacked in order, built a chunk of 16-row groups at a time"""
    n = sum(raw.shape[0] for raw in raws)
    firsts = np.cumsum([0] + [raw.shape[0] for raw in raws[:-1]])
    step = max(GROUP, CHUNK_WEIGHTS // k // GROUP * GROUP)
    assembler = RowAssembler(n)
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        pieces = []
        for raw, qtype, r0 in zip(raws, qtypes, firsts):
            a, b = max(c0, r0) - r0, min(c1, r0 + raw.shape[0]) - r0          # the part's rows in this chunk
            if a < b:
                pieces.append(blocks.decode(raw[a:b], qtype, k))
                if pages is not None:
                    pages.drop_view(raw[a:b])
        assembler.add(to_packed(pieces, form))
    return assembler.weight()


def _copy_fp32(param, part: _Part, arch: str, cfg, sharder, stats: LoadStats) -> None:
    tensor = _fp32(part, _rows(part, arch, cfg), arch)
    if sharder is not None:
        tensor = sharder.shard(part.hf_name, tensor)
    dest = param.data if part.expert is None else param.data[part.expert]
    dest = dest if part.rows is None else dest[part.rows[0]:part.rows[1]]
    if tensor.dim() == 1 and dest.shape == (1, tensor.shape[0]):    # Qwen2-MoE's shared expert gate: a vector in
        tensor = tensor.unsqueeze(0)                                # the file, a [1, hidden] linear here
    if dest.shape != tensor.shape:
        raise GGUFFileError(f"tensor {part.tensor.name!r}: shape {tuple(tensor.shape)} != {tuple(dest.shape)} "
                            f"expected for {part.hf_name}")
    dest.copy_(tensor)
    file_bytes = int(part.tensor.n_bytes) // (1 if part.index is None else int(part.tensor.shape[-1]))
    stats.add(part.tensor.tensor_type.name, file_bytes, dest.numel() * dest.element_size(), "fp32")


def gguf_source(folder: pathlib.Path) -> pathlib.Path | None:
    """The GGUF file a converted folder reads its weights from (gguf_convert writes SOURCE_FILE), or None."""
    import json
    source = folder / SOURCE_FILE
    if not source.is_file():
        return None
    path = pathlib.Path(json.loads(source.read_text())["path"])
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: its GGUF file {path} is gone")
    return path
