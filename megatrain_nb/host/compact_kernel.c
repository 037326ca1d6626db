/* AdamW over block-wise quantized moments, fused: dequantize, update in fp32, requantize, one pass.
 *
 * Built at first use by compact_host.py (gcc -O3 -march=native -fopenmp, cached by source hash) and called
 * through ctypes, which releases the GIL. The arithmetic follows compact_state.update_torch element for
 * element, with fused multiply-adds and reciprocals where they change a result by an ulp:
 *   m  = dq(m) + (1 - b1) (g - dq(m));   v = dq(v) + (1 - b2) (g*g - dq(v))        (torch.lerp's form)
 *   p  = p - lr*wd*p;   p = p - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)
 * then each block of the new moments is scaled by its absmax (clipped at 1e-12) and every value stored as
 * the nearest entry of its map (ties up), as torchao's quantize_8bit_with_qmap / quantize_4bit_with_qmap.
 * Exempt positions (fp32 moments kept apart) are neither read nor written, and count 0 in the absmax.
 * Every thread sets flush-to-zero and denormals-are-zero first (Note: [Subnormals] in denormals.py).
 *
 * Note: [Code by threshold count] "nearest entry, ties up" of a sorted map q of N entries is the number of
 * thresholds t[0..N-2] at or below x, t[c] the least float x in (q[c], q[c+1]] with fl(x - q[c]) >=
 * fl((q[c+1] - q[c]) * 0.5) (compact_host._thresholds finds them exactly and checks them). Two ways to
 * count: a binary search over the 16 thresholds of a 4-bit map held in one register (permutes, no memory),
 * and for 8 bits a bucket table keyed by x's sign and top 15 magnitude bits (magnitudes under 2^-23 share
 * bucket 0, at or over 1 the last): entry = count below the bucket << 17 | the low 16 key bits of the one
 * threshold inside it (0x10000: none). One lookup, one compare; the table is about 23 KiB a map.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GET_CSR() _mm_getcsr()
#define SET_CSR(c) _mm_setcsr(c)
#else
#define GET_CSR() 0u
#define SET_CSR(c) ((void)(c))
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define USE_AVX512 1
#endif

#define MAXB 256
#define TAB_LO 0x3400 /* top 16 bits of 2^-23: magnitudes below share bucket 0 */
#define TAB_HI 0x3F80 /* top 16 bits of 1.0: magnitudes at or above share the last bucket */
#define TAB_HALF (TAB_HI - TAB_LO + 2) /* buckets per sign */

/* Kernel's constants of one call, rounded by the caller. */
typedef struct {
    float grad_scale, lr_bc1, w1, w2, eps, decay, inv_bc2s;
} Hyper;

/* One map: q (N values), t (thresholds, N - 1 then +inf), tab (2 * TAB_HALF bucket entries). */
typedef struct {
    const float *q, *t;
    const uint32_t *tab;
} Map;

int table_layout(int32_t *out) { /* lets the Python side check it builds what this file reads */
    out[0] = TAB_LO;
    out[1] = TAB_HI;
    out[2] = TAB_HALF;
    return 3;
}

