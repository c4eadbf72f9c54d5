// Decode-step products for x86-64 CPUs: a few rows of activations times bf16 or int8 weights,
// accumulated in fp32 (services/inference/rows.py). With AVX2 and FMA the weights are widened to fp32 in
// registers and multiplied by fp32 activations; where the CPU has AVX-512 BF16, bf16 weights are also
// multiplied natively by the activations rounded to bf16 (bf16_dot_rows, below).
//
// A decode step reads every weight once for a few rows, so it is bound by how fast the weights
// stream from memory. The weights come in the kernel's blocked layout (rows.pack: [out/4, in/8, 4, 8],
// each block of 4 outputs with their 8 weights of every group of 8 inputs side by side), so a block is
// one sequential stream: read once from memory (four rows' streams 1-3 KB apart reached only about
// half the memory's bandwidth) and, for every group of activation rows, again from the L1 cache.
//
// Every output (m, n) sums its products in one order whatever the batch (the widening product: lane
// k % 8 in k's order, then one fixed horizontal sum, then the row's scale). A row's result therefore does
// not depend on the rows beside it, the tile it falls in or the thread that computes it.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

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
  // As attention keys and values: a pass serves 3 query heads (a key or value is loaded and widened once for
  // them), 4 positions' scores at a time, values 32 dims at a time (where they divide).
  static constexpr int HEADS = 3, POSITIONS = 4, VALUE_REGISTERS = 4;
  static constexpr bool PREFETCH = true;  // asks for lines AHEAD positions on (4 x 1,000: 6.9 -> 5.4 ms a step)
  SPADE_AVX2 static inline __m256 load(const T* p) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
};

struct F32 {  // keys and values kept in fp32
  using T = float;
  // A pass per query head, 8 positions' scores at a time, values 64 dims at a time (where they divide), no
  // prefetch: with nothing to widen, three heads a pass and prefetching were 4-20% slower here.
  static constexpr int HEADS = 1, POSITIONS = 8, VALUE_REGISTERS = 8;
  static constexpr bool PREFETCH = false;
  SPADE_AVX2 static inline __m256 load(const T* p) { return _mm256_loadu_ps(p); }
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
    if constexpr (PREFETCH)  // an address past the weights' end is only formed as an integer
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(group) + PREFETCH_BYTES), _MM_HINT_T0);
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

// How a block's product walks its rows: the first tile streams the block's weights from memory (asking for
// them ahead, below PREFETCH_ROWS rows), the rest read them from L1; four rows at a time, then a pair, then
// one. rows(MT, PREFETCH, m) computes rows [m, m + MT), MT and PREFETCH as std::integral_constant.
template <class Rows>
inline void walk_rows(int64_t M, Rows&& rows) {
  using Prefetch = std::true_type;
  using FromL1 = std::false_type;
  int64_t m = 0;
  if (M >= PREFETCH_ROWS) {  // bound by arithmetic: no tile prefetches
  } else if (M >= 4) {
    rows(std::integral_constant<int, 4>{}, Prefetch{}, 0);
    m = 4;
  } else if (M >= 2) {
    rows(std::integral_constant<int, 2>{}, Prefetch{}, 0);
    m = 2;
  } else if (M == 1) {
    rows(std::integral_constant<int, 1>{}, Prefetch{}, 0);
    m = 1;
  }
  for (; m + 4 <= M; m += 4) rows(std::integral_constant<int, 4>{}, FromL1{}, m);
  for (; m + 2 <= M; m += 2) rows(std::integral_constant<int, 2>{}, FromL1{}, m);
  for (; m < M; ++m) rows(std::integral_constant<int, 1>{}, FromL1{}, m);
}

// Outputs [n0, n0 + 4) of every row, widened: four rows at a time by halves of the block (fewer widenings
// per product; only the first half's tile prefetches), pairs and single rows by the whole block.
template <class W>
void block(const float* x, int64_t M, const typename W::T* w, int64_t K, const float* scale, float* y, int64_t N,
           int64_t n0) {
  const typename W::T* wb = w + n0 * K;
  const float* sb = scale ? scale + n0 : nullptr;
  walk_rows(M, [&](auto rows, auto prefetch, int64_t m) {
    constexpr int MT = decltype(rows)::value;
    constexpr bool PREFETCH = decltype(prefetch)::value;
    if constexpr (MT == 4) {
      tile<W, 4, 2, PREFETCH>(x + m * K, wb, 0, K, sb, y + m * N + n0, N);
      tile<W, 4, 2, false>(x + m * K, wb, 2, K, sb, y + m * N + n0, N);
    } else {
      tile<W, MT, 4, PREFETCH>(x + m * K, wb, 0, K, sb, y + m * N + n0, N);
    }
  });
}

