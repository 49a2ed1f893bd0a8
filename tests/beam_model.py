"""The tiny random Llama the beam search tests rank against transformers' generate(num_beams=...): logits spread
(a random init is near uniform: ties) and EOS made likely, so beams finish at different lengths."""

from __future__ import annotations

import torch
import transformers

EOS = 5
VOCAB = 96
PROMPTS = [[1, 17, 42, 8], [1, 60, 3], [1, 9, 9, 33, 71, 2], [1, 88]]


def tiny_beam_llama(max_position_embeddings: int = 64) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_position_embeddings,
                                      eos_token_id=EOS, pad_token_id=0, bos_token_id=1)
    m = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
        m.lm_head.weight[EOS] *= 1.6
    return m
