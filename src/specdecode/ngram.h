// One Cacheback n-gram table: a fixed-capacity two-level LRU from a leader (the last
// leader_len tokens) to at most max_followers followers (the follower_len tokens that came next).
//
// A table instance is a view over memory allocated once by its owner (see ngram_ops.h); nothing
// here allocates, so the memory of a cache never grows. Layout of one instance, in int32 words:
//
//   meta  [8]                    count (leaders in use), head, tail, 0...
//   live  [ring / 32]            bit q set iff log entry q is live
//   log   [ring]                 the recency log: slot indices in the order of their touches
//   slots [hash_cap * record]    open addressing with linear probing over the records themselves:
//           seq                  the log position of the leader's latest touch (its live entry)
//           state                0: the slot is empty; else 1 + the number of followers
//           tag                  the leader's hash (its home slot is tag & (hash_cap - 1))
//           key [leader_len]
//           row [max_followers * (follower_len + 2)]: follower tokens, then its int64 stamp
//
// Leader recency is an exact LRU kept as a log of touches instead of a linked list: a touch (an
// insert or a lookup of a known leader) clears the live bit of the leader's previous entry and
// appends a new entry at `tail`, writing only the leader's own record, the log's tail and two
// bits, where relinking a list node also writes its two neighbours' records (two more cache
// misses once a batch's tables outgrow the caches). Log positions are unique and increase with
// every touch, so they order the leaders exactly as the reference's OrderedDict does; the least
// recently used leader is the first live entry at or after `head`, found by scanning the bit
// words. When the log is full it is compacted in place (live entries move to the front in order,
// their records' seq is rewritten): at most max_leaders entries are live and the log holds
// 4 * max_leaders, so that happens at most once per 3 * max_leaders touches.
//
// The records live in the hash table itself, so a lookup costs one cache miss (the home slot's
// record: tag, key and row side by side; the next slots of a probe run follow in memory) instead
// of a bucket miss followed by a record miss. The table is at most half full
// (hash_cap >= 2 * max_leaders), so probe runs stay short.
//
// Invariants: count leaders are in use, each in exactly one slot on the probe run from its home
// slot (no empty slot in between), and with exactly one live log entry, at position seq in
// [head, tail), naming its slot; live bits are clear outside [head, tail); if count > 0 the entry
// at tail - 1 is live (the most recent leader). A full table evicts the least recently used
// leader before it adds one. Deletion shifts later records of the probe run back (no
// tombstones) and points the live log entry of every record it moves at its new slot. A row
// holds its followers physically ordered most recent first, with pairwise distinct token tuples
// and strictly decreasing stamps. Rows are at most 64 long, so keeping them ordered by shifting
// is cheaper than a second level of links.
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
  int hash_cap = 0;  // slots: a power of two >= 2 * max_leaders, so probe runs stay short
  int ring = 0;      // recency log entries: 4 * max_leaders rounded up to a multiple of 32
  int entry = 0;     // int32 words per follower: tokens + an int64 stamp
  int record = 0;    // int32 words per slot
  int64_t off_live = 0, off_log = 0, off_slots = 0;
  int64_t words = 0;  // int32 words per instance

  static constexpr int64_t kMeta = 8;

  static TableShape make(int leader_len, int follower_len, int max_leaders, int max_followers) {
    TableShape s;
    s.leader_len = leader_len;
    s.follower_len = follower_len;
    s.max_leaders = max_leaders;
    s.max_followers = max_followers;
    s.hash_cap = 2;
    while (s.hash_cap < 2 * max_leaders) s.hash_cap *= 2;
    s.ring = (4 * max_leaders + 31) / 32 * 32;
    s.entry = follower_len + 2;
    s.record = 3 + leader_len + max_followers * s.entry;
    s.off_live = kMeta;
    s.off_log = s.off_live + s.ring / 32;
    s.off_slots = s.off_log + s.ring;
    s.words = s.off_slots + static_cast<int64_t>(s.hash_cap) * s.record;
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
  // The least / most recently used leader's slot, or -1 for an empty table.
  int lru() const { return w_[0] > 0 ? log()[next_live(w_[1])] : -1; }
  int mru() const { return w_[0] > 0 ? log()[w_[2] - 1] : -1; }
  // The slot of the next more recently used leader, or -1 (walks the log; for introspection).
  int next(int leader) const {
    const int q = next_live(rec(leader)[kSeq] + 1);
    return q < w_[2] ? log()[q] : -1;
  }
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
    for (int64_t i = 0; i < s_->off_log; ++i) w_[i] = 0;  // meta and live bits
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
  // stage assumes the previous ones have landed: stage 0 pulls in the leader's home slot and the
  // table's meta words; every later stage s follows the probe run one slot further (slots home
  // .. home + s - 1 have landed; if none of them holds the leader's tag or ends the run, the
  // record at home + s is next: with the table up to half full, about half of the lookups of a
  // new leader and a third of those of a known one go past the home slot). Stage 1 also pulls in
  // the log and live words that a touch or an append writes (at the tail, and at the record's seq
  // for a leader found by tag) and, for a leader not found yet in a full table that the caller
  // will insert, those at the head; stage 2 the records of the 1st and 2nd least recent leaders
  // (the victims of an update's first two new leaders) and stage 3 the 3rd's. Hints only:
  // reading a stale slot or record is harmless. `insert` says whether the caller will insert
  // (else it only looks up and touches).
  void prefetch(uint32_t h, int stage, bool insert) const {
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    const int home = static_cast<int>(h & mask);
    if (stage == 0) {
      prefetch_record(home);
      __builtin_prefetch(w_, 1);
      return;
    }
    int found = -1;
    bool ended = false;
    uint32_t pos = static_cast<uint32_t>(home);
    for (int i = 0; i < stage; ++i, pos = (pos + 1) & mask) {
      const int32_t* r = rec(static_cast<int>(pos));
      if (r[kState] == 0) {
        ended = true;
        break;
      }
      if (static_cast<uint32_t>(r[kTag]) == h) {
        found = static_cast<int>(pos);
        break;
      }
    }
    if (found < 0 && !ended) prefetch_record(static_cast<int>(pos));
    const bool evicts = insert && found < 0 && w_[0] >= s_->max_leaders;
    if (stage == 1) {
      const int tail = w_[2];
      if (tail >= 0 && tail < s_->ring) {
        __builtin_prefetch(log() + tail, 1);
        __builtin_prefetch(live() + (tail >> 5), 1);
      }
      if (evicts) {
        const int head = w_[1];
        if (head >= 0 && head < s_->ring) {
          __builtin_prefetch(live() + (head >> 5));
          __builtin_prefetch(log() + head);
        }
      }
    }
    if (found >= 0) {
      const int q = rec(found)[kSeq];
      if (q >= 0 && q < s_->ring) __builtin_prefetch(live() + (q >> 5), 1);
      return;
    }
    if (!evicts || stage > 3) return;
    if (stage == 1) return;
    // Victim k (k = 0, 1, ...) is the k-th live log entry from the head.
    const int first = stage == 2 ? 0 : 2, last = stage == 2 ? 1 : 2;
    int q = next_live(w_[1]);
    for (int k = 0; k < first && q < w_[2]; ++k) q = next_live(q + 1);
    for (int k = first; k <= last && q < w_[2]; ++k, q = next_live(q + 1)) {
      const int victim = log()[q];
      if (victim < 0 || victim >= s_->hash_cap) return;
      prefetch_record(victim);
      __builtin_prefetch(rec((victim + 1) & (s_->hash_cap - 1)));
    }
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
    int32_t* r = rec(leader);
    const int q = r[kSeq];
    if (q == w_[2] - 1) return;  // already the most recent
    live()[q >> 5] &= ~(1u << (q & 31));
    append(leader, r);
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
      // The first live entry from the head is the least recent leader; nothing before it is
      // live, so the head moves past it.
      const int q = next_live(w_[1]);
      live()[q >> 5] &= ~(1u << (q & 31));
      w_[1] = q + 1;
      erase_slot(log()[q]);
    }
    const uint32_t mask = static_cast<uint32_t>(s_->hash_cap - 1);
    uint32_t pos = h & mask;
    while (rec(static_cast<int>(pos))[kState] != 0) pos = (pos + 1) & mask;
    const int idx = static_cast<int>(pos);
    int32_t* r = rec(idx);
    std::memcpy(r + kKey, leader, sizeof(int32_t) * s_->leader_len);
    r[kTag] = static_cast<int32_t>(h);
    r[kState] = 1;
    append(idx, r);
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
  enum : int { kSeq = 0, kState = 1, kTag = 2, kKey = 3 };

  int32_t* rec(int slot) const { return w_ + s_->off_slots + int64_t{slot} * s_->record; }
  int32_t* entry(int leader, int j) const {
    return rec(leader) + kKey + s_->leader_len + j * s_->entry;
  }
  uint32_t* live() const { return reinterpret_cast<uint32_t*>(w_ + s_->off_live); }
  int32_t* log() const { return w_ + s_->off_log; }

  // The first live log position >= q, or tail if there is none.
  int next_live(int q) const {
    const int tail = w_[2];
    const uint32_t* bits = live();
    while (q < tail) {
      const uint32_t word = bits[q >> 5] >> (q & 31);
      if (word != 0) return q + __builtin_ctz(word);  // live bits lie below tail
      q = (q | 31) + 1;
    }
    return tail;
  }

  // Logs a touch of the leader in `slot` (record r) at the tail; its previous entry, if any, is
  // already dead.
  void append(int slot, int32_t* r) {
    if (w_[2] == s_->ring) compact();
    const int t = w_[2]++;
    log()[t] = slot;
    live()[t >> 5] |= 1u << (t & 31);
    r[kSeq] = t;
  }

  // Moves the live entries to the front of the log, in order, and renumbers their records. At
  // most max_leaders of the 4 * max_leaders entries are live, so the log is at most a quarter
  // full afterwards. Entries only move down (out <= q), so none is overwritten before it is read.
  void compact() {
    uint32_t* bits = live();
    int32_t* lg = log();
    const int words = s_->ring >> 5;
    int out = 0;
    for (int i = w_[1] >> 5; i < words; ++i) {
      for (uint32_t word = bits[i]; word != 0; word &= word - 1) {
        const int q = (i << 5) + __builtin_ctz(word);
        const int slot = lg[q];
        lg[out] = slot;
        rec(slot)[kSeq] = out++;
      }
    }
    for (int i = 0; i < words; ++i) {
      const int lo = i << 5;
      bits[i] = out >= lo + 32 ? ~0u : out > lo ? (1u << (out - lo)) - 1 : 0u;
    }
    w_[1] = 0;
    w_[2] = out;
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

  // Empties a slot whose leader's log entry is already dead. Backward-shift deletion: later
  // records of the probe run move up into the hole unless their home slot lies cyclically after
  // the hole, so lookups never need tombstones; a moved record's live log entry is pointed at its
  // new slot.
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
        log()[rh[kSeq]] = static_cast<int32_t>(hole);
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
