/* AdamW over block-wise quantized moments, fused: dequantize, update in fp32, requantize, one pass.
 *
 * Built at first use by compact_state.py (gcc -O3 -fopenmp, cached by source hash) and called through
 * ctypes, which releases the GIL. The arithmetic mirrors compact_state.update_torch element for element:
 *   m  = dq(m) + (1 - b1) (g - dq(m));   v = dq(v) + (1 - b2) (g*g - dq(v))        (torch.lerp's form)
 *   p  = p - lr*wd*p;   p = p - lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)
 * then each block of the new moments is scaled by its absmax (clipped at 1e-12) and every value stored as
 * the nearest entry of its map (ties up), as torchao's quantize_8bit_with_qmap / quantize_4bit_with_qmap.
 * Exempt positions (fp32 moments kept apart) are neither read nor written, and count 0 in the absmax.
 * Every thread sets flush-to-zero and denormals-are-zero first (Note: [Subnormals] in compact_state.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define SET_FTZ() _mm_setcsr(_mm_getcsr() | 0x8040)
#else
#define SET_FTZ() ((void)0)
#endif

#define MAXB 256

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } b = {((uint32_t)h) << 16};
    return b.f;
}

/* index of the nearest map entry, as torchao: c = max{i : q[i] <= x} (0 if none), then up if
 * x - q[c] >= (q[c+1] - q[c]) * 0.5. ``tab`` gives c from x's top 16 bits, or one less (build_table's
 * caller checks that one step suffices); ``q`` has N + 1 entries, q[N] = +inf. Branchless: it vectorizes. */
static inline int nearest(float x, uint32_t bits, const float *q, const int32_t *tab) {
    int c = tab[bits >> 16];
    c += x >= q[c + 1];
    c += x - q[c] >= (q[c + 1] - q[c]) * 0.5f;
    return c;
}

/* tab[h] = max{i : q[i] <= lo(h)} (0 if none), lo(h) the least float whose top 16 bits are h. */
void build_table(const float *q, int N, int32_t *tab) {
    for (uint32_t h = 0; h < 65536; h++) {
        uint32_t a = h << 16, b = (h << 16) | 0xFFFFu;
        float fa, fb, lo;
        memcpy(&fa, &a, 4);
        memcpy(&fb, &b, 4);
        lo = (h & 0x8000u) ? fb : fa; /* negative: more bits, more negative */
        int c = 0;
        if (lo == lo) { /* NaN prefixes: 0 */
            for (int i = 0; i < N; i++)
                if (q[i] <= lo) c = i;
        }
        tab[h] = c;
    }
}

/* One AdamW step over positions [0, n) of a unit; blocks of ``block`` from position 0. ``qm``, ``qv``: maps
 * of N + 1 entries (the last +inf). w1 = 1 - b1, w2 = 1 - b2, decay = lr * wd, as the caller rounds them. */
void adamw_compact(float *p, const void *g, int g_bf16, float grad_scale, int64_t n,
                   uint8_t *mc, float *ms, uint8_t *vc, float *vs, int bits, int block,
                   const float *qm, const float *qv, const int32_t *tabm, const int32_t *tabv,
                   const int64_t *spans, int64_t nspans, /* sorted [a, b) pairs of exempt positions */
                   float lr, float w1, float w2, float eps, float decay, float bc1, float bc2_sqrt, int threads) {
    const int64_t nblocks = (n + block - 1) / block;
#pragma omp parallel num_threads(threads)
    {
        SET_FTZ();
        float m[MAXB], v[MAXB], gf[MAXB];
        union { float f[MAXB]; uint32_t u[MAXB]; } xm, xv;
        uint8_t skip[MAXB], cm[MAXB], cv[MAXB];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < nblocks; k++) {
            const int64_t s = k * block;
            const int len = (int)((n - s) < block ? (n - s) : block);
            int any_skip = 0;
            if (nspans) {
                memset(skip, 0, (size_t)len);
                int64_t lo = 0, hi = nspans; /* first span ending after s */
                while (lo < hi) {
                    int64_t mid = (lo + hi) / 2;
                    if (spans[2 * mid + 1] <= s) lo = mid + 1; else hi = mid;
                }
                for (int64_t t = lo; t < nspans && spans[2 * t] < s + len; t++) {
                    int64_t a = spans[2 * t] > s ? spans[2 * t] : s;
                    int64_t b = spans[2 * t + 1] < s + len ? spans[2 * t + 1] : s + len;
                    for (int64_t i = a; i < b; i++) skip[i - s] = 1;
                    any_skip = 1;
                }
            }
            if (bits == 8) {
                memcpy(cm, mc + s, (size_t)len);
                memcpy(cv, vc + s, (size_t)len);
            } else {
                for (int j = 0; j < len; j += 2) {
                    uint8_t a = mc[(s + j) >> 1], b = vc[(s + j) >> 1];
                    cm[j] = a >> 4; cm[j + 1] = a & 15;
                    cv[j] = b >> 4; cv[j + 1] = b & 15;
                }
            }
            if (g_bf16) {
                const uint16_t *gh = (const uint16_t *)g + s;
                for (int j = 0; j < len; j++) gf[j] = bf16_to_f32(gh[j]);
            } else {
                memcpy(gf, (const float *)g + s, sizeof(float) * (size_t)len);
            }
            const float sm = ms[k], sv = vs[k];
            float *pp = p + s;
            float am = 0.0f, av = 0.0f;
#pragma omp simd reduction(max : am, av)
            for (int j = 0; j < len; j++) {
                float gi = gf[j] * grad_scale;
                float mi = qm[cm[j]] * sm;
                float vi = qv[cv[j]] * sv;
                mi = mi + w1 * (gi - mi);
                vi = vi + w2 * (gi * gi - vi);
                float pi = pp[j];
                float nw = pi - decay * pi;
                nw = nw - lr * (mi / bc1) / (sqrtf(vi) / bc2_sqrt + eps);
                int keep = any_skip && skip[j];
                pp[j] = keep ? pi : nw;
                mi = keep ? 0.0f : mi;
                vi = keep ? 0.0f : vi;
                m[j] = mi;
                v[j] = vi;
                am = fabsf(mi) > am ? fabsf(mi) : am;
                av = fabsf(vi) > av ? fabsf(vi) : av;
            }
            am = am > 1e-12f ? am : 1e-12f;
            av = av > 1e-12f ? av : 1e-12f;
            ms[k] = am;
            vs[k] = av;
#pragma omp simd
            for (int j = 0; j < len; j++) {
                xm.f[j] = m[j] / am;
                xv.f[j] = v[j] / av;
            }
#pragma omp simd
            for (int j = 0; j < len; j++) {
                cm[j] = (uint8_t)nearest(xm.f[j], xm.u[j], qm, tabm);
                cv[j] = (uint8_t)nearest(xv.f[j], xv.u[j], qv, tabv);
            }
            if (bits == 8) {
                memcpy(mc + s, cm, (size_t)len);
                memcpy(vc + s, cv, (size_t)len);
            } else {
                if (len & 1) { /* the padding's nibble: the code of 0, as a whole block's padding gets */
                    cm[len] = (uint8_t)nearest(0.0f, 0u, qm, tabm);
                    cv[len] = (uint8_t)nearest(0.0f, 0u, qv, tabv);
                }
                for (int j = 0; j < len; j += 2) {
                    mc[(s + j) >> 1] = (uint8_t)((cm[j] << 4) | cm[j + 1]);
                    vc[(s + j) >> 1] = (uint8_t)((cv[j] << 4) | cv[j + 1]);
                }
            }
        }
    }
}
