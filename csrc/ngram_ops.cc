// Bindings for the Cacheback n-gram cache: a pybind11 class around sd::cpu::NGramCache.
// The cache is host state consulted every step, so every array must be in CPU memory.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "array.h"
#include "registry.h"
#include "specdecode/host_device.h"
#include "specdecode/ngram_ops.h"

namespace sd {
namespace {

using cpu::NGramCache;
using Cache = std::shared_ptr<NGramCache>;

void expect_host(const Array& a) {
  if (a.device().kind != DeviceKind::kCPU) {
    throw_value_error(std::string(a.name()) + ": is on " + a.device().str() +
                      ", but the n-gram cache lives on the host (it runs on the CPU every step); "
                      "pass CPU arrays, e.g. tensor.cpu()");
  }
}

// slots int32 [B], host, in [0, max_sequences) and pairwise distinct (two rows of one call on
// the same slot would race). Returns B.
int64_t check_slots(const NGramCache& cache, const Array& slots) {
  expect_host(slots);
  slots.expect_dtype({DType::kInt32}).expect_ndim(1).expect_contiguous();
  const int64_t batch = slots.size(0);
  const int32_t* s = slots.data<int32_t>();
  const int limit = cache.config().max_sequences;
  std::vector<uint8_t> seen(limit, 0);
  for (int64_t b = 0; b < batch; ++b) {
    if (s[b] < 0 || s[b] >= limit) {
      throw_value_error("slots: slot " + std::to_string(s[b]) + " (batch row " + std::to_string(b) +
                        ") is out of range [0, " + std::to_string(limit) +
                        "); raise max_sequences");
    }
    if (seen[s[b]]) {
      throw_value_error("slots: slot " + std::to_string(s[b]) +
                        " appears twice in one call; each sequence has its own slot");
    }
    seen[s[b]] = 1;
  }
  return batch;
}

void expect_not_frozen(const NGramCache& cache, const char* what) {
  if (cache.frozen()) {
    throw_value_error(std::string(what) +
                      ": this n-gram cache is frozen (a static table); it is never modified");
  }
}

void check_tokens_nonnegative(const int32_t* p, int64_t n, const char* name, int64_t base) {
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] < 0) {
      throw_value_error(std::string(name) + ": token ids must be >= 0, got " +
                        std::to_string(p[i]) + " at index " + std::to_string(base + i));
    }
  }
}

void update(NGramCache& cache, py::handle slots_obj, py::handle tokens_obj,
            py::handle offsets_obj) {
  expect_not_frozen(cache, "update");
  Array slots = Array::from_python(slots_obj, "slots");
  const int64_t batch = check_slots(cache, slots);
  Array tokens = Array::from_python(tokens_obj, "tokens");
  expect_host(tokens);
  tokens.expect_dtype({DType::kInt32}).expect_ndim(1).expect_contiguous();
  Array offsets = Array::from_python(offsets_obj, "offsets");
  expect_host(offsets);
  offsets.expect_dtype({DType::kInt32}).expect_shape({batch + 1}, {"B+1"}).expect_contiguous();
  const int32_t* off = offsets.data<int32_t>();
  const int64_t total = tokens.size(0);
  if (off[0] != 0) throw_value_error("offsets: must start at 0, got " + std::to_string(off[0]));
  for (int64_t b = 0; b < batch; ++b) {
    if (off[b + 1] < off[b]) {
      throw_value_error("offsets: must be non-decreasing, but offsets[" + std::to_string(b + 1) +
                        "] = " + std::to_string(off[b + 1]) + " < offsets[" + std::to_string(b) +
                        "] = " + std::to_string(off[b]));
    }
  }
  if (off[batch] != total) {
    throw_value_error("offsets: the last offset must equal len(tokens) = " + std::to_string(total) +
                      ", got " + std::to_string(off[batch]));
  }
  check_tokens_nonnegative(tokens.data<int32_t>(), total, "tokens", 0);
  py::gil_scoped_release nogil;
  cache.update(slots.data<int32_t>(), batch, tokens.data<int32_t>(), off);
}

