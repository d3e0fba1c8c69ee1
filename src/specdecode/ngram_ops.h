// The Cacheback n-gram cache on the CPU: one set of LRU tables per sequence slot (or one set
// shared by all slots), the token tail of each slot, and an optional frozen static cache that
// drafting also consults. All memory is allocated by the constructor and never grows.
//
// Preconditions of the batched calls (checked by the bindings, not here): slots are in
// [0, max_sequences) and pairwise distinct, token ids are >= 0, offsets are monotone from 0,
// context_lens are in [1, C], 1 <= max_nodes <= kMaxTreeNodes, max_depth >= 0, and the cache is
// not frozen for update/reset.
//
// Thread safety: with per-slot tables, calls that touch distinct slots use disjoint memory and
// may run concurrently (the batch itself is threaded over slots); with shared tables, update and
// draft take a mutex and walk the batch serially in batch order, so the result is deterministic.
// A frozen cache is never written (lookups do not refresh its recency), so it may be read by
// any number of threads. reset/clear/serialize must not overlap other calls on the same slots.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "specdecode/ngram.h"

namespace sd {
namespace cpu {

struct NGramConfig {
  std::vector<std::pair<int, int>> tables{{1, 2}};  // (leader_len, follower_len) per table
  int max_leaders = 256;
  int max_followers = 4;
  bool touch_on_read = true;
  int max_sequences = 256;
  bool shared = false;
};

// Throws std::invalid_argument naming the bad field.
void validate_ngram_config(const NGramConfig& config);

// Zeroed int32 memory for the tables, allocated once. Large buffers are 2 MiB aligned and, on
// Linux, advised to use transparent huge pages: a batch's tables are spread over tens or
// hundreds of MiB and every lookup lands somewhere random in them, so with 4 KiB pages most
// lookups would also miss the TLB.
class TableMemory {
 public:
  TableMemory() = default;
  explicit TableMemory(size_t words);
  TableMemory(TableMemory&& o) noexcept : data_(o.data_), words_(o.words_) {
    o.data_ = nullptr;
    o.words_ = 0;
  }
  TableMemory& operator=(TableMemory&&) = delete;
  TableMemory(const TableMemory&) = delete;
  ~TableMemory();
  int32_t* data() const { return data_; }
  size_t size() const { return words_; }

 private:
  int32_t* data_ = nullptr;
  size_t words_ = 0;
};

class NGramCache {
 public:
  explicit NGramCache(const NGramConfig& config);

  const NGramConfig& config() const { return config_; }
  int num_tables() const { return static_cast<int>(shapes_.size()); }
  int num_states() const { return config_.shared ? 1 : config_.max_sequences; }
  int tail_capacity() const { return tail_cap_; }
  int max_leader_len() const { return max_leader_len_; }
  int64_t nbytes() const;

  bool frozen() const { return frozen_; }
  void freeze() { frozen_ = true; }
  // The static cache consulted after this one's own tables; must be frozen and shared.
  void set_static(std::shared_ptr<const NGramCache> stat) { static_ = std::move(stat); }
  const std::shared_ptr<const NGramCache>& static_cache() const { return static_; }

  // Feeds the new tokens tokens[offsets[b] .. offsets[b+1]) of slot slots[b], for b < batch.
  void update(const int32_t* slots, int64_t batch, const int32_t* tokens, const int32_t* offsets);

  // Ends the token stream of a slot without adding n-grams (a document boundary).
  void end_streams(const int32_t* slots, int64_t batch);

  // Drafts a tree per sequence from its committed context contexts[b, 0 .. context_lens[b])
  // (row stride ctx_stride); only the last max_leader_len() tokens of a context are read.
  // Outputs: tokens/parents [batch, max_nodes] in the tree format of tree.h (node 0 = the last
  // committed token, -1 padding), num_nodes [batch]. chain keeps only the most recent follower at
  // each expansion.
  void draft(const int32_t* slots, int64_t batch, const int32_t* contexts, int64_t ctx_stride,
             const int32_t* context_lens, int max_nodes, int max_depth, bool chain,
             int32_t* out_tokens, int32_t* out_parents, int32_t* out_num_nodes);

  // Forgets the slots' tails and, with per-slot tables, their tables (a new sequence). With
  // shared tables, the shared knowledge is kept.
  void reset(const int32_t* slots, int64_t batch);
  // Forgets everything.
  void clear();

  // Versioned binary image (magic, version, config, state, FNV-1a 64 checksum).
  std::string serialize() const;
  // Throws std::invalid_argument for a foreign, truncated, corrupted or inconsistent image.
  static std::unique_ptr<NGramCache> deserialize(const char* data, size_t size);

  // ---- introspection (tests, debugging) ----
  ngram::Table table(int state, int t) const;
  int64_t clock(int state) const { return clocks_[state]; }
  std::vector<int32_t> tail(int slot) const;

 private:
  struct Candidate {
    const int32_t* tokens;
    int len;
    int64_t stamp;
  };
  struct Scratch;

  void update_one(int slot, const int32_t* tokens, int64_t n);
  void prefetch_update(int slot, const int32_t* tokens, int64_t n, int stage) const;
  void draft_one(int slot, const int32_t* context, int context_len, int max_nodes, int max_depth,
                 bool chain, Scratch& scratch, int32_t* out_tokens, int32_t* out_parents,
                 int32_t* out_num_nodes);
  // Appends the followers of every table of `cache` (state `state`) for a path ending with
  // `path` (last tokens, most recent last), most recent first.
  static void lookup(const NGramCache& cache, int state, bool touch, const int32_t* path,
                     int path_len, std::vector<Candidate>* out);
  void clear_state(int state);

  NGramConfig config_;
  std::vector<ngram::TableShape> shapes_;
  std::vector<TableMemory> words_;  // per table: num_states * words
  std::vector<int64_t> clocks_;     // per state: window ends seen, the stamp of the next insert - 1
  std::vector<int32_t> tails_;      // per slot: tail_cap_ tokens
  std::vector<int32_t> tail_lens_;
  int tail_cap_ = 1;
  int max_leader_len_ = 1;
  bool frozen_ = false;
  std::shared_ptr<const NGramCache> static_;
  std::mutex shared_mu_;
};

}  // namespace cpu
}  // namespace sd
