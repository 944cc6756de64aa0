// Huffman-coded bfloat16 exponents back to bfloat16 on the CPU (format: kernels/huffman_decode.py).
//
// A tensor of n values arrives as its sign+mantissa bytes `sm` (n,), its exponents coded chunk by
// chunk in `bits` (each chunk of chunk_elems values starts on a byte; `offsets` (n_chunks + 1,)
// says where), and a decode table of 2^12 entries indexed by the next 12 bits of the stream. An
// entry holds up to four exponents whose codes fit in those 12 bits (the exponents of trained
// weights average ~2.6 bits, so one lookup yields ~3-4 of them): bytes 0-3 the exponents, byte 4
// how many, byte 5 the bits they take, byte 6 the bits of the first alone (for the exact tail).
// The decoder works on its own copy of the table, laid out for a shorter chain of dependent
// instructions a lookup (to_fast). decode_record takes a whole record as the loader reads it
// (runtime/compression.py) and does the header's checks and the table itself, in microseconds,
// with the GIL released: a loader's threads decode records, or chunk ranges of a large one, side
// by side.
//
// Each chunk is decoded into a small buffer (L1-resident) and then merged with its sm bytes into
// bfloat16 in a loop the compiler vectorizes. Chunks are independent: a call decodes a range of
// them, on the caller's thread alone or with helpers of a small pool of this module's own (not
// OpenMP: an OpenMP team spins between parallel regions, and a loader makes hundreds of calls
// while its read threads want the same two cores; the pool's threads sleep, and take groups of
// chunks one at a time, so a helper the OS preempts holds up nobody); four chunks are
// decoded in step on each thread, their table lookups overlapping (1.5x one at a time). A 64-bit
// big-endian window is loaded once per four lookups (4 x 12 bits fit in the 57 bits it
// guarantees), shifted along by each lookup's bits. Chunks near the end of the stream, where a
// window could read past it, are decoded from a zero-padded copy. A chunk whose codes run past
// its own bytes is corrupt: the call fails naming it (the caller names the tensor).

#include <torch/extension.h>

#include <pthread.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

constexpr int kCodeBits = 12;

inline uint64_t load_be64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return __builtin_bswap64(v);
}

// One chunk's decoding state: where its codes are, how far it got, where its exponents go.
struct Cursor {
  const uint8_t* p;  // the chunk's first byte
  uint64_t pos;      // bits consumed
  uint8_t* out;      // next exponent
  uint8_t* end;      // one past the chunk's last exponent
};

constexpr int kShift = 64 - kCodeBits;

// The decoder's own layout of a table entry (build_table's, which the Python and Triton
// decoders share, is converted by to_fast): bits 0-7 the bits its exponents take, 8-15 how many
// there are, 16-23 the bits of the first alone, 32-63 the exponents. The bits taken come first
// so that the window's shift by them needs no extraction (a shift by a register uses its low
// six bits): a lookup's dependency chain is shift, shift, load.
inline uint64_t to_fast(uint64_t t) {
  return ((t & 0xFFFFFFFFull) << 32) | (((t >> 48) & 0xFF) << 16) | (((t >> 32) & 0xFF) << 8) |
         ((t >> 40) & 0xFF);
}

