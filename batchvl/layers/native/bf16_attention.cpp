// Attention in bf16 with the CPU's bf16 dot-product instruction (AVX512-BF16's vdpbf16ps: pairs of bf16
// products summed into float32 lanes, twice the multiply-adds of a float32 FMA), for the vision tower (each
// image's patches attending to each other) and for the language model's prefill chunks (causal, over the
// paged KV cache). torch's fused CPU attention computes bf16 inputs in float32 on CPUs without AMX, and
// two bf16 matmuls around a softmax pay for writing and reading the scores in bf16 and a dispatch per
// block: both ran at about 110-150 GFLOP/s on a 2-core AMD EPYC whose bf16 matmuls reach 380-410.
//
// Per (sequence, KV head), the keys are packed once into the layout the instruction reads (each 32-bit lane a
// pair of bf16 along the head dimension, 32 keys per block) and the values likewise (pairs along the keys).
// Then per block of queries: the scores of the block against every key (float32, in a per-thread buffer
// that stays in cache), the softmax (float32; the exponentials rounded to bf16, which is what the values
// are weighted with, and summed as rounded), and the weighted values divided by that sum, rounded to bf16.
//
// The instruction exists on AVX-512 CPUs with the BF16 extension (Intel Cooper Lake and later, AMD Zen 4
// and later). The functions that use it are compiled for that extension alone (a target attribute), so
// the rest of the AVX-512 build still runs on AVX-512 CPUs without it; `bf16_dot_products()` says whether
// this CPU has it, and callers ask before calling. Other builds compile none of it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define BATCHVL_BF16_DOT 1
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace {

// Where a tensor's rows are: row r of head h starts at base + h * head_stride + r * row_stride.
struct Rows {
  uint16_t* base;
  int64_t row_stride, head_stride;

  uint16_t* at(int64_t row, int64_t head) const { return base + head * head_stride + row * row_stride; }
};

Rows rows_of(const at::Tensor& t, int row_dim, int head_dim) {
  return {reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()), t.stride(row_dim), t.stride(head_dim)};
}

// One sequence: its queries, and its keys (and values), either rows first_key.. of the key tensor or the
// rows listed in `slots` (a paged cache). Causal: query i sits at position num_keys - num_queries + i and
// attends to the keys up to it; otherwise every query attends to every key.
struct Sequence {
  int64_t first_query, num_queries, num_keys;
  int64_t first_key;
  const int64_t* slots;
  bool causal;

  int64_t key_row(int64_t k) const { return slots ? slots[k] : first_key + k; }
  // keys that query i attends to
  int64_t keys_of(int64_t i) const { return causal ? num_keys - num_queries + i + 1 : num_keys; }
};

#ifdef BATCHVL_BF16_DOT

constexpr int kKeyBlock = 32;    // keys per packed block: two vectors of 16 float32 scores
constexpr int kScoreRows = 8;    // query rows per score tile: 8 x 2 accumulators
constexpr int kQueryBlock = 64;  // query rows per task: its scores (64 x keys x 4 bytes) stay in cache

int64_t blocks_of(int64_t keys) { return (keys + kKeyBlock - 1) / kKeyBlock; }

// Keys of one (sequence, KV head), packed: block b holds keys [32b, 32b + 32), as (head_dim / 2) rows of 32
// lanes, lane c of row j the bf16 pair (key[32b + c][2j], key[32b + c][2j + 1]). Keys past the end are 0.
void pack_keys(const Rows& key, const Sequence& seq, int64_t head, int pairs, uint32_t* packed) {
  std::memset(packed, 0, sizeof(uint32_t) * blocks_of(seq.num_keys) * pairs * kKeyBlock);
  for (int64_t k = 0; k < seq.num_keys; ++k) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(key.at(seq.key_row(k), head));
    uint32_t* lane = packed + (k / kKeyBlock) * pairs * kKeyBlock + k % kKeyBlock;
    for (int j = 0; j < pairs; ++j) lane[j * kKeyBlock] = row[j];
  }
}

