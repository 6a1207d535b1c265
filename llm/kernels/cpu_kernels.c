// Weight-only matrix kernels on AVX2+FMA (and AVX-512) CPUs: y[m, n] = sum_k x[m, k] * W[n, k], and a whole
// forward pass of a Llama (decode rows and prompt chunks) in one call.
//
// Decode multiplies a few activation rows by every weight once per token, so the time is the weight bytes
// read from memory; the kernel's job is to read each weight once, at full bandwidth, and keep the
// arithmetic off the critical path. Weights stay in their stored format (fp32, bf16, fp16, int8, int4) and
// are widened to fp32 in registers; activations and accumulation are fp32, so results equal the reference
// up to summation order (no activation quantization, unlike fbgemm's dynamic int8 or llama.cpp's Q8_0 dot
// products). One exception: int4 rounds x to 16 bits per group and sums the codes' products in integers (see
// gemm_int4) at 1 to 32 rows on AVX-512 (1 to 8 on AVX2), 4e-4 relative on the bundled model's logits, 15 bits
// where Q8_0 keeps 8.
//
// Threads: OpenMP over blocks of output rows. This library needs libgomp.so.1, which resolves to the copy
// torch has already loaded, so these loops share torch's thread pool and its thread count (the most a team
// here takes; fewer on a busy machine, see "Threads on a busy machine" below).
//
// One row (M == 1): 4 weight rows at a time, k unrolled twice: 8 independent FMA chains, enough to hide
// the FMA latency (with 4 chains the kernel was latency-bound at half the speed). The 4 rows come from 4
// streams, a quarter of the matrix apart, each with a software prefetch of its next row: one core reads
// memory faster on 4 streams than on one (31 against 24 GB/s on 2 threads, a plain sum over 600 MB here).
// Several rows: NR weight rows (widened once into an fp32 scratch in L1 where they are not fp32) against 4
// activation rows per register tile, activation rows in chunks that fit half of L2 (`chunk_rows`), the next
// block's weight rows prefetched into L2 while the tiles of this one run; rows longer than a tile's L1 share
// (1024 fp32 columns) go in column blocks whose partial sums add up in y. At 128 rows on AVX-512 that is
// 157-169 GMAC/s on 2 threads with the weights coming from memory (30 weight sets in turn, one per layer),
// 1.06-1.36x the fixed 96-row chunks without the prefetch that this replaced (measured at that change).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

// Runtime dispatch: llm/kernels/native.py builds this one source twice, for AVX2+FMA+F16C and for AVX-512
// (F/BW/VL/DQ + VNNI + BF16), and loads the build the CPU supports (`cpu_features` below, from the AVX2 build,
// tells it which). The hot kernels are written once against the `vf` vector type below, VW floats wide:
// __m512 (16 lanes, 32 registers) in the AVX-512 build, __m256 (8 lanes, 16 registers) otherwise. The
// register tiles are sized for each: 3 weight rows x 4 activation rows (12 accumulators) on AVX2, 6 x 4 (24)
// on AVX-512. K % 8 == 0 everywhere; on AVX-512 the last 8 columns of a K % 16 == 8 row use a masked load.
#ifdef __AVX512F__
typedef __m512 vf;
#define VW 16
#define ISA_NAME "avx512"
#define NR 6  // weight rows per register tile, several activation rows
#define MR 4  // activation rows per register tile (4: batches of 16 and prompts of 128 fill whole tiles)
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float v) { return _mm512_set1_ps(v); }
static inline vf vld(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vld8(const float *p) { return _mm512_maskz_loadu_ps(0x00FF, p); }  // 8 floats, rest 0
static inline vf vld_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vld8_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
// bf16 is the top half of an fp32: widening is a zero-extend and a shift, exact for every value.
static inline vf vld_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vld8_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(0x00FF, p)), 16));
}
static inline vf vld_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vld8_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(0x00FF, p)); }
static inline void vst(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 vf;
#define VW 8
#define ISA_NAME "avx2"
#define NR 3
#define MR 4
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float v) { return _mm256_set1_ps(v); }
static inline vf vld(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vld8(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vld_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vld8_i8(const int8_t *p) { return vld_i8(p); }
static inline vf vld_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vld8_bf16(const uint16_t *p) { return vld_bf16(p); }
static inline vf vld_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vld8_f16(const uint16_t *p) { return vld_f16(p); }
static inline void vst(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float hsum(__m256 v);
static inline float vsum(vf v) { return hsum(v); }
#endif

#define NB 4   // weight rows per block, one activation row

// Activation rows per chunk of a several-rows product: as many as half of this core's L2 holds at K columns
// (each chunk re-reads every weight row, so fewer chunks means fewer weight passes: a 128-token prompt ran as
// 96 + 32 rows, reading the weights twice, with the fixed 96 this replaced), in equal chunks, 32 at least.
static int64_t chunk_rows(int64_t M, int64_t K) {
    static int64_t l2 = 0;
    if (!l2) {
        const long got = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = got > 0 ? got : 512 << 10;  // unknown: the smallest L2 of the CPUs this runs on
    }
    int64_t most = l2 / 2 / (K * (int64_t)sizeof(float));
    most = most < 32 ? 32 : most;
    const int64_t chunks = (M + most - 1) / most;
    return (M + chunks - 1) / chunks;
}

// ---------------------------------------------------------------------------------------------------------
// Threads on a busy machine (#30). Every product is split over a team and ends at a barrier, ~150 times a
// token. With a static split, a thread that the kernel has descheduled (another job took its core) holds the
// others at each barrier for a whole time slice: one background spinner on 2 cores left decode at 0.24 of
// its quiet speed. Two remedies, both invisible in the results (each output is computed by the same code
// whichever thread takes it, so results are bitwise equal under any team size and split):
// - the products' blocks are taken in small pieces by whichever thread is awake (schedule(dynamic), `grain`),
//   so a thread that starts late or is preempted between pieces costs at most the piece it holds;
// - the team size adapts (`team`, `adapt_threads`), judged once per WINDOW_NS from two measures: the CPU
//   time the calling thread got over the window's wall time, where it spent most of the window inside the
//   kernels (on a quiet machine ~1: it works, or spins at the barriers; below CPU_SHARE its threads are
//   losing their cores to other work), and the time it waited at the end of each product for the others
//   (past WAIT_SHARE of the products' time). Either drops a thread, down to 1: no barrier at all, and a whole core when one other
//   job runs on two. Below the most (omp_get_max_threads: torch's count), a thread is added back when the
//   machine had a spare core over the last window (idle or niced time in /proc/stat), so a quiet machine
//   gets all its threads again within a window or two.
// `set_kernel_threads(n)` fixes the team at n (tests, A/B runs), -1 at the most (LLMPLAN_THREADS_ADAPT=0,
// llm/kernels/native.py); 0 returns to adapting. `kernel_threads_stats` reports what happened.
#define WINDOW_NS 100000000LL  // 100 ms: at least 10 jiffies of /proc/stat, a few dozen tokens
#define WAIT_SHARE 0.30        // quiet: a few % (a barrier is ~1-3 us, a piece a sixteenth of a product)
#define SPARE_CORE 0.6         // idle cores (of the whole machine) over a window that let a thread back in
#define CPU_SHARE 0.85         // quiet: 0.97-1.0; one spinner beside 2 threads on 2 cores: ~0.67

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int fixed_threads = 0;   // > 0: the team size, not adapted; < 0: the most, not adapted
static int team_threads = 0;    // the adapted team size (0: not started: the most)
static int64_t win_start = 0, win_region_ns = 0, win_wait_ns = 0;  // this window's products and waits
static int64_t idle_mark = -1, idle_mark_ns = 0;  // /proc/stat idle jiffies (all CPUs) and when read
static int64_t win_inside_ns = 0;  // wall time in the outermost kernel calls this window
// Raises back off: a raise undone within RAISE_UNDONE windows doubles the spare windows the next one needs
// (up to RAISE_AFTER_MOST). A served model's thread leaves cores idle between its steps (streaming, the
// server's own thread), which looked like a spare core every other window: the team went 1, 2, 1, 2 beside
// one spinner and kept 0.22 of its quiet speed, against 0.40 fixed at one thread.
#define RAISE_UNDONE 4
#define RAISE_AFTER_MOST 32
static int raise_after = 1, spare_windows = 0;
static int64_t last_raise_ns = 0;
static const void *win_owner = NULL;  // the thread that started the window, and its CPU time then
static int64_t win_cpu0 = 0;
static __thread char thread_token;  // its address tells the calling threads apart
static int64_t stat_drops = 0, stat_raises = 0, stat_regions = 0, stat_region_ns = 0, stat_wait_ns = 0;

// The most threads: torch's count (the OpenMP runtime's), unless pinned. llm/kernels/native.py pins it before it
// lowers torch's own count to the team's, so that torch's ops outside these kernels (sampling over the
// vocabulary, the fallback) stop meeting at barriers with a descheduled thread too, and raises still reach it.
static int most_pinned = 0;
void pin_kernel_most(int64_t n) { most_pinned = n > 0 ? (int)n : 0; }

static int most_threads(void) {
    const int n = most_pinned > 0 ? most_pinned : omp_get_max_threads();
    return n > 0 ? n : 1;
}

// The team size of the next parallel product.
static inline int team(void) {
    const int most = most_threads();
    if (fixed_threads) return fixed_threads > 0 ? fixed_threads : most;
    const int t = __atomic_load_n(&team_threads, __ATOMIC_RELAXED);
    return t > 0 && t < most ? t : most;
}

// Blocks per piece of a dynamic split of `count` blocks over `nt` threads: 8 pieces a thread, so a thread
// that is late by a piece leaves the others little to wait for, and the shared counter is taken rarely.
static inline int64_t grain(int64_t count, int nt) {
    const int64_t g = count / ((int64_t)nt * 8);
    return g > 1 ? g : 1;
}

// A product's time and the first thread's wait at its end (from its last piece to the barrier's release).
static inline void region_done(int64_t start, int64_t first_done) {
    const int64_t end = now_ns();
    __atomic_fetch_add(&win_region_ns, end - start, __ATOMIC_RELAXED);
    __atomic_fetch_add(&win_wait_ns, end - first_done, __ATOMIC_RELAXED);
    __atomic_fetch_add(&stat_regions, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&stat_region_ns, end - start, __ATOMIC_RELAXED);
    __atomic_fetch_add(&stat_wait_ns, end - first_done, __ATOMIC_RELAXED);
}

// Spare jiffies of all CPUs (idle + iowait + nice of /proc/stat's first line: niced work yields its core to
// ours), -1 where it cannot be read.
static int64_t idle_jiffies(void) {
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return -1;
    unsigned long long v[5] = {0};
    const int got = fscanf(f, "cpu %llu %llu %llu %llu %llu", v, v + 1, v + 2, v + 3, v + 4);
    fclose(f);
    return got == 5 ? (int64_t)(v[1] + v[3] + v[4]) : -1;
}

static inline int64_t thread_cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

// Once a window: drop a thread when the calling thread got too little of a CPU inside the kernels or waited
// past WAIT_SHARE of the products' time at their ends, add one back when a core was spare.
static void adapt_threads(void) {
    if (fixed_threads) return;
    const int64_t t = now_ns();
    if (win_start == 0) win_start = t, win_owner = &thread_token, win_cpu0 = thread_cpu_ns();
    if (t - win_start < WINDOW_NS) return;
    const int most = most_threads();
    int cur = team();
    const int64_t region = win_region_ns, wait = win_wait_ns, inside = win_inside_ns, wall = t - win_start;
    const int64_t cpu_now = thread_cpu_ns();  // two clock syscalls a window, none per call
    const int starved = win_owner == &thread_token && inside > wall / 2 && (double)(cpu_now - win_cpu0) <
                                                                                CPU_SHARE * (double)wall;
    const int waiting = region > WINDOW_NS / 10 && (double)wait > WAIT_SHARE * (double)region;
    if (cur > 1 && (starved || waiting)) {
        cur--;
        stat_drops++;
        const int undone = last_raise_ns && t - last_raise_ns < RAISE_UNDONE * WINDOW_NS;
        raise_after = undone ? (raise_after * 2 < RAISE_AFTER_MOST ? raise_after * 2 : RAISE_AFTER_MOST) : 1;
        spare_windows = 0;
        idle_mark = idle_jiffies(), idle_mark_ns = t;  // the spare-core check starts from here
    } else if (cur < most) {
        const int64_t idle = idle_jiffies();
        if (idle >= 0 && idle_mark >= 0 && t > idle_mark_ns) {
            const double hz = (double)sysconf(_SC_CLK_TCK), spare = (double)(idle - idle_mark) / hz /
                                                                    ((double)(t - idle_mark_ns) * 1e-9);
            spare_windows = spare >= SPARE_CORE ? spare_windows + 1 : 0;
            if (spare_windows >= raise_after) cur++, stat_raises++, spare_windows = 0, last_raise_ns = t;
        }
        idle_mark = idle, idle_mark_ns = t;
    }
    __atomic_store_n(&team_threads, cur, __ATOMIC_RELAXED);
    win_start = t, win_region_ns = 0, win_wait_ns = 0, win_inside_ns = 0;
    win_owner = &thread_token, win_cpu0 = cpu_now;
}

// The calls from outside (forward_pass, the products): the outermost one on a thread times its wall time
// and, on leaving, lets `adapt_threads` judge the window. KERNEL_CALL at the top of each: the cleanup
// attribute runs `leave_kernel` at every return.
static __thread int call_depth = 0;
static __thread int64_t call_wall = 0;

static inline int enter_kernel(void) {
    if (call_depth++ == 0 && !fixed_threads) call_wall = now_ns();
    return 0;
}

static inline void leave_kernel(int *unused) {
    (void)unused;
    if (--call_depth || fixed_threads) return;
    __atomic_fetch_add(&win_inside_ns, now_ns() - call_wall, __ATOMIC_RELAXED);
    adapt_threads();
}
#define KERNEL_CALL __attribute__((cleanup(leave_kernel), unused)) int kernel_call_ = enter_kernel()

// n > 0: every product on n threads from now on, not adapted; -1: on the most, not adapted; 0: adapt again,
// from the most.
void set_kernel_threads(int64_t n) {
    fixed_threads = n > 0 ? (int)n : (n < 0 ? -1 : 0);
    __atomic_store_n(&team_threads, 0, __ATOMIC_RELAXED);
    win_start = 0, win_region_ns = 0, win_wait_ns = 0, win_inside_ns = 0, idle_mark = -1;
    raise_after = 1, spare_windows = 0, last_raise_ns = 0;
}

// out[0..7]: team size now, the most, fixed (0, -1 or n), drops, raises, products timed, their ns, the first
// thread's wait ns at their ends.
void kernel_threads_stats(int64_t *out) {
    const int64_t v[8] = {team(), most_threads(), fixed_threads, stat_drops, stat_raises, stat_regions,
                          stat_region_ns, stat_wait_ns};
    for (int i = 0; i < 8; i++) out[i] = v[i];
}

// Which build this is ("avx512" or "avx2"): the run's env metrics name the path taken.
const char *kernel_isa(void) { return ISA_NAME; }

// The CPU's features as bits (1 avx2+fma+f16c, 2 avx512 f/bw/vl/dq, 4 avx512_vnni, 8 avx512_bf16), from
// cpuid and the OS's saved-state mask (libgcc checks XCR0), so a CPU whose OS does not save zmm reads as AVX2.
int64_t cpu_features(void) {
    __builtin_cpu_init();
    int64_t f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 1;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        f |= 2;
    if (__builtin_cpu_supports("avx512vnni")) f |= 4;
    if (__builtin_cpu_supports("avx512bf16")) f |= 8;
    return f;
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// fp32 to bf16 with round-to-nearest-even, as torch casts (NaN stays a quiet NaN).
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// The sums of 4 vectors' lanes, as the 4 lanes of one __m128 (a register tile's MR = 4 outputs of a weight
// row): a transposing reduction, 13 instructions on AVX-512 where 4 horizontal sums took 36. At K = 640
// those sums were a quarter of a tile's instructions (24 of them per 6 x 4 tile).
#ifdef __AVX512F__
static inline __m128 vsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    // per 128-bit block: [a0 + a2, b0 + b2, a1 + a3, b1 + b3], and the same of c, d
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    // per block: [a, b, c, d] summed over the block's 4 lanes
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#else
static inline __m128 vsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit lane: [a, b, c, d]
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif
_Static_assert(MR == 4, "the register tiles' stores reduce MR = 4 accumulators at once (vsum4)");

static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

// What the register tiles share (rows_tile, rows_tile_bf16_inputs): the next block's rows prefetched a share a
// k step, and a tile's stores.
typedef struct TilePrefetch {
    const char *const *next;
    int64_t bytes, per_tile, per_step, at;  // bytes a row (whole lines); `at` walks row `row`, then the next
    int row;
} TilePrefetch;

// Up to SPREAD_ROWS activation rows (a few tiles a block) the lines go a share a k step; more rows, a share a
// tile at its start. A burst of a tile's share (60 lines at 16 rows, K = 640) fills the core's line-fill
// buffers and stalls the tile behind it: 16-row fp32 products were 38 GMAC/s a core against 66 at 128 rows
// (Xeon, weights from L3), 46 spread. At 128 rows a tile's share is 8 lines, and the check in every step
// cost more (0.88-0.96x) than the burst.
#define SPREAD_ROWS 32
static inline TilePrefetch tile_prefetch_plan(const char *const *next, int64_t next_bytes, int64_t M, int64_t steps) {
    const int64_t lines = next ? (next_bytes + 63) / 64 : 0, tiles = (M + MR - 1) / MR, total = lines * NR;
    const int spread = M <= SPREAD_ROWS;
    return (TilePrefetch){next, lines * 64, spread ? 0 : (total + tiles - 1) / tiles,
                          spread ? (total + tiles * steps - 1) / (tiles * steps) : 0, 0, next ? 0 : NR};
}

// n more lines, walking the rows with counters (no division: this runs beside a step's FMAs).
static inline void tile_prefetch(TilePrefetch *p, int64_t n) {
    for (int64_t j = 0; j < n && p->row < NR; j++) {
        _mm_prefetch(p->next[p->row] + p->at, _MM_HINT_T1);
        p->at += 64;
        if (p->at == p->bytes) p->at = 0, p->row++;
    }
}

// The activation row of a tile's slot i: rows past the last (mb of them are real) repeat the first, unstored.
static inline int64_t tile_row(int64_t m, int i, int mb) { return m + (i < mb ? i : 0); }

static inline __attribute__((always_inline)) void tile_zero(vf acc[NR][MR]) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) acc[r][i] = vzero();
}

// y[i * ldy + r * cs] (+)= scale[r cs] * the sum of acc[r][i], for r < nr, i < mb.
static inline __attribute__((always_inline)) void tile_store(vf acc[NR][MR], int nr, int mb, float *y, int64_t ldy,
                                                             int64_t cs, const float *scale, int add) {
    for (int r = 0; r < nr; r++) {
        float sum[MR];
        _mm_storeu_ps(sum, vsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
        for (int i = 0; i < mb; i++) {
            const float v = sum[i] * (scale ? scale[r * cs] : 1.0f);
            y[i * ldy + r * cs] = add ? y[i * ldy + r * cs] + v : v;
        }
    }
}

// y[m, r cs] (row stride ldy) = scale[r cs] * sum_k w_r[k] x[m, k] for r < nr <= NR, m < M; scale may be NULL.
// Rows past nr (or m past M in the last tile) repeat row 0 and are not stored. K % 8 == 0.
// An NR x MR register tile (NR * MR accumulators, NR weight vectors, 1 activation vector live).
// next[r] (or NULL): the stored rows of the block this thread runs next, next_bytes each. Their cache lines are
// prefetched into L2 as the tiles go (tile_prefetch_plan): a block's weights come from memory once and are then
// reused by every tile, so without it each block starts with a stall on its rows (in a prefill, 20-30 % of
// the GEMM).
// x's rows lie ldx apart; with `add` the tile adds to y (a later block of K's columns, see gemm_f32).
// One k step of a tile: NR weight vectors (type TV, row r's from W), each activation row's vector (X) against
// all of them, MAC(acc, w, x) accumulating.
#define TILE_STEP(TV, W, X, MAC)                                                                        \
    {                                                                                                   \
        TV w_[NR];                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) w_[r] = W;                                 \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                          \
            const TV xv = X;                                                                            \
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) acc[r][i] = MAC(acc[r][i], w_[r], xv); \
        }                                                                                               \
    }
