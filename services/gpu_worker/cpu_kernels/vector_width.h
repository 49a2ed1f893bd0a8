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

#endif
