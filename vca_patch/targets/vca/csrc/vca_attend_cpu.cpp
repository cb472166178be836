// VCA's attention core as one CPU op (float32 inference): everything between the q/k/v projection and `proj`.
//
// Per (image, head), Stage I: pool the query grid to n tokens, add e±, read all N keys (flash-style key blocks,
// online softmax), v̂ = RMSNorm₁(u₊ − λ₁u₋). Per (image, head, block of rows), Stage II: softmax over the 2n
// contrast tokens against [v̂; −λ₂v̂], RMSNorm₂, plus the depthwise 3×3 conv of the value grid. The composite
// path runs ~25 small ATen kernels for this on a 224 px image, each a cold call; here it is one parallel region.
//
// The GEMMs are BLAS `sgemm_` (MKL in PyTorch's x86 builds); exponentials are ATen's vectorised exp_u20.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kKeyBlock = 512;  // Stage-I keys per block: the logits block stays in L2
constexpr int64_t kRowBlock = 256;  // Stage-II query rows per task, at most (fewer when threads would idle)

// Row-major c[m×n] = alpha·a[m×k]·op(b) + beta·c, op(b) = b [k×n] or bᵀ (b stored [n×k]); ld* are row strides.
void gemm_rows(bool b_transposed, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // Column-major BLAS computes cᵀ[n×m] = op(b)ᵀ·aᵀ.
  const char tb = b_transposed ? 'T' : 'N', ta = 'N';
  const int m_ = static_cast<int>(n), n_ = static_cast<int>(m), k_ = static_cast<int>(k);
  const int ldb_ = static_cast<int>(ldb), lda_ = static_cast<int>(lda), ldc_ = static_cast<int>(ldc);
  sgemm_(&tb, &ta, &m_, &n_, &k_, &alpha, b, &ldb_, a, &lda_, &beta, c, &ldc_);
}

inline Vec load(const float* p, int64_t count) { return count == kLanes ? Vec::loadu(p) : Vec::loadu(p, count); }

inline void store(const Vec& v, float* p, int64_t count) {
  if (count == kLanes) {
    v.store(p);
  } else {
    v.store(p, count);
  }
}

inline float lane_sum(const Vec& v) {
  alignas(64) float lanes[kLanes];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

float row_max(const float* x, int64_t len) {
  const Vec lowest(-std::numeric_limits<float>::infinity());
  Vec m0 = lowest, m1 = lowest;  // clamp_min is a plain vmaxps: logits are finite, no NaN propagation needed
  int64_t i = 0;
  for (; i + 2 * kLanes <= len; i += 2 * kLanes) {
    m0 = at::vec::clamp_min(Vec::loadu(x + i), m0);
    m1 = at::vec::clamp_min(Vec::loadu(x + i + kLanes), m1);
  }
  for (; i < len; i += kLanes) {
    const int64_t count = std::min(kLanes, len - i);
    m0 = at::vec::clamp_min(Vec::set(lowest, load(x + i, count), count), m0);
  }
  alignas(64) float lanes[kLanes];
  at::vec::clamp_min(m0, m1).store(lanes);
  return *std::max_element(lanes, lanes + kLanes);
}

// x[0:len] <- exp(x − shift); returns Σ exp. Normalising is left to the caller (on the d-wide output rows).
float exp_sum_(float* x, int64_t len, float shift) {
  const Vec vshift(shift);
  Vec s0(0.f), s1(0.f);
  int64_t i = 0;
  for (; i + 2 * kLanes <= len; i += 2 * kLanes) {
    const Vec e0 = (Vec::loadu(x + i) - vshift).exp_u20();
    const Vec e1 = (Vec::loadu(x + i + kLanes) - vshift).exp_u20();
    e0.store(x + i);
    e1.store(x + i + kLanes);
    s0 = s0 + e0;
    s1 = s1 + e1;
  }
  for (; i < len; i += kLanes) {
    const int64_t count = std::min(kLanes, len - i);
    const Vec e = (load(x + i, count) - vshift).exp_u20();
    store(e, x + i, count);
    s0 = s0 + Vec::set(Vec(0.f), e, count);
  }
  return lane_sum(s0 + s1);
}

inline void scale_(float* x, float factor, int64_t len) {
  for (int64_t i = 0; i < len; i += kLanes) {
    const int64_t count = std::min(kLanes, len - i);
    store(load(x + i, count) * Vec(factor), x + i, count);
  }
}

// scale / sqrt(mean((o·scale)²) + eps): the factor that RMS-normalises the row o[0:d] scaled by `scale`.
float rms_factor(const float* o, float scale, float eps, int64_t d) {
  Vec squares(0.f);
  for (int64_t c = 0; c < d; c += kLanes) {
    const Vec x = load(o + c, std::min(kLanes, d - c));
    squares = at::vec::fmadd(x, x, squares);
  }
  return scale / std::sqrt(lane_sum(squares) * scale * scale / static_cast<float>(d) + eps);
}

// o[0:d] <- RMSNorm(o·scale)·w (+ bias + Σ tap_w[i]·(tap_src[i] + src_bias) when given): Stage II's row epilogue.
void normalise_add_taps_(float* o, float scale, const float* w, float eps, int64_t d, const float* bias,
                         const float* const* tap_w, const float* const* tap_src, int taps, const float* src_bias) {
  const Vec factor(rms_factor(o, scale, eps, d));
  for (int64_t c = 0; c < d; c += kLanes) {
    const int64_t count = std::min(kLanes, d - c);
    Vec acc = load(o + c, count) * factor * load(w + c, count);
    if (bias != nullptr) acc = acc + load(bias + c, count);
    const Vec shift = src_bias != nullptr ? load(src_bias + c, count) : Vec(0.f);
    for (int i = 0; i < taps; ++i) {
      acc = at::vec::fmadd(load(tap_w[i] + c, count), load(tap_src[i] + c, count) + shift, acc);
    }
    store(acc, o + c, count);
  }
}

// A grow-only per-thread buffer: nothing to allocate, and no fresh pages to fault in, on every call. Its size
// does not grow with the batch or the grid (at most (2n + P)·max(512, d) floats, plus one per key chunk), except
// the local term's (slots 6 and 7: a block's local term, its transposed queries and the keys within its reach).
float* scratch(int slot, int64_t size) {
  thread_local std::vector<float> buffers[8];
  auto& buffer = buffers[slot];
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// Head h's slice of a [C] vector (d channels per head); nullptr (no vector) stays nullptr.
inline const float* head_slice(const float* x, int64_t h, int64_t d) { return x != nullptr ? x + h * d : nullptr; }

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, name, " must be [B, M, N, d] with a unit channel stride");
}

void check_vector(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
              name, " must be a contiguous float32 CPU tensor of ", numel, " elements");
}

}  // namespace

// VCA's local term (defined with its op below): the grid, and one (image, head)'s q, k and v at channel 0 of the head
// (token 0; row strides qr, kr, vr) with its slices of the q bias, v bias and output gain (nullptr: none).
struct LocalGrid {
  int64_t P, H, W, r, kernel, d;
  float scale;
};

struct LocalSource {
  const float* q;
  int64_t qr;
  const float* k;
  int64_t kr;
  const float* v;
  int64_t vr;
  const float* q_bias;
  const float* v_bias;
  const float* gain;
};

