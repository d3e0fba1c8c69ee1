// One Cacheback n-gram table: a fixed-capacity two-level LRU from a leader (the last
// leader_len tokens) to at most max_followers followers (the follower_len tokens that came next).
//
// A table instance is a view over memory allocated once by its owner (see ngram_ops.h); nothing
// here allocates, so the memory of a cache never grows. Layout of one instance, in int32 words:
//
//   meta    [4]                     count (leaders in use), lru (least recent leader), mru, 0
//   hash    [2 * hash_cap]          open addressing, linear probing: (leader index or -1, tag)
//   records [max_leaders * record]  one record per leader:
//             prev, next            intrusive doubly linked LRU list over leader indices (-1 ends)
//             nfol                  followers in the row
//             tag                   the leader's hash (its home bucket is tag & (hash_cap - 1))
//             key [leader_len]
//             row [max_followers * (follower_len + 2)]: follower tokens, then its int64 stamp
//
// A leader's links, key and row sit together and the hash keeps the tag beside the index, so a
// lookup costs about two cache misses and an insert about five (the LRU neighbours): the cache
// is memory-bound once a batch's tables exceed the last-level cache.
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
  int entry = 0;     // int32 words per follower: tokens + an int64 stamp
  int record = 0;    // int32 words per leader record
  int64_t off_records = 0;
  int64_t words = 0;  // int32 words per instance

  static TableShape make(int leader_len, int follower_len, int max_leaders, int max_followers) {
    TableShape s;
    s.leader_len = leader_len;
    s.follower_len = follower_len;
    s.max_leaders = max_leaders;
    s.max_followers = max_followers;
    s.hash_cap = 2;
    while (s.hash_cap < 2 * max_leaders) s.hash_cap *= 2;
    s.entry = follower_len + 2;
    s.record = 4 + leader_len + max_followers * s.entry;
    s.off_records = 4 + 2 * static_cast<int64_t>(s.hash_cap);
    s.words = s.off_records + static_cast<int64_t>(max_leaders) * s.record;
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
  Table(const TableShape* shape, int32_t* words) : s_(shape), w_(words) {}

  const TableShape& shape() const { return *s_; }
  int count() const { return w_[0]; }
  int lru() const { return w_[1]; }
  int mru() const { return w_[2]; }
  int prev(int leader) const { return rec(leader)[kPrev]; }
  int next(int leader) const { return rec(leader)[kNext]; }
  int num_followers(int leader) const { return rec(leader)[kNfol]; }
  const int32_t* key(int leader) const { return rec(leader) + kKey; }
  // Follower j (0 = most recent) of a leader's row.
  const int32_t* follower(int leader, int j) const { return entry(leader, j); }
  int64_t stamp(int leader, int j) const {
    int64_t v;
    std::memcpy(&v, entry(leader, j) + s_->follower_len, sizeof(v));
    return v;
  }

  void clear() {
    w_[0] = 0;
    w_[1] = -1;
    w_[2] = -1;
    w_[3] = 0;
    int32_t* hash = w_ + 4;
    for (int i = 0; i < s_->hash_cap; ++i) hash[2 * i] = -1;
  }

  // Index of the leader with these leader_len tokens, or -1.
  int find(const int32_t* leader) const {
    const uint32_t h = hash_tokens(leader, s_->leader_len);
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    const int32_t* hash = w_ + 4;
    for (uint32_t pos = h & mask;; pos = (pos + 1) & mask) {
      const int32_t idx = hash[2 * pos];
      if (idx < 0) return -1;
      if (static_cast<uint32_t>(hash[2 * pos + 1]) == h &&
          same_tokens(key(idx), leader, s_->leader_len)) {
        return idx;
      }
    }
  }

  // Prefetch hints for batched callers, which know later rows' leaders ahead of time. Each
  // stage assumes the previous one has landed: stage 0 pulls in the leader's home bucket;
  // stage 1 the record the bucket points to (or, for a new leader in a full table, the least
  // recent leader's record, which the insert will evict); stage 2 the records an insert or a
  // touch relinks (the LRU neighbours and the current most recent leader). Hints only: reading
  // a stale bucket or record here is harmless.
  void prefetch(const int32_t* leader, int stage) const {
    const uint32_t h = hash_tokens(leader, s_->leader_len);
    const int32_t* b = w_ + 4 + 2 * (h & static_cast<uint32_t>(s_->hash_cap - 1));
    if (stage == 0) {
      __builtin_prefetch(b);
      return;
    }
    const bool hit = b[0] >= 0 && static_cast<uint32_t>(b[1]) == h;
    const bool evicts = !hit && w_[0] == s_->max_leaders;
    if (!hit && !evicts) return;
    const int32_t* r = rec(hit ? b[0] : w_[1]);
    if (stage == 1) {
      __builtin_prefetch(r, 1);
      __builtin_prefetch(r + 16, 1);
      return;
    }
    if (r[kPrev] >= 0) __builtin_prefetch(rec(r[kPrev]), 1);
    if (r[kNext] >= 0) __builtin_prefetch(rec(r[kNext]), 1);
    if (w_[2] >= 0) __builtin_prefetch(rec(w_[2]), 1);
    if (evicts) {
      const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
      __builtin_prefetch(w_ + 4 + 2 * (static_cast<uint32_t>(r[kTag]) & mask), 1);
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
    int32_t* r = rec(idx);
    std::memcpy(r + kKey, leader, sizeof(int32_t) * s_->leader_len);
    const uint32_t h = hash_tokens(leader, s_->leader_len);
    r[kTag] = static_cast<int32_t>(h);
    r[kNfol] = 0;
    hash_insert(idx, h);
    push_mru(idx);
    return idx;
  }

  // Appends a follower as the least recent of a row that has room (deserialisation; the caller
  // checks the room and that the follower is new).
  void append_follower(int leader, const int32_t* follower, int64_t stamp) {
    const int j = rec(leader)[kNfol]++;
    write_entry(entry(leader, j), follower, stamp);
  }

  int find_follower(int leader, const int32_t* follower) const {
    const int n = num_followers(leader);
    for (int j = 0; j < n; ++j) {
      if (same_tokens(entry(leader, j), follower, s_->follower_len)) return j;
    }
    return -1;
  }

 private:
  enum : int { kPrev = 0, kNext = 1, kNfol = 2, kTag = 3, kKey = 4 };

  int32_t* rec(int leader) const { return w_ + s_->off_records + int64_t{leader} * s_->record; }
  int32_t* entry(int leader, int j) const {
    return rec(leader) + kKey + s_->leader_len + j * s_->entry;
  }

  void write_entry(int32_t* e, const int32_t* follower, int64_t stamp) {
    std::memcpy(e, follower, sizeof(int32_t) * s_->follower_len);
    std::memcpy(e + s_->follower_len, &stamp, sizeof(stamp));
  }

  void insert_follower(int leader, const int32_t* follower, int64_t stamp) {
    int32_t* r = rec(leader);
    const int n = r[kNfol];
    int j = find_follower(leader, follower);
    if (j < 0) {
      // A new follower: the least recent one falls off the end of a full row.
      j = n < s_->max_followers ? n : n - 1;
      if (n < s_->max_followers) r[kNfol] = n + 1;
    }
    // Shift the more recent entries 0 .. j-1 down by one and put this one first.
    int32_t* row = entry(leader, 0);
    std::memmove(row + s_->entry, row, sizeof(int32_t) * s_->entry * j);
    write_entry(row, follower, stamp);
  }

  void unlink(int leader) {
    int32_t* r = rec(leader);
    const int p = r[kPrev], n = r[kNext];
    if (p >= 0)
      rec(p)[kNext] = n;
    else
      w_[1] = n;
    if (n >= 0)
      rec(n)[kPrev] = p;
    else
      w_[2] = p;
  }

  void push_mru(int leader) {
    int32_t* r = rec(leader);
    r[kPrev] = w_[2];
    r[kNext] = -1;
    if (w_[2] >= 0)
      rec(w_[2])[kNext] = leader;
    else
      w_[1] = leader;
    w_[2] = leader;
  }

  void hash_insert(int leader, uint32_t h) {
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    int32_t* hash = w_ + 4;
    uint32_t pos = h & mask;
    while (hash[2 * pos] >= 0) pos = (pos + 1) & mask;
    hash[2 * pos] = leader;
    hash[2 * pos + 1] = static_cast<int32_t>(h);
  }

  // Backward-shift deletion: later entries of the probe run move up into the hole unless their
  // home bucket lies cyclically after the hole, so lookups never need tombstones.
  void hash_erase(int leader) {
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    int32_t* hash = w_ + 4;
    uint32_t hole = static_cast<uint32_t>(rec(leader)[kTag]) & mask;
    while (hash[2 * hole] != leader) hole = (hole + 1) & mask;
    for (uint32_t j = (hole + 1) & mask;; j = (j + 1) & mask) {
      const int32_t idx = hash[2 * j];
      if (idx < 0) break;
      const uint32_t home = static_cast<uint32_t>(hash[2 * j + 1]) & mask;
      // The entry at j may fill the hole iff its home is not in the cyclic range (hole, j].
      const bool home_in_range =
          hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
      if (!home_in_range) {
        hash[2 * hole] = idx;
        hash[2 * hole + 1] = hash[2 * j + 1];
        hole = j;
      }
    }
    hash[2 * hole] = -1;
  }

  const TableShape* s_;
  int32_t* w_;
};

}  // namespace ngram
}  // namespace sd
