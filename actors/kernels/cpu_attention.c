/* mlx's CPU softmax (precise, float32), bit for bit, vectorized.
 *
 * mlx 0.32 builds its x86 CPU kernels with one lane per "SIMD" register, so
 * each exp in a softmax is a scalar polynomial whose six fused multiply-adds
 * are calls into libm: about 20 ns an element, most of a CPU attention over a
 * long chunk. The arithmetic below is the same operation for operation (the
 * same constants, the same fused multiply-adds, the same double-precision
 * rounding to the nearest integer, the same left-to-right float sum), so every
 * result is the float mlx computes; the compiler is free to run the
 * elementwise passes many lanes wide because they are exact either way. Built
 * with -ffp-contract=off so no multiply and add are fused that mlx keeps apart.
 * actors/kernels/cpu_attention.py builds and loads it and checks it against mlx first.
 *
 * The end of the file: mlx-lm's quantized attention (decode, verify and prefill
 * steps) the same way (mlx's arithmetic, summed many outputs at a time).
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* mlx::core::simd::exp<float, 1> */
static inline float exp_like_mlx(float x_init) {
    float x = x_init * 1.442695f;
    /* mlx rounds with floor(x + 0.5) in double precision (Simd<float, 1> plus
     * a double literal), where the sum is exact. The same integer in float
     * lanes: floor(x), plus one where x - floor(x) >= 0.5 (that difference is
     * exact, or rounds only where it is above 0.5 either way). */
    float below = floorf(x);
    float ipart = below + (x - below >= 0.5f ? 1.0f : 0.0f);
    float fpart = x - ipart;
    float p = 1.535336188319500e-4f;
    p = fmaf(p, fpart, 1.339887440266574e-3f);
    p = fmaf(p, fpart, 9.618437357674640e-3f);
    p = fmaf(p, fpart, 5.550332471162809e-2f);
    p = fmaf(p, fpart, 2.402264791363012e-1f);
    p = fmaf(p, fpart, 6.931472028550421e-1f);
    p = fmaf(p, fpart, 1.000000000000000f);
    /* Outside [-88, 88] and for NaN the value is replaced below; clamping
     * first only keeps the integer conversion defined. */
    float clamped = ipart < -127.0f ? -127.0f : ipart;
    clamped = clamped > 128.0f ? 128.0f : clamped;
    union { uint32_t bits; float value; } scale;
    scale.bits = ((uint32_t)(int32_t)clamped + 127u) << 23;
    float result = x_init != x_init ? x_init : scale.value * p;
    result = x_init > 88.0f ? INFINITY : result;
    result = x_init < -88.0f ? 0.0f : result;
    return result;
}

void exp_rows(const float *restrict in, float *restrict out, long n) {
    for (long i = 0; i < n; i++) out[i] = exp_like_mlx(in[i]);
}

/* mlx::core::simd::maximum<float, 1> folded over a row, as both kernels do. */
static inline float row_maximum(const float *restrict in, long m) {
    float maximum = -INFINITY;
    for (long j = 0; j < m; j++) {
        float v = in[j];
        maximum = v != v ? v : (v > maximum ? v : maximum);
    }
    return maximum;
}

/* mlx::core::softmax<float, float> for one row of m values (`out` may be `in`). */
static void softmax_row(const float *in, float *out, long m) {
    float maximum = row_maximum(in, m);
    for (long j = 0; j < m; j++) out[j] = exp_like_mlx(in[j] - maximum);
    float normalizer = 0.0f;
    for (long j = 0; j < m; j++) normalizer = normalizer + out[j];
    normalizer = 1 / normalizer;
    for (long j = 0; j < m; j++) out[j] = out[j] * normalizer;
}

/* mlx::core::logsumexp<float, float> for one row of m values: the maximum,
 * the left-to-right sum of exp(x - maximum), then libm's logf of it plus the
 * maximum (the maximum itself where it is infinite). The exps go through a
 * scratch buffer so that they vectorize and the sum stays in order. */
static float logsumexp_row(const float *restrict in, float *restrict scratch, long m) {
    float maximum = row_maximum(in, m);
    enum { CHUNK = 1024 };
    float normalizer = 0.0f;
    for (long j0 = 0; j0 < m; j0 += CHUNK) {
        long n = m - j0 < CHUNK ? m - j0 : CHUNK;
        for (long j = 0; j < n; j++) scratch[j] = exp_like_mlx(in[j0 + j] - maximum);
        for (long j = 0; j < n; j++) normalizer = normalizer + scratch[j];
    }
    return isinf(maximum) ? maximum : logf(normalizer) + maximum;
}

