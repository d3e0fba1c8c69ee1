// One Cacheback n-gram table: a fixed-capacity two-level LRU from a leader (the last
// leader_len tokens) to at most max_followers followers (the follower_len tokens that came next).
//
// A table instance is a view over memory allocated once by its owner (see ngram_ops.h); nothing
// here allocates, so the memory of a cache never grows. Layout of one instance, in int32 words:
//
//   meta  [4]                    count (leaders in use), lru (least recent leader), mru, 0
//   slots [hash_cap * record]    open addressing with linear probing over the records themselves:
//           prev, next           intrusive doubly linked LRU list over slot indices (-1 ends)
//           state                0: the slot is empty; else 1 + the number of followers
//           tag                  the leader's hash (its home slot is tag & (hash_cap - 1))
//           key [leader_len]
//           row [max_followers * (follower_len + 2)]: follower tokens, then its int64 stamp
//
// A leader is identified by its slot. The records live in the hash table itself, so a lookup
// costs one cache miss (the home slot's record: tag, key and row side by side; the next slots
// of a probe run follow in memory) instead of a bucket miss followed by a record miss: once a
// batch's tables exceed the last-level cache the cache is bound by such misses. The table is at
// most half full (hash_cap >= 2 * max_leaders), so probe runs stay short.
//
// Invariants: count leaders are in use, each in exactly one slot on the probe run from its home
// slot (no empty slot in between), and in the LRU list exactly once; a full table evicts the least
// recently used leader before it adds one. Deletion shifts later records of the probe run back
// (no tombstones) and relinks the LRU neighbours of every record it moves. A row holds its
// followers physically ordered most recent first, with pairwise distinct token tuples and
// strictly decreasing stamps. Rows are at most 64 long, so keeping them ordered by shifting is
// cheaper than a second level of links.
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
  int hash_cap = 0;   // slots: a power of two >= 2 * max_leaders, so probe runs stay short
  int entry = 0;      // int32 words per follower: tokens + an int64 stamp
  int record = 0;     // int32 words per slot
  int64_t words = 0;  // int32 words per instance

  static constexpr int64_t kOffSlots = 4;

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
    s.words = kOffSlots + static_cast<int64_t>(s.hash_cap) * s.record;
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
  int num_followers(int leader) const { return rec(leader)[kState] - 1; }
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
    for (int i = 0; i < s_->hash_cap; ++i) rec(i)[kState] = 0;
  }

  // Slot of the leader with these leader_len tokens, or -1.
  int find(const int32_t* leader) const { return find(leader, hash_of(leader)); }
  int find(const int32_t* leader, uint32_t h) const {
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    for (uint32_t pos = h & mask;; pos = (pos + 1) & mask) {
      const int32_t* r = rec(static_cast<int>(pos));
      if (r[kState] == 0) return -1;
      if (static_cast<uint32_t>(r[kTag]) == h && same_tokens(r + kKey, leader, s_->leader_len)) {
        return static_cast<int>(pos);
      }
    }
  }

  uint32_t hash_of(const int32_t* leader) const { return hash_tokens(leader, s_->leader_len); }

  // Prefetch hints for batched callers, which know later rows' leaders ahead of time. Each
  // stage assumes the previous one has landed: stage 0 pulls in the leader's home slot (whose
  // record is the leader's in the common case) and the table's meta words; stage 1, for a hit in
  // the home slot, the records a touch relinks (the LRU neighbours and the most recent leader);
  // stages 1, 2, 3, ..., for a new leader in a full table, the records of the 1st, 2nd, 3rd, ...
  // least recent leaders (see below). Hints only: reading a stale slot or record is harmless.
  // `insert` says whether the caller will insert (else it only looks up and touches).
  void prefetch(uint32_t h, int stage, bool insert) const {
    const int home = static_cast<int>(h & static_cast<uint32_t>(s_->hash_cap - 1));
    const int32_t* r = rec(home);
    if (stage == 0) {
      prefetch_record(home);
      __builtin_prefetch(w_, 1);
      return;
    }
    const bool hit = r[kState] != 0 && static_cast<uint32_t>(r[kTag]) == h;
    if (hit) {
      if (stage != 1) return;
      if (r[kPrev] >= 0) __builtin_prefetch(rec(r[kPrev]), 1);
      if (r[kNext] >= 0) __builtin_prefetch(rec(r[kNext]), 1);
      if (w_[2] >= 0) __builtin_prefetch(rec(w_[2]), 1);
      return;
    }
    // A new leader in a full table: an update's e-th new leader evicts the e-th least recent
    // leader, so stage s walks one link further down the LRU list than stage s - 1 did (whose
    // record has landed) and prefetches that victim's record, the slot after it (the backward
    // shift reads it) and the most recent leader's record (push_mru writes it).
    if (!insert || w_[0] < s_->max_leaders || w_[1] < 0) return;
    int victim = w_[1];
    for (int i = 1; i < stage && victim >= 0; ++i) victim = rec(victim)[kNext];
    if (victim < 0) return;
    prefetch_record(victim);
    __builtin_prefetch(rec((victim + 1) & (s_->hash_cap - 1)));
    if (w_[2] >= 0) __builtin_prefetch(rec(w_[2]), 1);
  }

  // The slot of the leader with hash h if it sits in its home slot (tags only, keys are not
  // compared, so it may name another leader), else -1. A prefetch hint.
  int hint(uint32_t h) const {
    const int home = static_cast<int>(h & static_cast<uint32_t>(s_->hash_cap - 1));
    const int32_t* r = rec(home);
    return r[kState] != 0 && static_cast<uint32_t>(r[kTag]) == h ? home : -1;
  }

  // Every cache line of a slot's record.
  void prefetch_record(int slot) const {
    const char* r = reinterpret_cast<const char*>(rec(slot));
    const char* last = r + 4 * s_->record - 1;
    for (; r < last; r += 64) __builtin_prefetch(r, 1);
    __builtin_prefetch(last, 1);
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
    const uint32_t h = hash_of(leader);
    int idx = find(leader, h);
    if (idx >= 0) {
      touch(idx);
    } else {
      idx = add_leader(leader, h);
    }
    insert_follower(idx, follower, stamp);
  }

  // Adds a leader that is not in the table (find() < 0) as the most recent, with an empty row,
  // and returns its slot; a full table first evicts its least recently used leader with that
  // leader's row (which may move other leaders to other slots).
  int add_leader(const int32_t* leader) { return add_leader(leader, hash_of(leader)); }
  int add_leader(const int32_t* leader, uint32_t h) {
    if (w_[0] < s_->max_leaders) {
      ++w_[0];
    } else {
      const int victim = w_[1];
      unlink(victim);
      erase_slot(victim);
    }
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    uint32_t pos = h & mask;
    while (rec(static_cast<int>(pos))[kState] != 0) pos = (pos + 1) & mask;
    const int idx = static_cast<int>(pos);
    int32_t* r = rec(idx);
    std::memcpy(r + kKey, leader, sizeof(int32_t) * s_->leader_len);
    r[kTag] = static_cast<int32_t>(h);
    r[kState] = 1;
    push_mru(idx);
    return idx;
  }

  // Appends a follower as the least recent of a row that has room (deserialisation; the caller
  // checks the room and that the follower is new).
  void append_follower(int leader, const int32_t* follower, int64_t stamp) {
    const int j = rec(leader)[kState]++ - 1;
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
  enum : int { kPrev = 0, kNext = 1, kState = 2, kTag = 3, kKey = 4 };

  int32_t* rec(int slot) const { return w_ + TableShape::kOffSlots + int64_t{slot} * s_->record; }
  int32_t* entry(int leader, int j) const {
    return rec(leader) + kKey + s_->leader_len + j * s_->entry;
  }

  void write_entry(int32_t* e, const int32_t* follower, int64_t stamp) {
    for (int i = 0; i < s_->follower_len; ++i) e[i] = follower[i];
    std::memcpy(e + s_->follower_len, &stamp, sizeof(stamp));
  }

  void insert_follower(int leader, const int32_t* follower, int64_t stamp) {
    int32_t* r = rec(leader);
    const int n = r[kState] - 1;
    int j = find_follower(leader, follower);
    if (j < 0) {
      // A new follower: the least recent one falls off the end of a full row.
      j = n < s_->max_followers ? n : n - 1;
      if (n < s_->max_followers) r[kState] = n + 2;
    }
    // Shift the more recent entries 0 .. j-1 down by one and put this one first.
    int32_t* row = entry(leader, 0);
    // A few words: a plain loop (backwards, the ranges overlap) beats a call to memmove.
    for (int i = s_->entry * j - 1; i >= 0; --i) row[s_->entry + i] = row[i];
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

  // Empties a slot whose leader is already unlinked from the LRU list. Backward-shift deletion:
  // later records of the probe run move up into the hole unless their home slot lies cyclically
  // after the hole, so lookups never need tombstones; a moved record's LRU neighbours (or the
  // list's ends) are pointed at its new slot.
  void erase_slot(int slot) {
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    uint32_t hole = static_cast<uint32_t>(slot);
    for (uint32_t j = (hole + 1) & mask;; j = (j + 1) & mask) {
      const int32_t* rj = rec(static_cast<int>(j));
      if (rj[kState] == 0) break;
      const uint32_t home = static_cast<uint32_t>(rj[kTag]) & mask;
      // The record at j may fill the hole iff its home is not in the cyclic range (hole, j].
      const bool home_in_range =
          hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
      if (!home_in_range) {
        int32_t* rh = rec(static_cast<int>(hole));
        const int used = kKey + s_->leader_len + (rj[kState] - 1) * s_->entry;
        std::memcpy(rh, rj, sizeof(int32_t) * used);
        const int to = static_cast<int>(hole);
        if (rh[kPrev] >= 0)
          rec(rh[kPrev])[kNext] = to;
        else
          w_[1] = to;
        if (rh[kNext] >= 0)
          rec(rh[kNext])[kPrev] = to;
        else
          w_[2] = to;
        hole = j;
      }
    }
    rec(static_cast<int>(hole))[kState] = 0;
  }

  const TableShape* s_;
  int32_t* w_;
};

}  // namespace ngram
}  // namespace sd
