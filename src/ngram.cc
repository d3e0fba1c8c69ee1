#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "specdecode/host_device.h"
#include "specdecode/ngram.h"
#include "specdecode/ngram_ops.h"
#include "specdecode/parallel.h"

#include <unistd.h>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace sd {
namespace cpu {

using ngram::Table;
using ngram::TableShape;

void validate_ngram_config(const NGramConfig& c) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (c.tables.empty() || static_cast<int>(c.tables.size()) > ngram::kMaxTables) {
    fail("tables: expected 1 to " + std::to_string(ngram::kMaxTables) +
         " (leader_len, follower_len) pairs, got " + std::to_string(c.tables.size()));
  }
  for (size_t i = 0; i < c.tables.size(); ++i) {
    const auto [l, f] = c.tables[i];
    if (l < 1 || l > ngram::kMaxLeaderLen) {
      fail("leader_len: expected 1 to " + std::to_string(ngram::kMaxLeaderLen) + ", got " +
           std::to_string(l));
    }
    if (f < 1 || f > ngram::kMaxFollowerLen) {
      fail("follower_len: expected 1 to " + std::to_string(ngram::kMaxFollowerLen) + ", got " +
           std::to_string(f));
    }
    for (size_t j = 0; j < i; ++j) {
      if (c.tables[j] == c.tables[i]) {
        fail("tables: (" + std::to_string(l) + ", " + std::to_string(f) + ") is given twice");
      }
    }
  }
  if (c.max_leaders < 1 || c.max_leaders > ngram::kMaxLeaders) {
    fail("max_leaders: expected 1 to " + std::to_string(ngram::kMaxLeaders) + ", got " +
         std::to_string(c.max_leaders));
  }
  if (c.max_followers < 1 || c.max_followers > ngram::kMaxFollowers) {
    fail("max_followers: expected 1 to " + std::to_string(ngram::kMaxFollowers) + ", got " +
         std::to_string(c.max_followers));
  }
  if (c.max_sequences < 1 || c.max_sequences > (1 << 20)) {
    fail("max_sequences: expected 1 to 1048576, got " + std::to_string(c.max_sequences));
  }
  const int64_t states = c.shared ? 1 : c.max_sequences;
  int64_t bytes = 0;
  for (const auto& [l, f] : c.tables) {
    const TableShape s = TableShape::make(l, f, c.max_leaders, c.max_followers);
    bytes += states * s.words * 4;
  }
  // A guard against a typo (or a forged file) allocating the machine away, not a tuning knob:
  // the memory is zeroed up front, so an over-committed allocation would get the process killed
  // instead of raising.
  int64_t limit = int64_t{1} << 36;
#ifdef _SC_PHYS_PAGES
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) limit = std::min<int64_t>(limit, int64_t{pages} * page);
#endif
  if (bytes > limit) {
    fail("max_leaders/max_followers/max_sequences: the tables would take " +
         std::to_string(bytes >> 20) + " MiB, more than " + std::to_string(limit >> 20) +
         " MiB (64 GiB or the machine's physical memory)");
  }
}

TableMemory::TableMemory(size_t words) : words_(words) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = std::max<size_t>(words * sizeof(int32_t), 64);
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t rounded = (bytes + align - 1) / align * align;
  data_ = static_cast<int32_t*>(std::aligned_alloc(align, rounded));
  if (!data_) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (align == kHuge) madvise(data_, rounded, MADV_HUGEPAGE);  // a hint; failure is harmless
#endif
  std::memset(data_, 0, rounded);
}

TableMemory::~TableMemory() { std::free(data_); }

NGramCache::NGramCache(const NGramConfig& config) : config_(config) {
  validate_ngram_config(config_);
  const int states = num_states();
  int max_window = 2;
  for (const auto& [l, f] : config_.tables) {
    shapes_.push_back(TableShape::make(l, f, config_.max_leaders, config_.max_followers));
    max_window = std::max(max_window, l + f);
    max_leader_len_ = std::max(max_leader_len_, l);
  }
  tail_cap_ = max_window - 1;
  for (const TableShape& s : shapes_) {
    words_.emplace_back(static_cast<size_t>(s.words * states));
  }
  clocks_.assign(states, 0);
  tails_.assign(static_cast<size_t>(config_.max_sequences) * tail_cap_, kPad);
  tail_lens_.assign(config_.max_sequences, 0);
  for (int st = 0; st < states; ++st) clear_state(st);
}

