"""Write a small random HF model as a GGUF file, as llama.cpp's convert_hf_to_gguf.py would (no download): F32
tensors named by the gguf package's TensorNameMap (through transformers' get_gguf_hf_weights_map, the map its reader
inverts), the metadata keys transformers' reader takes, llama.cpp's q/k row permutation for llama-arch models and
Gemma's norms stored as 1 + w, and the default model's byte-level BPE tokenizer with its chat template."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import torch

from tests.worker.family_models import _COMMON

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "phi3": "phi3", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "mixtral": "llama"}
_EXPERT = re.compile(r"\.experts\.\d+\.")
# The GGUF tests' model shape: k-quant rows hold whole 256-weight super-blocks
GGUF_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}


def random_model(config_name: str, **config):
    """A random fp32 transformers model of config class `config_name` at GGUF_SHAPE (seed 0), `config` on top."""
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_name)(**{**_COMMON, **GGUF_SHAPE, **config}), dtype=torch.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (transformers' LlamaTensorProcessor undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(model) -> dict[str, str]:
    """GGUF name -> HF name (an expert's without its index). Mixtral, which llama.cpp converts as a llama with
    experts, by gguf-py's llama TensorNameMap (transformers' map knows no mixtral); the others by transformers'."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map
    if model.config.model_type != "mixtral":
        return get_gguf_hf_weights_map(model)
    from gguf import MODEL_ARCH, get_tensor_name_map
    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    out = {}
    for name in model.state_dict():
        base, suffix = _EXPERT.sub(".experts.", name).rsplit(".", 1)
        if name_map.get_name(base) is not None:
            out[f"{name_map.get_name(base)}.{suffix}"] = f"{base}.{suffix}"
    return out


def _tensors(model) -> dict[str, np.ndarray]:
    """Qwen2/3-MoE and Mixtral experts go in as llama.cpp stacks them: one [experts, rows, k] tensor per projection
    (ffn_gate_exps, ffn_up_exps, ffn_down_exps), the map's name without the expert index; Qwen2-MoE's shared
    expert gate as a vector."""
    cfg = model.config
    to_gguf = {hf: g for g, hf in gguf_names(model).items()}
    out, experts = {}, {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.to(torch.float32).numpy().copy()
        if _EXPERT.search(name):
            experts.setdefault(to_gguf[_EXPERT.sub(".experts.", name)], []).append(w)
            continue
        gguf_name = to_gguf[name]
        if "ffn_gate_inp_shexp" in gguf_name:
            w = w.reshape(-1)
        if GGUF_ARCH[cfg.model_type] == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            w = _permute(w, cfg.num_attention_heads if ".attn_q." in gguf_name else cfg.num_key_value_heads)
        if cfg.model_type.startswith("gemma") and "norm.weight" in gguf_name:
            w = w + 1.0
        out[gguf_name] = w
    out.update({gguf_name: np.stack(ws) for gguf_name, ws in experts.items()})
    return out


def _add_tokenizer(writer, tokenizer_dir: pathlib.Path, unigram: bool, vocab_size: int | None = None) -> None:
    """unigram: transformers reads a Gemma GGUF's tokenizer as sentencepiece (scores, an unk id), so it gets those
    too; the tests send token ids, so only the model's ids matter. vocab_size: pad the token list with plain tokens
    no merge reaches (a model shaped as one with a larger vocabulary, e.g. Llama 3's 128256)."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["id"] for t in spec["added_tokens"] if t.get("special")}
    for t in spec["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"<pad_{i}>" for i in range(len(tokens), vocab_size or 0)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    if unigram:
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    template = tokenizer_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


# the k-quants' fp16 scale fields (byte offsets in a block) and the scale that gives weights of about +-0.1
_K_SCALES = {"Q4_K": ((0, 0.1 / 120), (2, 0.1 / 31)), "Q5_K": ((0, 0.1 / 240), (2, 0.1 / 31)),
             "Q6_K": ((208, 0.1 / 1000),)}


def quantize(w: np.ndarray, qtype, seed: int = 0) -> np.ndarray:
    """w [..., rows, k] fp32 -> the GGUF blocks of `qtype` (uint8 [..., rows, row bytes]). gguf-py quantizes the
    types it can (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16); the k-quants (which it only dequantizes) get random block bytes
    with sane fp16 scales: any valid bytes are a valid checkpoint, and the oracle reads the file, not w."""
    import gguf
    if qtype.name not in _K_SCALES:
        return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    rows = int(np.prod(w.shape[:-1]))
    raw = rng.integers(0, 256, size=(rows, w.shape[-1] // block, size), dtype=np.uint8)
    for offset, scale in _K_SCALES[qtype.name]:
        d = (scale * rng.uniform(0.5, 1.5, size=raw.shape[:2])).astype(np.float16)
        raw[..., offset:offset + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(*w.shape[:-1], -1)


def add_shape(writer, name: str, context: int, hidden: int, layers: int, mlp: int, heads: int, kv_heads: int,
              head_dim: int, eps: float, rope_theta: float, vocab: int) -> None:
    """The metadata keys of a decoder's shape that transformers' reader and llama.cpp take."""
    writer.add_name(name)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)


def write_gguf(model, out: pathlib.Path, tokenizer_dir: pathlib.Path, name: str = "steploop-test",
               qtype_of=None) -> pathlib.Path:
    """`model`: a transformers CausalLM (random weights); returns the GGUF file written at `out`.
    qtype_of(gguf tensor name, 2-D or 3-D (experts) weight) -> a gguf.GGMLQuantizationType to store it as (None:
    F32)."""
    import gguf
    cfg = model.config
    writer = gguf.GGUFWriter(str(out), GGUF_ARCH[cfg.model_type])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    add_shape(writer, name, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_hidden_layers,
              cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cfg.rms_norm_eps,
              cfg.rope_theta, cfg.vocab_size)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:                                     # llama.cpp's MoE keys (Mixtral's width: feed_forward_length)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _add_tokenizer(writer, tokenizer_dir, unigram=cfg.model_type.startswith("gemma"))
    for i, (tensor_name, w) in enumerate(_tensors(model).items()):
        qtype = qtype_of(tensor_name, w) if qtype_of is not None and w.ndim in (2, 3) else None
        if qtype is None or qtype.name == "F32":
            writer.add_tensor(tensor_name, w)
        else:
            writer.add_tensor(tensor_name, quantize(w, qtype, seed=i), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
