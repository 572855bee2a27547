// CPU kernels for the torch engine's decode step: the operators around the GEMMs, one pass each.
// Each replaces a chain of small torch ops whose dispatch costs more than their arithmetic at decode shapes
// (rows = sequences in the batch). Semantics match rollout_server/engines/model.py and qurl/quant/absmax.py.
// The learner's: its log-prob head (learner/logprobs.py), RMSNorm, SwiGLU and the rotary embedding forward and backward
// (learner/fused.py), attention forward and backward (learner/attention.py), a transpose for its weight gradients
// (learner/linear.py), a push's int8 codes and its delta (qurl/wire/delta.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
inline T store(float v) { return static_cast<T>(v); }  // bf16: round to nearest even, as torch's casts

// parallel_for's grain for items of `work` elements each: a call under at::internal::GRAIN_SIZE elements in all runs
// on the calling thread, as torch's own element-wise operators do. A parallel region for every small call woke the
// OpenMP pool at each decode step's dozens of kernels (RESULTS §13).
inline int64_t grain(int64_t work, int64_t min_work = at::internal::GRAIN_SIZE) {
  return std::max<int64_t>(1, min_work / std::max<int64_t>(1, work));
}

// parallel_for over a decode attention call's (sequence, kv head) tasks, each reading its keys and values once per
// query row (`row_width` = query rows x head_dim elements), grained by the mean length
template <typename F>
void for_attention_tasks(int64_t b, int64_t kvh, int64_t row_width, const int64_t* lengths, const F& f) {
  int64_t keys = 0;
  for (int64_t i = 0; i < b; ++i) keys += lengths[i];
  at::parallel_for(0, b * kvh, grain(2 * row_width * std::max<int64_t>(1, keys / b)), f);
}

// y = w * dtype(x32 * rsqrt(mean(x32^2) + eps)), the product rounded once to the model dtype (HF RMSNorm)
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t k, float eps) {
  at::parallel_for(0, rows, grain(k), [&](int64_t begin, int64_t end) {
    std::vector<float> x32(k);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * k;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < k; ++i) {
        x32[i] = load(xr, i);
        ss += x32[i] * x32[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(k) + eps);
      T* yr = y + r * k;
      for (int64_t i = 0; i < k; ++i) {
        const float normed = static_cast<float>(store<T>(x32[i] * inv));
        yr[i] = store<T>(load(w, i) * normed);
      }
    }
  });
}

// per-row symmetric int8 codes shifted by 128 into uint8 (oneDNN's zero point 128) and the fp32 scale amax / 127
template <typename T>
void quant_rows(const T* x, uint8_t* q, float* scale, int64_t rows, int64_t k) {
  at::parallel_for(0, rows, grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * k;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(load(xr, i)));
      float s = amax / 127.f;
      if (!(s > 0.f)) s = 1.f;
      scale[r] = s;
      uint8_t* qr = q + r * k;
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) qr[i] = static_cast<uint8_t>(std::nearbyint(load(xr, i) / s) + 128.f);
    }
  });
}

// rotary embedding of one token per sequence and its k, v rows written to the cache: qkv [B, (H + 2 KV) D];
// cos, sin_signed [B, D] (sin_signed = [-sin, sin]); cache [slots, KV, T, D], sequence b in slot b at positions[b].
// x cos + roll(x, D / 2) sin_signed, each product and the sum rounded to the model dtype, as model.py's torch ops.
template <typename T>
void rope_cache_rows(const T* qkv, const T* cos, const T* sin, T* q, T* kc, T* vc, const int64_t* pos, int64_t b,
                     int64_t heads, int64_t kvh, int64_t d, int64_t kc_slot, int64_t kc_head, int64_t vc_slot,
                     int64_t vc_head) {
  const int64_t half = d / 2, width = (heads + 2 * kvh) * d;
  at::parallel_for(0, b * (heads + 2 * kvh), grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / (heads + 2 * kvh), h = task % (heads + 2 * kvh);
      const T* x = qkv + bi * width + h * d;
      T* dst;
      if (h < heads) {
        dst = q + (bi * heads + h) * d;
      } else if (h < heads + kvh) {
        dst = kc + bi * kc_slot + (h - heads) * kc_head + pos[bi] * d;
      } else {
        T* vrow = vc + bi * vc_slot + (h - heads - kvh) * vc_head + pos[bi] * d;
        std::memcpy(vrow, x, d * sizeof(T));
        continue;
      }
      const T* c = cos + bi * d;
      const T* sn = sin + bi * d;
      for (int64_t i = 0; i < d; ++i) {
        const float rolled = load(x, i < half ? i + half : i - half);
        const float a = static_cast<float>(store<T>(load(x, i) * load(c, i)));
        const float r = static_cast<float>(store<T>(rolled * load(sn, i)));
        dst[i] = store<T>(a + r);
      }
    }
  });
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 fp32 values from 16 model-dtype values
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // bf16 is fp32's high half
}

// e^x for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (~1 ulp), times 2^n
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}


// the model dtype's rounding of 16 fp32 values, back in fp32 (bf16: round to nearest even, as c10's cast)
inline __m512 round16(__m512 x, float) { return x; }
inline __m512 round16(__m512 x, c10::BFloat16) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round16(x, c10::BFloat16())), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}

// lane j = op (add or max) over v[j]'s 16 lanes: a transpose-and-combine tree, about 3 instructions per vector
template <typename Op>
inline __m512 across16(const __m512* v, const Op& op) {
  __m512 w[8], x[4];
  for (int j = 0; j < 8; ++j) {
    w[j] = op(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44), _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  }
  for (int j = 0; j < 4; ++j) {
    x[j] = op(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88), _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  }
  const __m512 t0 = op(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 t1 = op(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  const __m512 u =
      op(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4b + j holds v[4j + b]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, u);
}
inline __m512 sum16(const __m512* v) {
  return across16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}
inline __m512 max16(const __m512* v) {
  return across16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

constexpr bool kVectorAttention = true;

// s[l] = dot(l) * scale for l < len, 16 keys at a time: their dot products as 16 vectors, summed across at once
template <typename Dot>
inline void scores_by_block(int64_t len, float scale, float* s, const Dot& dot) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t l0 = 0; l0 < len; l0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - l0);
    __m512 part[16];
    for (int64_t j = 0; j < 16; ++j) part[j] = j < n ? dot(l0 + j) : _mm512_setzero_ps();
    _mm512_storeu_ps(s + l0, _mm512_mul_ps(sum16(part), sc));
  }
}

// one (sequence, kv head) task's scores: its G query rows qf [G, D] (fp32, scaled) against keys kt[l * ks2], l < len,
// into s [G][padded]
template <typename T, int C16>
void scores_fp32(const float* qf, int64_t g, const T* kt, int64_t ks2, int64_t len, int64_t padded, float* s) {
  for (int64_t gi = 0; gi < g; ++gi) {
    __m512 row[C16];
    for (int c = 0; c < C16; ++c) row[c] = _mm512_loadu_ps(qf + (gi * C16 + c) * 16);
    scores_by_block(len, 1.f, s + gi * padded, [&](int64_t l) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < C16; ++c) acc = _mm512_fmadd_ps(row[c], load16(kt + l * ks2 + 16 * c), acc);
      return acc;
    });
  }
}

#if defined(__AVX512BF16__)
// the same scores for bf16 q and keys by vdpbf16ps: bf16 products are exact in fp32 and summed in fp32, so the keys
// are read as they are stored, never widened (G times per key in scores_fp32); the scale multiplies the sums
template <int C16>
void scores_bf16(const c10::BFloat16* qt, int64_t g, float scale, const c10::BFloat16* kt, int64_t ks2, int64_t len,
                 int64_t padded, float* s) {
  constexpr int C32 = C16 / 2;
  for (int64_t gi = 0; gi < g; ++gi) {
    __m512bh row[C32];
    for (int c = 0; c < C32; ++c) row[c] = (__m512bh)_mm512_loadu_si512(qt + (gi * C32 + c) * 32);
    scores_by_block(len, scale, s + gi * padded, [&](int64_t l) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < C32; ++c) {
        acc = _mm512_dpbf16_ps(acc, row[c], (__m512bh)_mm512_loadu_si512(kt + l * ks2 + 32 * c));
      }
      return acc;
    });
  }
}
#endif

// out [G, D] = p [G][padded] times values vt[l * vs2], l < len: each value row is read (and widened) once for R query
// rows at a time, whose R x D sums stay in 16 registers
template <typename T, int C16>
void weighted_values(const float* p, int64_t g, int64_t padded, const T* vt, int64_t vs2, int64_t len, T* out) {
  constexpr int R = C16 >= 16 ? 1 : 16 / C16;
  for (int64_t g0 = 0; g0 < g; g0 += R) {
    const int64_t nr = std::min<int64_t>(R, g - g0);
    __m512 a[R][C16];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C16; ++c) a[r][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < len; ++l) {
      const T* vr = vt + l * vs2;
      __m512 vv[C16];
      for (int c = 0; c < C16; ++c) vv[c] = load16(vr + 16 * c);
      for (int r = 0; r < R; ++r) {
        if (r < nr) {
          const __m512 pv = _mm512_set1_ps(p[(g0 + r) * padded + l]);
          for (int c = 0; c < C16; ++c) a[r][c] = _mm512_fmadd_ps(pv, vv[c], a[r][c]);
        }
      }
    }
    for (int64_t r = 0; r < nr; ++r)
      for (int c = 0; c < C16; ++c) store16(out + (g0 + r) * C16 * 16 + 16 * c, a[r][c]);
  }
}

// scores -> probabilities in place, per query row: the max, e^(s - max) and their sum over the len real keys
inline void softmax_rows(float* s, int64_t g, int64_t len, int64_t padded) {
  for (int64_t gi = 0; gi < g; ++gi) {
    float* sg = s + gi * padded;
    std::fill(sg + len, sg + padded, sg[0]);  // the tail's lanes: a real score, so they never set the max
    __m512 m = _mm512_set1_ps(sg[0]);
    for (int64_t l = 0; l < padded; l += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + l));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < padded; l += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + l), mx));
      _mm512_storeu_ps(sg + l, e);
      if (l + 16 <= len) {
        sum = _mm512_add_ps(sum, e);
      } else {
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps((__mmask16)((1u << (len - l)) - 1), e));
      }
    }
    const float inv = 1.f / _mm512_reduce_add_ps(sum);
    for (int64_t l = 0; l < len; ++l) sg[l] *= inv;
  }
}

// one new token per sequence: q [B, KV, G, D]; k, v [B, KV, >=L, D] (last dim contiguous, D = 16 * C16);
// lengths [B] keys each sequence sees. Scores, softmax and the weighted sum of v in fp32; out in q's dtype.
template <typename T, int C16>
void decode_attention_d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* lengths,
                        float scale, at::Tensor& out) {
  constexpr int64_t d = 16 * C16;
  const int64_t kvh = q.size(1), g = q.size(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  for_attention_tasks(q.size(0), kvh, g * d, lengths, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / kvh, h = task % kvh, len = lengths[bi], padded = (len + 15) / 16 * 16;
      const T* qt = qp + task * g * d;
      const T* kt = kp + bi * ks0 + h * ks1;
      scores.resize(g * padded);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16> && C16 % 2 == 0) {
        scores_bf16<C16>(qt, g, scale, kt, ks2, len, padded, scores.data());
      } else
#endif
      {
        for (int64_t i = 0; i < g * d; ++i) qf[i] = load(qt, i) * scale;
        scores_fp32<T, C16>(qf.data(), g, kt, ks2, len, padded, scores.data());
      }
      softmax_rows(scores.data(), g, len, padded);
      weighted_values<T, C16>(scores.data(), g, padded, vp + bi * vs0 + h * vs1, vs2, len, op + task * g * d);
    }
  });
}