int64_t NGramCache::nbytes() const {
  int64_t total = 0;
  for (const auto& w : words_) total += static_cast<int64_t>(w.size() * sizeof(int32_t));
  total += static_cast<int64_t>(clocks_.size() * sizeof(int64_t));
  total += static_cast<int64_t>((tails_.size() + tail_lens_.size()) * sizeof(int32_t));
  return total;
}

// Views are handed out from const methods for lookups that refresh recency (touch_on_read) and
// for introspection; the cache's memory itself is never const.
Table NGramCache::table(int state, int t) const {
  const TableShape& s = shapes_[t];
  int32_t* words = words_[t].data() + s.words * state;
  return Table(&s, words);
}

std::vector<int32_t> NGramCache::tail(int slot) const {
  const int32_t* t = tails_.data() + static_cast<int64_t>(slot) * tail_cap_;
  return std::vector<int32_t>(t, t + tail_lens_[slot]);
}

void NGramCache::clear_state(int state) {
  for (int t = 0; t < num_tables(); ++t) table(state, t).clear();
  clocks_[state] = 0;
}

void NGramCache::clear() {
  for (int st = 0; st < num_states(); ++st) clear_state(st);
  std::fill(tail_lens_.begin(), tail_lens_.end(), 0);
}

void NGramCache::reset(const int32_t* slots, int64_t batch) {
  for (int64_t b = 0; b < batch; ++b) {
    tail_lens_[slots[b]] = 0;
    if (!config_.shared) clear_state(slots[b]);
  }
}

void NGramCache::end_streams(const int32_t* slots, int64_t batch) {
  for (int64_t b = 0; b < batch; ++b) tail_lens_[slots[b]] = 0;
}

// Rows per chunk of a threaded batch. A row costs a few hundred nanoseconds, so at least 16
// amortise the hand-off; beyond that, each chunk restarts the prefetch pipelines (its first rows
// were not prefetched), so chunks are as long as a few per thread allow: 4 per thread keep the
// threads balanced when one of them is slowed down.
static int64_t row_grain(int64_t batch) {
  const int64_t threads = std::max(1, num_threads());
  return std::max<int64_t>(16, batch / (4 * threads));
}

// ---------------------------------------------------------------------------------------------
// update

void NGramCache::update_one(int slot, const int32_t* tokens, int64_t n) {
  if (n <= 0) return;
  const int state = config_.shared ? 0 : slot;
  int32_t* tail = tails_.data() + static_cast<int64_t>(slot) * tail_cap_;
  const int64_t t = tail_lens_[slot];
  // Position i of the stream seen so far (tail followed by the new tokens).
  auto at = [&](int64_t i) { return i < t ? tail[i] : tokens[i - t]; };
  int32_t window[ngram::kMaxLeaderLen + ngram::kMaxFollowerLen];
  // Only windows that end in a new token: the others were inserted by earlier calls, which is
  // what makes every n-gram enter the tables exactly once across calls.
  for (int64_t end = t + 1; end <= t + n; ++end) {
    const int64_t stamp = ++clocks_[state];
    for (int k = 0; k < num_tables(); ++k) {
      const TableShape& s = shapes_[k];
      const int w = s.leader_len + s.follower_len;
      if (end < w) continue;
      for (int j = 0; j < w; ++j) window[j] = at(end - w + j);
      table(state, k).insert(window, window + s.leader_len, stamp);
    }
  }
  const int64_t total = t + n;
  const int keep = static_cast<int>(std::min<int64_t>(tail_cap_, total));
  int32_t fresh[ngram::kMaxLeaderLen + ngram::kMaxFollowerLen];
  for (int j = 0; j < keep; ++j) fresh[j] = at(total - keep + j);
  std::memcpy(tail, fresh, sizeof(int32_t) * keep);
  tail_lens_[slot] = keep;
}

