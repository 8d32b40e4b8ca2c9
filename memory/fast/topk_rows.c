/* Top-k of many short float32 rows on CPU, sorted descending (memory/fast/native_topk.py).
 *
 * Product-key search takes the top-k (k = knn, 32 by default) of rows of a
 * few hundred scores, for every token, head and key half: tens of thousands
 * of rows per layer call. torch.topk handles one row at a time with a
 * branchy selection (~2 us per 128-element row). Here L rows go through one
 * data-independent sorting network together, one row per vector lane, so
 * every compare-exchange is a few vector instructions for L rows at once:
 *   1. the row is cut into chunks of k; each chunk is bitonic-sorted;
 *   2. the best k of (best so far, next chunk) is a bitonic sequence
 *      (max of one list against the other reversed), merged in log2(k) steps.
 * Values are compared as int32 keys that order every float: NaN above +inf
 * (as torch.topk ranks NaN), and padding below -inf, so a padded slot never
 * wins over a real element.
 *
 * Ties: keys are equal exactly where torch.topk's comparison finds two
 * elements equivalent (equal floats, -0.0 and +0.0 included, or two NaNs).
 * Which of equal elements torch.topk keeps, and in which order, is the
 * order its std::nth_element and std::sort leave them in (not the lower
 * index first), so a row whose top k touches a tie is not answered here: it
 * is flagged, and the caller hands it to torch.topk. A row is flagged when
 * two of its k best keys are equal, or the best key left out (the largest
 * key any merge discards) equals the k-th; otherwise its top k is unique
 * and sorted, and so equal to torch.topk's.
 *
 * Rows are split over OpenMP threads: built with -fopenmp next to torch, the
 * kernel shares torch's OpenMP runtime (libgomp.so.1 is loaded once), so
 * its threads are torch's intra-op threads, not a second pool competing
 * for the same cores.
 *
 * Build: cc -O3 -march=native -fopenmp -shared -fPIC (GCC/Clang vector extensions).
 * Apache-2.0, memlm.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__) || defined(__ARM_NEON)
#define LANES 8
#else
#define LANES 4
#endif
#define MAX_K 128

typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef struct { vi key; vi idx; } slot_t;

/* After the call a holds the larger key of each lane, b the smaller. */
static inline void compare_exchange(slot_t *a, slot_t *b) {
    vi swap = a->key < b->key; /* all ones where the lanes must swap */
    vi ka = a->key, kb = b->key, ia = a->idx, ib = b->idx;
    a->key = (kb & swap) | (ka & ~swap);
    b->key = (ka & swap) | (kb & ~swap);
    a->idx = (ib & swap) | (ia & ~swap);
    b->idx = (ia & swap) | (ib & ~swap);
}

static void bitonic_sort_desc(slot_t *s, int k) {
    for (int size = 2; size <= k; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1)
            for (int i = 0; i < k; i++) {
                int j = i ^ stride;
                if (j > i) {
                    if ((i & size) == 0) compare_exchange(&s[i], &s[j]);
                    else compare_exchange(&s[j], &s[i]);
                }
            }
}

static void bitonic_merge_desc(slot_t *s, int k) {
    for (int stride = k >> 1; stride > 0; stride >>= 1)
        for (int i = 0; i < k; i++) {
            int j = i ^ stride;
            if (j > i) compare_exchange(&s[i], &s[j]);
        }
}

/* Order-preserving int32 key of a float: its magnitude bits, negated for a
 * negative float, so -0.0 and +0.0 share key 0 (torch.topk finds them
 * equal); every NaN maps to the top. Branch-free: it runs per element. */
static inline int32_t float_key(float v) {
    union { float f; int32_t i; } u = {v};
    int32_t magnitude = u.i & INT32_MAX, sign = u.i >> 31; /* sign: 0 or -1 */
    int32_t key = (magnitude ^ sign) - sign;
    return magnitude > 0x7F800000 ? INT32_MAX : key;
}

/* Chunk c of the L rows starting at row r0 into s (row r begins at x + offsets[r]). */
static void load_chunk(slot_t *s, const float *x, const int64_t *offsets, int64_t r0, int lanes,
                       int64_t n, int c, int k) {
    for (int t = 0; t < k; t++) {
        int64_t col = (int64_t)c * k + t;
        for (int l = 0; l < LANES; l++) {
            s[t].key[l] = (l < lanes && col < n) ? float_key(x[offsets[r0 + l] + col]) : INT32_MIN;
            s[t].idx[l] = (int32_t)col;
        }
    }
}

/* rows rows of n floats; row r starts at x + offsets[r] (unit column stride).
 * Writes the k largest of each row, descending, to values[r * k ...] and
 * their column indices to indices[r * k ...], on up to `threads` threads,
 * and tied[r] = 1 for a row whose top k touches a tie (see the top of this
 * file; its values and indices are then unspecified), else 0.
 * Needs k a power of two, 1 <= k <= MAX_K, k <= n < 2^31. Returns the
 * number of tied rows, or -1 for unsupported sizes. */
int64_t memlm_topk_rows(const float *x, const int64_t *offsets, int64_t rows, int64_t n, int k,
                        float *values, int64_t *indices, uint8_t *tied, int threads) {
    if (k < 1 || k > MAX_K || (k & (k - 1)) || n < k || n > INT32_MAX) return -1;
    int chunks = (int)((n + k - 1) / k);
    int64_t batches = (rows + LANES - 1) / LANES;
    int64_t n_tied = 0;
    (void)threads;
    /* A thread per at least 32 batches: below that, waking threads costs more. */
#pragma omp parallel for schedule(static) num_threads(threads) if (batches >= 64 && threads > 1) \
    reduction(+ : n_tied)
    for (int64_t batch = 0; batch < batches; batch++) {
        slot_t best[MAX_K], next[MAX_K];
        int64_t r0 = batch * LANES;
        int lanes = rows - r0 < LANES ? (int)(rows - r0) : LANES;
        vi left_out; /* per lane: the largest key discarded so far */
        for (int l = 0; l < LANES; l++) left_out[l] = INT32_MIN;
        load_chunk(best, x, offsets, r0, lanes, n, 0, k);
        bitonic_sort_desc(best, k);
        for (int c = 1; c < chunks; c++) {
            load_chunk(next, x, offsets, r0, lanes, n, c, k);
            bitonic_sort_desc(next, k);
            for (int t = 0; t < k; t++) { /* best k of both: a bitonic sequence */
                slot_t *a = &best[t], *b = &next[k - 1 - t];
                vi take = a->key < b->key;
                vi lost = (a->key & take) | (b->key & ~take);
                vi higher = lost > left_out;
                left_out = (lost & higher) | (left_out & ~higher);
                a->key = (b->key & take) | (a->key & ~take);
                a->idx = (b->idx & take) | (a->idx & ~take);
            }
            bitonic_merge_desc(best, k);
        }
        vi tie = left_out == best[k - 1].key;
        for (int t = 0; t + 1 < k; t++) tie |= best[t].key == best[t + 1].key;
        for (int l = 0; l < lanes; l++) {
            const float *row = x + offsets[r0 + l];
            tied[r0 + l] = tie[l] != 0;
            n_tied += tie[l] != 0;
            for (int t = 0; t < k; t++) {
                int32_t col = best[t].idx[l];
                values[(r0 + l) * k + t] = row[col]; /* the element itself: NaN stays NaN */
                indices[(r0 + l) * k + t] = col;
            }
        }
    }
    return n_tied;
}
