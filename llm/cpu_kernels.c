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
