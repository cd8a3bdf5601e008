// Decode attention read straight from the paged KV cache: one query per sequence, over that sequence's
// cached keys and values, found through its list of cache pages (the block manager's blocks: key k lies at
// slot pages[k / page_size] * page_size + k % page_size; a step hands over a few dozen block ids per
// sequence where a slot per key made the host copy every context's slots every step). Each (sequence, KV
// head) is one task: the query heads sharing that KV head are scored against each key as it is read, so
// every cached row is read once, where gathering the keys into a padded batch first read them, wrote a
// copy and read the copy again.
// Scores, softmax and the weighted sum are in float32, as torch's CPU attention computes them.
//
// Built at run time for the machine's vector ISA (torch.utils.cpp_extension, see native_kernels.py), with
// ATen's Vectorized types: the same source compiles to AVX-512, AVX2 or plain loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<at::BFloat16>;

float lane_sum(fVec x) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, x);
}

// The lane sums of four vectors at once (a 4-lane vector of them): a third of the shuffles of four
// separate reductions, and the scores of a group of query heads are four or more such sums per key.
#if defined(CPU_CAPABILITY_AVX512)
#define BATCHVL_LANE_SUMS_OF_FOUR 1
__m128 lane_sums(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto fold = [](__m512 x) { return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1)); };
  const __m256 ab = _mm256_hadd_ps(fold(a), fold(b));  // per 128-bit half: a, a, b, b partial sums
  const __m256 cd = _mm256_hadd_ps(fold(c), fold(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // per half: a, b, c, d partial sums
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#elif defined(CPU_CAPABILITY_AVX2)
#define BATCHVL_LANE_SUMS_OF_FOUR 1
__m128 lane_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

// One head's row of DIM values as float32 vectors, held in registers.
template <int DIM>
struct Row {
  static constexpr int kVectors = DIM / fVec::size();
  static_assert(kVectors >= 1 && DIM % fVec::size() == 0, "a head is a whole number of vectors");
  fVec part[kVectors];

  void load(const float* src) {
    for (int v = 0; v < kVectors; ++v) part[v] = fVec::loadu(src + v * fVec::size());
  }

  void load(const at::BFloat16* src) {
    int v = 0;
    for (; v + 1 < kVectors; v += 2) {  // a bf16 vector widens to two float vectors
      auto [low, high] = at::vec::convert_to_float<at::BFloat16>(bVec::loadu(src + v * fVec::size()));
      part[v] = low;
      part[v + 1] = high;
    }
    if (v < kVectors) {  // an odd last vector: load half a bf16 vector
      part[v] = std::get<0>(at::vec::convert_to_float<at::BFloat16>(bVec::loadu(src + v * fVec::size(), fVec::size())));
    }
  }

  // The products summed over vectors; the dot product is the sum of its lanes.
  fVec products(const Row& other) const {
    fVec sum = part[0] * other.part[0];
    for (int v = 1; v < kVectors; ++v) sum = at::vec::fmadd(part[v], other.part[v], sum);
    return sum;
  }
};

// Softmax of `scores` in place, without the division: returns 1 / the sum of the exponentials.
float exponentials(float* scores, int64_t count) {
  const float top =
      at::vec::reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, scores, count);
  at::vec::map([top](fVec x) { return (x - fVec(top)).exp_u20(); }, scores, scores, count);
  return 1.f / at::vec::reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, scores, count);
}

constexpr int kMaxGroup = 16;  // query heads attended together: their queries and sums stay on the stack

struct Task {
  const void* query;  // the group's first query head; the others follow at query_head_stride
  const void* keys;   // this KV head's keys in the layer, (slots, DIM); values likewise
  const void* values;
  const int64_t* pages;  // the sequence's cache pages, in order
  int64_t page_size;     // slots per page
  int64_t num_keys;
  void* out;  // the group's first output head; the others follow at out_head_stride
  int group;  // query heads attended together, at most kMaxGroup
};

