// y = x @ W.T straight from a GGUF file's quantized blocks (llama.cpp's layouts, ggml-common.h): Q8_0, Q4_0,
// Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. Built into the same shared object as cpu_kernels.c (llm/kernels/native.py).
//
// Every type is read as int8 codes q with one fp32 scale `wd` and one offset `c` per 16 columns (a weight is
// wd * q + c; c is the min of Q4_1/Q5_1/Q4_K/Q5_K, else 0). Each 256 columns of a weight row are decoded into
// that form in registers (`SB`: no scratch in memory, whose 32-byte stores and 64-byte loads stalled on store
// forwarding) and dotted with up to MR activation rows; more rows decode the row again (from L1) per MR rows.
// Activations are rounded per 32 columns to int8 (scale amax / 127, as llama.cpp's Q8_0), so the products are
// integer dot products (AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw): sum q * xq per 16 columns, times wd * dx in
// fp32; the offsets add c * dx * sum(xq) per 16 columns. The activations are padded with zeros to a multiple of
// 256 columns and the weights' missing blocks decode as zeros, so the loops have no tails. On AVX-512 the
// K-quants' and Q8_0's row form (kq_rows: up to 3 activation rows of Q4_K/Q6_K, 5 of Q8_0, 7 of Q5_K) takes the
// columns transposed, so each 16-column group sums in integers in one lane; from 8 rows (Q4_K/Q6_K: 4,
// Q8_0/Q5_0: 6) products run on panels (gguf_panels.c).

#pragma GCC optimize("fp-contract=off")  // dequantized values must equal gguf-py's unfused d * q + m exactly

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void kernel_threads_stats(int64_t *out);  // cpu_kernels.c: out[0] is the team size the other products use
// gguf_panels.c: many activation rows on panels of 16 weight rows (AVX-512 VNNI; 0 / -1 elsewhere)
int64_t gguf_panel_type(int64_t type);
int64_t gguf_panel_products(int64_t type, const void *blocks, int64_t row_bytes, int64_t N, int64_t K,
                            const int8_t *q, const float *dx, const float *xs, const int32_t *bs, int64_t Kp,
                            int64_t m0, int64_t m1, float *y, int64_t ldy, int64_t split, int64_t nt);

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

#define SBK 256  // columns a padded superblock: 16 groups of 16

// Elements and bytes a block of `type`; 0 for a type these kernels do not read. Static, so the products' loops
// (where `type` is a constant) fold it: the exported gguf_block_shape below may be interposed (-fPIC) and is not
// inlined, which made the 1.5B's batch-1 products 1.2x slower when superblock_bytes called it.
static inline int64_t block_shape(int64_t type, int64_t *out) {
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

int64_t gguf_block_shape(int64_t type, int64_t *out) { return block_shape(type, out); }

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#define INLINE static inline __attribute__((always_inline))

// 256 columns of a weight row, decoded: q as 8 x 32 int8, wd and c per 16 columns (2 x 8 floats each).
typedef struct {
    __m256i q[8];
    __m256 wd[2], c[2];
} SB;

static inline int64_t padded(int64_t K) { return (K + SBK - 1) / SBK * SBK; }

// Bytes a superblock (256 columns) of a row of `type`: one block of the K-quants, 8 of the others.
static inline int64_t superblock_bytes(int64_t type) {
    int64_t shape[2] = {SBK, 0};
    block_shape(type, shape);
    return SBK / shape[0] * shape[1];
}

// Blocks of 32 columns in superblock s of a row of K columns (8, or fewer in a row's last, partial superblock).
static inline int blocks_in(int64_t K, int64_t s) { return K / 32 - 8 * s < 8 ? (int)(K / 32 - 8 * s) : 8; }

static int has_mins(int64_t type) { return type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K; }

// The decoders are 256-bit byte operations (AVX2; the AVX-512 build runs them too).
INLINE __m256i lo4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
INLINE __m256i hi4(__m256i v) { return lo4(_mm256_srli_epi16(v, 4)); }
INLINE __m256i ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

// 16 bytes of nibbles: the 32 columns of a block (low nibbles first, then high).
INLINE __m256i nibbles32(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return lo4(_mm256_set_m128i(_mm_srli_epi16(v, 4), v));
}

// Bit j of the 32 bits as 16 (or 0) in byte j.
INLINE __m256i bit4_bytes(const uint8_t *qh4) {
    uint32_t bits;
    memcpy(&bits, qh4, 4);
#ifdef __AVX512BW__
    return _mm256_maskz_set1_epi8((__mmask32)bits, 16);
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#endif
}

// 8 floats, each twice: per 16 columns from per 32.
INLINE void twice(__m256 v, __m256 out[2]) {
    out[0] = _mm256_permutevar8x32_ps(v, _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0));
    out[1] = _mm256_permutevar8x32_ps(v, _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4));
}

// The fp16 at byte `at` of each of 8 blocks `bytes` apart (0 past nblk) as 8 floats, built in registers (8 scalar
// stores and a vector load would stall on store forwarding every 256 columns).
INLINE __m256 halves8(const uint8_t *p, int64_t bytes, int at, int nblk) {
    short h[8];
    for (int j = 0; j < 8; j++) {
        uint16_t v = 0;
        if (j < nblk) memcpy(&v, p + j * bytes + at, 2);
        h[j] = (short)v;
    }
    return _mm256_cvtph_ps(_mm_set_epi16(h[7], h[6], h[5], h[4], h[3], h[2], h[1], h[0]));
}

// The first 4 bytes of each of 8 blocks `bytes` apart (0 past nblk): the fp16 scale d and (Q4_1, Q5_1) the
// min m, as 8 floats each, from 8 32-bit loads (halves8 twice is 16 loads and inserts, ~1/6 of Q4_1's work at
// batch 1; a vpgatherdd was slower still on Zen 4).
INLINE void block_dm(const uint8_t *p, int64_t bytes, int nblk, __m256 *d, __m256 *m) {
    int v[8];
    for (int j = 0; j < 8; j++) {
        uint32_t u = 0;
        if (j < nblk) memcpy(&u, p + j * bytes, 4);
        v[j] = (int)u;
    }
    const __m256i g = _mm256_set_epi32(v[7], v[6], v[5], v[4], v[3], v[2], v[1], v[0]);
    const __m256i lo = _mm256_and_si256(g, _mm256_set1_epi32(0xffff)), hi = _mm256_srli_epi32(g, 16);
    const __m256i dm = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);  // d0..7 | m0..7
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
}