static inline uint32_t f2u(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int code_scalar(float x, const uint32_t *tab) {
    uint32_t b = f2u(x), neg = b >> 31;
    int32_t k = (int32_t)((b >> 16) & 0x7FFF) - (TAB_LO - 1);
    k = k < 0 ? 0 : (k > TAB_HI - TAB_LO + 1 ? TAB_HI - TAB_LO + 1 : k);
    uint32_t e = tab[k + (neg ? TAB_HALF : 0)];
    uint32_t low = (neg ? ~b : b) & 0xFFFF;
    return (int)(e >> 17) + (low >= (e & 0x1FFFF));
}

/* [s, s + len) of one block; skip[j]: position s + j keeps fp32 moments (NULL: none does). Portable path,
 * and every block's path where AVX-512 is missing; the codes of a partial block's padding are the code of
 * 0, as update_torch pads blocks with zeros. */
static void block_scalar(float *p, const void *g, int g_bf16, int64_t s, int len, int block, int bits,
                         uint8_t *mc, float *ms, uint8_t *vc, float *vs, int64_t k, Map M, Map V, Hyper h,
                         const uint8_t *skip) {
    float m[MAXB], v[MAXB];
    uint8_t cm[MAXB], cv[MAXB];
    if (bits == 8) {
        memcpy(cm, mc + s, (size_t)len);
        memcpy(cv, vc + s, (size_t)len);
    } else {
        for (int j = 0; j < len; j++) {
            uint8_t a = mc[(s + j) >> 1], b = vc[(s + j) >> 1];
            cm[j] = (j & 1) ? (a & 15) : (a >> 4);
            cv[j] = (j & 1) ? (b & 15) : (b >> 4);
        }
    }
    const float sm = ms[k], sv = vs[k];
    float am = 0.0f, av = 0.0f;
    for (int j = 0; j < len; j++) {
        float gi = (g_bf16 ? bf16_to_f32(((const uint16_t *)g)[s + j]) : ((const float *)g)[s + j]) * h.grad_scale;
        float mi = M.q[cm[j]] * sm, vi = V.q[cv[j]] * sv;
        mi = fmaf(h.w1, gi - mi, mi);
        vi = fmaf(h.w2, fmaf(gi, gi, -vi), vi);
        float pi = p[s + j];
        float den = fmaf(sqrtf(vi), h.inv_bc2s, h.eps);
        float nw = fmaf(-h.decay, pi, pi) - (h.lr_bc1 * mi) / den;
        if (skip && skip[j]) {
            mi = vi = 0.0f;
        } else {
            p[s + j] = nw;
        }
        m[j] = mi;
        v[j] = vi;
        am = fabsf(mi) > am ? fabsf(mi) : am;
        av = fabsf(vi) > av ? fabsf(vi) : av;
    }
    am = am > 1e-12f ? am : 1e-12f;
    av = av > 1e-12f ? av : 1e-12f;
    ms[k] = am;
    vs[k] = av;
    const float rm = 1.0f / am, rv = 1.0f / av;
    const int c0m = code_scalar(0.0f, M.tab), c0v = code_scalar(0.0f, V.tab);
    for (int j = 0; j < block; j++) {
        cm[j] = (uint8_t)(j < len ? code_scalar(m[j] * rm, M.tab) : c0m);
        cv[j] = (uint8_t)(j < len ? code_scalar(v[j] * rv, V.tab) : c0v);
    }
    if (bits == 8) {
        memcpy(mc + s, cm, (size_t)block);
        memcpy(vc + s, cv, (size_t)block);
    } else {
        for (int j = 0; j < block; j += 2) {
            mc[(s + j) >> 1] = (uint8_t)((cm[j] << 4) | cm[j + 1]);
            vc[(s + j) >> 1] = (uint8_t)((cv[j] << 4) | cv[j + 1]);
        }
    }
}

#ifdef USE_AVX512
/* 16 codes (as int32) of positions s .. s + 15. */
static inline __m512i load_codes(const uint8_t *c, int64_t s, int bits) {
    if (bits == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + s)));
    __m128i b = _mm_loadl_epi64((const __m128i *)(c + (s >> 1)));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo)); /* high nibble first */
}

static inline void store_codes(uint8_t *c, int64_t s, int bits, __m512i code) {
    __m128i c8 = _mm512_cvtepi32_epi8(code);
    if (bits == 8) {
        _mm_storeu_si128((__m128i *)(c + s), c8);
        return;
    }
    /* 16-bit word = even | odd << 8  ->  even << 4 | odd in its low byte */
    __m128i w = _mm_and_si128(_mm_or_si128(_mm_slli_epi16(c8, 4), _mm_srli_epi16(c8, 8)), _mm_set1_epi16(0xFF));
    _mm_storel_epi64((__m128i *)(c + (s >> 1)), _mm_packus_epi16(w, w));
}

/* Note: [Dequantize by permutes] a gather is slow where the CPU mitigates Gather Data Sampling (Intel's 2023
 * microcode: tens of cycles each), and the 8-bit path took four for 16 positions: two to dequantize, two for the
 * bucket table. An 8-bit map's 256 entries are instead looked up with eight two-register permutes (each picks
 * among 32 entries by a code's low 5 bits) and a tree of blends on bits 5, 6 and 7. Counting the code by a
 * binary search of such lookups (about 35 instructions for 16 positions) would replace the bucket table's one
 * gather; in a quick, unrecorded comparison on the 2-core CPU box it was slower, so quantizing keeps the table.
 * bench/host_adam.py measures the rates (ours_int8 against fp32_fused) on the host that matters. */