// (image b, head h) of q, k, v [B, M, N, d], with its slices of the [C] vectors q_bias, v_bias and gain.
LocalSource local_source(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t b, int64_t h,
                         const float* q_bias, const float* v_bias, const float* gain) {
  const int64_t d = q.size(3);
  const auto head = [b, h](const at::Tensor& t) { return t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1); };
  return {head(q), q.stride(2), head(k), k.stride(2), head(v), v.stride(2), head_slice(q_bias, h, d),
          head_slice(v_bias, h, d), head_slice(gain, h, d)};
}

void local_term_rows(const LocalGrid& g, const LocalSource& src, int64_t pa, int64_t pb, float* o, int64_t o_ld);

// q, k, v: [B, M, N, d] (unit channel stride; any batch, head and row strides, e.g. head views of token rows);
// N = num_prefix + H·W tokens. q_bias, v_bias: [C] biases not yet added to q and v (a k bias needs no adding:
// every softmax over keys is shift-invariant per row; the caller drops it). The rest are the layer's constants:
// embed_pos/neg [n, C]; temperature [M] or None; lambda1/2 0-d; norm weights [d], already scaled by (1 − λ_init)
// (norm2_weight may also be [C]: one [d] weight per head, for a layer that scales Stage II's output per channel);
// dwc_taps [9, C] (tap-major depthwise weights); dwc_bias [C]; local_window: k > 0 (odd) adds the local term,
// local_gain ⊙ (neighbourhood attention of the patch rows + v_bias) (`neighbourhood_cpu`), computed per Stage-II
// block while its q rows are still in cache: no [B, H·W, C] tensor, and no pass to add it. Writes o [B, N, C], the
// input of `proj`, to `out`, which may be q's own buffer: every task reads its q rows (pooling, prefix, Stage-II
// block, local term) before it writes the same rows of o, and no task reads rows another one writes.
void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_prefix, int64_t H,
                 int64_t W, const std::optional<at::Tensor>& q_bias, const std::optional<at::Tensor>& v_bias,
                 const at::Tensor& embed_pos, const at::Tensor& embed_neg, const std::optional<at::Tensor>& temperature,
                 const at::Tensor& lambda1, const at::Tensor& lambda2, const at::Tensor& norm1_weight,
                 const at::Tensor& norm2_weight, double eps1, double eps2, double scale, bool exact_prefix, bool joint,
                 int64_t gh, int64_t gw, const at::Tensor& dwc_taps, const at::Tensor& dwc_bias, int64_t local_window,
                 const std::optional<at::Tensor>& local_gain, at::Tensor& out) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  const int64_t B = q.size(0), M = q.size(1), N = q.size(2), d = q.size(3), C = M * d;
  const int64_t P = num_prefix, n = gh * gw, P_exact = exact_prefix ? P : 0, R = 2 * n + P_exact;
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k and v must have one shape, got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(B >= 0 && M > 0 && d > 0, "q must have at least one head of positive width, got ", q.sizes());
  TORCH_CHECK(P >= 0 && H > 0 && W > 0 && N == P + H * W, "tokens (", N, ") must be prefix + H·W (", P, " + ", H,
              "×", W, ")");
  TORCH_CHECK(gh > 0 && gw > 0, "the contrast grid must be positive, got ", gh, "×", gw);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 3 && out.size(0) == B &&
                  out.size(1) == N && out.size(2) == C && out.is_contiguous(),
              "out must be a contiguous float32 CPU tensor [B, N, C] = [", B, ", ", N, ", ", C, "]");
  check_vector(embed_pos, n * C, "embed_pos");
  check_vector(embed_neg, n * C, "embed_neg");
  check_vector(norm1_weight, d, "norm1_weight");
  const int64_t w2_head = norm2_weight.numel() == C && C != d ? d : 0;  // per-head [C] weight: head h at h·d
  check_vector(norm2_weight, w2_head ? C : d, "norm2_weight");
  check_vector(dwc_taps, 9 * C, "dwc_taps");
  check_vector(dwc_bias, C, "dwc_bias");
  if (temperature.has_value()) check_vector(*temperature, M, "temperature");
  if (q_bias.has_value()) check_vector(*q_bias, C, "q_bias");
  if (v_bias.has_value()) check_vector(*v_bias, C, "v_bias");
  TORCH_CHECK(local_window >= 0 && (local_window == 0 || local_window % 2 == 1),
              "local_window must be 0 (off) or a positive odd size, got ", local_window);
  if (local_gain.has_value()) check_vector(*local_gain, C, "local_gain");

  const int64_t qb = q.stride(0), qh_ = q.stride(1), qr = q.stride(2);
  const int64_t kb = k.stride(0), kh_ = k.stride(1), kr = k.stride(2);
  const int64_t vb = v.stride(0), vh_ = v.stride(1), vr = v.stride(2);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  const float* e_pos = embed_pos.data_ptr<float>();
  const float* e_neg = embed_neg.data_ptr<float>();
  const float* tau = temperature.has_value() ? temperature->data_ptr<float>() : nullptr;
  const float* q_shift = q_bias.has_value() ? q_bias->data_ptr<float>() : nullptr;
  const float* v_shift = v_bias.has_value() ? v_bias->data_ptr<float>() : nullptr;
  const float* w1 = norm1_weight.data_ptr<float>();
  const float* w2 = norm2_weight.data_ptr<float>();
  const float* taps_w = dwc_taps.data_ptr<float>();
  const float* bias_w = dwc_bias.data_ptr<float>();
  TORCH_CHECK(lambda1.numel() == 1 && lambda2.numel() == 1, "lambda1 and lambda2 must be scalars");
  if (B == 0) return;  // an empty batch: nothing to write (and no work to split across heads)
  const float l1 = lambda1.item<float>(), l2 = lambda2.item<float>(), s = static_cast<float>(scale);
  const LocalGrid grid{P, H, W, local_window / 2, local_window, d, s};
  const float* local_gain_data = local_gain.has_value() ? local_gain->data_ptr<float>() : nullptr;

  float* o_data = out.data_ptr<float>();
  // Stage I reads every key once per (image, head); when there are fewer of those than twice the threads, each
  // head's keys are split into chunks whose partial softmax sums are merged afterwards (as flash-decoding does).
  const int64_t heads = B * M, kv_blocks = (N + kKeyBlock - 1) / kKeyBlock;
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::min(kv_blocks, std::max<int64_t>(1, (2 * threads + heads - 1) / heads));
  const int64_t chunk_keys = (kv_blocks + chunks - 1) / chunks * kKeyBlock;
  const int64_t partial = R * (d + 2);  // one chunk's Σ exp·v [R, d], running max [R] and Σ exp [R]
  // Per call (sized by the batch): Stage-II keys (the 2n contrast tokens) and values [v̂; −λ₂v̂] and, when the keys
  // are split, each head's Stage-I queries and chunk partials (else a thread's own blocks hold them).
  const bool split = chunks > 1;
  at::Tensor work = at::empty({heads * (4 * n * d + (split ? R * d + chunks * partial : 0))}, q.options());
  float* keys = work.data_ptr<float>();
  float* values = keys + heads * 2 * n * d;
  float* split_queries = values + heads * 2 * n * d;
  float* split_partials = split_queries + heads * R * d;
  const auto queries_of = [&](int64_t t) { return split ? split_queries + t * R * d : scratch(4, R * d); };
  const auto partial_of = [&](int64_t task) { return split ? split_partials + task * partial : scratch(5, partial); };

  // Stage I queries of (image, head) t: t± = pooled q + e±, then the exact prefix rows.
  const auto build_queries = [&](int64_t t) {
    float* pooled = scratch(0, d);
    const int64_t b = t / M, h = t % M;
    const float* qh = q_data + b * qb + h * qh_;
    float* tokens = queries_of(t);
    for (int64_t iy = 0; iy < gh; ++iy) {  // adaptive average pooling windows, as torch computes them
      const int64_t y0 = iy * H / gh, y1 = ((iy + 1) * H + gh - 1) / gh;
      for (int64_t ix = 0; ix < gw; ++ix) {
        const int64_t x0 = ix * W / gw, x1 = ((ix + 1) * W + gw - 1) / gw;
        std::fill(pooled, pooled + d, 0.f);
        for (int64_t y = y0; y < y1; ++y) {
          for (int64_t x = x0; x < x1; ++x) {
            const float* row = qh + (P + y * W + x) * qr;
            for (int64_t c = 0; c < d; ++c) pooled[c] += row[c];
          }
        }
        const float inv_count = 1.f / static_cast<float>((y1 - y0) * (x1 - x0));
        const int64_t i = iy * gw + ix;
        const float* ep = e_pos + i * C + h * d;
        const float* en = e_neg + i * C + h * d;
        for (int64_t c = 0; c < d; ++c) {
          const float mean = pooled[c] * inv_count + (q_shift != nullptr ? q_shift[h * d + c] : 0.f);
          tokens[i * d + c] = mean + ep[c];
          tokens[(n + i) * d + c] = mean + en[c];
        }
      }
    }
    for (int64_t j = 0; j < P_exact; ++j) {
      for (int64_t c = 0; c < d; ++c)
        tokens[(2 * n + j) * d + c] = qh[j * qr + c] + (q_shift != nullptr ? q_shift[h * d + c] : 0.f);
    }
  };

  // Stage I partial of (image, head, key chunk) `task`: key blocks with an online softmax.
  const auto read_chunk = [&](int64_t task) {
    float* logits = scratch(1, R * kKeyBlock);
    const int64_t t = task / chunks, b = t / M, h = t % M;
    const float* kh = k_data + b * kb + h * kh_;
    const float* vh = v_data + b * vb + h * vh_;
    const float* tokens = queries_of(t);
    float* u = partial_of(task);  // [R, d] Σ exp·v
    float* running_max = u + R * d;
    float* running_sum = running_max + R;
    std::fill(running_max, running_max + R, -std::numeric_limits<float>::infinity());
    std::fill(running_sum, running_sum + R, 0.f);
    std::fill(u, u + R * d, 0.f);
    const int64_t k_end = std::min(N, (task % chunks + 1) * chunk_keys);
    for (int64_t k0 = (task % chunks) * chunk_keys; k0 < k_end; k0 += kKeyBlock) {
      const int64_t len = std::min(kKeyBlock, k_end - k0);
      gemm_rows(true, R, len, d, s, tokens, d, kh + k0 * kr, kr, 0.f, logits, len);
      for (int64_t r = 0; r < R; ++r) {
        float* row = logits + r * len;
        const float new_max = std::max(running_max[r], row_max(row, len));
        const float correction = std::exp(running_max[r] - new_max);  // 0 on the first block
        running_sum[r] = running_sum[r] * correction + exp_sum_(row, len, new_max);
        running_max[r] = new_max;
        if (correction != 1.f) scale_(u + r * d, correction, d);
      }
      gemm_rows(false, R, d, len, 1.f, logits, len, vh + k0 * vr, vr, 1.f, u, d);
    }
  };

  // Stage I output of (image, head) t: merge its chunks, then v̂ and the Stage-II keys and values.
  const auto finish_head = [&](int64_t t) {
    float* u = scratch(2, R * d + chunks);
    float* weights = u + R * d;  // per chunk
    const int64_t b = t / M, h = t % M;
    const float* first = partial_of(t * chunks);  // the head's chunks, consecutive
    for (int64_t r = 0; r < R; ++r) {  // softmax = Σ_c e^(m_c − m)·Σexp·v_c / Σ_c e^(m_c − m)·Σexp_c
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, first[c * partial + R * d + r]);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* chunk = first + c * partial;
        weights[c] = chunk[R * d + r] == -std::numeric_limits<float>::infinity()
                         ? 0.f  // an empty chunk
                         : std::exp(chunk[R * d + r] - m);
        total += weights[c] * chunk[R * d + R + r];
      }
      float* row = u + r * d;
      const float* part = first + r * d;
      const float w0 = weights[0] / total;
      for (int64_t i = 0; i < d; ++i) {  // softmax rows sum to 1: P·(v + 1·bᵀ) = P·v + b
        row[i] = w0 * part[i] + (v_shift != nullptr ? v_shift[h * d + i] : 0.f);
      }
      for (int64_t c = 1; c < chunks; ++c) {
        const float w = weights[c] / total;
        part = first + c * partial + r * d;
        for (int64_t i = 0; i < d; ++i) row[i] += w * part[i];
      }
    }
    for (int64_t j = 0; j < P_exact; ++j)  // exact read-out: the prefix rows are final (no norm, no conv)
      std::copy(u + (2 * n + j) * d, u + (2 * n + j + 1) * d, o_data + (b * N + j) * C + h * d);
    float* val = values + t * 2 * n * d;
    for (int64_t i = 0; i < n; ++i) {
      const float* up = u + i * d;
      const float* un = u + (n + i) * d;
      float* v_hat = val + i * d;
      for (int64_t c = 0; c < d; ++c) v_hat[c] = up[c] - l1 * un[c];
      normalise_add_taps_(v_hat, 1.f, w1, static_cast<float>(eps1), d, nullptr, nullptr, nullptr, 0, nullptr);
      float* v_neg = val + (n + i) * d;
      for (int64_t c = 0; c < d; ++c) v_neg[c] = -l2 * v_hat[c];
    }
    const float* tokens = queries_of(t);
    std::copy(tokens, tokens + 2 * n * d, keys + t * 2 * n * d);
  };

  if (chunks == 1) {  // one parallel region: a task per (image, head)
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        build_queries(t);
        read_chunk(t);
        finish_head(t);
      }
    });
  } else {
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) build_queries(t);
    });
    at::parallel_for(0, heads * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) read_chunk(task);
    });
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) finish_head(t);
    });
  }

  // Stage II with RMSNorm₂ and the depthwise conv, per (image, head, block of query rows).
  const int64_t row_block = std::clamp<int64_t>((N * heads + 2 * threads - 1) / (2 * threads), 32, kRowBlock);
  const int64_t blocks = (N + row_block - 1) / row_block;
  at::parallel_for(0, B * M * blocks, 1, [&](int64_t begin, int64_t end) {
    float* logits = scratch(1, kRowBlock * 2 * n);
    float* row_scale = scratch(3, kRowBlock + 2 * n + d);
    float* column_shift = row_scale + kRowBlock;  // α·b_q·t_j: what the q bias adds to every row's logits
    float* interior_bias = column_shift + 2 * n;  // conv bias + Σ_taps w·b_v: an interior row's constant term
    const float* tap_w[9];
    const float* tap_src[9];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / blocks, block = task % blocks, b = t / M, h = t % M;
      const int64_t r0 = std::max(block * row_block, P_exact), r1 = std::min((block + 1) * row_block, N);
      if (r0 >= r1) continue;
      const int64_t rows = r1 - r0;
      const int64_t pa = std::max(r0 - P, int64_t{0}), pb = r1 - P;  // the block's patch rows
      float* local = local_window > 0 && pb > pa ? scratch(6, kRowBlock * d) : nullptr;  // [pb − pa, d]
      if (local != nullptr) {  // before o is written over q
        local_term_rows(grid, local_source(q, k, v, b, h, q_shift, v_shift, local_gain_data), pa, pb, local, d);
      }
      const float alpha = s * (tau != nullptr ? tau[h] : 1.f);  // s·τ·q·tᵀ
      gemm_rows(true, rows, 2 * n, d, alpha, q_data + b * qb + h * qh_ + r0 * qr, qr, keys + t * 2 * n * d, d, 0.f,
                logits, 2 * n);
      if (q_shift != nullptr) {
        const float* key = keys + t * 2 * n * d;
        for (int64_t j = 0; j < 2 * n; ++j) {
          float dot = 0.f;
          for (int64_t c = 0; c < d; ++c) dot += q_shift[h * d + c] * key[j * d + c];
          column_shift[j] = alpha * dot;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* row = logits + r * 2 * n;
        if (q_shift != nullptr) {
          for (int64_t j = 0; j < 2 * n; ++j) row[j] += column_shift[j];
        }
        if (joint) {  // one softmax over [t₊; t₋]: its 1/Σ is applied to the output row
          row_scale[r] = 1.f / exp_sum_(row, 2 * n, row_max(row, 2 * n));
        } else {  // two softmaxes, each half normalised here
          scale_(row, 1.f / exp_sum_(row, n, row_max(row, n)), n);
          scale_(row + n, 1.f / exp_sum_(row + n, n, row_max(row + n, n)), n);
          row_scale[r] = 1.f;
        }
      }
      float* o_block = o_data + (b * N + r0) * C + h * d;
      gemm_rows(false, rows, d, 2 * n, 1.f, logits, 2 * n, values + t * 2 * n * d, d, 0.f, o_block, C);

      const float* vh = v_data + b * vb + h * vh_;
      const float* vbh = v_shift != nullptr ? v_shift + h * d : nullptr;
      const float* head_taps = taps_w + h * d;
      for (int64_t c = 0; c < d; ++c) {
        float tap_sum = 0.f;
        for (int64_t i = 0; i < 9; ++i) tap_sum += head_taps[i * C + c];
        interior_bias[c] = bias_w[h * d + c] + (vbh != nullptr ? vbh[c] * tap_sum : 0.f);
      }
      // Prefix and border rows whole, here; interior rows (all nine neighbours in the grid) get their RMS factor
      // here and the rest below, one channel block at a time.
      std::array<bool, kRowBlock> interior{};
      for (int64_t r = r0; r < r1; ++r) {
        float* o_row = o_block + (r - r0) * C;
        const float scale_r = row_scale[r - r0];
        const int64_t p = r - P, y = p / W, x = p % W;
        if (r >= P && y > 0 && y < H - 1 && x > 0 && x < W - 1) {
          interior[r - r0] = true;
          row_scale[r - r0] = rms_factor(o_row, scale_r, static_cast<float>(eps2), d);
          continue;
        }
        int taps = 0;
        if (r >= P) {  // a border patch row: the 3×3 neighbours inside the grid (zero padding)
          for (int64_t dy = -1; dy <= 1; ++dy) {
            for (int64_t dx = -1; dx <= 1; ++dx) {
              const int64_t yy = y + dy, xx = x + dx;
              if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
              tap_w[taps] = head_taps + ((dy + 1) * 3 + (dx + 1)) * C;
              tap_src[taps++] = vh + (P + yy * W + xx) * vr;
            }
          }
        }
        normalise_add_taps_(o_row, scale_r, w2 + h * w2_head, static_cast<float>(eps2), d, r >= P ? bias_w + h * d : nullptr, tap_w,
                            tap_src, taps, vbh);
      }
      // Interior rows by channel block: the nine tap weights stay in registers and the three grid lines of v
      // that a block reads (3·W·64 bytes) stay in L1. `interior_bias` already holds the conv of the v bias.
      const int64_t line = W * vr;
      for (int64_t c = 0; c < d; c += kLanes) {
        const int64_t count = std::min(kLanes, d - c);
        std::array<Vec, 9> tap;
        for (int64_t i = 0; i < 9; ++i) tap[i] = load(head_taps + i * C + c, count);
        const Vec weight = load(w2 + h * w2_head + c, count), bias = load(interior_bias + c, count);
        for (int64_t r = r0; r < r1; ++r) {
          if (!interior[r - r0]) continue;
          float* o = o_block + (r - r0) * C + c;
          const float* v = vh + r * vr + c;
          Vec acc = load(o, count) * Vec(row_scale[r - r0]) * weight + bias;
          acc = at::vec::fmadd(tap[0], load(v - line - vr, count), acc);
          acc = at::vec::fmadd(tap[1], load(v - line, count), acc);
          acc = at::vec::fmadd(tap[2], load(v - line + vr, count), acc);
          acc = at::vec::fmadd(tap[3], load(v - vr, count), acc);
          acc = at::vec::fmadd(tap[4], load(v, count), acc);
          acc = at::vec::fmadd(tap[5], load(v + vr, count), acc);
          acc = at::vec::fmadd(tap[6], load(v + line - vr, count), acc);
          acc = at::vec::fmadd(tap[7], load(v + line, count), acc);
          acc = at::vec::fmadd(tap[8], load(v + line + vr, count), acc);
          store(acc, o, count);
        }
      }
      for (int64_t p = pa; local != nullptr && p < pb; ++p) {  // o's patch rows += the local term
        float* o = o_block + (P + p - r0) * C;
        const float* add = local + (p - pa) * d;
        for (int64_t c = 0; c < d; c += kLanes) {
          const int64_t count = std::min(kLanes, d - c);
          store(load(o + c, count) + load(add + c, count), o + c, count);
        }
      }
    }
  });
}

