// y = x @ W.T straight from a GGUF file's quantized blocks (llama.cpp's layouts, ggml-common.h): Q8_0, Q4_0,
// Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. Built into the same shared object as cpu_kernels.c (llm/kernels/native.py).
//
// Every type is read as int8 weights q with one fp32 scale `wd` and one offset `c` per 16 columns (a weight is
// wd * q + c; c is the min of Q4_1/Q5_1/Q4_K/Q5_K, else 0): a weight row is decoded into that form in an L1
// scratch, then dotted with each activation row. Activations are rounded per 32 columns to int8 (scale amax/127,
// as llama.cpp's Q8_0), so the products are integer dot products (AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw):
// sum q * xq per 16 columns, times wd * dx in fp32; the offsets add c * dx * sum(xq) per 16 columns.
// Columns are padded to a multiple of 256 with zero weights and zero activations, so the loops have no tails.

#pragma GCC optimize("fp-contract=off")  // dequantized values must equal gguf-py's unfused d * q + m exactly

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void kernel_threads_stats(int64_t *out);  // cpu_kernels.c: out[0] is the team size the other products use

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

#define SBK 256  // columns a padded superblock: 16 groups of 16

// Elements and bytes a block of `type`; 0 for a type these kernels do not read.
int64_t gguf_block_shape(int64_t type, int64_t *out) {
    int64_t bs = 0, bytes = 0;
    switch (type) {
        case F32: bs = 1, bytes = 4; break;
        case F16: bs = 1, bytes = 2; break;
        case BF16: bs = 1, bytes = 2; break;
        case Q4_0: bs = 32, bytes = 18; break;
        case Q4_1: bs = 32, bytes = 20; break;
        case Q5_0: bs = 32, bytes = 22; break;
        case Q5_1: bs = 32, bytes = 24; break;
        case Q8_0: bs = 32, bytes = 34; break;
        case Q4_K: bs = 256, bytes = 144; break;
        case Q5_K: bs = 256, bytes = 176; break;
        case Q6_K: bs = 256, bytes = 210; break;
        default: return 0;
    }
    out[0] = bs, out[1] = bytes;
    return 1;
}

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// A decoded weight row: q [Kp], wd and c [Kp / 16].
typedef struct {
    int8_t *q;
    float *wd, *c;
} Decoded;

static void put_groups(const Decoded *o, int64_t g, int count, float wd, float c) {
    for (int i = 0; i < count; i++) o->wd[g + i] = wd, o->c[g + i] = c;
}

// The 32-column types: block b holds columns 32b..32b+31 (low nibbles first, then high).
static void dec_q8_0(const uint8_t *p, int64_t b, const Decoded *o) {
    memcpy(o->q + 32 * b, p + 2, 32);
    put_groups(o, 2 * b, 2, h2f(p), 0.0f);
}

static void dec_q4(const uint8_t *qs, int8_t *q, int off) {
    for (int j = 0; j < 16; j++) q[j] = (int8_t)((qs[j] & 15) - off), q[j + 16] = (int8_t)((qs[j] >> 4) - off);
}

static void dec_q5(const uint8_t *qh4, const uint8_t *qs, int8_t *q, int off) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - off);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
    }
}

static void dec_q4_0(const uint8_t *p, int64_t b, const Decoded *o) {
    dec_q4(p + 2, o->q + 32 * b, 8);
    put_groups(o, 2 * b, 2, h2f(p), 0.0f);
}

static void dec_q4_1(const uint8_t *p, int64_t b, const Decoded *o) {
    dec_q4(p + 4, o->q + 32 * b, 0);
    put_groups(o, 2 * b, 2, h2f(p), h2f(p + 2));
}

static void dec_q5_0(const uint8_t *p, int64_t b, const Decoded *o) {
    dec_q5(p + 2, p + 6, o->q + 32 * b, 16);
    put_groups(o, 2 * b, 2, h2f(p), 0.0f);
}

static void dec_q5_1(const uint8_t *p, int64_t b, const Decoded *o) {
    dec_q5(p + 4, p + 8, o->q + 32 * b, 0);
    put_groups(o, 2 * b, 2, h2f(p), h2f(p + 2));
}

// Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes (get_scale_min_k4).
static void k4_scales(const uint8_t *p, int64_t b, const Decoded *o) {
    const float d = h2f(p), dmin = h2f(p + 2);
    const uint8_t *s = p + 4;
    for (int j = 0; j < 8; j++) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        put_groups(o, 16 * b + 2 * j, 2, d * (float)sc, -(dmin * (float)m));
    }
}