// The 32-column types: 8 blocks (nblk of them; the rest zero) of `bytes`, q from block j into q[j].
INLINE void sb_small(int64_t type, const uint8_t *p, int nblk, SB *o) {
    const int64_t bytes = type == Q8_0 ? 34 : type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : 24;
    const int min = type == Q4_1 || type == Q5_1;
    for (int j = 0; j < 8; j++) {
        const uint8_t *b = p + j * bytes;
        if (j >= nblk) {
            o->q[j] = _mm256_setzero_si256();
        } else if (type == Q8_0) {
            o->q[j] = ld32(b + 2);
        } else if (type == Q4_0 || type == Q4_1) {
            o->q[j] = _mm256_sub_epi8(nibbles32(b + 2 + 2 * min), _mm256_set1_epi8(type == Q4_0 ? 8 : 0));
        } else {
            const __m256i q = _mm256_or_si256(nibbles32(b + 6 + 2 * min), bit4_bytes(b + 2 + 2 * min));
            o->q[j] = _mm256_sub_epi8(q, _mm256_set1_epi8(type == Q5_0 ? 16 : 0));
        }
    }
    if (min) {
        __m256 d, m;
        block_dm(p, bytes, nblk, &d, &m);
        twice(d, o->wd), twice(m, o->c);
    } else {
        twice(halves8(p, bytes, 0, nblk), o->wd);
    }
}

// Q4_K/Q5_K's 8 6-bit scales and mins from 12 bytes (get_scale_min_k4), as bytes 0-7 and 8-15.
INLINE __m128i k4_scale_bytes(const uint8_t *s) {
    uint32_t u[4];
    memcpy(u, s, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    const uint32_t mins_lo = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_lo;
    u[0] &= m1;
    return _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);  // in registers: no store-forwarding stall
}

// Q4_K/Q5_K: sub-block 2j and 2j + 1 are the low and high nibbles of 32 bytes; Q5_K's fifth bit of
// sub-block j is bit j of the 32 qh bytes.
INLINE void sb_k45(int64_t type, const uint8_t *p, SB *o) {
    const __m128i sm = k4_scale_bytes(p + 4);
    const __m256 d = _mm256_set1_ps(h2f(p)), dmin = _mm256_set1_ps(h2f(p + 2));
    twice(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))), o->wd);
    const __m256 m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
    twice(_mm256_sub_ps(_mm256_setzero_ps(), m), o->c);
    const uint8_t *qs = p + (type == Q4_K ? 16 : 48);
    const __m256i qh = type == Q5_K ? ld32(p + 16) : _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
    for (int j = 0; j < 4; j++) {
        const __m256i v = ld32(qs + 32 * j);
        o->q[2 * j] = lo4(v), o->q[2 * j + 1] = hi4(v);
        if (type == Q5_K) {
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one);
            o->q[2 * j] = _mm256_or_si256(o->q[2 * j], _mm256_slli_epi16(h0, 4));
            o->q[2 * j + 1] = _mm256_or_si256(o->q[2 * j + 1], _mm256_slli_epi16(h1, 4));
        }
    }
}

// Q6_K: 16 int8 scales; per half of 128 columns, 64 ql bytes (low 4 bits: A, B) and 32 qh bytes H (2 high
// bits for each of the half's 4 chunks of 32).
INLINE void sb_q6_k(const uint8_t *p, SB *o) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(p + 192));
    const __m256 d = _mm256_set1_ps(h2f(p + 208));
    o->wd[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    o->wd[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    const __m256i m2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        const __m256i A = ld32(p + 64 * h), B = ld32(p + 64 * h + 32), H = ld32(p + 128 + 32 * h);
        const __m256i hb[4] = {_mm256_and_si256(_mm256_slli_epi16(H, 4), m2),
                               _mm256_and_si256(_mm256_slli_epi16(H, 2), m2), _mm256_and_si256(H, m2),
                               _mm256_and_si256(_mm256_srli_epi16(H, 2), m2)};
        const __m256i lo[4] = {lo4(A), lo4(B), hi4(A), hi4(B)};
        for (int c = 0; c < 4; c++) o->q[4 * h + c] = _mm256_sub_epi8(_mm256_or_si256(lo[c], hb[c]), off);
    }
}

// The offset Q4_0, Q5_0 and Q6_K subtract from their unsigned codes (0: the type has none).
static inline int code_offset(int64_t type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q6_K ? 32 : 0; }

// Superblock s (columns 256s..) of a row of `type` over K columns; the columns past K are zero. `biased`: the
// codes of Q4_0/Q5_0/Q6_K kept unsigned (q + offset, the offset moved into c = -offset * wd, exact), so the
// products need no sign fix (the compiler folds the offset's subtraction and addition).
INLINE void sb_decode(int64_t type, const uint8_t *row, int64_t s, int64_t K, int biased, SB *o) {
    o->c[0] = o->c[1] = _mm256_setzero_ps();
    if (type == Q4_K || type == Q5_K) {
        sb_k45(type, row + s * (type == Q4_K ? 144 : 176), o);
    } else if (type == Q6_K) {
        sb_q6_k(row + s * 210, o);
    } else {
        sb_small(type, row + s * superblock_bytes(type), blocks_in(K, s), o);
    }
    const int off = code_offset(type);
    if (biased && off) {
        for (int j = 0; j < 8; j++) o->q[j] = _mm256_add_epi8(o->q[j], _mm256_set1_epi8((char)off));
        for (int h = 0; h < 2; h++) o->c[h] = _mm256_mul_ps(o->wd[h], _mm256_set1_ps((float)-off));
    }
}

// Superblock s of a row for the products: from `pre` where the row was decoded already (tiled_pass), else now.
INLINE void sb_at(int64_t type, const uint8_t *row, int64_t s, int64_t K, const SB *pre, SB *o) {
    if (pre)
        *o = pre[s];
    else
        sb_decode(type, row, s, K, 1, o);
}

// fp32 rows [N, K] of F32/F16/BF16 blocks.
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


// A quantized row as fp32, equal to gguf-py's dequantize: wd * q + c in fp32, not fused.
#define DEQ_ROW(T) \
    case T: deq_row(T, row, K, dst); break