at::Tensor attend_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_prefix, int64_t H,
                      int64_t W, const std::optional<at::Tensor>& q_bias, const std::optional<at::Tensor>& v_bias,
                      const at::Tensor& embed_pos, const at::Tensor& embed_neg,
                      const std::optional<at::Tensor>& temperature, const at::Tensor& lambda1,
                      const at::Tensor& lambda2, const at::Tensor& norm1_weight, const at::Tensor& norm2_weight,
                      double eps1, double eps2, double scale, bool exact_prefix, bool joint, int64_t gh, int64_t gw,
                      const at::Tensor& dwc_taps, const at::Tensor& dwc_bias, int64_t local_window,
                      const std::optional<at::Tensor>& local_gain) {
  check_heads(q, "q");
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1) * q.size(3)}, q.options());
  attend_into(q, k, v, num_prefix, H, W, q_bias, v_bias, embed_pos, embed_neg, temperature, lambda1, lambda2,
              norm1_weight, norm2_weight, eps1, eps2, scale, exact_prefix, joint, gh, gw, dwc_taps, dwc_bias,
              local_window, local_gain, out);
  return out;
}

// The same, with o written over q: q must be the head view [B, M, N, d] of its own dense [B, N, C] buffer (what
// a q projection returns), sharing no memory with k or v; that buffer then holds o [B, N, C]. Spares a fresh
// [B, N, C] tensor per layer (at 16k tokens, 25 MiB of pages to fault in).
void attend_cpu_into_q(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_prefix, int64_t H,
                       int64_t W, const std::optional<at::Tensor>& q_bias, const std::optional<at::Tensor>& v_bias,
                       const at::Tensor& embed_pos, const at::Tensor& embed_neg,
                       const std::optional<at::Tensor>& temperature, const at::Tensor& lambda1,
                       const at::Tensor& lambda2, const at::Tensor& norm1_weight, const at::Tensor& norm2_weight,
                       double eps1, double eps2, double scale, bool exact_prefix, bool joint, int64_t gh, int64_t gw,
                       const at::Tensor& dwc_taps, const at::Tensor& dwc_bias, int64_t local_window,
                       const std::optional<at::Tensor>& local_gain) {
  check_heads(q, "q");
  const int64_t B = q.size(0), M = q.size(1), N = q.size(2), d = q.size(3), C = M * d;
  TORCH_CHECK(q.stride(0) == N * C && q.stride(1) == d && q.stride(2) == C && q.storage_offset() == 0 &&
                  q.storage().nbytes() == static_cast<size_t>(B * N * C) * sizeof(float),
              "attend_cpu_into_q: q must be the [B, M, N, d] head view of its own dense [B, N, C] buffer");
  TORCH_CHECK(!q.is_alias_of(k) && !q.is_alias_of(v), "attend_cpu_into_q: q must not share memory with k or v");
  at::Tensor out = q.as_strided({B, N, C}, {N * C, C, 1});
  attend_into(q, k, v, num_prefix, H, W, q_bias, v_bias, embed_pos, embed_neg, temperature, lambda1, lambda2,
              norm1_weight, norm2_weight, eps1, eps2, scale, exact_prefix, joint, gh, gw, dwc_taps, dwc_bias,
              local_window, local_gain, out);
}