// A tile function over weights TW and inputs TX: WIDTH columns a step (LOADW / LOADX), the last K % WIDTH by
// TAILW(p, n) / TAILX(p).
#define ROWS_TILE(NAME, TW, TX, TV, WIDTH, LOADW, TAILW, LOADX, TAILX, MAC)                                        \
    static void NAME(const TW *const *wr, const TX *x, int64_t ldx, int64_t M, int64_t K, float *y, int64_t ldy,     \
                     int64_t cs, int nr, const float *scale, int add, const char *const *next, int64_t next_bytes) { \
        TilePrefetch ahead = tile_prefetch_plan(next, next_bytes, M, (K + (WIDTH) - 1) / (WIDTH));                 \
        for (int64_t m = 0; m < M; m += MR) {                                                                       \
            const int mb = (int)(M - m < MR ? M - m : MR);                                                          \
            const TX *xr[MR];                                                                                       \
            for (int i = 0; i < MR; i++) xr[i] = x + tile_row(m, i, mb) * ldx;                                      \
            vf acc[NR][MR];                                                                                         \
            tile_zero(acc);                                                                                         \
            int64_t k = 0;                                                                                          \
            tile_prefetch(&ahead, ahead.per_tile);                                                                  \
            if (ahead.per_step)                                                                                     \
                for (; k + (WIDTH) <= K; k += (WIDTH)) {                                                            \
                    tile_prefetch(&ahead, ahead.per_step);                                                          \
                    TILE_STEP(TV, LOADW(wr[r] + k), LOADX(xr[i] + k), MAC)                                          \
                }                                                                                                   \
            else                                                                                                    \
                for (; k + (WIDTH) <= K; k += (WIDTH)) TILE_STEP(TV, LOADW(wr[r] + k), LOADX(xr[i] + k), MAC)       \
            if (k < K) TILE_STEP(TV, TAILW(wr[r] + k, K - k), TAILX(xr[i] + k), MAC)                                \
            tile_store(acc, nr, mb, y + m * ldy, ldy, cs, scale, add);                                              \
        }                                                                                                           \
    }
#define F32_TAIL(p, n) vld8(p)  // AVX-512 only: the last 8 columns (AVX2's K % 8 == 0 leaves none)
#define F32_MAC(acc, w, x) vfma(w, x, acc)
ROWS_TILE(rows_tile, float, float, vf, VW, vld, F32_TAIL, vld, vld8, F32_MAC)

// Row r of the block at `base` whose rows lie `step` apart, or `base` itself past the last of N rows (such a
// row is computed again and not stored). The one-row kernels' 4 streams (step L = ceil(N / 4), base = the
// block) and the several-rows blocks (Blocks below) both pick their rows with it.
static inline int64_t strided_row(int64_t base, int64_t r, int64_t step, int64_t N) {
    return base + r * step < N ? base + r * step : base;
}

// The blocks of a several-rows product over N weight rows: block b is rows base + r step (r < NR; the nr of
// them below N are a prefix, the rest repeat the first and are not stored). With `streams` the rows are NR
// streams, as the one-row kernels read them (ONE_ROW): step = L = ceil(N / NR), base = b. Otherwise a block
// is NR adjacent rows: step 1, base = b NR. Streams pay where a block is short work on weights read straight
// from memory: fp32 up to STREAM_ROWS activation rows (+6 % at batch 16 on AVX2). Not in prefills, whose
// outputs, NR columns L apart, were 13-18 % slower to store (a tile's rows touch NR lines each, not one),
// nor for widened weights (int8, 16-bit: no gain at batch 16, -3 % int8 on AVX-512).
#define STREAM_ROWS 32
typedef struct Blocks {
    int64_t N, count, step;  // count blocks; step: between a block's rows, and between its output columns
} Blocks;

static inline Blocks blocks_of(int64_t N, int streams) {
    const int64_t L = (N + NR - 1) / NR;
    return (Blocks){N, L, streams ? L : 1};
}

static inline int64_t block_base(const Blocks *bl, int64_t b) { return bl->step == 1 ? b * NR : b; }

// Block b's rows n[r]; returns nr.
static inline int block_rows(const Blocks *bl, int64_t b, int64_t *n) {
    const int64_t base = block_base(bl, b);
    int nr = 0;
    for (int r = 0; r < NR; r++) {
        n[r] = strided_row(base, r, bl->step, bl->N);
        nr += base + r * bl->step < bl->N;
    }
    return nr;
}

// The stored rows of block b + 1 (row_bytes each), for rows_tile's prefetch; false when there is none.
static inline int next_rows(const Blocks *bl, const void *w, int64_t b, int64_t row_bytes, const char **next) {
    if (b + 1 >= bl->count) return 0;
    int64_t n[NR];
    block_rows(bl, b + 1, n);
    for (int r = 0; r < NR; r++) next[r] = (const char *)w + n[r] * row_bytes;
    return 1;
}

// Prefetch the 64-byte lines that the bytes [from, to) of each of 4 rows start, `ahead` bytes further on.
#define PREFETCH4(p0, p1, p2, p3, from, to, ahead)                                                \
    for (int64_t b_ = ((from) + 63) & ~(int64_t)63; b_ < (to); b_ += 64) {                       \
        _mm_prefetch((const char *)(p0) + b_ + (ahead), _MM_HINT_T0);                            \
        _mm_prefetch((const char *)(p1) + b_ + (ahead), _MM_HINT_T0);                            \
        _mm_prefetch((const char *)(p2) + b_ + (ahead), _MM_HINT_T0);                            \
        _mm_prefetch((const char *)(p3) + b_ + (ahead), _MM_HINT_T0);                            \
    }

// One activation row: 4 weight rows (W loaded by LOAD from row pointers p0..p3), 8 FMA chains, and a
// software prefetch `ahead` bytes past each row (the hardware prefetcher alone reaches half the bandwidth).
#define DOT4_ONE(NAME, T, LOAD, LOAD8)                                                            \
    static void dot4_one_##NAME(const T *p0, const T *p1, const T *p2, const T *p3, const float *x,   \
                             int64_t K, int64_t ahead, float out[4]) {                            \
        vf a0 = vzero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;          \
        const int64_t sz = (int64_t)sizeof(T);                                                   \
        int64_t k = 0;                                                                           \
        for (; k + 2 * VW <= K; k += 2 * VW) {                                                   \
            PREFETCH4(p0, p1, p2, p3, k * sz, (k + 2 * VW) * sz, ahead)                          \
            const vf x0 = vld(x + k), x1 = vld(x + k + VW);                                      \
            a0 = vfma(LOAD(p0 + k), x0, a0); b0 = vfma(LOAD(p0 + k + VW), x1, b0);               \
            a1 = vfma(LOAD(p1 + k), x0, a1); b1 = vfma(LOAD(p1 + k + VW), x1, b1);               \
            a2 = vfma(LOAD(p2 + k), x0, a2); b2 = vfma(LOAD(p2 + k + VW), x1, b2);               \
            a3 = vfma(LOAD(p3 + k), x0, a3); b3 = vfma(LOAD(p3 + k + VW), x1, b3);               \
        }                                                                                        \
        for (; k + VW <= K; k += VW) {                                                           \
            PREFETCH4(p0, p1, p2, p3, k * sz, (k + VW) * sz, ahead)                              \
            const vf x0 = vld(x + k);                                                            \
            a0 = vfma(LOAD(p0 + k), x0, a0); a1 = vfma(LOAD(p1 + k), x0, a1);                    \
            a2 = vfma(LOAD(p2 + k), x0, a2); a3 = vfma(LOAD(p3 + k), x0, a3);                    \
        }                                                                                        \
        if (k < K) { /* AVX-512 only: the last 8 columns */                                      \
            const vf x0 = vld8(x + k);                                                           \
            b0 = vfma(LOAD8(p0 + k), x0, b0); b1 = vfma(LOAD8(p1 + k), x0, b1);                  \
            b2 = vfma(LOAD8(p2 + k), x0, b2); b3 = vfma(LOAD8(p3 + k), x0, b3);                  \
        }                                                                                        \
        out[0] = vsum(vadd(a0, b0));                                                             \
        out[1] = vsum(vadd(a1, b1));                                                             \
        out[2] = vsum(vadd(a2, b2));                                                             \
        out[3] = vsum(vadd(a3, b3));                                                             \
    }

// One activation row against all N weight rows; y[n] = dot * scale[n] (scale may be NULL). The rows are 4
// streams of L = ceil(N / 4): block b takes rows b, b + L, b + 2 L, b + 3 L, and a thread's consecutive
// blocks walk each stream in order. Against 4 adjacent rows a block (one stream a thread), batch-1 decode
// gained 8-10 % fp32, 10-20 % int8 and 20-45 % bf16 (int4, bound by its arithmetic, is unchanged).
#define ONE_ROW(NAME, T)                                                                           \
    static void one_row_##NAME(const T *w, const float *scale, const float *x, float *y, int64_t N, int64_t K) { \
        const int64_t L = (N + NB - 1) / NB;                                                       \
        const int nt = team();                                                                     \
        const int64_t g = grain(L, nt), start = now_ns();                                          \
        int64_t first_done = start;                                                                \
        _Pragma("omp parallel num_threads(nt)")                                                    \
        {                                                                                          \
            _Pragma("omp for schedule(dynamic, g) nowait")                                         \
            for (int64_t b = 0; b < L; b++) {                                                      \
                const T *rows[NB];                                                                 \
                for (int64_t r = 0; r < NB; r++) rows[r] = w + strided_row(b, r, L, N) * K;       \
                float out[NB];                                                                     \
                dot4_one_##NAME(rows[0], rows[1], rows[2], rows[3], x, K, K * (int64_t)sizeof(T), out); \
                for (int64_t r = 0; r < NB && b + r * L < N; r++)                                  \
                    y[b + r * L] = out[r] * (scale ? scale[b + r * L] : 1.0f);                     \
            }                                                                                      \
            if (omp_get_thread_num() == 0) first_done = now_ns();                                  \
        }                                                                                          \
        region_done(start, first_done);                                                            \
    }

// Up to GROUP activation rows against 2 weight rows, each row's sums in DOT4_ONE's order exactly (chain a over
// the first VW columns of every 2 VW, chain b over the second, the odd VW into a, the last 8 into b), so a
// row's result is bitwise the one-row kernel's: a pass that verifies speculative guesses (a few rows) gives
// each row the logits a one-token decode step would. Each weight vector is loaded and widened once for all
// `mb` rows: widening (2 uops a vector for int8) is what a second pass over L1-resident rows costs.
#ifdef __AVX512F__
#define GROUP 6  // 24 accumulators, 4 weight vectors, 2 activation vectors: 30 of the 32 registers
#else
#define GROUP 2  // AVX2's 16 registers: 8 accumulators
#endif
#define DOT2_ROWS(NAME, T, LOAD, LOAD8)                                                                        \
    static inline __attribute__((always_inline)) void dot2_rows_##NAME(                                       \
        const T *p0, const T *p1, const float *x, int64_t K, const int mb, int64_t ahead, float out[][2]) {    \
        vf a[2][GROUP], b[2][GROUP];                                                                           \
        _Pragma("GCC unroll 8") for (int i = 0; i < GROUP; i++) a[0][i] = a[1][i] = b[0][i] = b[1][i] = vzero(); \
        const int64_t sz = (int64_t)sizeof(T);                                                                 \
        int64_t k = 0;                                                                                         \
        for (; k + 2 * VW <= K; k += 2 * VW) {                                                                 \
            PREFETCH4(p0, p1, p0, p1, k * sz, (k + 2 * VW) * sz, ahead)                                        \
            const vf w0 = LOAD(p0 + k), w1 = LOAD(p0 + k + VW), v0 = LOAD(p1 + k), v1 = LOAD(p1 + k + VW);     \
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {                                             \
                const vf x0 = vld(x + i * K + k), x1 = vld(x + i * K + k + VW);                                \
                a[0][i] = vfma(w0, x0, a[0][i]), b[0][i] = vfma(w1, x1, b[0][i]);                              \
                a[1][i] = vfma(v0, x0, a[1][i]), b[1][i] = vfma(v1, x1, b[1][i]);                              \
            }                                                                                                  \
        }                                                                                                      \
        for (; k + VW <= K; k += VW) {                                                                         \
            const vf w0 = LOAD(p0 + k), v0 = LOAD(p1 + k);                                                     \
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {                                             \
                const vf x0 = vld(x + i * K + k);                                                              \
                a[0][i] = vfma(w0, x0, a[0][i]), a[1][i] = vfma(v0, x0, a[1][i]);                              \
            }                                                                                                  \
        }                                                                                                      \
        if (k < K) { /* AVX-512 only: the last 8 columns */                                                    \
            const vf w0 = LOAD8(p0 + k), v0 = LOAD8(p1 + k);                                                   \
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {                                             \
                const vf x0 = vld8(x + i * K + k);                                                             \
                b[0][i] = vfma(w0, x0, b[0][i]), b[1][i] = vfma(v0, x0, b[1][i]);                              \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++)                                                   \
            out[i][0] = vsum(vadd(a[0][i], b[0][i])), out[i][1] = vsum(vadd(a[1][i], b[1][i]));                \
    }                                                                                                          \
    /* mb as a constant in each case: the compiler keeps the accumulators in registers */                     \
    static void dot2_group_##NAME(const T *p0, const T *p1, const float *x, int64_t K, int mb, int64_t ahead,  \
                                  float out[][2]) {                                                            \
        switch (mb) {                                                                                          \
            case 1: dot2_rows_##NAME(p0, p1, x, K, 1, ahead, out); break;                                      \
            case 2: dot2_rows_##NAME(p0, p1, x, K, 2, ahead, out); break;                                      \
            case 3: dot2_rows_##NAME(p0, p1, x, K, GROUP < 3 ? GROUP : 3, ahead, out); break;                  \
            case 4: dot2_rows_##NAME(p0, p1, x, K, GROUP < 4 ? GROUP : 4, ahead, out); break;                  \
            case 5: dot2_rows_##NAME(p0, p1, x, K, GROUP < 5 ? GROUP : 5, ahead, out); break;                  \
            default: dot2_rows_##NAME(p0, p1, x, K, GROUP, ahead, out); break;                                 \
        }                                                                                                      \
    }

// A few activation rows (2 .. FEW_ROWS: a decode row and its speculative guesses, a few decode rows) against
// all N weight rows, the 4-stream blocks of ONE_ROW: a block's rows come from memory once, for the first pair
// of activation rows, and from L1 for the others; each output is bitwise ONE_ROW's for that row. The several-
// rows product instead widens each block into a scratch and tiles it (`gemm_widened`): a 2-row int8 product
// cost 2.5x a 1-row one there, as its 4 streams' prefetch and in-register widening are what decode lives on.
#define FEW_ROWS 8
#define FEW(NAME, T) FEW_NAMED(few_rows_##NAME, NAME, T)
#define FEW_NAMED(FN, NAME, T)                                                                                  \
    static void FN(const T *w, const float *scale, const float *x, float *y, int64_t M, int64_t N,             \
                                int64_t K) {                                                                    \
        const int64_t L = (N + NB - 1) / NB;                                                                    \
        const int nt = team();                                                                                  \
        const int64_t g = grain(L, nt), start = now_ns();                                                       \
        int64_t first_done = start;                                                                             \
        _Pragma("omp parallel num_threads(nt)")                                                                 \
        {                                                                                                       \
        _Pragma("omp for schedule(dynamic, g) nowait")                                                          \
        for (int64_t b = 0; b < L; b++) {                                                                       \
            const T *rows[NB];                                                                                  \
            for (int64_t r = 0; r < NB; r++) rows[r] = w + strided_row(b, r, L, N) * K;                        \
            for (int64_t m = 0; m < M; m += GROUP) {                                                            \
                const int mb = (int)(M - m < GROUP ? M - m : GROUP);                                            \
                const int64_t ahead = m ? 0 : K * (int64_t)sizeof(T); /* later groups read what the first did */ \
                for (int64_t r0 = 0; r0 < NB; r0 += 2) {                                                        \
                    float out[GROUP][2];                                                                        \
                    dot2_group_##NAME(rows[r0], rows[r0 + 1], x + m * K, K, mb, ahead, out);                   \
                    for (int64_t i = 0; i < mb; i++)                                                            \
                        for (int64_t r = r0; r < r0 + 2 && b + r * L < N; r++)                                  \
                            y[(m + i) * N + b + r * L] = out[i][r - r0] * (scale ? scale[b + r * L] : 1.0f);    \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        if (omp_get_thread_num() == 0) first_done = now_ns();                                                   \
        }                                                                                                       \
        region_done(start, first_done);                                                                         \
    }

DOT4_ONE(i8, int8_t, vld_i8, vld8_i8)
DOT4_ONE(f32, float, vld, vld8)
DOT4_ONE(bf16, uint16_t, vld_bf16, vld8_bf16)
DOT4_ONE(f16, uint16_t, vld_f16, vld8_f16)
ONE_ROW(i8, int8_t)
ONE_ROW(f32, float)
ONE_ROW(bf16, uint16_t)
ONE_ROW(f16, uint16_t)
#ifdef __AVX512F__
DOT2_ROWS(i8, int8_t, vld_i8, vld8_i8)
DOT2_ROWS(f32, float, vld, vld8)
DOT2_ROWS(bf16, uint16_t, vld_bf16, vld8_bf16)
DOT2_ROWS(f16, uint16_t, vld_f16, vld8_f16)
FEW(i8, int8_t)
FEW(f32, float)
FEW(bf16, uint16_t)
FEW(f16, uint16_t)
#else
DOT2_ROWS(i8, int8_t, vld_i8, vld8_i8)
DOT2_ROWS(f32, float, vld, vld8)
DOT2_ROWS(bf16, uint16_t, vld_bf16, vld8_bf16)
DOT2_ROWS(f16, uint16_t, vld_f16, vld8_f16)
FEW_NAMED(few_pairs_i8, i8, int8_t)
FEW_NAMED(few_pairs_f32, f32, float)
FEW_NAMED(few_pairs_bf16, bf16, uint16_t)
FEW_NAMED(few_pairs_f16, f16, uint16_t)
// AVX2, 3 rows and more: up to GROUP1 activation rows against ONE weight row, in DOT4_ONE's order (chains a and b) per row: 12
// accumulators and the 2 widened weight vectors in AVX2's 16 registers, x read as memory operands. Each
// weight vector is widened once for up to 6 rows where the 2 x 2 tile above widened it for 2: at 3 rows
// and more that tile paid a second widening pass per block. Two rows keep the 2 x 2 tile (`few_pairs`), whose
// shared x loads make it the faster there. int8 kernel alone, 1 thread, against the 2 x 2 tile at every
// count: 2 rows 1.22x its time (hence the pairs), 3 rows 1.03x, 4 rows 0.90x, 5 rows 0.78x, 6 rows 0.82x.
#define GROUP1 6
#define DOT1_ROWS(NAME, T, LOAD)                                                                               \
    static inline __attribute__((always_inline)) void dot1_rows_##NAME(const T *p0, const float *x, int64_t K,  \
                                                                       const int mb, int64_t ahead, float *out) { \
        vf a[GROUP1], b[GROUP1];                                                                               \
        _Pragma("GCC unroll 8") for (int i = 0; i < GROUP1; i++) a[i] = b[i] = vzero();                        \
        const int64_t sz = (int64_t)sizeof(T);                                                                 \
        int64_t k = 0;                                                                                         \
        for (; k + 2 * VW <= K; k += 2 * VW) {                                                                 \
            for (int64_t b_ = (k * sz + 63) & ~(int64_t)63; ahead && b_ < (k + 2 * VW) * sz; b_ += 64)          \
                _mm_prefetch((const char *)p0 + b_ + ahead, _MM_HINT_T0);                                      \
            const vf w0 = LOAD(p0 + k), w1 = LOAD(p0 + k + VW);                                                \
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {                                             \
                a[i] = vfma(w0, vld(x + i * K + k), a[i]);                                                     \
                b[i] = vfma(w1, vld(x + i * K + k + VW), b[i]);                                                \
            }                                                                                                  \
        }                                                                                                      \
        for (; k + VW <= K; k += VW) {                                                                         \
            const vf w0 = LOAD(p0 + k);                                                                        \
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) a[i] = vfma(w0, vld(x + i * K + k), a[i]);    \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) out[i] = vsum(vadd(a[i], b[i]));                  \
    }                                                                                                          \
    static void dot1_group_##NAME(const T *p0, const float *x, int64_t K, int mb, int64_t ahead, float *out) {  \
        switch (mb) {                                                                                          \
            case 1: dot1_rows_##NAME(p0, x, K, 1, ahead, out); break;                                          \
            case 2: dot1_rows_##NAME(p0, x, K, 2, ahead, out); break;                                          \
            case 3: dot1_rows_##NAME(p0, x, K, 3, ahead, out); break;                                          \
            case 4: dot1_rows_##NAME(p0, x, K, 4, ahead, out); break;                                          \
            case 5: dot1_rows_##NAME(p0, x, K, 5, ahead, out); break;                                          \
            default: dot1_rows_##NAME(p0, x, K, GROUP1, ahead, out); break;                                    \
        }                                                                                                      \
    }