// The [rows, out] fp32 product: outputs(y, n0) writes outputs [n0, n0 + 4) of every row, the blocks split over
// torch's threads (at least 16 a thread).
template <class Outputs>
torch::Tensor over_blocks(const torch::Tensor& x, const torch::Tensor& w, Outputs&& outputs) {
  auto y = torch::empty({x.size(0), w.size(0) * BLOCK}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) outputs(yp, b * BLOCK);
  });
  return y;
}

// What every product takes: [rows, in] fp32 activations, weights in the blocked layout with as many inputs.
void check_product(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), "activations and weights must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "activations must be a contiguous [rows, in] float32 tensor");
  TORCH_CHECK(x.size(1) % GROUP == 0, "inputs must be a multiple of 8, not ", x.size(1));
  TORCH_CHECK(w.dim() == 4 && w.size(2) == BLOCK && w.size(3) == GROUP && w.is_contiguous(),
              "weights must be in the kernel's blocked layout (rows.pack): a contiguous [out/4, in/8, 4, 8] "
              "tensor");
  TORCH_CHECK(w.size(1) * GROUP == x.size(1), "activations have ", x.size(1), " inputs, the weights ",
              w.size(1) * GROUP);
}

template <class W>
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& w, const typename W::T* weights,
                      const float* scale) {
  check_product(x, w);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * BLOCK;
  const float* xp = x.data_ptr<float>();
  return over_blocks(x, w, [&](float* y, int64_t n0) { block<W>(xp, M, weights, K, scale, y, N, n0); });
}

torch::Tensor bf16_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "weights must be bfloat16");
  return product<Bf16>(x, w, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), nullptr);
}

torch::Tensor int8_rows(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8, "weights must be int8");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == BLOCK && q.size(3) == GROUP,
              "weights must be in the kernel's blocked layout (rows.pack): a contiguous [out/4, in/8, 4, 8] tensor");
  TORCH_CHECK(scales.is_cpu() && scales.dim() == 1 && scales.scalar_type() == torch::kFloat32 &&
                  scales.is_contiguous() && scales.size(0) == q.size(0) * BLOCK,
              "scales must be a contiguous float32 vector, one per output");
  return product<Int8>(x, q, q.data_ptr<int8_t>(), scales.data_ptr<float>());
}


// Where the CPU multiplies bf16 pairs natively (AVX-512 BF16: AMD Zen 4, Intel Cooper Lake and Sapphire
// Rapids), bf16 weights are multiplied by bf16 activations with VDPBF16PS: two products a lane, accumulated
// in fp32, twice the pairs an instruction of the widen-and-FMA path above and no widening. The activations
// are rounded to bf16 once (round to nearest even, as torch's and oneDNN's bf16 products round them);
// denormal activations and products are flushed to zero, as the instruction does.
#define SPADE_BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool bf16_dot_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }();
  return supported;
}

SPADE_BF16DOT void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, x + i));
    _mm256_mask_storeu_epi16(out + i, tail, (__m256i)rounded);
  }
}

// y[m, n0 + n] for MT rows of bf16 x and the block of 4 outputs whose weights start at wb. A group of 8
// inputs of a block is one 64-byte register of 4 outputs x 8 weights, so one VDPBF16PS by the row's 8 inputs
// (broadcast to the 4 outputs' quarters) sums output n's pairs in lanes 4n..4n+3. Each lane accumulates its
// pairs in k's order (the instruction adds a pair's two products in its own fixed order), then the 4 lanes
// are summed in one fixed order: a row's result does not depend on the rows beside it or the tile it falls in.
template <int MT, bool PREFETCH>
SPADE_BF16DOT inline void dot_tile(const uint16_t* x, const uint16_t* wb, int64_t K, float* y, int64_t ldy) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += GROUP) {
    const uint16_t* group = wb + k * BLOCK;
    if constexpr (PREFETCH)
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(group) + PREFETCH_BYTES), _MM_HINT_T0);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(group);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv =
          (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + m * K + k)));
      acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m512 a = _mm512_add_ps(acc[m], _mm512_permute_ps(acc[m], 0x4E));  // lanes 0+2 and 1+3 of each quarter
    a = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));                    // then their sum
    _mm_storeu_ps(y + m * ldy, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, a)));
  }
}

