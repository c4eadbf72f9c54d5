// Causal attention for x86-64 CPUs with AVX-512: a prompt's prefill in the inference engine and the learner's
// forward and backward passes (spade/attention.py). torch's SDPA reached ~100 GFLOP/s here on SmolLM2's
// 64-dim heads, against ~800 for the model's products; this kernel reaches ~250-300 in fp32.
//
// Queries [H, n, D] attend to keys and values [KVH, T, D] (grouped-query attention: the H / KVH query heads of
// a group share a key/value head). Query i sees keys [0, T - n + i]: the keys before the queries are a prefix
// they all see (a cached prompt, or the learner's shared prefix), the rest causally.
//
// A task is a key/value head and a block of query positions: its rows (every head of the group at each
// position) are scored against the keys transposed ([D][T], so a register holds 16 keys' products), the
// scores of a row are softmaxed exactly (its max, then exp and the sum), and the values weighed, a tile of
// rows at a time. Every row sums its products in one order (dims in order for a score, keys in order for an
// output), whatever rows or tasks are beside it: a query's result does not depend on how many queries came
// with it. Arithmetic is fp32 throughout (bf16 inputs are widened by the caller). Both calls release Python's GIL,
// as torch's operators do: the embedded run's inference engine works in another thread meanwhile.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

#define SPADE_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

constexpr int TILE = 6;   // rows a tile: 6 rows x 4 registers of accumulators, their operands beside them
constexpr int LANES = 16;  // fp32 lanes of a register
constexpr int64_t KEY_BLOCK = 64;  // keys are transposed and scored in blocks of this many

bool supported() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"); }

// exp(x) for x <= 0 (softmax's shifted scores), 16 at a time: Cephes' expf, relative error about 1e-7.
SPADE_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// s[r][j] = scale * (a_r . bt[:, j]) for R rows a_r (D values each, lda apart) and keys [j0, j0 + 16 NK) of bt
// ([D][ldb], transposed): the products summed in the dims' order.
template <int R, int NK>
SPADE_AVX512 inline void dot_tile(const float* a, int64_t lda, const float* bt, int64_t ldb, int64_t D, int64_t j0,
                                  float scale, float* s, int64_t lds) {
  __m512 acc[R][NK];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NK; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 keys[NK];
    for (int c = 0; c < NK; ++c) keys[c] = _mm512_loadu_ps(bt + d * ldb + j0 + LANES * c);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + d]);
      for (int c = 0; c < NK; ++c) acc[r][c] = _mm512_fmadd_ps(x, keys[c], acc[r][c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NK; ++c) _mm512_storeu_ps(s + r * lds + j0 + LANES * c, _mm512_mul_ps(acc[r][c], sc));
}

// dot_tile over keys [0, n) (n rounded up to 16: bt is zero-padded to a whole block).
template <int R>
SPADE_AVX512 void dot_rows(const float* a, int64_t lda, const float* bt, int64_t ldb, int64_t D, int64_t n, float scale,
                           float* s, int64_t lds) {
  int64_t j = 0;
  for (; j + 4 * LANES <= n; j += 4 * LANES) dot_tile<R, 4>(a, lda, bt, ldb, D, j, scale, s, lds);
  for (; j < n; j += LANES) dot_tile<R, 1>(a, lda, bt, ldb, D, j, scale, s, lds);
}

// out[r][d0, d0 + 16 NV) = factor[r] * sum over j in [0, n) of w[r][j] * m[j][d0, ...), keys in order.
template <int R, int NV>
SPADE_AVX512 inline void weigh_tile(const float* w, int64_t ldw, const float* m, int64_t D, int64_t n, int64_t d0,
                                    const float* factor, float* out, int64_t ldo) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vals[NV];
    for (int c = 0; c < NV; ++c) vals[c] = _mm512_loadu_ps(m + j * D + d0 + LANES * c);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(w[r * ldw + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(x, vals[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 f = _mm512_set1_ps(factor[r]);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + r * ldo + d0 + LANES * c, _mm512_mul_ps(acc[r][c], f));
  }
}

template <int R>
SPADE_AVX512 void weigh_rows(const float* w, int64_t ldw, const float* m, int64_t D, int64_t n, const float* factor,
                             float* out, int64_t ldo) {
  int64_t d0 = 0;
  for (; d0 + 4 * LANES <= D; d0 += 4 * LANES) weigh_tile<R, 4>(w, ldw, m, D, n, d0, factor, out, ldo);
  for (; d0 < D; d0 += LANES) weigh_tile<R, 1>(w, ldw, m, D, n, d0, factor, out, ldo);
}

// acc[j][d0, ...) += sum over the R rows of w[r][j] * x[r][d0, ...), for j in [0, n): a gradient of the keys or
// values, the rows in order.
template <int R, int NV>
SPADE_AVX512 inline void spread_tile(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t D, int64_t n,
                                     int64_t d0, float* acc) {
  __m512 rows[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) rows[r][c] = _mm512_loadu_ps(x + r * ldx + d0 + LANES * c);
  for (int64_t j = 0; j < n; ++j) {
    float* out = acc + j * D + d0;
    __m512 sum[NV];
    for (int c = 0; c < NV; ++c) sum[c] = _mm512_loadu_ps(out + LANES * c);
    for (int r = 0; r < R; ++r) {
      const __m512 f = _mm512_set1_ps(w[r * ldw + j]);
      for (int c = 0; c < NV; ++c) sum[c] = _mm512_fmadd_ps(f, rows[r][c], sum[c]);
    }
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + LANES * c, sum[c]);
  }
}