// Prefetch stage `stage` (see Table::prefetch) for the leaders of the windows a row's update
// will insert (the first few; a step commits a handful of tokens).
void NGramCache::prefetch_update(int slot, const int32_t* tokens, int64_t n, int stage) const {
  const int state = config_.shared ? 0 : slot;
  const int64_t t = tail_lens_[slot];
  const int32_t* tail = tails_.data() + static_cast<int64_t>(slot) * tail_cap_;
  int32_t leader[ngram::kMaxLeaderLen];
  for (int64_t end = t + 1; end <= t + std::min<int64_t>(n, 8); ++end) {
    for (int k = 0; k < num_tables(); ++k) {
      const TableShape& s = shapes_[k];
      const int w = s.leader_len + s.follower_len;
      if (end < w) continue;
      for (int j = 0; j < s.leader_len; ++j) {
        const int64_t i = end - w + j;
        leader[j] = i < t ? tail[i] : tokens[i - t];
      }
      const Table tab = table(state, k);
      tab.prefetch(tab.hash_of(leader), stage, true);
    }
  }
}

void NGramCache::update(const int32_t* slots, int64_t batch, const int32_t* tokens,
                        const int32_t* offsets) {
  // Rows hit unrelated tables, so once a batch's tables outgrow the caches each insert waits on
  // memory; a four-stage prefetch pipeline over the next rows overlaps those waits.
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int stage = 0; stage < 4; ++stage) {
        const int64_t ahead = b + 4 - stage;
        if (ahead < end) {
          prefetch_update(slots[ahead], tokens + offsets[ahead],
                          static_cast<int64_t>(offsets[ahead + 1]) - offsets[ahead], stage);
        }
      }
      update_one(slots[b], tokens + offsets[b], static_cast<int64_t>(offsets[b + 1]) - offsets[b]);
    }
  };
  if (config_.shared) {
    std::lock_guard<std::mutex> lock(shared_mu_);
    for (int64_t b = 0; b < batch; ++b) {
      update_one(slots[b], tokens + offsets[b], static_cast<int64_t>(offsets[b + 1]) - offsets[b]);
    }
    return;
  }
  parallel_for(batch, row_grain(batch), rows);
}

// ---------------------------------------------------------------------------------------------
// draft

struct NGramCache::Scratch {
  // first_child / next_sibling: each node's children as a list, so that a token is looked for
  // among all of a node's children, whichever expansion made them.
  std::vector<int32_t> token, parent, depth, queue, first_child, next_sibling;
  std::vector<uint8_t> queued;
  std::vector<Candidate> cands;
  std::vector<int32_t> cur;
  std::vector<uint8_t> alive;
  explicit Scratch(int max_nodes)
      : token(max_nodes),
        parent(max_nodes),
        depth(max_nodes),
        queue(max_nodes),
        first_child(max_nodes),
        next_sibling(max_nodes),
        queued(max_nodes) {}
};

void NGramCache::lookup(const NGramCache& cache, int state, bool touch, const int32_t* path,
                        int path_len, std::vector<Candidate>* out) {
  const size_t first = out->size();
  for (int k = 0; k < cache.num_tables(); ++k) {
    const TableShape& s = cache.shapes_[k];
    if (path_len < s.leader_len) continue;
    Table tab = cache.table(state, k);
    const int idx = tab.find(path + path_len - s.leader_len);
    if (idx < 0) continue;
    if (touch) tab.touch(idx);
    const int n = tab.num_followers(idx);
    for (int j = 0; j < n; ++j)
      out->push_back({tab.follower(idx, j), s.follower_len, tab.stamp(idx, j)});
  }
  // Merge the tables' rows (each already most recent first) by stamp, most recent first; on a
  // tie (the same window end in two tables) the earlier table comes first. Stable insertion sort:
  // a handful of candidates.
  for (size_t i = first + 1; i < out->size(); ++i) {
    const Candidate c = (*out)[i];
    size_t j = i;
    while (j > first && (*out)[j - 1].stamp < c.stamp) {
      (*out)[j] = (*out)[j - 1];
      --j;
    }
    (*out)[j] = c;
  }
}