// visit(k, slot) for each of a task's keys in order: a page at a time, with no division per key.
template <typename Visit>
void for_each_key(const Task& task, Visit visit) {
  for (int64_t first = 0, page = 0; first < task.num_keys; first += task.page_size, ++page) {
    const int64_t base = task.pages[page] * task.page_size, count = std::min(task.page_size, task.num_keys - first);
    for (int64_t j = 0; j < count; ++j) visit(first + j, base + j);
  }
}

// Attention of one sequence's query heads that share one KV head. The group's queries are scored against
// each key as it is read; scores are laid out per query head so that the softmax runs over contiguous keys.
template <typename T, int DIM>
void attend_group(const Task& task, int64_t query_head_stride, int64_t out_head_stride, float scaling,
                  std::vector<float>& scores) {
  const T* query = static_cast<const T*>(task.query);
  const T* keys = static_cast<const T*>(task.keys);
  const T* values = static_cast<const T*>(task.values);
  const int64_t num_keys = task.num_keys;
  const int group = task.group;
  Row<DIM> queries[kMaxGroup], row;
  for (int g = 0; g < group; ++g) {
    queries[g].load(query + g * query_head_stride);
    for (auto& part : queries[g].part) part = part * fVec(scaling);
  }
  scores.resize(group * num_keys);
  for_each_key(task, [&](int64_t k, int64_t slot) {
    row.load(keys + slot * DIM);
    int g = 0;
#ifdef BATCHVL_LANE_SUMS_OF_FOUR
    for (; g + 4 <= group; g += 4) {
      float four[4];
      _mm_storeu_ps(four, lane_sums(queries[g].products(row), queries[g + 1].products(row),
                                    queries[g + 2].products(row), queries[g + 3].products(row)));
      for (int i = 0; i < 4; ++i) scores[(g + i) * num_keys + k] = four[i];
    }
#endif
    for (; g < group; ++g) scores[g * num_keys + k] = lane_sum(queries[g].products(row));
  });
  float inverse[kMaxGroup];
  for (int g = 0; g < group; ++g) inverse[g] = exponentials(scores.data() + g * num_keys, num_keys);

  Row<DIM> sums[kMaxGroup];
  for (int g = 0; g < group; ++g)
    for (auto& part : sums[g].part) part = fVec(0.f);
  for_each_key(task, [&](int64_t k, int64_t slot) {
    row.load(values + slot * DIM);
    for (int g = 0; g < group; ++g) {
      const fVec weight(scores[g * num_keys + k]);
      for (int v = 0; v < Row<DIM>::kVectors; ++v) sums[g].part[v] = at::vec::fmadd(weight, row.part[v], sums[g].part[v]);
    }
  });
  T* out = static_cast<T*>(task.out);
  for (int g = 0; g < group; ++g) {
    float result[DIM];
    for (int v = 0; v < Row<DIM>::kVectors; ++v) (sums[g].part[v] * fVec(inverse[g])).store(result + v * fVec::size());
    for (int d = 0; d < DIM; ++d) out[g * out_head_stride + d] = static_cast<T>(result[d]);
  }
}