/* mlx's softmax of a row whose values past the first `valid` are masked with
 * float32's lowest value (its attention's causal mask), from the first `valid`
 * alone: while exp(lowest - maximum) is 0, the masked values leave the maximum
 * as it is, add 0 to the sum (a float plus zero is itself) and come out as 0
 * times the normalizer. Where it is not 0 (no valid value, or the maximum is
 * -inf or NaN), the masked row itself. `out` may be `in`. */
static void softmax_prefix(const float *in, float *out, long m, long valid) {
    if (valid > m) valid = m;
    float maximum = valid > 0 ? row_maximum(in, valid) : -INFINITY;
    if (valid < 1 || exp_like_mlx(-FLT_MAX - maximum) != 0.0f) {
        if (out != in) memcpy(out, in, sizeof(float) * (valid > 0 ? valid : 0));
        for (long j = valid > 0 ? valid : 0; j < m; j++) out[j] = -FLT_MAX;
        softmax_row(out, out, m);
        return;
    }
    for (long j = 0; j < valid; j++) out[j] = exp_like_mlx(in[j] - maximum);
    float normalizer = 0.0f;
    for (long j = 0; j < valid; j++) normalizer = normalizer + out[j];
    normalizer = 1 / normalizer;
    for (long j = 0; j < valid; j++) out[j] = out[j] * normalizer;
    float masked = 0.0f * normalizer;
    for (long j = valid; j < m; j++) out[j] = masked;
}

struct span {
    const float *in;
    float *out;
    long first, last, m;
    int kind;  /* 0: softmax (out: rows x m), 1: logsumexp (out: rows), 2: causal softmax */
    long length, offset;  /* kind 2: queries a block of rows, and the first one's position */
};

static void *run_span(void *arg) {
    struct span *s = arg;
    if (s->kind == 0) {
        for (long i = s->first; i < s->last; i++)
            softmax_row(s->in + i * s->m, s->out + i * s->m, s->m);
    } else if (s->kind == 2) {
        for (long i = s->first; i < s->last; i++)
            softmax_prefix(s->in + i * s->m, s->out + i * s->m, s->m, s->offset + i % s->length + 1);
    } else {
        float scratch[1024];
        for (long i = s->first; i < s->last; i++) s->out[i] = logsumexp_row(s->in + i * s->m, scratch, s->m);
    }
    return NULL;
}

/* A row kernel over a contiguous rows x m array, on up to `threads` threads
 * (rows are independent, so the split changes no bit). */
static void run_rows(const float *in, float *out, long rows, long m, int threads, int kind,
                     long length, long offset) {
    enum { MAX_THREADS = 16 };
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 2 || rows < 2) {
        struct span all = {in, out, 0, rows, m, kind, length, offset};
        run_span(&all);
        return;
    }
    if (threads > rows) threads = (int)rows;
    pthread_t ids[MAX_THREADS];
    int running[MAX_THREADS] = {0};
    struct span spans[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        spans[t] = (struct span){in, out, rows * t / threads, rows * (t + 1) / threads, m, kind,
                                 length, offset};
        running[t] = t < threads - 1 && pthread_create(&ids[t], NULL, run_span, &spans[t]) == 0;
        if (!running[t]) run_span(&spans[t]);
    }
    for (int t = 0; t < threads; t++)
        if (running[t]) pthread_join(ids[t], NULL);
}

/* Softmax over the last axis (mlx's precise softmax). */
void softmax_rows(const float *in, float *out, long rows, long m, int threads) {
    run_rows(in, out, rows, m, threads, 0, 1, 0);
}

/* mlx's attention's causal mask and softmax: rows in blocks of `length`
 * queries, query t of a block at position offset + t, seeing keys 0 to there.
 * `out` may be `in`. */
void softmax_causal_rows(const float *in, float *out, long rows, long m, long length,
                         long offset, int threads) {
    run_rows(in, out, rows, m, threads, 2, length, offset);
}

/* Logsumexp over the last axis, one float a row (mlx's logsumexp). */
void logsumexp_rows(const float *in, float *out, long rows, long m, int threads) {
    run_rows(in, out, rows, m, threads, 1, 1, 0);
}

/* mlx-lm's quantized attention (quantized_matmul of the scaled queries
 * against the keys, the mask, the precise softmax, and quantized_matmul of the
 * weights against the values), float32, bit for bit what mlx's CPU kernels
 * compute (_qmm_t and _qmm: one lane, each output a left-to-right sum of
 * x * (scale * w + bias)). mlx reads every key once per output; here a block
 * of keys is dequantized once, transposed, and summed many outputs wide, each
 * output still in its own order.
 *
 * q: (rows, heads, repeats * queries, dim), contiguous, already scaled: the
 * `repeats` query heads that share key head `h`, each with `queries` queries
 * a row (1 in a decode step; a verify step's or a prefill chunk's several).
 * Keys and values: three planes each (the packed words, the scales, the
 * biases), key j of (row b, head h) at base + b * stride[0] + h * stride[1] +
 * j * per_key (elements), for the words (kst[0..1], per_key dim * bits / 32)
 * and for scales and biases (kst[2..3], per_key dim / group). mask: rows x
 * queries x length bytes (0: masked), or NULL. out: like q. */