#define FEW1(NAME, T)                                                                                           \
    static void few_rows_##NAME(const T *w, const float *scale, const float *x, float *y, int64_t M, int64_t N, \
                                int64_t K) {                                                                    \
        if (M == 2) {                                                                                           \
            few_pairs_##NAME(w, scale, x, y, M, N, K);                                                          \
            return;                                                                                             \
        }                                                                                                       \
        const int64_t L = (N + NB - 1) / NB;                                                                    \
        _Pragma("omp parallel for schedule(static)")                                                            \
        for (int64_t b = 0; b < L; b++) {                                                                       \
            for (int64_t m = 0; m < M; m += GROUP1) {                                                           \
                const int mb = (int)(M - m < GROUP1 ? M - m : GROUP1);                                          \
                const int64_t ahead = m ? 0 : K * (int64_t)sizeof(T); /* later groups read what the first did */ \
                for (int64_t r = 0; r < NB && b + r * L < N; r++) {                                             \
                    float out[GROUP1];                                                                          \
                    dot1_group_##NAME(w + (b + r * L) * K, x + m * K, K, mb, ahead, out);                      \
                    for (int64_t i = 0; i < mb; i++)                                                            \
                        y[(m + i) * N + b + r * L] = out[i] * (scale ? scale[b + r * L] : 1.0f);                \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }
DOT1_ROWS(i8, int8_t, vld_i8)
DOT1_ROWS(f32, float, vld)
DOT1_ROWS(bf16, uint16_t, vld_bf16)
DOT1_ROWS(f16, uint16_t, vld_f16)
FEW1(i8, int8_t)
FEW1(f32, float)
FEW1(bf16, uint16_t)
FEW1(f16, uint16_t)
#endif

// Widen int8 codes to fp32 (K % 8 == 0).
static void widen_i8(const int8_t *q, float *dst, int64_t K) {
    int64_t k = 0;
    for (; k + VW <= K; k += VW) vst(dst + k, vld_i8(q + k));
    for (; k < K; k += 8) _mm256_storeu_ps(dst + k, load_i8(q + k));
}

// The several-rows products' loops, shared by every weight format: activation rows in chunks of MC, columns in
// blocks of KB, each (chunk, column block) one parallel pass over the weight blocks (`Blocks`), taken in pieces
// by whichever thread is free; `block` runs one weight block's tiles. A pass hands it the stored rows of the
// block this thread runs next (their slice of the columns) to prefetch, and a scratch of `scratch_floats`.
typedef struct TilePass {
    const Blocks *bl;
    const void *ctx;                   // the product's own operands
    float *y;                          // the chunk's first output row
    int64_t m0, mc, k0, kc, N, K, bytes;  // bytes: the stored slice of a weight row
} TilePass;
typedef void (*TileBlock)(const TilePass *p, int64_t b, const int64_t *n, int nr, const char *const *next,
                          float *scratch);

static void tiled_product(TileBlock block, const void *ctx, const void *w, int64_t row_bytes, float *y, int64_t M,
                          int64_t N, int64_t K, int64_t KB, int64_t MC, int streams, int64_t scratch_floats) {
    const Blocks bl = blocks_of(N, streams);
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kc = K - k0 < KB ? K - k0 : KB;
            const TilePass pass = {&bl, ctx, y + m0 * N, m0, M - m0 < MC ? M - m0 : MC, k0, kc, N, K,
                                   kc * row_bytes / K};
            const int64_t from = k0 * row_bytes / K;
            const int nt = team();
            const int64_t g = grain(bl.count, nt), start = now_ns();
            int64_t first_done = start;
#pragma omp parallel num_threads(nt)
            {
                float *scratch = scratch_floats ? (float *)_mm_malloc(scratch_floats * sizeof(float), 64) : NULL;
#pragma omp for schedule(dynamic, g) nowait
                for (int64_t b = 0; b < bl.count; b++) {
                    int64_t n[NR];
                    const int nr = block_rows(&bl, b, n);
                    const char *next[NR];
                    const int more = next_rows(&bl, w, b, row_bytes, next);
                    for (int r = 0; more && r < NR; r++) next[r] += from;
                    block(&pass, b, n, nr, more ? next : NULL, scratch);
                }
                _mm_free(scratch);
                if (omp_get_thread_num() == 0) first_done = now_ns();
            }
            region_done(start, first_done);
        }
    }
}

// Several rows of a weight not stored as fp32: each block's NR rows are widened (int8, bf16, fp16) or
// dequantized (int4) by `widen` into this thread's fp32 scratch in L1, once per chunk of activation rows,
// then `rows_tile`; the stored rows of the next block (row_bytes each) are prefetched meanwhile. y[m, n] is
// scaled by scale[n] where scale is not NULL (int8's per-row scale). Long rows go in gemm_f32's column
// blocks (whole int4 groups), so the widened rows stay in L1 and the sums keep the fp32 product's order.
typedef struct WideRows {
    const void *w, *scale, *zero;  // the stored rows; int4's fp16 scales and zero points [N, K / G]
    int64_t K, G, row_bytes, f16;
    void (*widen)(const struct WideRows *src, int64_t n, int64_t k0, int64_t kc, float *dst);  // row n, kc from k0
} WideRows;

static int64_t column_block(int64_t K, int64_t G);

typedef struct WidenedProduct {
    const WideRows *src;
    const float *x, *scale;
} WidenedProduct;

static void widened_block(const TilePass *p, int64_t b, const int64_t *n, int nr, const char *const *next,
                          float *wide) {
    const WidenedProduct *c = (const WidenedProduct *)p->ctx;
    const float *wr[NR];
    for (int r = 0; r < NR; r++) {
        if (r < nr) c->src->widen(c->src, n[r], p->k0, p->kc, wide + r * p->kc);
        wr[r] = wide + (r < nr ? r : 0) * p->kc;
    }
    const int64_t at = block_base(p->bl, b);
    rows_tile(wr, c->x + p->m0 * p->K + p->k0, p->K, p->mc, p->kc, p->y + at, p->N, p->bl->step, nr,
              c->scale ? c->scale + at : NULL, p->k0 > 0, next, p->bytes);
}

static void gemm_widened(const WideRows *src, const float *x, float *y, int64_t M, int64_t N, const float *scale) {
    const int64_t K = src->K, KB = column_block(K, src->G);
    const WidenedProduct c = {src, x, scale};
    tiled_product(widened_block, &c, src->w, src->row_bytes, y, M, N, K, KB, chunk_rows(M, KB), 0, NR * KB);
}

static void widen_i8_row(const WideRows *src, int64_t n, int64_t k0, int64_t kc, float *dst) {
    widen_i8((const int8_t *)src->w + n * src->K + k0, dst, kc);
}

// int8 codes with one fp32 scale per output row: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
// Requires K % 8 == 0 (checked by the caller).
void gemm_int8(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t N, int64_t K) {
    KERNEL_CALL;
    if (M == 1) {
        one_row_i8(q, scale, x, y, N, K);
        return;
    }
    if (M <= FEW_ROWS) {
        few_rows_i8(q, scale, x, y, M, N, K);
        return;
    }
    const WideRows src = {q, NULL, NULL, K, 0, K, 0, widen_i8_row};
    gemm_widened(&src, x, y, M, N, scale);
}

static void f32_block(const TilePass *p, int64_t b, const int64_t *n, int nr, const char *const *next, float *unused) {
    (void)unused;
    const float *const *c = (const float *const *)p->ctx, *x = c[0], *w = c[1];
    const float *wr[NR];
    for (int r = 0; r < NR; r++) wr[r] = w + n[r] * p->K + p->k0;
    const int64_t at = block_base(p->bl, b);
    rows_tile(wr, x + p->m0 * p->K + p->k0, p->K, p->mc, p->kc, p->y + at, p->N, p->bl->step, nr, NULL, p->k0 > 0,
              next, p->bytes);
}

#define KC_F32 1024  // columns per block of a long-K fp32 product (6 rows: 24 KB of a 32-48 KB L1); % 16 == 0

// The columns a tile takes at once: all K up to KC_F32, else KC_F32 (whole groups of G where G > 0, int4).
static int64_t column_block(int64_t K, int64_t G) {
    if (K <= KC_F32) return K;
    return G > 0 ? (KC_F32 >= G ? KC_F32 / G * G : G) : KC_F32;
}

// fp32 weights: y[m, n] = sum_k x[m, k] * w[n, k]. Requires K % 8 == 0.
void gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K) {
    KERNEL_CALL;
    if (M == 1) {
        one_row_f32(w, NULL, x, y, N, K);
        return;
    }
    if (M <= FEW_ROWS) {
        few_rows_f32(w, NULL, x, y, M, N, K);
        return;
    }
    // Columns in blocks of KC_F32 where K is longer: a tile reads its NR weight rows once per activation tile,
    // so they must stay in L1; 6 rows of Qwen2.5 0.5B's down projection (K = 4864) are 117 KB, and that
    // product ran at 126 GMAC/s against 226-232 for its K = 896 ones (Zen 5, 128 rows): 210 with the blocks,
    // Gemma 3's K = 2048 147 -> 199 (blocks of 512 were slower: 193-206). Each column block adds its partial
    // sums to y; the activation rows' chunk is sized for a block's columns. Not up to STREAM_ROWS rows, whose
    // weights come from memory once: whole rows keep each of the 6 streams one sequential read (a block of
    // columns reads 4 KB of each row and skips the rest until the next pass), and a pass fewer is a barrier
    // fewer. 16 rows from memory, Xeon: +8-17 % at K = 1536, 4864 and 8960, +40 % with the weights in L3.
    const int streams = M <= STREAM_ROWS;
    const int64_t KB = streams ? K : column_block(K, 0);
    const float *c[2] = {x, w};
    tiled_product(f32_block, c, w, K * (int64_t)sizeof(float), y, M, N, K, KB, chunk_rows(M, KB), streams, 0);
}

// Widen 16-bit floats (bf16, or fp16 when `f16`) to fp32 (K % 8 == 0).
static void widen_half(const uint16_t *w, float *dst, int64_t K, int f16) {
    int64_t k = 0;
    for (; k + VW <= K; k += VW) vst(dst + k, f16 ? vld_f16(w + k) : vld_bf16(w + k));
    for (; k < K; k += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(w + k));
        _mm256_storeu_ps(dst + k, f16 ? _mm256_cvtph_ps(h)
                                      : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
}

// bf16 or fp16 weights (uint16 bit patterns; fp16 when `f16`): y[m, n] = sum_k x[m, k] * w[n, k], exactly the
// fp32 product of the widened weights (every bf16 and fp16 value is an fp32 value). Half the bytes of fp32 at
// decode.
static void widen_half_row(const WideRows *src, int64_t n, int64_t k0, int64_t kc, float *dst) {
    widen_half((const uint16_t *)src->w + n * src->K + k0, dst, kc, (int)src->f16);
}

static void gemm_bf16_inputs(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K);

// The formats of gemm_half's 16-bit weights.
enum { HALF_BF16 = 0, HALF_F16 = 1, HALF_BF16_INPUTS = 2 };

void gemm_half(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t format) {
    KERNEL_CALL;
    if (format == HALF_BF16_INPUTS) {
        gemm_bf16_inputs(x, w, y, M, N, K);
        return;
    }
    const int f16 = format == HALF_F16;
    if (M == 1) {
        if (f16)
            one_row_f16(w, NULL, x, y, N, K);
        else
            one_row_bf16(w, NULL, x, y, N, K);
        return;
    }
    if (M <= FEW_ROWS) {
        if (f16)
            few_rows_f16(w, NULL, x, y, M, N, K);
        else
            few_rows_bf16(w, NULL, x, y, M, N, K);
        return;
    }
    const WideRows src = {w, NULL, NULL, K, 0, 2 * K, f16, widen_half_row};
    gemm_widened(&src, x, y, M, N, NULL);
}

// ---------------------------------------------------------------------------------------------------------
// bf16 weights with bf16 inputs (HALF_BF16_INPUTS): x rounded to bf16 (nearest even, as torch casts), then
// every product is the exact product of two bf16 values, summed in fp32. This is what llama.cpp's BF16 and
// torch's bf16 matmul compute. On a CPU with AVX512_BF16, vdpbf16ps takes 32 such products an instruction
// into 16 fp32 sums, on the weights as stored: the exact path (HALF_BF16) widens each 16 weights first (3
// uops), which bound its batch-1 decode by arithmetic (36 GB/s on a Zen 5, where fp32 reads 60) and its
// prefill at 0.69x llama.cpp's. Elsewhere (AVX2, or AVX-512 without BF16) x is rounded to bf16 values held as
// fp32 and the exact path runs: the same products on every CPU, up to summation order (and vdpbf16ps's
// flushing of denormals).
//
// x is rounded once per product into this thread's buffer (kept for the next product), KP = K rounded up to
// 32 columns a row, the padding zero; a tail of fewer than 32 weights is a masked load, so every product
// past K is 0 * 0.
static __thread void *xin_buf;
static __thread int64_t xin_cap;

static void *xin_buffer(int64_t bytes) {
    if (bytes > xin_cap) {
        _mm_free(xin_buf);
        xin_buf = _mm_malloc(bytes, 64);
        xin_cap = xin_buf ? bytes : 0;
    }
    return xin_buf;
}

#define ROUND_PARALLEL 65536  // elements: below this a fork costs more than the rounding

#if defined(__AVX512BF16__)
#define KP_OF(K) (((K) + 31) & ~(int64_t)31)
static inline __m512bh bh_ld(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512bh bh_ld_tail(const uint16_t *p, int64_t n) {  // n < 32 values, the rest 0
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
}
static inline __m512 bh_dot(__m512 acc, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }

static void round_rows_bf16(const float *x, uint16_t *xb, int64_t M, int64_t K) {
    const int64_t KP = KP_OF(K);
#pragma omp parallel for schedule(static) if (M * K >= ROUND_PARALLEL)
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * K;
        uint16_t *dst = xb + m * KP;
        int64_t k = 0;
        for (; k + 32 <= K; k += 32)
            _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(vld(src + k + 16), vld(src + k)));
        for (; k < K; k++) dst[k] = to_bf16(src[k]);
        for (; k < KP; k++) dst[k] = 0;
    }
}

// One input row against 4 weight rows (p[r]), 2 chains a row: chain a over the first 32 columns of every 64,
// b over the second; a last full 32 into a, a last part into b. streams_bf16_inputs' groups keep this order exactly.
static void dot4_one_bf16_inputs(const uint16_t *const p[4], const uint16_t *x, int64_t K, int64_t ahead, float out[4]) {
    __m512 a[4], b[4];
    for (int r = 0; r < 4; r++) a[r] = b[r] = vzero();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        PREFETCH4(p[0], p[1], p[2], p[3], k * 2, (k + 64) * 2, ahead)
        const __m512bh x0 = bh_ld(x + k), x1 = bh_ld(x + k + 32);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            a[r] = bh_dot(a[r], bh_ld(p[r] + k), x0);
            b[r] = bh_dot(b[r], bh_ld(p[r] + k + 32), x1);
        }
    }
    if (k + 32 <= K) {
        const __m512bh x0 = bh_ld(x + k);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) a[r] = bh_dot(a[r], bh_ld(p[r] + k), x0);
        k += 32;
    }
    if (k < K) {
        const __m512bh x0 = bh_ld(x + k);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) b[r] = bh_dot(b[r], bh_ld_tail(p[r] + k, K - k), x0);
    }
    for (int r = 0; r < 4; r++) out[r] = vsum(vadd(a[r], b[r]));
}