// Values of one (sequence, KV head), packed: row i holds `width` lanes (head_dim rounded up to whole
// vectors), lane d the bf16 pair (value[2i][d], value[2i + 1][d]); lanes past head_dim and a missing last
// value of an odd count are 0.
void pack_values(const Rows& value, const Sequence& seq, int64_t head, int dim, int width, uint32_t* packed) {
  for (int64_t i = 0; i < (seq.num_keys + 1) / 2; ++i) {
    const uint16_t* even = value.at(seq.key_row(2 * i), head);
    const uint16_t* odd = 2 * i + 1 < seq.num_keys ? value.at(seq.key_row(2 * i + 1), head) : nullptr;
    uint32_t* out = packed + i * width;
    for (int d = 0; d < dim; ++d) out[d] = uint32_t(even[d]) | (odd ? uint32_t(odd[d]) << 16 : 0u);
    std::fill(out + dim, out + width, 0u);
  }
}

// Scores of ROWS query rows (each a pointer to its head_dim bf16 values) against one packed key block:
// scores[r * stride + c] for the block's 32 keys.
template <int ROWS>
BF16_TARGET void score_tile(const uint32_t* const* queries, const uint32_t* block, int pairs, float* scores,
                            int64_t stride) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int j = 0; j < pairs; ++j) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(block + j * kKeyBlock);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(block + j * kKeyBlock + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(queries[r][j]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q, k1);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(scores + r * stride, acc[r][0]);
    _mm512_storeu_ps(scores + r * stride + 16, acc[r][1]);
  }
}

// Softmax of one row's first `length` scores, scaled: the exponentials rounded to bf16 into `weights`,
// zeros from there to `width` (the keys of the row's block, an even count: the values are packed in
// pairs); returns 1 / the sum of the rounded exponentials.
BF16_TARGET float softmax_row(const float* scores, int64_t length, int64_t width, float scale, uint16_t* weights) {
  using fVec = at::vec::Vectorized<float>;
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t k = 0;
  for (; k + 16 <= length; k += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + k));
  float highest = _mm512_reduce_max_ps(top);
  for (; k < length; ++k) highest = std::max(highest, scores[k]);
  const __m512 shift = _mm512_set1_ps(-highest * scale), factor = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (k = 0; k < length; k += 16) {
    const __mmask16 lanes = length - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (length - k)) - 1);
    const __m512 x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, scores + k), factor, shift);
    const __m512 e = _mm512_maskz_mov_ps(lanes, __m512(fVec(x).exp_u20()));
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_mask_storeu_epi16(weights + k, lanes, rounded);
    // the sum of what the values are weighted with: the rounded exponentials, widened back exactly
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
  }
  std::fill(weights + length, weights + width, uint16_t(0));
  return 1.f / _mm512_reduce_add_ps(sum);
}

// out rows r < ROWS (each `out[r]`, head_dim bf16) = the weighted sum of the packed values, times inverse[r].
// DIM_VECTORS = head_dim / 16 rounded up; `last` masks the lanes of the last vector within head_dim.
template <int ROWS, int DIM_VECTORS>
BF16_TARGET void weighted_values(const uint32_t* const* weights, const uint32_t* values, int64_t pairs,
                                 const float* inverse, uint16_t* const* out, __mmask16 last) {
  constexpr int dim = DIM_VECTORS * 16;
  __m512 acc[ROWS][DIM_VECTORS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < DIM_VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh row[DIM_VECTORS];
    for (int v = 0; v < DIM_VECTORS; ++v) row[v] = (__m512bh)_mm512_loadu_si512(values + i * dim + v * 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[r][i]));
      for (int v = 0; v < DIM_VECTORS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w, row[v]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512 scale = _mm512_set1_ps(inverse[r]);
    for (int v = 0; v < DIM_VECTORS; ++v)
      _mm256_mask_storeu_epi16(out[r] + v * 16, v + 1 < DIM_VECTORS ? __mmask16(0xFFFF) : last,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][v], scale)));
  }
}

