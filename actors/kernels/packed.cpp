/* Decode-step products of float32 weights, read from a copy packed once at load:
 * an mlx primitive (it runs inside mlx's graph, on the CPU stream) with
 * OpenBLAS's own arithmetic.
 *
 * For a product its small-matrix kernel does not take, OpenBLAS (0.3.21, the
 * AVX-512 kernels) copies the weight into panels of 16 outputs on every call,
 * then multiplies: each output keeps one accumulator, the products are added
 * in K order with fused multiply-adds, a K block at a time, and each block's
 * sum is added to the output (the first to zero, or to the bias). At a decode
 * step's few rows that copy costs about what the multiply does. Here the
 * panels are made once (actors/kernels/packed.py) and the same sums run from
 * them, so each output is the same float; packed.py checks that per shape and
 * row count against mlx's matmul before a product is routed here.
 *
 * The products OpenBLAS's small-matrix kernel takes instead (the transposed
 * weight's "TN" kernel: outputs x rows <= 1,200 and M x N x K <= 10^6; at one
 * row most of a small model's attention and down products) read the weight
 * where it lies, one output at a time: sixteen lanes of fused multiply-adds
 * over K, the lanes then summed in a fixed tree. That kernel runs on one
 * thread; here its outputs are shared with a helper thread, each output's sums
 * unchanged (`small` below).
 *
 * Built on first use by actors/kernels/packed.py with nanobind (the version whose
 * internals mlx's own module uses, so an mx.array passes as itself).
 */
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr long LANES = 16;  // outputs a panel
constexpr long MAX_ROWS = 128;  // rows (positions) a product may have
constexpr long ROW_BLOCK = 8;  // rows the packed kernel keeps in registers at once
// A small-matrix product of at least this many weights splits its outputs with
// the helper thread (on SmolLM2 at one row: all of q, k, v, o and down; k and v
// gain least, about even).
constexpr long SMALL_SPLIT = 1L << 16;
// Pauses the helper thread spins for the next product before it sleeps (about
// 0.4 ms here; 200 or 200,000 read the same within noise at one row).
constexpr int SPINS = 20000;

struct Product {
  const float *panels;  // [n / 16][k][16], or the weight [n][k] where `small`
  const float *x;       // [m][k]
  const float *bias;    // [n] or null
  float *out;           // [m][n]
  long m, n, k;
  const long *bounds;  // the K blocks' edges, first 0, last k
  int blocks;
  bool small;  // the small-matrix kernel's sums, from the weight in place
};

/* Panels [first, last) of one product: `P` panels at a time share each row's
 * broadcast value; the rows go up to ROW_BLOCK at a time, each panel
 * read once from memory for all of them. */
template <int P>
void panels(const Product &j, long first, long last) {
  for (long p = first; p < last; p += P)
    for (long r0 = 0; r0 < j.m; r0 += ROW_BLOCK) {
      const long rows = j.m - r0 < ROW_BLOCK ? j.m - r0 : ROW_BLOCK;
      const float *x = j.x + r0 * j.k;
      float *out = j.out + r0 * j.n;
      __m512 sum[P][ROW_BLOCK];
      for (int b = 0; b < j.blocks; b++) {
        __m512 acc[P][ROW_BLOCK];
        for (int q = 0; q < P; q++)
          for (long r = 0; r < rows; r++) acc[q][r] = _mm512_setzero_ps();
        for (long kk = j.bounds[b]; kk < j.bounds[b + 1]; kk++) {
          __m512 w[P];
          for (int q = 0; q < P; q++) w[q] = _mm512_loadu_ps(j.panels + ((p + q) * j.k + kk) * LANES);
          for (long r = 0; r < rows; r++) {
            __m512 v = _mm512_set1_ps(x[r * j.k + kk]);
            for (int q = 0; q < P; q++) acc[q][r] = _mm512_fmadd_ps(w[q], v, acc[q][r]);
          }
        }
        for (int q = 0; q < P; q++)
          for (long r = 0; r < rows; r++) {
            if (b > 0)
              sum[q][r] = _mm512_add_ps(acc[q][r], sum[q][r]);
            else if (j.bias != nullptr)
              sum[q][r] = _mm512_add_ps(acc[q][r], _mm512_loadu_ps(j.bias + (p + q) * LANES));
            else
              sum[q][r] = acc[q][r];
          }
      }
      for (int q = 0; q < P; q++)
        for (long r = 0; r < rows; r++) _mm512_storeu_ps(out + r * j.n + (p + q) * LANES, sum[q][r]);
    }
}