INLINE void deq_row(int64_t type, const uint8_t *row, int64_t K, float *dst) {
    for (int64_t s = 0; s < padded(K) / SBK; s++) {
        SB o;
        sb_decode(type, row, s, K, 0, &o);
        int8_t q[SBK];
        float wd[16], c[16];
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(q + 32 * j), o.q[j]);
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(wd + 8 * h, o.wd[h]), _mm256_storeu_ps(c + 8 * h, o.c[h]);
        const int64_t n = K - SBK * s < SBK ? K - SBK * s : SBK;
        for (int64_t i = 0; i < n; i++) dst[SBK * s + i] = wd[i / 16] * (float)q[i] + c[i / 16];
    }
}

static void dequantize_row(int64_t type, const uint8_t *row, int64_t K, float *dst) {
    switch (type) {
        DEQ_ROW(Q8_0);
        DEQ_ROW(Q4_0);
        DEQ_ROW(Q4_1);
        DEQ_ROW(Q5_0);
        DEQ_ROW(Q5_1);
        DEQ_ROW(Q4_K);
        DEQ_ROW(Q5_K);
        DEQ_ROW(Q6_K);
        default: widen_row(type, row, K, dst);
    }
}

// 0, or -1 for an unknown type or K not whole blocks. A few rows (an embedding's gather) run on the calling
// thread: no one-thread parallel region, which would park the team's other thread (see quantize_x).
int64_t gguf_dequantize_rows(int64_t type, const void *blocks, float *out, int64_t N, int64_t K) {
    int64_t shape[2];
    if (!gguf_block_shape(type, shape) || K % shape[0]) return -1;
    const int64_t row_bytes = K / shape[0] * shape[1];
    const uint8_t *rows = (const uint8_t *)blocks;
    if (N * K < 65536) {
        for (int64_t n = 0; n < N; n++) dequantize_row(type, rows + n * row_bytes, K, out + n * K);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) dequantize_row(type, rows + n * row_bytes, K, out + n * K);
    return 0;
}

// Activations rounded per 32 columns: q [M, Kp] int8, and per 16 columns dx (the block's scale), the codes'
// sum bs and xs = dx * bs, each [M, Kp / 16].
typedef struct {
    int8_t *q;
    float *dx, *xs;
    int32_t *bs;
    int64_t Kp;
} XQ;

// 32 values to int8 codes with one scale (amax / 127); `rest`, when given, gets what the codes left out.
static void quantize_block(const float *xb, int8_t *qb, float *dx, float *xs, int32_t *bs, float *rest) {
    // In 8-float vectors, the same operations as the scalar form (max of |x| ignoring NaN, amax / 127, 1 / d,
    // x * id rounded half to even): it was a libm fmaxf call per value, on the one thread before each product.
    __m256 v[4], amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax8 = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]), amax8);  // NaN: keeps amax8
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[i] = _mm256_cvtps_epi32(r);  // |x * id| <= 127 (+ rounding)
        if (rest) _mm256_storeu_ps(rest + 8 * i, _mm256_sub_ps(v[i], _mm256_mul_ps(_mm256_set1_ps(d), r)));
    }
    const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(q16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    for (int hf = 0; hf < 2; hf++) {
        const __m256i s8 = _mm256_add_epi32(qi[2 * hf], qi[2 * hf + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        const int sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
        dx[hf] = d, xs[hf] = d * (float)sum, bs[hf] = sum;
    }
}

// One activation row rounded per 32 columns; with `split`, two rows: the codes, then the codes of what they
// left out (at most half a step, so its own scale is <= 1/254 of the first's: x to about 15 bits, the two
// rows' products summed).
static void quantize_row(const float *x, int64_t K, XQ *xq, int64_t m, int split) {
    const int64_t Kp = xq->Kp, G = Kp / 16;
    for (int64_t b = 0; b < K / 32; b++) {
        float rest[32];
        for (int pass = 0; pass <= split; pass++) {
            const int64_t at = (m + pass) * G + 2 * b;
            quantize_block(pass ? rest : x + 32 * b, xq->q + (m + pass) * Kp + 32 * b, xq->dx + at, xq->xs + at,
                           xq->bs + at, split && !pass ? rest : NULL);
        }
    }
}

static inline int team_size(void) {
    int64_t stats[8];
    kernel_threads_stats(stats);
    return stats[0] > 0 ? (int)stats[0] : 1;
}

// x [M, K] rounded: M rows, or 2M with split (row 2m the codes of x's row m, 2m + 1 of what they left out).
static int quantize_x(const float *x, int64_t M, int64_t K, int split, XQ *out) {
    const int64_t Kp = padded(K), G = Kp / 16, R = split ? 2 : 1;
    M *= R;
    out->Kp = Kp;
    out->q = _mm_malloc((size_t)(M * Kp), 64);
    out->dx = _mm_malloc((size_t)(3 * M * G) * sizeof(float), 64);
    if (!out->q || !out->dx) return 0;
    out->xs = out->dx + M * G, out->bs = (int32_t *)(out->dx + 2 * M * G);
    memset(out->q, 0, (size_t)(M * Kp));
    memset(out->dx, 0, (size_t)(3 * M * G) * sizeof(float));
    // No parallel region at all for a small x, not one of a single thread (`if` false): a one-thread region
    // parks the team's other thread, and the product's region then waits to wake it (ms on a busy machine).
    if (M * K < 65536) {
        for (int64_t m = 0; m < M; m += R) quantize_row(x + m / R * K, K, out, m, split);
        return 1;
    }
#pragma omp parallel for num_threads(team_size()) schedule(static)
    for (int64_t m = 0; m < M; m += R) quantize_row(x + m / R * K, K, out, m, split);
    return 1;
}

#define MR 4  // activation rows a pass over one weight row
#define KQ_MR 8  // the same in kq_rows (AVX-512; up to 7 reach it: then panels)

// Columns of superblock s that hold weights: the padding past K decodes as zero against zero x, so its chunks
// are skipped (exactly: they would add 0). K = 576 (SmolLM2) is 2.25 superblocks, a quarter of the work padding.
static inline int64_t live_columns(int64_t K, int64_t s) { return K - SBK * s < SBK ? K - SBK * s : SBK; }

// The row form reads a weight row's superblocks in order, and a thread's rows follow each other in memory: it
// fetches FETCH_AHEAD bytes ahead of the superblock it decodes (the hardware's prefetcher alone kept the 1.5B's
// batch-1 products at 0.63-0.70 of a plain read; 4 KiB ahead 0.76-0.81, 8 KiB the same, 16 KiB less).
#define FETCH_AHEAD 4096
INLINE void fetch_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + FETCH_AHEAD + b, _MM_HINT_T0);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// The AVX-512 products' superblock: 4 x 64 columns of codes and 16 wd, c in one vector each. The K-quants are
// decoded into it directly, in the unsigned form (no 256-bit halves to join: 10 fewer inserts a superblock, and
// the K-quants' rows are most of a Q4_K_M file); the other types are joined from SB.
typedef struct {
    __m512i q[4];
    __m512 wd, c;
} SBZ;

INLINE void sbz_join(const SB *o, SBZ *z) {
    for (int c = 0; c < 4; c++) z->q[c] = _mm512_inserti64x4(_mm512_castsi256_si512(o->q[2 * c]), o->q[2 * c + 1], 1);
    z->wd = _mm512_insertf32x8(_mm512_castps256_ps512(o->wd[0]), o->wd[1], 1);
    z->c = _mm512_insertf32x8(_mm512_castps256_ps512(o->c[0]), o->c[1], 1);
}

// 32 bytes in both halves of a vector.
INLINE __m512i twin(const uint8_t *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }

// Q4_K/Q5_K as sb_k45, in 512 bits: 64 columns c are the low then the high nibbles of 32 bytes (one shift per
// 64-bit lane, 0 or 4); Q5_K's fifth bit of sub-block j, bit j of the 32 qh bytes, rotated to bit 4.
INLINE void sbz_k45(int64_t type, const uint8_t *p, SBZ *z) {
    const __m128i sm = k4_scale_bytes(p + 4);
    const __m512 d = _mm512_set1_ps(h2f(p)), dmin = _mm512_set1_ps(h2f(p + 2));
    z->wd = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sm, sm))));
    const __m512 m = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(sm, sm))));
    z->c = _mm512_sub_ps(_mm512_setzero_ps(), m);
    const uint8_t *qs = p + (type == Q4_K ? 16 : 48);
    const __m512i nib = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0), low4 = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        z->q[c] = _mm512_and_si512(_mm512_srlv_epi64(twin(qs + 32 * c), nib), low4);
        if (type == Q5_K) {
            const int64_t a = (4 - 2 * c) & 63, b = (3 - 2 * c) & 63;  // bit 2c, 2c + 1 to bit 4
            const __m512i hb = _mm512_rolv_epi64(twin(p + 16), _mm512_set_epi64(b, b, b, b, a, a, a, a));
            z->q[c] = _mm512_or_si512(z->q[c], _mm512_and_si512(hb, _mm512_set1_epi8(16)));
        }
    }
}

