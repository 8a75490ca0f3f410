/* Q8_0 expert products for several tokens at once, as a ggml custom op (moeswap.quant.q8_0_kernel).
 *
 * dst[t][k][row] = dot(W[ids[t][k]] row, x[t][k % x_ne11]) for Q8_0 weights W and Q8_0
 * activations x (ggml's own quantization, a ggml_cpy before this op): what ggml_mul_mat_id
 * computes, bit for bit. Each (row, token) sum is ggml_vec_dot_q8_0_q8_0's on x86: per block
 * an exact int32 dot product in eight lanes, times d_w * d_x (one float product), fused into the
 * lanes' accumulator in block order, then ggml's horizontal sum. What differs is the loop:
 * ggml's vec_dot reads a weight row once per token and waits on one accumulator chain; here a
 * row meets up to 4 of the expert's tokens, so each weight block is loaded (and its sign taken)
 * once for them all and their chains run side by side. One row at a time keeps a thread's reads
 * one sequential stream (tiles of 4 rows, four interleaved streams, read memory ~1.5x slower
 * here); the row PREFETCH_ROWS ahead is prefetched.
 */
#include <immintrin.h>
#include <stdint.h>

#define PREFETCH_ROWS 4
#define MAX_PICKS 4096 /* tokens x picks of one call; the graph builder keeps within it */

typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;

typedef struct {
    const char *w;             /* expert 0, row 0 */
    int64_t w_expert_stride, w_row_stride, n_rows, n_blocks;
    const char *x;             /* Q8_0 activations: row (t, j) at t * x_token_stride + j * x_pick_stride */
    int64_t x_pick_stride, x_token_stride, x_ne11;
    const int32_t *ids;        /* [T][K] expert of each pick; NULL: expert 0 (one dense matrix) */
    int64_t n_picked, n_tokens;
} q8_0_args;

struct ggml_tensor;
void * ggml_get_data(const struct ggml_tensor * tensor); /* libggml-base, loaded globally */

static inline float hsum_float_8(const __m256 x) { /* ggml's, same order */
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

/* |w| times sign(x, w), pairs summed into eight int32 lanes: exact whichever instructions */
static inline __m256 lane_sums(__m256i abs_w, __m256i signed_x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), abs_w, signed_x));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), abs_w, signed_x));
#else
    const __m256i pairs = _mm256_maddubs_epi16(abs_w, signed_x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), pairs));
#endif
}

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

#define ROW(P)                                                                                \
static void row_##P(const q8_0_args *a, const char *w, const char *const *xs, float *const *out, \
                    int64_t row) {                                                            \
    __m256 acc[P];                                                                            \
    for (int p = 0; p < P; p++) acc[p] = _mm256_setzero_ps();                                 \
    for (int64_t b = 0; b < a->n_blocks; b++) {                                               \
        const block_q8_0 *blk = (const block_q8_0 *)w + b;                                    \
        const float dw = half_to_float(blk->d);                                               \
        const __m256i qw = _mm256_loadu_si256((const __m256i *)blk->qs);                      \
        const __m256i aw = _mm256_sign_epi8(qw, qw);                                          \
        _mm_prefetch((const char *)blk + PREFETCH_ROWS * a->w_row_stride, _MM_HINT_T0);       \
        for (int p = 0; p < P; p++) {                                                         \
            const block_q8_0 *xb = (const block_q8_0 *)xs[p] + b;                             \
            const __m256i qx = _mm256_loadu_si256((const __m256i *)xb->qs);                   \
            const __m256 q = lane_sums(aw, _mm256_sign_epi8(qx, qw));                         \
            acc[p] = _mm256_fmadd_ps(_mm256_set1_ps(dw * half_to_float(xb->d)), q, acc[p]);   \
        }                                                                                     \
    }                                                                                         \
    for (int p = 0; p < P; p++) out[p][row] = hsum_float_8(acc[p]);                           \
}
ROW(1) ROW(2) ROW(3) ROW(4)

typedef void (*row_fn)(const q8_0_args *, const char *, const char *const *, float *const *,
                       int64_t);
static const row_fn ROWS[5] = {0, row_1, row_2, row_3, row_4};

/* ggml_custom_op_t: thread ith of nth takes its share of every picked expert's rows */
void moeswap_q8_0_experts(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const q8_0_args *a = userdata;
    float *const result = ggml_get_data(dst); /* F32 [T][K][n_rows] */
    const int64_t n = a->n_picked * a->n_tokens;
    int32_t expert[MAX_PICKS], pick[MAX_PICKS];
    for (int64_t i = 0; i < n; i++) { /* picks sorted by expert (insertion: n is small) */
        const int32_t e = a->ids ? a->ids[i] : 0;
        int64_t j = i;
        for (; j > 0 && expert[j - 1] > e; j--) { expert[j] = expert[j - 1]; pick[j] = pick[j - 1]; }
        expert[j] = e;
        pick[j] = (int32_t)i;
    }
    const int64_t first_row = a->n_rows * ith / nth, end_row = a->n_rows * (ith + 1) / nth;
    for (int64_t s = 0, e; s < n; s = e) {
        for (e = s; e < n && expert[e] == expert[s]; e++) {}
        const char *w = a->w + expert[s] * a->w_expert_stride;
        for (int64_t g = s; g < e; g += 4) {
            const int P = (int)(e - g < 4 ? e - g : 4);
            const char *xs[4];
            float *out[4];
            for (int p = 0; p < P; p++) {
                const int64_t i = pick[g + p], t = i / a->n_picked, k = i % a->n_picked;
                xs[p] = a->x + t * a->x_token_stride + (k % a->x_ne11) * a->x_pick_stride;
                out[p] = result + i * a->n_rows;
            }
            for (int64_t row = first_row; row < end_row; row++)
                ROWS[P](a, w + row * a->w_row_stride, xs, out, row);
        }
    }
}