template <int R>
SPADE_AVX512 void spread_rows(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t D, int64_t n,
                              float* acc) {
  int64_t d0 = 0;
  for (; d0 + 4 * LANES <= D; d0 += 4 * LANES) spread_tile<R, 4>(w, ldw, x, ldx, D, n, d0, acc);
  for (; d0 < D; d0 += LANES) spread_tile<R, 1>(w, ldw, x, ldx, D, n, d0, acc);
}

// Every rows' tile of a task: TILE rows at a time, then the rest one by one.
template <class Tile>
SPADE_AVX512 inline void by_tiles(int64_t rows, Tile&& tile) {
  int64_t r = 0;
  for (; r + TILE <= rows; r += TILE) tile(std::integral_constant<int, TILE>(), r);
  for (; r < rows; ++r) tile(std::integral_constant<int, 1>(), r);
}

SPADE_AVX512 float dot(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

// The shapes of a call and the task layout they imply.
struct Shape {
  int64_t H, n, D, KVH, T, G, offset, ldk, positions, blocks;
  Shape(const torch::Tensor& q, const torch::Tensor& k) {
    H = q.size(0), n = q.size(1), D = q.size(2), KVH = k.size(0), T = k.size(1);
    G = H / KVH;
    offset = T - n;
    ldk = (T + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    positions = std::max<int64_t>(1, TILE / G);
    blocks = (n + positions - 1) / positions;
  }
  // Task t: key/value head t % KVH and a block of positions, cheap and costly blocks alternating (the causal
  // blocks' cost grows with their position), so torch's even split of the tasks gives each thread the same work.
  void task(int64_t t, int64_t& h, int64_t& p0, int64_t& pn) const {
    h = t % KVH;
    const int64_t i = t / KVH, b = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
    p0 = b * positions;
    pn = std::min(positions, n - p0);
  }
  int64_t tasks() const { return KVH * blocks; }
};

// [KVH, D, ldk]: each head's [T, D] transposed and zero-padded to whole key blocks.
torch::Tensor transposed(const torch::Tensor& m, const Shape& s) {
  auto t = torch::zeros({s.KVH, s.D, s.ldk}, m.options());
  t.narrow(2, 0, s.T).copy_(m.transpose(1, 2));
  return t;
}

// The rows of a task, gathered: row pi * G + g is query head h * G + g at position p0 + pi.
SPADE_AVX512 void gather(const float* src, const Shape& s, int64_t h, int64_t p0, int64_t pn, float* rows) {
  for (int64_t pi = 0; pi < pn; ++pi)
    for (int64_t g = 0; g < s.G; ++g) {
      const float* from = src + ((h * s.G + g) * s.n + p0 + pi) * s.D;
      std::copy(from, from + s.D, rows + (pi * s.G + g) * s.D);
    }
}

SPADE_AVX512 void scatter(const float* rows, const Shape& s, int64_t h, int64_t p0, int64_t pn, float* dst) {
  for (int64_t pi = 0; pi < pn; ++pi)
    for (int64_t g = 0; g < s.G; ++g) {
      const float* from = rows + (pi * s.G + g) * s.D;
      std::copy(from, from + s.D, dst + ((h * s.G + g) * s.n + p0 + pi) * s.D);
    }
}

// exp(s - shift) over a row's first `seen` keys, zero from there to `width`; returns their sum.
SPADE_AVX512 float exp_row(float* row, int64_t seen, int64_t width, float shift) {
  const __m512 m = _mm512_set1_ps(shift);
  __m512 total = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + LANES <= seen; j += LANES) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
    _mm512_storeu_ps(row + j, e);
    total = _mm512_add_ps(total, e);
  }
  if (j < seen) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (seen - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), m)));
    _mm512_storeu_ps(row + j, e);
    total = _mm512_add_ps(total, e);
    j += LANES;
  }
  std::fill(row + std::min(j, width), row + width, 0.0f);
  return _mm512_reduce_add_ps(total);
}

