/* qdot_cpu.c's int8 dot products again, each quad's integer sums by AVX512-VNNI's vpdpbusd
 * on 256-bit registers (AVX512VL; qdot_cpu.c's header, "VNNI": the same integers, so the
 * same bits), for chips with AVX512-VNNI and not AVX-VNNI (Cascade Lake, Ice Lake, Zen 4).
 * Empty where the copies are not built (PD_QVNNI). */
#include "gemm_tile.h" /* PD_QVNNI */
#ifdef PD_QVNNI
#define PD_QDOT_DPBUSD 2
#include "qdot_cpu.c"
#else
typedef int pd_qdot_avx512vnni_not_built; /* ISO C: a translation unit declares something */
#endif
