// Weight-only matrix kernels for decode on AVX2+FMA CPUs: y[m, n] = sum_k x[m, k] * W[n, k], few rows m.
//
// Decode multiplies a few activation rows by every weight once per token, so the time is the weight bytes
// read from memory; the kernel's job is to read each weight once, at full bandwidth, and keep the
// arithmetic off the critical path. Weights stay in their stored format and are widened to fp32 in
// registers; activations and accumulation are fp32, so results equal the reference up to summation order
// (no activation quantization, unlike fbgemm's dynamic int8 or llama.cpp's Q8_0 dot products).
//
// Threads: OpenMP over blocks of output rows. This library needs libgomp.so.1, which resolves to the copy
// torch has already loaded, so these loops share torch's thread pool and its thread count.
//
// One row (M == 1): 4 weight rows at a time, k unrolled twice: 8 independent FMA chains, enough to hide
// the FMA latency (with 4 chains the kernel was latency-bound at half the speed).
// Several rows: a block of 4 weight rows, KC columns at a time, is widened once into an fp32 scratch in
// L1, and every activation row streams past it (2 weight rows x 4 activation rows per register tile), so a
// batch still reads each weight from memory once and widens it once.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NB 4    // weight rows per block
#define KC 256  // columns per widened chunk: NB * KC floats = 4 KB of scratch

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }

// acc[r][m] += sum_{k < len} w_r[k] * x[m * ldx + k] for r < 2, m < mb (mb <= 4); len % 8 == 0.
static inline void tile_2x4(const float *w0, const float *w1, const float *x, int64_t ldx, int64_t len, int mb,
                            float acc[2][4]) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    const float *x0 = x, *x1 = x + (mb > 1 ? ldx : 0), *x2 = x + (mb > 2 ? 2 * ldx : 0),
                *x3 = x + (mb > 3 ? 3 * ldx : 0);
    for (int64_t k = 0; k < len; k += 8) {
        __m256 u = load_f32(w0 + k), v = load_f32(w1 + k), xv;
        xv = load_f32(x0 + k); a00 = _mm256_fmadd_ps(u, xv, a00); a10 = _mm256_fmadd_ps(v, xv, a10);
        xv = load_f32(x1 + k); a01 = _mm256_fmadd_ps(u, xv, a01); a11 = _mm256_fmadd_ps(v, xv, a11);
        xv = load_f32(x2 + k); a02 = _mm256_fmadd_ps(u, xv, a02); a12 = _mm256_fmadd_ps(v, xv, a12);
        xv = load_f32(x3 + k); a03 = _mm256_fmadd_ps(u, xv, a03); a13 = _mm256_fmadd_ps(v, xv, a13);
    }
    // rows past mb computed duplicates of row 0; they are simply not stored
    __m256 r0[4] = {a00, a01, a02, a03}, r1[4] = {a10, a11, a12, a13};
    for (int m = 0; m < mb; m++) {
        acc[0][m] += hsum(r0[m]);
        acc[1][m] += hsum(r1[m]);
    }
}

// Several activation rows against one block of nb fp32 weight rows (w, row stride K): out[m][r].
static void block_many(const float *w, int64_t nb, const float *x, int64_t M, int64_t K, int64_t kc_len,
                       int64_t k0, float *out) {
    for (int64_t r = 0; r < nb; r += 2) {
        const float *w0 = w + r * kc_len, *w1 = w0 + (r + 1 < nb ? kc_len : 0);
        for (int64_t m = 0; m < M; m += 4) {
            int mb = (int)(M - m < 4 ? M - m : 4);
            float acc[2][4] = {{0}};
            tile_2x4(w0, w1, x + m * K + k0, K, kc_len, mb, acc);
            for (int i = 0; i < mb; i++) {
                out[(m + i) * NB + r] += acc[0][i];
                if (r + 1 < nb) out[(m + i) * NB + r + 1] += acc[1][i];
            }
        }
    }
}