// Up to GROUP input rows (KP apart) against 2 weight rows, each row's sums in dot4_one_bf16_inputs's order,
// so each output is bitwise the one-row kernel's (a verifying pass gives a decode step's logits).
static inline __attribute__((always_inline)) void dot2_rows_bf16_inputs(const uint16_t *p0, const uint16_t *p1,
                                                                        const uint16_t *x, int64_t K, const int mb,
                                                                        int64_t ahead, float out[][2]) {
    const int64_t KP = KP_OF(K);
    __m512 a[2][GROUP], b[2][GROUP];
#pragma GCC unroll 8
    for (int i = 0; i < GROUP; i++) a[0][i] = a[1][i] = b[0][i] = b[1][i] = vzero();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        PREFETCH4(p0, p1, p0, p1, k * 2, (k + 64) * 2, ahead)
        const __m512bh w0 = bh_ld(p0 + k), w1 = bh_ld(p0 + k + 32), v0 = bh_ld(p1 + k), v1 = bh_ld(p1 + k + 32);
#pragma GCC unroll 8
        for (int i = 0; i < mb; i++) {
            const __m512bh x0 = bh_ld(x + i * KP + k), x1 = bh_ld(x + i * KP + k + 32);
            a[0][i] = bh_dot(a[0][i], w0, x0), b[0][i] = bh_dot(b[0][i], w1, x1);
            a[1][i] = bh_dot(a[1][i], v0, x0), b[1][i] = bh_dot(b[1][i], v1, x1);
        }
    }
    if (k + 32 <= K) {
        const __m512bh w0 = bh_ld(p0 + k), v0 = bh_ld(p1 + k);
#pragma GCC unroll 8
        for (int i = 0; i < mb; i++) {
            const __m512bh x0 = bh_ld(x + i * KP + k);
            a[0][i] = bh_dot(a[0][i], w0, x0), a[1][i] = bh_dot(a[1][i], v0, x0);
        }
        k += 32;
    }
    if (k < K) {
        const __m512bh w0 = bh_ld_tail(p0 + k, K - k), v0 = bh_ld_tail(p1 + k, K - k);
#pragma GCC unroll 8
        for (int i = 0; i < mb; i++) {
            const __m512bh x0 = bh_ld(x + i * KP + k);
            b[0][i] = bh_dot(b[0][i], w0, x0), b[1][i] = bh_dot(b[1][i], v0, x0);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mb; i++) out[i][0] = vsum(vadd(a[0][i], b[0][i])), out[i][1] = vsum(vadd(a[1][i], b[1][i]));
}

static void dot2_group_bf16_inputs(const uint16_t *p0, const uint16_t *p1, const uint16_t *x, int64_t K, int mb,
                                   int64_t ahead, float out[][2]) {
    switch (mb) {  // mb as a constant in each case: the compiler keeps the accumulators in registers
        case 1: dot2_rows_bf16_inputs(p0, p1, x, K, 1, ahead, out); break;
        case 2: dot2_rows_bf16_inputs(p0, p1, x, K, 2, ahead, out); break;
        case 3: dot2_rows_bf16_inputs(p0, p1, x, K, 3, ahead, out); break;
        case 4: dot2_rows_bf16_inputs(p0, p1, x, K, 4, ahead, out); break;
        case 5: dot2_rows_bf16_inputs(p0, p1, x, K, 5, ahead, out); break;
        default: dot2_rows_bf16_inputs(p0, p1, x, K, GROUP, ahead, out); break;
    }
}

// 1 .. FEW_ROWS input rows on ONE_ROW's 4 streams: one row by dot4_one_bf16_inputs, more in groups against
// pairs of weight rows (FEW's blocks: a block's rows from memory once, for the first group), bitwise the same.
static void streams_bf16_inputs(const uint16_t *w, const uint16_t *x, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t L = (N + NB - 1) / NB, KP = KP_OF(K);
    const int nt = team();
    const int64_t g = grain(L, nt), start = now_ns();
    int64_t first_done = start;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(dynamic, g) nowait
        for (int64_t b = 0; b < L; b++) {
            const uint16_t *rows[NB];
            for (int64_t r = 0; r < NB; r++) rows[r] = w + strided_row(b, r, L, N) * K;
            if (M == 1) {
                float out[NB];
                dot4_one_bf16_inputs(rows, x, K, K * 2, out);
                for (int64_t r = 0; r < NB && b + r * L < N; r++) y[b + r * L] = out[r];
                continue;
            }
            for (int64_t m = 0; m < M; m += GROUP) {
                const int mb = (int)(M - m < GROUP ? M - m : GROUP);
                const int64_t ahead = m ? 0 : K * 2;  // later groups read what the first did
                for (int64_t r0 = 0; r0 < NB; r0 += 2) {
                    float out[GROUP][2];
                    dot2_group_bf16_inputs(rows[r0], rows[r0 + 1], x + m * KP, K, mb, ahead, out);
                    for (int64_t i = 0; i < mb; i++)
                        for (int64_t r = r0; r < r0 + 2 && b + r * L < N; r++) y[(m + i) * N + b + r * L] = out[i][r - r0];
                }
            }
        }
        if (omp_get_thread_num() == 0) first_done = now_ns();
    }
    region_done(start, first_done);
}

// rows_tile with bf16 weights read as stored and bf16 inputs (rows ldx apart, padded with zeros to 32 columns).
ROWS_TILE(rows_tile_bf16_inputs, uint16_t, uint16_t, __m512bh, 32, bh_ld, bh_ld_tail, bh_ld, bh_ld, bh_dot)

// Many input rows: tiled_product's passes (column blocks of 2 KC_F32: the same 4 KB a weight row as fp32's),
// with the weights read as stored (no widening scratch).
typedef struct Bf16Product {
    const uint16_t *x, *w;  // x rounded, KP a row
    int64_t KP;
} Bf16Product;

static void bf16_inputs_block(const TilePass *p, int64_t b, const int64_t *n, int nr, const char *const *next,
                              float *unused) {
    (void)unused;
    const Bf16Product *c = (const Bf16Product *)p->ctx;
    const uint16_t *wr[NR];
    for (int r = 0; r < NR; r++) wr[r] = c->w + n[r] * p->K + p->k0;
    const int64_t at = block_base(p->bl, b);
    rows_tile_bf16_inputs(wr, c->x + p->m0 * c->KP + p->k0, c->KP, p->mc, p->kc, p->y + at, p->N, p->bl->step, nr,
                          NULL, p->k0 > 0, next, p->bytes);
}

static void many_bf16_inputs(const uint16_t *w, const uint16_t *xb, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t KB = K > 2 * KC_F32 ? 2 * KC_F32 : K;
    const Bf16Product c = {xb, w, KP_OF(K)};
    tiled_product(bf16_inputs_block, &c, w, K * 2, y, M, N, K, KB, chunk_rows(M, (KP_OF(KB) + 1) / 2), 0, 0);
}
#endif

// Whether this build and CPU run HALF_BF16_INPUTS on vdpbf16ps (else: x rounded, then the exact path).
int64_t bf16_dot_products(void) {
#if defined(__AVX512BF16__)
    return (cpu_features() & 8) != 0;
#else
    return 0;
#endif
}

// x rounded to bf16 into `xr` as fp32 values, then the exact product of the widened weights: the path of a CPU
// without vdpbf16ps, and of many rows where its tiles do not pay (bf16_dot_tiles).
static void xround_bf16_inputs(const float *x, float *xr, const uint16_t *w, float *y, int64_t M, int64_t N,
                               int64_t K) {
#pragma omp parallel for schedule(static) if (M * K >= ROUND_PARALLEL)
    for (int64_t i = 0; i < M * K; i++) {
        const uint32_t bits = (uint32_t)to_bf16(x[i]) << 16;
        memcpy(xr + i, &bits, sizeof(bits));
    }
    gemm_half(xr, w, y, M, N, K, HALF_BF16);
}

static int dot_tiles = -1;  // bf16_dot_tiles' answer: -1 not measured yet (or measure again), 0 or 1

#if defined(__AVX512BF16__)
// Times one several-rows product (64 x 1024 against 192 rows, in L2) on the vdpbf16ps tiles and on the rounded x
// with the exact tiles, alternating, the best of 7 each.
static int measure_dot_tiles(void) {
    enum { TM = 64, TN = 192, TK = 1024, REPS = 7 };
    float *x = (float *)malloc(TM * TK * sizeof(float)), *xr = (float *)malloc(TM * TK * sizeof(float));
    float *y = (float *)malloc(TM * TN * sizeof(float));
    uint16_t *w = (uint16_t *)malloc(TN * TK * sizeof(uint16_t)), *xb = (uint16_t *)malloc(TM * KP_OF(TK) * 2);
    if (!x || !xr || !y || !w || !xb) abort();
    for (int64_t i = 0; i < TM * TK; i++) x[i] = (float)((i * 7919) % 201 - 100) / 64.0f;
    for (int64_t i = 0; i < TN * TK; i++) w[i] = to_bf16((float)((i * 104729) % 199 - 99) / 128.0f);
    int64_t best_dot = INT64_MAX, best_round = INT64_MAX;
    for (int rep = 0; rep < REPS; rep++) {
        int64_t t = now_ns();
        round_rows_bf16(x, xb, TM, TK);
        many_bf16_inputs(w, xb, y, TM, TN, TK);
        t = now_ns() - t;
        best_dot = t < best_dot ? t : best_dot;
        t = now_ns();
        xround_bf16_inputs(x, xr, w, y, TM, TN, TK);
        t = now_ns() - t;
        best_round = t < best_round ? t : best_round;
    }
    free(x), free(xr), free(y), free(w), free(xb);
    return best_dot < best_round * 0.9;  // a clear win only: on a shared machine one time can be unlucky
}
#endif

// Whether many rows (prefill chunks, batches over FEW_ROWS) of a bf16_inputs product run on the vdpbf16ps
// tiles: measured once a process, as neither the vendor nor a feature bit tells. A Zen 5 runs vdpbf16ps on
// both 512-bit pipes, so its tiles make 64 products a cycle where the FMA tiles make 32 (1.5-2.6x the exact
// tiles); an Intel Xeon (AVX512_BF16 and AMX listed) ran them at 99 GMAC/s against 120 for the exact tiles on
// the rounded x: 32 a cycle either way, plus the rounding pass. One row and a few rows keep vdpbf16ps
// everywhere (decode is bound by the weights' bytes, which it reads as stored). set_bf16_dot_tiles(0 or 1)
// forces the answer (the tests run both tiles), -1 measures again; a CPU without vdpbf16ps (an AVX-512 Xeon
// whose hypervisor hides AVX512_BF16) answers 0 even when forced, as gemm_bf16_inputs never takes them there.
int64_t bf16_dot_tiles(void) {
#if defined(__AVX512BF16__)
    if (!bf16_dot_products()) return 0;
    int known = __atomic_load_n(&dot_tiles, __ATOMIC_ACQUIRE);
    if (known < 0) {
        known = measure_dot_tiles();
        __atomic_store_n(&dot_tiles, known, __ATOMIC_RELEASE);
    }
    return known;
#else
    return 0;
#endif
}

void set_bf16_dot_tiles(int64_t v) { __atomic_store_n(&dot_tiles, v < 0 ? -1 : v > 0, __ATOMIC_RELEASE); }

static void gemm_bf16_inputs(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
    static int dot = -1;  // the CPU does not change under a running process
    if (dot < 0) dot = (int)bf16_dot_products();
    if (dot && (M <= FEW_ROWS || bf16_dot_tiles())) {
        uint16_t *xb = (uint16_t *)xin_buffer(M * KP_OF(K) * 2);
        if (!xb) abort();  // out of memory for a few rows of activations: nothing sensible is left to do
        round_rows_bf16(x, xb, M, K);
        if (M <= FEW_ROWS)
            streams_bf16_inputs(w, xb, y, M, N, K);
        else
            many_bf16_inputs(w, xb, y, M, N, K);
        return;
    }
#endif
    float *xr = (float *)xin_buffer(M * K * (int64_t)sizeof(float));
    if (!xr) abort();
    xround_bf16_inputs(x, xr, w, y, M, N, K);
}

// int4 groups (`Int4Weight`): w[n, k] = code[n, k] * scale[n, g] + zero[n, g] with g = k / G, codes two per
// byte along k (even k in the low nibble), scale and zero fp16. Requires G % 32 == 0.
//
// One row: the codes' products in integers, against x rounded to 16 bits per group (`quantize_x16`): a
// group's products are summed exactly in int32, then scaled once by scale * x's scale; the zero term is
// zero[n, :] . xsum[:] on the unrounded x, xsum[g] being the sum of x over group g. 4 weight rows at a time,
// 0.5 byte/weight. Rounding x to 16 bits moves the bundled model's decode logits by 4e-4 (relative), against
// the 0.058 that the int4 weights themselves cost (`tests/pipeline/test_smollm2_precisions.py`).
// A few rows (2 .. FEW_ROWS): the one-row kernel's blocks, each row's result bitwise the one-row kernel's.
// Many rows: on AVX-512 up to INT4_TILE_ROWS the integer tiles (`many_rows_int4`, the same rounding of x);
// else NR rows are dequantized (code * scale + zero) into an fp32 scratch, then `rows_tile`, on x as it is.

static inline __m256 nibbles_lo8(__m128i codes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)); }
static inline __m256 nibbles_hi8(__m128i codes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)));
}

// zero[:] . xsum[:] for one weight row (fp16 zero points): the zero-point term of the int4 dot products.
static inline float zero_term(const uint16_t *ze, const float *xsum, int64_t groups) {
    __m256 z = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        z = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ze + g))), _mm256_loadu_ps(xsum + g), z);
    float zsum = hsum(z);
    for (; g < groups; g++) zsum += _cvtsh_ss(ze[g]) * xsum[g];
    return zsum;
}

// x as 16-bit integers for the integer int4 kernel: per group of G columns one scale absmax / 32767 (0 for an
// all-zero group), x rounded to nearest; each 32 columns are stored as their 16 even then 16 odd columns, the
// order in which one 16-byte run of codes meets them (byte i holds codes 2 i and 2 i + 1). xsum[g]: the sum of
// the unrounded x over group g, for the zero-point term.
// 64-bit quarters 0, 2, 1, 3: undoes the per-128-bit-lane order of shuffle_ps and packs_epi32 on two inputs
static inline __m256 in_order(__m256 v) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8)); }

static void quantize_x16(const float *x, int16_t *xq, float *xscale, float *xsum, int64_t K, int64_t G) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < K / G; g++) {
        const float *xg = x + g * G;
        __m256 top8 = _mm256_setzero_ps(), sum8 = _mm256_setzero_ps();
        for (int64_t k = 0; k < G; k += 8) {
            const __m256 v = _mm256_loadu_ps(xg + k);
            top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, v));  // a NaN lane is dropped here, kept in the sum
            sum8 = _mm256_add_ps(sum8, v);
        }
        float lanes[8], top = 0.0f;
        _mm256_storeu_ps(lanes, top8);
        for (int i = 0; i < 8; i++) top = fmaxf(top, lanes[i]);
        xsum[g] = hsum(sum8);  // a non-finite x reaches the output through the zero term, as through a product
        xscale[g] = top / 32767.0f;
        const __m256 inv = _mm256_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
        for (int64_t c = 0; c < G; c += 32) {
            __m256i half[2][2];  // [even or odd][columns 0-15 or 16-31 of the 32] as int32
            for (int h = 0; h < 2; h++) {
                const __m256 a = _mm256_loadu_ps(xg + c + 16 * h), b = _mm256_loadu_ps(xg + c + 16 * h + 8);
                // [a0 a2 b0 b2 | a4 a6 b4 b6] -> a0 a2 a4 a6 b0 b2 b4 b6 (and the odd columns alike)
                const __m256 even = in_order(_mm256_shuffle_ps(a, b, 0x88)), odd = in_order(_mm256_shuffle_ps(a, b, 0xDD));
                half[0][h] = _mm256_cvtps_epi32(_mm256_mul_ps(even, inv));  // round to nearest even
                half[1][h] = _mm256_cvtps_epi32(_mm256_mul_ps(odd, inv));
            }
            for (int e = 0; e < 2; e++)  // packs_epi32 interleaves its inputs' 128-bit lanes the same way
                _mm256_storeu_si256((__m256i *)(xq + g * G + c + 16 * e),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(half[e][0], half[e][1]), 0xD8));
        }
    }
}

// Four weight rows against one activation row (x from quantize_x16): out[r] = sum_k x[k] * w_r[k]. Per 32
// codes of a row: one zero-extending load of 16 bytes to 16-bit lanes, a mask and a shift for the two nibble
// planes, and two multiply-adds of pairs into 8 int32 lanes (vpmaddwd + vpaddd, or one vpdpwssd with VNNI);
// per group one conversion and one FMA. The float form it replaced converted every code to float and was
// bound by those conversions: 183 against 221 tok/s int4 decode on the AVX2 path (+1.5 % on AVX-512).
// |x| <= 32767 and codes <= 15: a group of G <= 1024 codes sums to < 2^31 in each lane.
static void dot4_one_int4(const uint8_t *const p[4], const uint16_t *const sc[4], const uint16_t *const ze[4],
                          const int16_t *xq, const float *xscale, const float *xsum, int64_t K, int64_t G,
                          float out[4]) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    const int64_t groups = K / G;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const uint8_t *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
    for (int r = 0; r < 4; r++) {
        _mm_prefetch((const char *)(sc[r] + groups), _MM_HINT_T0);  // the next row of each stream
        _mm_prefetch((const char *)(ze[r] + groups), _MM_HINT_T0);
    }
#ifdef __AVX512VNNI__
#define PAIRS_ADD(D, A, B) D = _mm256_dpwssd_epi32(D, A, B)  // one instruction for the multiply-add and sum
#else
#define PAIRS_ADD(D, A, B) D = _mm256_add_epi32(D, _mm256_madd_epi16(A, B))
#endif
#define INT4_PAIRS(P, D)                                                                          \
    {                                                                                             \
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((P) + at)));    \
        PAIRS_ADD(D, _mm256_and_si256(v, low), xe);                                               \
        PAIRS_ADD(D, _mm256_srli_epi16(v, 4), xo);                                                \
    }
    float sf[4][8];  // scale * x scale of the next 8 groups: a broadcast load per group and row
    for (int64_t g = 0; g < groups; g++) {
        if (g % 8 == 0) {
            for (int r = 0; r < 4; r++) {
                if (groups - g >= 8) {
                    _mm256_storeu_ps(sf[r], _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc[r] + g))),
                                                          _mm256_loadu_ps(xscale + g)));
                } else {
                    for (int64_t i = 0; i < groups - g; i++) sf[r][i] = _cvtsh_ss(sc[r][g + i]) * xscale[g + i];
                }
            }
        }
        __m256i d0 = _mm256_setzero_si256(), d1 = d0, d2 = d0, d3 = d0;
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            const int64_t at = k / 2;
            if ((at & 63) == 0) {  // each stream's next row: the hardware prefetcher alone is too slow
                _mm_prefetch((const char *)(p0 + at + K / 2), _MM_HINT_T0);
                _mm_prefetch((const char *)(p1 + at + K / 2), _MM_HINT_T0);
                _mm_prefetch((const char *)(p2 + at + K / 2), _MM_HINT_T0);
                _mm_prefetch((const char *)(p3 + at + K / 2), _MM_HINT_T0);
            }
            const __m256i xe = _mm256_loadu_si256((const __m256i *)(xq + k)),
                          xo = _mm256_loadu_si256((const __m256i *)(xq + k + 16));
            INT4_PAIRS(p0, d0)
            INT4_PAIRS(p1, d1)
            INT4_PAIRS(p2, d2)
            INT4_PAIRS(p3, d3)
        }
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_broadcast_ss(&sf[0][g % 8]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_broadcast_ss(&sf[1][g % 8]), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2), _mm256_broadcast_ss(&sf[2][g % 8]), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d3), _mm256_broadcast_ss(&sf[3][g % 8]), acc3);
    }