void NGramCache::draft_one(int slot, const int32_t* context, int context_len, int max_nodes,
                           int max_depth, bool chain, Scratch& sc, int32_t* out_tokens,
                           int32_t* out_parents, int32_t* out_num_nodes) {
  const int state = config_.shared ? 0 : slot;
  const bool touch = config_.touch_on_read && !frozen_;
  const NGramCache* stat = static_.get();
  const int path_cap = std::max(max_leader_len_, stat ? stat->max_leader_len_ : 1);

  int count = 1;
  sc.token[0] = context[context_len - 1];
  sc.parent[0] = kPad;
  sc.depth[0] = 0;
  sc.first_child[0] = -1;
  std::fill(sc.queued.begin(), sc.queued.begin() + max_nodes, 0);
  int qhead = 0, qtail = 0;
  sc.queue[qtail++] = 0;
  sc.queued[0] = 1;

  int32_t path[ngram::kMaxLeaderLen];
  while (qhead < qtail && count < max_nodes) {
    const int v = sc.queue[qhead++];
    if (sc.depth[v] >= max_depth) continue;
    // The last path_cap tokens of context + the tokens from the root's child down to v.
    int have = 0;
    int32_t rev[ngram::kMaxLeaderLen];
    for (int u = v; u > 0 && have < path_cap; u = sc.parent[u]) rev[have++] = sc.token[u];
    for (int i = context_len - 1; i >= 0 && have < path_cap; --i) rev[have++] = context[i];
    for (int i = 0; i < have; ++i) path[i] = rev[have - 1 - i];

    sc.cands.clear();
    lookup(*this, state, touch, path, have, &sc.cands);
    if (stat) lookup(*stat, 0, false, path, have, &sc.cands);
    if (sc.cands.empty()) continue;
    if (chain) sc.cands.resize(1);

    // Insert the candidates as paths below v, level by level, so that siblings claim the node
    // budget before descendants. Invariant: no two children of a node carry the same token, so a
    // candidate's path joins any existing node with its prefix, also one made by an earlier
    // expansion (a longer follower of another table passes through the ends of shorter ones).
    const int ncand = static_cast<int>(sc.cands.size());
    sc.cur.assign(ncand, v);
    sc.alive.assign(ncand, 1);
    int longest = 0;
    for (const Candidate& c : sc.cands) longest = std::max(longest, c.len);
    // Every path below v is at depth depth[v] + j + 1 at level j, so the depth limit cuts all
    // candidates at the same level: those still longer than that die there.
    const int levels = std::min(longest, max_depth - sc.depth[v]);
    for (int j = 0; j < levels; ++j) {
      for (int c = 0; c < ncand; ++c) {
        if (!sc.alive[c] || j >= sc.cands[c].len) continue;
        const int at = sc.cur[c];
        const int32_t tok = sc.cands[c].tokens[j];
        int child = sc.first_child[at];
        while (child >= 0 && sc.token[child] != tok) child = sc.next_sibling[child];
        if (child < 0) {
          if (count >= max_nodes) {
            sc.alive[c] = 0;
            continue;
          }
          child = count++;
          sc.token[child] = tok;
          sc.parent[child] = at;
          sc.depth[child] = sc.depth[at] + 1;
          sc.queued[child] = 0;
          sc.first_child[child] = -1;
          sc.next_sibling[child] = sc.first_child[at];
          sc.first_child[at] = child;
        }
        sc.cur[c] = child;
      }
    }
    for (int c = 0; c < ncand; ++c) {
      if (sc.cands[c].len > levels) sc.alive[c] = 0;
    }
    // The end of each complete candidate path is the next leader's last token (breadth first).
    for (int c = 0; c < ncand; ++c) {
      const int end = sc.cur[c];
      if (sc.alive[c] && !sc.queued[end]) {
        sc.queued[end] = 1;
        sc.queue[qtail++] = end;
      }
    }
  }

  for (int i = 0; i < count; ++i) {
    out_tokens[i] = sc.token[i];
    out_parents[i] = sc.parent[i];
  }
  for (int i = count; i < max_nodes; ++i) {
    out_tokens[i] = kPad;
    out_parents[i] = kPad;
  }
  *out_num_nodes = count;
}

