/* The vector width the C kernels are compiled for: VL floats, from the instruction set build.py compiles with
   (AVX-512: 16, AVX2 + FMA: 8, anything else: 4). Generic vectors wider than the hardware's made gcc keep them on
   the stack and move them through general registers after every operation (10x slower on an AVX2-only CPU). */

#ifndef STEPLOOP_VECTOR_WIDTH_H
#define STEPLOOP_VECTOR_WIDTH_H

#include <stdint.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
#else
#define VL 4
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

/* mask lanes are -1 (take a) or 0 (take b) */
static inline vf select_lanes(vi mask, vf a, vf b)
{
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* exp(x) = 2^n * exp(r) for n an integer (in a float) and r = x - n ln 2, |r| <= ln(2) / 2: Cephes' degree-6
   polynomial, ~2 ulp; 2^n from its exponent bits. Each file picks n its own way (see its exp). */
static inline vf exp_reduced(vf x, vf n)
{
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;    /* ln 2 split in two for an exact product */
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

#endif