template <typename T>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const int64_t* lengths, float scale, at::Tensor& out) {
  switch (q.size(3) / 16) {  // D a multiple of 16 up to 128 (decode_attention's check)
    case 1: return decode_attention_d<T, 1>(q, k, v, lengths, scale, out);
    case 2: return decode_attention_d<T, 2>(q, k, v, lengths, scale, out);
    case 3: return decode_attention_d<T, 3>(q, k, v, lengths, scale, out);
    case 4: return decode_attention_d<T, 4>(q, k, v, lengths, scale, out);
    case 5: return decode_attention_d<T, 5>(q, k, v, lengths, scale, out);
    case 6: return decode_attention_d<T, 6>(q, k, v, lengths, scale, out);
    case 7: return decode_attention_d<T, 7>(q, k, v, lengths, scale, out);
    default: return decode_attention_d<T, 8>(q, k, v, lengths, scale, out);
  }
}

#if defined(__AVX512VNNI__)
#define QURL_INT8_GEMM
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
constexpr const char* kInt8Gemm = "amx";  // AMX tiles where K is a multiple of 64, else VNNI
// every row count, prefill's too: at 256-2,880 rows of SmolLM2's shapes on par with oneDNN's AMX qlinear (0.48-1.60x
// per shape and call, noisy, ~1x in the mean; RESULTS §13), and the engine then keeps no oneDNN copy of the codes,
// whose re-pack was 0.40 s of a push's 0.60 s of re-derivations
constexpr int64_t kInt8GemmMaxRows = INT64_MAX;
#else
constexpr const char* kInt8Gemm = "avx512-vnni";
constexpr int64_t kInt8GemmMaxRows = 32;  // above it oneDNN's qlinear is as fast (RESULTS §13)
#endif
inline bool packed_matches(const at::Tensor& p, int64_t n, int64_t k) {
  return p.dim() == 4 && p.size(0) == (n + 15) / 16 && p.size(1) == (k + 3) / 4;
}

// int8 codes [N, K] -> [ceil(N/16)][ceil(K/4)][16][4] (zero padded), the panel one VNNI step reads, and
// 128 * each row's sum (the u8 input's zero point times the codes)
std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(), "int8_pack: int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1), nb = (n + 15) / 16, k4 = (k + 3) / 4;
  auto packed = at::zeros({nb, k4, 16, 4}, codes.options());
  auto comp = at::empty({nb * 16}, codes.options().dtype(at::kInt));
  const int8_t* c = codes.data_ptr<int8_t>();
  int8_t* pk = packed.data_ptr<int8_t>();
  int32_t* cp = comp.data_ptr<int32_t>();
  const int64_t full = k / 4;  // whole quads; the last K % 4 inputs stay zero padded
  // every push re-packs every linear: rows by 4-byte quads and panels in parallel, not byte by byte
  at::parallel_for(0, nb, grain(16 * k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin * 16; r < std::min(n, end * 16); ++r) {
      const int8_t* row = c + r * k;
      int8_t* dst = pk + ((r / 16) * k4 * 16 + r % 16) * 4;
      for (int64_t i = 0; i < full; ++i) std::memcpy(dst + i * 64, row + 4 * i, 4);
      if (k > 4 * full) std::memcpy(dst + full * 64, row + 4 * full, k - 4 * full);
      int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < k; ++i) sum += row[i];
      cp[r] = 128 * sum;
    }
  });
  for (int64_t r = n; r < nb * 16; ++r) cp[r] = 0;
  return {packed, comp};
}


// acc[r] = the int32 sums of input rows xb[r] (r < R, R a constant so they stay in registers) with one panel
template <int R>
inline void int8_tile_rows(const uint8_t* xb, int64_t k, const int8_t* panel, __m512i* out) {
  const int64_t kfull = k / 4;
  __m512i acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t i = 0; i < kfull; ++i) {
    const __m512i wv = _mm512_loadu_si512(panel + i * 64);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, xb + r * k + 4 * i, 4);
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(quad), wv);
    }
  }
  if (4 * kfull < k) {  // the last K % 4 inputs, zero padded like the panel
    const __m512i wv = _mm512_loadu_si512(panel + kfull * 64);
    for (int r = 0; r < R; ++r) {
      uint8_t q4[4] = {0, 0, 0, 0};
      std::memcpy(q4, xb + r * k + 4 * kfull, k - 4 * kfull);
      int32_t quad;
      std::memcpy(&quad, q4, 4);
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(quad), wv);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// int8_tile_rows for a row count known only at run time (1..R)
template <int R>
inline void int8_tile(int64_t rows, const uint8_t* xb, int64_t k, const int8_t* panel, __m512i* out) {
  if (rows == R) {
    int8_tile_rows<R>(xb, k, panel, out);
  } else if constexpr (R > 1) {
    int8_tile<R - 1>(rows, xb, k, panel, out);
  }
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
// Linux grants a process AMX's tile state only when asked (oneDNN asks too, for its own AMX kernels)
inline bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// tiles 0 (int32 sums), 1 (16 input rows x 64 u8) and 2 (16 quads x 16 codes x 4 s8: 64 inputs of one panel),
// each 16 rows of 64 bytes
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64};
  uint8_t rows[16] = {16, 16, 16};
};

// int8_tile for 16 input rows (zero padded, row stride k) and one panel by AMX, k a multiple of 64: the panel's 16
// quads per 64 inputs are the B tile as stored
inline void int8_tile_amx(const uint8_t* x16, int64_t k, const int8_t* panel, __m512i* out) {
  _tile_zero(0);
  for (int64_t kc = 0; kc < k / 64; ++kc) {
    _tile_loadd(1, x16 + kc * 64, k);
    _tile_loadd(2, panel + kc * 1024, 64);
    _tile_dpbusd(0, 1, 2);
  }
  _tile_stored(0, out, 64);
}
#endif

// y[m, n] = ((sum_k xu[m, k] w[n, k] - 128 sum_k w[n, k]) * w_scale[n]) * x_scale[m] (+ bias[n]): exact int32 sums
// (VNNI's u8 x s8 adds into int32, no saturation), the dequantization in fp32, y in T
template <typename T>
void int8_gemm_kernel(const uint8_t* xu, const float* xs, const int8_t* pk, const int32_t* comp, const float* ws,
                      const T* bias, T* y, int64_t m, int64_t n, int64_t k) {
  const int64_t nb = (n + 15) / 16, k4 = (k + 3) / 4;
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  const bool amx = k % 64 == 0 && amx_granted();
  std::vector<uint8_t> padded;  // whole A tiles: the input rows zero padded to a multiple of 16, where they are not
  const uint8_t* x16 = xu;
  if (amx && m % 16 != 0) {
    padded.assign((m + 15) / 16 * 16 * k, 0);
    std::memcpy(padded.data(), xu, m * k);
    x16 = padded.data();
  }
#endif
  // a region only for work worth a fork: 2^19 multiply-adds is ~8k VNNI instructions, a few microseconds
  at::parallel_for(0, nb, grain(m * k * 16, int64_t{1} << 19), [&](int64_t begin, int64_t end) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (amx) {
      const TileConfig cfg;
      _tile_loadconfig(&cfg);
    }
#endif
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* panel = pk + b * k4 * 64;
      const __m512i cv = _mm512_loadu_si512(comp + b * 16);
      const int64_t cols = std::min<int64_t>(16, n - b * 16);
      const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
      const __m512 wsv = _mm512_maskz_loadu_ps(keep, ws + b * 16);
      __m512 bv = _mm512_setzero_ps();
      if (bias != nullptr) {
        alignas(64) float tmp[16] = {};
        for (int64_t j = 0; j < cols; ++j) tmp[j] = static_cast<float>(bias[b * 16 + j]);
        bv = _mm512_load_ps(tmp);
      }
      for (int64_t m0 = 0; m0 < m; m0 += 16) {
        const int64_t rows = std::min<int64_t>(16, m - m0);
        __m512i acc[16];
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
        if (amx) {
          int8_tile_amx(x16 + m0 * k, k, panel, acc);
        } else
#endif
        int8_tile<16>(rows, xu + m0 * k, k, panel, acc);
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], cv));
          __m512 out = _mm512_mul_ps(_mm512_mul_ps(f, wsv), _mm512_set1_ps(xs[m0 + r]));
          T* yr = y + (m0 + r) * n + b * 16;
          if (bias != nullptr) out = _mm512_add_ps(round16(out, T()), bv);
          if (cols == 16) {
            store16(yr, out);
          } else {
            alignas(64) T tmp[16];
            store16(tmp, out);
            std::memcpy(yr, tmp, cols * sizeof(T));
          }
        }
      }
    }
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (amx) _tile_release();
#endif
  });
}
#else
constexpr const char* kInt8Gemm = "";  // without AVX-512 VNNI the engine keeps oneDNN's qlinear
#endif
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (the AVX2-only EPYC): the same kernels 8 lanes wide, and an int8 GEMM on AVX2's u8 x s8 pairs
#include <immintrin.h>
#define QURL_INT8_GEMM
constexpr const char* kInt8Gemm = "avx2";
// every row count, as AMX's: 1.28-1.43x oneDNN's sign split at 256-2,880 rows of SmolLM2's shapes, 2.7-3.6x at 16
// (RESULTS §13, twenty-second session), and the engine keeps no oneDNN copy of the codes to re-pack after a push
constexpr int64_t kInt8GemmMaxRows = INT64_MAX;

// int8 codes [N, K] -> the same rows zero padded to a multiple of 32 inputs (one AVX2 step), and an unused
// compensation (this kernel multiplies signed codes, no zero point). Codes must be symmetric: -128 has no sign flip.
std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(), "int8_pack: int8 [N, K]");
  TORCH_CHECK(codes.numel() == 0 || codes.min().item<int8_t>() > -128, "int8_pack: codes in [-127, 127]");
  const int64_t n = codes.size(0), k = codes.size(1);
  auto packed = at::zeros({n, (k + 31) / 32 * 32}, codes.options());
  packed.narrow(1, 0, k).copy_(codes);
  return {packed, at::zeros({n}, codes.options().dtype(at::kInt))};
}
inline bool packed_matches(const at::Tensor& p, int64_t n, int64_t k) {
  return p.dim() == 2 && p.size(0) == n && p.size(1) == (k + 31) / 32 * 32;
}

