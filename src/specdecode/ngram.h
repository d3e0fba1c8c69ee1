// One Cacheback n-gram table: a fixed-capacity two-level LRU from a leader (the last
// leader_len tokens) to at most max_followers followers (the follower_len tokens that came next).
//
// A table instance is a view over memory allocated once by its owner (see ngram_ops.h); nothing
// here allocates, so the memory of a cache never grows. Layout of one instance, in int32 words:
//
//   meta   [4]            count (leaders in use), lru (least recently used leader), mru, unused
//   hash   [hash_cap]     open addressing with linear probing: leader index or -1 (empty)
//   home   [max_leaders]  each leader's hash value (its home bucket is home & (hash_cap - 1))
//   keys   [max_leaders * leader_len]
//   prev   [max_leaders]  intrusive doubly linked LRU list over leader indices (-1 ends it)
//   next   [max_leaders]
//   nfol   [max_leaders]  followers in each leader's row
//   fol    [max_leaders * max_followers * follower_len]
// plus stamps (int64) [max_leaders * max_followers].
//
// Invariants: leaders 0 .. count-1 are in use (a full table evicts and reuses an index, nothing
// is ever freed on its own, so no free list is needed); every leader in use is in the hash and
// in the LRU list exactly once; a row holds its followers physically ordered most recent first,
// with pairwise distinct token tuples and strictly decreasing stamps. Rows are at most 64 long,
// so keeping them ordered by shifting is cheaper than a second level of links.
#pragma once

#include <cstdint>
#include <cstring>

namespace sd {
namespace ngram {

constexpr int kMaxLeaderLen = 16;
constexpr int kMaxFollowerLen = 32;
constexpr int kMaxFollowers = 64;
constexpr int kMaxTables = 8;
// Leader indices and follower slots are int32.
constexpr int64_t kMaxLeaders = int64_t{1} << 24;

struct TableShape {
  int leader_len = 1;
  int follower_len = 2;
  int max_leaders = 256;
  int max_followers = 4;
  int hash_cap = 0;  // a power of two >= 2 * max_leaders, so probes stay short
  int64_t off_hash = 0, off_home = 0, off_keys = 0, off_prev = 0, off_next = 0, off_nfol = 0,
          off_fol = 0;
  int64_t words = 0;   // int32 words per instance
  int64_t stamps = 0;  // int64 stamps per instance

