// The sampler's two hot loops over a batch of vocabulary-wide rows (engine/sampler.py calls them;
// engine/kernels/reference.py has the same in torch ops, which run where this library does not):
//
//   argmax_rows(x)                        the first largest logit of each row (torch.argmax's
//                                         answer, NaN counting as largest); torch's own argmax
//                                         over 64 x 49,152 logits took 13 ms on this CPU
//   sample_rows(x, top_k, top_p, u)       each row's draw: keep its top-k tokens, then the fewest
//                                         of those (largest first) whose mass reaches top_p (a
//                                         logit threshold: ties with the last one kept stay), and
//                                         return the first token, in vocabulary order, whose
//                                         cumulative mass exceeds u times the kept mass.
//
// The reference finds top-p's nucleus with a full sort of every row (110 ms for 64 rows here);
// here it is sorted from the tokens within 16 of the row's largest logit (e^-16: below float32's
// resolution of the mass), and from the whole row only when those do not hold top_p's mass. Sums
// of probabilities are kept in double, so a draw can differ from the reference's float32 cumsum
// only where u lands within rounding of a boundary between two tokens.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "vec_avx2.h"

namespace {

using jitney_kernels::exp8;

constexpr float kInf = std::numeric_limits<float>::infinity();
// Tokens further than this below a row's largest logit weigh at most e^-16 (1.1e-7) of it each:
// the top-p candidates are the ones above (the rest are sorted only when these fall short).
constexpr float kCandidateSpan = 16.0f;

int64_t argmax_row(const float* x, int64_t V) {
  __m256 best = _mm256_set1_ps(-kInf);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) break;  // a NaN: exact scan below
    best = _mm256_max_ps(best, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float top = *std::max_element(lanes, lanes + 8);
  for (int64_t j = i; j < V; ++j) {
    if (std::isnan(x[j])) {
      // torch.argmax counts NaN as the largest: the first NaN wins, unless an earlier one did.
      for (int64_t k = 0; k < j; ++k) {
        if (std::isnan(x[k])) return k;
      }
      return j;
    }
    top = std::max(top, x[j]);
  }
  for (int64_t j = 0; j < V; ++j) {
    if (x[j] == top) return j;
  }
  return 0;  // every logit -inf: torch answers 0 too
}

float row_max(const float* x, int64_t V) {
  __m256 best = _mm256_set1_ps(-kInf);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float top = *std::max_element(lanes, lanes + 8);
  for (; i < V; ++i) top = std::max(top, x[i]);
  return top;
}

// sum over x >= floor of exp(x - top).
double kept_mass(const float* x, int64_t V, float top, float floor) {
  const __m256 t = _mm256_set1_ps(top), f = _mm256_set1_ps(floor);
  double total = 0;
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(v, t)), _mm256_cmp_ps(v, f, _CMP_GE_OQ));
    total += jitney_kernels::hsum(e);
  }
  for (; i < V; ++i) {
    if (x[i] >= floor) total += std::exp(x[i] - top);
  }
  return total;
}

// The smallest logit top-p keeps among the survivors (x >= floor, sorted largest first, mass
// normalised over the survivors): tokens are kept while the mass before them is below top_p.
// Candidates are sorted only as far as needed: the largest 64, then 4x as many, and so on.
float top_p_floor(const float* x, int64_t V, float top, float floor, double top_p,
                  std::vector<float>& buf) {
  const double total = kept_mass(x, V, top, floor);
  for (float from : {std::max(floor, top - kCandidateSpan), floor}) {
    buf.clear();
    for (int64_t i = 0; i < V; ++i) {
      if (x[i] >= from) buf.push_back(x[i]);
    }
    const int64_t n = static_cast<int64_t>(buf.size());
    double before = 0;
    float last = buf.front();
    int64_t sorted = 0;
    for (int64_t want = 64; sorted < n; want *= 4) {
      const int64_t upto = std::min(want, n);
      std::partial_sort(buf.begin() + sorted, buf.begin() + upto, buf.end(), std::greater<float>());
      for (; sorted < upto; ++sorted) {
        if (before >= top_p) return last;
        last = buf[sorted];
        before += std::exp(static_cast<double>(last) - top) / total;
      }
    }
    if (before >= top_p || from <= floor) return last;  // reached, or every survivor kept
  }
  return floor;
}

int64_t sample_row(const float* x, int64_t V, int64_t k, double top_p, double u,
                   std::vector<float>& buf) {
  const float top = row_max(x, V);
  float floor = -kInf;
  if (0 < k && k < V) {  // the k-th largest logit (ties with it stay): among the candidates
    for (float from : {top - kCandidateSpan, -kInf}) {  // near the top if k of them are there
      buf.clear();
      for (int64_t i = 0; i < V; ++i) {
        if (x[i] >= from) buf.push_back(x[i]);
      }
      if (static_cast<int64_t>(buf.size()) >= k) break;
    }
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
    floor = buf[k - 1];
  }
  if (top_p < 1) floor = top_p_floor(x, V, top, floor, top_p, buf);
  // The draw: the first kept token whose cumulative mass exceeds u * (the kept mass).
  const double target = u * kept_mass(x, V, top, floor);
  const __m256 t = _mm256_set1_ps(top), f = _mm256_set1_ps(floor);
  double mass = 0;
  int64_t i = 0, last = -1;
  for (; i + 8 <= V; i += 8) {  // whole groups of 8 while the target is beyond them
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(v, t)), _mm256_cmp_ps(v, f, _CMP_GE_OQ));
    const double group = jitney_kernels::hsum(e);
    if (mass + group > target) break;
    mass += group;
  }
  for (; i < V; ++i) {
    if (x[i] < floor) continue;
    mass += std::exp(x[i] - top);
    last = i;
    if (mass > target) return i;
  }
  return last >= 0 ? last : argmax_row(x, V);  // rounding left the target just past the end
}

void check_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1 && x.size(1) > 0,
              op, ": x must be float32 [N, V] on the CPU with contiguous rows, got ",
              x.scalar_type(), " ", x.sizes());
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows("argmax_rows", x);
  const int64_t N = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * x.stride(0), V);
  });
  return out;
}

at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& u) {
  const char* op = "sample_rows";
  check_rows(op, x);
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.dim() == 1 && top_k.size(0) == N &&
                  top_k.is_contiguous(),
              op, ": top_k must be contiguous int64 [", N, "]");
  for (const at::Tensor* t : {&top_p, &u}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == N &&
                    t->is_contiguous(),
                op, ": top_p and u must be contiguous float32 [", N, "]");
  }
  at::Tensor out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* outp = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf;
    for (int64_t r = b; r < e; ++r) {
      outp[r] = sample_row(xp + r * x.stride(0), V, kp[r], pp[r], up[r], buf);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(jitney, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_rows", &sample_rows);
}