// y[m, n] = ((sum_k x[m, k] w[n, k]) * x_scale[m]) * w_scale[n] (+ bias[n]), x the signed codes (xu ^ 0x80).
// AVX2 multiplies u8 x s8 pairs into saturating int16, so each step takes |x| and w with x's sign (|x|, |w| <= 127:
// a pair's sum stays under 32767, the sums exact, as llama.cpp's AVX2 dot products do); 2 rows x 4 columns a tile.
// Each thread's columns are swept once per block of kRowBlock rows, so that block's codes stay in L2 while the
// thread's weight rows stream past them (unblocked, prefill's thousands of rows were re-read from L3 per tile).
constexpr int64_t kRowBlock = 64;
template <typename T>
void int8_gemm_kernel(const uint8_t* xu, const float* xs, const int8_t* pk, const int32_t*, const float* ws,
                      const T* bias, T* y, int64_t m, int64_t n, int64_t k) {
  const int64_t kp = (k + 31) / 32 * 32, k32 = k / 32 * 32;
  std::vector<int8_t> sx(m * kp, 0), ax(m * kp, 0);  // signed codes and their magnitudes, zero padded like the rows
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  at::parallel_for(0, m, grain(k, int64_t{1} << 16), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* xr = xu + r * k;
      int8_t *sr = sx.data() + r * kp, *ar = ax.data() + r * kp;
      for (int64_t i = 0; i < k32; i += 32) {
        const __m256i c = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + i)), flip);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sr + i), c);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ar + i), _mm256_abs_epi8(c));  // abs(-128) = 0x80, read as 128
      }
      for (int64_t i = k32; i < k; ++i) {
        const int8_t c = static_cast<int8_t>(xr[i] ^ 0x80);
        sr[i] = c;
        ar[i] = static_cast<int8_t>(c < 0 ? -c : c);
      }
    }
  });
  const __m256i ones = _mm256_set1_epi16(1);
  at::parallel_for(0, (n + 3) / 4, grain(m * k * 4, int64_t{1} << 19), [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t r1 = std::min(m, r0 + kRowBlock);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t c0 = 4 * b, cols = std::min<int64_t>(4, n - c0);
        const int8_t* w[4];
        for (int64_t j = 0; j < 4; ++j) w[j] = pk + std::min(c0 + j, n - 1) * kp;  // a short tile repeats its last
        for (int64_t m0 = r0; m0 < r1; m0 += 2) {
          const int64_t rows = std::min<int64_t>(2, r1 - m0);
          const int8_t* xsr[2] = {sx.data() + m0 * kp, sx.data() + (m0 + rows - 1) * kp};
          const int8_t* xar[2] = {ax.data() + m0 * kp, ax.data() + (m0 + rows - 1) * kp};
          __m256i acc[2][4];
          for (auto& row : acc) for (auto& a : row) a = _mm256_setzero_si256();
          for (int64_t i = 0; i < kp; i += 32) {
            __m256i wv[4];
            for (int j = 0; j < 4; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + i));
            for (int r = 0; r < 2; ++r) {
              const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xar[r] + i));
              const __m256i xsg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xsr[r] + i));
              for (int j = 0; j < 4; ++j) {
                const __m256i pairs = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[j], xsg));
                acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(pairs, ones));
              }
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[r][0], acc[r][1]),
                                                _mm256_hadd_epi32(acc[r][2], acc[r][3]));
            alignas(16) int32_t sums[4];
            _mm_store_si128(reinterpret_cast<__m128i*>(sums),
                            _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
            for (int64_t j = 0; j < cols; ++j) {  // the dequantization of the oneDNN sign-split path it replaces
              float out = (static_cast<float>(sums[j]) * xs[m0 + r]) * ws[c0 + j];
              if (bias != nullptr) out = static_cast<float>(store<T>(out)) + static_cast<float>(bias[c0 + j]);
              y[(m0 + r) * n + c0 + j] = store<T>(out);
            }
          }
        }
      }
    }
  });
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// e^x for x in [-87, 88.7]: as exp16, with 2^n built in the exponent bits (AVX2 has no scalef)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

inline __m256 round8(__m256 x, float) { return x; }
inline __m256 round8(__m256 x, c10::BFloat16) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(c10::BFloat16* p, __m256 x) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round8(x, c10::BFloat16())), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// lane j = the sum of v[j]'s 8 lanes: two rounds of horizontal adds, then the two halves added
inline __m256 sum8(const __m256* v) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float reduce8(__m256 x, bool max) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  float r = lanes[0];
  for (int i = 1; i < 8; ++i) r = max ? std::max(r, lanes[i]) : r + lanes[i];
  return r;
}

constexpr bool kVectorAttention = true;

// decode_attention_kernel of the AVX-512 block, 8 keys and 8 lanes at a time (D a multiple of 16, up to 128)
template <typename T>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const int64_t* lengths, float scale, at::Tensor& out) {
  const int64_t b = q.size(0), kvh = q.size(1), g = q.size(2), d = q.size(3), c8 = d / 8;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  for_attention_tasks(b, kvh, g * d, lengths, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / kvh, h = task % kvh, len = lengths[bi], padded = (len + 7) / 8 * 8;
      const T* qt = qp + task * g * d;
      for (int64_t i = 0; i < g * d; ++i) qf[i] = load(qt, i) * scale;
      scores.resize(g * padded);
      const T* kt = kp + bi * ks0 + h * ks1;
      for (int64_t gi = 0; gi < g; ++gi) {
        const float* qg = qf.data() + gi * d;
        for (int64_t l0 = 0; l0 < len; l0 += 8) {
          __m256 part[8];
          for (int64_t j = 0; j < 8; ++j) {
            part[j] = _mm256_setzero_ps();
            if (l0 + j < len) {
              const T* kr = kt + (l0 + j) * ks2;
              for (int64_t c = 0; c < c8; ++c) {
                part[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), load8(kr + 8 * c), part[j]);
              }
            }
          }
          _mm256_storeu_ps(scores.data() + gi * padded + l0, sum8(part));
        }
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        float* sg = scores.data() + gi * padded;
        std::fill(sg + len, sg + padded, sg[0]);
        __m256 m = _mm256_set1_ps(sg[0]);
        for (int64_t l = 0; l < padded; l += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sg + l));
        const __m256 mx = _mm256_set1_ps(reduce8(m, true));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t l = 0; l < padded; l += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + l), mx));
          _mm256_storeu_ps(sg + l, e);
          const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(len - l)), lane));
          sum = _mm256_add_ps(sum, _mm256_and_ps(e, keep));  // the tail's padding lanes left out
        }
        const float inv = 1.f / reduce8(sum, false);
        for (int64_t l = 0; l < len; ++l) sg[l] *= inv;
      }
      const T* vt = vp + bi * vs0 + h * vs1;
      for (int64_t gi = 0; gi < g; ++gi) {
        __m256 a[16];
        for (int64_t c = 0; c < c8; ++c) a[c] = _mm256_setzero_ps();
        const float* pg = scores.data() + gi * padded;
        for (int64_t l = 0; l < len; ++l) {
          const __m256 pv = _mm256_set1_ps(pg[l]);
          const T* vr = vt + l * vs2;
          for (int64_t c = 0; c < c8; ++c) a[c] = _mm256_fmadd_ps(pv, load8(vr + 8 * c), a[c]);
        }
        for (int64_t c = 0; c < c8; ++c) _mm256_storeu_ps(acc.data() + gi * d + 8 * c, a[c]);
      }
      T* ot = op + task * g * d;
      for (int64_t i = 0; i < g * d; ++i) ot[i] = store<T>(acc[i]);
    }
  });
}
#else
constexpr bool kVectorAttention = false;  // without AVX2 + FMA the engine keeps torch's scaled_dot_product_attention
constexpr const char* kInt8Gemm = "";     // and oneDNN's qlinear

template <typename T>
void decode_attention_kernel(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int64_t*, float,
                             at::Tensor&) {
  TORCH_CHECK(false, "decode_attention needs AVX2 and FMA");
}
#endif

// out = up * silu(gate), gate row r at g + r ld and up row r at u + r ld ([gate | up] rows: u = g + inter, ld = 2 inter),
// silu rounded to the model dtype and then the product, as torch's two operators round
template <typename T>
void silu_mul_rows(const T* gate, const T* up, int64_t ld, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(3 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate + r * ld;
      const T* u = up + r * ld;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= inter; i += 16) {
        const __m512 x = load16(g + i);
        const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(88.f)));
        const __m512 act = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), T());
        store16(o + i, _mm512_mul_ps(act, load16(u + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= inter; i += 8) {
        const __m256 x = load8(g + i);
        const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(88.f)));
        const __m256 act = round8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)), T());
        store8(o + i, _mm256_mul_ps(act, load8(u + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float x = load(g, i);
        o[i] = store<T>(static_cast<float>(store<T>(x / (1.f + std::exp(-x)))) * load(u, i));
      }
    }
  });
}

// the learner's SwiGLU backward over [gate | up] rows and dh = d out: with s = sigmoid(gate) and a = T(silu(gate)) as
// the forward rounded it, d up = T(dh a) and d gate = T(T(dh up) s (1 + gate (1 - s))): autograd's mul and
// silu_backward, each rounded to the model dtype where they round
template <typename T>
void silu_mul_backward_rows(const T* dh, const T* gu, T* dgu, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(6 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      const T* d = dh + r * inter;
      T* dg = dgu + r * 2 * inter;
      T* du = dg + inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= inter; i += 16) {
        const __m512 x = load16(g + i), dv = load16(d + i);
        const __m512 den = _mm512_add_ps(one, exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x),
                                                                    _mm512_set1_ps(88.f))));
        const __m512 act = round16(_mm512_div_ps(x, den), T());
        const __m512 s = _mm512_div_ps(one, den);
        store16(du + i, _mm512_mul_ps(dv, act));
        const __m512 da = round16(_mm512_mul_ps(dv, load16(u + i)), T());
        const __m512 slope = _mm512_add_ps(one, _mm512_mul_ps(x, _mm512_sub_ps(one, s)));
        store16(dg + i, _mm512_mul_ps(_mm512_mul_ps(da, s), slope));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= inter; i += 8) {
        const __m256 x = load8(g + i), dv = load8(d + i);
        const __m256 den =
            _mm256_add_ps(one, exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(88.f))));
        const __m256 act = round8(_mm256_div_ps(x, den), T());
        const __m256 s = _mm256_div_ps(one, den);
        store8(du + i, _mm256_mul_ps(dv, act));
        const __m256 da = round8(_mm256_mul_ps(dv, load8(u + i)), T());
        const __m256 slope = _mm256_add_ps(one, _mm256_mul_ps(x, _mm256_sub_ps(one, s)));
        store8(dg + i, _mm256_mul_ps(_mm256_mul_ps(da, s), slope));
      }
#endif
      for (; i < inter; ++i) {
        const float x = load(g, i), dv = load(d, i);
        const float den = 1.f + std::exp(-x), s = 1.f / den;
        du[i] = store<T>(dv * static_cast<float>(store<T>(x / den)));
        const float da = static_cast<float>(store<T>(dv * load(u, i)));
        dg[i] = store<T>(da * s * (1.f + x * (1.f - s)));
      }
    }
  });
}

// HF's rotary embedding of [B, L, heads, d] rows by cos, sin [B or 1, L, d], rotate_half(x) = [-x2, x1]: y = x cos +
// rotate_half(x) sin, each product and the sum rounded to the model dtype as torch's chain rounds them. With `grad`,
// the input's gradient from y's the same way: dx = dy cos + rotate_half^T(dy sin), rotate_half^T(g) = [g2, -g1]. Both
// halves are one form, o = T(T(a c) + T(sign b s')): forward (b, s', sign) = (x2, s1, -) then (x1, s2, +), backward
// (dy2, s2, +) then (dy1, s1, -). Token t's x rows start at x + t x_ld (q or k inside one fused q | k | v projection),
// y's are contiguous.
template <typename T>
void rotary_rows(const T* x, int64_t x_ld, const T* cos, const T* sin, int64_t cos_batch, T* y, int64_t b, int64_t len,
                 int64_t heads, int64_t d, bool grad) {
  const int64_t half = d / 2;
  const float sign = grad ? 1.f : -1.f;  // the first half's partner term's sign; the second's is its opposite
  at::parallel_for(0, b * len, grain(3 * heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t at = (t / len) * cos_batch + (t % len) * d;  // token t's cos and sin
      const T* c = cos + at;
      const T* s1 = sin + at + (grad ? half : 0);  // the first half's sine
      const T* s2 = sin + at + (grad ? 0 : half);  // the second half's
      for (int64_t h = 0; h < heads; ++h) {
        const T* a = x + t * x_ld + h * d;
        T* o = y + (t * heads + h) * d;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 neg = _mm512_set1_ps(sign), pos = _mm512_set1_ps(-sign);
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = load16(a + i), x2 = load16(a + half + i);
          const __m512 p1 = round16(_mm512_mul_ps(_mm512_mul_ps(x2, neg), load16(s1 + i)), T());
          const __m512 p2 = round16(_mm512_mul_ps(_mm512_mul_ps(x1, pos), load16(s2 + i)), T());
          store16(o + i, _mm512_add_ps(round16(_mm512_mul_ps(x1, load16(c + i)), T()), p1));
          store16(o + half + i, _mm512_add_ps(round16(_mm512_mul_ps(x2, load16(c + half + i)), T()), p2));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 neg = _mm256_set1_ps(sign), pos = _mm256_set1_ps(-sign);
        for (; i + 8 <= half; i += 8) {
          const __m256 x1 = load8(a + i), x2 = load8(a + half + i);
          const __m256 p1 = round8(_mm256_mul_ps(_mm256_mul_ps(x2, neg), load8(s1 + i)), T());
          const __m256 p2 = round8(_mm256_mul_ps(_mm256_mul_ps(x1, pos), load8(s2 + i)), T());
          store8(o + i, _mm256_add_ps(round8(_mm256_mul_ps(x1, load8(c + i)), T()), p1));
          store8(o + half + i, _mm256_add_ps(round8(_mm256_mul_ps(x2, load8(c + half + i)), T()), p2));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = load(a, i), x2 = load(a, half + i);
          const float p1 = static_cast<float>(store<T>(sign * x2 * load(s1, i)));
          const float p2 = static_cast<float>(store<T>(-sign * x1 * load(s2, i)));
          o[i] = store<T>(static_cast<float>(store<T>(x1 * load(c, i))) + p1);
          o[half + i] = store<T>(static_cast<float>(store<T>(x2 * load(c, half + i))) + p2);
        }
      }
    }
  });
}