torch::Tensor bf16_dot_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(bf16_dot_supported(), "this CPU has no AVX-512 BF16 (VDPBF16PS)");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "weights must be bfloat16");
  check_product(x, w);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * BLOCK;
  // Every element is written by the rounding: no zero-filling (a std::vector's) on the decode step's path.
  const std::unique_ptr<uint16_t[]> rounded(new uint16_t[static_cast<size_t>(M * K)]);
  round_to_bf16(x.data_ptr<float>(), M * K, rounded.get());
  const uint16_t* xp = rounded.get();
  const uint16_t* weights = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  return over_blocks(x, w, [&](float* y, int64_t n0) {
    const uint16_t* wb = weights + n0 * K;
    walk_rows(M, [&](auto rows, auto prefetch, int64_t m) {
      dot_tile<decltype(rows)::value, decltype(prefetch)::value>(xp + m * K, wb, K, y + m * N + n0, N);
    });
  });
}

// exp(x) for x <= 0 (softmax's shifted scores), 8 at a time: Cephes' expf, the polynomial after a
// split into 2^n * exp(r), |r| <= ln(2) / 2; relative error about 1e-7.
SPADE_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // below, exp underflows fp32's normal range; NaN stays NaN
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// The sums of 8 registers' lanes, as one register (lane j: the sum of a[j]'s lanes, in one fixed order).
SPADE_AVX2 inline __m256 sum_each(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// How many positions ahead a pass over keys or values asks for their lines.
constexpr int64_t AHEAD = 16;

// Ask for the cache lines of `count` values of type T from p on (within the buffer; a prefetch never faults).
template <class T>
SPADE_AVX2 inline void prefetch(const T* p, int64_t count) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t at = first; at < first + count * sizeof(T); at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
}

// out[g * D + d0, + 8 NV) = inverse_sums[g] * the sum over the kept positions l of p[g * L + l] * v[l], in
// their order, for the GB query heads g of one pass over the values.
template <int NV, int GB, class KV>
SPADE_AVX2 void weigh_values(const float* p, int64_t L, const int64_t* kept, int64_t count, const typename KV::T* v,
                             int64_t v_stride, int64_t d0, const float* inverse_sums, float* out, int64_t D) {
  __m256 acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t l = kept[i];
    const typename KV::T* row = v + l * v_stride + d0;
    if (KV::PREFETCH && i + AHEAD < count) prefetch(v + kept[i + AHEAD] * v_stride + d0, 8 * NV);
    __m256 w[GB];
    for (int g = 0; g < GB; ++g) w[g] = _mm256_set1_ps(p[g * L + l]);
    for (int j = 0; j < NV; ++j) {
      const __m256 values = KV::load(row + 8 * j);
      for (int g = 0; g < GB; ++g) acc[g][j] = _mm256_fmadd_ps(w[g], values, acc[g][j]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m256 inv = _mm256_set1_ps(inverse_sums[g]);
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + g * D + d0 + 8 * j, _mm256_mul_ps(acc[g][j], inv));
  }
}

// Every head of one pass (GB of them), their values NV registers of dims at a time.
template <int NV, int GB, class KV>
SPADE_AVX2 void weigh_all(const float* p, int64_t L, const int64_t* kept, int64_t count, const typename KV::T* v,
                          int64_t v_stride, const float* inverse_sums, float* out, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 8 * NV)
    weigh_values<NV, GB, KV>(p, L, kept, count, v, v_stride, d0, inverse_sums, out, D);
}