#undef INT4_PAIRS
#undef PAIRS_ADD
    const __m256 accs[4] = {acc0, acc1, acc2, acc3};
    for (int r = 0; r < 4; r++) out[r] = hsum(accs[r]) + zero_term(ze[r], xsum, groups);
}

// One dequantized row, natural k order: dst[k] = code[k] * scale[g] + zero[g].
static void dequant_int4_row(const uint8_t *p, const uint16_t *sc, const uint16_t *ze, int64_t K, int64_t G,
                             float *dst) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t k = 0; k < K; k += 32) {
        const int64_t g = k / G;
        const __m256 s = _mm256_set1_ps(_cvtsh_ss(sc[g])), z = _mm256_set1_ps(_cvtsh_ss(ze[g]));
        const __m128i b = _mm_loadu_si128((const __m128i *)(p + k / 2));
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // k order
        _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(nibbles_lo8(first), s, z));
        _mm256_storeu_ps(dst + k + 8, _mm256_fmadd_ps(nibbles_hi8(first), s, z));
        _mm256_storeu_ps(dst + k + 16, _mm256_fmadd_ps(nibbles_lo8(second), s, z));
        _mm256_storeu_ps(dst + k + 24, _mm256_fmadd_ps(nibbles_hi8(second), s, z));
    }
}

static void dequant_int4_row_of(const WideRows *src, int64_t n, int64_t k0, int64_t kc, float *dst) {
    const int64_t K = src->K, G = src->G, at = n * (K / G) + k0 / G;  // k0: a whole number of groups
    dequant_int4_row((const uint8_t *)src->w + n * (K / 2) + k0 / 2, (const uint16_t *)src->scale + at,
                     (const uint16_t *)src->zero + at, kc, G, dst);
}

// Up to GROUP4 activation rows against 4 weight rows, each row's result bitwise dot4_one_int4's (a pass that
// verifies speculative guesses gives each row the logits a one-token decode step would): the integer sums of a
// group are exact in any order, and each row's float steps (scale product, FMA per group, horizontal sum, zero
// term) are the one-row kernel's. Each 16 bytes of codes are loaded and split into nibble planes once for all
// `mb` rows: that unpacking, not the memory, is what the one-row int4 kernel is bound by.
#ifdef __AVX512F__
#define GROUP4 4  // 16 int32 accumulators and 8 x vectors: AVX-512VL's 32 ymm registers
#else
#define GROUP4 2  // 8 accumulators, 4 x vectors, the mask and a code plane: AVX2's 16 registers
#endif
static inline __attribute__((always_inline)) void dot4_rows_int4(
    const uint8_t *const p[4], const uint16_t *const sc[4], const uint16_t *const ze[4], const int16_t *xq,
    const float *xscale, const float *xsum, int64_t K, int64_t G, const int mb, float out[][4]) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    const int64_t groups = K / G;
    __m256 acc[4][GROUP4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < GROUP4; i++) acc[r][i] = _mm256_setzero_ps();
    for (int r = 0; r < 4; r++) {
        _mm_prefetch((const char *)(sc[r] + groups), _MM_HINT_T0);
        _mm_prefetch((const char *)(ze[r] + groups), _MM_HINT_T0);
    }
#ifdef __AVX512VNNI__
#define PAIRS_ADD(D, A, B) D = _mm256_dpwssd_epi32(D, A, B)
#else
#define PAIRS_ADD(D, A, B) D = _mm256_add_epi32(D, _mm256_madd_epi16(A, B))
#endif
    float sf[GROUP4][4][8];  // per row: scale * x scale of the next 8 groups, as dot4_one_int4 computes them
    for (int64_t g = 0; g < groups; g++) {
        if (g % 8 == 0) {
            for (int i = 0; i < mb; i++)
                for (int r = 0; r < 4; r++) {
                    const float *xs = xscale + i * groups;
                    if (groups - g >= 8) {
                        _mm256_storeu_ps(sf[i][r], _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc[r] + g))),
                                                                 _mm256_loadu_ps(xs + g)));
                    } else {
                        for (int64_t j = 0; j < groups - g; j++) sf[i][r][j] = _cvtsh_ss(sc[r][g + j]) * xs[g + j];
                    }
                }
        }
        __m256i d[4][GROUP4];
        _Pragma("GCC unroll 8") for (int i = 0; i < GROUP4; i++) d[0][i] = d[1][i] = d[2][i] = d[3][i] = _mm256_setzero_si256();
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            const int64_t at = k / 2;
            if ((at & 63) == 0)
                for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(p[r] + at + K / 2), _MM_HINT_T0);
            __m256i xe[GROUP4], xo[GROUP4];
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {
                xe[i] = _mm256_loadu_si256((const __m256i *)(xq + i * K + k));
                xo[i] = _mm256_loadu_si256((const __m256i *)(xq + i * K + k + 16));
            }
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p[r] + at)));
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi16(v, 4);
                _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {
                    PAIRS_ADD(d[r][i], lo, xe[i]);
                    PAIRS_ADD(d[r][i], hi, xo[i]);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++)
                acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r][i]), _mm256_broadcast_ss(&sf[i][r][g % 8]), acc[r][i]);
    }
#undef PAIRS_ADD
    for (int i = 0; i < mb; i++)
        for (int r = 0; r < 4; r++) out[i][r] = hsum(acc[r][i]) + zero_term(ze[r], xsum + i * groups, groups);
}

// mb as a constant in each case: the compiler keeps the accumulators in registers
static void dot4_group_int4(const uint8_t *const p[4], const uint16_t *const sc[4], const uint16_t *const ze[4],
                            const int16_t *xq, const float *xscale, const float *xsum, int64_t K, int64_t G, int mb,
                            float out[][4]) {
    switch (mb) {
        case 1: dot4_rows_int4(p, sc, ze, xq, xscale, xsum, K, G, 1, out); break;
        case 2: dot4_rows_int4(p, sc, ze, xq, xscale, xsum, K, G, 2, out); break;
        case 3: dot4_rows_int4(p, sc, ze, xq, xscale, xsum, K, G, GROUP4 < 3 ? GROUP4 : 3, out); break;
        default: dot4_rows_int4(p, sc, ze, xq, xscale, xsum, K, G, GROUP4, out); break;
    }
}

// 2 .. FEW_ROWS activation rows (a decode row and its guesses): each row's x rounded as the one-row kernel
// rounds it, the 4-stream blocks of the one-row kernel, GROUP4 rows at a time against each block's codes
// (from memory for the first group, from L1 for the others). Through the dequantizing tiled path a 2-row
// int4 product cost several times a 1-row one, and its fp32 sums differed from the one-row integer ones.
static void few_rows_int4(const float *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *zero,
                          float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    const int64_t groups = K / G;
    int16_t *xq = (int16_t *)malloc(M * K * sizeof(int16_t));
    float *xscale = (float *)malloc(M * groups * sizeof(float)), *xsum = (float *)malloc(M * groups * sizeof(float));
    for (int64_t m = 0; m < M; m++) quantize_x16(x + m * K, xq + m * K, xscale + m * groups, xsum + m * groups, K, G);
    const int64_t L = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < L; b++) {
        const uint8_t *p[NB];
        const uint16_t *sc[NB], *ze[NB];
        for (int64_t r = 0; r < NB; r++) {
            const int64_t n = strided_row(b, r, L, N);
            p[r] = packed + n * (K / 2), sc[r] = scale + n * groups, ze[r] = zero + n * groups;
        }
        for (int64_t m = 0; m < M; m += GROUP4) {
            const int mb = (int)(M - m < GROUP4 ? M - m : GROUP4);
            float out[GROUP4][4];
            dot4_group_int4(p, sc, ze, xq + m * K, xscale + m * groups, xsum + m * groups, K, G, mb, out);
            for (int64_t i = 0; i < mb; i++)
                for (int64_t r = 0; r < NB && b + r * L < N; r++) y[(m + i) * N + b + r * L] = out[i][r];
        }
    }
    free(xsum);
    free(xq);
    free(xscale);
}

#ifdef __AVX512F__
// Several rows on AVX-512 (up to INT4_TILE_ROWS): the codes' products in integers (vpdpwssd, 32 multiply-adds
// an instruction), on x rounded to 16 bits per group as the one-row kernel rounds it, so 1 .. 32 rows share one
// arithmetic but for the fp32 order of the sums. The dequantizing tiles these replace spent a third of a Gemma
// 3 batch-16 step turning codes into fp32 (perf: 25 % of the samples in dequant_int4_row, 48 % in the fp32
// tiles after it). At 16 rows on the Xeon: the Gemma 3 head 34.7 -> 22.4 ms, the linears 1.4-1.6x.
//
// A superblock is 256 columns: 8 segments of 32 codes (each in one group), 128 bytes, two zmm loads. Two
// dword permutes give each int32 lane t two 32-bit pieces (16 codes) of segment t / 2, so the lane sums 16
// products a superblock before one conversion, one scale (the segment's scale * x's scale) and one FMA, and
// the zero-point term (zero * x's sum over the segment) one more: no lane ever mixes groups. A mask and three
// shifts split each 16-bit word (4 codes) into planes of one code a word, each multiplied (word pairs summed,
// vpdpwssd) by the matching plane of x. A K that is not a multiple of 256 ends in masked loads: the absent
// segments' codes, x and scales are 0. Tried and not kept: 128-column superblocks (one load, no permute;
// same speed), two dependency chains a row or rows interleaved (same speed: not latency-bound).
#define SB 256              // columns a superblock
#define INT4_TILE_ROWS 32   // the most rows it takes: at 64 and 128 both tiles run at one speed (0.9-1.1x)
#define MT4 16              // activation rows a tile: 16 fp32 accumulators and one weight row's 8 planes

typedef struct Int4X {  // one activation row's superblock, prepared once a product (`int4_x_planes`)
    int16_t q[8][32];   // plane 4 j + c, word 2 t + w: x at column 32 (t / 2) + 8 p + 4 w + c, p = 2 (t % 2) + j
    float sx[16];       // lane t: x's scale (its group's absmax / 32767) for segment t / 2
    float xs[16];       // lane t: the sum of x over segment t / 2, halved (two lanes add it)
} Int4X;

static int int4_tiles_on = 1;  // set_int4_integer_tiles: 0 runs many rows on the dequantizing tiles (A/B, tests)

void set_int4_integer_tiles(int64_t v) { __atomic_store_n(&int4_tiles_on, v != 0, __ATOMIC_RELEASE); }

// The most rows a product runs on these tiles now (0: none, the dequantizing tiles take every many-row product).
int64_t int4_integer_tile_rows(void) { return __atomic_load_n(&int4_tiles_on, __ATOMIC_ACQUIRE) ? INT4_TILE_ROWS : 0; }

// x [M, K] into S superblocks a row; the group scale and the rounding are quantize_x16's.
static void int4_x_planes(const float *x, Int4X *out, int64_t M, int64_t K, int64_t G) {
    const int64_t S = (K + SB - 1) / SB;
    int16_t order[32];
    for (int w = 0; w < 32; w++) {
        const int plane = w / 4, j = plane / 4, c = plane % 4, i = w % 4;
        order[w] = (int16_t)(16 * (i / 2) + 8 * j + 4 * (i % 2) + c);
    }
    const __m512i plane_order = _mm512_loadu_si512(order);
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        Int4X *o = out + m * S;
        memset(o, 0, S * sizeof(Int4X));
        for (int64_t g = 0; g < K / G; g++) {
            const float *xg = xm + g * G;
            __m512 top16 = _mm512_setzero_ps();
            for (int64_t k = 0; k < G; k += 16)  // a NaN x is dropped here (max_ps keeps its second operand)
                top16 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xg + k)), top16);
            const float top = _mm512_reduce_max_ps(top16), scale = top / 32767.0f;
            const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
            for (int64_t k = 0; k < G; k += 32) {  // one segment
                const int64_t at = g * G + k, seg = (at % SB) / 32;
                Int4X *sb = o + at / SB;
                const __m512 a = _mm512_loadu_ps(xg + k), b = _mm512_loadu_ps(xg + k + 16);
                const __m512i q16 = _mm512_inserti64x4(  // round to nearest even, 16 bits, column order
                    _mm512_castsi256_si512(_mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)))),
                    _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))), 1);
                int64_t words[8];  // plane 4 j + c's 4 words of this segment: columns 8j+c, 8j+4+c, 16+8j+c, 20+8j+c
                _mm512_storeu_si512(words, _mm512_permutexvar_epi16(plane_order, q16));
                for (int j = 0; j < 8; j++) memcpy(&sb->q[j][4 * seg], &words[j], sizeof(int64_t));
                const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
                for (int h = 0; h < 2; h++) {
                    sb->sx[2 * seg + h] = scale;
                    sb->xs[2 * seg + h] = sum * 0.5f;
                }
            }
        }
    }
}

// The horizontal sums of 16 vectors in one: halves of 128-bit lanes folded across vector pairs (a[i] with
// a[i + 8], then with a[i + 4]), then within the 128-bit lanes. Lane l of the result is a[SUM16_ROW(l)]'s sum.
#define SUM16_ROW(l) ((int[]){0, 2, 1, 3}[(l) % 4] + (int[]){0, 8, 4, 12}[(l) / 4])
static inline __m512 sums16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  // lanes: a[i]'s 128-bit halves summed, then a[i + 8]'s
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)  // 128-bit lane j: a[i], a[i + 8], a[i + 4], a[i + 12], four partial sums each
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)  // within each 128-bit lane: two partials of c[i]'s row, two of c[i + 2]'s
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

typedef struct Int4Tiles {
    const uint8_t *packed;
    const uint16_t *scale, *zero;
    const Int4X *x;
    const __m512i *seg_group;  // per superblock, lane t: the group of segment t / 2 less the superblock's first
    __m512i pick[2];           // lane t of permute j: dword 2 (t % 2) + j of segment t / 2 (of two loads)
    int64_t G, groups, S;
} Int4Tiles;

// mb (a constant in each instance) activation rows against one weight row over superblocks s0 .. s1 - 1;
// y[i * N] gets the sums (added to what it holds where add). next: the next block's same row, its lines
// prefetched two a superblock (a superblock's codes are two lines), or NULL.
static inline __attribute__((always_inline)) void int4_tile(const Int4Tiles *c, int64_t n, const Int4X *x,
                                                            int64_t s0, int64_t s1, int64_t K, const int mb,
                                                            float *y, int64_t N, int add, const char *next) {
    const uint8_t *codes = c->packed + n * (K / 2);
    const uint16_t *sc = c->scale + n * c->groups, *ze = c->zero + n * c->groups;
    const __m512i low = _mm512_set1_epi16(0x0F);
    __m512 acc[MT4];
    for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = s0; s < s1; s++) {
        const int64_t k0 = s * SB, left = (K - k0) / 2;  // bytes of codes from k0 on
        if (next) {
            _mm_prefetch(next + (s - s0) * 128, _MM_HINT_T0);
            _mm_prefetch(next + (s - s0) * 128 + 64, _MM_HINT_T0);
        }
        __m512i lo, hi;
        if (left >= 128) {
            lo = _mm512_loadu_si512(codes + k0 / 2), hi = _mm512_loadu_si512(codes + k0 / 2 + 64);
        } else {
            const __mmask64 all = ~(__mmask64)0;
            lo = _mm512_maskz_loadu_epi8(left >= 64 ? all : (((__mmask64)1 << left) - 1), codes + k0 / 2);
            hi = _mm512_maskz_loadu_epi8(left > 64 ? (((__mmask64)1 << (left - 64)) - 1) : 0, codes + k0 / 2 + 64);
        }
        const __m512i t0 = _mm512_permutex2var_epi32(lo, c->pick[0], hi), t1 = _mm512_permutex2var_epi32(lo, c->pick[1], hi);
        const __m512i planes[8] = {
            _mm512_and_si512(t0, low), _mm512_and_si512(_mm512_srli_epi16(t0, 4), low),
            _mm512_and_si512(_mm512_srli_epi16(t0, 8), low), _mm512_srli_epi16(t0, 12),
            _mm512_and_si512(t1, low), _mm512_and_si512(_mm512_srli_epi16(t1, 4), low),
            _mm512_and_si512(_mm512_srli_epi16(t1, 8), low), _mm512_srli_epi16(t1, 12)};
        const int64_t g0 = k0 / c->G, ng = c->groups - g0 < 8 ? c->groups - g0 : 8;  // the scales to load
        const __mmask8 gm = (__mmask8)((1u << ng) - 1);
        const __m512 sw = _mm512_permutexvar_ps(c->seg_group[s], _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_maskz_loadu_epi16(gm, sc + g0)))),
                     zw = _mm512_permutexvar_ps(c->seg_group[s], _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_maskz_loadu_epi16(gm, ze + g0))));
        _Pragma("GCC unroll 16") for (int i = 0; i < mb; i++) {
            const Int4X *xi = x + i * c->S + s;
            __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), planes[0], _mm512_load_si512(xi->q[0]));
            _Pragma("GCC unroll 8") for (int j = 1; j < 8; j++) d = _mm512_dpwssd_epi32(d, planes[j], _mm512_load_si512(xi->q[j]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, _mm512_load_ps(xi->sx)), acc[i]);
            acc[i] = _mm512_fmadd_ps(zw, _mm512_load_ps(xi->xs), acc[i]);
        }
    }
    if (mb == MT4) {  // the 16 sums in one vector, 46 shuffles and adds where 16 reductions take ~130
        float sums[16];
        _mm512_storeu_ps(sums, sums16(acc));
        for (int l = 0; l < 16; l++) {
            const int i = SUM16_ROW(l);
            y[i * N] = (add ? y[i * N] : 0.0f) + sums[l];
        }
    } else {
        for (int i = 0; i < mb; i++) y[i * N] = (add ? y[i * N] : 0.0f) + _mm512_reduce_add_ps(acc[i]);
    }
}

static void int4_tiles_block(const TilePass *p, int64_t b, const int64_t *n, int nr, const char *const *next,
                             float *unused) {
    (void)b, (void)unused;
    const Int4Tiles *c = (const Int4Tiles *)p->ctx;
    const int64_t s0 = p->k0 / SB, s1 = (p->k0 + p->kc + SB - 1) / SB;
    for (int64_t m = 0; m < p->mc;) {  // tiles of 16 rows, then 8, 4, 2, 1: each a constant for the compiler
        const int64_t left = p->mc - m;
        const int mb = left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const Int4X *x = c->x + (p->m0 + m) * c->S;
        for (int r = 0; r < nr; r++) {
            float *y = p->y + m * p->N + n[r];
            const char *ahead = next && m == 0 ? next[r] : NULL;
            switch (mb) {
                case 16: int4_tile(c, n[r], x, s0, s1, p->K, 16, y, p->N, p->k0 > 0, ahead); break;
                case 8: int4_tile(c, n[r], x, s0, s1, p->K, 8, y, p->N, p->k0 > 0, ahead); break;
                case 4: int4_tile(c, n[r], x, s0, s1, p->K, 4, y, p->N, p->k0 > 0, ahead); break;
                case 2: int4_tile(c, n[r], x, s0, s1, p->K, 2, y, p->N, p->k0 > 0, ahead); break;
                default: int4_tile(c, n[r], x, s0, s1, p->K, 1, y, p->N, p->k0 > 0, ahead); break;
            }
        }
        m += mb;
    }
}