/* The small-matrix kernel's lane sum for four accumulators at once: each
 * output is ((b0 + b1) + (b2 + b3)), where b_q is the sum of lanes 4q..4q+3 as
 * (l0 + l1) + (l2 + l3). */
inline __m128 tree4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab_lo = _mm512_unpacklo_ps(a, b), ab_hi = _mm512_unpackhi_ps(a, b);
  __m512 cd_lo = _mm512_unpacklo_ps(c, d), cd_hi = _mm512_unpackhi_ps(c, d);
  __m512 l0 = _mm512_shuffle_ps(ab_lo, cd_lo, _MM_SHUFFLE(1, 0, 1, 0));
  __m512 l1 = _mm512_shuffle_ps(ab_lo, cd_lo, _MM_SHUFFLE(3, 2, 3, 2));
  __m512 l2 = _mm512_shuffle_ps(ab_hi, cd_hi, _MM_SHUFFLE(1, 0, 1, 0));
  __m512 l3 = _mm512_shuffle_ps(ab_hi, cd_hi, _MM_SHUFFLE(3, 2, 3, 2));
  __m512 s = _mm512_add_ps(_mm512_add_ps(l0, l1), _mm512_add_ps(l2, l3));
  __m128 b0 = _mm512_extractf32x4_ps(s, 0), b1 = _mm512_extractf32x4_ps(s, 1);
  __m128 b2 = _mm512_extractf32x4_ps(s, 2), b3 = _mm512_extractf32x4_ps(s, 3);
  return _mm_add_ps(_mm_add_ps(b0, b1), _mm_add_ps(b2, b3));
}

/* Outputs [first, last) (whole groups of four, the last group possibly short)
 * of a small-matrix product, `R` rows from `row`: lane l of an output's
 * accumulator adds w[k] * x[k] for k = l, l + 16, ... in order, the last
 * partial 16 masked. The four-way tree sums an output where the kernel groups
 * it in fours (outputs below n rounded down to 4, or rows below m rounded down
 * to 4), the compiler's sixteen-lane reduction elsewhere. */