// The scores of GB query heads (q: their D values each, one after another) at positions [l, l + PB), PB <= 8,
// into s[g * L + l + j], scaled. Each is its dims' products summed lane by lane in the dims' order, then by
// sum_each's tree: a score's bits depend neither on the positions nor on the heads computed beside it.
template <int GB, int PB, class KV>
SPADE_AVX2 inline void score_block(const float* q, const typename KV::T* k, int64_t k_stride, int64_t l, int64_t L,
                                   int64_t D, __m256 scale8, float* s) {
  __m256 acc[GB][8];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 8; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[GB];
    for (int g = 0; g < GB; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);
    for (int j = 0; j < PB; ++j) {
      const __m256 keys = KV::load(k + (l + j) * k_stride + d);
      for (int g = 0; g < GB; ++g) acc[g][j] = _mm256_fmadd_ps(qv[g], keys, acc[g][j]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m256 scores = _mm256_mul_ps(sum_each(acc[g]), scale8);
    if constexpr (PB == 8) {
      _mm256_storeu_ps(s + g * L + l, scores);
    } else {
      alignas(32) float lane[8];
      _mm256_store_ps(lane, scores);
      for (int j = 0; j < PB; ++j) s[g * L + l + j] = lane[j];
    }
  }
}

// Every position's score for the GB heads of one pass over the keys: KV::POSITIONS at a time (3 heads of 4:
// their accumulators, queries and one key fill the 16 registers), the rest one at a time.
template <int GB, class KV>
SPADE_AVX2 void score_all(const float* q, const typename KV::T* k, int64_t k_stride, int64_t L, int64_t D,
                          __m256 scale8, float* s) {
  constexpr int PB = KV::POSITIONS;
  int64_t l = 0;
  for (; l + PB <= L; l += PB) {
    if (KV::PREFETCH && l + AHEAD + PB <= L)
      for (int64_t j = 0; j < PB; ++j) prefetch(k + (l + AHEAD + j) * k_stride, D);
    score_block<GB, PB, KV>(q, k, k_stride, l, L, D, scale8, s);
  }
  for (; l < L; ++l) score_block<GB, 1, KV>(q, k, k_stride, l, L, D, scale8, s);
}

// One query position's attention for every row and head: softmax(scale * q k^T over the row's kept
// positions) v, each group of H / KVH query heads on its key/value head (grouped-query attention), in fp32.
// Each (row, key/value head) is one task and sums over its own kept positions in their order, so a row's
// result does not depend on the rows beside it or on its padding (masked positions are never read after
// their scores). A row with no kept position gets zeros.
template <class KV>
SPADE_AVX2 void attend_head(const float* q, const typename KV::T* k, const typename KV::T* v, int64_t k_stride,
                            int64_t v_stride, const bool* keep, int64_t L, int64_t G, int64_t D, float scale, float* out,
                            std::vector<float>& scores, std::vector<int64_t>& kept) {
  kept.clear();
  for (int64_t l = 0; l < L; ++l)
    if (keep == nullptr || keep[l]) kept.push_back(l);
  const int64_t count = static_cast<int64_t>(kept.size());
  scores.resize(G * L);  // every position's score is written below
  std::vector<float> maxima(G, -INFINITY), inverse_sums(G, 0.0f);
  // Scores, KV::HEADS heads of the group a pass over the keys (a bf16 key streams from memory and is widened
  // once for three heads).
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int64_t g0 = 0; g0 < G; g0 += KV::HEADS) {
    const int64_t heads = std::min<int64_t>(KV::HEADS, G - g0);
    const float* qg = q + g0 * D;
    float* sg = scores.data() + g0 * L;
    if (heads == 3) score_all<3, KV>(qg, k, k_stride, L, D, scale8, sg);
    else if (heads == 2) score_all<2, KV>(qg, k, k_stride, L, D, scale8, sg);
    else score_all<1, KV>(qg, k, k_stride, L, D, scale8, sg);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* sg = scores.data() + g * L;
    for (int64_t i = 0; i < count; ++i) {  // a NaN score makes the head's output NaN, as SDPA's
      const float score = sg[kept[i]];
      if (score > maxima[g] || std::isnan(score)) maxima[g] = score;
    }
  }
  // exp(s - max) at every position, 8 at a time (a padded row's too: one position at a time cost 3 ms a step
  // for a row of 1,500; the masked ones are never read), then the sum over the kept positions, the i-th in
  // lane i % 8: the same order whatever the row's padding.
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * L;
    const __m256 m = _mm256_set1_ps(maxima[g]);
    int64_t l = 0;
    for (; l + 8 <= L; l += 8) _mm256_storeu_ps(sg + l, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + l), m)));
    if (l < L) {
      alignas(32) float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t j = l; j < L; ++j) lane[j - l] = sg[j] - maxima[g];
      _mm256_store_ps(lane, exp_nonpositive(_mm256_load_ps(lane)));
      for (int64_t j = l; j < L; ++j) sg[j] = lane[j - l];
    }
    __m256 total = _mm256_setzero_ps();
    int64_t i = 0;
    if (count == L) {  // kept[i] == i
      for (; i + 8 <= count; i += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(sg + i));
    } else {
      alignas(32) float lane[8];
      for (; i + 8 <= count; i += 8) {
        for (int j = 0; j < 8; ++j) lane[j] = sg[kept[i + j]];
        total = _mm256_add_ps(total, _mm256_load_ps(lane));
      }
    }
    float sum = horizontal_sum(total);
    for (; i < count; ++i) sum += sg[kept[i]];
    inverse_sums[g] = count > 0 ? 1.0f / sum : 0.0f;  // no kept position: zeros (SDPA gives NaN)
  }
  // The values, KV::HEADS heads a pass, KV::VALUE_REGISTERS registers of dims at a time where they divide, else 2.
  constexpr int NV = KV::VALUE_REGISTERS;
  for (int64_t g0 = 0; g0 < G; g0 += KV::HEADS) {
    const int64_t heads = std::min<int64_t>(KV::HEADS, G - g0);
    const float* p = scores.data() + g0 * L;
    const float* inv = inverse_sums.data() + g0;
    float* o = out + g0 * D;
    const bool wide = D % (8 * NV) == 0;
    if (heads == 3) {
      if (wide) weigh_all<NV, 3, KV>(p, L, kept.data(), count, v, v_stride, inv, o, D);
      else weigh_all<2, 3, KV>(p, L, kept.data(), count, v, v_stride, inv, o, D);
    } else if (heads == 2) {
      if (wide) weigh_all<NV, 2, KV>(p, L, kept.data(), count, v, v_stride, inv, o, D);
      else weigh_all<2, 2, KV>(p, L, kept.data(), count, v, v_stride, inv, o, D);
    } else {
      if (wide) weigh_all<NV, 1, KV>(p, L, kept.data(), count, v, v_stride, inv, o, D);
      else weigh_all<2, 1, KV>(p, L, kept.data(), count, v, v_stride, inv, o, D);
    }
  }
}