// the learner's RMSNorm backward (rms_norm_rows forward): r = rsqrt(mean(x^2) + eps), n = T(x r), y = w n. With
// dn = T(dy w), as autograd forms it in the model dtype: dx = T(r dn - x r^3 sum(dn x) / k), and dw = the sum over
// rows of dy n, in fp32 (one partial per thread in dw_part, added by the caller) where autograd rounds each product
template <typename T>
void rms_norm_backward_rows(const T* dy, const T* x, const T* w, T* dx, float* dw_part, int64_t rows, int64_t k,
                            float eps) {
  at::parallel_for(0, rows, grain(4 * k), [&](int64_t begin, int64_t end) {
    float* dw = dw_part + at::get_thread_num() * k;
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * k;
      const T* dyr = dy + r * k;
      T* dxr = dx + r * k;
      // one pass for sum(x^2) and sum(dn x) (neither needs r), a second, from L1, for dx and dw
      float ss = 0.f, dot = 0.f;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 ss16 = _mm512_setzero_ps(), dot16 = _mm512_setzero_ps();
      for (; i + 16 <= k; i += 16) {
        const __m512 xv = load16(xr + i);
        ss16 = _mm512_add_ps(ss16, _mm512_mul_ps(xv, xv));
        dot16 = _mm512_add_ps(dot16, _mm512_mul_ps(round16(_mm512_mul_ps(load16(dyr + i), load16(w + i)), T()), xv));
      }
      ss = _mm512_reduce_add_ps(ss16);
      dot = _mm512_reduce_add_ps(dot16);
#elif defined(__AVX2__) && defined(__FMA__)
      __m256 ss8 = _mm256_setzero_ps(), dot8 = _mm256_setzero_ps();
      for (; i + 8 <= k; i += 8) {
        const __m256 xv = load8(xr + i);
        ss8 = _mm256_add_ps(ss8, _mm256_mul_ps(xv, xv));
        dot8 = _mm256_add_ps(dot8, _mm256_mul_ps(round8(_mm256_mul_ps(load8(dyr + i), load8(w + i)), T()), xv));
      }
      ss = reduce8(ss8, false);
      dot = reduce8(dot8, false);
#endif
      for (; i < k; ++i) {
        ss += load(xr, i) * load(xr, i);
        dot += static_cast<float>(store<T>(load(dyr, i) * load(w, i))) * load(xr, i);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(k) + eps);
      const float c = inv * inv * inv * dot / static_cast<float>(k);
      i = 0;
#if defined(__AVX512F__)
      const __m512 inv16 = _mm512_set1_ps(inv), c16 = _mm512_set1_ps(c);
      for (; i + 16 <= k; i += 16) {
        const __m512 xv = load16(xr + i), dyv = load16(dyr + i);
        const __m512 dn = round16(_mm512_mul_ps(dyv, load16(w + i)), T());
        store16(dxr + i, _mm512_sub_ps(_mm512_mul_ps(inv16, dn), _mm512_mul_ps(xv, c16)));
        const __m512 n = round16(_mm512_mul_ps(xv, inv16), T());
        _mm512_storeu_ps(dw + i, _mm512_add_ps(_mm512_loadu_ps(dw + i), _mm512_mul_ps(dyv, n)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 inv8 = _mm256_set1_ps(inv), c8 = _mm256_set1_ps(c);
      for (; i + 8 <= k; i += 8) {
        const __m256 xv = load8(xr + i), dyv = load8(dyr + i);
        const __m256 dn = round8(_mm256_mul_ps(dyv, load8(w + i)), T());
        store8(dxr + i, _mm256_sub_ps(_mm256_mul_ps(inv8, dn), _mm256_mul_ps(xv, c8)));
        const __m256 n = round8(_mm256_mul_ps(xv, inv8), T());
        _mm256_storeu_ps(dw + i, _mm256_add_ps(_mm256_loadu_ps(dw + i), _mm256_mul_ps(dyv, n)));
      }
#endif
      for (; i < k; ++i) {
        const float dn = static_cast<float>(store<T>(load(dyr, i) * load(w, i)));
        dxr[i] = store<T>(inv * dn - load(xr, i) * c);
        dw[i] += load(dyr, i) * static_cast<float>(store<T>(load(xr, i) * inv));
      }
    }
  });
}

// y = T(acc * xs[row]), then + bias rounded to T again (torch's add_ into a T tensor): an int8 linear's
// dequantization after oneDNN's GEMM applied the weights' scales, in one pass
template <typename T>
void dequant_rows(const float* acc, const float* xs, const T* bias, T* y, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float s = xs[r];
      const float* a = acc + r * n;
      T* o = y + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_set1_ps(s));
        if (bias != nullptr) v = _mm512_add_ps(round16(v, T()), load16(bias + i));
        store16(o + i, v);
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_set1_ps(s));
        if (bias != nullptr) v = _mm256_add_ps(round8(v, T()), load8(bias + i));
        store8(o + i, v);
      }
#endif
      for (; i < n; ++i) {
        const float v = static_cast<float>(store<T>(a[i] * s));
        o[i] = bias != nullptr ? store<T>(v + load(bias, i)) : store<T>(v);
      }
    }
  });
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define QURL_SAMPLE_ROWS
#if defined(__AVX512F__)
constexpr int64_t kExpWidth = 16;
// e[0..16) = e^(x / t - m) for x / t <= m, and their sum; 0 below e^-87 (exp16's floor), so that a -inf logit
// (a masked token) has no weight at all
inline float exp_chunk(const float* x, float t, float m, float* e) {
  const __m512 a = _mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(x), _mm512_set1_ps(t)), _mm512_set1_ps(m));
  const __m512 v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(-87.f), _CMP_GE_OQ), exp16(a));
  _mm512_storeu_ps(e, v);
  return _mm512_reduce_add_ps(v);
}
#else
constexpr int64_t kExpWidth = 8;
inline float exp_chunk(const float* x, float t, float m, float* e) {
  const __m256 a = _mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x), _mm256_set1_ps(t)), _mm256_set1_ps(m));
  const __m256 v = _mm256_and_ps(exp8(a), _mm256_cmp_ps(a, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
  _mm256_storeu_ps(e, v);
  return reduce8(v, false);
}
#endif

// sampling.py's draw in one pass over each row's logits (no top-k / top-p): the log-softmax of logits / t at the
// token, which is the first maximum where t == 0 (greedy; t = 1 for its logprob), else the first token whose
// cumulative e^(x / t - m) reaches u * their total, found by walking per-chunk sums then one chunk. Against
// sampling.py's cumsum over normalised probabilities only the summation order differs, so a draw can differ only
// where u * total falls within rounding of a boundary. Replaces log_softmax, exp, cumsum and searchsorted over
// [B, V] (four passes and three allocations: 5.2 ms against 20.3 ms on [64, 49152], one AMX Xeon thread).
void sample_rows_kernel(const float* logits, const float* temps, const float* uniforms, int64_t* tokens,
                        float* logprobs, int64_t b, int64_t v) {
  const int64_t w = kExpWidth, full = v / w, segments = (v + w - 1) / w;  // the last segment may be short
  // e[0..n) of segment j (n = its length) and their sum
  auto segment = [&](const float* x, int64_t j, float t, float m, float* e, int64_t* n) {
    *n = std::min(w, v - j * w);
    if (j < full) return exp_chunk(x + j * w, t, m, e);
    float sum = 0.f;
    for (int64_t i = 0; i < *n; ++i) {
      const float a = x[j * w + i] / t - m;
      sum += (e[i] = a >= -87.f ? std::exp(a) : 0.f);
    }
    return sum;
  };
  at::parallel_for(0, b, grain(4 * v), [&](int64_t begin, int64_t end) {
    std::vector<float> sums(segments);
    float e[kExpWidth];
    int64_t n = 0;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = logits + r * v;
      const bool greedy = temps[r] == 0.f;
      const float t = greedy ? 1.f : temps[r];
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t i = 0; i < v; ++i) mx = std::max(mx, x[i]);
      const float m = mx / t;  // division is monotone: the maximum of x / t
      double total = 0.0;  // fp64: a running fp32 sum of 6,144 segment sums (AVX2, 49k) was 2.3e-5 off in the log-prob
      int64_t last = 0;  // the last segment with weight: the walk stops there at the latest
      for (int64_t j = 0; j < segments; ++j) {
        total += (sums[j] = segment(x, j, t, m, e, &n));
        if (sums[j] > 0.f) last = j;
      }
      int64_t tok = 0;
      if (greedy) {
        while (tok + 1 < v && x[tok] != mx) ++tok;  // the first maximum, as torch.argmax
      } else {
        const double target = uniforms[r] * total;
        double c = 0.0;
        int64_t j = 0;
        while (j < last && c + sums[j] < target) c += sums[j++];
        segment(x, j, t, m, e, &n);
        tok = j * w;
        for (int64_t i = 0; i < n; ++i) {  // a positive weight only: rounding never picks an impossible token
          if (e[i] > 0.f) tok = j * w + i;
          c += e[i];
          if (e[i] > 0.f && c >= target) break;
        }
      }
      tokens[r] = tok;
      logprobs[r] = static_cast<float>((x[tok] / t - m) - std::log(total));
    }
  });
}

// The learner's log-prob head (learner/logprobs.py) over one chunk of logits rows [R, V], each row in blocks of
// kHeadBlock converted to fp32 on the stack: no [R, V] fp32 tensor exists. The torch chain it replaces (fp32 copy,
// logsumexp, sub, exp, mul, sum; backward: sub, exp, mul, scatter, bf16 copy) allocated one or two such tensors per
// pass, 134-268 MB at 1,365 rows of a 49k vocabulary, each page-faulted in anew (RESULTS §13).
constexpr int64_t kHeadBlock = 1024;

template <typename T>
inline int64_t head_block(const T* x, int64_t i, int64_t v, float* buf) {
  const int64_t n = std::min(kHeadBlock, v - i);
  for (int64_t j = 0; j < n; ++j) buf[j] = load(x, i + j);
  return n;
}