void NGramCache::draft(const int32_t* slots, int64_t batch, const int32_t* contexts,
                       int64_t ctx_stride, const int32_t* context_lens, int max_nodes,
                       int max_depth, bool chain, int32_t* out_tokens, int32_t* out_parents,
                       int32_t* out_num_nodes) {
  // The root's leaders are the contexts' last tokens, known for every row up front. Each row's
  // context lies in memory of its own, so the rows ahead first get the end of their context
  // (three rows ahead), then their home slots (two rows ahead) and then the next slot of the
  // probe run if the home slot does not hold the leader, and the log words a touch writes (one
  // row ahead).
  auto prefetch = [&](int64_t b, int stage) {
    const int32_t* ctx = contexts + b * ctx_stride;
    for (int k = 0; k < num_tables(); ++k) {
      const int l = shapes_[k].leader_len;
      if (context_lens[b] < l) continue;
      const Table tab = table(slots[b], k);
      tab.prefetch(tab.hash_of(ctx + context_lens[b] - l), stage, false);
    }
  };
  // One row ahead, whose root records have landed: the home slots of the leaders that the
  // first expansions below the root will look up, i.e. the ends of the root's most recent
  // followers (breadth first reaches them first; the node budget is usually spent soon after).
  const int deep_width = chain ? 1 : 2;
  auto deep = [&](int64_t b) {
    const int32_t* ctx = contexts + b * ctx_stride;
    const int len = context_lens[b];
    int root[ngram::kMaxTables], next_j[ngram::kMaxTables];
    for (int k = 0; k < num_tables(); ++k) {
      const Table tab = table(slots[b], k);
      const int l = shapes_[k].leader_len;
      root[k] = len >= l ? tab.hint(tab.hash_of(ctx + len - l)) : -1;
      next_j[k] = 0;
    }
    int32_t leader[ngram::kMaxLeaderLen];
    for (int taken = 0; taken < deep_width; ++taken) {
      // The next most recent follower over the tables, as lookup() merges them.
      int best = -1;
      int64_t best_stamp = -1;
      for (int k = 0; k < num_tables(); ++k) {
        if (root[k] < 0) continue;
        const Table tab = table(slots[b], k);
        if (next_j[k] >= tab.num_followers(root[k])) continue;
        const int64_t st = tab.stamp(root[k], next_j[k]);
        if (st > best_stamp) {
          best = k;
          best_stamp = st;
        }
      }
      if (best < 0) return;
      const int fl = shapes_[best].follower_len;
      const int32_t* f = table(slots[b], best).follower(root[best], next_j[best]++);
      for (int k = 0; k < num_tables(); ++k) {
        const int l = shapes_[k].leader_len;
        const int32_t* key = f + fl - l;
        if (fl < l) {
          // The leader reaches back into the context: its last l - fl tokens, then f.
          if (len < l - fl) continue;
          std::memcpy(leader, ctx + len - (l - fl), sizeof(int32_t) * (l - fl));
          std::memcpy(leader + l - fl, f, sizeof(int32_t) * fl);
          key = leader;
        }
        const Table tab = table(slots[b], k);
        tab.prefetch(tab.hash_of(key), 0, false);
      }
    }
  };
  const bool pipeline = !config_.shared && max_depth >= 1 && max_nodes >= 2;
  auto run = [&](int64_t begin, int64_t end) {
    Scratch scratch(max_nodes);
    for (int64_t b = begin; b < end; ++b) {
      if (pipeline) {
        if (b + 3 < end) {
          const int32_t* last = contexts + (b + 3) * ctx_stride + context_lens[b + 3] - 1;
          __builtin_prefetch(last);
          __builtin_prefetch(last - (max_leader_len_ - 1));
        }
        if (b + 2 < end) prefetch(b + 2, 0);
        if (b + 1 < end) {
          prefetch(b + 1, 1);
          if (max_depth >= 2) deep(b + 1);
        }
      }
      draft_one(slots[b], contexts + b * ctx_stride, context_lens[b], max_nodes, max_depth, chain,
                scratch, out_tokens + b * max_nodes, out_parents + b * max_nodes,
                out_num_nodes + b);
    }
  };
  if (config_.shared) {
    std::lock_guard<std::mutex> lock(shared_mu_);
    run(0, batch);
    return;
  }
  parallel_for(batch, row_grain(batch), run);
}

// ---------------------------------------------------------------------------------------------
// serialisation
//
// Little-endian image:
//   "SDNGRAM\0"  u32 version
//   u32 num_tables, (u32 leader_len, u32 follower_len) * num_tables, u32 max_leaders,
//   u32 max_followers, u32 max_sequences, u8 touch_on_read, u8 shared, u8 frozen, u8 0
//   per slot: u32 tail_len, i32 * tail_len
//   per state: i64 clock; per table: u32 leaders, per leader from least to most recent:
//     i32 * leader_len, u32 followers, per follower from most to least recent:
//       i32 * follower_len, i64 stamp
//   u64 FNV-1a of everything before
// Loading re-inserts leaders and followers in recency order, so the hash layout is rebuilt and
// never trusted from the file.

