/* qdot_cpu.c's int8 dot products again, each quad's integer sums by AVX-VNNI's vpdpbusd
 * (qdot_cpu.c's header, "VNNI": the same integers, so the same bits); with
 * -DPD_QDOT_EMULATE_VNNI the same code with vpdpbusd's sum in AVX2 instructions, for the
 * tests. Empty where the copies are not built (PD_QVNNI). */
#include "gemm_tile.h" /* PD_QVNNI */
#ifdef PD_QVNNI
#ifdef PD_QDOT_EMULATE_VNNI
#define PD_QDOT_DPBUSD 3
#else
#define PD_QDOT_DPBUSD 1
#endif
#include "qdot_cpu.c"
#else
typedef int pd_qdot_avxvnni_not_built; /* ISO C: a translation unit declares something */
#endif