template <typename T, int DIM>
void attend(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv, const at::Tensor& rows,
            const at::Tensor& pages, const at::Tensor& starts, const at::Tensor& lengths, int64_t page_size,
            float scaling) {
  const int64_t kv_heads = kv.size(1), num_slots = kv.size(2), group = query.size(0) / kv_heads;
  const int64_t batch = rows.size(0);
  // A group larger than kMaxGroup query heads is attended in parts, each a task of its own.
  const int64_t parts = (group + kMaxGroup - 1) / kMaxGroup, part_size = (group + parts - 1) / parts;
  const T* query_data = query.data_ptr<T>();
  const T* kv_data = kv.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* page_data = pages.data_ptr<int64_t>();
  const int64_t* start_of = starts.data_ptr<int64_t>();
  const int64_t* length_of = lengths.data_ptr<int64_t>();
  auto task_at = [&](int64_t index) {
    const int64_t seq = index / (kv_heads * parts), kv_head = index / parts % kv_heads, part = index % parts;
    const int64_t row = row_of[seq], head = kv_head * group + part * part_size;
    return Task{query_data + head * query.stride(0) + row * query.stride(1),
                kv_data + kv_head * num_slots * DIM,
                kv_data + (kv_heads + kv_head) * num_slots * DIM,
                page_data + start_of[seq],
                page_size,
                length_of[seq],
                out_data + row * out.stride(0) + head * out.stride(1),
                static_cast<int>(std::min(part_size, group - part * part_size))};
  };
  // Tasks are dealt out in turn (task i to worker i mod n), not in contiguous ranges: neighbouring sequences
  // often differ much in length, and contiguous ranges left one thread waiting for the other.
  const int64_t tasks = batch * kv_heads * parts, workers = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t worker = first; worker < last; ++worker)
      for (int64_t index = worker; index < tasks; index += workers)
        attend_group<T, DIM>(task_at(index), query.stride(0), out.stride(1), scaling, scores);
  });
}

template <typename T>
void attend_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv, const at::Tensor& rows,
                const at::Tensor& pages, const at::Tensor& starts, const at::Tensor& lengths, int64_t page_size,
                float scaling) {
  switch (query.size(2)) {
    case 16: return attend<T, 16>(out, query, kv, rows, pages, starts, lengths, page_size, scaling);
    case 32: return attend<T, 32>(out, query, kv, rows, pages, starts, lengths, page_size, scaling);
    case 64: return attend<T, 64>(out, query, kv, rows, pages, starts, lengths, page_size, scaling);
    case 128: return attend<T, 128>(out, query, kv, rows, pages, starts, lengths, page_size, scaling);
    case 256: return attend<T, 256>(out, query, kv, rows, pages, starts, lengths, page_size, scaling);
    default: TORCH_CHECK(false, "head size ", query.size(2), " is not one of 16, 32, 64, 128, 256");
  }
}

}  // namespace

namespace batchvl_native {

// out (T, H, D): rows[b] of it receives sequence b's attention output, every head.
// query (H, T, D), last dim contiguous; kv (2, H_kv, slots, D) contiguous, one layer of the cache;
// rows (B,); pages, every sequence's cache pages one after the other, sequence b's from starts[b] on,
// holding its lengths[b] >= 1 keys page_size to a page (page_size 1: the pages are the keys' slots); all
// int64. No table padded to the longest: its copy cost milliseconds a step at hundreds of decodes.
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor kv, at::Tensor rows, at::Tensor pages,
                            at::Tensor starts, at::Tensor lengths, double scale, int64_t page_size) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && kv.dim() == 4, "query (H, T, D), out (T, H, D), kv (2, Hkv, S, D)");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv.is_contiguous(), "head dims must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv.scalar_type() && out.scalar_type() == kv.scalar_type(), "one dtype");
  TORCH_CHECK(query.size(2) == kv.size(3) && out.size(2) == kv.size(3), "one head size");
  TORCH_CHECK(query.size(0) % kv.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(page_size >= 1, "a page holds at least one slot");
  TORCH_CHECK(rows.scalar_type() == at::kLong && pages.scalar_type() == at::kLong &&
                  starts.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && pages.dim() == 1 &&
                  pages.is_contiguous() && starts.size(0) == rows.size(0) && lengths.size(0) == rows.size(0),
              "rows, starts and lengths are int64 with one entry per sequence, pages a contiguous int64 list");
  const float scaling = static_cast<float>(scale);
  if (kv.scalar_type() == at::kFloat) {
    attend_dim<float>(out, query, kv, rows, pages, starts, lengths, page_size, scaling);
  } else if (kv.scalar_type() == at::kBFloat16) {
    attend_dim<at::BFloat16>(out, query, kv, rows, pages, starts, lengths, page_size, scaling);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 only, got ", kv.scalar_type());
  }
}

}  // namespace batchvl_native
