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
 * panels are made once (actors/step/packed.py) and the same sums run from
 * them, so each output is the same float; packed.py checks that per shape and
 * row count against mlx's matmul before a product is routed here.
 *
 * Built on first use by actors/step/packed.py with nanobind (the version whose
 * internals mlx's own module uses, so an mx.array passes as itself).
 */
#include <immintrin.h>

#include <atomic>
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
constexpr long MAX_ROWS = 8;

struct Product {
  const float *panels;  // [n / 16][k][16]
  const float *x;       // [m][k]
  const float *bias;    // [n] or null
  float *out;           // [m][n]
  long m, n, k;
  const long *bounds;  // the K blocks' edges, first 0, last k
  int blocks;
};

/* Panels [first, last) of one product: `P` panels at a time share each row's
 * broadcast value. */
template <int P>
void panels(const Product &j, long first, long last) {
  for (long p = first; p < last; p += P) {
    __m512 sum[P][MAX_ROWS];
    for (int b = 0; b < j.blocks; b++) {
      __m512 acc[P][MAX_ROWS];
      for (int q = 0; q < P; q++)
        for (long r = 0; r < j.m; r++) acc[q][r] = _mm512_setzero_ps();
      for (long kk = j.bounds[b]; kk < j.bounds[b + 1]; kk++) {
        __m512 w[P];
        for (int q = 0; q < P; q++) w[q] = _mm512_loadu_ps(j.panels + ((p + q) * j.k + kk) * LANES);
        for (long r = 0; r < j.m; r++) {
          __m512 v = _mm512_set1_ps(j.x[r * j.k + kk]);
          for (int q = 0; q < P; q++) acc[q][r] = _mm512_fmadd_ps(w[q], v, acc[q][r]);
        }
      }
      for (int q = 0; q < P; q++)
        for (long r = 0; r < j.m; r++) {
          if (b > 0)
            sum[q][r] = _mm512_add_ps(acc[q][r], sum[q][r]);
          else if (j.bias != nullptr)
            sum[q][r] = _mm512_add_ps(acc[q][r], _mm512_loadu_ps(j.bias + (p + q) * LANES));
          else
            sum[q][r] = acc[q][r];
        }
    }
    for (int q = 0; q < P; q++)
      for (long r = 0; r < j.m; r++) _mm512_storeu_ps(j.out + r * j.n + (p + q) * LANES, sum[q][r]);
  }
}

void run(const Product &j, long first, long last) {
  long pairs = j.m > 2 ? (last - first) / 2 * 2 : 0;
  panels<2>(j, first, first + pairs);
  panels<1>(j, first + pairs, last);
}

/* One helper thread takes half the panels of a large product: it spins a
 * little for the next one (a decode step's products come back to back), then
 * sleeps. It serves one product at a time: a product that comes while it is
 * busy (another model's stream, in the same process) runs whole where it came. */
class Helper {
 public:
  void split(const Product &j) {
    long count = j.n / LANES;
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (count < 64 || !lock.owns_lock()) {
      run(j, 0, count);
      return;
    }
    start();
    job_ = j;
    half_ = count / 2;
    long ticket = posted_.fetch_add(1, std::memory_order_acq_rel) + 1;
    posted_.notify_one();
    run(j, 0, half_);
    while (finished_.load(std::memory_order_acquire) != ticket) _mm_pause();
  }

 private:
  void start() {
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
  }
  void loop() {
    long seen = 0;
    for (;;) {
      long ticket;
      int spins = 0;
      while ((ticket = posted_.load(std::memory_order_acquire)) == seen) {
        if (++spins < 20000)
          _mm_pause();
        else
          posted_.wait(seen, std::memory_order_acquire);
      }
      seen = ticket;
      run(job_, half_, job_.n / LANES);
      finished_.store(ticket, std::memory_order_release);
    }
  }
  std::mutex busy_;
  bool started_ = false;  // written under busy_
  Product job_{};
  long half_ = 0;
  std::atomic<long> posted_{0}, finished_{0};
};

Helper &helper() {
  static Helper *h = new Helper();  // never destroyed: its thread outlives exit
  return *h;
}

class PackedMatmul : public mx::Primitive {
 public:
  PackedMatmul(mx::Stream s, long n, long k, std::vector<long> bounds)
      : mx::Primitive(s), n_(n), k_(k), bounds_(std::move(bounds)) {}

  void eval_cpu(const std::vector<mx::array> &in, std::vector<mx::array> &outs) override {
    auto &out = outs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (auto &a : in) encoder.set_input_array(a);
    encoder.set_output_array(out);
    long m = in[0].size() / k_;
    const float *bias = in.size() > 2 ? in[2].data<float>() : nullptr;
    encoder.dispatch([x = in[0].data<float>(), w = in[1].data<float>(), bias, o = out.data<float>(),
                      m, n = n_, k = k_, bounds = bounds_]() {
      Product j{w, x, bias, o, m, n, k, bounds.data(), static_cast<int>(bounds.size()) - 1};
      helper().split(j);
    });
  }
  void eval_gpu(const std::vector<mx::array> &, std::vector<mx::array> &) override {
    throw std::runtime_error("packed_matmul runs on the CPU only");
  }
  const char *name() const override { return "PackedMatmul"; }
  bool is_equivalent(const mx::Primitive &other) const override {
    auto *o = dynamic_cast<const PackedMatmul *>(&other);
    return o != nullptr && o->n_ == n_ && o->k_ == k_ && o->bounds_ == bounds_;
  }

 private:
  long n_, k_;
  std::vector<long> bounds_;
};

/* x [..., k] times the packed weight (n outputs), plus bias: [..., n]. */
mx::array packed_matmul(const mx::array &x, const mx::array &panels, long n, long k,
                        std::vector<long> bounds, std::optional<mx::array> bias) {
  if (x.dtype() != mx::float32 || panels.dtype() != mx::float32 || x.shape().back() != k ||
      panels.size() != static_cast<size_t>(n * k) || n % LANES != 0 || x.size() / k > MAX_ROWS ||
      bounds.size() < 2 || bounds.front() != 0 || bounds.back() != k)
    throw std::invalid_argument("packed_matmul: float32 x [..., k] of at most 8 rows, n % 16 == 0");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::contiguous(x, false, s), mx::contiguous(panels, false, s)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, s));
  auto shape = x.shape();
  shape.back() = static_cast<int>(n);
  return mx::array(shape, mx::float32, std::make_shared<PackedMatmul>(s, n, k, bounds), inputs);
}

}  // namespace

NB_MODULE(_packed, m) {
  nb::module_::import_("mlx.core");
  m.def("packed_matmul", &packed_matmul, nb::arg("x"), nb::arg("panels"), nb::arg("n"), nb::arg("k"),
        nb::arg("bounds"), nb::arg("bias") = nb::none());
}