void draft(NGramCache& cache, py::handle slots_obj, py::handle contexts_obj,
           py::handle context_lens_obj, int max_nodes, int max_depth, bool chain,
           py::handle out_tokens_obj, py::handle out_parents_obj, py::handle out_num_nodes_obj) {
  Array slots = Array::from_python(slots_obj, "slots");
  const int64_t batch = check_slots(cache, slots);
  Array contexts = Array::from_python(contexts_obj, "contexts");
  expect_host(contexts);
  contexts.expect_dtype({DType::kInt32}).expect_ndim(2).expect_inner_contiguous();
  contexts.expect_shape({batch, -1}, {"B", "C"});
  const int64_t width = contexts.size(1);
  if (width < 1) throw_value_error("contexts: needs at least one column (the last token)");
  Array lens = Array::from_python(context_lens_obj, "context_lens");
  expect_host(lens);
  lens.expect_dtype({DType::kInt32}).expect_shape({batch}, {"B"}).expect_contiguous();
  if (max_nodes < 1 || max_nodes > kMaxTreeNodes) {
    throw_value_error("max_nodes: expected 1 to " + std::to_string(kMaxTreeNodes) + ", got " +
                      std::to_string(max_nodes));
  }
  if (max_depth < 0) {
    throw_value_error("max_depth: expected >= 0, got " + std::to_string(max_depth));
  }
  const int64_t stride = batch > 1 ? contexts.stride(0) : width;
  const int32_t* len = lens.data<int32_t>();
  const int32_t* ctx = contexts.data<int32_t>();
  int read = cache.max_leader_len();
  if (cache.static_cache()) read = std::max(read, cache.static_cache()->max_leader_len());
  for (int64_t b = 0; b < batch; ++b) {
    if (len[b] < 1 || len[b] > width) {
      throw_value_error("context_lens: context_lens[" + std::to_string(b) +
                        "] = " + std::to_string(len[b]) +
                        " is out of range [1, C = " + std::to_string(width) + "]");
    }
    // Drafting reads only the last `read` tokens of a context (the longest leader).
    const int64_t from = std::max<int64_t>(0, len[b] - read);
    check_tokens_nonnegative(ctx + b * stride + from, len[b] - from, "contexts", from);
  }
  Array out_tokens = Array::from_python(out_tokens_obj, "tokens", true);
  Array out_parents = Array::from_python(out_parents_obj, "parents", true);
  Array out_num = Array::from_python(out_num_nodes_obj, "num_nodes", true);
  for (const Array* a : {&out_tokens, &out_parents}) {
    expect_host(*a);
    a->expect_dtype({DType::kInt32}).expect_shape({batch, max_nodes}).expect_contiguous();
  }
  expect_host(out_num);
  out_num.expect_dtype({DType::kInt32}).expect_shape({batch}).expect_contiguous();

  py::gil_scoped_release nogil;
  cache.draft(slots.data<int32_t>(), batch, ctx, stride, len, max_nodes, max_depth, chain,
              out_tokens.data<int32_t>(), out_parents.data<int32_t>(), out_num.data<int32_t>());
}

void reset(NGramCache& cache, py::handle slots_obj, bool end_stream_only) {
  expect_not_frozen(cache, "reset");
  Array slots = Array::from_python(slots_obj, "slots");
  const int64_t batch = check_slots(cache, slots);
  py::gil_scoped_release nogil;
  if (end_stream_only)
    cache.end_streams(slots.data<int32_t>(), batch);
  else
    cache.reset(slots.data<int32_t>(), batch);
}

py::tuple tokens_tuple(const int32_t* p, int n) {
  py::tuple t(n);
  for (int i = 0; i < n; ++i) t[i] = py::int_(p[i]);
  return t;
}