static void dec_q4_k(const uint8_t *p, int64_t b, const Decoded *o) {
    k4_scales(p, b, o);
    const uint8_t *qs = p + 16;
    int8_t *q = o->q + SBK * b;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++)
            q[64 * j + l] = (int8_t)(qs[32 * j + l] & 15), q[64 * j + 32 + l] = (int8_t)(qs[32 * j + l] >> 4);
}

static void dec_q5_k(const uint8_t *p, int64_t b, const Decoded *o) {
    k4_scales(p, b, o);
    const uint8_t *qh = p + 16, *qs = p + 48;
    int8_t *q = o->q + SBK * b;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            const int lo = qs[32 * j + l], h = qh[l];
            q[64 * j + l] = (int8_t)((lo & 15) | (((h >> (2 * j)) & 1) << 4));
            q[64 * j + 32 + l] = (int8_t)((lo >> 4) | (((h >> (2 * j + 1)) & 1) << 4));
        }
}

// Q6_K: 16 groups of 16 with int8 scales; ql low 4 bits, qh high 2 bits, 128 columns a half.
static void dec_q6_k(const uint8_t *p, int64_t b, const Decoded *o) {
    const uint8_t *ql = p, *qh = p + 128;
    const int8_t *sc = (const int8_t *)(p + 192);
    const float d = h2f(p + 208);
    for (int g = 0; g < 16; g++) put_groups(o, 16 * b + g, 1, d * (float)sc[g], 0.0f);
    int8_t *q = o->q + SBK * b;
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                const int lo = (ql[64 * h + 32 * (c & 1) + l] >> (4 * (c >> 1))) & 15;
                q[128 * h + 32 * c + l] = (int8_t)((lo | (((qh[32 * h + l] >> (2 * c)) & 3) << 4)) - 32);
            }
}

typedef void (*BlockDecoder)(const uint8_t *p, int64_t b, const Decoded *o);

static BlockDecoder decoder_of(int64_t type) {
    switch (type) {
        case Q8_0: return dec_q8_0;
        case Q4_0: return dec_q4_0;
        case Q4_1: return dec_q4_1;
        case Q5_0: return dec_q5_0;
        case Q5_1: return dec_q5_1;
        case Q4_K: return dec_q4_k;
        case Q5_K: return dec_q5_k;
        case Q6_K: return dec_q6_k;
        default: return NULL;
    }
}

static inline int64_t padded(int64_t K) { return (K + SBK - 1) / SBK * SBK; }

// One weight row into `o`, zero past K.
static void decode_row(BlockDecoder dec, const uint8_t *row, int64_t bs, int64_t bytes, int64_t K, const Decoded *o) {
    const int64_t nb = K / bs, Kp = padded(K);
    for (int64_t b = 0; b < nb; b++) dec(row + b * bytes, b, o);
    memset(o->q + K, 0, (size_t)(Kp - K));
    for (int64_t g = K / 16; g < Kp / 16; g++) o->wd[g] = 0.0f, o->c[g] = 0.0f;
}

// Per-thread scratch for one decoded row (grows, never shrinks).
static __thread void *dec_buf;
static __thread int64_t dec_cap;

static int scratch(int64_t Kp, Decoded *o) {
    const int64_t bytes = Kp + 2 * (Kp / 16) * (int64_t)sizeof(float);
    if (bytes > dec_cap) {
        _mm_free(dec_buf);
        dec_buf = _mm_malloc((size_t)bytes, 64);
        dec_cap = dec_buf ? bytes : 0;
        if (!dec_buf) return 0;
    }
    o->wd = (float *)dec_buf;
    o->c = o->wd + Kp / 16;
    o->q = (int8_t *)(o->c + Kp / 16);
    return 1;
}

// fp32 rows [N, K] of the blocks, equal to gguf-py's dequantize (wd * q + c in fp32, not fused).
static void widen_row(int64_t type, const uint8_t *row, int64_t K, float *out) {
    if (type == F32) {
        memcpy(out, row, (size_t)K * 4);
    } else if (type == F16) {
        for (int64_t i = 0; i < K; i++) out[i] = h2f(row + 2 * i);
    } else {
        for (int64_t i = 0; i < K; i++) {
            uint32_t u = (uint32_t)(row[2 * i] | (row[2 * i + 1] << 8)) << 16;
            memcpy(out + i, &u, 4);
        }
    }
}