  static TableShape make(int leader_len, int follower_len, int max_leaders, int max_followers) {
    TableShape s;
    s.leader_len = leader_len;
    s.follower_len = follower_len;
    s.max_leaders = max_leaders;
    s.max_followers = max_followers;
    s.hash_cap = 2;
    while (s.hash_cap < 2 * max_leaders) s.hash_cap *= 2;
    const int64_t ml = max_leaders;
    s.off_hash = 4;
    s.off_home = s.off_hash + s.hash_cap;
    s.off_keys = s.off_home + ml;
    s.off_prev = s.off_keys + ml * leader_len;
    s.off_next = s.off_prev + ml;
    s.off_nfol = s.off_next + ml;
    s.off_fol = s.off_nfol + ml;
    s.words = s.off_fol + ml * max_followers * follower_len;
    s.stamps = ml * max_followers;
    return s;
  }
};

inline uint32_t hash_tokens(const int32_t* key, int len) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(len);
  for (int i = 0; i < len; ++i) {
    h ^= static_cast<uint32_t>(key[i]);
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 29;
  return static_cast<uint32_t>(h);
}

inline bool same_tokens(const int32_t* a, const int32_t* b, int len) {
  for (int i = 0; i < len; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// A view of one table instance. Cheap to copy; all state lives in the owner's memory.
class Table {
 public:
  Table(const TableShape* shape, int32_t* words, int64_t* stamps)
      : s_(shape), w_(words), stamp_(stamps) {}

  const TableShape& shape() const { return *s_; }
  int count() const { return w_[0]; }
  int lru() const { return w_[1]; }
  int mru() const { return w_[2]; }
  int next(int leader) const { return w_[s_->off_next + leader]; }
  int prev(int leader) const { return w_[s_->off_prev + leader]; }
  const int32_t* key(int leader) const {
    return w_ + s_->off_keys + int64_t{leader} * s_->leader_len;
  }
  int num_followers(int leader) const { return w_[s_->off_nfol + leader]; }
  // Follower j (0 = most recent) of a leader's row.
  const int32_t* follower(int leader, int j) const {
    return w_ + s_->off_fol + (int64_t{leader} * s_->max_followers + j) * s_->follower_len;
  }
  int64_t stamp(int leader, int j) const { return stamp_[int64_t{leader} * s_->max_followers + j]; }

  void clear() {
    w_[0] = 0;
    w_[1] = -1;
    w_[2] = -1;
    w_[3] = 0;
    for (int i = 0; i < s_->hash_cap; ++i) w_[s_->off_hash + i] = -1;
  }

  // Index of the leader with these leader_len tokens, or -1.
  int find(const int32_t* leader) const {
    const uint32_t h = hash_tokens(leader, s_->leader_len);
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    const int32_t* hash = w_ + s_->off_hash;
    for (uint32_t pos = h & mask;; pos = (pos + 1) & mask) {
      const int32_t idx = hash[pos];
      if (idx < 0) return -1;
      if (static_cast<uint32_t>(w_[s_->off_home + idx]) == h &&
          same_tokens(key(idx), leader, s_->leader_len)) {
        return idx;
      }
    }
  }

  // Makes a leader the most recently used.
  void touch(int leader) {
    if (w_[2] == leader) return;
    unlink(leader);
    push_mru(leader);
  }

  // Records that `follower` came after `leader`. A known leader and a known follower become
  // most recent; a new leader in a full table evicts the least recently used leader with its
  // row; a new follower in a full row evicts that row's least recently used follower.
  void insert(const int32_t* leader, const int32_t* follower, int64_t stamp) {
    int idx = find(leader);
    if (idx >= 0) {
      touch(idx);
    } else {
      idx = add_leader(leader);
    }
    insert_follower(idx, follower, stamp);
  }

  // Adds a leader that is not in the table (find() < 0) as the most recent, with an empty row;
  // a full table first evicts its least recently used leader with that leader's row.
  int add_leader(const int32_t* leader) {
    int idx;
    if (w_[0] < s_->max_leaders) {
      idx = w_[0]++;
    } else {
      idx = w_[1];
      unlink(idx);
      hash_erase(idx);
    }
    std::memcpy(w_ + s_->off_keys + int64_t{idx} * s_->leader_len, leader,
                sizeof(int32_t) * s_->leader_len);
    const uint32_t h = hash_tokens(leader, s_->leader_len);
    w_[s_->off_home + idx] = static_cast<int32_t>(h);
    hash_insert(idx, h);
    push_mru(idx);
    w_[s_->off_nfol + idx] = 0;
    return idx;
  }

  // Appends a follower as the least recent of a row that has room (deserialisation; the caller
  // checks the room and that the follower is new).
  void append_follower(int leader, const int32_t* follower, int64_t stamp) {
    const int j = w_[s_->off_nfol + leader]++;
    write_follower(leader, j, follower, stamp);
  }

  int find_follower(int leader, const int32_t* follower) const {
    const int n = num_followers(leader);
    for (int j = 0; j < n; ++j) {
      if (same_tokens(this->follower(leader, j), follower, s_->follower_len)) return j;
    }
    return -1;
  }

 private:
  int32_t* fol_ptr(int leader, int j) {
    return w_ + s_->off_fol + (int64_t{leader} * s_->max_followers + j) * s_->follower_len;
  }

  void write_follower(int leader, int j, const int32_t* follower, int64_t stamp) {
    std::memcpy(fol_ptr(leader, j), follower, sizeof(int32_t) * s_->follower_len);
    stamp_[int64_t{leader} * s_->max_followers + j] = stamp;
  }

  void insert_follower(int leader, const int32_t* follower, int64_t stamp) {
    int n = num_followers(leader);
    int j = find_follower(leader, follower);
    if (j < 0) {
      // A new follower: the least recent one falls off the end of a full row.
      j = n < s_->max_followers ? n : n - 1;
      if (n < s_->max_followers) w_[s_->off_nfol + leader] = n + 1;
    }
    // Shift the more recent entries 0 .. j-1 down by one and put this one first.
    const int f = s_->follower_len;
    int32_t* row = fol_ptr(leader, 0);
    int64_t* stamps = stamp_ + int64_t{leader} * s_->max_followers;
    std::memmove(row + f, row, sizeof(int32_t) * f * j);
    std::memmove(stamps + 1, stamps, sizeof(int64_t) * j);
    std::memcpy(row, follower, sizeof(int32_t) * f);
    stamps[0] = stamp;
  }

  void unlink(int leader) {
    int32_t* prev = w_ + s_->off_prev;
    int32_t* next = w_ + s_->off_next;
    const int p = prev[leader], n = next[leader];
    if (p >= 0)
      next[p] = n;
    else
      w_[1] = n;
    if (n >= 0)
      prev[n] = p;
    else
      w_[2] = p;
  }

  void push_mru(int leader) {
    int32_t* prev = w_ + s_->off_prev;
    int32_t* next = w_ + s_->off_next;
    prev[leader] = w_[2];
    next[leader] = -1;
    if (w_[2] >= 0)
      next[w_[2]] = leader;
    else
      w_[1] = leader;
    w_[2] = leader;
  }

  void hash_insert(int leader, uint32_t h) {
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    int32_t* hash = w_ + s_->off_hash;
    uint32_t pos = h & mask;
    while (hash[pos] >= 0) pos = (pos + 1) & mask;
    hash[pos] = leader;
  }

  // Backward-shift deletion: later entries of the probe run move up into the hole unless their
  // home bucket lies cyclically after the hole, so lookups never need tombstones.
  void hash_erase(int leader) {
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    int32_t* hash = w_ + s_->off_hash;
    uint32_t hole = static_cast<uint32_t>(w_[s_->off_home + leader]) & mask;
    while (hash[hole] != leader) hole = (hole + 1) & mask;
    for (uint32_t j = (hole + 1) & mask;; j = (j + 1) & mask) {
      const int32_t idx = hash[j];
      if (idx < 0) break;
      const uint32_t home = static_cast<uint32_t>(w_[s_->off_home + idx]) & mask;
      // The entry at j may fill the hole iff its home is not in the cyclic range (hole, j].
      const bool home_in_range =
          hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
      if (!home_in_range) {
        hash[hole] = idx;
        hole = j;
      }
    }
    hash[hole] = -1;
  }

  const TableShape* s_;
  int32_t* w_;
  int64_t* stamp_;
};

}  // namespace ngram
}  // namespace sd