enum { KEYS_AT_ONCE = 16, MAX_DIM = 256, QUERIES_AT_ONCE = 64 };

/* 16 floats, one output each: each lane's multiply and add round on their own
 * (no fused multiply-add: -ffp-contract=off), so a lane is mlx's scalar sum. */
typedef float lanes __attribute__((vector_size(64)));

/* One key's (or value's) dim floats, as mlx dequantizes them: scale * w + bias
 * per group, the packed values low bits first. */
static inline void dequantized(const uint8_t *restrict packed, const float *restrict scales,
                               const float *restrict biases, long dim, int group, int bits,
                               float *restrict out) {
    for (long g0 = 0, g = 0; g0 < dim; g0 += group, g++) {
        const float scale = scales[g], bias = biases[g];
        if (bits == 8) {
            for (long k = 0; k < group; k++) out[g0 + k] = scale * (float)packed[g0 + k] + bias;
        } else {
            const uint8_t *p = packed + (g0 >> 1);
            for (long k = 0; k < group / 2; k++) {
                out[g0 + 2 * k] = scale * (float)(p[k] & 0xf) + bias;
                out[g0 + 2 * k + 1] = scale * (float)(p[k] >> 4) + bias;
            }
        }
    }
}

struct attend {
    const float *q;
    const uint32_t *kw, *vw;
    const float *ks, *kb, *vs, *vb;
    const long *kst, *vst;
    const unsigned char *mask;
    float *out;
    long rows, heads, repeats, queries, length, dim; /* repeats: query heads x queries */
    int bits, group;
    long first, last; /* work units [first, last): (row, head, QUERIES_AT_ONCE queries) */
};

/* scores[m - first] = q[m] . keys[j0 .. j0 + n), for queries [first, last), one
 * output a lane, each summed over the dim in order (_qmm_t). Four queries at a
 * time, so that four sums are in flight (a last group of fewer repeats its
 * last query and keeps what it needs). */
static void scores_block(const float *q, const lanes *keys, long dim, long first, long last,
                         long n, float *scores, long stride) {
    for (long m = first; m < last; m += 4) {
        const float *q0 = q + m * dim;
        const float *q1 = q + (m + 1 < last ? m + 1 : last - 1) * dim;
        const float *q2 = q + (m + 2 < last ? m + 2 : last - 1) * dim;
        const float *q3 = q + (m + 3 < last ? m + 3 : last - 1) * dim;
        lanes a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (long k = 0; k < dim; k++) {
            const lanes key = keys[k];
            a0 = a0 + q0[k] * key;
            a1 = a1 + q1[k] * key;
            a2 = a2 + q2[k] * key;
            a3 = a3 + q3[k] * key;
        }
        const lanes *sums[4] = {&a0, &a1, &a2, &a3};
        for (long r = 0; r < 4 && m + r < last; r++) {
            float *row = scores + (m + r - first) * stride;
            for (long i = 0; i < n; i++) row[i] = (*sums[r])[i];
        }
    }
}

/* out[m] += weights[m][i] * values[i] for i in order (_qmm's sum over keys);
 * dim a multiple of 16. */
static void values_block(const float (*values)[MAX_DIM], long n, long dim, const float *weights,
                         long stride, long count, float *out) {
    const long width = dim / 16;
    for (long m = 0; m < count; m++) {
        lanes acc[MAX_DIM / 16];
        memcpy(acc, out + m * dim, sizeof(float) * dim);
        for (long i = 0; i < n; i++) {
            const float x = weights[m * stride + i];
            const lanes *v = (const lanes *)values[i];
            for (long c = 0; c < width; c++) acc[c] = acc[c] + x * v[c];
        }
        memcpy(out + m * dim, acc, sizeof(float) * dim);
    }
}

/* Queries [first, last) of (row b, head h): their scores, the mask, the
 * softmax, then their outputs. scores: (last - first) x length floats. */