SPADE_AVX512 float row_max(const float* row, int64_t seen) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + LANES <= seen; j += LANES) m = _mm512_max_ps(m, _mm512_loadu_ps(row + j));
  float best = _mm512_reduce_max_ps(m);
  for (; j < seen; ++j) best = std::max(best, row[j]);
  return best;
}

// The keys a task's rows see: row r = pi * G + g sees offset + p0 + pi + 1.
inline int64_t seen(const Shape& s, int64_t p0, int64_t r) { return s.offset + p0 + r / s.G + 1; }

struct Scratch {
  std::vector<float> a, b, p, x;
};

// One task's forward: its rows' outputs and log-sum-exps.
SPADE_AVX512 void forward_task(int64_t t, const Shape& s, const float* q, const float* kt, const float* v, float scale,
                               float* out, float* lse, Scratch& w) {
  int64_t h, p0, pn;
  s.task(t, h, p0, pn);
  const int64_t rows = pn * s.G, keys = s.offset + p0 + pn;
  const int64_t width = (keys + LANES - 1) / LANES * LANES;
  w.a.resize(rows * s.D);
  w.b.resize(rows * s.D);
  w.p.resize(rows * width);
  w.x.resize(rows);
  gather(q, s, h, p0, pn, w.a.data());
  const float* kth = kt + h * s.D * s.ldk;
  by_tiles(rows, [&](auto R, int64_t r) {
    dot_rows<decltype(R)::value>(w.a.data() + r * s.D, s.D, kth, s.ldk, s.D, keys, scale, w.p.data() + r * width, width);
  });
  for (int64_t r = 0; r < rows; ++r) {
    float* row = w.p.data() + r * width;
    const int64_t n = seen(s, p0, r);
    const float m = row_max(row, n);
    const float sum = exp_row(row, n, width, m);
    w.x[r] = 1.0f / sum;
    const int64_t pi = r / s.G, g = r % s.G;
    lse[(h * s.G + g) * s.n + p0 + pi] = m + std::log(sum);
  }
  const float* vh = v + h * s.T * s.D;
  by_tiles(rows, [&](auto R, int64_t r) {
    weigh_rows<decltype(R)::value>(w.p.data() + r * width, width, vh, s.D, keys, w.x.data() + r, w.b.data() + r * s.D,
                                   s.D);
  });
  scatter(w.b.data(), s, h, p0, pn, out);
}

// One task's backward: its rows' query gradients, and their parts of the keys' and values' (into dk, dv).
SPADE_AVX512 void backward_task(int64_t t, const Shape& s, const float* q, const float* k, const float* kt,
                                const float* vt, const float* out, const float* dout, const float* lse, float scale,
                                float* dq, float* dk, float* dv, Scratch& w) {
  int64_t h, p0, pn;
  s.task(t, h, p0, pn);
  const int64_t rows = pn * s.G, keys = s.offset + p0 + pn;
  const int64_t width = (keys + LANES - 1) / LANES * LANES;
  w.a.resize(rows * s.D);
  w.b.resize(rows * s.D);
  w.p.resize(2 * rows * width);
  w.x.resize(2 * rows);
  float* p = w.p.data();
  float* ds = w.p.data() + rows * width;
  gather(q, s, h, p0, pn, w.a.data());
  gather(dout, s, h, p0, pn, w.b.data());
  const float* kth = kt + h * s.D * s.ldk;
  const float* vth = vt + h * s.D * s.ldk;
  by_tiles(rows, [&](auto R, int64_t r) {
    constexpr int RR = decltype(R)::value;
    dot_rows<RR>(w.a.data() + r * s.D, s.D, kth, s.ldk, s.D, keys, scale, p + r * width, width);
    dot_rows<RR>(w.b.data() + r * s.D, s.D, vth, s.ldk, s.D, keys, 1.0f, ds + r * width, width);
  });
  std::vector<float> orow(s.D);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pi = r / s.G, g = r % s.G, at = (h * s.G + g) * s.n + p0 + pi;
    float* prow = p + r * width;
    exp_row(prow, seen(s, p0, r), width, lse[at]);  // the probabilities, from the forward's log-sum-exp
    const float delta = dot(w.b.data() + r * s.D, out + at * s.D, s.D);
    float* drow = ds + r * width;
    const __m512 dl = _mm512_set1_ps(delta), sc = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < width; j += LANES) {  // dS = P (dP - delta), times the scale (zero where P is)
      const __m512 pv = _mm512_loadu_ps(prow + j);
      _mm512_storeu_ps(drow + j, _mm512_mul_ps(_mm512_mul_ps(pv, _mm512_sub_ps(_mm512_loadu_ps(drow + j), dl)), sc));
    }
    w.x[r] = 1.0f;
  }
  const float* kh = k + h * s.T * s.D;
  std::vector<float> dqrows(rows * s.D);
  by_tiles(rows, [&](auto R, int64_t r) {
    constexpr int RR = decltype(R)::value;
    weigh_rows<RR>(ds + r * width, width, kh, s.D, keys, w.x.data(), dqrows.data() + r * s.D, s.D);
    spread_rows<RR>(p + r * width, width, w.b.data() + r * s.D, s.D, s.D, keys, dv + h * s.T * s.D);
    spread_rows<RR>(ds + r * width, width, w.a.data() + r * s.D, s.D, s.D, keys, dk + h * s.T * s.D);
  });
  scatter(dqrows.data(), s, h, p0, pn, dq);
}