// Q6_K as sb_q6_k, unsigned (q + 32, c = -32 wd): per half of 128 columns, 64 ql bytes (low nibbles: columns
// 0-63, high: 64-127) and 32 qh bytes whose bit pairs 0-1, 2-3, 4-5, 6-7 hold the 4 chunks' high bits, rotated
// to bits 4-5.
INLINE void sbz_q6_k(const uint8_t *p, SBZ *z) {
    const __m512 d = _mm512_set1_ps(h2f(p + 208));
    z->wd = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)))));
    z->c = _mm512_mul_ps(z->wd, _mm512_set1_ps(-32.0f));
    const __m512i low4 = _mm512_set1_epi8(15), hi2 = _mm512_set1_epi8(0x30);
    const __m512i rot_lo = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), rot_hi = _mm512_set_epi64(62, 62, 62, 62, 0, 0, 0, 0);
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(p + 64 * h), qh = twin(p + 128 + 32 * h);
        const __m512i lo = _mm512_and_si512(ql, low4), hi = _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4);
        z->q[2 * h] = _mm512_or_si512(lo, _mm512_and_si512(_mm512_rolv_epi64(qh, rot_lo), hi2));
        z->q[2 * h + 1] = _mm512_or_si512(hi, _mm512_and_si512(_mm512_rolv_epi64(qh, rot_hi), hi2));
    }
}

// Superblock s for the products: from `pre` where decoded already (tiled_pass), else now, unsigned.
INLINE void sbz_at(int64_t type, const uint8_t *row, int64_t s, int64_t K, const SB *pre, SBZ *z) {
    if (pre) {
        sbz_join(pre + s, z);
    } else if (type == Q4_K || type == Q5_K) {
        sbz_k45(type, row + s * (type == Q4_K ? 144 : 176), z);
    } else if (type == Q6_K) {
        sbz_q6_k(row + s * 210, z);
    } else {
        SB o;
        sb_decode(type, row, s, K, 1, &o);
        sbz_join(&o, z);
    }
}

// Superblock s of a row in the unsigned form, in memory: codes [256], and per 16 columns wd and c (gguf_panels.c
// lays 16 rows of them out as a panel). Q8_0's signed codes get 128 added (the sign bit flipped), c = -128 wd.
void gguf_superblock_parts(int64_t type, const uint8_t *row, int64_t s, int64_t K, uint8_t *codes, float *wd,
                           float *c) {
    SBZ z;
    sbz_at(type, row, s, K, NULL, &z);
    if (type == Q8_0) {
        for (int j = 0; j < 4; j++) z.q[j] = _mm512_xor_si512(z.q[j], _mm512_set1_epi8((char)0x80));
        z.c = _mm512_mul_ps(z.wd, _mm512_set1_ps(-128.0f));
    }
    for (int j = 0; j < 4; j++) _mm512_storeu_si512(codes + 64 * j, z.q[j]);
    _mm512_storeu_ps(wd, z.wd), _mm512_storeu_ps(c, z.c);
}