// Every (row, key/value head) of a step, as attend_head takes them: keys and values of type KV.
template <class KV>
void attend_rows(const float* qp, const typename KV::T* kp, const typename KV::T* vp, const torch::Tensor& k,
                 const torch::Tensor& v, const bool* keep, int64_t R, int64_t H, int64_t KVH, int64_t L, int64_t D,
                 float scale, float* op) {
  const int64_t G = H / KVH;
  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> kept;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / KVH, h = t % KVH;
      attend_head<KV>(qp + (r * H + h * G) * D, kp + r * k.stride(0) + h * k.stride(1),
                      vp + r * v.stride(0) + h * v.stride(1), k.stride(2), v.stride(2), keep ? keep + r * L : nullptr,
                      L, G, D, scale, op + (r * H + h * G) * D, scores, kept);
    }
  });
}

// Keys and values in fp32, or in bf16 (the engine's decode batch keeps them so where its bf16 steps multiply
// natively: half the bytes a step's attention reads; each is widened exactly, the arithmetic is the same).
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(), "query, keys and values must be on the CPU");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "the query must be float32");
  TORCH_CHECK((k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16) &&
                  v.scalar_type() == k.scalar_type(),
              "keys and values must both be float32 or both bfloat16");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.is_contiguous(),
              "the query must be a contiguous [rows, heads, 1, dim]");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "keys and values must be [rows, kv_heads, length, dim] alike");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(3), KVH = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == R && k.size(3) == D, "keys and values must have the query's rows and dim");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "the query's heads must be a multiple of the key/value heads");
  TORCH_CHECK(D % 16 == 0, "the head dim must be a multiple of 16, not ", D);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "each key and value must be contiguous");
  const bool* keep = nullptr;
  torch::Tensor keep_tensor;
  if (mask.has_value()) {
    TORCH_CHECK(mask->is_cpu(), "the mask must be on the CPU");
    keep_tensor = mask->to(torch::kBool).contiguous();
    TORCH_CHECK(keep_tensor.dim() == 2 && keep_tensor.size(0) == R && keep_tensor.size(1) == L,
                "the mask must be [rows, length]");
    keep = keep_tensor.data_ptr<bool>();
  }
  auto out = torch::empty({R, H, 1, D}, q.options());
  const float scale32 = static_cast<float>(scale);
  if (k.scalar_type() == torch::kBFloat16) {
    const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
    const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
    attend_rows<Bf16>(q.data_ptr<float>(), kp, vp, k, v, keep, R, H, KVH, L, D, scale32, out.data_ptr<float>());
  } else {
    attend_rows<F32>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k, v, keep, R, H, KVH, L, D,
                     scale32, out.data_ptr<float>());
  }
  return out;
}