static void attend_one(const struct attend *a, long b, long h, long first, long last,
                       float *scores) {
    const long dim = a->dim, length = a->length, repeats = a->repeats;
    const long bytes = dim * a->bits / 8, groups = dim / a->group;
    const float *q = a->q + (b * a->heads + h) * repeats * dim;
    const uint8_t *kw = (const uint8_t *)(a->kw + b * a->kst[0] + h * a->kst[1]);
    const float *ks = a->ks + b * a->kst[2] + h * a->kst[3];
    const float *kb = a->kb + b * a->kst[2] + h * a->kst[3];
    const uint8_t *vw = (const uint8_t *)(a->vw + b * a->vst[0] + h * a->vst[1]);
    const float *vs = a->vs + b * a->vst[2] + h * a->vst[3];
    const float *vb = a->vb + b * a->vst[2] + h * a->vst[3];
    const unsigned char *mask = a->mask ? a->mask + b * a->queries * length : NULL;
    float rows[KEYS_AT_ONCE][MAX_DIM] __attribute__((aligned(64)));
    lanes keys[MAX_DIM];
    /* scores = q @ dequantized(keys)^T, KEYS_AT_ONCE outputs wide */
    for (long j0 = 0; j0 < length; j0 += KEYS_AT_ONCE) {
        long n = length - j0 < KEYS_AT_ONCE ? length - j0 : KEYS_AT_ONCE;
        for (long i = 0; i < KEYS_AT_ONCE; i++) {
            long j = j0 + (i < n ? i : 0);
            dequantized(kw + j * bytes, ks + j * groups, kb + j * groups, dim, a->group, a->bits,
                        rows[i]);
        }
        for (long k = 0; k < dim; k++)
            for (long i = 0; i < KEYS_AT_ONCE; i++) keys[k][i] = rows[i][k];
        scores_block(q, keys, dim, first, last, n, scores + j0, length);
    }
    for (long m = first; m < last; m++) {
        float *row = scores + (m - first) * length;
        if (mask) {
            const unsigned char *allowed = mask + (m % a->queries) * length;
            for (long j = 0; j < length; j++) row[j] = allowed[j] ? row[j] : -3.40282347e38f;
        }
        softmax_row(row, row, length);
    }
    /* out = weights @ dequantized(values), dim outputs wide, each a sum over
     * the keys in order: a block of values dequantized at once */
    float *out = a->out + ((b * a->heads + h) * repeats + first) * dim;
    for (long i = 0; i < (last - first) * dim; i++) out[i] = 0.0f;
    for (long j0 = 0; j0 < length; j0 += KEYS_AT_ONCE) {
        long n = length - j0 < KEYS_AT_ONCE ? length - j0 : KEYS_AT_ONCE;
        for (long i = 0; i < n; i++)
            dequantized(vw + (j0 + i) * bytes, vs + (j0 + i) * groups, vb + (j0 + i) * groups,
                        dim, a->group, a->bits, rows[i]);
        values_block((const float (*)[MAX_DIM])rows, n, dim, scores + j0, length, last - first,
                     out);
    }
}

static void *attend_span(void *arg) {
    const struct attend *a = arg;
    const long chunks = (a->repeats + QUERIES_AT_ONCE - 1) / QUERIES_AT_ONCE;
    const long most = a->repeats < QUERIES_AT_ONCE ? a->repeats : QUERIES_AT_ONCE;
    float *scores = malloc(sizeof(float) * most * a->length);
    if (!scores) return (void *)1;
    for (long u = a->first; u < a->last; u++) {
        long pair = u / chunks, first = (u % chunks) * QUERIES_AT_ONCE;
        long last = first + QUERIES_AT_ONCE < a->repeats ? first + QUERIES_AT_ONCE : a->repeats;
        attend_one(a, pair / a->heads, pair % a->heads, first, last, scores);
    }
    free(scores);
    return NULL;
}

/* Returns 0, or -1 where the shapes are not supported (the caller keeps mlx's
 * path), or 1 where memory ran out. */
int quantized_attention(
    const float *q, const uint32_t *kw, const float *ks, const float *kb, const long *kst,
    const uint32_t *vw, const float *vs, const float *vb, const long *vst,
    const unsigned char *mask, float *out, long rows, long heads, long repeats, long queries,
    long length, long dim, int bits, int group, int threads) {
    enum { MAX_THREADS = 16 };
    if ((bits != 8 && bits != 4) || dim > MAX_DIM || dim % group || dim % 16 || length < 1 ||
        queries < 1)
        return -1;
    long units = rows * heads * ((repeats * queries + QUERIES_AT_ONCE - 1) / QUERIES_AT_ONCE);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = (int)units;
    if (threads < 1) threads = 1;
    struct attend spans[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int running[MAX_THREADS] = {0};
    void *failed = NULL;
    for (int t = 0; t < threads; t++) {
        spans[t] = (struct attend){q, kw, vw, ks, kb, vs, vb, kst, vst, mask, out, rows, heads,
                                   repeats * queries, queries, length, dim, bits, group,
                                   units * t / threads, units * (t + 1) / threads};
        running[t] = t < threads - 1 && pthread_create(&ids[t], NULL, attend_span, &spans[t]) == 0;
        if (!running[t]) failed = attend_span(&spans[t]) ? (void *)1 : failed;
    }
    for (int t = 0; t < threads; t++) {
        void *r = NULL;
        if (running[t]) pthread_join(ids[t], &r);
        if (r) failed = r;
    }
    return failed ? 1 : 0;
}