// 64 columns (4 groups) a step: vpdpbusd of q (unsigned; for Q8_0 |q|, against xq with q's sign) and xq,
// 16 int32 lanes, 4 a group; each lane's sum times its group's wd * dx. Q8_0's q = -128 works too: vpabsb
// gives 0x80, 128 as the unsigned operand. Even and odd steps sum apart (two dependency chains of 2, not one of 4).
INLINE void dot_rows(int64_t type, const uint8_t *row, int64_t K, const XQ *x, int64_t m, int mb, float *out,
                     const SB *pre) {
    const int64_t Kp = x->Kp, G = Kp / 16;
    const int mins = has_mins(type) || code_offset(type), sign = type == Q8_0;  // the others' codes are >= 0
    __m512 acc[MR][2], macc[MR];
    __m512i idx[4];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int c = 0; c < 4; c++) idx[c] = _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(16 * c), lane), 2);
    for (int r = 0; r < mb; r++) acc[r][0] = acc[r][1] = macc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < Kp / SBK; s++) {
        SBZ o;
        if (!pre) fetch_ahead(row + s * superblock_bytes(type), superblock_bytes(type));
        sbz_at(type, row, s, K, pre, &o);
        __m512 sv[MR];
        for (int r = 0; r < mb; r++) sv[r] = _mm512_mul_ps(o.wd, _mm512_loadu_ps(x->dx + (m + r) * G + 16 * s));
        const int64_t live = live_columns(K, s);
        for (int c = 0; c < 4 && 64 * c < live; c++) {
            const __m512i au = sign ? _mm512_abs_epi8(o.q[c]) : o.q[c];
            const __mmask64 neg = sign ? _mm512_movepi8_mask(o.q[c]) : 0;
            for (int r = 0; r < mb; r++) {
                __m512i xv = _mm512_loadu_si512(x->q + (m + r) * Kp + SBK * s + 64 * c);
                if (sign) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), au, xv);
                const __m512 f = _mm512_cvtepi32_ps(p);
                acc[r][c & 1] = _mm512_fmadd_ps(f, _mm512_permutexvar_ps(idx[c], sv[r]), acc[r][c & 1]);
            }
        }
        if (mins)
            for (int r = 0; r < mb; r++)
                macc[r] = _mm512_fmadd_ps(o.c, _mm512_loadu_ps(x->xs + (m + r) * G + 16 * s), macc[r]);
    }
    for (int r = 0; r < mb; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), macc[r]));
}

// k4_scale_bytes in vector operations: bytes 0-7 the scales, 8-15 the mins. Scale j < 4 is byte j, min j < 4
// byte j + 4 (low 6 bits); scale j >= 4 is byte j + 4's low nibble, min j >= 4 its high nibble, each with the
// top 2 bits of byte j - 4 (scales) or j (mins) above them.
INLINE __m128i k4_scale_vector(const uint8_t *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s);  // 12 bytes used: a block has 144 and s is at 4
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i lo = _mm_mask_blend_epi8(0xF000, a, _mm_srli_epi16(a, 4));  // the mins' high nibbles
    const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    return _mm_ternarylogic_epi32(_mm_and_si128(lo, keep), _mm_srli_epi16(top, 2), _mm_set1_epi8(0x30), 0xf8);
}

INLINE __m512i k4_step(const __m512i lo, const __m512i hi, int t) {
    // Q4_K/Q5_K: lane G = 2k + e, step t <- dword 4e + t of 32-byte block k / 2; qword k low (k even) or high nibbles
    const __m512i idx = _mm512_set_epi32(28 + t, 24 + t, 28 + t, 24 + t, 20 + t, 16 + t, 20 + t, 16 + t,
                                         12 + t, 8 + t, 12 + t, 8 + t, 4 + t, t, 4 + t, t);
    return _mm512_permutex2var_epi32(lo, idx, hi);
}

INLINE void kq_codes_k45(int64_t type, const uint8_t *p, __m512i q[4]) {
    const uint8_t *qs = p + (type == Q4_K ? 16 : 48);
    const __m512i lo = _mm512_loadu_si512(qs), hi = _mm512_loadu_si512(qs + 64);
    const __m512i nib = _mm512_set_epi64(4, 0, 4, 0, 4, 0, 4, 0), low4 = _mm512_set1_epi8(15);
    const __m512i qh = type == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 16)))
                                    : _mm512_setzero_si512();
    for (int t = 0; t < 4; t++) {
        q[t] = _mm512_and_si512(_mm512_srlv_epi64(k4_step(lo, hi, t), nib), low4);
        if (type == Q5_K) {  // sub-block k's fifth bit: bit k of qh byte 16e + 4t + j, rotated to bit 4
            const __m512i h = _mm512_permutexvar_epi32(
                _mm512_set_epi32(4 + t, t, 4 + t, t, 4 + t, t, 4 + t, t, 4 + t, t, 4 + t, t, 4 + t, t, 4 + t, t), qh);
            const __m512i rot = _mm512_set_epi64(61, 62, 63, 0, 1, 2, 3, 4);
            const __m512i fifth = _mm512_rolv_epi64(h, rot);
            q[t] = _mm512_ternarylogic_epi32(q[t], fifth, _mm512_set1_epi8(16), 0xf8);  // a | (b & c)
        }
    }
}

// Q6_K: lane G (half G / 8), step t: ql dword 16 (G / 8) + 4 (G % 4) + t, shifted by 4 in its half's high 64
// columns; qh dword 8 (G / 8) + 4 (G % 2) + t, bit pair (G % 8) / 2 rotated to bits 4-5.
INLINE void kq_codes_q6(const uint8_t *p, __m512i q[4]) {
    const __m512i lo = _mm512_loadu_si512(p), hi = _mm512_loadu_si512(p + 64), qh = _mm512_loadu_si512(p + 128);
    const __m512i nib = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0), low4 = _mm512_set1_epi8(15);
    const __m512i rot = _mm512_set_epi64(62, 0, 2, 4, 62, 0, 2, 4), hi2 = _mm512_set1_epi8(0x30);
    for (int t = 0; t < 4; t++) {
        const __m512i li = _mm512_set_epi32(28 + t, 24 + t, 20 + t, 16 + t, 28 + t, 24 + t, 20 + t, 16 + t,
                                            12 + t, 8 + t, 4 + t, t, 12 + t, 8 + t, 4 + t, t);
        const __m512i hidx = _mm512_set_epi32(12 + t, 8 + t, 12 + t, 8 + t, 12 + t, 8 + t, 12 + t, 8 + t,
                                              4 + t, t, 4 + t, t, 4 + t, t, 4 + t, t);
        const __m512i l = _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutex2var_epi32(lo, li, hi), nib), low4);
        const __m512i h = _mm512_rolv_epi64(_mm512_permutexvar_epi32(hidx, qh), rot);
        q[t] = _mm512_ternarylogic_epi32(l, h, hi2, 0xf8);
    }
}