// ---- VCA's local term (float32 inference): neighbourhood attention of the patch rows --------------------------
//
// Vectorised over queries: a block of kLanes consecutive patch queries (row-major grid order, so a block may span
// two grid rows) reads, for each neighbour offset (dy, dx), the keys at the same flat offset dy·W + dx. With the
// queries and keys transposed to [d, patches], an offset's logits are one vector per channel, q[c, block] ⊙
// k[c, block + dy·W + dx]: no horizontal sums, no gathers. Keys past the grid's edge get a −∞ logit from per-lane
// row and column masks (the transposed keys are zero-padded, so every shifted load stays in the buffer). The
// softmax runs across offsets, lane by lane; the values are summed per query over its on-grid window, vectorised
// over channels, and normalised once.

namespace {

constexpr int kMaxColumns = 12;  // key columns (accumulators) per pass over the channels

// acc[i] = Σ_c q[c·q_ld + lanes] ⊙ k[c·k_ld + i + lanes], i < G: the logits of G consecutive key columns.
template <int G>
void column_logits(const float* q, int64_t q_ld, const float* k, int64_t k_ld, int64_t d, Vec* acc) {
  Vec a[G];
  for (int i = 0; i < G; ++i) a[i] = Vec(0.f);
  for (int64_t c = 0; c < d; ++c) {
    const Vec qv = Vec::loadu(q + c * q_ld);
    const float* kc = k + c * k_ld;
    for (int i = 0; i < G; ++i) a[i] = at::vec::fmadd(qv, Vec::loadu(kc + i), a[i]);
  }
  for (int i = 0; i < G; ++i) acc[i] = a[i];
}

template <int... G>
void column_logits_n(int g, const float* q, int64_t q_ld, const float* k, int64_t k_ld, int64_t d, Vec* acc,
                     std::integer_sequence<int, G...>) {
  ((g == G + 1 ? column_logits<G + 1>(q, q_ld, k, k_ld, d, acc) : void()), ...);
}

#if defined(CPU_CAPABILITY_AVX512)
// AVX-512: the G shifted key vectors come from two or three aligned loads and `valignd`, not G unaligned loads
// (most of which would straddle two cache lines): the keys' row must start 64-byte aligned, Off = its misalignment.
template <int S>
inline __m512 shifted(__m512 v0, __m512 v1, __m512 v2) {
  if constexpr (S == 0) {
    return v0;
  } else if constexpr (S < 16) {
    return _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(v1), _mm512_castps_si512(v0), S));
  } else if constexpr (S == 16) {
    return v1;
  } else {
    return _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(v2), _mm512_castps_si512(v1), S - 16));
  }
}