// Four lookups of at most four exponents each from one 64-bit window (>= 57 bits valid, 48 used
// at most): the caller makes sure 16 exponents are still wanted, so the 4-byte stores stay
// inside. The window is shifted along by each lookup's bits; the position is summed apart.
inline void step4(Cursor& c, const uint64_t* table) {
  uint64_t w = load_be64(c.p + (c.pos >> 3)) << (c.pos & 7);
  const uint64_t t0 = table[w >> kShift];
  w <<= (t0 & 63);
  const uint64_t t1 = table[w >> kShift];
  w <<= (t1 & 63);
  const uint64_t t2 = table[w >> kShift];
  w <<= (t2 & 63);
  const uint64_t t3 = table[w >> kShift];
  c.pos += (t0 & 0xFF) + (t1 & 0xFF) + (t2 & 0xFF) + (t3 & 0xFF);
  uint32_t v = static_cast<uint32_t>(t0 >> 32);
  std::memcpy(c.out, &v, 4);
  c.out += (t0 >> 8) & 0xFF;
  v = static_cast<uint32_t>(t1 >> 32);
  std::memcpy(c.out, &v, 4);
  c.out += (t1 >> 8) & 0xFF;
  v = static_cast<uint32_t>(t2 >> 32);
  std::memcpy(c.out, &v, 4);
  c.out += (t2 >> 8) & 0xFF;
  v = static_cast<uint32_t>(t3 >> 32);
  std::memcpy(c.out, &v, 4);
  c.out += (t3 >> 8) & 0xFF;
}

constexpr int64_t kRoom = 16;  // exponents a step4 may store

// Decodes the rest of a chunk: whole windows while 16 exponents are wanted, then one exponent
// at a time, so the bit count comes out exact.
inline void finish(Cursor& c, const uint64_t* table) {
  while (c.end - c.out >= kRoom) step4(c, table);
  while (c.out < c.end) {
    const uint64_t w = load_be64(c.p + (c.pos >> 3)) << (c.pos & 7);
    const uint64_t t = table[w >> kShift];
    *c.out++ = static_cast<uint8_t>(t >> 32);
    c.pos += (t >> 16) & 0xFF;
  }
}

// kWays chunks at once: their lookups are independent chains that the core overlaps (one chain
// waits on its table load most of the time). 4 was fastest of 2, 3, 4, 5, 6 (with step4;
// 2026-11-26, SmolLM2's records on one core: 62 ms; 5 and 6 spill registers: 91, 100 ms).
constexpr int kWays = 4;

inline void decode_group(Cursor* c, const uint64_t* table) {
  for (;;) {
    bool room = true;
    for (int k = 0; k < kWays; ++k) room &= c[k].end - c[k].out >= kRoom;
    if (!room) break;
    for (int k = 0; k < kWays; ++k) step4(c[k], table);
  }
  for (int k = 0; k < kWays; ++k) finish(c[k], table);
}

// bfloat16 from sign+mantissa bytes and exponents. With AVX2, 32 values a step written with
// streaming stores where dst is 32-byte aligned (a chunk's values start on 8 KiB of output at
// the default chunk size): decoded weights are not read again soon, and a plain store first
// reads each line of the (new) output memory, a third of the merge's memory traffic. The
// caller fences (stream_fence) before the values are used.
inline void merge(const uint8_t* sm, const uint8_t* e, uint16_t* dst, int64_t m) {
  int64_t i = 0;
#if defined(__AVX2__)
  if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    const __m256i sign = _mm256_set1_epi16(0x80), mant = _mm256_set1_epi16(0x7F);
    for (; i + 32 <= m; i += 32) {
      const __m256i s8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + i));
      const __m256i e8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + i));
      for (int half = 0; half < 2; ++half) {
        const __m128i sh = half ? _mm256_extracti128_si256(s8, 1) : _mm256_castsi256_si128(s8);
        const __m128i eh = half ? _mm256_extracti128_si256(e8, 1) : _mm256_castsi256_si128(e8);
        const __m256i s16 = _mm256_cvtepu8_epi16(sh), e16 = _mm256_cvtepu8_epi16(eh);
        const __m256i v = _mm256_or_si256(
            _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(s16, sign), 8),
                            _mm256_slli_epi16(e16, 7)),
            _mm256_and_si256(s16, mant));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 16 * half), v);
      }
    }
  }
#endif
  for (; i < m; ++i) {
    const uint16_t s = sm[i];
    dst[i] = static_cast<uint16_t>(((s & 0x80) << 8) | (uint16_t(e[i]) << 7) | (s & 0x7F));
  }
}