// ---- The decode step's elementwise work (services/inference/llama_decode.py) ----------------------------------
// One call for what took torch several operators on a few rows of a few hundred values each (a norm six, the
// rotary embedding five, SiLU and its product three): at 4-8 rows their dispatch, not their arithmetic, was
// a fifth of a step. Each row is computed alone, so a row's bits depend on no other row.

// x <- x + delta where delta is given (the residual stream, in place), then y = w * (x * (1 / sqrt(mean(x^2) +
// eps))): LlamaRMSNorm in fp32. The squares are summed 8 lanes at a time in the dims' order, then in one fixed
// horizontal order.
SPADE_AVX2 void norm_row(float* x, const float* delta, const float* w, int64_t D, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 v = _mm256_loadu_ps(x + d);
    if (delta != nullptr) {
      v = _mm256_add_ps(v, _mm256_loadu_ps(delta + d));
      _mm256_storeu_ps(x + d, v);
    }
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = horizontal_sum(acc);
  for (; d < D; ++d) {
    if (delta != nullptr) x[d] += delta[d];
    sum += x[d] * x[d];
  }
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  const __m256 inverse8 = _mm256_set1_ps(inverse);
  for (d = 0; d + 8 <= D; d += 8)
    _mm256_storeu_ps(y + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(x + d), inverse8)));
  for (; d < D; ++d) y[d] = w[d] * (x[d] * inverse);
}

torch::Tensor rms_norm(torch::Tensor x, const c10::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                       double eps) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() >= 1,
              "the hidden states must be a contiguous float32 CPU tensor");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == D,
              "the norm's weight must be a contiguous float32 [", D, "]");
  torch::Tensor added;  // contiguous here (a product's output already is), not by a call from Python
  if (delta.has_value()) {
    TORCH_CHECK(delta->scalar_type() == torch::kFloat32 && delta->sizes() == x.sizes(),
                "what is added must be a float32 tensor of the hidden states' shape");
    added = delta->contiguous();
  }
  const float* dp = added.defined() ? added.data_ptr<float>() : nullptr;
  auto y = torch::empty_like(x);
  const int64_t R = D > 0 ? x.numel() / D : 0;
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    norm_row(xp + r * D, dp ? dp + r * D : nullptr, wp, D, static_cast<float>(eps), yp + r * D);
  return y;
}

// The rotary embedding of the first `rotated` of each row's `heads` heads, in place: with h = D / 2,
// x[i] cos[i] - x[i + h] sin[i] and x[i + h] cos[i + h] + x[i] sin[i + h], each product rounded and then summed, as
// transformers' apply_rotary_pos_emb computes them in fp32: no FMA (this function's target has none), the same bits.
__attribute__((target("avx2"))) void rotate_row(float* x, int64_t rotated, int64_t D, const float* c, const float* s) {
  const int64_t h = D / 2;
  for (int64_t head = 0; head < rotated; ++head) {
    float* a = x + head * D;
    float* b = a + h;
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
      const __m256 av = _mm256_loadu_ps(a + i), bv = _mm256_loadu_ps(b + i);
      const __m256 first = _mm256_sub_ps(_mm256_mul_ps(av, _mm256_loadu_ps(c + i)),
                                         _mm256_mul_ps(bv, _mm256_loadu_ps(s + i)));
      const __m256 second = _mm256_add_ps(_mm256_mul_ps(bv, _mm256_loadu_ps(c + h + i)),
                                          _mm256_mul_ps(av, _mm256_loadu_ps(s + h + i)));
      _mm256_storeu_ps(a + i, first);
      _mm256_storeu_ps(b + i, second);
    }
    for (; i < h; ++i) {
      const float av = a[i], bv = b[i];
      const float p = av * c[i], q = bv * s[i], r = bv * c[h + i], t = av * s[h + i];
      a[i] = p - q;
      b[i] = r + t;
    }
  }
}