static inline __m512 lut256(__m512i c, const float *q) {
    __m512 r[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_permutex2var_ps(_mm512_loadu_ps(q + 32 * i), c, _mm512_loadu_ps(q + 32 * i + 16));
    for (int bit = 32, w = 8; w > 1; bit <<= 1, w >>= 1) {
        const __mmask16 hi = _mm512_test_epi32_mask(c, _mm512_set1_epi32(bit));
        for (int i = 0; i < w / 2; i++) r[i] = _mm512_mask_blend_ps(hi, r[2 * i], r[2 * i + 1]);
    }
    return r[0];
}

static inline __m512 dequant(__m512i c, const float *q, __m512 q16, int bits) {
    return bits == 8 ? lut256(c, q) : _mm512_permutexvar_ps(c, q16);
}

/* Note: [Code by threshold count]: 4 bits a binary search over t16 (thresholds, +inf last), 8 bits the
 * bucket table. */
static inline __m512i quant(__m512 x, const uint32_t *tab, __m512 t16, int bits) {
    if (bits == 4) {
        __m512i idx = _mm512_setzero_si512();
        for (int step = 8; step; step >>= 1) {
            __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(step - 1)), t16);
            idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ), idx, _mm512_set1_epi32(step));
        }
        return idx;
    }
    __m512i b = _mm512_castps_si512(x);
    __mmask16 neg = _mm512_cmplt_epi32_mask(b, _mm512_setzero_si512());
    __m512i k = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x7FFF)),
                                 _mm512_set1_epi32(TAB_LO - 1));
    k = _mm512_min_epi32(_mm512_max_epi32(k, _mm512_setzero_si512()), _mm512_set1_epi32(TAB_HI - TAB_LO + 1));
    k = _mm512_mask_add_epi32(k, neg, k, _mm512_set1_epi32(TAB_HALF));
    __m512i e = _mm512_i32gather_epi32(k, (const int *)tab, 4);
    __m512i low = _mm512_and_si512(_mm512_mask_xor_epi32(b, neg, b, _mm512_set1_epi32(-1)), _mm512_set1_epi32(0xFFFF));
    __mmask16 up = _mm512_cmpge_epi32_mask(low, _mm512_and_si512(e, _mm512_set1_epi32(0x1FFFF)));
    __m512i c = _mm512_srli_epi32(e, 17);
    return _mm512_mask_add_epi32(c, up, c, _mm512_set1_epi32(1));
}

/* A whole block [s, s + block) with AVX-512, 16 positions a step; same arithmetic as block_scalar. */
static inline __attribute__((always_inline)) void block_avx512(float *p, const void *g, int g_bf16, int64_t s, int block, int bits, uint8_t *mc,
                         float *ms, uint8_t *vc, float *vs, int64_t k, Map M, Map V, Hyper h,
                         const uint8_t *skip) {
    __attribute__((aligned(64))) float m[MAXB], v[MAXB];
    const __m512 qm16 = _mm512_loadu_ps(M.q), qv16 = _mm512_loadu_ps(V.q); /* 4-bit maps: 16 entries */
    const __m512 sm = _mm512_set1_ps(ms[k]), sv = _mm512_set1_ps(vs[k]);
    const __m512 gs = _mm512_set1_ps(h.grad_scale), w1 = _mm512_set1_ps(h.w1), w2 = _mm512_set1_ps(h.w2);
    const __m512 lr_bc1 = _mm512_set1_ps(h.lr_bc1), eps = _mm512_set1_ps(h.eps);
    const __m512 decay = _mm512_set1_ps(h.decay), ibc2 = _mm512_set1_ps(h.inv_bc2s);
    __m512 am = _mm512_setzero_ps(), av = _mm512_setzero_ps();
    for (int j = 0; j < block; j += 16) {
        const int64_t i = s + j;
        __m512 gi = g_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i))), 16))
                           : _mm512_loadu_ps((const float *)g + i);
        gi = _mm512_mul_ps(gi, gs);
        __m512 mi = _mm512_mul_ps(dequant(load_codes(mc, i, bits), M.q, qm16, bits), sm);
        __m512 vi = _mm512_mul_ps(dequant(load_codes(vc, i, bits), V.q, qv16, bits), sv);
        mi = _mm512_fmadd_ps(w1, _mm512_sub_ps(gi, mi), mi);
        vi = _mm512_fmadd_ps(w2, _mm512_fmsub_ps(gi, gi, vi), vi);
        __m512 pi = _mm512_loadu_ps(p + i);
        __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(vi), ibc2, eps);
        __m512 nw = _mm512_sub_ps(_mm512_fnmadd_ps(decay, pi, pi), _mm512_div_ps(_mm512_mul_ps(lr_bc1, mi), den));
        __mmask16 upd = skip ? (__mmask16)~_mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(skip + j)),
                                                              _mm_set1_epi8(1))
                             : (__mmask16)0xFFFF;
        _mm512_mask_storeu_ps(p + i, upd, nw);
        mi = _mm512_maskz_mov_ps(upd, mi);
        vi = _mm512_maskz_mov_ps(upd, vi);
        _mm512_store_ps(m + j, mi);
        _mm512_store_ps(v + j, vi);
        am = _mm512_max_ps(am, _mm512_abs_ps(mi));
        av = _mm512_max_ps(av, _mm512_abs_ps(vi));
    }
    float amax = _mm512_reduce_max_ps(am), vmax = _mm512_reduce_max_ps(av);
    amax = amax > 1e-12f ? amax : 1e-12f;
    vmax = vmax > 1e-12f ? vmax : 1e-12f;
    ms[k] = amax;
    vs[k] = vmax;
    const __m512 rm = _mm512_set1_ps(1.0f / amax), rv = _mm512_set1_ps(1.0f / vmax);
    const __m512 tm16 = _mm512_loadu_ps(M.t), tv16 = _mm512_loadu_ps(V.t); /* 4-bit maps' thresholds */
    for (int j = 0; j < block; j += 16) {
        store_codes(mc, s + j, bits, quant(_mm512_mul_ps(_mm512_load_ps(m + j), rm), M.tab, tm16, bits));
        store_codes(vc, s + j, bits, quant(_mm512_mul_ps(_mm512_load_ps(v + j), rv), V.tab, tv16, bits));
    }
}
#endif