// [(leader, [(follower, stamp), ...most recent first]), ...least recent leader first]
py::list table_state(const NGramCache& cache, int state, int table) {
  if (state < 0 || state >= cache.num_states()) {
    throw py::index_error("state: expected 0 to " + std::to_string(cache.num_states() - 1));
  }
  if (table < 0 || table >= cache.num_tables()) {
    throw py::index_error("table: expected 0 to " + std::to_string(cache.num_tables() - 1));
  }
  const ngram::Table tab = cache.table(state, table);
  const auto& s = tab.shape();
  py::list out;
  for (int i = tab.lru(); i >= 0; i = tab.next(i)) {
    py::list row;
    for (int j = 0; j < tab.num_followers(i); ++j) {
      row.append(py::make_tuple(tokens_tuple(tab.follower(i, j), s.follower_len),
                                py::int_(tab.stamp(i, j))));
    }
    out.append(py::make_tuple(tokens_tuple(tab.key(i), s.leader_len), row));
  }
  return out;
}

Cache make_cache(const std::vector<std::pair<int, int>>& tables, int max_leaders, int max_followers,
                 bool touch_on_read, int max_sequences, bool shared) {
  cpu::NGramConfig c;
  c.tables = tables;
  c.max_leaders = max_leaders;
  c.max_followers = max_followers;
  c.touch_on_read = touch_on_read;
  c.max_sequences = max_sequences;
  c.shared = shared;
  return std::make_shared<NGramCache>(c);  // std::invalid_argument -> ValueError
}

}  // namespace

void register_ngram_ops(py::module_& m) {
  py::class_<NGramCache, Cache>(m, "NGramCache")
      .def(py::init(&make_cache), py::arg("tables"), py::arg("max_leaders"),
           py::arg("max_followers"), py::arg("touch_on_read"), py::arg("max_sequences"),
           py::arg("shared"))
      .def("update", &update, py::arg("slots"), py::arg("tokens"), py::arg("offsets"))
      .def("draft", &draft, py::arg("slots"), py::arg("contexts"), py::arg("context_lens"),
           py::arg("max_nodes"), py::arg("max_depth"), py::arg("chain"), py::arg("out_tokens"),
           py::arg("out_parents"), py::arg("out_num_nodes"))
      .def("reset", &reset, py::arg("slots"), py::arg("end_stream_only") = false)
      .def("clear",
           [](NGramCache& c) {
             expect_not_frozen(c, "clear");
             c.clear();
           })
      .def("freeze", &NGramCache::freeze)
      .def_property_readonly("frozen", &NGramCache::frozen)
      .def_property_readonly("shared", [](const NGramCache& c) { return c.config().shared; })
      .def_property_readonly("nbytes", &NGramCache::nbytes)
      .def_property_readonly("config",
                             [](const NGramCache& c) {
                               const auto& k = c.config();
                               py::dict d;
                               d["tables"] = py::tuple(py::cast(k.tables));
                               d["max_leaders"] = k.max_leaders;
                               d["max_followers"] = k.max_followers;
                               d["touch_on_read"] = k.touch_on_read;
                               d["max_sequences"] = k.max_sequences;
                               d["shared"] = k.shared;
                               return d;
                             })
      .def_property_readonly("max_leader_len", &NGramCache::max_leader_len)
      .def(
          "set_static",
          [](NGramCache& c, const Cache& stat) {
            if (stat) {
              if (stat.get() == &c) throw_value_error("static: a cache cannot be its own static");
              if (!stat->frozen() || !stat->config().shared) {
                throw_value_error(
                    "static: must be a frozen, shared cache (NGramCache.build(...) or "
                    "cache.freeze() on a shared=True cache)");
              }
            }
            c.set_static(stat);
          },
          py::arg("static").none(true))
      .def("to_bytes",
           [](const NGramCache& c) {
             std::string s;
             {
               py::gil_scoped_release nogil;
               s = c.serialize();
             }
             return py::bytes(s);
           })
      .def_static("from_bytes",
                  [](py::bytes data) {
                    std::string s = data;
                    py::gil_scoped_release nogil;
                    return Cache(NGramCache::deserialize(s.data(), s.size()));
                  })
      .def("table_state", &table_state, py::arg("state"), py::arg("table"))
      .def("tail",
           [](const NGramCache& c, int slot) {
             if (slot < 0 || slot >= c.config().max_sequences) throw py::index_error("slot");
             return c.tail(slot);
           })
      .def("clock", [](const NGramCache& c, int state) {
        if (state < 0 || state >= c.num_states()) throw py::index_error("state");
        return c.clock(state);
      });
}

}  // namespace sd