template <int Off, int... I>
inline void shifted_fmadd(__m512 q, const float* k, __m512* a, std::integer_sequence<int, I...>) {
  constexpr int G = sizeof...(I);
  const __m512 v0 = _mm512_load_ps(k), v1 = _mm512_load_ps(k + 16);
  const __m512 v2 = Off + G - 1 > 16 ? _mm512_load_ps(k + 32) : v1;
  ((a[I] = _mm512_fmadd_ps(q, shifted<Off + I>(v0, v1, v2), a[I])), ...);
}

template <int G, int Off>
void column_logits_shifted(const float* q, int64_t q_ld, const float* k, int64_t k_ld, int64_t d, Vec* acc) {
  __m512 a[G];
  for (int i = 0; i < G; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    shifted_fmadd<Off>(_mm512_loadu_ps(q + c * q_ld), k + c * k_ld, a, std::make_integer_sequence<int, G>{});
  }
  for (int i = 0; i < G; ++i) acc[i] = Vec(a[i]);
}

using LogitsFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, Vec*);

template <int G, int... Off>
constexpr std::array<LogitsFn, 16> shifted_table(std::integer_sequence<int, Off...>) {
  return {{&column_logits_shifted<G, Off>...}};
}

template <int... G>
LogitsFn shifted_logits(int g, int off, std::integer_sequence<int, G...>) {
  static constexpr std::array<std::array<LogitsFn, 16>, sizeof...(G)> tables{
      {shifted_table<G + 1>(std::make_integer_sequence<int, 16>{})...}};
  return tables[g - 1][off];
}
#endif

// acc[0:g] = the logits of g consecutive key columns from k (see `column_logits`); k's rows 64-byte aligned
// at k − (k mod 16 floats), with 48 floats readable from there.
void key_logits(int g, const float* q, int64_t q_ld, const float* k, int64_t k_ld, int64_t d, Vec* acc) {
#if defined(CPU_CAPABILITY_AVX512)
  const int off = static_cast<int>((reinterpret_cast<uintptr_t>(k) / sizeof(float)) % 16);
  shifted_logits(g, off, std::make_integer_sequence<int, kMaxColumns>{})(q, q_ld, k - off, k_ld, d, acc);
#else
  column_logits_n(g, q, q_ld, k, k_ld, d, acc, std::make_integer_sequence<int, kMaxColumns>{});
#endif
}