inline void stream_fence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

// Waits until `ready()`, spinning for up to kSpinNs first: between a loader's back-to-back calls
// the gap is tens of microseconds, and a sleeping thread takes about as long to wake.
constexpr int64_t kSpinNs = 50000;

template <class F>
bool spin_until(F ready) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNs);
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return false;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

// Helper threads that sleep (after a short spin) until a call hands them work. A call runs
// `body(unit)` for units [0, n) on its own thread and on up to `helpers` pool threads, each
// taking the next unit until none is left, and returns once all are done. Calls from several
// threads take turns.
class Pool {
 public:
  void run(int64_t n, int helpers, const std::function<void(int64_t)>& body) {
    std::unique_lock<std::mutex> call(calls_);  // one call at a time uses the helpers
    {
      std::lock_guard<std::mutex> g(mu_);
      while (static_cast<int>(threads_.size()) < helpers) {
        threads_.emplace_back([this] { serve(); });
        threads_.back().detach();  // the pool is never destroyed (see pool())
      }
      body_ = &body;
      n_ = n;
      next_.store(0);
      active_.store(helpers);
      wanted_ = helpers;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work(body);
    if (!spin_until([this] { return active_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> g(mu_);
      done_.wait(g, [this] { return active_.load() == 0; });  // helpers that found nothing too
    }
    std::lock_guard<std::mutex> g(mu_);
    body_ = nullptr;
  }

 private:
  void work(const std::function<void(int64_t)>& body) {
    for (int64_t u = next_.fetch_add(1); u < n_; u = next_.fetch_add(1)) body(u);
  }

  void serve() {
    uint64_t seen = 0;
    for (;;) {
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
      const std::function<void(int64_t)>* body;
      {
        std::unique_lock<std::mutex> g(mu_);
        wake_.wait(g, [&] { return generation_.load() != seen && wanted_ > 0; });
        seen = generation_.load();
        --wanted_;
        body = body_;
      }
      work(*body);
      if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> g(mu_);  // the caller may be asleep on done_
        done_.notify_one();
      }
    }
  }

  std::mutex calls_, mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int64_t)>* body_ = nullptr;
  std::atomic<int64_t> next_{0};
  int64_t n_ = 0;
  std::atomic<int> active_{0};
  int wanted_ = 0;
  std::atomic<uint64_t> generation_{0};
};

std::atomic<Pool*> g_pool{nullptr};

// The process's pool, made on first use. A forked child has none of its parent's threads, so it
// starts a pool of its own (the parent's is left as it was: its locks may be held).
Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); }); });
  Pool* p = g_pool.load();
  if (p == nullptr) {
    static std::mutex make;
    std::lock_guard<std::mutex> g(make);
    p = g_pool.load();
    if (p == nullptr) {
      p = new Pool();  // never deleted: its detached threads wait on it until the process ends
      g_pool.store(p);
    }
  }
  return *p;
}

}  // namespace