struct Buffers {
  std::vector<float> scores;      // kQueryBlock x the block's keys, padded to whole key blocks
  std::vector<uint16_t> weights;  // kQueryBlock x the block's keys, padded to an even count; bf16
};

// Runs fn(task, buffers) for tasks [0, total) on torch's threads, each taking the next task as it finishes
// one (tasks differ in cost with their sequence's length).
template <typename Fn>
void deal(int64_t total, const Fn& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Buffers buffers;
    for (int64_t w = begin; w < end; ++w)
      for (int64_t task = next++; task < total; task = next++) fn(task, buffers);
  });
}

template <int DIM_VECTORS>
struct Attention {
  static constexpr int kWidth = DIM_VECTORS * 16;  // a packed value row: head_dim rounded up to vectors
  static constexpr int kValueRows = std::max(1, 16 / DIM_VECTORS);  // accumulators of a value tile: 16

  // One task: queries [first, first + count) of `seq`, query head `head`, over its packed keys and values.
  BF16_TARGET static void block(const Rows& query, const Rows& out, int dim, const Sequence& seq, int64_t head,
                                const uint32_t* keys, const uint32_t* values, int64_t first, int64_t count,
                                float scale, Buffers& buffers) {
    const int pairs = dim / 2;
    const int64_t attended = seq.keys_of(first + count - 1);  // the block's last query sees the most keys
    const int64_t blocks = blocks_of(attended), padded = blocks * kKeyBlock, even = attended + attended % 2;
    buffers.scores.resize(kQueryBlock * padded);
    buffers.weights.resize(kQueryBlock * even);
    float* scores = buffers.scores.data();
    uint16_t* weights = buffers.weights.data();

    // Row pointers, with the tile's rows past `count` repeating the last (computed, never stored).
    const uint32_t* rows[kQueryBlock + kScoreRows];
    for (int64_t r = 0; r < count + kScoreRows; ++r)
      rows[r] = reinterpret_cast<const uint32_t*>(query.at(seq.first_query + first + std::min(r, count - 1), head));
    float tail[kScoreRows * kKeyBlock];
    for (int64_t b = 0; b < blocks; ++b) {
      const uint32_t* block = keys + b * pairs * kKeyBlock;
      for (int64_t r = 0; r < count; r += kScoreRows) {
        if (count - r >= kScoreRows) {
          score_tile<kScoreRows>(rows + r, block, pairs, scores + r * padded + b * kKeyBlock, padded);
        } else {
          score_tile<kScoreRows>(rows + r, block, pairs, tail, kKeyBlock);
          for (int64_t t = 0; t < count - r; ++t)
            std::memcpy(scores + (r + t) * padded + b * kKeyBlock, tail + t * kKeyBlock, sizeof(tail[0]) * kKeyBlock);
        }
      }
    }
    float inverse[kQueryBlock + kValueRows];
    for (int64_t r = 0; r < count; ++r)
      inverse[r] = softmax_row(scores + r * padded, seq.keys_of(first + r), even, scale, weights + r * even);

    const uint32_t* weight_rows[kQueryBlock + kValueRows];
    uint16_t* out_rows[kQueryBlock + kValueRows];
    uint16_t spill[kValueRows][kWidth];
    for (int64_t r = 0; r < count + kValueRows; ++r) {
      const bool real = r < count;
      weight_rows[r] = reinterpret_cast<const uint32_t*>(weights + std::min(r, count - 1) * even);
      out_rows[r] = real ? out.at(seq.first_query + first + r, head) : spill[(r - count) % kValueRows];
      if (!real) inverse[r] = 0.f;
    }
    const __mmask16 last = __mmask16((1u << (dim - (DIM_VECTORS - 1) * 16)) - 1);
    for (int64_t r = 0; r < count; r += kValueRows)
      weighted_values<kValueRows, DIM_VECTORS>(weight_rows + r, values, even / 2, inverse + r, out_rows + r, last);
  }