// per row: lse = logsumexp(x), logp = x[target] - lse, entropy = lse - sum(softmax(x) * x), x = logits / t
template <typename T>
void head_forward_kernel(const T* logits, const int64_t* targets, float t, float* lse, float* logp, float* entropy,
                         int64_t rows, int64_t v) {
  at::parallel_for(0, rows, grain(2 * v), [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kHeadBlock];
    alignas(64) float e[kExpWidth];
    for (int64_t r = begin; r < end; ++r) {
      const T* x = logits + r * v;
      float mx = -INFINITY;
      for (int64_t i = 0; i < v; i += kHeadBlock) {
        const int64_t n = head_block(x, i, v, buf);
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, buf[j]);
      }
      const float m = mx / t;  // division is monotone: the maximum of x / t
      float sum = 0.f, dot = 0.f;  // sum e^(x - m), and sum e^(x - m) x where the entropy is wanted
      for (int64_t i = 0; i < v; i += kHeadBlock) {
        const int64_t n = head_block(x, i, v, buf);
        int64_t j = 0;
        for (; j + kExpWidth <= n; j += kExpWidth) {
          sum += exp_chunk(buf + j, t, m, e);
          if (entropy != nullptr) {
#pragma omp simd reduction(+ : dot)
            for (int64_t k = 0; k < kExpWidth; ++k) dot += e[k] * (buf[j + k] / t);
          }
        }
        for (; j < n; ++j) {
          const float a = buf[j] / t - m, w = a >= -87.f ? std::exp(a) : 0.f;
          sum += w;
          dot += w * (buf[j] / t);
        }
      }
      lse[r] = m + std::log(sum);
      logp[r] = load(x, targets[r]) / t - lse[r];
      if (entropy != nullptr) entropy[r] = lse[r] - dot / sum;
    }
  });
}

// in place, per row: d = (onehot(target) - softmax(x)) * g / t' (t' = t where the forward divided, else 1), rounded
// once to the logits' dtype, as the torch chain's fp32 d then its cast
template <typename T>
void head_backward_kernel(T* logits, const int64_t* targets, const float* lse, const float* g, float t, bool divide,
                          int64_t rows, int64_t v) {
  at::parallel_for(0, rows, grain(2 * v), [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kHeadBlock];
    for (int64_t r = begin; r < end; ++r) {
      T* x = logits + r * v;
      const float gr = g[r];
      for (int64_t i = 0; i < v; i += kHeadBlock) {
        const int64_t n = head_block(x, i, v, buf);
        int64_t j = 0;
        for (; j + kExpWidth <= n; j += kExpWidth) exp_chunk(buf + j, t, lse[r], buf + j);
        for (; j < n; ++j) {
          const float a = buf[j] / t - lse[r];
          buf[j] = a >= -87.f ? std::exp(a) : 0.f;
        }
#pragma omp simd
        for (int64_t k = 0; k < n; ++k) buf[k] = buf[k] * -gr;
        if (targets[r] >= i && targets[r] < i + n) buf[targets[r] - i] += gr;
        if (divide) {
#pragma omp simd
          for (int64_t k = 0; k < n; ++k) buf[k] = buf[k] / t;
        }
        for (int64_t k = 0; k < n; ++k) x[i + k] = store<T>(buf[k]);
      }
    }
  });
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>

// a 16 x 16 block of 16-bit elements transposed in registers: three rounds of interleaving pairs, then 128-bit halves
inline void transpose_16x16(const uint16_t* s, int64_t ls, uint16_t* d, int64_t ld) {
  __m256i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i * ls));
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm256_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm256_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm256_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm256_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + 2 * j] = _mm256_unpacklo_epi64(r[8 * i + j], r[8 * i + j + 4]);
      t[8 * i + 2 * j + 1] = _mm256_unpackhi_epi64(r[8 * i + j], r[8 * i + j + 4]);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm256_permute2x128_si256(t[j], t[j + 8], 0x20);
    r[j + 8] = _mm256_permute2x128_si256(t[j], t[j + 8], 0x31);
  }
  for (int i = 0; i < 16; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i * ld), r[i]);
}
#endif

// dst [cols, rows] = src [rows, cols]^T of 16-bit elements (any dtype of that width moves unchanged), over 64 x 64
// tiles shared among the threads, each in 16 x 16 register blocks where AVX2 has them
void transpose_tiles(const uint16_t* src, int64_t rows, int64_t cols, int64_t ld, uint16_t* dst) {
  constexpr int64_t kTile = 64;
  const int64_t col_tiles = (cols + kTile - 1) / kTile, tiles = (rows + kTile - 1) / kTile * col_tiles;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t / col_tiles * kTile, c0 = t % col_tiles * kTile;
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      int64_t r = r0;
#if defined(__AVX2__)
      for (; r + 16 <= r1; r += 16) {
        int64_t c = c0;
        for (; c + 16 <= c1; c += 16) transpose_16x16(src + r * ld + c, ld, dst + c * rows + r, rows);
        for (; c < c1; ++c)
          for (int64_t k = r; k < r + 16; ++k) dst[c * rows + k] = src[k * ld + c];
      }
#endif
      for (; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) dst[c * rows + r] = src[r * ld + c];
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), name, ": a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": fp32 or bf16");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm x");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1), "rms_norm w");
  auto y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), eps);
  } else {
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                  x.size(0), x.size(1), eps);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> quantize_uint8_shifted(const at::Tensor& x) {
  check_rows(x, "quantize_uint8_shifted x");
  auto q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  auto s = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) {
    quant_rows(x.data_ptr<float>(), q.data_ptr<uint8_t>(), s.data_ptr<float>(), x.size(0), x.size(1));
  } else {
    quant_rows(x.data_ptr<c10::BFloat16>(), q.data_ptr<uint8_t>(), s.data_ptr<float>(), x.size(0), x.size(1));
  }
  return {q, s};
}

// The flat indices of the elements where a and b differ, U an unsigned integer of the element's size (bit patterns):
// 64-byte blocks compared whole (vectorized), then the elements of each block that differs. The blocks that differ
// are listed first and counted, so the output is allocated once at its size (a tensor whose every element moved
// gives as many indices as elements, and no growing buffer holds them twice).
template <typename U>
at::Tensor changed_in(const U* a, const U* b, int64_t n, const at::TensorOptions& options) {
  constexpr int64_t kBlock = 64 / sizeof(U);
  const int64_t blocks = n / kBlock;
  auto differs = [&](int64_t i) { return a[i] != b[i]; };
  std::vector<int64_t> touched;  // blocks that differ, and the tail as one more when it does
  int64_t count = 0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const U* x = a + blk * kBlock;
    const U* y = b + blk * kBlock;
    U diff = 0;
    for (int64_t j = 0; j < kBlock; ++j) diff |= x[j] ^ y[j];
    if (diff == 0) continue;
    touched.push_back(blk);
    for (int64_t j = 0; j < kBlock; ++j) count += x[j] != y[j];
  }
  int64_t tail = 0;
  for (int64_t i = blocks * kBlock; i < n; ++i) tail += differs(i);
  auto idx = at::empty({count + tail}, options.dtype(at::kLong));
  int64_t* out = idx.data_ptr<int64_t>();
  for (const int64_t blk : touched) {
    for (int64_t i = blk * kBlock; i < (blk + 1) * kBlock; ++i) {
      if (differs(i)) *out++ = i;
    }
  }
  for (int64_t i = blocks * kBlock; tail && i < n; ++i) {
    if (differs(i)) *out++ = i;
  }
  return idx;
}

// Flat indices (int64, increasing) of the elements whose bit patterns differ between two tensors of one shape and
// dtype: a delta push's diff (qurl/wire/delta.py) in one read of each, where the torch chain wrote a bool tensor and
// read it twice. Few elements change between two optimizer steps.
at::Tensor changed_indices(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "changed_indices: CPU tensors");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "changed_indices: contiguous tensors");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes(), "changed_indices: one shape and dtype");
  const void* pa = a.data_ptr();
  const void* pb = b.data_ptr();
  const int64_t n = a.numel();
  switch (a.element_size()) {
    case 1: return changed_in(static_cast<const uint8_t*>(pa), static_cast<const uint8_t*>(pb), n, a.options());
    case 2: return changed_in(static_cast<const uint16_t*>(pa), static_cast<const uint16_t*>(pb), n, a.options());
    case 4: return changed_in(static_cast<const uint32_t*>(pa), static_cast<const uint32_t*>(pb), n, a.options());
    case 8: return changed_in(static_cast<const uint64_t*>(pa), static_cast<const uint64_t*>(pb), n, a.options());
    default: TORCH_CHECK(false, "changed_indices: elements of 1, 2, 4 or 8 bytes");
  }
}

at::Tensor transposed(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "transposed: a 2-D CPU tensor of rows");
  TORCH_CHECK(x.element_size() == 2, "transposed: 16-bit elements (bf16, fp16)");
  at::Tensor out = at::empty({x.size(1), x.size(0)}, x.options());
  transpose_tiles(static_cast<const uint16_t*>(x.data_ptr()), x.size(0), x.size(1), x.stride(0),
                  static_cast<uint16_t*>(out.data_ptr()));
  return out;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_mul gate_up");
  const int64_t inter = gu.size(1) / 2;
  auto out = at::empty({gu.size(0), inter}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    const float* g = gu.data_ptr<float>();
    silu_mul_rows(g, g + inter, 2 * inter, out.data_ptr<float>(), gu.size(0), inter);
  } else {
    const c10::BFloat16* g = gu.data_ptr<c10::BFloat16>();
    silu_mul_rows(g, g + inter, 2 * inter, out.data_ptr<c10::BFloat16>(), gu.size(0), inter);
  }
  return out;
}

at::Tensor silu_mul_backward(const at::Tensor& dh, const at::Tensor& gu) {
  check_rows(gu, "silu_mul_backward gate_up");
  check_rows(dh, "silu_mul_backward dh");
  TORCH_CHECK(dh.scalar_type() == gu.scalar_type() && dh.size(0) == gu.size(0) && 2 * dh.size(1) == gu.size(1),
              "silu_mul_backward: dh is not [rows, gate_up width / 2] in gate_up's dtype");
  auto dgu = at::empty_like(gu);
  if (gu.scalar_type() == at::kFloat) {
    silu_mul_backward_rows(dh.data_ptr<float>(), gu.data_ptr<float>(), dgu.data_ptr<float>(), gu.size(0), dh.size(1));
  } else {
    silu_mul_backward_rows(dh.data_ptr<c10::BFloat16>(), gu.data_ptr<c10::BFloat16>(),
                           dgu.data_ptr<c10::BFloat16>(), gu.size(0), dh.size(1));
  }
  return dgu;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool grad) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.size(3) % 2 == 0 && x.stride(3) == 1 &&
                  x.stride(2) == x.size(3) && x.stride(0) == x.size(1) * x.stride(1) &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rotary: x an fp32 or bf16 [B, L, heads, head_dim] CPU tensor, head_dim even, each token's heads "
              "contiguous and tokens evenly spaced");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(1) == x.size(1) && cos.size(2) == x.size(3) &&
                  (cos.size(0) == 1 || cos.size(0) == x.size(0)) && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin contiguous [B or 1, L, head_dim] in x's dtype");
  auto y = at::empty(x.sizes(), x.options());
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0);
  if (x.scalar_type() == at::kFloat) {
    rotary_rows(x.data_ptr<float>(), x.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(), cb,
                y.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.size(3), grad);
  } else {
    using BF16 = c10::BFloat16;
    rotary_rows(x.data_ptr<BF16>(), x.stride(1), cos.data_ptr<BF16>(), sin.data_ptr<BF16>(), cb, y.data_ptr<BF16>(),
                x.size(0), x.size(1), x.size(2), x.size(3), grad);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     double eps) {
  check_rows(x, "rms_norm_backward x");
  check_rows(dy, "rms_norm_backward dy");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "rms_norm_backward: dy is not x's");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1), "rms_norm_backward w");
  const int64_t k = x.size(1);
  auto dx = at::empty_like(x);
  auto part = at::zeros({at::get_num_threads(), k}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) {
    rms_norm_backward_rows(dy.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), dx.data_ptr<float>(),
                           part.data_ptr<float>(), x.size(0), k, eps);
  } else {
    rms_norm_backward_rows(dy.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(),
                           dx.data_ptr<c10::BFloat16>(), part.data_ptr<float>(), x.size(0), k, eps);
  }
  return {dx, part.sum(0).to(x.scalar_type())};
}