namespace {

// Decodes chunks [first, last) of a tensor of n values (its offsets checked by the caller) into
// dst, on `threads` threads (1: the calling thread alone). The GIL must be released. Returns the
// index of the first corrupt chunk, or -1.
int64_t decode_chunks(uint16_t* dst, const uint64_t* tab, const int32_t* off, const uint8_t* smp,
                      const uint8_t* bp, int64_t n, int64_t nbytes, int64_t chunk_elems,
                      int64_t first, int64_t last, int64_t threads) {
  // the most values a chunk holds: buffers are sized by it, not by a header's chunk_elems alone
  // (a one-chunk record with a corrupt chunk_elems must not cost gigabytes before it is named)
  const int64_t span = std::max<int64_t>(1, std::min(chunk_elems, n));
  const int64_t worst = (span * kCodeBits + 7) / 8 + 8;  // bytes a chunk's windows may read
  const int64_t groups = (last - first + kWays - 1) / kWays;
  std::atomic<int64_t> bad{-1};
  auto decode_one = [&](int64_t g, uint8_t* e, std::vector<uint8_t>* tail) {
    Cursor cur[kWays];
    const int64_t c0 = first + kWays * g, count = std::min<int64_t>(kWays, last - c0);
    for (int64_t k = 0; k < kWays; ++k) {
      const int64_t c = c0 + std::min(k, count - 1);  // a short last group repeats its last
      const int64_t m = std::min(chunk_elems, n - c * chunk_elems);
      const uint8_t* src = bp + off[c];
      if (off[c] + worst > nbytes) {  // near the end: decode from a zero-padded copy
        tail[k].assign(worst, 0);
        std::memcpy(tail[k].data(), src, nbytes - off[c]);
        src = tail[k].data();
      }
      uint8_t* ex = e + k * span;
      cur[k] = Cursor{src, 0, ex, ex + m};
    }
    decode_group(cur, tab);
    for (int64_t k = 0; k < count; ++k) {
      const int64_t c = c0 + k, begin = c * chunk_elems;
      if (cur[k].pos > 8 * static_cast<uint64_t>(off[c + 1] - off[c])) {
        int64_t none = -1;
        bad.compare_exchange_strong(none, c);
        continue;
      }
      merge(smp + begin, e + k * span, dst + begin, std::min(chunk_elems, n - begin));
    }
    stream_fence();  // this thread's streaming stores are done before the call returns
  };
  const int64_t nt = std::max<int64_t>(1, std::min(threads, groups));
  if (nt == 1) {
    thread_local std::vector<uint8_t> e, tail[kWays];
    if (static_cast<int64_t>(e.size()) < kWays * span) e.resize(kWays * span);
    for (int64_t g = 0; g < groups; ++g) decode_one(g, e.data(), tail);
  } else {
    // units of several groups (~64K values), so that taking one costs little beside its work
    const int64_t per = std::max<int64_t>(1, (1 << 16) / (kWays * span));
    const int64_t units = (groups + per - 1) / per;
    const std::function<void(int64_t)> body = [&](int64_t u) {
      thread_local std::vector<uint8_t> e, tail[kWays];
      if (static_cast<int64_t>(e.size()) < kWays * span) e.resize(kWays * span);
      for (int64_t g = u * per, end = std::min(groups, g + per); g < end; ++g)
        decode_one(g, e.data(), tail);
    };
    pool().run(units, static_cast<int>(std::min<int64_t>(nt, units)) - 1, body);
  }
  return bad.load();
}

constexpr int kTableSize = 1 << kCodeBits;

// The decode table of a complete prefix code of at most 12 bits given by its lengths (len[s] for
// the 256 symbols) into t (kTableSize entries). Returns false, writing nothing useful, if the
// lengths are not such a code.
bool fill_table(const int64_t* len, uint64_t* t) {
  uint8_t sym[kTableSize], size[kTableSize];
  int at = 0;  // canonical order, (length, symbol): each code's windows follow the previous
  for (int s = 0; s < 256; ++s)
    if (len[s] < 0 || len[s] > kCodeBits) return false;
  for (int l = 1; l <= kCodeBits; ++l)
    for (int s = 0; s < 256; ++s)
      if (len[s] == l) {
        const int span = 1 << (kCodeBits - l);
        if (at + span > kTableSize) return false;  // over-subscribed
        std::memset(sym + at, s, span);
        std::memset(size + at, l, span);
        at += span;
      }
  if (at != kTableSize) return false;  // incomplete
  for (int w = 0; w < kTableSize; ++w) {
    uint64_t entry = sym[w], count = 1, used = size[w];
    for (int k = 1; k < 4; ++k) {  // the next codes, while they end inside the 12 known bits
      const int rest = (w << used) & (kTableSize - 1);
      if (used + size[rest] > kCodeBits) break;
      entry |= uint64_t(sym[rest]) << (8 * k);
      ++count;
      used += size[rest];
    }
    t[w] = entry | (count << 32) | (used << 40) | (uint64_t(size[w]) << 48);
  }
  return true;
}

// fill_table's entries in the decoder's layout (to_fast).
bool fill_fast_table(const int64_t* len, uint64_t* t) {
  if (!fill_table(len, t)) return false;
  for (int w = 0; w < kTableSize; ++w) t[w] = to_fast(t[w]);
  return true;
}

}  // namespace