  // Attention of every sequence, every query head; query head h reads KV head h / (heads / kv_heads).
  static void run(const Rows& query, const Rows& key, const Rows& value, const Rows& out, int64_t heads,
                  int64_t kv_heads, int dim, const std::vector<Sequence>& sequences, float scale) {
    const int64_t group = heads / kv_heads, count = static_cast<int64_t>(sequences.size());
    const int pairs = dim / 2;
    // Packed keys and values of every (sequence, KV head), at offsets computed up front.
    std::vector<int64_t> key_offset(count + 1, 0), value_offset(count + 1, 0);
    for (int64_t s = 0; s < count; ++s) {
      const int64_t keys = sequences[s].num_keys;
      key_offset[s + 1] = key_offset[s] + kv_heads * blocks_of(keys) * kKeyBlock * pairs;
      value_offset[s + 1] = value_offset[s] + kv_heads * ((keys + 1) / 2) * kWidth;
    }
    std::vector<uint32_t> packed_keys(key_offset[count]), packed_values(value_offset[count]);
    auto keys_of = [&](int64_t s, int64_t h) {
      return packed_keys.data() + key_offset[s] + h * blocks_of(sequences[s].num_keys) * kKeyBlock * pairs;
    };
    auto values_of = [&](int64_t s, int64_t h) {
      return packed_values.data() + value_offset[s] + h * ((sequences[s].num_keys + 1) / 2) * kWidth;
    };
    deal(count * kv_heads, [&](int64_t task, Buffers&) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      pack_keys(key, sequences[s], h, pairs, keys_of(s, h));
      pack_values(value, sequences[s], h, dim, kWidth, values_of(s, h));
    });

    // Tasks of kQueryBlock queries, the most expensive sequences' first, so that the last tasks are short.
    struct Task {
      int64_t seq, head, first, count;
    };
    std::vector<int64_t> order(count);
    for (int64_t s = 0; s < count; ++s) order[s] = s;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return sequences[a].num_keys * sequences[a].num_queries > sequences[b].num_keys * sequences[b].num_queries;
    });
    std::vector<Task> tasks;
    for (int64_t s : order)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t first = 0; first < sequences[s].num_queries; first += kQueryBlock)
          tasks.push_back({s, h, first, std::min<int64_t>(kQueryBlock, sequences[s].num_queries - first)});
    deal(static_cast<int64_t>(tasks.size()), [&](int64_t index, Buffers& buffers) {
      const Task& t = tasks[index];
      block(query, out, dim, sequences[t.seq], t.head, keys_of(t.seq, t.head / group), values_of(t.seq, t.head / group),
            t.first, t.count, scale, buffers);
    });
  }
};

void run(const Rows& query, const Rows& key, const Rows& value, const Rows& out, int64_t heads, int64_t kv_heads,
         int64_t dim, const std::vector<Sequence>& sequences, float scale) {
  TORCH_CHECK(dim > 0 && dim % 2 == 0, "head size ", dim, " is not even");
  // one instantiation per number of 16-lane vectors a head takes
  switch ((dim + 15) / 16) {
    case 1: return Attention<1>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    case 2: return Attention<2>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    case 3: return Attention<3>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    case 4: return Attention<4>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    case 5: return Attention<5>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    case 6: return Attention<6>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    case 7: return Attention<7>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    case 8: return Attention<8>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    case 16: return Attention<16>::run(query, key, value, out, heads, kv_heads, dim, sequences, scale);
    default: TORCH_CHECK(false, "head size ", dim, " is over 128 and not 242-256");
  }
}

#endif  // BATCHVL_BF16_DOT

}  // namespace