/* One AdamW step over positions [0, n) of a unit; blocks of ``block`` from position 0. Each map: ``q``
 * (N values), ``t`` (N - 1 thresholds then +inf), ``tab`` (bucket table); Note: [Code by threshold count].
 * w1 = 1 - b1, w2 = 1 - b2, decay = lr * wd, lr_bc1 = lr / bc1, inv_bc2s = 1 / sqrt(bc2), as the caller
 * rounds them. Blocks are split statically over threads and each is computed alone: the bytes do not
 * depend on the thread count. */
void adamw_compact(float *p, const void *g, int g_bf16, float grad_scale, int64_t n, uint8_t *mc, float *ms,
                   uint8_t *vc, float *vs, int bits, int block, const float *qm, const float *tm,
                   const uint32_t *tabm, const float *qv, const float *tv, const uint32_t *tabv,
                   const int64_t *spans, int64_t nspans, /* sorted [a, b) pairs of exempt positions */
                   float lr_bc1, float w1, float w2, float eps, float decay, float inv_bc2s, int threads) {
    const int64_t nblocks = (n + block - 1) / block;
    const Hyper h = {grad_scale, lr_bc1, w1, w2, eps, decay, inv_bc2s};
    const Map M = {qm, tm, tabm}, V = {qv, tv, tabv};
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = GET_CSR(); /* restored at the end: the caller's thread and the pool run torch ops */
        SET_CSR(csr | 0x8040u);        /* flush-to-zero, denormals-are-zero */
        __attribute__((aligned(64))) uint8_t skip[MAXB];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < nblocks; k++) {
            const int64_t s = k * block;
            const int len = (int)((n - s) < block ? (n - s) : block);
            int any_skip = 0;
            if (nspans) {
                int64_t lo = 0, hi = nspans; /* first span ending after s */
                while (lo < hi) {
                    int64_t mid = (lo + hi) / 2;
                    if (spans[2 * mid + 1] <= s) lo = mid + 1; else hi = mid;
                }
                for (int64_t t = lo; t < nspans && spans[2 * t] < s + len; t++) {
                    if (!any_skip) memset(skip, 0, sizeof skip);
                    int64_t a = spans[2 * t] > s ? spans[2 * t] : s;
                    int64_t b = spans[2 * t + 1] < s + len ? spans[2 * t + 1] : s + len;
                    memset(skip + (a - s), 1, (size_t)(b - a));
                    any_skip = 1;
                }
            }
            const uint8_t *sk = any_skip ? skip : NULL;
#ifdef USE_AVX512
            if (len == block) {
                if (bits == 8) /* constant bits: the lookups unroll */
                    block_avx512(p, g, g_bf16, s, 256, 8, mc, ms, vc, vs, k, M, V, h, sk);
                else
                    block_avx512(p, g, g_bf16, s, 128, 4, mc, ms, vc, vs, k, M, V, h, sk);
                continue;
            }
#endif
            block_scalar(p, g, g_bf16, s, len, block, bits, mc, ms, vc, vs, k, M, V, h, sk);
        }
        SET_CSR(csr);
    }
}