// Q8_0 in kq_rows' order: a superblock is 8 blocks of 34 bytes (d, 32 signed codes), nblk of them in the row
// (K = 640: the last superblock holds 4; the missing ones are not read, their codes and scales 0). Lane 2j + e
// (block j, half e), step t: block j's code dword 4e + t, from pairs of blocks joined into 512 bits; the codes
// unsigned (+128: the sign bit flipped), the 128 * sum(x) this adds coming off each lane in integers.
INLINE void kq_codes_q8(const uint8_t *p, int nblk, __m512i q[4], __m512 *wd) {
    __m512i z[4];
    for (int pr = 0; pr < 4; pr++) {
        const __m256i lo = 2 * pr < nblk ? ld32(p + 68 * pr + 2) : _mm256_setzero_si256();
        const __m256i hi = 2 * pr + 1 < nblk ? ld32(p + 68 * pr + 36) : _mm256_setzero_si256();
        z[pr] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    for (int t = 0; t < 4; t++) {  // lane L: block (L / 2) % 4 of its half's pair, dword 4 (L % 2) + t
        const __m512i idx = _mm512_set_epi32(28 + t, 24 + t, 20 + t, 16 + t, 12 + t, 8 + t, 4 + t, t,
                                             28 + t, 24 + t, 20 + t, 16 + t, 12 + t, 8 + t, 4 + t, t);
        const __m512i a = _mm512_permutex2var_epi32(z[0], idx, z[1]), b = _mm512_permutex2var_epi32(z[2], idx, z[3]);
        q[t] = _mm512_xor_si512(_mm512_mask_blend_epi32(0xFF00, a, b), _mm512_set1_epi8((char)0x80));
    }
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    *wd = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(halves8(p, 34, 0, nblk)));
}


// The K-quants and Q8_0 at few rows, with one integer sum per 16 columns. dot_rows' natural order (64 consecutive
// columns a vpdpbusd) leaves each lane 4 products of one group, so every 64 columns cost a convert, a permute and
// an fma. Here the 4 vpdpbusd of a superblock take the columns transposed (lane G, step t: columns 16G + 4t..+3),
// so lane G sums its whole group of 16 in integers and the superblock takes one convert and one fma. The weights'
// bytes go to that order with a dword permute; the activations are laid out so once per product (kq_transpose).
// The arithmetic is dot_rows': per-16 integer sums times wd * dx, so the products are equal within fp32 order.
INLINE void kq_rows(int64_t type, const uint8_t *row, int64_t K, const XQ *x, int64_t m, int mb, float *out) {
    const int64_t Kp = x->Kp, G = Kp / 16;
    __m512 acc[KQ_MR];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < Kp / SBK; s++) {
        const int64_t sb_bytes = superblock_bytes(type);
        const uint8_t *p = row + s * sb_bytes;
        fetch_ahead(p, sb_bytes);
        __m512i q[4];
        __m512 wd, c = _mm512_setzero_ps();
        if (type == Q8_0) {
            kq_codes_q8(p, blocks_in(K, s), q, &wd);
        } else if (type == Q6_K) {
            kq_codes_q6(p, q);
            wd = _mm512_mul_ps(_mm512_set1_ps(h2f(p + 208)),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)))));
            c = _mm512_mul_ps(wd, _mm512_set1_ps(-32.0f));
        } else {
            kq_codes_k45(type, p, q);
            const __m128i sm = k4_scale_vector(p + 4);
            int32_t dmin;
            memcpy(&dmin, p, 4);
            const __m512 dm = _mm512_cvtph_ps(_mm256_set1_epi32(dmin));  // d, dmin, d, dmin, ...
            wd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_setzero_si512(), dm),
                               _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sm, sm))));
            c = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_set1_epi32(1), dm),
                              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(sm, sm))));
            c = _mm512_sub_ps(_mm512_setzero_ps(), c);
        }
        for (int r = 0; r < mb; r++) {
            const int8_t *xq = x->q + (m + r) * Kp + SBK * s;
            __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], _mm512_loadu_si512(xq));
            __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], _mm512_loadu_si512(xq + 64));
            a = _mm512_dpbusd_epi32(a, q[2], _mm512_loadu_si512(xq + 128));
            b = _mm512_dpbusd_epi32(b, q[3], _mm512_loadu_si512(xq + 192));
            const __m512 sv = _mm512_mul_ps(wd, _mm512_loadu_ps(x->dx + (m + r) * G + 16 * s));
            if (type == Q8_0) {  // the +128 of the unsigned codes, against each 16 columns' code sum
                const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(x->bs + (m + r) * G + 16 * s), 7);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(a, b), off)), sv, acc[r]);
                continue;
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, b)), sv, acc[r]);
            acc[r] = _mm512_fmadd_ps(c, _mm512_loadu_ps(x->xs + (m + r) * G + 16 * s), acc[r]);
        }
    }
    for (int r = 0; r < mb; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// The activation rows' codes in kq_rows' order: per superblock, dword 16t + G <- dword 4G + t.
static void kq_transpose(int8_t *q, int64_t M, int64_t Kp) {
    const __m512i idx[4] = {
        _mm512_set_epi32(60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0),
        _mm512_set_epi32(61, 57, 53, 49, 45, 41, 37, 33, 29, 25, 21, 17, 13, 9, 5, 1),
        _mm512_set_epi32(62, 58, 54, 50, 46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2),
        _mm512_set_epi32(63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3)};
    for (int64_t at = 0; at < M * Kp; at += SBK) {
        __m512i v[4], t[4];
        for (int i = 0; i < 4; i++) v[i] = _mm512_loadu_si512(q + at + 64 * i);
        for (int i = 0; i < 4; i++) {  // dwords 0-31 from v0|v1, 32-63 from v2|v3: two halves per step
            const __m512i a = _mm512_permutex2var_epi32(v[0], idx[i], v[1]);  // lanes 0-7 valid (from dwords < 32)
            const __m512i b = _mm512_permutex2var_epi32(v[2], _mm512_sub_epi32(idx[i], _mm512_set1_epi32(32)), v[3]);
            t[i] = _mm512_mask_blend_epi32(0xFF00, a, b);
        }
        for (int i = 0; i < 4; i++) _mm512_storeu_si512(q + at + 64 * i, t[i]);
    }
}
#define KQ_ROWS 1
#else
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

// 32 columns (2 groups) a step: vpmaddubsw of q (unsigned; for Q8_0 |q|, against xq with q's sign) and xq
// (pairs of products, |sum| <= 2 * 128 * 127: no saturation), vpmaddwd with ones: 8 int32 lanes, 4 a group.
INLINE void dot_rows(int64_t type, const uint8_t *row, int64_t K, const XQ *x, int64_t m, int mb, float *out,
                     const SB *pre) {
    const int64_t Kp = x->Kp, G = Kp / 16;
    const int mins = has_mins(type) || code_offset(type), sign = type == Q8_0;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR], macc[MR];
    for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_ps(), macc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < Kp / SBK; s++) {
        SB o;
        if (!pre) fetch_ahead(row + s * superblock_bytes(type), superblock_bytes(type));
        sb_at(type, row, s, K, pre, &o);
        const int64_t live = live_columns(K, s);
        for (int h = 0; h < 2 && 128 * h < live; h++) {  // 8 groups: 128 columns
            const int64_t g0 = 16 * s + 8 * h;
            __m256 sv[MR];
            for (int r = 0; r < mb; r++) sv[r] = _mm256_mul_ps(o.wd[h], _mm256_loadu_ps(x->dx + (m + r) * G + g0));
            for (int c = 0; c < 4 && 128 * h + 32 * c < live; c++) {
                const int a = 2 * c, b = 2 * c + 1;
                const __m256i idx = _mm256_set_epi32(b, b, b, b, a, a, a, a);
                const __m256i wv = o.q[4 * h + c], au = sign ? _mm256_abs_epi8(wv) : wv;
                for (int r = 0; r < mb; r++) {
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + (m + r) * Kp + g0 * 16 + 32 * c));
                    if (sign) xv = _mm256_sign_epi8(xv, wv);
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(au, xv), ones);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(sv[r], idx), acc[r]);
                }
            }
            if (mins)
                for (int r = 0; r < mb; r++)
                    macc[r] = _mm256_fmadd_ps(o.c[h], _mm256_loadu_ps(x->xs + (m + r) * G + g0), macc[r]);
        }
    }
    for (int r = 0; r < mb; r++) out[r] = hsum8(_mm256_add_ps(acc[r], macc[r]));
}
#endif