void rotate(torch::Tensor x, int64_t heads, int64_t rotated, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "the projections must be a contiguous float32 CPU tensor");
  TORCH_CHECK(heads > 0 && rotated >= 0 && rotated <= heads, "rotated heads must be 0 to heads (", heads, "), not ",
              rotated);
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 [rows, head_dim]");
  const int64_t R = cos.size(0), D = cos.size(1);
  TORCH_CHECK(D % 2 == 0 && x.numel() == R * heads * D, "the projections must be [rows, ", heads, " * ", D, "]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) rotate_row(xp + r * heads * D, rotated, D, cp + r * D, sp + r * D);
}

// exp(x) 8 at a time for x up to 88 (larger: exp(88)): exp_nonpositive's polynomial holds there too.
SPADE_AVX2 inline __m256 exp_clamped(__m256 x) { return exp_nonpositive(_mm256_min_ps(_mm256_set1_ps(88.0f), x)); }

// y[r, i] = silu(g) u = g / (1 + exp(-g)) u for g = gu[r, i], u = gu[r, I + i] (the MLP's stacked gate and up); the
// last few of a row through the same 8 lanes as the others.
SPADE_AVX2 inline __m256 silu_times(__m256 g, __m256 u) {
  const __m256 e = exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

SPADE_AVX2 void silu_mul_row(const float* gu, int64_t I, float* y) {
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) _mm256_storeu_ps(y + i, silu_times(_mm256_loadu_ps(gu + i), _mm256_loadu_ps(gu + I + i)));
  if (i < I) {
    alignas(32) float g[8] = {0, 0, 0, 0, 0, 0, 0, 0}, u[8] = {0, 0, 0, 0, 0, 0, 0, 0}, out[8];
    for (int64_t j = i; j < I; ++j) g[j - i] = gu[j], u[j - i] = gu[I + j];
    _mm256_store_ps(out, silu_times(_mm256_load_ps(g), _mm256_load_ps(u)));
    for (int64_t j = i; j < I; ++j) y[j] = out[j - i];
  }
}

torch::Tensor silu_mul(const torch::Tensor& projections) {
  TORCH_CHECK(projections.is_cpu() && projections.scalar_type() == torch::kFloat32 && projections.dim() >= 1 &&
                  projections.size(-1) % 2 == 0,
              "the gate and up projections must be a float32 CPU [..., 2 * intermediate]");
  const torch::Tensor gate_up = projections.contiguous();
  const int64_t I = gate_up.size(-1) / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gate_up.options());
  const int64_t R = I > 0 ? gate_up.numel() / (2 * I) : 0;
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) silu_mul_row(gp + r * 2 * I, I, yp + r * I);
  return y;
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
  m.def("bf16_dot_rows", &bf16_dot_rows,
        "[rows, in] fp32 activations rounded to bf16 times bf16 weights (blocked), VDPBF16PS: [rows, out] fp32",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_dot_supported", &bf16_dot_supported, "whether this CPU has AVX-512 BF16 (VDPBF16PS)");
  m.def("rms_norm", &rms_norm,
        "LlamaRMSNorm of each row of fp32 x ([..., D]) with weight [D]; with delta, x += delta first (in place)",
        py::arg("x"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("rotate", &rotate,
        "the rotary embedding of the first `rotated` of each row's `heads` heads of fp32 x ([rows, heads * D]), "
        "in place, with cos and sin [rows, D]",
        py::arg("x"), py::arg("heads"), py::arg("rotated"), py::arg("cos"), py::arg("sin"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of fp32 [..., 2 * I] (gate first): [..., I]",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention,
        "one query position's attention: q [rows, heads, 1, dim] fp32, k and v [rows, kv_heads, length, dim] fp32 "
        "or bf16, "
        "mask [rows, length] (true: attend) or None, scale: [rows, heads, 1, dim] fp32",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
}