// 0, -1 for an unknown type or K not whole blocks, -2 out of memory.
int64_t gguf_dequantize_rows(int64_t type, const void *blocks, float *out, int64_t N, int64_t K) {
    int64_t shape[2];
    if (!gguf_block_shape(type, shape) || K % shape[0]) return -1;
    const int64_t row_bytes = K / shape[0] * shape[1], Kp = padded(K);
    const BlockDecoder dec = decoder_of(type);
    int failed = 0;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = (const uint8_t *)blocks + n * row_bytes;
        float *dst = out + n * K;
        Decoded o;
        if (!dec) {
            widen_row(type, row, K, dst);
        } else if (scratch(Kp, &o)) {
            decode_row(dec, row, shape[0], shape[1], K, &o);
            for (int64_t i = 0; i < K; i++) dst[i] = o.wd[i / 16] * (float)o.q[i] + o.c[i / 16];
        } else {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        }
    }
    return failed ? -2 : 0;
}

// Activations rounded per 32 columns: q [M, Kp] int8, and per 16 columns dx (the block's scale) and
// xs = dx * sum(q over the 16), both [M, Kp / 16].
typedef struct {
    int8_t *q;
    float *dx, *xs;
    int64_t Kp;
} XQ;

static void quantize_row(const float *x, int64_t K, int8_t *q, float *dx, float *xs) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(xb[l]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int8_t *qb = q + 32 * b;
        for (int l = 0; l < 32; l++) qb[l] = (int8_t)nearbyintf(xb[l] * id);  // |x * id| <= 127 (+ rounding)
        for (int h = 0; h < 2; h++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += qb[16 * h + l];
            dx[2 * b + h] = d, xs[2 * b + h] = d * (float)s;
        }
    }
}

static int quantize_x(const float *x, int64_t M, int64_t K, XQ *out) {
    const int64_t Kp = padded(K), G = Kp / 16;
    out->Kp = Kp;
    out->q = _mm_malloc((size_t)(M * Kp), 64);
    out->dx = _mm_malloc((size_t)(2 * M * G) * sizeof(float), 64);
    if (!out->q || !out->dx) return 0;
    out->xs = out->dx + M * G;
    memset(out->q, 0, (size_t)(M * Kp));
    memset(out->dx, 0, (size_t)(2 * M * G) * sizeof(float));
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, out->q + m * Kp, out->dx + m * G, out->xs + m * G);
    return 1;
}

#define MR 4  // activation rows a pass over one decoded weight row

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// 64 columns (4 groups) a step: |q| (unsigned) against xq with q's sign, 16 int32 lanes, 4 a group; each lane's
// sum times its group's wd * dx. q = -128 never occurs (|q| <= 127 in every type, x rounded to +-127).
static inline __attribute__((always_inline)) void dot_rows(const Decoded *w, const XQ *x, int64_t m, int mb, int mins,
                                                           float *out) {
    const int64_t Kp = x->Kp, G = Kp / 16;
    __m512 acc[MR], macc[MR];
    __m512i idx[4];
    for (int c = 0; c < 4; c++) idx[c] = _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(16 * c),
                                                                             _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)), 2);
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps(), macc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < Kp / SBK; s++) {
        const __m512 wd = _mm512_loadu_ps(w->wd + 16 * s);
        __m512 sv[MR];
        for (int r = 0; r < mb; r++) sv[r] = _mm512_mul_ps(wd, _mm512_loadu_ps(x->dx + (m + r) * G + 16 * s));
        for (int c = 0; c < 4; c++) {
            const __m512i wv = _mm512_loadu_si512(w->q + SBK * s + 64 * c);
            const __m512i au = _mm512_abs_epi8(wv);
            const __mmask64 neg = _mm512_movepi8_mask(wv);
            for (int r = 0; r < mb; r++) {
                __m512i xv = _mm512_loadu_si512(x->q + (m + r) * Kp + SBK * s + 64 * c);
                xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), au, xv);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx[c], sv[r]), acc[r]);
            }
        }
        if (mins) {
            const __m512 cv = _mm512_loadu_ps(w->c + 16 * s);
            for (int r = 0; r < mb; r++)
                macc[r] = _mm512_fmadd_ps(cv, _mm512_loadu_ps(x->xs + (m + r) * G + 16 * s), macc[r]);
        }
    }
    for (int r = 0; r < mb; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], macc[r]));
}
#else
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