template <int R>
void small_rows(const Product &j, long first, long last, long row) {
  const long k16 = j.k & ~15L, n4 = j.n & ~3L, m4 = j.m & ~3L;
  const __mmask16 tail = static_cast<__mmask16>((1u << (j.k - k16)) - 1);
  for (long i = first; i < last; i += 4) {
    long outs = last - i < 4 ? last - i : 4;
    __m512 acc[4][R];
    for (int o = 0; o < 4; o++)
      for (int r = 0; r < R; r++) acc[o][r] = _mm512_setzero_ps();
    const float *w = j.panels + i * j.k;
    for (long kk = 0; kk < k16; kk += 16) {
      __m512 xv[R];
      for (int r = 0; r < R; r++) xv[r] = _mm512_loadu_ps(j.x + (row + r) * j.k + kk);
      for (int o = 0; o < outs; o++) {
        __m512 wv = _mm512_loadu_ps(w + o * j.k + kk);
        for (int r = 0; r < R; r++) acc[o][r] = _mm512_fmadd_ps(wv, xv[r], acc[o][r]);
      }
    }
    if (tail) {
      __m512 xv[R];
      for (int r = 0; r < R; r++) xv[r] = _mm512_maskz_loadu_ps(tail, j.x + (row + r) * j.k + k16);
      for (int o = 0; o < outs; o++) {
        __m512 wv = _mm512_maskz_loadu_ps(tail, w + o * j.k + k16);
        for (int r = 0; r < R; r++) acc[o][r] = _mm512_fmadd_ps(wv, xv[r], acc[o][r]);
      }
    }
    for (int r = 0; r < R; r++) {
      float *out = j.out + (row + r) * j.n + i;
      float sums[4];
      if (i < n4) {
        _mm_storeu_ps(sums, tree4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
      } else {
        for (int o = 0; o < outs; o++)
          sums[o] = row + r < m4 ? _mm_cvtss_f32(tree4(acc[o][r], acc[o][r], acc[o][r], acc[o][r]))
                                 : _mm512_reduce_add_ps(acc[o][r]);
      }
      for (int o = 0; o < outs; o++) out[o] = j.bias != nullptr ? sums[o] + j.bias[i + o] : sums[o];
    }
  }
}

void small(const Product &j, long first, long last) {
  long row = 0;
  for (; row + 4 <= j.m; row += 4) small_rows<4>(j, first, last, row);
  switch (j.m - row) {
    case 3: small_rows<3>(j, first, last, row); break;
    case 2: small_rows<2>(j, first, last, row); break;
    case 1: small_rows<1>(j, first, last, row); break;
  }
}

/* A product's work comes in units: panels of 16 outputs, or groups of four
 * outputs for the small-matrix kernel. */
long units(const Product &j) { return j.small ? (j.n + 3) / 4 : j.n / LANES; }

void run(const Product &j, long first, long last) {
  if (j.small) {
    small(j, first * 4, last * 4 < j.n ? last * 4 : j.n);
    return;
  }
  long pairs = j.m > 2 ? (last - first) / 2 * 2 : 0;
  panels<2>(j, first, first + pairs);
  panels<1>(j, first + pairs, last);
}

bool worth_splitting(const Product &j) {
  return j.small ? j.n * j.k >= SMALL_SPLIT : j.n / LANES * j.m >= 64;
}

/* The units of a chunk, the grain the two threads share a product in: about
 * 32K weights read (128 KiB), counting a panel once for each 8 rows. */
long chunk_units(const Product &j) {
  long weights = (j.small ? 4 : LANES) * j.k;                  // a unit's
  long passes = j.small ? 1 : (j.m + ROW_BLOCK - 1) / ROW_BLOCK;  // each read this often
  long step = 32768 / (weights * passes);
  return step > 0 ? step : 1;
}

/* One helper thread shares the chunks of a large product with the thread that
 * evaluates it: each claims the next chunk from one counter until none is
 * left, so a helper that is late (asleep, or waiting for a core) costs only
 * its share of the parallelism, never a wait; the evaluating thread waits only
 * for chunks the helper has claimed. The helper spins a little for the next
 * product (a decode step's products come back to back), then sleeps. It serves
 * one product at a time: a product that comes while it is busy (another
 * model's stream, in the same process) runs whole where it came.
 *
 * The counter holds the product's ticket in its high half and the next chunk
 * in its low half, so a claim can only succeed for the product it was read
 * for: a helper that copied the job of a product already finished (and perhaps
 * a half-written next one) finds its claims refused and drops the copy. */
class Helper {
 public:
  void split(const Product &j) {
    long count = units(j);
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!worth_splitting(j) || !lock.owns_lock()) {
      run(j, 0, count);
      return;
    }
    start();
    Job job{j, count, chunk_units(j), 0};
    job.chunks = (count + job.step - 1) / job.step;
    job_ = job;
    done_.store(0, std::memory_order_relaxed);
    uint64_t ticket = ++ticket_ & 0xffffffffu;  // the counter's high half
    claim_.store(ticket << 32, std::memory_order_release);
    claim_.notify_one();
    long mine = work(ticket, job, nullptr);
    while (done_.load(std::memory_order_acquire) != job.chunks - mine) _mm_pause();
  }

 private:
  struct Job {
    Product product;
    long count, step, chunks;
  };

  /* Claims and runs chunks of product `ticket` while any is left; returns how
   * many it ran (each also counted in `done`, where given). */
  long work(uint64_t ticket, const Job &job, std::atomic<long> *done) {
    long ran = 0;
    uint64_t v = claim_.load(std::memory_order_acquire);
    for (;;) {
      long chunk = static_cast<long>(v & 0xffffffffu);
      if ((v >> 32) != ticket || chunk >= job.chunks) return ran;
      if (!claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        continue;
      long first = chunk * job.step, last = first + job.step;
      run(job.product, first, last < job.count ? last : job.count);
      ran++;
      if (done != nullptr) done->fetch_add(1, std::memory_order_release);
      v = claim_.load(std::memory_order_acquire);
    }
  }
  void start() {
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t v;
      int spins = 0;
      while ((v = claim_.load(std::memory_order_acquire)) >> 32 == seen) {
        if (++spins < SPINS)
          _mm_pause();
        else
          claim_.wait(v, std::memory_order_acquire);
      }
      seen = v >> 32;
      Job job = job_;  // read after the ticket: whole, unless that product is over
      work(seen, job, &done_);
    }
  }
  std::mutex busy_;
  bool started_ = false;  // written under busy_
  uint64_t ticket_ = 0;   // written under busy_
  Job job_{};
  std::atomic<uint64_t> claim_{0};
  std::atomic<long> done_{0};
};