// One activation row: 4 weight rows (W loaded by LOAD from row pointers p0..p3), 8 FMA chains.
#define DOT4_ONE(T, LOAD)                                                                        \
    static void dot4_one_##T(const T *p0, const T *p1, const T *p2, const T *p3, const float *x,   \
                             int64_t K, float out[4]) {                                           \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0; \
        int64_t k = 0;                                                                           \
        for (; k + 16 <= K; k += 16) {                                                           \
            if ((k * (int64_t)sizeof(T)) % 64 == 0) {                                            \
                /* the next block's rows: the hardware prefetcher alone reaches half the bandwidth */ \
                _mm_prefetch((const char *)(p0 + k + 4 * K), _MM_HINT_T0);                       \
                _mm_prefetch((const char *)(p1 + k + 4 * K), _MM_HINT_T0);                       \
                _mm_prefetch((const char *)(p2 + k + 4 * K), _MM_HINT_T0);                       \
                _mm_prefetch((const char *)(p3 + k + 4 * K), _MM_HINT_T0);                       \
            }                                                                                    \
            __m256 x0 = load_f32(x + k), x1 = load_f32(x + k + 8);                               \
            a0 = _mm256_fmadd_ps(LOAD(p0 + k), x0, a0); b0 = _mm256_fmadd_ps(LOAD(p0 + k + 8), x1, b0); \
            a1 = _mm256_fmadd_ps(LOAD(p1 + k), x0, a1); b1 = _mm256_fmadd_ps(LOAD(p1 + k + 8), x1, b1); \
            a2 = _mm256_fmadd_ps(LOAD(p2 + k), x0, a2); b2 = _mm256_fmadd_ps(LOAD(p2 + k + 8), x1, b2); \
            a3 = _mm256_fmadd_ps(LOAD(p3 + k), x0, a3); b3 = _mm256_fmadd_ps(LOAD(p3 + k + 8), x1, b3); \
        }                                                                                        \
        for (; k < K; k += 8) {                                                                  \
            __m256 x0 = load_f32(x + k);                                                         \
            a0 = _mm256_fmadd_ps(LOAD(p0 + k), x0, a0); a1 = _mm256_fmadd_ps(LOAD(p1 + k), x0, a1); \
            a2 = _mm256_fmadd_ps(LOAD(p2 + k), x0, a2); a3 = _mm256_fmadd_ps(LOAD(p3 + k), x0, a3); \
        }                                                                                        \
        out[0] = hsum(_mm256_add_ps(a0, b0));                                                    \
        out[1] = hsum(_mm256_add_ps(a1, b1));                                                    \
        out[2] = hsum(_mm256_add_ps(a2, b2));                                                    \
        out[3] = hsum(_mm256_add_ps(a3, b3));                                                    \
    }

DOT4_ONE(int8_t, load_i8)
DOT4_ONE(float, load_f32)

// int8 codes with one fp32 scale per output row: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
// Requires K % 8 == 0 (checked by the caller).
void gemm_int8(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * NB, nb = N - n0 < NB ? N - n0 : NB;
        const int8_t *rows[NB];
        for (int64_t r = 0; r < NB; r++) rows[r] = q + (n0 + (r < nb ? r : 0)) * K;
        if (M == 1) {
            float out[NB];
            dot4_one_int8_t(rows[0], rows[1], rows[2], rows[3], x, K, out);
            for (int64_t r = 0; r < nb; r++) y[n0 + r] = out[r] * scale[n0 + r];
            continue;
        }
        float wide[NB * KC];
        float out[M * NB];
        memset(out, 0, sizeof(out));
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t len = K - k0 < KC ? K - k0 : KC;
            for (int64_t r = 0; r < nb; r++)
                for (int64_t k = 0; k < len; k += 8) _mm256_storeu_ps(wide + r * len + k, load_i8(rows[r] + k0 + k));
            block_many(wide, nb, x, M, K, len, k0, out);
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < nb; r++) y[m * N + n0 + r] = out[m * NB + r] * scale[n0 + r];
    }
}

// fp32 weights: y[m, n] = sum_k x[m, k] * w[n, k]. Requires K % 8 == 0.
void gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * NB, nb = N - n0 < NB ? N - n0 : NB;
        if (M == 1) {
            const float *rows[NB];
            for (int64_t r = 0; r < NB; r++) rows[r] = w + (n0 + (r < nb ? r : 0)) * K;
            float out[NB];
            dot4_one_float(rows[0], rows[1], rows[2], rows[3], x, K, out);
            for (int64_t r = 0; r < nb; r++) y[n0 + r] = out[r];
            continue;
        }
        float out[M * NB];
        memset(out, 0, sizeof(out));
        // weight rows are contiguous with stride K: treat the whole row as one chunk
        block_many(w + n0 * K, nb, x, M, K, K, 0, out);
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < nb; r++) y[m * N + n0 + r] = out[m * NB + r];
    }
}

// ---------------------------------------------------------------------------------------------------------
// A whole decode step (one new token per row, all layers, the head) in one call, for fp32 activations.
//
// The torch model spends as long dispatching its ~30 small ops per layer as it does multiplying, at batch
// 1 on a small model; here each layer is 4 weight products plus a few loops over a few KB of activations.
// Same arithmetic as `Transformer.forward`: RMSNorm, fused QKV, rotate-half RoPE at each row's position,
// K/V stored into the static cache at `slot`, GQA attention over the row's valid slots (the new one
// included), output projection, residual, RMSNorm, fused gate|up, SiLU(gate) * up, down, residual; then
// the final norm and the head. Python checks every shape and layout before calling (llm/fused_decode.py).