constexpr int kGroup = 4;  // consecutive queries of one grid row that share each value row they read
constexpr int kValueVectors = kLanes >= 16 ? 4 : 2;  // channel vectors per pass (4·kGroup accumulators on AVX-512)

// The probability slots of a block (`neighbourhood_block`): the prefix keys, then per key row a padded run of
// kernel + 2(kGroup − 1) column slots (zero outside the kernel), so a group's queries read a shared key column at
// slots one apart, branch-free.
struct Slots {
  int64_t P, stride, dy_lo;
  int64_t at(int64_t row, int64_t dx_padded) const { return P + (row - dy_lo) * stride + dx_padded; }
};

#if defined(__GNUC__)
#define VCA_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define VCA_ALWAYS_INLINE inline
#endif

// Value sums of a group of n queries (y, x0 + i) of one grid row over NV channel vectors (the last `tail` lanes
// wide when Tail): n·NV accumulators in registers, each value row loaded once for the queries whose window holds it.
template <int NV, bool Tail>
VCA_ALWAYS_INLINE void load_values(Vec (&row)[NV], const float* v, int64_t tail) {
  for (int j = 0; j < NV; ++j) row[j] = Tail && j == NV - 1 ? Vec::loadu(v + j * kLanes, tail) : Vec::loadu(v + j * kLanes);
}

// queries Lo..Hi of the group add w_i · row; query i's weight at w[i·step]
template <int Lo, int Hi, int n, int NV>
VCA_ALWAYS_INLINE void add_values(Vec (&acc)[n][NV], const Vec (&row)[NV], const float* w, int64_t step) {
  for (int i = Lo; i <= Hi; ++i) {
    const Vec wi(w[i * step]);
    for (int j = 0; j < NV; ++j) acc[i][j] = at::vec::fmadd(wi, row[j], acc[i][j]);
  }
}

// Key column x0 − r + E (read by queries 0..E) and x0 + r + 1 + E (read by E + 1..n − 1), for E = 0..n − 2: the
// columns beside those every query of the group reads. One past the grid's edge has weight 0 for every query (a
// masked slot), so it is read from the edge column instead: no branch.
template <int E, int n, int NV, bool Tail>
VCA_ALWAYS_INLINE void edge_values(Vec (&acc)[n][NV], Vec (&row)[NV], const float* w, const float* v, int64_t vr,
                                   int64_t x0, int64_t r, int64_t W, int64_t tail) {
  if constexpr (E < n - 1) {
    const int64_t left = x0 - r + E, right = x0 + r + 1 + E;
    load_values<NV, Tail>(row, v + std::max(left, int64_t{0}) * vr, tail);
    add_values<0, E>(acc, row, w + left * kLanes, 1 - kLanes);
    load_values<NV, Tail>(row, v + std::min(right, W - 1) * vr, tail);
    add_values<E + 1, n - 1>(acc, row, w + right * kLanes, 1 - kLanes);
    edge_values<E + 1, n, NV, Tail>(acc, row, w, v, vr, x0, r, W, tail);
  }
}

// What one group of queries needs: its probabilities and 1/Σ at the first query's lane (query i's weights are
// i·(1 − kLanes) further, `Slots`), its first grid position, the head's values and output rows at the pass's
// channels, and that pass's slice of the value bias and the output gain (nullptr: none).
struct Group {
  const float* probs;
  const float* inv;
  int64_t y, x0;
  const float* v;
  int64_t vr;
  float* o;
  int64_t C, tail;
  const float* bias;
  const float* gain;
};

// o[i·C + channels] = gain ⊙ (inv[i] · Σ w·v + bias) over the prefix keys and the on-grid window of the n queries
// (y, x0 + i) of one grid row (the weights sum to 1: v's bias is added after).
template <int n, int NV, bool Tail>
void group_values(const LocalGrid& g, const Slots& slots, const Group& q) {
  Vec acc[n][NV];
  Vec row[NV];
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < NV; ++j) acc[i][j] = Vec(0.f);
  }
  for (int64_t j = 0; j < g.P; ++j) {  // the prefix slots are not padded: query i's weight at j·kLanes + i
    load_values<NV, Tail>(row, q.v + j * q.vr, q.tail);
    add_values<0, n - 1>(acc, row, q.probs + j * kLanes, 1);
  }
  const int64_t r = g.r, x0 = q.x0, shared0 = std::max(x0 + n - 1 - r, int64_t{0});
  const int64_t shared1 = std::min(x0 + r, g.W - 1);
  for (int64_t yy = std::max(q.y - r, int64_t{0}); yy <= std::min(q.y + r, g.H - 1); ++yy) {
    const float* w = q.probs + slots.at(yy - q.y, r + kGroup - 1 - x0) * kLanes;  // query 0, key column kx: w[kx·kLanes]
    const float* v = q.v + (g.P + yy * g.W) * q.vr;
    for (int64_t kx = shared0; kx <= shared1; ++kx) {
      load_values<NV, Tail>(row, v + kx * q.vr, q.tail);
      add_values<0, n - 1>(acc, row, w + kx * kLanes, 1 - kLanes);
    }
    edge_values<0, n, NV, Tail>(acc, row, w, v, q.vr, x0, r, g.W, q.tail);
  }
  Vec bias[NV], gain[NV];
  for (int j = 0; j < NV; ++j) {
    const int64_t lanes = Tail && j == NV - 1 ? q.tail : kLanes;
    bias[j] = q.bias != nullptr ? load(q.bias + j * kLanes, lanes) : Vec(0.f);
    gain[j] = q.gain != nullptr ? load(q.gain + j * kLanes, lanes) : Vec(1.f);
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < NV; ++j) {
      const Vec out = at::vec::fmadd(acc[i][j], Vec(q.inv[i]), bias[j]) * gain[j];
      float* dst = q.o + i * q.C + j * kLanes;
      if (Tail && j == NV - 1) {
        out.store(dst, q.tail);
      } else {
        out.store(dst);
      }
    }
  }
}

using GroupFn = void (*)(const LocalGrid&, const Slots&, const Group&);

template <int n, int... NV>
GroupFn group_fn(int nv, bool tail, std::integer_sequence<int, NV...>) {
  GroupFn fn = nullptr;
  ((nv == NV + 1 ? (fn = tail ? &group_values<n, NV + 1, true> : &group_values<n, NV + 1, false>) : fn), ...);
  return fn;
}

template <int... N>
GroupFn group_fn(int n, int nv, bool tail, std::integer_sequence<int, N...>) {
  GroupFn fn = nullptr;
  ((n == N + 1 ? (fn = group_fn<N + 1>(nv, tail, std::make_integer_sequence<int, kValueVectors>{})) : fn), ...);
  return fn;
}