void check(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(supported(), "causal attention needs a CPU with AVX-512 (F and DQ)");
  for (const auto* x : {&q, &k, &v}) {
    TORCH_CHECK(x->is_cpu() && x->scalar_type() == torch::kFloat32 && x->dim() == 3 && x->is_contiguous(),
                "queries, keys and values must be contiguous float32 [heads, length, dim] on the CPU");
  }
  TORCH_CHECK(k.sizes() == v.sizes(), "keys and values must have one shape");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) % LANES == 0, "the head dim must be the keys' and a multiple of 16");
  TORCH_CHECK(q.size(0) > 0 && k.size(0) > 0 && q.size(0) % k.size(0) == 0,
              "the query heads must be a positive multiple of the key/value heads");
  TORCH_CHECK(q.size(1) <= k.size(1), "there must be at least as many keys as queries (query i sees T - n + i + 1)");
}

}  // namespace

std::vector<torch::Tensor> causal_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          double scale) {
  check(q, k, v);
  const Shape s(q, k);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({s.H, s.n}, q.options());
  if (s.n == 0) return {out, lse};
  const auto kt = transposed(k, s);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, s.tasks(), 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t t = begin; t < end; ++t)
      forward_task(t, s, q.data_ptr<float>(), kt.data_ptr<float>(), v.data_ptr<float>(), sc, out.data_ptr<float>(),
                   lse.data_ptr<float>(), w);
  });
  return {out, lse};
}

std::vector<torch::Tensor> causal_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& out, const torch::Tensor& dout, const torch::Tensor& lse,
                                           double scale) {
  check(q, k, v);
  TORCH_CHECK(out.sizes() == q.sizes() && dout.sizes() == q.sizes() && out.is_contiguous() && dout.is_contiguous() &&
                  out.scalar_type() == torch::kFloat32 && dout.scalar_type() == torch::kFloat32,
              "the output and its gradient must be contiguous float32 shaped as the queries");
  const Shape s(q, k);
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == torch::kFloat32 && lse.numel() == s.H * s.n,
              "the log-sum-exps must be the forward's, float32 [heads, length]");
  auto dq = torch::empty_like(q);
  if (s.n == 0) return {dq, torch::zeros_like(k), torch::zeros_like(v)};
  const auto kt = transposed(k, s), vt = transposed(v, s);
  const float sc = static_cast<float>(scale);
  // Each thread adds its tasks' parts of the keys' and values' gradients into its own buffers, summed after.
  const int threads = at::get_num_threads();
  auto parts = torch::zeros({threads, 2, s.KVH, s.T, s.D}, q.options());
  at::parallel_for(0, s.tasks(), 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    float* mine = parts.data_ptr<float>() + at::get_thread_num() * 2 * s.KVH * s.T * s.D;
    for (int64_t t = begin; t < end; ++t)
      backward_task(t, s, q.data_ptr<float>(), k.data_ptr<float>(), kt.data_ptr<float>(), vt.data_ptr<float>(),
                    out.data_ptr<float>(), dout.data_ptr<float>(), lse.data_ptr<float>(), sc, dq.data_ptr<float>(),
                    mine, mine + s.KVH * s.T * s.D, w);
  });
  auto summed = parts.sum(0);
  return {dq, summed[0], summed[1]};
}

bool causal_supported() { return supported(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_forward", &causal_forward,
        "causal grouped-query attention of q [H, n, D] on k, v [KVH, T, D] (query i sees keys [0, T - n + i]), "
        "fp32: (out [H, n, D], log-sum-exp [H, n])",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("causal_backward", &causal_backward, "the gradients (dq, dk, dv) of causal_forward's output",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("dout"), py::arg("lse"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("causal_supported", &causal_supported, "whether this CPU runs the kernel (AVX-512 F and DQ)");
}