#include <math.h>
#include <stdlib.h>

enum { LINEAR_F32 = 0, LINEAR_INT8 = 1 };

typedef struct {
    int64_t kind;        // LINEAR_F32: w is float [n, k]; LINEAR_INT8: w is int8 [n, k] with scale [n]
    const void *w;
    const float *scale;
    int64_t n, k;
} Linear;

typedef struct {
    const float *attn_norm, *ffn_norm;  // [dim]
    Linear wqkv, wo, w13, w2;
} Layer;

typedef struct {
    int64_t n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, vocab;
    int64_t max_batch, max_tokens;       // KV cache geometry: [n_layers, max_batch, n_kv_heads, max_tokens, head_dim]
    float eps;
    const float *embed;                  // [vocab, dim]
    const float *rope_cos, *rope_sin;    // [max_positions, head_dim / 2]
    const float *norm;                   // [dim]
    Linear head;
    const Layer *layers;                 // [n_layers]
    float *k_cache, *v_cache;
    const uint8_t *valid;                // [max_batch, max_tokens]: slot holds a real token of that row
} DecodeModel;

static void linear(const Linear *l, const float *x, float *y, int64_t M) {
    if (l->kind == LINEAR_INT8)
        gemm_int8(x, (const int8_t *)l->w, l->scale, y, M, l->n, l->k);
    else
        gemm_f32(x, (const float *)l->w, y, M, l->n, l->k);
}

static void rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t D, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float ss = 0.0f;
        for (int64_t i = 0; i < D; i++) ss += xm[i] * xm[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) y[m * D + i] = xm[i] * inv * w[i];
    }
}