// 32 columns (2 groups) a step: vpmaddubsw of |q| and xq with q's sign (pairs of products, |sum| <= 2 * 128 * 127,
// no saturation), vpmaddwd with ones: 8 int32 lanes, 4 a group.
static inline __attribute__((always_inline)) void dot_rows(const Decoded *w, const XQ *x, int64_t m, int mb, int mins,
                                                           float *out) {
    const int64_t Kp = x->Kp, G = Kp / 16;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR], macc[MR];
    for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_ps(), macc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < Kp / SBK; s++) {
        for (int h = 0; h < 2; h++) {  // 8 groups: 128 columns
            const int64_t g0 = 16 * s + 8 * h;
            const __m256 wd = _mm256_loadu_ps(w->wd + g0);
            __m256 sv[MR];
            for (int r = 0; r < mb; r++) sv[r] = _mm256_mul_ps(wd, _mm256_loadu_ps(x->dx + (m + r) * G + g0));
            for (int c = 0; c < 4; c++) {
                const __m256i idx = _mm256_set_epi32(2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c, 2 * c, 2 * c, 2 * c);
                const int64_t col = SBK * s + 128 * h + 32 * c;
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w->q + col));
                const __m256i au = _mm256_abs_epi8(wv);
                for (int r = 0; r < mb; r++) {
                    const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x->q + (m + r) * Kp + col)), wv);
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(au, xv), ones);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(sv[r], idx), acc[r]);
                }
            }
            if (mins) {
                const __m256 cv = _mm256_loadu_ps(w->c + g0);
                for (int r = 0; r < mb; r++)
                    macc[r] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(x->xs + (m + r) * G + g0), macc[r]);
            }
        }
    }
    for (int r = 0; r < mb; r++) out[r] = hsum8(_mm256_add_ps(acc[r], macc[r]));
}
#endif

// mb as a constant in each case: the compiler keeps the accumulators in registers.
static void dot_group(const Decoded *w, const XQ *x, int64_t m, int mb, int mins, float *out) {
    switch (mb) {
        case 1: dot_rows(w, x, m, 1, mins, out); break;
        case 2: dot_rows(w, x, m, 2, mins, out); break;
        case 3: dot_rows(w, x, m, 3, mins, out); break;
        default: dot_rows(w, x, m, MR, mins, out); break;
    }
}

static int has_mins(int64_t type) { return type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K; }

static inline int team_size(void) {
    int64_t stats[8];
    kernel_threads_stats(stats);
    return stats[0] > 0 ? (int)stats[0] : 1;
}

// y [M, N] = x [M, K] @ W.T for W's N rows of `type` blocks; each thread decodes a weight row once and runs
// every activation row against it. 0, or -1 for an unknown type or K not whole blocks, -2 out of memory.
int64_t gguf_linear(int64_t type, const void *blocks, const float *x, float *y, int64_t M, int64_t N, int64_t K) {
    int64_t shape[2];
    const BlockDecoder dec = decoder_of(type);
    if (!dec || !gguf_block_shape(type, shape) || K % shape[0]) return -1;
    XQ xq;
    if (!quantize_x(x, M, K, &xq)) {
        _mm_free(xq.q), _mm_free(xq.dx);
        return -2;
    }
    const int64_t row_bytes = K / shape[0] * shape[1];
    const int mins = has_mins(type), nt = team_size();
    const int64_t g = N / ((int64_t)nt * 8) > 1 ? N / ((int64_t)nt * 8) : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        Decoded o;
        const int ok = scratch(xq.Kp, &o);
        if (!ok) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, g)
        for (int64_t n = 0; n < N; n++) {
            if (!ok) continue;
            decode_row(dec, (const uint8_t *)blocks + n * row_bytes, shape[0], shape[1], K, &o);
            for (int64_t m = 0; m < M; m += MR) {
                float out[MR];
                const int mb = M - m < MR ? (int)(M - m) : MR;
                dot_group(&o, &xq, m, mb, mins, out);
                for (int r = 0; r < mb; r++) y[(m + r) * N + n] = out[r];
            }
        }
    }
    _mm_free(xq.q), _mm_free(xq.dx);
    return failed ? -2 : 0;
}