static void many_rows_int4(const float *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *zero,
                           float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    const int64_t S = (K + SB - 1) / SB;
    Int4X *xp = (Int4X *)_mm_malloc(M * S * sizeof(Int4X), 64);
    __m512i *seg_group = (__m512i *)_mm_malloc(S * sizeof(__m512i), 64);
    if (!xp || !seg_group) abort();
    int4_x_planes(x, xp, M, K, G);
    for (int64_t s = 0; s < S; s++) {
        int32_t lanes[16];
        for (int t = 0; t < 16; t++) {
            const int64_t k = s * SB + 32 * (t / 2);
            lanes[t] = k < K ? (int32_t)(k / G - s * SB / G) : 0;
        }
        seg_group[s] = _mm512_loadu_si512(lanes);
    }
    Int4Tiles c = {packed, scale, zero, xp, seg_group, {_mm512_setzero_si512(), _mm512_setzero_si512()}, G, K / G, S};
    for (int j = 0; j < 2; j++) {
        int32_t lanes[16];
        for (int t = 0; t < 16; t++) {  // segment t / 2 is dword 4 (seg % 4) .. of load seg / 4 (16 + i: the second)
            const int seg = t / 2, piece = 2 * (t % 2) + j;
            lanes[t] = 16 * (seg / 4) + 4 * (seg % 4) + piece;
        }
        c.pick[j] = _mm512_loadu_si512(lanes);
    }
    // Chunks of MT4 activation rows: a tile's prepared x (2.5 bytes a column a row, 25 KB at K = 640) stays in
    // L1 for all the weight rows of a block; with a prompt chunk's 128 rows in one pass, each weight row read
    // them again from L2 (0.6-0.9x the dequantizing tiles).
    const int64_t KB = K <= 1024 ? K : 1024;  // a multiple of SB: the column blocks' partial sums add up in y
    tiled_product(int4_tiles_block, &c, packed, K / 2, y, M, N, K, KB, MT4, 0, 0);
    _mm_free(seg_group);
    _mm_free(xp);
}
#undef SB
#undef MT4
#else
void set_int4_integer_tiles(int64_t v) { (void)v; }  // the AVX2 build has only the dequantizing tiles
int64_t int4_integer_tile_rows(void) { return 0; }
#endif

// y[m, n] = sum_k x[m, k] * w[n, k] for int4 groups; packed uint8 [N, K/2], scale/zero fp16 [N, K/G].
void gemm_int4(const float *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *zero, float *y,
               int64_t M, int64_t N, int64_t K, int64_t G) {
    KERNEL_CALL;
    const int64_t groups = K / G;
    if (M == 1) {
        int16_t *xq = (int16_t *)malloc(K * sizeof(int16_t));  // x rounded, in the order the codes meet it
        float *xscale = (float *)malloc(groups * sizeof(float)), *xsum = (float *)malloc(groups * sizeof(float));
        quantize_x16(x, xq, xscale, xsum, K, G);
        const int64_t L = (N + NB - 1) / NB;  // rows per stream (see ONE_ROW)
        const int nt = team();
        const int64_t g = grain(L, nt), start = now_ns();
        int64_t first_done = start;
#pragma omp parallel num_threads(nt)
        {
#pragma omp for schedule(dynamic, g) nowait
            for (int64_t b = 0; b < L; b++) {
                const uint8_t *p[NB];
                const uint16_t *sc[NB], *ze[NB];
                for (int64_t r = 0; r < NB; r++) {
                    const int64_t n = strided_row(b, r, L, N);
                    p[r] = packed + n * (K / 2), sc[r] = scale + n * groups, ze[r] = zero + n * groups;
                }
                float out[NB];
                dot4_one_int4(p, sc, ze, xq, xscale, xsum, K, G, out);
                for (int64_t r = 0; r < NB && b + r * L < N; r++) y[b + r * L] = out[r];
            }
            if (omp_get_thread_num() == 0) first_done = now_ns();
        }
        region_done(start, first_done);
        free(xsum);
        free(xq);
        free(xscale);
        return;
    }
    if (M <= FEW_ROWS) {
        few_rows_int4(x, packed, scale, zero, y, M, N, K, G);
        return;
    }
#ifdef __AVX512F__
    if (M <= INT4_TILE_ROWS && __atomic_load_n(&int4_tiles_on, __ATOMIC_ACQUIRE)) {
        many_rows_int4(x, packed, scale, zero, y, M, N, K, G);
        return;
    }
#endif
    const WideRows src = {packed, scale, zero, K, G, K / 2, 0, dequant_int4_row_of};
    gemm_widened(&src, x, y, M, N, NULL);
}

// ---------------------------------------------------------------------------------------------------------
// A whole forward pass (decode rows and prompt chunks, all layers, the head) in one call, fp32 activations.
//
// The torch model spends as long dispatching its ~30 small ops per layer as it does multiplying, at batch
// 1 on a small model; here each layer is 4 weight products plus a few loops over a few KB of activations.
// A prefill through the torch modules spent a fifth of its time outside the weight products (norms, RoPE,
// SDPA, SiLU and their allocations); here it is one call per chunk.
// Same arithmetic as `Transformer.forward`: RMSNorm, fused QKV, rotate-half RoPE at each row's position,
// K/V stored into the static cache at `slot`, GQA attention over the row's valid slots (the new one
// included), output projection, residual, RMSNorm, fused gate|up, SiLU(gate) * up, down, residual; then
// the final norm and the head. Python checks every shape and layout before calling (llm/generation/fused_decode.py).

enum {
    LINEAR_F32 = 0, LINEAR_INT8 = 1, LINEAR_INT4 = 2, LINEAR_BF16 = 3, LINEAR_F16 = 4, LINEAR_BF16_INPUTS = 5,
    LINEAR_GGUF = 6, LINEAR_PARTS = 7
};

typedef struct {
    int64_t kind;        // LINEAR_F32: w is float [n, k]; LINEAR_INT8: w is int8 [n, k] with fp32 scale [n];
    const void *w;       // LINEAR_INT4: w is packed uint8 [n, k/2] with fp16 scale and zero [n, k/group];
    const void *scale;   // LINEAR_BF16 / LINEAR_F16: w is bf16 / fp16 (uint16 bits) [n, k]; LINEAR_BF16_INPUTS:
                         // bf16 w, x rounded to bf16 (gemm_half HALF_BF16_INPUTS); LINEAR_GGUF: w is a GGUF's
    const void *zero;    // quantized block rows [n, row bytes], group their ggml type (gguf_blocks.c);
    int64_t n, k, group; // LINEAR_PARTS: w is `group` LINEAR_GGUF parts (a fused q|k|v of differing block types),
    int64_t xbits;       // each writing its own n columns of the [M, n] output in order. xbits: LINEAR_GGUF's
} Linear;                // rounding of x (8 or 16, gguf_blocks.c)

// gguf_blocks.c (the same shared object)
int64_t gguf_linear_ld(int64_t type, const void *blocks, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t ldy, int64_t xbits);
int64_t gguf_dequantize_rows(int64_t type, const void *blocks, float *out, int64_t N, int64_t K);
int64_t gguf_block_shape(int64_t type, int64_t *out);

typedef struct {
    const float *attn_norm, *ffn_norm;  // [dim]
    Linear wqkv, wo, w13, w2;
    // The departures of other families (llm/model/architecture.py); NULL / 0 where the layer has none (Llama).
    const float *qkv_bias;                     // [(H + 2 KV) hd]: added to the fused q|k|v (Qwen2)
    const float *q_norm, *k_norm;              // [hd]: per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    const float *post_attn_norm, *post_ffn_norm;  // [dim]: norms of the attention's and MLP's outputs (Gemma)
    const float *rope_cos, *rope_sin;          // this layer's tables (Gemma 3's sliding layers: their own base)
    int64_t window;                            // > 0: attend to the last `window` slots only (sliding window)
    void *k_cache, *v_cache;                   // this layer's K/V [max_batch, n_kv_heads, rows, head_dim]
    int64_t rows;                              // slots it holds: max_tokens, or a sliding layer's ring (slot % rows)
} Layer;

typedef struct {
    int64_t n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, vocab;
    int64_t max_batch, max_tokens;       // KV cache geometry: rows per layer (Layer.rows), slots per row
    float eps;
    const void *embed;                   // [vocab, dim]: fp32, or a GGUF's block rows of ggml type embed_type
    const float *rope_cos, *rope_sin;    // [max_positions, head_dim / 2]
    const float *norm;                   // [dim]
    Linear head;
    const Layer *layers;                 // [n_layers]
    const uint8_t *valid;                // [max_batch, max_tokens]: slot holds a real token of that row
    int64_t *layer_ns;                   // NULL, or [2 n_layers + 2] CLOCK_MONOTONIC marks (see step_clock)
    int64_t kv_format;                   // KV_F32, KV_F16 or KV_BF16
    int64_t gelu;                        // 1: GeGLU with tanh-approximated GELU (Gemma), 0: SwiGLU
    int64_t embed_type;                  // 0 (ggml's F32): embed is fp32; else its rows are dequantized per token
    float embed_scale;                   // embeddings are multiplied by this when it is not 1 (Gemma: sqrt(dim))
    float attn_scale;                    // the scores' scale; 0: 1 / sqrt(head_dim)
    float attn_softcap, final_softcap;   // > 0: scores / logits become cap * tanh(x / cap) (Gemma 2)
} DecodeModel;
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

// The structs' sizes and field offsets, so the ctypes mirror in llm/generation/fused_decode.py can be checked against
// what this compiler laid out before a single pointer is handed over (a mismatch would corrupt memory).
int64_t decode_layout(int64_t *out, int64_t cap) {
    const int64_t v[] = {
        sizeof(Linear), offsetof(Linear, w), offsetof(Linear, scale), offsetof(Linear, zero), offsetof(Linear, n),
        offsetof(Linear, k), offsetof(Linear, group), offsetof(Linear, xbits), sizeof(Layer), offsetof(Layer, ffn_norm), offsetof(Layer, wqkv),
        offsetof(Layer, wo), offsetof(Layer, w13), offsetof(Layer, w2), offsetof(Layer, qkv_bias),
        offsetof(Layer, q_norm), offsetof(Layer, k_norm), offsetof(Layer, post_attn_norm),
        offsetof(Layer, post_ffn_norm), offsetof(Layer, rope_cos), offsetof(Layer, rope_sin), offsetof(Layer, window),
        offsetof(Layer, k_cache), offsetof(Layer, v_cache), offsetof(Layer, rows), sizeof(DecodeModel),
        offsetof(DecodeModel, max_batch), offsetof(DecodeModel, eps), offsetof(DecodeModel, embed),
        offsetof(DecodeModel, norm), offsetof(DecodeModel, head), offsetof(DecodeModel, layers),
        offsetof(DecodeModel, valid), offsetof(DecodeModel, layer_ns), offsetof(DecodeModel, kv_format),
        offsetof(DecodeModel, gelu), offsetof(DecodeModel, embed_type), offsetof(DecodeModel, embed_scale),
        offsetof(DecodeModel, attn_scale), offsetof(DecodeModel, attn_softcap), offsetof(DecodeModel, final_softcap),
    };
    const int64_t n = (int64_t)(sizeof(v) / sizeof(v[0]));
    for (int64_t i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

// Per-layer timing of the fused step, only when observing (layer_ns non-NULL; otherwise one untaken branch
// per layer): marks[0] at the start, marks[1 + 2l] after layer l's attention and residual, marks[2 + 2l]
// after its MLP and residual, marks[2 n_layers + 1] after the head. CLOCK_MONOTONIC is the clock of Python's
// time.perf_counter_ns, so the marks line up with the caller's own spans (llm/model/layer_clock.py).
static inline void step_clock(const DecodeModel *m, int64_t at) {
    if (!m->layer_ns) return;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    m->layer_ns[at] = (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

// A GGUF product into columns of y (row stride ldy); out of memory, its columns are NaN rather than stale.
static void gguf_product(const Linear *l, const float *x, float *y, int64_t M, int64_t ldy) {
    if (gguf_linear_ld(l->group, l->w, x, y, M, l->n, l->k, ldy, l->xbits) == 0) return;
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < l->n; j++) y[r * ldy + j] = NAN;
}

// Parts of different block types: each writes its columns straight into y through the output stride, so no
// scratch and no scatter pass (at batch 1 the copy would be as long as a small part's product).
static void gguf_parts(const Linear *l, const float *x, float *y, int64_t M) {
    const Linear *parts = (const Linear *)l->w;
    int64_t col = 0;
    for (int64_t p = 0; p < l->group; p++) {
        gguf_product(parts + p, x, y + col, M, l->n);
        col += parts[p].n;
    }
}

static void linear(const Linear *l, const float *x, float *y, int64_t M) {
    if (l->kind == LINEAR_GGUF)
        gguf_product(l, x, y, M, l->n);
    else if (l->kind == LINEAR_PARTS)
        gguf_parts(l, x, y, M);
    else if (l->kind == LINEAR_INT8)
        gemm_int8(x, (const int8_t *)l->w, (const float *)l->scale, y, M, l->n, l->k);
    else if (l->kind == LINEAR_INT4)
        gemm_int4(x, (const uint8_t *)l->w, (const uint16_t *)l->scale, (const uint16_t *)l->zero, y, M, l->n, l->k,
                  l->group);
    else if (l->kind == LINEAR_BF16)
        gemm_half(x, (const uint16_t *)l->w, y, M, l->n, l->k, HALF_BF16);
    else if (l->kind == LINEAR_F16)
        gemm_half(x, (const uint16_t *)l->w, y, M, l->n, l->k, HALF_F16);
    else if (l->kind == LINEAR_BF16_INPUTS)
        gemm_half(x, (const uint16_t *)l->w, y, M, l->n, l->k, HALF_BF16_INPUTS);
    else
        gemm_f32(x, (const float *)l->w, y, M, l->n, l->k);
}

// The sums of squares of n rows of D floats (ld apart, n <= 8) into ss[0..n), each summed in the order
// 0..D-1 as a plain loop sums it (the products rounded, then added one by one), so a row's norm does not
// depend on its neighbours; the rows go in the lanes of one vector. One row alone is a chain of D dependent
// adds (4 cycles each): the norms were 5 % of a 128-token Gemma 3 prefill.
// The rows' 8 columns at a time are transposed in registers (8 loads, 24 shuffles), not gathered column by
// column: a gather cost 17-33 cycles on Zen 5, so a 1536-wide norm took ~10 us.
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

static void sums_of_squares(const float *x, int64_t ld, int64_t n, int64_t D, float *ss) {
    const float *row[8];
    for (int j = 0; j < 8; j++) row[j] = x + (j < n ? j : 0) * ld;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 v[8];
        for (int j = 0; j < 8; j++) v[j] = _mm256_loadu_ps(row[j] + i);
        transpose8(v);  // v[c]: column i + c of the 8 rows
        for (int c = 0; c < 8; c++) acc = _mm256_add_ps(acc, _mm256_mul_ps(v[c], v[c]));
    }
    for (; i < D; i++) {
        const __m256 v = _mm256_setr_ps(row[0][i], row[1][i], row[2][i], row[3][i], row[4][i], row[5][i], row[6][i],
                                        row[7][i]);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float all[8];
    _mm256_storeu_ps(all, acc);
    for (int64_t j = 0; j < n; j++) ss[j] = all[j];
}

// x / rms(x) * w for n <= 8 rows of D floats (y may be x: a row is read for its sum before it is written).
static void norm_rows(const float *x, const float *w, float *y, int64_t n, int64_t D, float eps) {
    float ss[8];
    sums_of_squares(x, D, n, D, ss);
    for (int64_t m = 0; m < n; m++) {
        const float *xm = x + m * D, inv = 1.0f / sqrtf(ss[m] / (float)D + eps);
        for (int64_t i = 0; i < D; i++) y[m * D + i] = xm[i] * inv * w[i];
    }
}

// The same over M rows, eight at a time, in parallel from 16 rows.
static void rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t D, float eps) {
#pragma omp parallel for schedule(static) num_threads(team()) if (M >= 16)
    for (int64_t m0 = 0; m0 < M; m0 += 8) norm_rows(x + m0 * D, w, y + m0 * D, M - m0 < 8 ? M - m0 : 8, D, eps);
}

// h += d over n floats (the residuals), in parallel when `many`.
static void add_rows(float *h, const float *d, int64_t n, int many) {
#pragma omp parallel for schedule(static) num_threads(team()) if (many)
    for (int64_t i = 0; i < n; i++) h[i] += d[i];
}

// rotate-half RoPE of one head in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
static void rope(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

// a . b over n floats: VW lanes, two accumulators (an 8-FMA dependency chain per dot left the attention
// latency-bound: ~60 cycles a score in a 128-token prefill).
static inline float dot(const float *a, const float *b, int64_t n) {
    vf s0 = vzero(), s1 = vzero();
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        s0 = vfma(vld(a + i), vld(b + i), s0);
        s1 = vfma(vld(a + i + VW), vld(b + i + VW), s1);
    }
    for (; i + VW <= n; i += VW) s0 = vfma(vld(a + i), vld(b + i), s0);
    float sum = vsum(vadd(s0, s1));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

// q . k_i for the 8 keys k_i = k + i hd (hd % VW == 0), as one vector: 8 independent accumulators and one
// transposing reduction (3 levels of pairwise adds) instead of 8 horizontal sums, which were half the cost
// of a score.
static inline __m256 dot8(const float *q, const float *k, int64_t hd) {
    vf a[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) a[i] = vzero();
    for (int64_t d = 0; d < hd; d += VW) {
        const vf qv = vld(q + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = vfma(qv, vld(k + i * hd + d), a[i]);
    }
    __m256 b[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
#ifdef __AVX512F__
        b[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
#else
        b[i] = a[i];
#endif
    // hadd(x, y) = [x01 x23 y01 y23 | x45 x67 y45 y67]: twice gives each key's sums of lanes 0-3 in the low
    // half and of lanes 4-7 in the high half, for keys 0-3 and 4-7; the halves' sum is the 8 dot products.
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(b[4], b[5]), _mm256_hadd_ps(b[6], b[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// e^x for 8 lanes (Cephes' range reduction and degree-6 polynomial, ~2 ulp); x is clamped to [-87, 88], so
// the result is finite and > 0 (the callers zero masked lanes themselves). libm's scalar expf was 1/6 of a
// decode step at a few hundred tokens of context (softmax over every slot, SiLU over the MLP width).
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln2, in two parts for precision
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// SiLU(gate) * up over n values (n % 8 == 0 is not required).
static void swiglu(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

// GELU(gate) * up with GELU's tanh approximation (transformers' gelu_pytorch_tanh), the GeGLU of Gemma.
// 0.5 (1 + tanh(u)) is sigmoid(2u), so the vector lanes use exp8 as SiLU does: libm's scalar tanhf (with the
// expm1f inside it) was 18 % of a Gemma prefill.
static void geglu(const float *gate, const float *up, float *out, int64_t n) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), m2k0 = _mm256_set1_ps(-2.0f * k0), vk1 = _mm256_set1_ps(k1);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(vk1, g), _mm256_mul_ps(g, g), g);  // g + k1 g^3
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_mul_ps(m2k0, inner))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        const float g = gate[i];
        out[i] = 0.5f * g * (1.0f + tanhf(k0 * (g + k1 * g * g * g))) * up[i];
    }
}

// cap * tanh(x / cap) over n values, -inf (a masked slot) kept: Gemma 2's soft-capping.
static void soft_cap(float *x, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != -INFINITY) x[i] = cap * tanhf(x[i] / cap);
}

// p[t] = e^(p[t] - top) over n scores, 0 where p[t] is -inf (a masked slot); returns their sum.
static float exp_shifted(float *p, int64_t n, float top) {
    const __m256 t8 = _mm256_set1_ps(top), ninf = _mm256_set1_ps(-INFINITY);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 x = _mm256_loadu_ps(p + t);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, t8)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
        _mm256_storeu_ps(p + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    for (; t < n; t++) {
        p[t] = p[t] == -INFINITY ? 0.0f : expf(p[t] - top);
        sum += p[t];
    }
    return sum;
}

// Attention of one (row, KV head, slot chunk) for the `rep` query heads that share the KV head: each key and
// value is read from memory once for all of them (the cache is the largest stream of a long-context step).
// Unnormalized partials, merged across chunks by the caller: top[j] = max score, total[j] = sum of
// e^(score - top), out[j] = sum of e^(score - top) * v. `p` has room for rep * (t1 - t0) scores.
static void attend_chunk(const float *q, const float *kc, const float *vc, const uint8_t *ok, int64_t t0, int64_t t1,
                         int64_t hd, int64_t rep, float scale, float cap, float *p, float *top, float *total,
                         float *out) {
    const int64_t n = t1 - t0;
    // Scores (the maxima in a second, branch-free pass): 8 slots at a time where the head's width allows;
    // a slot that is not valid gets -inf whatever its (possibly stale) key gave.
    int64_t t = t0;
    if (hd % VW == 0) {
        const __m256 s8 = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= t1; t += 8) {
            const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ok + t))), _mm256_setzero_si256()));
            for (int64_t j = 0; j < rep; j++) {
                const __m256 d = _mm256_mul_ps(dot8(q + j * hd, kc + t * hd, hd), s8);
                _mm256_storeu_ps(p + j * n + t - t0, _mm256_blendv_ps(ninf, d, live));
            }
        }
    }
    for (; t < t1; t++) {
        const float *kt = kc + t * hd;
        for (int64_t j = 0; j < rep; j++) p[j * n + t - t0] = ok[t] ? dot(q + j * hd, kt, hd) * scale : -INFINITY;
    }
    if (cap > 0.0f) soft_cap(p, rep * n, cap);
    for (int64_t j = 0; j < rep; j++) {
        float *pj = p + j * n;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(pj + i));
        float lanes[8], best = -INFINITY;
        _mm256_storeu_ps(lanes, m8);
        for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
        for (; i < n; i++) best = pj[i] > best ? pj[i] : best;
        top[j] = best;
        total[j] = 0.0f;
        if (best == -INFINITY) {  // every slot of the chunk is padding
            for (i = 0; i < n; i++) pj[i] = 0.0f;
            continue;
        }
        total[j] = exp_shifted(pj, n, best);
    }
    // out[j] = sum_t p[j, t] v_t, four slots per pass over out (a quarter of its loads and stores) where all
    // four are valid; a slot that is not is skipped, never multiplied by 0 (its V may be stale or NaN).
    for (int64_t j = 0; j < rep * hd; j++) out[j] = 0.0f;
    for (t = t0; t + 4 <= t1; t += 4) {
        if (!(ok[t] && ok[t + 1] && ok[t + 2] && ok[t + 3])) {
            for (int64_t u = t; u < t + 4; u++) {
                if (!ok[u]) continue;
                const float *vt = vc + u * hd;
                for (int64_t j = 0; j < rep; j++) {
                    const float w = p[j * n + u - t0];
                    for (int64_t i = 0; i < hd; i++) out[j * hd + i] += w * vt[i];
                }
            }
            continue;
        }
        const float *v0 = vc + t * hd, *v1 = v0 + hd, *v2 = v1 + hd, *v3 = v2 + hd;
        for (int64_t j = 0; j < rep; j++) {
            const float *pj = p + j * n + t - t0;
            const vf w0 = vset1(pj[0]), w1 = vset1(pj[1]), w2 = vset1(pj[2]), w3 = vset1(pj[3]);
            float *o = out + j * hd;
            int64_t i = 0;
            for (; i + VW <= hd; i += VW) {
                vf acc = vfma(w0, vld(v0 + i), vld(o + i));
                acc = vfma(w1, vld(v1 + i), acc);
                acc = vfma(w2, vld(v2 + i), acc);
                vst(o + i, vfma(w3, vld(v3 + i), acc));
            }
            for (; i < hd; i++) o[i] += pj[0] * v0[i] + pj[1] * v1[i] + pj[2] * v2[i] + pj[3] * v3[i];
        }
    }
    for (; t < t1; t++) {
        if (!ok[t]) continue;
        const float *vt = vc + t * hd;
        for (int64_t j = 0; j < rep; j++) {
            const vf w = vset1(p[j * n + t - t0]);
            float *o = out + j * hd;
            int64_t i = 0;
            for (; i + VW <= hd; i += VW) vst(o + i, vfma(w, vld(vt + i), vld(o + i)));
            for (; i < hd; i++) o[i] += p[j * n + t - t0] * vt[i];
        }
    }
}