at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& positions, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "rope_cache qkv");
  const int64_t b = qkv.size(0), d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d, "rope_cache: qkv width is not (heads + 2 kv_heads) head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == b * d && sin.numel() == b * d,
              "rope_cache: cos, sin [B, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && k_cache.stride(2) == d &&
                  v_cache.stride(3) == 1 && v_cache.stride(2) == d && k_cache.size(0) >= b && k_cache.size(1) == kv_heads,
              "rope_cache: caches [slots, kv_heads, T, D] with rows contiguous");
  for (const at::Tensor* t : {&cos, &sin, static_cast<const at::Tensor*>(&k_cache), static_cast<const at::Tensor*>(&v_cache)}) {
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rope_cache: one dtype");
  }
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == b,
              "rope_cache positions: int64 [B]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < k_cache.size(2), "rope_cache: position out of range");
  auto q = at::empty({b, heads, d}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rope_cache_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
                    k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), pos, b, heads, kv_heads, d,
                    k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1));
  } else {
    using B16 = c10::BFloat16;
    rope_cache_rows(qkv.data_ptr<B16>(), cos.data_ptr<B16>(), sin.data_ptr<B16>(), q.data_ptr<B16>(),
                    k_cache.data_ptr<B16>(), v_cache.data_ptr<B16>(), pos, b, heads, kv_heads, d,
                    k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1));
  }
  return q;
}

// linear.py's Int8Linear._int8_onednn and _add_bias in one call: x's rows quantized (quant_rows), oneDNN's prepacked
// u8 x s8 GEMM through the dispatcher (its fp32 sums times w_scales), then dequant_rows into x's dtype, or fp32 for the
// int8 lm_head; from Python these were five calls, each with its own dispatch, per linear
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scales,
                       const at::Tensor& w_zero_points, const c10::optional<at::Tensor>& bias, bool fp32_out) {
  check_rows(x, "int8_linear x");
  static const c10::OperatorHandle qlinear =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  auto [xu, xs] = quantize_uint8_shifted(x);
  torch::jit::Stack stack{xu,      1.0,   int64_t{128},          packed, w_scales, w_zero_points, c10::IValue(), 1.0,
                          int64_t{0}, at::kFloat, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          std::string("")};
  qlinear.callBoxed(&stack);
  const at::Tensor acc = std::move(stack[0]).toTensor();
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.is_contiguous() && rows == x.size(0), "int8_linear: GEMM output");
  const at::ScalarType out_dtype = fp32_out ? at::kFloat : x.scalar_type();
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == out_dtype && bias->is_contiguous() && bias->numel() == n, "int8_linear bias");
  }
  auto y = at::empty({rows, n}, x.options().dtype(out_dtype));
  const float* a = acc.data_ptr<float>();
  const float* s = xs.data_ptr<float>();
  if (out_dtype == at::kFloat) {
    dequant_rows(a, s, bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), rows, n);
  } else {
    using B16 = c10::BFloat16;
    dequant_rows(a, s, bias ? bias->data_ptr<B16>() : nullptr, y.data_ptr<B16>(), rows, n);
  }
  return y;
}

#ifdef QURL_SAMPLE_ROWS
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& temps,
                                               const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_rows logits: a contiguous fp32 [B, V] CPU tensor");
  const int64_t b = logits.size(0);
  for (const at::Tensor* p : {&temps, &uniforms}) {
    TORCH_CHECK(p->scalar_type() == at::kFloat && p->is_contiguous() && p->numel() == b, "sample_rows: fp32 [B] settings");
  }
  const float* tp = temps.data_ptr<float>();
  const float* up = uniforms.data_ptr<float>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(tp[i] >= 0.f && std::isfinite(tp[i]), "sample_rows: temperature must be finite and >= 0");
    TORCH_CHECK(up[i] > 0.f && up[i] <= 1.f, "sample_rows: uniform must be in (0, 1]");
  }
  auto tokens = at::empty({b}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({b}, logits.options());
  sample_rows_kernel(logits.data_ptr<float>(), tp, up, tokens.data_ptr<int64_t>(), logprobs.data_ptr<float>(), b,
                     logits.size(1));
  return {tokens, logprobs};
}

void check_head(const at::Tensor& logits, const at::Tensor& targets, const char* name) {
  check_rows(logits, name);
  TORCH_CHECK(logits.size(1) > 0, name, ": an empty vocabulary");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.is_contiguous() && targets.numel() == logits.size(0),
              name, ": int64 targets, one per row");
  const int64_t* tp = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < targets.numel(); ++i) {
    TORCH_CHECK(tp[i] >= 0 && tp[i] < logits.size(1), name, ": a target out of the vocabulary");
  }
}

std::vector<at::Tensor> head_forward(const at::Tensor& logits, const at::Tensor& targets, double temperature,
                                     bool entropy) {
  check_head(logits, targets, "head_forward");
  const int64_t rows = logits.size(0), v = logits.size(1);
  const auto opts = logits.options().dtype(at::kFloat);
  auto lse = at::empty({rows}, opts), logp = at::empty({rows}, opts);
  auto ent = entropy ? at::empty({rows}, opts) : at::empty({0}, opts);
  const float t = temperature > 0 ? static_cast<float>(temperature) : 1.f;  // 0: unscaled
  float* ep = entropy ? ent.data_ptr<float>() : nullptr;
  if (logits.scalar_type() == at::kFloat) {
    head_forward_kernel(logits.data_ptr<float>(), targets.data_ptr<int64_t>(), t, lse.data_ptr<float>(),
                        logp.data_ptr<float>(), ep, rows, v);
  } else {
    head_forward_kernel(logits.data_ptr<c10::BFloat16>(), targets.data_ptr<int64_t>(), t, lse.data_ptr<float>(),
                        logp.data_ptr<float>(), ep, rows, v);
  }
  return {lse, logp, ent};
}

void head_backward_(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& grad,
                    double temperature) {
  check_head(logits, targets, "head_backward_");
  for (const at::Tensor* p : {&lse, &grad}) {
    TORCH_CHECK(p->scalar_type() == at::kFloat && p->is_contiguous() && p->numel() == logits.size(0),
                "head_backward_: fp32 lse and grad, one per row");
  }
  const int64_t rows = logits.size(0), v = logits.size(1);
  const bool divide = temperature > 0 && temperature != 1;
  const float t = divide ? static_cast<float>(temperature) : 1.f;
  if (logits.scalar_type() == at::kFloat) {
    head_backward_kernel(logits.data_ptr<float>(), targets.data_ptr<int64_t>(), lse.data_ptr<float>(),
                         grad.data_ptr<float>(), t, divide, rows, v);
  } else {
    head_backward_kernel(logits.data_ptr<c10::BFloat16>(), targets.data_ptr<int64_t>(), lse.data_ptr<float>(),
                         grad.data_ptr<float>(), t, divide, rows, v);
  }
}
#endif

#ifdef QURL_INT8_GEMM
at::Tensor int8_gemm(const at::Tensor& xu, const at::Tensor& xs, const at::Tensor& packed, const at::Tensor& comp,
                     const at::Tensor& ws, const c10::optional<at::Tensor>& bias, int64_t n, at::ScalarType out_dtype) {
  TORCH_CHECK(xu.scalar_type() == at::kByte && xu.dim() == 2 && xu.is_contiguous(), "int8_gemm xu: uint8 [M, K]");
  const int64_t m = xu.size(0), k = xu.size(1);
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.is_contiguous() && xs.numel() == m, "int8_gemm xs: fp32 [M, 1]");
  TORCH_CHECK(packed_matches(packed, n, k), "int8_gemm: packed codes do not match [N, K]");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.numel() == n, "int8_gemm ws: fp32 [N]");
  auto y = at::empty({m, n}, xu.options().dtype(out_dtype));
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == out_dtype && bias->is_contiguous() && bias->numel() == n, "int8_gemm bias");
  }
  if (out_dtype == at::kFloat) {
    int8_gemm_kernel<float>(xu.data_ptr<uint8_t>(), xs.data_ptr<float>(), packed.data_ptr<int8_t>(),
                            comp.data_ptr<int32_t>(), ws.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr,
                            y.data_ptr<float>(), m, n, k);
  } else {
    TORCH_CHECK(out_dtype == at::kBFloat16, "int8_gemm: fp32 or bf16 out");
    using B16 = c10::BFloat16;
    int8_gemm_kernel<B16>(xu.data_ptr<uint8_t>(), xs.data_ptr<float>(), packed.data_ptr<int8_t>(),
                          comp.data_ptr<int32_t>(), ws.data_ptr<float>(), has_bias ? bias->data_ptr<B16>() : nullptr,
                          y.data_ptr<B16>(), m, n, k);
  }
  return y;
}
#endif

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lengths,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4 && q.is_contiguous(), "decode_attention q: contiguous [B, KV, G, D]");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.stride(3) == 1 && v.stride(3) == 1 && q.size(3) % 16 == 0 &&
                  q.size(3) <= 128,
              "decode_attention k, v: [B, KV, L, D], D a multiple of 16 up to 128");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "decode_attention: one dtype");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == q.size(0),
              "decode_attention lengths: int64 [B]");
  auto lc = lengths.cpu();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= k.size(2) && lp[i] <= v.size(2), "decode_attention: length out of range");
  }
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode_attention_kernel<float>(q, k, v, lp, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_kernel<c10::BFloat16>(q, k, v, lp, scale, out);
  } else {
    TORCH_CHECK(false, "decode_attention: fp32 or bf16");
  }
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <ATen/native/CPUBlas.h>
#define QURL_ATTENTION_BACKWARD
// The learner's attention (learner/attention.py), forward and backward, causal or masked SDPA in bf16, over blocks of
// 64 queries x 64 keys whose products run on oneDNN's brgemm (AMX tiles where the CPU has them) and whose softmax
// (forward: online, as flash attention) and softmax gradient are one pass in registers. Torch's CPU flash backward ran
// at ~75 GFLOP/s on SmolLM2's GSM-shaped rows, its forward at ~200 (RESULTS §13).
namespace attention_blocks {
using BF16 = c10::BFloat16;
namespace cpublas = at::native::cpublas;
constexpr int64_t kBlock = 64;  // queries and keys per block

// a [rows, cols] view of one (sequence, head): row r at p + r * ld
struct Rows {
  const BF16* p;
  int64_t ld;
};

// sequence b's head hh of a [B, H, L, D] tensor
Rows view(const at::Tensor& t, int64_t b, int64_t hh) {
  return Rows{t.data_ptr<BF16>() + b * t.stride(0) + hh * t.stride(1), t.stride(2)};
}

// rows [r0, r0 + 64) of `x` into a zero-padded 64 x cols row-major block
void block_rows(Rows x, int64_t r0, int64_t len, int64_t cols, BF16* dst) {
  const int64_t rows = std::min(kBlock, len - r0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * cols, x.p + (r0 + r) * x.ld, cols * sizeof(BF16));
  std::memset(dst + rows * cols, 0, (kBlock - rows) * cols * sizeof(BF16));
}

void transpose(const BF16* src, int64_t rows, int64_t cols, BF16* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// a k x n row-major matrix into brgemm's VNNI layout for bf16 B: [k / 2][n][2]
void pack(const BF16* src, int64_t k, int64_t n, BF16* dst) {
  cpublas::pack(k, n, n, n, at::kBFloat16, at::kBFloat16, src, dst);
}

// which of keys [kj, kj + 16) query qi attends to: in range, causal, and where the boolean mask row says so
inline __mmask16 allowed(int64_t qi, int64_t kj, int64_t len, bool causal, const bool* mask_row) {
  int64_t n = qi < len ? std::min<int64_t>(16, len - kj) : 0;
  if (causal) n = std::min(n, qi - kj + 1);
  if (n <= 0) return 0;
  __mmask16 ok = n == 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
  if (mask_row != nullptr) {
    if (n == 16) {
      const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mask_row + kj));
      ok &= _mm_test_epi8_mask(m, m);
    } else {
      for (int64_t e = 0; e < n; ++e)
        if (!mask_row[kj + e]) ok &= static_cast<__mmask16>(~(1u << e));
    }
  }
  return ok;
}

