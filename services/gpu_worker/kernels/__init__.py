"""Triton kernels of the worker, one module per kernel family, each a triad: @triton.jit kernel, a launcher that
checks its inputs and explains its grid, and a slow obvious torch reference (in `reference.py`).

    paged_attention   unified paged attention over one flat batch (prompt chunks + decodes), split-KV + reduce,
                      per-layer sliding window and logit soft-capping
    cache_write       write the step's new K/V into the paged cache by slot (slot -1 = skip)
    fused             RMSNorm (+ residual add), neox rotary in place on q and k, SiLU-and-mul
    lora_shrink       batched LoRA z = scale * x[rows] @ A[slot]^T over the step's adapter segments (Punica/S-LoRA)
    lora_expand       batched LoRA y[rows, slice] += z @ B[slot]^T in place (lora_meta: their shared checks/tiles)
    lora_rows         the jit prologue both share: one program's rows of a segment and its slot
    lora_ops          the LoRA dispatch: Triton on CUDA, a torch path on the CPU (imports no triton itself;
                      references in lora_reference.py)
    fused_moe         mixture-of-experts MLP: pairs sorted by expert, grouped GEMMs (GLU up, routed down)
    activations       @triton.jit helpers: overflow-free tanh, silu / gelu / gelu_tanh
    tuning            the attention launch configs tuned at start, and the warm-up compiles (imports no triton
                      at module level)

Importing any kernel module imports triton and decorates the kernels. Triton decides at decoration time
whether a kernel is interpreted (TRITON_INTERPRET=1) or compiled, so set that variable before the first import.
Nothing in the worker imports a kernel module unless the triton backend is selected or LoRA / MoE run on CUDA;
lora_ops and lora_meta import no triton, so the CPU LoRA path runs on the `[worker-cpu]` install (no triton).
"""