// The value sums of the n ≤ kGroup queries (y, x0 + i), kValueVectors channel vectors at a time. q's v, o, bias and
// gain point at channel 0 of the head.
void window_values(const LocalGrid& g, const Slots& slots, int64_t n, const Group& q) {
  for (int64_t c0 = 0; c0 < g.d; c0 += kValueVectors * kLanes) {
    const int64_t width = std::min<int64_t>(kValueVectors * kLanes, g.d - c0), tail = width % kLanes;
    const int nv = static_cast<int>((width + kLanes - 1) / kLanes);
    const GroupFn fn = group_fn(static_cast<int>(n), nv, tail > 0, std::make_integer_sequence<int, kGroup>{});
    Group part = q;
    part.v += c0;
    part.o += c0;
    part.tail = tail;
    if (part.bias != nullptr) part.bias += c0;
    if (part.gain != nullptr) part.gain += c0;
    fn(g, slots, part);
  }
}

// One (image, head) of a task: its transposed queries [d, ·] (patch p at column p − q_lo, row stride q_ld) and keys
// (patch p at column p − k_lo, row stride k_ld, rows 64-byte aligned), its key and value rows (channel 0 of the
// head), its output rows (patch p at o + (p − o_lo)·o_ld) and its slices of the value bias and output gain (nullptr:
// none).
struct Head {
  const float* qt;
  int64_t q_lo, q_ld;
  const float* kt;
  int64_t k_lo, k_ld;
  const float* k;
  int64_t kr;
  const float* v;
  int64_t vr;
  float* o;
  int64_t o_lo, o_ld;
  const float* bias;
  const float* gain;
};

// The local term of the queries [p0, p0 + lanes) of one head; buffer: `block_buffer_size` floats.
void neighbourhood_block(const LocalGrid& g, const Head& head, int64_t p0, int64_t lanes, float* buffer) {
  const int64_t r = g.r, W = g.W, H = g.H, P = g.P, kernel = g.kernel;
  const int64_t first_row = p0 / W, last_row = (p0 + lanes - 1) / W;
  const int64_t dy_lo = std::max(-r, -last_row), dy_hi = std::min(r, H - 1 - first_row);
  const Slots slots{P, kernel + 2 * (kGroup - 1), dy_lo};
  float* probs = buffer;                                                   // [slots, lanes]
  float* column_bias = probs + slots.at(dy_hi + 1, 0) * kLanes;            // [kernel, lanes]: 0 or −∞
  float* inv = column_bias + kernel * kLanes;                              // [lanes]: 1 / Σ exp
  const float minus_inf = -std::numeric_limits<float>::infinity();
  // each lane's grid row and column; NaN on padding lanes (past the block), which every mask test then passes
  alignas(64) float ys[kLanes], xs[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) {
    ys[l] = l < lanes ? static_cast<float>((p0 + l) / W) : std::numeric_limits<float>::quiet_NaN();
    xs[l] = l < lanes ? static_cast<float>((p0 + l) % W) : std::numeric_limits<float>::quiet_NaN();
  }
  const Vec y_lane = Vec::loadu(ys), x_lane = Vec::loadu(xs), zero(0.f), masked(minus_inf);
  const auto off_grid = [&](const Vec& at, int64_t size) { return (at < zero) | (at >= Vec(static_cast<float>(size))); };
  for (int64_t dx = -r; dx <= r; ++dx) {
    Vec::blendv(zero, masked, off_grid(x_lane + Vec(static_cast<float>(dx)), W)).store(column_bias + (dx + r) * kLanes);
  }
  const float* qt = head.qt + (p0 - head.q_lo);
  const int64_t q_ld = head.q_ld;
  const Vec s(g.scale);
  Vec top(minus_inf);
  for (int64_t j = 0; j < P; ++j) {  // prefix keys: one broadcast channel at a time
    Vec a(0.f);
    for (int64_t c = 0; c < g.d; ++c) a = at::vec::fmadd(Vec::loadu(qt + c * q_ld), Vec(head.k[j * head.kr + c]), a);
    a = a * s;
    a.store(probs + j * kLanes);
    top = at::vec::maximum(top, a);
  }
  Vec acc[kMaxColumns];
  for (int64_t dy = dy_lo; dy <= dy_hi; ++dy) {
    const Vec row_bias = Vec::blendv(zero, masked, off_grid(y_lane + Vec(static_cast<float>(dy)), H));
    const float* k = head.kt + (p0 + dy * W - r - head.k_lo);
    float* row = probs + slots.at(dy, kGroup - 1) * kLanes;  // the kernel's columns, dx = −r first
    for (int64_t x0 = 0; x0 < kernel; x0 += kMaxColumns) {
      const int n = static_cast<int>(std::min<int64_t>(kMaxColumns, kernel - x0));
      key_logits(n, qt, q_ld, k + x0, head.k_ld, g.d, acc);
      for (int i = 0; i < n; ++i) {
        const Vec logit = at::vec::fmadd(acc[i], s, row_bias + Vec::loadu(column_bias + (x0 + i) * kLanes));
        logit.store(row + (x0 + i) * kLanes);
        top = at::vec::maximum(top, logit);
      }
    }
  }
  // softmax across the slots, lane by lane (every valid query reads its own key: top is finite); zero padding
  Vec sum(0.f);
  const auto exp_ = [&](float* x) {
    const Vec e = (Vec::loadu(x) - top).exp_u20();
    e.store(x);
    sum = sum + e;
  };
  for (int64_t j = 0; j < P; ++j) exp_(probs + j * kLanes);
  for (int64_t dy = dy_lo; dy <= dy_hi; ++dy) {
    float* row = probs + slots.at(dy, 0) * kLanes;
    for (int64_t i = 0; i < kGroup - 1; ++i) zero.store(row + i * kLanes);
    for (int64_t i = kGroup - 1; i < kGroup - 1 + kernel; ++i) exp_(row + i * kLanes);
    for (int64_t i = kGroup - 1 + kernel; i < slots.stride; ++i) zero.store(row + i * kLanes);
  }
  (Vec(1.f) / sum).store(inv);
  // values: groups of up to kGroup consecutive queries of one grid row (at most kernel + 1: each key column beside
  // those the whole group reads is then read by the queries on its side, `edge_values`)
  const int64_t group = std::min<int64_t>(kGroup, kernel + 1);
  for (int64_t l = 0; l < lanes;) {
    const int64_t p = p0 + l, y = p / W, x = p % W, n = std::min({group, lanes - l, W - x});
    window_values(g, slots, n, {probs + l, inv + l, y, x, head.v, head.vr, head.o + (p - head.o_lo) * head.o_ld,
                                head.o_ld, 0, head.bias, head.gain});
    l += n;
  }
}

// floats of `neighbourhood_block`'s buffer
int64_t block_buffer_size(int64_t P, int64_t kernel) {
  return (P + kernel * (kernel + 2 * (kGroup - 1)) + kernel + 1) * kLanes;
}

}  // namespace

