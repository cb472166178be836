// Binary Linear on the CPU: sign(x)·sign(W)ᵀ by XNOR + popcount over packed 64-bit words, then one scale per
// output channel and the bias: y[r, o] = float(dot[r, o]) · scale[o] + bias[o] (two IEEE roundings, in that
// order, as the float emulation does them: the ±1 dot product is an exact integer there too).
//
// Bits: word w, bit j holds input column 64·w + j (LSB first); sign bit 1 ⇔ value < 0, nonzero bit 1 ⇔ value ≠ 0.
// sign(0) = 0, so over the columns where both are nonzero (mask m): dot = popcount(m) − 2·popcount((sx ^ sw) & m).
// Padding columns have mask 0. Without a weight nonzero plane the weight has no zeros and m = mx (the activation's
// mask), whose popcount is counted once per row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

inline int64_t popcount(uint64_t v) { return static_cast<int64_t>(__builtin_popcountll(v)); }

// x [rows, k] float32 -> sign and nonzero words [rows, words] and per-row nonzero counts.
void pack_rows(const float* x, int64_t rows, int64_t k, int64_t words, uint64_t* signs, uint64_t* nonzero,
               int64_t* count) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * k;
      int64_t n = 0;
      for (int64_t w = 0; w < words; ++w) {
        uint64_t s = 0, m = 0;
        const int64_t lo = w * 64, hi = std::min<int64_t>(k, lo + 64);
        for (int64_t c = lo; c < hi; ++c) {
          const float v = row[c];
          s |= static_cast<uint64_t>(v < 0.f) << (c - lo);
          m |= static_cast<uint64_t>(v != 0.f) << (c - lo);
        }
        signs[r * words + w] = s;
        nonzero[r * words + w] = m;
        n += popcount(m);
      }
      count[r] = n;
    }
  });
}

at::Tensor xnor_linear(const at::Tensor& x, const at::Tensor& weight_signs,
                       const std::optional<at::Tensor>& weight_nonzero, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "xnor_linear: x must be a contiguous float32 CPU matrix [rows, in_features]");
  TORCH_CHECK(weight_signs.scalar_type() == at::kLong && weight_signs.dim() == 2 && weight_signs.is_contiguous(),
              "xnor_linear: weight_signs must be contiguous int64 words [out_features, ceil(in_features / 64)]");
  const int64_t rows = x.size(0), k = x.size(1), out = weight_signs.size(0), words = weight_signs.size(1);
  TORCH_CHECK(words == (k + 63) / 64, "xnor_linear: ", words, " words per row do not hold ", k, " input columns");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == out && scale.is_contiguous(),
              "xnor_linear: scale must be contiguous float32 [out_features]");
  const bool has_mask = weight_nonzero.has_value() && weight_nonzero->defined();
  if (has_mask) {
    TORCH_CHECK(weight_nonzero->sizes() == weight_signs.sizes() && weight_nonzero->scalar_type() == at::kLong &&
                    weight_nonzero->is_contiguous(),
                "xnor_linear: weight_nonzero must be int64 words shaped like weight_signs");
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == out && bias->is_contiguous(),
                "xnor_linear: bias must be contiguous float32 [out_features]");
  }
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  std::vector<uint64_t> xs(rows * words), xm(rows * words);
  std::vector<int64_t> xcount(rows);
  pack_rows(x.data_ptr<float>(), rows, k, words, xs.data(), xm.data(), xcount.data());

  // Weights word-major [words, out], so the innermost loop runs over output channels: one XOR, AND and popcount
  // per 64 columns and 1-8 outputs (vectorised with AVX-512 VPOPCNTDQ where the build has it).
  const auto* ws = reinterpret_cast<const uint64_t*>(weight_signs.data_ptr<int64_t>());
  const auto* wm = has_mask ? reinterpret_cast<const uint64_t*>(weight_nonzero->data_ptr<int64_t>()) : nullptr;
  std::vector<uint64_t> wst(words * out), wmt(has_mask ? words * out : 0);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t w = 0; w < words; ++w) {
      wst[w * out + o] = ws[o * words + w];
      if (has_mask) wmt[w * out + o] = wm[o * words + w];
    }
  }
  const float* sc = scale.data_ptr<float>();
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> differ(out), valid(has_mask ? out : 0);
    for (int64_t r = begin; r < end; ++r) {
      std::fill(differ.begin(), differ.end(), 0);
      std::fill(valid.begin(), valid.end(), 0);
      int64_t* dp = differ.data();
      int64_t* vp = valid.data();
      for (int64_t w = 0; w < words; ++w) {
        const uint64_t s = xs[r * words + w], m = xm[r * words + w];
        const uint64_t* wsw = wst.data() + w * out;
        if (has_mask) {
          const uint64_t* wmw = wmt.data() + w * out;
          for (int64_t o = 0; o < out; ++o) {
            const uint64_t both = m & wmw[o];
            vp[o] += popcount(both);
            dp[o] += popcount((s ^ wsw[o]) & both);
          }
        } else {
          for (int64_t o = 0; o < out; ++o) dp[o] += popcount((s ^ wsw[o]) & m);
        }
      }
      float* yr = yp + r * out;
      const int64_t n = xcount[r];
      for (int64_t o = 0; o < out; ++o) {
        const int64_t dot = (has_mask ? vp[o] : n) - 2 * dp[o];
        float value = static_cast<float>(dot) * sc[o];  // -ffp-contract=off: rounded here, no FMA
        if (b != nullptr) value = value + b[o];
        yr[o] = value;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(vca_patch_didb, m) {
  m.def("xnor_linear(Tensor x, Tensor weight_signs, Tensor? weight_nonzero, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(vca_patch_didb, CPU, m) { m.impl("xnor_linear", &xnor_linear); }
