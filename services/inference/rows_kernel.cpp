// Decode-step products for x86-64 CPUs with AVX2 and FMA: a few rows of fp32 activations times
// bf16 or int8 weights, widened to fp32 in registers, accumulated in fp32 (services/inference/rows.py).
//
// A decode step reads every weight once for a few rows, so it is bound by how fast the weights
// stream from memory. The weights come in the kernel's blocked layout (rows.pack: [out/4, in/8, 4, 8],
// each block of 4 outputs with their 8 weights of every group of 8 inputs side by side), so a block is
// one sequential stream: read once from memory (four rows' streams 1-3 KB apart reached only about
// half the memory's bandwidth) and, for every group of activation rows, again from the L1 cache,
// widened to fp32 8 at a time and multiplied with fused multiply-adds.
//
// Every output (m, n) sums its products in one order whatever the batch: lane k % 8 in k's order,
// then one fixed horizontal sum, then the row's scale. A row's result therefore does not depend on
// the rows beside it, the tile it falls in or the thread that computes it.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

#define SPADE_AVX2 __attribute__((target("avx2,fma")))

SPADE_AVX2 inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 h = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, h);
  h = _mm_movehl_ps(h, s);
  return _mm_cvtss_f32(_mm_add_ss(s, h));
}

struct Bf16 {  // the upper half of an fp32: widening is a shift
  using T = uint16_t;
  SPADE_AVX2 static inline __m256 load(const T* p) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
};

struct Int8 {
  using T = int8_t;
  SPADE_AVX2 static inline __m256 load(const T* p) {
    __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  }
};

// Outputs a block holds, and inputs a group (one register of fp32); rows.py's BLOCK and INPUT_MULTIPLE.
constexpr int64_t BLOCK = 4, GROUP = 8;
// How far ahead of its reads a block's first tile asks for the block's weights: 1 KB (16 groups of bf16
// weights). The hardware's own prefetching left 5-12% of a one-row product's time on the AVX2 VM (a
// scratch timing of the model's shapes: 1, 2 and 4 KB ahead, 1 KB the best but for the LM head). The
// tiles after it read the block from L1 and ask for nothing (with prefetches, 8 rows took 13-25% longer),
// and from PREFETCH_ROWS rows on, where the arithmetic bounds a product, the first tile asks for nothing
// either (16 rows took 12% longer with it). A prefetch never faults: reaching past the weights is harmless.
constexpr int64_t PREFETCH_BYTES = 1024, PREFETCH_ROWS = 8;

// y[m, n] = scale[n] * sum_k x[m, k] w[n, k] for MT rows of x and NT outputs of one block, from the
// block's output `first` on: their weights of inputs [k, k + 8) sit at wb + k * BLOCK + n * GROUP.
template <class W, int MT, int NT, bool PREFETCH>
SPADE_AVX2 inline void tile(const float* x, const typename W::T* wb, int first, int64_t K, const float* scale,
                            float* y, int64_t ldy) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += GROUP) {
    const typename W::T* group = wb + k * BLOCK + first * GROUP;
    if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(group) + PREFETCH_BYTES, _MM_HINT_T0);
    __m256 wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = W::load(group + n * GROUP);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      const float sum = horizontal_sum(acc[m][n]);
      y[m * ldy + first + n] = scale ? sum * scale[first + n] : sum;
    }
}

// Outputs [n0, n0 + 4) of every row: the block's weights stay in L1 while the rows pass over it,
// four rows at a time by halves of the block (fewer widenings per product), then in pairs, then one.
template <class W>
void block(const float* x, int64_t M, const typename W::T* w, int64_t K, const float* scale, float* y, int64_t N,
           int64_t n0) {
  const typename W::T* wb = w + n0 * K;
  const float* sb = scale ? scale + n0 : nullptr;
  int64_t m = 0;
  if (M >= PREFETCH_ROWS) {
    // bound by arithmetic: no tile prefetches
  } else if (M >= 4) {  // the first tile streams the block from memory, the rest read it from L1
    tile<W, 4, 2, true>(x, wb, 0, K, sb, y + n0, N);
    tile<W, 4, 2, false>(x, wb, 2, K, sb, y + n0, N);
    m = 4;
  } else if (M >= 2) {
    tile<W, 2, 4, true>(x, wb, 0, K, sb, y + n0, N);
    m = 2;
  } else if (M == 1) {
    tile<W, 1, 4, true>(x, wb, 0, K, sb, y + n0, N);
    m = 1;
  }
  for (; m + 4 <= M; m += 4) {
    tile<W, 4, 2, false>(x + m * K, wb, 0, K, sb, y + m * N + n0, N);
    tile<W, 4, 2, false>(x + m * K, wb, 2, K, sb, y + m * N + n0, N);
  }
  for (; m + 2 <= M; m += 2) tile<W, 2, 4, false>(x + m * K, wb, 0, K, sb, y + m * N + n0, N);
  for (; m < M; ++m) tile<W, 1, 4, false>(x + m * K, wb, 0, K, sb, y + m * N + n0, N);
}

template <class W>
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& w, const typename W::T* weights,
                      const float* scale) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), "activations and weights must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "activations must be a contiguous [rows, in] float32 tensor");
  TORCH_CHECK(x.size(1) % GROUP == 0, "inputs must be a multiple of 8, not ", x.size(1));
  TORCH_CHECK(w.dim() == 4 && w.size(2) == BLOCK && w.size(3) == GROUP && w.is_contiguous(),
              "weights must be in the kernel's blocked layout (rows.pack): a contiguous [out/4, in/8, 4, 8] "
              "tensor");
  TORCH_CHECK(w.size(1) * GROUP == x.size(1), "activations have ", x.size(1), " inputs, the weights ",
              w.size(1) * GROUP);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * BLOCK;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) block<W>(xp, M, weights, K, scale, yp, N, b * BLOCK);
  });
  return y;
}

torch::Tensor bf16_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "weights must be bfloat16");
  return product<Bf16>(x, w, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), nullptr);
}

torch::Tensor int8_rows(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8, "weights must be int8");
  TORCH_CHECK(scales.is_cpu() && scales.dim() == 1 && scales.scalar_type() == torch::kFloat32 &&
                  scales.is_contiguous() && scales.size(0) == q.size(0) * BLOCK,
              "scales must be a contiguous float32 vector, one per output");
  return product<Int8>(x, q, q.data_ptr<int8_t>(), scales.data_ptr<float>());
}

}  // namespace

// The products touch no Python object: they release the GIL, as torch's own operators do, so the
// embedded run's other threads (its learner, its HTTP loop) run Python meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_rows", &bf16_rows,
        "[rows, in] fp32 activations times bf16 weights (blocked: [out/4, in/8, 4, 8]): [rows, out] fp32",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_rows", &int8_rows,
        "[rows, in] fp32 activations times int8 weights (blocked) and fp32 [out] scales: [rows, out] fp32",
        py::call_guard<py::gil_scoped_release>());
}