// The local term of the patch queries [pa, pb) of one (image, head) to o (patch p at o + (p − pa)·o_ld): transposes
// the queries and the keys within their reach into a per-thread buffer, then runs their blocks of kLanes queries.
void local_term_rows(const LocalGrid& g, const LocalSource& src, int64_t pa, int64_t pb, float* o, int64_t o_ld) {
  const int64_t P = g.P, d = g.d, HW = g.H * g.W, halo = g.r * g.W + g.r;  // halo: a neighbour's farthest flat offset
  const auto round_up = [](int64_t x) { return (x + kLanes - 1) / kLanes * kLanes; };
  // the keys within reach: [pa − halo, pb + halo), plus room for the aligned loads past the last one
  const int64_t q_len = round_up(pb - pa), k_lo = pa - halo, k_len = round_up(q_len + 2 * halo) + 3 * kLanes;
  float* buffer = scratch(7, d * (q_len + k_len) + block_buffer_size(P, g.kernel) + kLanes);
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(buffer) / sizeof(float) % kLanes;
  float* qt = buffer + (kLanes - misaligned) % kLanes;
  float* kt = qt + d * q_len;
  const int64_t k0 = std::max<int64_t>(0, k_lo), k1 = std::min(HW, k_lo + k_len);  // keys on the grid
  at::vec::transpose_mxn<float>(src.q + (P + pa) * src.qr, src.qr, qt, q_len, static_cast<int>(pb - pa),
                                static_cast<int>(d));
  at::vec::transpose_mxn<float>(src.k + (P + k0) * src.kr, src.kr, kt + (k0 - k_lo), k_len, static_cast<int>(k1 - k0),
                                static_cast<int>(d));
  for (int64_t c = 0; c < d; ++c) {
    float* q_row = qt + c * q_len;
    if (src.q_bias != nullptr) {
      const Vec shift(src.q_bias[c]);
      for (int64_t i = 0; i < pb - pa; i += kLanes) {
        const int64_t count = std::min(kLanes, pb - pa - i);
        store(load(q_row + i, count) + shift, q_row + i, count);
      }
    }
    std::fill(q_row + (pb - pa), q_row + q_len, 0.f);
    std::fill(kt + c * k_len, kt + c * k_len + (k0 - k_lo), 0.f);
    std::fill(kt + c * k_len + (k1 - k_lo), kt + (c + 1) * k_len, 0.f);
  }
  const Head head{qt, pa, q_len, kt, k_lo, k_len, src.k, src.kr, src.v, src.vr, o, pa, o_ld, src.v_bias, src.gain};
  float* block_buffer = kt + d * k_len;
  for (int64_t p0 = pa; p0 < pb; p0 += kLanes) neighbourhood_block(g, head, p0, std::min(kLanes, pb - p0), block_buffer);
}

// VCA's local term: q, k, v [B, M, N, d] as in attend_into (unit channel stride); N = num_prefix + H·W. Each patch
// row takes one softmax over the prefix keys and the kernel × kernel patch keys around it that lie on the grid.
// q_bias, v_bias: [C] biases not yet added to q and v (a k bias cancels in every softmax); out_scale: [C] gain on
// the result (None: 1). Returns out_scale ⊙ (NA(q + q_bias, k, v) + v_bias), [B, H·W, M·d]: token-major, the layout
// of the patch rows of o. Tasks: (image, head, part of the grid), each transposing its queries and the keys they
// reach into a per-thread buffer.
at::Tensor neighbourhood_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_prefix,
                             int64_t H, int64_t W, int64_t kernel, double scale,
                             const std::optional<at::Tensor>& q_bias, const std::optional<at::Tensor>& v_bias,
                             const std::optional<at::Tensor>& out_scale) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  const int64_t B = q.size(0), M = q.size(1), N = q.size(2), d = q.size(3), C = M * d, P = num_prefix;
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k and v must have one shape, got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(P >= 0 && H > 0 && W > 0 && N == P + H * W, "tokens (", N, ") must be prefix + H·W (", P, " + ", H,
              "×", W, ")");
  TORCH_CHECK(kernel > 0 && kernel % 2 == 1, "the neighbourhood kernel must be a positive odd size, got ", kernel);
  if (q_bias.has_value()) check_vector(*q_bias, C, "q_bias");
  if (v_bias.has_value()) check_vector(*v_bias, C, "v_bias");
  if (out_scale.has_value()) check_vector(*out_scale, C, "out_scale");
  at::Tensor out = at::empty({B, H * W, C}, q.options());
  if (B == 0) return out;
  const float* q_shift = q_bias.has_value() ? q_bias->data_ptr<float>() : nullptr;
  const float* v_shift = v_bias.has_value() ? v_bias->data_ptr<float>() : nullptr;
  const float* gain = out_scale.has_value() ? out_scale->data_ptr<float>() : nullptr;
  float* o_data = out.data_ptr<float>();
  const LocalGrid g{P, H, W, kernel / 2, kernel, d, static_cast<float>(scale)};
  const int64_t HW = H * W, heads = B * M;
  // Split each head's blocks into parts when there are fewer heads than twice the threads (a part also transposes
  // the keys within reach of its queries: cheap next to its logits while it holds a few grid rows).
  const int64_t blocks = (HW + kLanes - 1) / kLanes;
  const int64_t wanted = (2 * at::get_num_threads() + heads - 1) / heads;
  const int64_t parts = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, blocks * kLanes / (4 * W)));
  const int64_t part_blocks = (blocks + parts - 1) / parts;
  at::parallel_for(0, heads * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / parts, b = t / M, h = t % M;
      const int64_t pa = task % parts * part_blocks * kLanes, pb = std::min(HW, pa + part_blocks * kLanes);
      if (pa >= pb) continue;
      float* o = o_data + (b * HW + pa) * C + h * d;  // patch pa's row, channel 0 of head h
      local_term_rows(g, local_source(q, k, v, b, h, q_shift, v_shift, gain), pa, pb, o, C);
    }
  });
  return out;
}

// The arguments after q, shared by both ops' schemas.
#define VCA_ATTEND_ARGUMENTS                                                                                      \
  "Tensor k, Tensor v, SymInt num_prefix, SymInt H, SymInt W, Tensor? q_bias, Tensor? v_bias, Tensor embed_pos, " \
  "Tensor embed_neg, Tensor? temperature, Tensor lambda1, Tensor lambda2, Tensor norm1_weight, "                  \
  "Tensor norm2_weight, float eps1, float eps2, float scale, bool exact_prefix, bool joint, int gh, int gw, "     \
  "Tensor dwc_taps, Tensor dwc_bias, int local_window=0, Tensor? local_gain=None"

TORCH_LIBRARY(vca_patch, m) {
  m.def("attend_cpu(Tensor q, " VCA_ATTEND_ARGUMENTS ") -> Tensor",
        {at::Tag::needs_fixed_stride_order});  // under torch.compile, inputs keep their eager strides
  m.def("attend_cpu_into_q(Tensor(a!) q, " VCA_ATTEND_ARGUMENTS ") -> ()");
  m.def("neighbourhood_cpu(Tensor q, Tensor k, Tensor v, SymInt num_prefix, SymInt H, SymInt W, int kernel, float scale, "
        "Tensor? q_bias=None, Tensor? v_bias=None, Tensor? out_scale=None) -> Tensor",
        {at::Tag::needs_fixed_stride_order});  // under torch.compile, inputs keep their eager strides
}

TORCH_LIBRARY_IMPL(vca_patch, CPU, m) {
  m.impl("attend_cpu", &attend_cpu);
  m.impl("attend_cpu_into_q", &attend_cpu_into_q);
  m.impl("neighbourhood_cpu", &neighbourhood_cpu);
}