// out: (n,) bfloat16 or int16, contiguous; table: (4096,) int64; offsets: (n_chunks + 1,) int32;
// sm: (n,) uint8; bits: (nbytes,) uint8. Decodes chunks [first, last) on `threads` threads (1:
// on the calling thread, no OpenMP team: a loader runs many such calls side by side on its own
// threads). Returns the index of the first corrupt chunk, or -1.
int64_t decode_bf16(torch::Tensor out, torch::Tensor table, torch::Tensor offsets,
                    torch::Tensor sm, torch::Tensor bits, int64_t chunk_elems, int64_t first,
                    int64_t last, int64_t threads) {
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kShort,
              "huffman decode: out must be bfloat16 or int16, got ", out.scalar_type());
  TORCH_CHECK(table.scalar_type() == torch::kLong && table.numel() == (1 << kCodeBits),
              "huffman decode: table must be int64 of ", 1 << kCodeBits, " entries");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt, "huffman decode: offsets must be int32");
  TORCH_CHECK(sm.scalar_type() == torch::kByte && bits.scalar_type() == torch::kByte,
              "huffman decode: sm and bits must be uint8");
  TORCH_CHECK(out.is_contiguous() && table.is_contiguous() && offsets.is_contiguous() &&
                  sm.is_contiguous() && bits.is_contiguous(),
              "huffman decode: contiguous tensors expected");
  TORCH_CHECK(chunk_elems > 0, "huffman decode: chunk_elems must be positive");
  const int64_t n = sm.numel();
  const int64_t n_chunks = (n + chunk_elems - 1) / chunk_elems;
  TORCH_CHECK(out.numel() == n, "huffman decode: out has ", out.numel(), " elements, sm ", n);
  TORCH_CHECK(offsets.numel() == n_chunks + 1, "huffman decode: ", n_chunks,
              " chunks need ", n_chunks + 1, " offsets, got ", offsets.numel());
  TORCH_CHECK(0 <= first && first <= last && last <= n_chunks, "huffman decode: chunks [", first,
              ", ", last, ") of ", n_chunks);
  const int64_t nbytes = bits.numel();
  const int32_t* off = offsets.data_ptr<int32_t>();
  for (int64_t c = first; c < last; ++c)  // in bounds and in order, before any read
    TORCH_CHECK(off[c] >= 0 && off[c] <= off[c + 1] && off[c + 1] <= nbytes,
                "huffman decode: chunk offsets out of order or past the stream at chunk ", c);
  const uint64_t* given = reinterpret_cast<const uint64_t*>(table.data_ptr<int64_t>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  pybind11::gil_scoped_release no_gil;  // a loader's read threads go on meanwhile
  alignas(64) uint64_t tab[kTableSize];
  for (int w = 0; w < kTableSize; ++w) tab[w] = to_fast(given[w]);
  return decode_chunks(dst, tab, off, sm.data_ptr<uint8_t>(), bits.data_ptr<uint8_t>(), n, nbytes,
                       chunk_elems, first, last, threads);
}