// whether 64 x 64 block (i, j) of (query, key) has any pair attended: j <= i under the causal mask, else from the
// mask's rows, so that blocks a packed row's mask leaves empty (one answer's keys for another's queries) cost nothing
bool live_block(int64_t i, int64_t j, int64_t len, bool causal, const bool* mask, int64_t mask_ld) {
  if (causal) return j <= i;
  const int64_t w = std::min(kBlock, len - j * kBlock);
  const __mmask64 cols = w == 64 ? ~0ULL : (1ULL << w) - 1;
  for (int64_t r = i * kBlock; r < std::min(len, (i + 1) * kBlock); ++r) {
    const __m512i m = _mm512_maskz_loadu_epi8(cols, mask + r * mask_ld + j * kBlock);
    if (_mm512_test_epi8_mask(m, m) != 0) return true;
  }
  return false;
}

void live_blocks(int64_t len, bool causal, const bool* mask, int64_t mask_ld, std::vector<uint8_t>& live) {
  const int64_t blocks = (len + kBlock - 1) / kBlock;
  live.resize(blocks * blocks);
  for (int64_t i = 0; i < blocks; ++i)
    for (int64_t j = 0; j < blocks; ++j) live[i * blocks + j] = live_block(i, j, len, causal, mask, mask_ld);
}

// the boolean mask of a call: its data and strides over (sequence, head, query), 0 where broadcast
struct Mask {
  const bool* p = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  const bool* head(int64_t b, int64_t h) const { return p != nullptr ? p + b * s0 + h * s1 : nullptr; }
};

// q [B, H, L, D], k and v [B, H / g, L, D] bf16, and the optional boolean mask, checked; the mask's view
Mask check_attention(const char* op, std::initializer_list<const at::Tensor*> rows, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask) {
  for (const at::Tensor* t : rows) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 4 && t->scalar_type() == at::kBFloat16 && t->stride(3) == 1, op,
                ": bf16 [B, H, L, D] CPU tensors, D contiguous");
  }
  const int64_t nb = q.size(0), h = q.size(1), len = q.size(2), d = q.size(3);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == nb && k.size(2) == len && k.size(3) == d && h % k.size(1) == 0,
              op, ": q [B, H, L, D], k and v [B, H / g, L, D], as many keys as queries");
  TORCH_CHECK(d % 32 == 0 && d <= 256, op, ": head_dim a multiple of 32, at most 256");
  Mask view;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(2) == len && m.size(3) == len &&
                    m.stride(3) == 1 && (m.size(0) == 1 || m.size(0) == nb) && (m.size(1) == 1 || m.size(1) == h),
                op, ": a boolean mask [B or 1, H or 1, L, L], the last dimension contiguous");
    view = {m.data_ptr<bool>(), m.size(0) == 1 ? 0 : m.stride(0), m.size(1) == 1 ? 0 : m.stride(1), m.stride(2)};
  }
  return view;
}

// rows [r0, r0 + 64) of (sequence, head) view x packed as a 64 x d brgemm B (VNNI, in 64-column slices: oneDNN packs B
// at most 64 columns wide) at `kn`, and transposed as a d x 64 one at `kt` (where kt is not null)
void pack_keys(Rows x, int64_t r0, int64_t len, int64_t d, BF16* kn, BF16* kt, BF16* tmp, BF16* tmp_t) {
  block_rows(x, r0, len, d, tmp);
  if (kn != nullptr) {
    for (int64_t n = 0; n < d; n += kBlock) {
      const int64_t w = std::min(kBlock, d - n);
      for (int64_t r = 0; r < kBlock; ++r) std::memcpy(tmp_t + r * w, tmp + r * d + n, w * sizeof(BF16));
      pack(tmp_t, kBlock, w, kn + kBlock * n);
    }
  }
  if (kt != nullptr) {
    transpose(tmp, kBlock, d, tmp_t);
    pack(tmp_t, d, kBlock, kt);
  }
}

// one 64 x 64 block of the forward's online softmax: each query row's running max m and sum l over the keys so far
// updated and its accumulated output rescaled to the new max; P = exp(S scale - m) where allowed, row-major bf16 (the A
// of P V). The sum adds P before its rounding, as torch's CPU flash forward does. A block that every query attends
// whole (below the causal diagonal, unmasked, inside the row) skips the per-lane mask.
void online_softmax_block(const float* s, int64_t i0, int64_t j0, int64_t len, bool causal, const bool* mask,
                          int64_t mask_ld, float scale, float* m, float* l, float* acc, int64_t d, BF16* p) {
  constexpr int64_t kVecs = kBlock / 16;
  const bool whole = mask == nullptr && (!causal || j0 + kBlock <= i0 + 1) && std::max(i0, j0) + kBlock <= len;
  alignas(64) __mmask16 ok[kBlock][kVecs];
  alignas(64) float block_max[kBlock], alpha[kBlock];
  __m512 part[16];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < kBlock; r0 += 16) {  // row maxima of S scale over the allowed keys, 16 rows reduced at once
    for (int64_t e = 0; e < 16; ++e) {
      const int64_t r = r0 + e, qi = i0 + r;
      const bool* row = mask != nullptr && qi < len ? mask + qi * mask_ld : nullptr;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t c = 0; c < kVecs; ++c) {
        ok[r][c] = whole ? 0xffff : allowed(qi, j0 + 16 * c, len, causal, row);
        mx = _mm512_mask_max_ps(mx, ok[r][c], mx, _mm512_loadu_ps(s + r * kBlock + 16 * c));
      }
      part[e] = mx;
    }
    _mm512_storeu_ps(block_max + r0, _mm512_mul_ps(max16(part), sc));  // scale > 0: the max of S scale
  }
  const __m512 none = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < kBlock; r += 16) {  // new maxima and the factors rescaling the rows so far, 16 rows at once
    const __m512 old = _mm512_loadu_ps(m + r), now = _mm512_max_ps(old, _mm512_loadu_ps(block_max + r));
    const __mmask16 seen = _mm512_cmp_ps_mask(now, none, _CMP_NEQ_OQ);  // rows with a key attended so far
    const __m512 a = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.f), exp16(_mm512_maskz_sub_ps(seen, old, now)));
    _mm512_storeu_ps(m + r, now);
    _mm512_storeu_ps(alpha + r, a);
    _mm512_storeu_ps(l + r, _mm512_mul_ps(_mm512_loadu_ps(l + r), a));
  }
  for (int64_t r0 = 0; r0 < kBlock; r0 += 16) {
    for (int64_t e = 0; e < 16; ++e) {
      const int64_t r = r0 + e;
      if (alpha[r] != 1.f) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(acc + r * d + c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + c), a));
      }
      const __m512 mr = _mm512_set1_ps(m[r]);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < kVecs; ++c) {
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + r * kBlock + 16 * c), sc, mr);
        const __m512 pv = _mm512_maskz_mov_ps(ok[r][c], exp16(x));
        sum = _mm512_add_ps(sum, pv);
        store16(p + r * kBlock + 16 * c, pv);
      }
      part[e] = sum;
    }
    _mm512_storeu_ps(l + r0, _mm512_add_ps(_mm512_loadu_ps(l + r0), sum16(part)));
  }
}

// one 64 x 64 block: P = exp(S scale - lse) where allowed, dS = P (dP - delta); P and dS as VNNI pairs of query rows
// (the B of dv^T and dk^T), dS also row-major (the A of dq)
void softmax_grad_block(const float* s, const float* dp, int64_t i0, int64_t j0, int64_t len, bool causal,
                        const bool* mask, int64_t mask_ld, float scale, const float* lse, const float* delta,
                        BF16* p_vnni, BF16* ds_vnni, BF16* ds) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kBlock; r += 2) {
    for (int64_t c = 0; c < kBlock; c += 16) {
      __m512i pb[2], db[2];
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t qi = i0 + r + e, at = (r + e) * kBlock + c;
        const bool* row = mask != nullptr && qi < len ? mask + qi * mask_ld : nullptr;
        const __mmask16 ok = allowed(qi, j0 + c, len, causal, row);
        const float l = qi < len ? lse[qi] : 0.f, d = qi < len ? delta[qi] : 0.f;
        const __m512 pv = _mm512_maskz_mov_ps(ok, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + at), sc, _mm512_set1_ps(l))));
        const __m512 dv = _mm512_maskz_mul_ps(ok, pv, _mm512_sub_ps(_mm512_loadu_ps(dp + at), _mm512_set1_ps(d)));
        pb[e] = _mm512_castps_si512(round16(pv, BF16()));  // each bf16 in its lane's high half
        db[e] = _mm512_castps_si512(round16(dv, BF16()));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds + at), _mm512_cvtepi32_epi16(_mm512_srli_epi32(db[e], 16)));
      }
      const int64_t vn = r * kBlock + 2 * c;  // (row pair r / 2, column c, parity)
      _mm512_storeu_si512(p_vnni + vn, _mm512_or_si512(_mm512_srli_epi32(pb[0], 16), pb[1]));
      _mm512_storeu_si512(ds_vnni + vn, _mm512_or_si512(_mm512_srli_epi32(db[0], 16), db[1]));
    }
  }
}

// a [64, d] fp32 block, transposed ([d, 64] in `t`) or not, times `scale`, into rows [r0, r0 + 64) of a bf16 view
void write_rows(const float* a, bool transposed, int64_t d, float scale, int64_t r0, int64_t len, BF16* out,
                int64_t ld) {
  alignas(64) float row[256];
  for (int64_t r = 0; r < std::min(kBlock, len - r0); ++r) {
    const float* src = a + r * d;
    if (transposed) {
      for (int64_t c = 0; c < d; ++c) row[c] = a[c * kBlock + r];
      src = row;
    }
    for (int64_t c = 0; c < d; c += 16) store16(out + (r0 + r) * ld + c, _mm512_mul_ps(_mm512_loadu_ps(src + c), _mm512_set1_ps(scale)));
  }
}
}  // namespace attention_blocks