namespace {

constexpr char kMagic[8] = {'S', 'D', 'N', 'G', 'R', 'A', 'M', '\0'};
constexpr uint32_t kVersion = 1;

uint64_t fnv1a64(const char* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<uint8_t>(data[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

class Writer {
 public:
  template <typename T>
  void put(T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_tokens(const int32_t* p, int n) {
    out.append(reinterpret_cast<const char*>(p), sizeof(int32_t) * n);
  }
  std::string out;
};

class Reader {
 public:
  Reader(const char* data, size_t size) : p_(data), end_(data + size) {}
  template <typename T>
  T get(const char* what) {
    if (static_cast<size_t>(end_ - p_) < sizeof(T)) {
      throw std::invalid_argument(std::string("n-gram cache file is truncated (in ") + what + ")");
    }
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  void get_tokens(int32_t* out, int n, const char* what) {
    for (int i = 0; i < n; ++i) {
      out[i] = get<int32_t>(what);
      if (out[i] < 0) {
        throw std::invalid_argument(std::string("n-gram cache file has a negative token id in ") +
                                    what);
      }
    }
  }
  bool done() const { return p_ == end_; }

 private:
  const char* p_;
  const char* end_;
};

[[noreturn]] void bad_file(const std::string& why) {
  throw std::invalid_argument("n-gram cache file is inconsistent: " + why);
}

}  // namespace

std::string NGramCache::serialize() const {
  Writer w;
  w.out.append(kMagic, sizeof(kMagic));
  w.put<uint32_t>(kVersion);
  w.put<uint32_t>(static_cast<uint32_t>(num_tables()));
  for (const auto& [l, f] : config_.tables) {
    w.put<uint32_t>(l);
    w.put<uint32_t>(f);
  }
  w.put<uint32_t>(config_.max_leaders);
  w.put<uint32_t>(config_.max_followers);
  w.put<uint32_t>(config_.max_sequences);
  w.put<uint8_t>(config_.touch_on_read);
  w.put<uint8_t>(config_.shared);
  w.put<uint8_t>(frozen_);
  w.put<uint8_t>(0);
  for (int s = 0; s < config_.max_sequences; ++s) {
    w.put<uint32_t>(tail_lens_[s]);
    w.put_tokens(tails_.data() + static_cast<int64_t>(s) * tail_cap_, tail_lens_[s]);
  }
  for (int st = 0; st < num_states(); ++st) {
    w.put<int64_t>(clocks_[st]);
    for (int k = 0; k < num_tables(); ++k) {
      const Table tab = table(st, k);
      w.put<uint32_t>(tab.count());
      for (int i = tab.lru(); i >= 0; i = tab.next(i)) {
        w.put_tokens(tab.key(i), tab.shape().leader_len);
        const int n = tab.num_followers(i);
        w.put<uint32_t>(n);
        for (int j = 0; j < n; ++j) {
          w.put_tokens(tab.follower(i, j), tab.shape().follower_len);
          w.put<int64_t>(tab.stamp(i, j));
        }
      }
    }
  }
  const uint64_t sum = fnv1a64(w.out.data(), w.out.size());
  w.put<uint64_t>(sum);
  return std::move(w.out);
}

std::unique_ptr<NGramCache> NGramCache::deserialize(const char* data, size_t size) {
  if (size < sizeof(kMagic) + 4 || std::memcmp(data, kMagic, sizeof(kMagic)) != 0) {
    throw std::invalid_argument("not a specdecode n-gram cache file (bad magic)");
  }
  uint32_t version;
  std::memcpy(&version, data + sizeof(kMagic), 4);
  if (version != kVersion) {
    throw std::invalid_argument("n-gram cache file version " + std::to_string(version) +
                                " is not supported (this build reads version " +
                                std::to_string(kVersion) + ")");
  }
  if (size < sizeof(kMagic) + 4 + 8) throw std::invalid_argument("n-gram cache file is truncated");
  uint64_t stored;
  std::memcpy(&stored, data + size - 8, 8);
  if (fnv1a64(data, size - 8) != stored) {
    throw std::invalid_argument("n-gram cache file is corrupted (checksum mismatch)");
  }

  Reader r(data + sizeof(kMagic) + 4, size - sizeof(kMagic) - 4 - 8);
  NGramConfig c;
  const uint32_t ntables = r.get<uint32_t>("config");
  if (ntables < 1 || ntables > static_cast<uint32_t>(ngram::kMaxTables)) {
    bad_file("num_tables = " + std::to_string(ntables));
  }
  c.tables.clear();
  for (uint32_t k = 0; k < ntables; ++k) {
    const uint32_t l = r.get<uint32_t>("config"), f = r.get<uint32_t>("config");
    if (l > 1024 || f > 1024) bad_file("table lengths out of range");
    c.tables.emplace_back(static_cast<int>(l), static_cast<int>(f));
  }
  const uint32_t ml = r.get<uint32_t>("config"), mf = r.get<uint32_t>("config"),
                 ms = r.get<uint32_t>("config");
  if (ml > ngram::kMaxLeaders || mf > 1024 || ms > (1u << 20)) bad_file("capacities out of range");
  c.max_leaders = static_cast<int>(ml);
  c.max_followers = static_cast<int>(mf);
  c.max_sequences = static_cast<int>(ms);
  c.touch_on_read = r.get<uint8_t>("config") != 0;
  c.shared = r.get<uint8_t>("config") != 0;
  const bool frozen = r.get<uint8_t>("config") != 0;
  r.get<uint8_t>("config");
  try {
    validate_ngram_config(c);
  } catch (const std::invalid_argument& e) {
    bad_file(e.what());
  }
  auto cache = std::make_unique<NGramCache>(c);
  for (int s = 0; s < c.max_sequences; ++s) {
    const uint32_t n = r.get<uint32_t>("tails");
    if (n > static_cast<uint32_t>(cache->tail_cap_)) bad_file("a tail is too long");
    r.get_tokens(cache->tails_.data() + static_cast<int64_t>(s) * cache->tail_cap_,
                 static_cast<int>(n), "tails");
    cache->tail_lens_[s] = static_cast<int32_t>(n);
  }
  int32_t key[ngram::kMaxLeaderLen], fol[ngram::kMaxFollowerLen];
  for (int st = 0; st < cache->num_states(); ++st) {
    const int64_t clock = r.get<int64_t>("clock");
    if (clock < 0) bad_file("negative clock");
    // A clock counts committed tokens; one of 2^62 or more can only be forged, and its stamps
    // would overflow within the next updates.
    if (clock > (INT64_MAX >> 1)) bad_file("clock out of range");
    cache->clocks_[st] = clock;
    for (int k = 0; k < cache->num_tables(); ++k) {
      Table tab = cache->table(st, k);
      const TableShape& s = tab.shape();
      const uint32_t nl = r.get<uint32_t>("leaders");
      if (nl > static_cast<uint32_t>(s.max_leaders)) bad_file("too many leaders in a table");
      for (uint32_t i = 0; i < nl; ++i) {
        r.get_tokens(key, s.leader_len, "leaders");
        if (tab.find(key) >= 0) bad_file("a leader appears twice in a table");
        const int idx = tab.add_leader(key);
        const uint32_t nf = r.get<uint32_t>("followers");
        if (nf < 1 || nf > static_cast<uint32_t>(s.max_followers)) {
          bad_file("a row has " + std::to_string(nf) + " followers");
        }
        // Rows are stored and written most recent first, stamps strictly decreasing.
        int64_t newer = clock + 1;
        for (uint32_t j = 0; j < nf; ++j) {
          r.get_tokens(fol, s.follower_len, "followers");
          const int64_t stamp = r.get<int64_t>("followers");
          if (stamp < 1 || stamp >= newer) bad_file("follower stamps out of order");
          newer = stamp;
          if (tab.find_follower(idx, fol) >= 0) bad_file("a follower appears twice in a row");
          tab.append_follower(idx, fol, stamp);
        }
      }
    }
  }
  if (!r.done()) bad_file("trailing bytes");
  cache->frozen_ = frozen;
  return cache;
}

}  // namespace cpu
}  // namespace sd