// attend_chunk over n slots of layer L's cache starting at element `at` (validity `ok`, per slot): straight
// from an fp32 cache, or through this thread's fp32 copy `wide` (2 span hd floats) of a 16-bit one.
static void attend_piece(const DecodeModel *m, const Layer *L, const float *q, int64_t at, const uint8_t *ok,
                         int64_t n, int64_t hd, int64_t rep, float scale, float *scores, float *wide, int64_t span,
                         float *part) {
    if (wide) {  // widen the slots (hd % 8 == 0), then attend over the copy
        const int f16 = m->kv_format == KV_F16;
        widen_half((const uint16_t *)L->k_cache + at, wide, n * hd, f16);
        widen_half((const uint16_t *)L->v_cache + at, wide + span * hd, n * hd, f16);
        attend_chunk(q, wide, wide + span * hd, ok, 0, n, hd, rep, scale, m->attn_softcap, scores, part, part + rep,
                     part + 2 * rep);
    } else {
        attend_chunk(q, (const float *)L->k_cache + at, (const float *)L->v_cache + at, ok, 0, n, hd, rep, scale,
                     m->attn_softcap, scores, part, part + rep, part + 2 * rep);
    }
}

// Two pieces' unnormalized partials (top, total, out as attend_chunk leaves them) into the first, rescaled to
// their common max: what the caller's merge across chunks does, for a ring's piece after its wrap.
static void merge_partials(float *part, const float *extra, int64_t rep, int64_t hd) {
    for (int64_t j = 0; j < rep; j++) {
        const float t1 = part[j], t2 = extra[j];
        if (t2 == -INFINITY) continue;
        const float top = t1 > t2 ? t1 : t2;
        const float w1 = t1 == -INFINITY ? 0.0f : expf(t1 - top), w2 = expf(t2 - top);
        part[j] = top;
        part[rep + j] = w1 * part[rep + j] + w2 * extra[rep + j];
        float *o = part + 2 * rep + j * hd;
        const float *e = extra + 2 * rep + j * hd;
        for (int64_t i = 0; i < hd; i++) o[i] = w1 * o[i] + w2 * e[i];
    }
}

// ---------------------------------------------------------------------------------------------------------
// Prefill attention by blocks. attend_chunk serves one input at a time: every input of a prompt chunk widens
// its keys and values by itself and scores them as dot products, so a 128-token Gemma 3 prefill spent 18 of
// its 144 ms there (fp16 cache) and a 512-token one 195 of 652 (the work grows with the square of the length).
// A block of ATT_QB consecutive inputs of one row (a prompt chunk's, at consecutive slots) shares the slots of
// a KV head instead: each step widens ATT_KB slots once for the whole block, scores them against all of its
// query heads in register tiles (rows_tile), and adds them into the outputs under an online softmax (a
// running maximum and sum per query head, as flash attention keeps them).
#define ATT_QB 16       // inputs per block
#define ATT_MIN_RUN 16  // runs this long go in blocks; shorter ones (decode rows, a speculative check's few inputs)
                        // keep attend_chunk, so a decode step's arithmetic does not depend on its neighbours
#define ATT_KB 64       // slots per step
#if VW == 16
#define PV_VECS 4  // 16 accumulators, 4 value vectors and a broadcast of AVX-512's 32 registers
#else
#define PV_VECS 2  // 8 accumulators, 2 value vectors and a broadcast of AVX2's 16
#endif

// A thread's buffers for attend_block (floats): the block's queries and outputs [QB rep, hd], its scores
// [QB rep, ATT_KB], running maxima and sums [QB rep], a step's keys and values [ATT_KB, hd], a spare row.
typedef struct {
    float *q, *o, *s, *top, *sum, *k, *v, *spare;
} BlockScratch;

static int64_t block_scratch_floats(int64_t rep, int64_t hd) {
    const int64_t R = ATT_QB * rep;
    return 2 * R * hd + R * ATT_KB + 2 * R + 2 * ATT_KB * hd + hd;
}

static BlockScratch block_scratch(float *f, int64_t rep, int64_t hd) {
    const int64_t R = ATT_QB * rep;
    BlockScratch b;
    b.q = f, b.o = b.q + R * hd, b.s = b.o + R * hd, b.top = b.s + R * ATT_KB, b.sum = b.top + R;
    b.k = b.sum + R, b.v = b.k + ATT_KB * hd, b.spare = b.v + ATT_KB * hd;
    return b;
}

// o_j += sum_{t < n} p_j[t] v_t for four rows j (hd floats each; p_j and o_j at pj[j], oj[j]): PV_VECS vectors
// of columns at a time stay in registers over all n slots.
static void add_weighted_values(const float *const pj[4], const float *v, int64_t n, int64_t hd, float *const oj[4]) {
    int64_t d = 0;
    for (; d + PV_VECS * VW <= hd; d += PV_VECS * VW) {
        vf acc[4][PV_VECS];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
            for (int u = 0; u < PV_VECS; u++) acc[j][u] = vld(oj[j] + d + u * VW);
        for (int64_t t = 0; t < n; t++) {
            vf vt[PV_VECS];
#pragma GCC unroll 4
            for (int u = 0; u < PV_VECS; u++) vt[u] = vld(v + t * hd + d + u * VW);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const vf p = vset1(pj[j][t]);
#pragma GCC unroll 4
                for (int u = 0; u < PV_VECS; u++) acc[j][u] = vfma(p, vt[u], acc[j][u]);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
            for (int u = 0; u < PV_VECS; u++) vst(oj[j] + d + u * VW, acc[j][u]);
    }
    for (; d + VW <= hd; d += VW) {
        vf acc[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[j] = vld(oj[j] + d);
        for (int64_t t = 0; t < n; t++) {
            const vf vt = vld(v + t * hd + d);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[j] = vfma(vset1(pj[j][t]), vt, acc[j]);
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) vst(oj[j] + d, acc[j]);
    }
    for (; d < hd; d++)
        for (int j = 0; j < 4; j++)
            for (int64_t t = 0; t < n; t++) oj[j][d] += pj[j][t] * v[t * hd + d];
}

// n slots of layer L's cache from element `at` into fp32 k and v ([n, hd]); a slot that is not valid (its
// contents may be stale, or NaN) is zeroed, so a weight of 0 on it adds 0.
static void load_slots(const DecodeModel *m, const Layer *L, int64_t at, const uint8_t *ok, int64_t n, int64_t hd,
                       float *k, float *v) {
    if (m->kv_format == KV_F32) {
        memcpy(k, (const float *)L->k_cache + at, (size_t)(n * hd) * sizeof(float));
        memcpy(v, (const float *)L->v_cache + at, (size_t)(n * hd) * sizeof(float));
    } else {
        const int f16 = m->kv_format == KV_F16;
        widen_half((const uint16_t *)L->k_cache + at, k, n * hd, f16);
        widen_half((const uint16_t *)L->v_cache + at, v, n * hd, f16);
    }
    for (int64_t t = 0; t < n; t++)
        if (!ok[t]) {
            memset(k + t * hd, 0, (size_t)hd * sizeof(float));
            memset(v + t * hd, 0, (size_t)hd * sizeof(float));
        }
}

// One score row of a step (input at slot s, its slots a..b-1 of the step's t0..): scaled and capped, -inf
// where a slot is not valid; then the online softmax: the running maximum `top` and sum, the row's output
// rescaled when the maximum grows, and the scores turned into the weights e^(score - top). Returns 0 when
// no slot of the row is valid in this step (nothing to add).
static int softmax_step(float *sj, const uint8_t *ok, int64_t n, float scale, float cap, float *top, float *sum,
                        float *o, int64_t hd) {
    float best = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        float x = sj[t] * scale;
        if (cap > 0.0f) x = cap * tanhf(x / cap);
        sj[t] = ok[t] ? x : -INFINITY;
        best = sj[t] > best ? sj[t] : best;
    }
    if (best == -INFINITY) return 0;
    if (best > *top) {
        if (*top != -INFINITY) {
            const float c = expf(*top - best);
            *sum *= c;
            for (int64_t i = 0; i < hd; i++) o[i] *= c;
        }
        *top = best;
    }
    *sum += exp_shifted(sj, n, *top);
    return 1;
}

// Inputs r0..r0+nq-1 of cache row `row`, at slots s0..s0+nq-1, KV head g: the outputs of their query heads
// (rep each) into att [.., H hd], normalized. An input at slot s attends to the valid slots up to s (and past
// s - window on a sliding layer), as attend_chunk's callers give it; the block's steps cover the union.
static void attend_block(const DecodeModel *m, const Layer *L, const float *qkv, int64_t qkv_w, int64_t r0,
                         int64_t nq, int64_t s0, int64_t row, int64_t g, float scale, float *att, BlockScratch *b) {
    const int64_t H = m->n_heads, KV = m->n_kv_heads, hd = m->head_dim, rep = H / KV, R = nq * rep;
    const int64_t W = L->window, end = s0 + nq;
    const uint8_t *ok = m->valid + row * m->max_tokens;
    const int64_t base = (row * KV + g) * L->rows * hd;
    for (int64_t i = 0; i < nq; i++)
        memcpy(b->q + i * rep * hd, qkv + (r0 + i) * qkv_w + g * rep * hd, (size_t)(rep * hd) * sizeof(float));
    memset(b->o, 0, (size_t)(R * hd) * sizeof(float));
    for (int64_t j = 0; j < R; j++) b->top[j] = -INFINITY, b->sum[j] = 0.0f;
    int64_t t0 = W > 0 && s0 + 1 - W > 0 ? s0 + 1 - W : 0;
    while (t0 < end) {
        // a step's slots lie at ring rows t0 % rows..: cut where the ring wraps
        const int64_t at = t0 % L->rows;
        int64_t n = end - t0 < ATT_KB ? end - t0 : ATT_KB;
        if (n > L->rows - at) n = L->rows - at;
        load_slots(m, L, base + at * hd, ok + t0, n, hd, b->k, b->v);
        for (int64_t c = 0; c < n; c += NR) {  // scores [R, n]: the keys as a tile's weight rows
            const int nr = n - c < NR ? (int)(n - c) : NR;
            const float *kr[NR];
            for (int r = 0; r < NR; r++) kr[r] = b->k + (c + (r < nr ? r : 0)) * hd;
            rows_tile(kr, b->q, hd, R, hd, b->s + c, ATT_KB, 1, nr, NULL, 0, NULL, 0);
        }
        for (int64_t i = 0; i < nq; i++) {
            // input i's slots in this step: from t0 (or its window's first) to its own slot
            const int64_t s = s0 + i, first = W > 0 && s + 1 - W > t0 ? s + 1 - W : t0;
            const int64_t last = s + 1 < t0 + n ? s + 1 : t0 + n;
            if (first >= last) continue;
            const float *pj[4];
            float *oj[4];
            int live = 0;
            for (int64_t j = 0; j < rep; j++) {
                const int64_t x = i * rep + j;
                float *sj = b->s + x * ATT_KB + (first - t0);
                if (softmax_step(sj, ok + first, last - first, scale, m->attn_softcap, b->top + x, b->sum + x,
                                 b->o + x * hd, hd)) {
                    pj[live] = sj, oj[live] = b->o + x * hd, live++;
                }
                if (live == 4 || (j == rep - 1 && live > 0)) {
                    for (int u = live; u < 4; u++) pj[u] = pj[0], oj[u] = b->spare;  // padding rows, unread
                    add_weighted_values(pj, b->v + (first - t0) * hd, last - first, hd, oj);
                    live = 0;
                }
            }
        }
        t0 += n;
    }
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < rep; j++) {
            const int64_t x = i * rep + j;
                        float *out = att + (r0 + i) * H * hd + (g * rep + j) * hd;
            for (int64_t d = 0; d < hd; d++) out[d] = b->o[x * hd + d] / b->sum[x];
        }
}