Helper &helper() {
  static Helper *h = new Helper();  // never destroyed: its thread outlives exit
  return *h;
}

class PackedMatmul : public mx::Primitive {
 public:
  PackedMatmul(mx::Stream s, long n, long k, std::vector<long> bounds, bool small)
      : mx::Primitive(s), n_(n), k_(k), bounds_(std::move(bounds)), small_(small) {}

  void eval_cpu(const std::vector<mx::array> &in, std::vector<mx::array> &outs) override {
    auto &out = outs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (auto &a : in) encoder.set_input_array(a);
    encoder.set_output_array(out);
    long m = in[0].size() / k_;
    const float *bias = in.size() > 2 ? in[2].data<float>() : nullptr;
    encoder.dispatch([x = in[0].data<float>(), w = in[1].data<float>(), bias, o = out.data<float>(),
                      m, n = n_, k = k_, bounds = bounds_, small = small_]() {
      Product j{w, x, bias, o, m, n, k, bounds.data(), static_cast<int>(bounds.size()) - 1, small};
      helper().split(j);
    });
  }
  void eval_gpu(const std::vector<mx::array> &, std::vector<mx::array> &) override {
    throw std::runtime_error("packed_matmul runs on the CPU only");
  }
  const char *name() const override { return "PackedMatmul"; }
  bool is_equivalent(const mx::Primitive &other) const override {
    auto *o = dynamic_cast<const PackedMatmul *>(&other);
    return o != nullptr && o->n_ == n_ && o->k_ == k_ && o->bounds_ == bounds_ &&
           o->small_ == small_;
  }

 private:
  long n_, k_;
  std::vector<long> bounds_;
  bool small_;
};

mx::array product(const mx::array &x, const mx::array &weight, long n, long k,
                  std::vector<long> bounds, std::optional<mx::array> bias, bool small) {
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::contiguous(x, false, s), mx::contiguous(weight, false, s)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, s));
  auto shape = x.shape();
  shape.back() = static_cast<int>(n);
  return mx::array(shape, mx::float32,
                   std::make_shared<PackedMatmul>(s, n, k, std::move(bounds), small), inputs);
}

bool fits(const mx::array &x, const mx::array &weight, long n, long k,
          const std::optional<mx::array> &bias) {
  return x.dtype() == mx::float32 && weight.dtype() == mx::float32 && x.shape().back() == k &&
         weight.size() == static_cast<size_t>(n * k) && x.size() / k <= MAX_ROWS &&
         (!bias || (bias->dtype() == mx::float32 && bias->size() == static_cast<size_t>(n)));
}

/* x [..., k] times the packed weight (n outputs), plus bias: [..., n]. */
mx::array packed_matmul(const mx::array &x, const mx::array &panels, long n, long k,
                        std::vector<long> bounds, std::optional<mx::array> bias) {
  if (!fits(x, panels, n, k, bias) || n % LANES != 0 || bounds.size() < 2 || bounds.front() != 0 ||
      bounds.back() != k)
    throw std::invalid_argument("packed_matmul: float32 x [..., k] of at most 128 rows, n % 16 == 0");
  return product(x, panels, n, k, std::move(bounds), std::move(bias), false);
}

/* x [..., k] times weight.T (weight [n, k], where it lies), plus bias, with the
 * small-matrix kernel's sums: [..., n]. */
mx::array small_matmul(const mx::array &x, const mx::array &weight, std::optional<mx::array> bias) {
  if (weight.ndim() != 2 || weight.shape(1) < 16 || !fits(x, weight, weight.shape(0), weight.shape(1), bias))
    throw std::invalid_argument("small_matmul: float32 x [..., k] of at most 128 rows, weight [n, k]");
  long n = weight.shape(0), k = weight.shape(1);
  return product(x, weight, n, k, {0, k}, std::move(bias), true);
}

}  // namespace

NB_MODULE(_packed, m) {
  nb::module_::import_("mlx.core");
  m.def("packed_matmul", &packed_matmul, nb::arg("x"), nb::arg("panels"), nb::arg("n"), nb::arg("k"),
        nb::arg("bounds"), nb::arg("bias") = nb::none());
  m.def("small_matmul", &small_matmul, nb::arg("x"), nb::arg("weight"), nb::arg("bias") = nb::none());
}
