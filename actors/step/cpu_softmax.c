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
 * actors/cpu_softmax.py builds and loads it and checks it against mlx first.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

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

/* mlx::core::softmax<float, float> for one row of m values. */
static void softmax_row(const float *restrict in, float *restrict out, long m) {
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

struct span {
    const float *in;
    float *out;
    long first, last, m;
    int kind; /* 0: softmax (out: rows x m), 1: logsumexp (out: rows) */
};

static void *run_span(void *arg) {
    struct span *s = arg;
    if (s->kind == 0) {
        for (long i = s->first; i < s->last; i++)
            softmax_row(s->in + i * s->m, s->out + i * s->m, s->m);
    } else {
        float scratch[1024];
        for (long i = s->first; i < s->last; i++) s->out[i] = logsumexp_row(s->in + i * s->m, scratch, s->m);
    }
    return NULL;
}

/* A row kernel over a contiguous rows x m array, on up to `threads` threads
 * (rows are independent, so the split changes no bit). */
static void run_rows(const float *in, float *out, long rows, long m, int threads, int kind) {
    enum { MAX_THREADS = 16 };
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 2 || rows < 2) {
        struct span all = {in, out, 0, rows, m, kind};
        run_span(&all);
        return;
    }
    if (threads > rows) threads = (int)rows;
    pthread_t ids[MAX_THREADS];
    int running[MAX_THREADS] = {0};
    struct span spans[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        spans[t] = (struct span){in, out, rows * t / threads, rows * (t + 1) / threads, m, kind};
        running[t] = t < threads - 1 && pthread_create(&ids[t], NULL, run_span, &spans[t]) == 0;
        if (!running[t]) run_span(&spans[t]);
    }
    for (int t = 0; t < threads; t++)
        if (running[t]) pthread_join(ids[t], NULL);
}

/* Softmax over the last axis (mlx's precise softmax). */
void softmax_rows(const float *in, float *out, long rows, long m, int threads) {
    run_rows(in, out, rows, m, threads, 0);
}

/* Logsumexp over the last axis, one float a row (mlx's logsumexp). */
void logsumexp_rows(const float *in, float *out, long rows, long m, int threads) {
    run_rows(in, out, rows, m, threads, 1);
}