namespace batchvl_native {

bool bf16_dot_products() {
#ifdef BATCHVL_BF16_DOT
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

void check_bf16(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.stride(-1) == 1, "bf16 with the head dimension contiguous");
}

// Non-causal attention of each sequence's queries over its own keys, every head. query, key, value and out
// are (T, H, D) bf16 with the head dimension contiguous (any row and head strides); cu_seqlens (S + 1,)
// int64 gives sequence s the rows [cu_seqlens[s], cu_seqlens[s + 1]).
void varlen_attention(at::Tensor out, at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor cu_seqlens,
                      double scale) {
  TORCH_CHECK(bf16_dot_products(), "this CPU has no AVX512-BF16 dot products: check bf16_dot_products() first");
  TORCH_CHECK(query.dim() == 3 && key.sizes() == query.sizes() && value.sizes() == query.sizes() &&
                  out.sizes() == query.sizes(),
              "query, key, value and out are (T, H, D) of one shape");
  for (const auto* t : {&query, &key, &value, &out}) check_bf16(*t);
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 && cu_seqlens.is_contiguous(),
              "cu_seqlens is int64 (S + 1,)");
  std::vector<Sequence> sequences;
  const int64_t* bounds = cu_seqlens.data_ptr<int64_t>();
  for (int64_t s = 0; s + 1 < cu_seqlens.size(0); ++s) {
    TORCH_CHECK(0 <= bounds[s] && bounds[s] <= bounds[s + 1] && bounds[s + 1] <= query.size(0),
                "cu_seqlens out of order or range");
    const int64_t length = bounds[s + 1] - bounds[s];
    if (length) sequences.push_back({bounds[s], length, length, bounds[s], nullptr, false});
  }
#ifdef BATCHVL_BF16_DOT
  run(rows_of(query, 0, 1), rows_of(key, 0, 1), rows_of(value, 0, 1), rows_of(out, 0, 1), query.size(1),
      query.size(1), query.size(2), sequences, static_cast<float>(scale));
#endif
}

// Causal attention of prefill chunks over the paged KV cache: sequence b's queries are rows
// query_starts[b] .. + query_counts[b] of the step, at the last positions of its lengths[b] keys, which
// are cache slots slots[b, :lengths[b]] (written before the call). query (H, T, D), out (T, H, D), kv
// (2, H_kv, slots, D) one layer of the cache, all bf16 with the head dimension contiguous; the rest int64.
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor kv, at::Tensor query_starts,
                             at::Tensor query_counts, at::Tensor slots, at::Tensor lengths, double scale) {
  TORCH_CHECK(bf16_dot_products(), "this CPU has no AVX512-BF16 dot products: check bf16_dot_products() first");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && kv.dim() == 4 && kv.size(0) == 2,
              "query (H, T, D), out (T, H, D), kv (2, Hkv, S, D)");
  for (const auto* t : {&query, &out, &kv}) check_bf16(*t);
  TORCH_CHECK(query.size(2) == kv.size(3) && out.size(2) == kv.size(3) && out.size(1) == query.size(0),
              "one head size, out (T, H, D)");
  TORCH_CHECK(query.size(0) % kv.size(1) == 0, "query heads must be a multiple of KV heads");
  const int64_t batch = query_starts.size(0);
  for (const auto* t : {&query_starts, &query_counts, &slots, &lengths})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == batch,
                "query_starts, query_counts, slots and lengths are int64, one entry (row) per sequence");
  const int64_t* start = query_starts.data_ptr<int64_t>();
  const int64_t* count = query_counts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  std::vector<Sequence> sequences;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 < count[b] && count[b] <= length[b] && length[b] <= slots.size(1) &&
                    start[b] + count[b] <= query.size(1),
                "each sequence has 1..lengths[b] queries within the step and lengths[b] slots");
    sequences.push_back({start[b], count[b], length[b], 0, slots.data_ptr<int64_t>() + b * slots.size(1), true});
  }
#ifdef BATCHVL_BF16_DOT
  auto* cache = reinterpret_cast<uint16_t*>(kv.data_ptr<at::BFloat16>());
  const Rows keys{cache, kv.stride(2), kv.stride(1)}, values{cache + kv.stride(0), kv.stride(2), kv.stride(1)};
  run(rows_of(query, 1, 0), keys, values, rows_of(out, 0, 1), query.size(0), kv.size(1), query.size(2), sequences,
      static_cast<float>(scale));
#endif
}

}  // namespace batchvl_native