// A "huffman" record (runtime/compression.py: b"EIH1", u32 chunk_elems, u64 n, u64 nbytes, 128
// bytes of code lengths two per byte, int32 offsets, n sign+mantissa bytes, the coded exponents)
// decoded into out ((n,) bfloat16 or int16, contiguous), its chunks [first, last) (last -1: to
// the end), in one call: the header read and checked, the table built (~10 us) and the chunks
// decoded, all with the GIL released (a loader decodes pieces of records on its read threads,
// side by side). `record`: (size,) uint8, contiguous, its first byte 4-aligned. Returns -1 if
// all went well, the index of the first corrupt chunk, or -2 for a header that parse_record
// (runtime/compression.py) rejects or a chunk range outside the record: the caller asks
// parse_record why.
int64_t decode_record(torch::Tensor out, torch::Tensor record, int64_t threads,
                      int64_t first, int64_t last) {
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kShort,
              "huffman decode: out must be bfloat16 or int16, got ", out.scalar_type());
  TORCH_CHECK(record.scalar_type() == torch::kByte, "huffman decode: record must be uint8");
  TORCH_CHECK(out.is_contiguous() && record.is_contiguous(),
              "huffman decode: contiguous tensors expected");
  const uint8_t* rec = record.data_ptr<uint8_t>();
  TORCH_CHECK((reinterpret_cast<uintptr_t>(rec) & 3) == 0, "huffman decode: record not 4-aligned");
  const int64_t size = record.numel(), want_n = out.numel();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  pybind11::gil_scoped_release no_gil;
  constexpr int64_t kHead = 24 + 128;
  if (size < kHead || std::memcmp(rec, "EIH1", 4) != 0) return -2;
  uint32_t chunk_elems;
  uint64_t n, nbytes;
  std::memcpy(&chunk_elems, rec + 4, 4);
  std::memcpy(&n, rec + 8, 8);
  std::memcpy(&nbytes, rec + 16, 8);
  if (chunk_elems == 0 || n != static_cast<uint64_t>(want_n) || nbytes >= (uint64_t(1) << 31))
    return -2;
  const int64_t n_chunks = (static_cast<int64_t>(n) + chunk_elems - 1) / chunk_elems;
  const int64_t at = kHead + 4 * (n_chunks + 1);
  if (size != at + static_cast<int64_t>(n) + static_cast<int64_t>(nbytes)) return -2;
  int64_t len[256];
  for (int i = 0; i < 128; ++i) {
    len[2 * i] = rec[24 + i] & 15;
    len[2 * i + 1] = rec[24 + i] >> 4;
  }
  alignas(64) uint64_t table[kTableSize];
  if (!fill_fast_table(len, table)) return -2;
  const int32_t* off = reinterpret_cast<const int32_t*>(rec + kHead);
  if (off[0] != 0 || off[n_chunks] != static_cast<int64_t>(nbytes)) return -2;
  for (int64_t c = 0; c < n_chunks; ++c)
    if (off[c + 1] < off[c]) return -2;
  if (last < 0) last = n_chunks;
  if (first < 0 || first > last || last > n_chunks) return -2;
  return decode_chunks(dst, table, off, rec + at, rec + at + n, static_cast<int64_t>(n),
                       static_cast<int64_t>(nbytes), chunk_elems, first, last, threads);
}

// The decode table of a code given by its lengths ((256,) int64, a complete prefix code of at
// most 12 bits, checked by the caller): the same entries as decode_table_reference in
// kernels/huffman_decode.py, in microseconds instead of a fraction of a millisecond (a model
// has hundreds of tensors, each with its own code).
torch::Tensor build_table(torch::Tensor lengths) {
  TORCH_CHECK(lengths.scalar_type() == torch::kLong && lengths.numel() == 256 &&
                  lengths.is_contiguous(),
              "huffman table: (256,) int64 lengths expected");
  auto table = torch::empty({kTableSize}, torch::kLong);
  TORCH_CHECK(fill_table(lengths.data_ptr<int64_t>(),
                         reinterpret_cast<uint64_t*>(table.data_ptr<int64_t>())),
              "huffman table: not a complete prefix code of at most ", kCodeBits, " bits");
  return table;
}