std::vector<at::Tensor> attention_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                           bool causal, const c10::optional<at::Tensor>& mask, double scale_) {
  using namespace attention_blocks;
  const Mask mk = check_attention("attention_backward", {&dout, &q, &k, &v, &out}, q, k, v, mask);
  const int64_t nb = q.size(0), h = q.size(1), len = q.size(2), d = q.size(3), hk = k.size(1);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "attention_backward: d out and out shaped as q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == nb && lse.size(1) == h &&
                  lse.size(2) == len, "attention_backward: fp32 logsumexp [B, H, L]");
  const int64_t group = h / hk, blocks = (len + kBlock - 1) / kBlock, padded = blocks * kBlock, sq = kBlock * d;
  const float scale = static_cast<float>(scale_);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const float* lp = lse.data_ptr<float>();
  // one task per (sequence, kv head): its group of query heads accumulate dk and dv in fp32, unshared
  at::parallel_for(0, nb * hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<BF16> k_vnni(padded * d), kt_vnni(padded * d), vt_vnni(padded * d), qb(padded * d), qt(padded * d),
        gb(padded * d), gt(padded * d), tmp(sq), tmp_t(sq);
    std::vector<float> dkt(padded * d), dvt(padded * d), dqa(padded * d), delta(padded), lrow(padded);
    std::vector<uint8_t> live;
    alignas(64) float s[kBlock * kBlock], dp[kBlock * kBlock];
    alignas(64) BF16 p_vnni[kBlock * kBlock], ds_vnni[kBlock * kBlock], ds[kBlock * kBlock];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / hk, g = t % hk;
      for (int64_t j = 0; j < blocks; ++j) {  // k and v, packed once for the group: k as dq's B, k^T and v^T as S's and dP's
        pack_keys(view(k, b, g), j * kBlock, len, d, k_vnni.data() + j * sq, kt_vnni.data() + j * sq, tmp.data(), tmp_t.data());
        pack_keys(view(v, b, g), j * kBlock, len, d, nullptr, vt_vnni.data() + j * sq, tmp.data(), tmp_t.data());
      }
      std::fill(dkt.begin(), dkt.end(), 0.f);
      std::fill(dvt.begin(), dvt.end(), 0.f);
      for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
        for (int64_t i = 0; i < blocks; ++i) {  // q and d out: row-major (S's and dP's A) and transposed (dk's, dv's A)
          block_rows(view(q, b, hh), i * kBlock, len, d, qb.data() + i * sq);
          transpose(qb.data() + i * sq, kBlock, d, qt.data() + i * sq);
          block_rows(view(dout, b, hh), i * kBlock, len, d, gb.data() + i * sq);
          transpose(gb.data() + i * sq, kBlock, d, gt.data() + i * sq);
        }
        const Rows o = view(out, b, hh);
        for (int64_t r = 0; r < len; ++r) {  // delta = rowsum(d out * out), the softmax gradient's shift
          __m512 acc = _mm512_setzero_ps();
          for (int64_t c = 0; c < d; c += 16) acc = _mm512_fmadd_ps(load16(o.p + r * o.ld + c), load16(gb.data() + r * d + c), acc);
          delta[r] = _mm512_reduce_add_ps(acc);
          lrow[r] = lp[b * lse.stride(0) + hh * lse.stride(1) + r * lse.stride(2)];
        }
        std::fill(dqa.begin(), dqa.end(), 0.f);
        const bool* mh = mk.head(b, hh);
        if (hh == g * group || mk.s1 != 0) live_blocks(len, causal || mh == nullptr, mh, mk.s2, live);
        for (int64_t i = 0; i < blocks; ++i) {
          for (int64_t j = 0; j < blocks; ++j) {
            if (!live[i * blocks + j]) continue;
            cpublas::brgemm(kBlock, kBlock, d, d, kBlock, kBlock, false, qb.data() + i * sq, kt_vnni.data() + j * sq, s);
            cpublas::brgemm(kBlock, kBlock, d, d, kBlock, kBlock, false, gb.data() + i * sq, vt_vnni.data() + j * sq, dp);
            softmax_grad_block(s, dp, i * kBlock, j * kBlock, len, causal, mh, mk.s2, scale, lrow.data(), delta.data(),
                               p_vnni, ds_vnni, ds);
            cpublas::brgemm(d, kBlock, kBlock, kBlock, kBlock, kBlock, true, gt.data() + i * sq, p_vnni, dvt.data() + j * sq);
            cpublas::brgemm(d, kBlock, kBlock, kBlock, kBlock, kBlock, true, qt.data() + i * sq, ds_vnni, dkt.data() + j * sq);
            for (int64_t n = 0; n < d; n += kBlock) {
              const int64_t w = std::min(kBlock, d - n);
              cpublas::brgemm(kBlock, w, kBlock, kBlock, w, d, true, ds, k_vnni.data() + j * sq + kBlock * n,
                              dqa.data() + i * sq + n);
            }
          }
        }
        BF16* dqp = dq.data_ptr<BF16>() + b * dq.stride(0) + hh * dq.stride(1);
        for (int64_t i = 0; i < blocks; ++i) write_rows(dqa.data() + i * sq, false, d, scale, i * kBlock, len, dqp, dq.stride(2));
      }
      BF16* dkp = dk.data_ptr<BF16>() + b * dk.stride(0) + g * dk.stride(1);
      BF16* dvp = dv.data_ptr<BF16>() + b * dv.stride(0) + g * dv.stride(1);
      for (int64_t j = 0; j < blocks; ++j) {
        write_rows(dkt.data() + j * sq, true, d, scale, j * kBlock, len, dkp, dk.stride(2));
        write_rows(dvt.data() + j * sq, true, d, 1.f, j * kBlock, len, dvp, dv.stride(2));
      }
    }
    cpublas::brgemm_release();
  });
  return {dq, dk, dv};
}

std::vector<at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                          const c10::optional<at::Tensor>& mask, double scale_) {
  using namespace attention_blocks;
  const Mask mk = check_attention("attention_forward", {&q, &k, &v}, q, k, v, mask);
  const int64_t nb = q.size(0), h = q.size(1), len = q.size(2), d = q.size(3), hk = k.size(1);
  const int64_t group = h / hk, blocks = (len + kBlock - 1) / kBlock, padded = blocks * kBlock, sq = kBlock * d;
  const float scale = static_cast<float>(scale_);
  // [B, H, L, D] over [B, L, H, D] memory: the layout the attention's output projection reads, with no copy
  auto out = at::empty({nb, len, h, d}, q.options()).permute({0, 2, 1, 3});
  auto lse = at::empty({nb, h, len}, q.options().dtype(at::kFloat));
  // k^T (S's B) and v (P V's B) of every (sequence, kv head), packed once
  std::vector<BF16> kt_vnni(nb * hk * padded * d), v_vnni(nb * hk * padded * d);
  at::parallel_for(0, nb * hk * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<BF16> tmp(sq), tmp_t(sq);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (hk * blocks), g = t / blocks % hk, j = t % blocks, at = t * sq;
      pack_keys(view(k, b, g), j * kBlock, len, d, nullptr, kt_vnni.data() + at, tmp.data(), tmp_t.data());
      pack_keys(view(v, b, g), j * kBlock, len, d, v_vnni.data() + at, nullptr, tmp.data(), tmp_t.data());
    }
  });
  // one task per (sequence, head, block of 64 queries): queries attend independently
  at::parallel_for(0, nb * h * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<BF16> qb(sq);
    std::vector<float> acc(sq);
    alignas(64) float s[kBlock * kBlock], m[kBlock], l[kBlock];
    alignas(64) BF16 p[kBlock * kBlock];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (h * blocks), hh = t / blocks % h, i = t % blocks, g = hh / group;
      const BF16* kt = kt_vnni.data() + (b * hk + g) * padded * d;
      const BF16* vn = v_vnni.data() + (b * hk + g) * padded * d;
      const bool* mh = mk.head(b, hh);
      block_rows(view(q, b, hh), i * kBlock, len, d, qb.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m, m + kBlock, -INFINITY);
      std::fill(l, l + kBlock, 0.f);
      for (int64_t j = 0; j < blocks; ++j) {
        if (!live_block(i, j, len, causal || mh == nullptr, mh, mk.s2)) continue;
        cpublas::brgemm(kBlock, kBlock, d, d, kBlock, kBlock, false, qb.data(), kt + j * sq, s);
        online_softmax_block(s, i * kBlock, j * kBlock, len, causal, mh, mk.s2, scale, m, l, acc.data(), d, p);
        for (int64_t n = 0; n < d; n += kBlock) {
          const int64_t w = std::min(kBlock, d - n);
          cpublas::brgemm(kBlock, w, kBlock, kBlock, w, d, true, p, vn + j * sq + kBlock * n, acc.data() + n);
        }
      }
      BF16* op = out.data_ptr<BF16>() + b * out.stride(0) + hh * out.stride(1);
      float* lp = lse.data_ptr<float>() + (b * h + hh) * len;
      for (int64_t r = 0; r < std::min(kBlock, len - i * kBlock); ++r) {  // a row with no key attended: 0, lse -inf
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t c = 0; c < d; c += 16) store16(op + (i * kBlock + r) * out.stride(2) + c, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * d + c), _mm512_set1_ps(inv)));
        lp[i * kBlock + r] = l[r] > 0.f ? m[r] + std::log(l[r]) : -INFINITY;
      }
    }
    cpublas::brgemm_release();
  });
  return {out, lse};
}

// whether attention_forward's and attention_backward's brgemm runs here: oneDNN packs bf16 for it on this CPU
bool attention_backward_ready() { return at::native::cpublas::could_pack(at::kBFloat16); }
#endif

#ifdef QURL_INT8_GEMM
// a dispatcher op, so that profilers (benchmarks/rollout_throughput.py's GEMM share) see the GEMM by name
TORCH_LIBRARY(qurl, m) {
  m.def("int8_gemm(Tensor xu, Tensor xs, Tensor packed, Tensor comp, Tensor ws, Tensor? bias, int n, "
        "ScalarType out_dtype) -> Tensor");
}
TORCH_LIBRARY_IMPL(qurl, CPU, m) { m.impl("int8_gemm", &int8_gemm); }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "HF RMSNorm over rows");
  m.def("quantize_uint8_shifted", &quantize_uint8_shifted, "per-row int8 codes + 128 as uint8, and fp32 scales");
  m.def("silu_mul", &silu_mul, "up * silu(gate) over [gate | up] rows");
  m.def("silu_mul_backward", &silu_mul_backward, "[d gate | d up] of silu_mul from d out");
  m.def("transposed", &transposed, "x^T as a contiguous copy, over tiles, in parallel");
  m.def("rotary", &rotary, "HF's rotary embedding of [B, L, heads, head_dim] rows, or its input gradient");
  m.def("rms_norm_backward", &rms_norm_backward, "d x and d weight of HF RMSNorm");
  m.def("changed_indices", &changed_indices, "flat indices of the elements whose bit patterns differ");
  m.def("int8_linear", &int8_linear, "an int8 linear by oneDNN's prepacked GEMM: quantize, GEMM, dequantize (+ bias)");
  m.def("rope_cache", &rope_cache, "rotary q and k of one token per sequence; k, v written to the cache");
  m.attr("vector_attention") = kVectorAttention;
  m.attr("int8_gemm") = kInt8Gemm;  // the instruction set of the int8 GEMM, "" where there is none
#ifdef QURL_INT8_GEMM
  m.attr("int8_gemm_max_rows") = kInt8GemmMaxRows;
  m.def("int8_pack", &int8_pack, "int8 codes into the GEMM kernel's layout, and the zero point's compensation");
#endif
  m.def("decode_attention", &decode_attention, "one query token per sequence over its cache");
#ifdef QURL_SAMPLE_ROWS
  m.def("sample_rows", &sample_rows, "tokens and logprobs of greedy or temperature draws, no top-k / top-p");
  m.def("head_forward", &head_forward, "the learner head's lse, target log-prob and entropy per logits row");
  m.def("head_backward_", &head_backward_, "the learner head's d logp / d logits, in place over the logits");
#endif
#ifdef QURL_ATTENTION_BACKWARD
  m.def("attention_forward", &attention_forward, "out and logsumexp of causal or masked bf16 SDPA, grouped k and v");
  m.def("attention_backward", &attention_backward, "dq, dk, dv of causal or masked bf16 SDPA from out and logsumexp");
  m.def("attention_backward_ready", &attention_backward_ready, "whether oneDNN's bf16 brgemm runs on this CPU");
#endif
}