// One function per type, mb a constant in each case: the decoder and the accumulators stay in registers.
#define DOT_TYPE(T)                                                                                          \
    static void dot_##T(const uint8_t *row, int64_t K, const XQ *x, int64_t m, int mb, float *out,          \
                        const SB *pre) {                                                                     \
        switch (mb) {                                                                                        \
            case 1: dot_rows(T, row, K, x, m, 1, out, pre); break;                                           \
            case 2: dot_rows(T, row, K, x, m, 2, out, pre); break;                                           \
            case 3: dot_rows(T, row, K, x, m, 3, out, pre); break;                                           \
            default: dot_rows(T, row, K, x, m, MR, out, pre); break;                                         \
        }                                                                                                    \
    }
DOT_TYPE(Q8_0)
DOT_TYPE(Q4_0)
DOT_TYPE(Q4_1)
DOT_TYPE(Q5_0)
DOT_TYPE(Q5_1)
DOT_TYPE(Q4_K)
DOT_TYPE(Q5_K)
DOT_TYPE(Q6_K)

typedef void (*RowDot)(const uint8_t *row, int64_t K, const XQ *x, int64_t m, int mb, float *out, const SB *pre);

#ifdef KQ_ROWS
#define DOT_KQ(T)                                                                                            \
    static void kq_##T(const uint8_t *row, int64_t K, const XQ *x, int64_t m, int mb, float *out,           \
                       const SB *pre) {                                                                      \
        (void)pre;                                                                                           \
        switch (mb) {                                                                                        \
            case 1: kq_rows(T, row, K, x, m, 1, out); break;                                                 \
            case 2: kq_rows(T, row, K, x, m, 2, out); break;                                                 \
            case 3: kq_rows(T, row, K, x, m, 3, out); break;                                                 \
            case 4: kq_rows(T, row, K, x, m, 4, out); break;                                                 \
            case 5: kq_rows(T, row, K, x, m, 5, out); break;                                                 \
            case 6: kq_rows(T, row, K, x, m, 6, out); break;                                                 \
            case 7: kq_rows(T, row, K, x, m, 7, out); break;                                                 \
            default: kq_rows(T, row, K, x, m, KQ_MR, out); break;                                            \
        }                                                                                                    \
    }
DOT_KQ(Q8_0)
DOT_KQ(Q4_K)
DOT_KQ(Q5_K)
DOT_KQ(Q6_K)
#endif

// The row form with transposed activations (kq_rows: the K-quants, and Q8_0, whose 16-column groups sum in integers
// the same way: Gemma 3 270M's products at 2 rows, its 16-bit activations' batch 1, 1.13x faster), where the build
// has it; else NULL.
static RowDot kq_dot_of(int64_t type) {
#ifdef KQ_ROWS
    switch (type) {
        case Q8_0: return kq_Q8_0;
        case Q4_K: return kq_Q4_K;
        case Q5_K: return kq_Q5_K;
        case Q6_K: return kq_Q6_K;
        default: break;
    }
#endif
    (void)type;
    return NULL;
}

static RowDot dot_of(int64_t type) {
    switch (type) {
        case Q8_0: return dot_Q8_0;
        case Q4_0: return dot_Q4_0;
        case Q4_1: return dot_Q4_1;
        case Q5_0: return dot_Q5_0;
        case Q5_1: return dot_Q5_1;
        case Q4_K: return dot_Q4_K;
        case Q5_K: return dot_Q5_K;
        case Q6_K: return dot_Q6_K;
        default: return NULL;
    }
}


// Activation rows a pass over the weights: their rounded rows (K bytes and 3 numbers per 16 columns) fit half
// of L2, so each weight row's dot products read them from L2, not L3 (more rows re-read the weights instead).
// Panels (gguf_panels.c) read them once per 16 weight rows, streamed 4 at a time: L3 serves, and a larger chunk
// decodes each panel fewer times (at K = 8960, 128 rows in one chunk ran 1.2x faster than in four of 36).
#define X_CHUNK_BYTES (512 * 1024)
#define PANEL_CHUNK_BYTES (8 * 1024 * 1024)
static int64_t chunk_rows(int64_t Kp, int64_t budget) {
    const int64_t rows = budget / (Kp + 3 * Kp / 4) / MR * MR;
    return rows > MR ? rows : MR;
}