// The encoder's inner loop: exponents `exps` ((n,) uint8) in the canonical code `codes` /
// `lengths` ((256,) int64 each; every exponent present has a length of 1..12) packed most
// significant bit first, chunk by chunk (each chunk of chunk_elems values starts on a byte, its
// last byte zero-padded): (the bytes, (n_chunks + 1,) int64 offsets of the chunks in them).
// The same bytes as runtime/compression.py's numpy `_pack`, ~20x faster on one thread.
std::vector<torch::Tensor> pack_codes(torch::Tensor exps, torch::Tensor codes,
                                      torch::Tensor lengths, int64_t chunk_elems) {
  TORCH_CHECK(exps.scalar_type() == torch::kByte && exps.is_contiguous(),
              "huffman pack: contiguous uint8 exponents expected");
  TORCH_CHECK(codes.scalar_type() == torch::kLong && codes.numel() == 256 &&
                  codes.is_contiguous() && lengths.scalar_type() == torch::kLong &&
                  lengths.numel() == 256 && lengths.is_contiguous(),
              "huffman pack: (256,) int64 codes and lengths expected");
  TORCH_CHECK(chunk_elems > 0, "huffman pack: chunk_elems must be positive");
  const uint8_t* e = exps.data_ptr<uint8_t>();
  const int64_t* code = codes.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int s = 0; s < 256; ++s)
    TORCH_CHECK(len[s] >= 0 && len[s] <= kCodeBits, "huffman pack: code lengths must be 0..12");
  pybind11::gil_scoped_release no_gil;  // `edgeinfer compress` encodes on several threads
  const int64_t n = exps.numel(), n_chunks = (n + chunk_elems - 1) / chunk_elems;
  auto offsets = torch::empty({n_chunks + 1}, torch::kLong);
  int64_t* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t c = 0; c < n_chunks; ++c) {  // each chunk's bytes
    const int64_t lo = c * chunk_elems, hi = std::min(n, lo + chunk_elems);
    int64_t bits = 0;
    for (int64_t i = lo; i < hi; ++i) {
      TORCH_CHECK(len[e[i]] > 0, "huffman pack: exponent ", int(e[i]), " has no code");
      bits += len[e[i]];
    }
    off[c + 1] = off[c] + (bits + 7) / 8;
  }
  auto out = torch::empty({off[n_chunks]}, torch::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t lo = c * chunk_elems, hi = std::min(n, lo + chunk_elems);
    uint8_t* at = o + off[c];
    uint64_t acc = 0;  // the pending bits, in its low `held` bits (held < 8 between codes)
    int held = 0;
    for (int64_t i = lo; i < hi; ++i) {
      acc = (acc << len[e[i]]) | uint64_t(code[e[i]]);
      held += int(len[e[i]]);
      while (held >= 8) {
        held -= 8;
        *at++ = uint8_t(acc >> held);
      }
    }
    if (held) *at++ = uint8_t(acc << (8 - held));
  }
  return {out, offsets};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_codes", &pack_codes,
        "exponents packed in a canonical code, chunk by chunk: (bytes, (n_chunks + 1,) offsets)",
        py::arg("exps"), py::arg("codes"), py::arg("lengths"), py::arg("chunk_elems"));
  m.def("decode_bf16", &decode_bf16,
        "Huffman-coded bfloat16 exponents + raw sign/mantissa bytes -> bfloat16, chunks "
        "[first, last) (in place)",
        py::arg("out"), py::arg("table"), py::arg("offsets"), py::arg("sm"), py::arg("bits"),
        py::arg("chunk_elems"), py::arg("first"), py::arg("last"), py::arg("threads"));
  m.def("decode_record", &decode_record,
        "chunks [first, last) of a huffman record decoded into out (last -1: to the end): -1, "
        "the first corrupt chunk, or -2 for a bad header",
        py::arg("out"), py::arg("record"), py::arg("threads"), py::arg("first") = 0,
        py::arg("last") = -1);
  m.def("build_table", &build_table, "the multi-symbol decode table of a code (its lengths)",
        py::arg("lengths"));
}