// One token's K and V of one KV head (hd floats each) into layer L's cache at element `at`, in the cache's
// format (fp16 and bf16 rounded to nearest even, as torch casts, so both paths store the same bits).
static void store_kv(const DecodeModel *m, const Layer *L, int64_t at, const float *k, const float *v, int64_t hd) {
    if (m->kv_format == KV_F32) {
        memcpy((float *)L->k_cache + at, k, hd * sizeof(float));
        memcpy((float *)L->v_cache + at, v, hd * sizeof(float));
        return;
    }
    uint16_t *kc = (uint16_t *)L->k_cache + at, *vc = (uint16_t *)L->v_cache + at;
    int64_t i = 0;
    if (m->kv_format == KV_F16)  // 8 at a time, the same rounding as the scalar conversion below
        for (; i + 8 <= hd; i += 8) {
            _mm_storeu_si128((__m128i *)(kc + i), _mm256_cvtps_ph(_mm256_loadu_ps(k + i), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(vc + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
        }
    for (; i < hd; i++) {
        if (m->kv_format == KV_F16) {
            kc[i] = _cvtss_sh(k[i], _MM_FROUND_TO_NEAREST_INT);
            vc[i] = _cvtss_sh(v[i], _MM_FROUND_TO_NEAREST_INT);
        } else {
            kc[i] = to_bf16(k[i]);
            vc[i] = to_bf16(v[i]);
        }
    }
}

// Input r is cache row rows[r]: its K/V go to slot slots[r] and it attends over that row's valid slots
// 0..slots[r]. Rows may sit at different lengths (a scheduler's slots), or all at one slot (a static batch).
// A prompt chunk is inputs of one row at consecutive slots: every input's K/V is stored before any input
// attends, so each sees the chunk's earlier tokens (causal attention within the chunk) and this one call
// prefills; decode rows and prompt chunks may share it. Logits are computed for the n_out inputs outs[]
// into logits [n_out, vocab] (none when n_out is 0: a chunk before a prompt's last needs none, its last chunk
// only its last token's), or for all M inputs when n_out is -1.
// work: floats for h, xn [M, dim], qkv [M, (H + 2 KV) hd], att [M, H hd], gu [M, 2 hidden], act [M, hidden]
//
// The per-input loops (norms, RoPE, K/V stores, SwiGLU, residuals) run in parallel from MANY_INPUTS inputs;
// below that (decode) a fork would cost more than the loop.
#define MANY_INPUTS 16

// h [M, dim] = the inputs' rows of the embedding table. A GGUF table's rows are dequantized one by one on
// this thread (one row is below gguf_dequantize_rows' parallel threshold: no region that parks the other thread).
static void embed_rows(const DecodeModel *m, const int64_t *tokens, int64_t M, float *h) {
    const int64_t D = m->dim;
    int64_t shape[2] = {1, 4};
    if (m->embed_type && !gguf_block_shape(m->embed_type, shape)) shape[0] = 0;  // Python refuses these first
    const int64_t row_bytes = shape[0] ? D / shape[0] * shape[1] : 0;
    for (int64_t r = 0; r < M; r++) {
        if (!m->embed_type)
            memcpy(h + r * D, (const float *)m->embed + tokens[r] * D, D * sizeof(float));
        else if (!row_bytes || gguf_dequantize_rows(m->embed_type, (const uint8_t *)m->embed + tokens[r] * row_bytes,
                                                    h + r * D, 1, D))
            for (int64_t i = 0; i < D; i++) h[r * D + i] = NAN;
    }
}

void forward_pass(const DecodeModel *m, const int64_t *tokens, const int64_t *positions, const int64_t *rows,
                  const int64_t *slots, int64_t M, float *work, float *logits, const int64_t *outs, int64_t n_out) {
    const int64_t D = m->dim, H = m->n_heads, KV = m->n_kv_heads, hd = m->head_dim, half = hd / 2;
    const int64_t I = m->hidden, qkv_w = (H + 2 * KV) * hd, rep = H / KV, T = m->max_tokens;
    float *h = work, *xn = h + M * D, *qkv = xn + M * D, *att = qkv + M * qkv_w, *gu = att + M * H * hd,
          *act = gu + M * 2 * I;
    const float scale = m->attn_scale > 0.0f ? m->attn_scale : 1.0f / sqrtf((float)hd);
    const int many = M >= MANY_INPUTS;
    KERNEL_CALL;
    step_clock(m, 0);
    embed_rows(m, tokens, M, h);
    if (m->embed_scale != 1.0f)
        for (int64_t i = 0; i < M * D; i++) h[i] *= m->embed_scale;
    // Runs of at least ATT_MIN_RUN inputs of one row at consecutive slots (prompt chunks) attend in blocks of
    // at most ATT_QB (attend_block; block k is inputs blocks[2k] .. + blocks[2k + 1]); the others one by one.
    int64_t *blocks = (int64_t *)malloc((size_t)(3 * M) * sizeof(int64_t)), *single = blocks + 2 * M;
    int64_t n_blocks = 0, n_single = 0;
    for (int64_t r = 0; r < M;) {
        int64_t e = r + 1;
        while (e < M && rows[e] == rows[r] && slots[e] == slots[e - 1] + 1) e++;
        if (e - r >= ATT_MIN_RUN) {
            const int64_t nb = (e - r + ATT_QB - 1) / ATT_QB;  // blocks of equal size (within one)
            for (int64_t k = 0; k < nb; k++, n_blocks++) {
                blocks[2 * n_blocks] = r + (e - r) * k / nb;
                blocks[2 * n_blocks + 1] = r + (e - r) * (k + 1) / nb - blocks[2 * n_blocks];
            }
        } else {
            for (int64_t i = r; i < e; i++) single[n_single++] = i;
        }
        r = e;
    }
    // Single inputs' work items: (input, KV head, chunk of slots); enough chunks that both threads have work
    // even at batch 1 (3 KV heads), not so many that the merge costs more than it spreads.
    // Chunks are sized for the longest row; a shorter row's surplus chunks are empty.
    int64_t longest = 0;
    for (int64_t x = 0; x < n_single; x++) longest = slots[single[x]] + 1 > longest ? slots[single[x]] + 1 : longest;
    const int64_t want = 8, per_row_group = n_single * KV;
    int64_t chunks = per_row_group >= want || !per_row_group ? 1 : (want + per_row_group - 1) / per_row_group;
    if (chunks > (longest + 31) / 32) chunks = (longest + 31) / 32;  // at least 32 slots per chunk
    if (chunks < 1) chunks = 1;  // no single inputs
    const int64_t span = (longest + chunks - 1) / chunks, items = n_single * KV * chunks;
    float *parts = (float *)malloc((size_t)(items ? items : 1) * rep * (hd + 2) * sizeof(float));

    for (int64_t l = 0; l < m->n_layers; l++) {
        const Layer *L = m->layers + l;
        rms_norm(h, L->attn_norm, xn, M, D, m->eps);
        linear(&L->wqkv, xn, qkv, M);
#pragma omp parallel for schedule(static) num_threads(team()) if (many)
        for (int64_t r = 0; r < M; r++) {
            float *q = qkv + r * qkv_w, *k = q + H * hd, *v = k + KV * hd;
            if (L->qkv_bias)
                for (int64_t i = 0; i < qkv_w; i++) q[i] += L->qkv_bias[i];
            if (L->q_norm) {
                for (int64_t j = 0; j < H; j += 8)  // each head a row, in place (Qwen3's and Gemma 3's q/k norms)
                    norm_rows(q + j * hd, L->q_norm, q + j * hd, H - j < 8 ? H - j : 8, hd, m->eps);
                for (int64_t g = 0; g < KV; g += 8)
                    norm_rows(k + g * hd, L->k_norm, k + g * hd, KV - g < 8 ? KV - g : 8, hd, m->eps);
            }
            const float *c = L->rope_cos + positions[r] * half, *s = L->rope_sin + positions[r] * half;
            for (int64_t j = 0; j < H + KV; j++) rope(q + j * hd, c, s, half);  // q heads, then k heads
            for (int64_t g = 0; g < KV; g++) {
                const int64_t at = ((rows[r] * KV + g) * L->rows + slots[r] % L->rows) * hd;
                store_kv(m, L, at, k + g * hd, v + g * hd, hd);
            }
        }
        const int nt = team();
        const int64_t start = now_ns();
        int64_t first_done = start;
#pragma omp parallel num_threads(nt)
        {
            float *scores = (float *)malloc((size_t)rep * span * sizeof(float));  // this thread's
            // a 16-bit cache: this thread's fp32 copies of an item's keys and values
            float *wide = m->kv_format == KV_F32 ? NULL : (float *)malloc((size_t)2 * span * hd * sizeof(float));
            // a ring's second piece (its slots wrap past the last row): this thread's partials of it
            float *extra = L->rows < T ? (float *)malloc((size_t)rep * (hd + 2) * sizeof(float)) : NULL;
            float *block_floats = n_blocks ? (float *)malloc((size_t)block_scratch_floats(rep, hd) * sizeof(float))
                                           : NULL;
            BlockScratch bs = block_scratch(block_floats, rep, hd);
            // One item at a time to whichever thread is free: a prompt chunk's later inputs attend over more
            // slots than its first ones (so its blocks go last first), and a descheduled thread leaves its
            // share to the others.
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t item = 0; item < n_blocks * KV; item++) {
                const int64_t k = n_blocks - 1 - item / KV, g = item % KV, r0 = blocks[2 * k];
                attend_block(m, L, qkv, qkv_w, r0, blocks[2 * k + 1], slots[r0], rows[r0], g, scale, att, &bs);
            }
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t item = 0; item < items; item++) {
                const int64_t rg = item / chunks, c = item % chunks, r = single[rg / KV], g = rg % KV;
                int64_t t0 = c * span, t1 = t0 + span < slots[r] + 1 ? t0 + span : slots[r] + 1;
                if (L->window > 0 && t0 < slots[r] + 1 - L->window) t0 = slots[r] + 1 - L->window;  // slides
                t1 = t1 > t0 ? t1 : t0;
                const int64_t base = (rows[r] * KV + g) * L->rows * hd;
                float *part = parts + item * rep * (hd + 2);
                const float *q = qkv + r * qkv_w + g * rep * hd;
                const uint8_t *ok = m->valid + rows[r] * T;
                // Slots t0..t1 sit at rows t0 % rows.. of the layer: one piece, or two where a ring wraps (a
                // sliding layer reads at most `window` < rows slots, so never more).
                const int64_t at = t0 % L->rows, first = at + (t1 - t0) <= L->rows ? t1 - t0 : L->rows - at;
                attend_piece(m, L, q, base + at * hd, ok + t0, first, hd, rep, scale, scores, wide, span, part);
                if (first < t1 - t0) {
                    attend_piece(m, L, q, base, ok + t0 + first, t1 - t0 - first, hd, rep, scale, scores, wide, span,
                                 extra);
                    merge_partials(part, extra, rep, hd);
                }
            }
            free(scores);
            free(wide);
            free(extra);
            free(block_floats);
            if (omp_get_thread_num() == 0) first_done = now_ns();
        }
        region_done(start, first_done);
#pragma omp parallel for schedule(static) num_threads(team()) if (n_single >= MANY_INPUTS)
        for (int64_t x = 0; x < n_single; x++)  // merge the chunks: rescale each to the common max
            for (int64_t hq = 0; hq < H; hq++) {
                const int64_t g = hq / rep, j = hq % rep;
                float top = -INFINITY, den = 0.0f, *out = att + single[x] * H * hd + hq * hd;
                for (int64_t c = 0; c < chunks; c++) {
                    const float t = parts[((x * KV + g) * chunks + c) * rep * (hd + 2) + j];
                    if (t > top) top = t;
                }
                for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
                for (int64_t c = 0; c < chunks; c++) {
                    const float *part = parts + ((x * KV + g) * chunks + c) * rep * (hd + 2);
                    if (part[j] == -INFINITY) continue;
                    const float w = expf(part[j] - top);
                    den += w * part[rep + j];
                    for (int64_t i = 0; i < hd; i++) out[i] += w * part[2 * rep + j * hd + i];
                }
                for (int64_t i = 0; i < hd; i++) out[i] /= den;
            }
        linear(&L->wo, att, xn, M);
        if (L->post_attn_norm) rms_norm(xn, L->post_attn_norm, xn, M, D, m->eps);  // in place: row by row
        add_rows(h, xn, M * D, many);
        step_clock(m, 1 + 2 * l);
        rms_norm(h, L->ffn_norm, xn, M, D, m->eps);
        linear(&L->w13, xn, gu, M);
#pragma omp parallel for schedule(static) num_threads(team()) if (many)
        for (int64_t r = 0; r < M; r++) {
            if (m->gelu)
                geglu(gu + r * 2 * I, gu + r * 2 * I + I, act + r * I, I);
            else
                swiglu(gu + r * 2 * I, gu + r * 2 * I + I, act + r * I, I);
        }
        linear(&L->w2, act, xn, M);
        if (L->post_ffn_norm) rms_norm(xn, L->post_ffn_norm, xn, M, D, m->eps);
        add_rows(h, xn, M * D, many);
        step_clock(m, 2 + 2 * l);
    }
    free(parts);
    free(blocks);
    if (n_out >= 0) {  // the head's rows only: gather them (h is free now)
        for (int64_t i = 0; i < n_out; i++) memcpy(xn + i * D, h + outs[i] * D, D * sizeof(float));
        if (n_out) {
            rms_norm(xn, m->norm, h, n_out, D, m->eps);
            linear(&m->head, h, logits, n_out);
        }
    } else {
        rms_norm(h, m->norm, xn, M, D, m->eps);
        linear(&m->head, xn, logits, M);
    }
    if (m->final_softcap > 0.0f) soft_cap(logits, (n_out >= 0 ? n_out : M) * m->vocab, m->final_softcap);
    step_clock(m, 2 * m->n_layers + 1);
}

// ---------------------------------------------------------------------------------------------------------
// Per-row symmetric int8 quantization at load, the same arithmetic as `_quantize_int8` in weight_formats.py
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

// Group-wise asymmetric int4 at load, the arithmetic of `_quantize_int4` in weight_formats.py: per group of G
// columns zero = fp16(min), scale = fp16((max - zero) / 15) (1 where that is not > 0), code = clamp(
// round-half-even((w - zero) / scale), 0, 15), two codes per byte (even k in the low nibble). Returns the
// number of groups holding NaN, infinity or values beyond fp16's range: the caller then uses the torch
// version, which decides what those mean (an error, for out-of-range values).
int64_t quantize_int4_groups(const float *w, uint8_t *packed, uint16_t *scale, uint16_t *zero, int64_t N, int64_t K,
                             int64_t G) {
    int64_t bad = 0;
    const int64_t groups = K / G;
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *src = w + n * K + g * G;
            float lo = src[0], hi = src[0], poison = 0.0f;
            int64_t i = 0;
            if (G % 8 == 0) {
                __m256 lo8 = _mm256_loadu_ps(src), hi8 = lo8, p8 = _mm256_setzero_ps();
                for (; i < G; i += 8) {
                    const __m256 v = _mm256_loadu_ps(src + i);
                    lo8 = _mm256_min_ps(lo8, v);
                    hi8 = _mm256_max_ps(hi8, v);
                    p8 = _mm256_add_ps(p8, _mm256_mul_ps(v, _mm256_setzero_ps()));
                }
                float l[8], h[8];
                _mm256_storeu_ps(l, lo8);
                _mm256_storeu_ps(h, hi8);
                for (int j = 0; j < 8; j++) lo = fminf(lo, l[j]), hi = fmaxf(hi, h[j]);
                poison = hsum(p8);
            }
            for (; i < G; i++) {
                lo = fminf(lo, src[i]);
                hi = fmaxf(hi, src[i]);
                poison += src[i] * 0.0f;  // NaN for NaN and infinity
            }
            if (poison != 0.0f || poison != poison || fabsf(lo) > 65504.0f || fabsf(hi) > 65504.0f) {
                bad++;
                continue;
            }
            const uint16_t z16 = _cvtss_sh(lo, _MM_FROUND_TO_NEAREST_INT);
            const float z = _cvtsh_ss(z16);
            uint16_t s16 = _cvtss_sh((hi - z) / 15.0f, _MM_FROUND_TO_NEAREST_INT);
            float s = _cvtsh_ss(s16);
            if (!(s > 0.0f)) s16 = 0x3C00, s = 1.0f;  // fp16 1.0
            scale[n * groups + g] = s16;
            zero[n * groups + g] = z16;
            uint8_t *out = packed + (n * K + g * G) / 2;
            int64_t k = 0;
            if (G % 8 == 0) {  // 8 codes at a time: the division and rounding dominate, vectorize them
                const __m256 z8 = _mm256_set1_ps(z), s8 = _mm256_set1_ps(s), top = _mm256_set1_ps(15.0f);
                int32_t c[8];
                for (; k < G; k += 8) {
                    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(src + k), z8), s8),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), top);
                    _mm256_storeu_si256((__m256i *)c, _mm256_cvtps_epi32(v));
                    for (int i = 0; i < 8; i += 2) out[(k + i) / 2] = (uint8_t)(c[i] | (c[i + 1] << 4));
                }
            }
            for (; k < G; k += 2) {  // groups of 2, 4 or 6 columns
                float a = nearbyintf((src[k] - z) / s), b = nearbyintf((src[k + 1] - z) / s);
                a = a < 0.0f ? 0.0f : (a > 15.0f ? 15.0f : a);
                b = b < 0.0f ? 0.0f : (b > 15.0f ? 15.0f : b);
                out[k / 2] = (uint8_t)a | (uint8_t)((uint8_t)b << 4);
            }
        }
    }
    return bad;
}

/* Constrained decoding (llm/sampling/token_mask.py): the logits of tokens a grammar forbids become -inf, read from
   llguidance's bitmask (bit t % 32 of word t / 32 set: token t allowed). One pass over V floats, no
   allocation: a torch unpack of the bits cost ~1 ms a token on this project's CPUs. Returns the tokens allowed. */
int64_t apply_token_bitmask(float *logits, const uint32_t *bits, int64_t V) {
    int64_t allowed = 0;
    const float ninf = -INFINITY;
    for (int64_t w = 0; w * 32 < V; w++) {
        const uint32_t b = bits[w];
        float *row = logits + w * 32;
        const int n = (int)(V - w * 32 < 32 ? V - w * 32 : 32);
        if (b == 0xFFFFFFFFu && n == 32) {
            allowed += 32;
            continue;
        }
        for (int i = 0; i < n; i++) {
            if ((b >> i) & 1u) allowed++;
            else row[i] = ninf;
        }
    }
    return allowed;
}

static float greedy_logprob(const float *x, int64_t V, float top) {
    double total = 0.0;
    for (int64_t b = 0; b < V; b += 1024) {
        const int64_t end = b + 1024 < V ? b + 1024 : V;
        int64_t t = b;
        const __m256 shift = _mm256_set1_ps(top);
        __m256 s0 = _mm256_setzero_ps(), s1 = s0;
        for (; t + 16 <= end; t += 16) {
            s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), shift)));
            s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t + 8), shift)));
        }
        double part = hsum(_mm256_add_ps(s0, s1));
        for (; t < end; t++) part += expf(x[t] - top);
        total += part;
    }
    return (float)-log(total);
}

/* Greedy picking (the bench's picker, the engine's greedy rows without samplers): the first maximum of a row
   of V fp32 logits and its log-softmax, -log sum_v exp(x_v - max) (greedy_logprob: exp8, fp32 lanes over
   blocks of 1024 logits, the blocks added in double). torch's max(0) and logsumexp took 0.2-0.37 ms a row at
   Gemma 3's 262144 logits (3-6 ms of a 16-row decode step); this, 0.12-0.15 ms. Returns the token, or -1 where
   the row holds a NaN or an infinity (the caller's own path decides what that means). */
int64_t greedy_pick(const float *x, int64_t V, float *logprob) {
    if (V <= 0) return -1;
    __m256 best = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
        const __m256 a = _mm256_loadu_ps(x + v);
        best = _mm256_max_ps(best, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(a, a), _mm256_setzero_ps(), _CMP_NEQ_UQ));  // NaN, inf
    }
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, best);
    for (int i = 0; i < 8; i++) top = fmaxf(top, lanes[i]);
    int finite = _mm256_movemask_ps(bad) == 0;
    for (int64_t t = v; t < V; t++) {
        finite &= isfinite(x[t]) != 0;
        top = fmaxf(top, x[t]);
    }
    if (!finite) return -1;
    int64_t token = -1, t = 0;  // the first maximum, as argmax and max(0) give it
    const __m256 want = _mm256_set1_ps(top);
    for (; token < 0 && t + 8 <= V; t += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + t), want, _CMP_EQ_OQ));
        if (hit) token = t + __builtin_ctz((unsigned)hit);
    }
    for (; token < 0; t++)
        if (x[t] == top) token = t;
    *logprob = greedy_logprob(x, V, top);
    return token;
}