// One chunk of activation rows [m0, m1) against all N weight rows.
typedef struct {
    int64_t type;
    const void *blocks;
    int64_t row_bytes, K, N;
    const XQ *xq;
    RowDot dot;
    float *y;
    int64_t ldy;
    int split;
    int64_t m0, m1;
    int step;  // activation rows a dot call takes: MR, or KQ_MR for kq_rows
} Pass;

// The dot products of weight row n (decoded already into `pre`, or NULL: decoded per MR rows) with the chunk.
static void row_products(const Pass *p, int64_t n, const SB *pre) {
    const uint8_t *row = (const uint8_t *)p->blocks + n * p->row_bytes;
    for (int64_t m = p->m0; m < p->m1; m += p->step) {
        float out[16];
        const int mb = p->m1 - m < p->step ? (int)(p->m1 - m) : p->step;
        p->dot(row, p->K, p->xq, m, mb, out, pre);
        if (p->split)  // MR and the chunks are even: a pass holds whole pairs
            for (int r = 0; r < mb; r += 2) p->y[(m + r) / 2 * p->ldy + n] = out[r] + out[r + 1];
        else
            for (int r = 0; r < mb; r++) p->y[(m + r) * p->ldy + n] = out[r];
    }
}

// Few activation rows (decode, small batches): each weight row decoded in registers per MR of them.
static void row_pass(const Pass *p, int nt) {
    const int64_t g = p->N / ((int64_t)nt * 8) > 1 ? p->N / ((int64_t)nt * 8) : 1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, g)
    for (int64_t n = 0; n < p->N; n++) row_products(p, n, NULL);
}

// Many activation rows (prefill, large batches): a weight row is decoded once into the thread's scratch (SB
// form, 320 bytes a superblock: 18 KB at K = 14336, in L1/L2 beside the activation chunk), then dotted with
// every activation row of the chunk, MR at a time, from the scratch: the decode costs once per chunk instead
// of once per MR rows, and the products are the same operations on the same values.
#define TILE_MIN_ROWS 32  // measured: at 16 rows the decode in registers was as fast or faster
// Rounded activation rows from which a pass runs on panels (gguf_panels.c), where the type has them: at 4 rows a
// panel's decode cost more than the rows saved, at 8 they broke even or won (Q4_K, Q6_K; K = 1536, 4096, 8960).
// The types whose panels are decoded straight from the blocks (the next one fetched ahead) start lower, measured
// on the real models' products in model order: Q4_K/Q6_K against the K-quants' row form (kq_rows) won from 4 rows
// (the 1.5B: 4 rows 75 against 83 ms, 6 rows 93 against 108; 2 rows tied); Q8_0/Q5_0 against dot_rows lost at 4
// (the 0.5B 36 against 30 ms) and won at 6 (37 against 44; Gemma 3 270M 21 against 27).
#define PANEL_MIN_ROWS 8
static int panel_min_rows(int64_t type) {
    return type == Q4_K || type == Q6_K ? 4 : type == Q8_0 || type == Q5_0 ? 6 : PANEL_MIN_ROWS;
}
static int tiled_pass(const Pass *p, int nt) {
    const int64_t S = padded(p->K) / SBK;
    const int64_t g = p->N / ((int64_t)nt * 8) > 1 ? p->N / ((int64_t)nt * 8) : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SB *decoded = _mm_malloc((size_t)S * sizeof(SB), 64);
        if (!decoded) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, g)
        for (int64_t n = 0; n < p->N; n++) {
            if (!decoded) continue;
            const uint8_t *row = (const uint8_t *)p->blocks + n * p->row_bytes;
            for (int64_t s = 0; s < S; s++) sb_decode(p->type, row, s, p->K, 1, decoded + s);
            row_products(p, n, decoded);
        }
        _mm_free(decoded);
    }
    return failed;
}

// y [M, N] = x [M, K] @ W.T for W's N rows of `type` blocks, x rounded per 32 columns to int8 (xbits 8, as
// llama.cpp's Q8_0) or in two int8 passes (xbits 16), output row m at y + m * ldy (ldy >= N: the fused
// pass's q|k|v parts of different types each write their own columns of one [M, ldy] output, no scatter): each
// weight row is read once a chunk of activation rows, decoded once per MR of them. 0, or -1 for an unknown type
// or K not whole blocks or xbits not 8 or 16, -2 out of memory.
int64_t gguf_linear_ld(int64_t type, const void *blocks, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t ldy, int64_t xbits) {
    int64_t shape[2];
    const RowDot dot = dot_of(type);
    if (!dot || !gguf_block_shape(type, shape) || K % shape[0] || (xbits != 8 && xbits != 16)) return -1;
    XQ xq;
    const int split = xbits == 16, R = split ? 2 : 1;
    if (!quantize_x(x, M, K, split, &xq)) {
        _mm_free(xq.q), _mm_free(xq.dx);
        return -2;
    }
    M *= R;
    const int panels = M >= panel_min_rows(type) && gguf_panel_type(type);
    const int64_t row_bytes = K / shape[0] * shape[1];
    const RowDot kq = panels ? NULL : kq_dot_of(type);
#ifdef KQ_ROWS
    if (kq) kq_transpose(xq.q, M, xq.Kp);
#endif
    const int64_t chunk = chunk_rows(xq.Kp, panels ? PANEL_CHUNK_BYTES : X_CHUNK_BYTES);
    const int nt = team_size();
    int failed = 0;
    for (int64_t m0 = 0; m0 < M && !failed; m0 += chunk) {
        const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
        const Pass pass = {type, blocks, row_bytes, K, N, &xq, kq ? kq : dot, y, ldy, split, m0, m1,
                           kq ? KQ_MR : MR};
        if (panels)
            failed = gguf_panel_products(type, blocks, row_bytes, N, K, xq.q, xq.dx, xq.xs, xq.bs, xq.Kp, m0, m1, y, ldy,
                                         split, nt) != 0;
        else if (m1 - m0 > TILE_MIN_ROWS && !kq)
            failed = tiled_pass(&pass, nt);
        else
            row_pass(&pass, nt);
    }
    _mm_free(xq.q), _mm_free(xq.dx);
    return failed ? -2 : 0;
}

int64_t gguf_linear(int64_t type, const void *blocks, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                    int64_t xbits) {
    return gguf_linear_ld(type, blocks, x, y, M, N, K, N, xbits);
}