// rotate-half RoPE of one head in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
static void rope(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = hsum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

// work: floats for h, xn [M, dim], qkv [M, (H + 2 KV) hd], att [M, H hd], gu [M, 2 hidden], act [M, hidden]
void decode_step(const DecodeModel *m, const int64_t *tokens, const int64_t *positions, int64_t M, int64_t slot,
                 float *work, float *logits) {
    const int64_t D = m->dim, H = m->n_heads, KV = m->n_kv_heads, hd = m->head_dim, half = hd / 2;
    const int64_t I = m->hidden, qkv_w = (H + 2 * KV) * hd, rep = H / KV, T = m->max_tokens;
    float *h = work, *xn = h + M * D, *qkv = xn + M * D, *att = qkv + M * qkv_w, *gu = att + M * H * hd,
          *act = gu + M * 2 * I;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int64_t r = 0; r < M; r++) memcpy(h + r * D, m->embed + tokens[r] * D, D * sizeof(float));

    for (int64_t l = 0; l < m->n_layers; l++) {
        const Layer *L = m->layers + l;
        rms_norm(h, L->attn_norm, xn, M, D, m->eps);
        linear(&L->wqkv, xn, qkv, M);
        for (int64_t r = 0; r < M; r++) {
            float *q = qkv + r * qkv_w, *k = q + H * hd, *v = k + KV * hd;
            const float *c = m->rope_cos + positions[r] * half, *s = m->rope_sin + positions[r] * half;
            for (int64_t j = 0; j < H + KV; j++) rope(q + j * hd, c, s, half);  // q heads, then k heads
            for (int64_t g = 0; g < KV; g++) {
                const int64_t at = (((l * m->max_batch + r) * KV + g) * T + slot) * hd;
                memcpy(m->k_cache + at, k + g * hd, hd * sizeof(float));
                memcpy(m->v_cache + at, v + g * hd, hd * sizeof(float));
            }
        }
#pragma omp parallel
        {
            float *p = malloc((slot + 1) * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t rh = 0; rh < M * H; rh++) {
                const int64_t r = rh / H, hq = rh % H, g = hq / rep;
                const float *q = qkv + r * qkv_w + hq * hd;
                const int64_t base = ((l * m->max_batch + r) * KV + g) * T * hd;
                const float *kc = m->k_cache + base, *vc = m->v_cache + base;
                const uint8_t *ok = m->valid + r * T;
                float top = -INFINITY, total = 0.0f;
                for (int64_t t = 0; t <= slot; t++) {
                    p[t] = ok[t] ? dot(q, kc + t * hd, hd) * scale : -INFINITY;
                    if (p[t] > top) top = p[t];
                }
                for (int64_t t = 0; t <= slot; t++) {
                    p[t] = ok[t] ? expf(p[t] - top) : 0.0f;
                    total += p[t];
                }
                float *out = att + r * H * hd + hq * hd;
                for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
                for (int64_t t = 0; t <= slot; t++) {
                    if (p[t] == 0.0f) continue;
                    const float w = p[t] / total;
                    const float *vt = vc + t * hd;
                    for (int64_t i = 0; i < hd; i++) out[i] += w * vt[i];
                }
            }
            free(p);
        }
        linear(&L->wo, att, xn, M);
        for (int64_t i = 0; i < M * D; i++) h[i] += xn[i];
        rms_norm(h, L->ffn_norm, xn, M, D, m->eps);
        linear(&L->w13, xn, gu, M);
        for (int64_t r = 0; r < M; r++) {
            const float *gate = gu + r * 2 * I, *up = gate + I;
            for (int64_t i = 0; i < I; i++) act[r * I + i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        }
        linear(&L->w2, act, xn, M);
        for (int64_t i = 0; i < M * D; i++) h[i] += xn[i];
    }
    rms_norm(h, m->norm, xn, M, D, m->eps);
    linear(&m->head, xn, logits, M);
}

// ---------------------------------------------------------------------------------------------------------
// Per-row symmetric int8 quantization at load, the same arithmetic as `_quantize_int8` in quantize.py
// (scale = absmax / 127, or 1 for an all-zero row; q = round-half-even(w / scale) clamped to +-127), in two
// passes over each row while it is in L1 instead of six full-tensor passes with temporaries.
// Returns the number of rows holding NaN or infinity (their output is meaningless: the caller falls back).
int64_t quantize_int8_rows(const float *w, int8_t *q, float *scale, int64_t N, int64_t K) {
    int64_t bad = 0;
    const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (int64_t n = 0; n < N; n++) {
        const float *row = w + n * K;
        int8_t *out = q + n * K;
        __m256 top8 = _mm256_setzero_ps(), poison = _mm256_setzero_ps();  // x * 0 is NaN for NaN and inf
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 x = _mm256_loadu_ps(row + k);
            top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, x));
            poison = _mm256_add_ps(poison, _mm256_mul_ps(x, _mm256_setzero_ps()));
        }
        float lanes[8], top = 0.0f, nan_check = hsum(poison);
        _mm256_storeu_ps(lanes, top8);
        for (int i = 0; i < 8; i++) top = fmaxf(top, lanes[i]);
        for (; k < K; k++) {
            top = fmaxf(top, fabsf(row[k]));
            nan_check += row[k] * 0.0f;
        }
        if (nan_check != 0.0f || nan_check != nan_check) {  // only NaN fails x == x; 0 * finite is 0
            bad++;
            continue;
        }
        const float s = top > 0.0f ? top / 127.0f : 1.0f;
        const __m256 s8 = _mm256_set1_ps(s);
        scale[n] = s;
        for (k = 0; k + 8 <= K; k += 8) {
            // a true division, as torch does (a reciprocal multiply would round differently)
            __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + k), s8),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
            __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(out + k), _mm_packs_epi16(i16, i16));
        }
        for (; k < K; k++) {
            float v = nearbyintf(row[k] / s);  // the default rounding mode: to nearest, ties to even
            out[k] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        }
    }
    return bad;
}

// Squared-error terms of an int8 quantization, every `step`-th row: out[0] = sum (w - q * scale)^2,
// out[1] = sum w^2, in double across rows (fp32 within a row, as the torch version does per block).
void int8_error_terms(const float *w, const int8_t *q, const float *scale, int64_t N, int64_t K, int64_t step,
                      double *out) {
    double num = 0.0, den = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : num, den)
    for (int64_t n = 0; n < N; n += step) {
        const float *row = w + n * K;
        const int8_t *codes = q + n * K;
        const __m256 s = _mm256_set1_ps(scale[n]);
        __m256 e = _mm256_setzero_ps(), r = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 x = _mm256_loadu_ps(row + k), d = _mm256_sub_ps(x, _mm256_mul_ps(load_i8(codes + k), s));
            e = _mm256_fmadd_ps(d, d, e);
            r = _mm256_fmadd_ps(x, x, r);
        }
        float fe = hsum(e), fr = hsum(r);
        for (; k < K; k++) {
            float d = row[k] - (float)codes[k] * scale[n];
            fe += d * d;
            fr += row[k] * row[k];
        }
        num += fe;
        den += fr;
    }
    out[0] = num;
    out[1] = den;
}
