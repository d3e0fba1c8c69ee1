// Bindings for tree-masked attention and KV compaction: tree_attention and compact_kv.
#include <cstdint>
#include <string>

#include "array.h"
#include "dispatch.h"
#include "registry.h"
#include "specdecode/attention.h"
#include "specdecode/attention_ops.h"
#include "specdecode/host_device.h"

#ifdef SPECDECODE_WITH_CUDA
#include "attention.cuh"
#endif

namespace sd {
namespace {

AttnDType attn_dtype(const Array& a) {
  switch (a.dtype()) {
    case DType::kFloat16:
      return AttnDType::kFloat16;
    case DType::kBFloat16:
      return AttnDType::kBFloat16;
    default:
      return AttnDType::kFloat32;
  }
}

void check_nonnegative_strides(const Array& a) {
  // Offsets are computed as sums of index * stride; a negative stride would step before data.
  for (int d = 0; d < a.ndim(); ++d) {
    if (a.stride(d) < 0) {
      throw_value_error(std::string(a.name()) + ": negative strides are not supported");
    }
  }
}

// k_cache / v_cache [B, S, Hkv, D]: float dtype, last dim contiguous, same strides for both.
void check_caches(const Array& k, const Array& v, int64_t batch) {
  k.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16}).expect_ndim(4);
  k.expect_shape({batch, -1, -1, -1}, {"B", "S", "Hkv", "D"}).expect_inner_contiguous();
  v.expect_same_dtype(k).expect_same_device(k).expect_inner_contiguous();
  if (v.shape() != k.shape()) {
    throw_value_error("v_cache: expected the shape of k_cache " + k.shape_str() + ", got " +
                      v.shape_str());
  }
  for (int d = 0; d < 3; ++d) {
    if (k.stride(d) != v.stride(d)) {
      throw_value_error(
          "v_cache: must have the same strides as k_cache (views of buffers of one layout)");
    }
  }
  check_nonnegative_strides(k);
}

void tree_attention(py::handle q_obj, py::handle k_obj, py::handle v_obj,
                    py::handle prefix_lens_obj, py::handle mask_obj, py::handle out_obj,
                    py::handle lse_obj, py::handle status_obj, double scale, py::handle part_o_obj,
                    py::handle part_lse_obj, std::intptr_t stream) {
  Array q = Array::from_python(q_obj, "q");
  q.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16}).expect_ndim(4);
  q.expect_inner_contiguous();
  check_nonnegative_strides(q);
  const int64_t batch = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3);
  if (t < 1 || t > kMaxTreeNodes) {
    throw_value_error("q: T (dim 1) must be 1 to " + std::to_string(kMaxTreeNodes) + ", got " +
                      std::to_string(t));
  }
  if (!attention_head_dim_supported(d)) {
    throw_value_error("q: head dim D must be 32, 64, 80, 96, 128 or 256, got " + std::to_string(d));
  }
  Array k = Array::from_python(k_obj, "k_cache");
  Array v = Array::from_python(v_obj, "v_cache");
  k.expect_same_device(q);
  k.expect_same_dtype(q);
  check_caches(k, v, batch);
  const int64_t s = k.size(1), hkv = k.size(2);
  if (k.size(3) != d) {
    throw_value_error("k_cache: head dim " + std::to_string(k.size(3)) + " != q's " +
                      std::to_string(d));
  }
  if (hkv < 1 || hq < 1 || hq % hkv != 0) {
    throw_value_error("q: the number of query heads (" + std::to_string(hq) +
                      ") must be a positive multiple of the KV heads (" + std::to_string(hkv) +
                      ")");
  }
  if (s < t) {
    throw_value_error("k_cache: S = " + std::to_string(s) +
                      " cannot hold the T = " + std::to_string(t) + " tree nodes");
  }
  Array prefix_lens = Array::from_python(prefix_lens_obj, "prefix_lens");
  prefix_lens.expect_dtype({DType::kInt32}).expect_shape({batch}, {"B"}).expect_contiguous();
  prefix_lens.expect_same_device(q);
  std::optional<Array> mask = optional_array(mask_obj, "tree_mask");
  if (mask) {
    // The shape before the layout: a slice of the wrong rows is reported as the wrong shape.
    mask->expect_dtype({DType::kUInt32});
    mask->expect_shape({batch, t, mask_words(static_cast<int>(t))}, {"B", "T", "ceil(T/32)"});
    mask->expect_contiguous().expect_same_device(q);
  }
  Array out = Array::from_python(out_obj, "out", true);
  out.expect_same_dtype(q)
      .expect_shape({batch, t, hq, d})
      .expect_contiguous()
      .expect_same_device(q);
  std::optional<Array> lse = optional_array(lse_obj, "lse", true);
  if (lse) {
    lse->expect_dtype({DType::kFloat32}).expect_shape({batch, t, hq}).expect_contiguous();
    lse->expect_same_device(q);
  }
  Array status = Array::from_python(status_obj, "status", true);
  status.expect_dtype({DType::kInt32}).expect_shape({batch}).expect_contiguous();
  status.expect_same_device(q);
  std::optional<Array> part_o = optional_array(part_o_obj, "part_o", true);
  std::optional<Array> part_lse = optional_array(part_lse_obj, "part_lse", true);

  AttentionArgs args;
  args.q = q.raw();
  args.k = k.raw();
  args.v = v.raw();
  args.prefix_lens = prefix_lens.data<int32_t>();
  args.mask = mask ? mask->data<uint32_t>() : nullptr;
  args.out = out.raw();
  args.lse = lse ? lse->data<float>() : nullptr;
  args.status = status.data<int32_t>();
  args.dtype = attn_dtype(q);
  args.batch = batch;
  args.tree_len = t;
  args.cache_len = s;
  args.q_heads = hq;
  args.kv_heads = hkv;
  args.head_dim = d;
  for (int i = 0; i < 3; ++i) {
    args.q_strides[i] = q.stride(i);
    args.kv_strides[i] = k.stride(i);
  }
  args.scale = static_cast<float>(scale);

  const DeviceScope device_scope = prepare_device(q);
  const bool on_cuda = device_scope.on_cuda();
  if (!on_cuda) {
    py::gil_scoped_release nogil;
    cpu::tree_attention(args);
    return;
  }
#ifdef SPECDECODE_WITH_CUDA
  // The splits' partial results live in caller-allocated workspace: [splits, B, T, Hq, D] fp32
  // and [splits, B, T, Hq] fp32 (native code allocates nothing on the GPU).
  if (!part_o || !part_lse) throw_value_error("part_o/part_lse: required on CUDA");
  part_o->expect_dtype({DType::kFloat32}).expect_ndim(5).expect_contiguous().expect_same_device(q);
  const int64_t splits = part_o->size(0);
  part_o->expect_shape({splits, batch, t, hq, d});
  part_lse->expect_dtype({DType::kFloat32}).expect_contiguous().expect_same_device(q);
  part_lse->expect_shape({splits, batch, t, hq});
  if (splits < 1) throw_value_error("part_o: at least one split");
  py::gil_scoped_release nogil;
  check_cuda(cuda::tree_attention(args, static_cast<int>(splits), part_o->data<float>(),
                                  part_lse->data<float>(), as_stream(stream)),
             "tree_attention");
#endif
}

void compact_kv(py::handle k_obj, py::handle v_obj, py::handle prefix_lens_obj, py::handle path_obj,
                py::handle num_accepted_obj, py::handle new_lens_obj, py::handle status_obj,
                std::intptr_t stream) {
  Array k = Array::from_python(k_obj, "k_cache", true);
  Array v = Array::from_python(v_obj, "v_cache", true);
  k.expect_ndim(4);
  const int64_t batch = k.size(0);
  check_caches(k, v, batch);
  Array prefix_lens = Array::from_python(prefix_lens_obj, "prefix_lens");
  prefix_lens.expect_dtype({DType::kInt32}).expect_shape({batch}, {"B"}).expect_contiguous();
  prefix_lens.expect_same_device(k);
  Array path = Array::from_python(path_obj, "path");
  path.expect_dtype({DType::kInt32}).expect_ndim(2).expect_contiguous().expect_same_device(k);
  path.expect_shape({batch, -1}, {"B", "L"});
  if (path.size(1) > kMaxTreeNodes) {
    throw_value_error("path: at most " + std::to_string(kMaxTreeNodes) + " nodes per row, got " +
                      path.shape_str());
  }
  Array num_accepted = Array::from_python(num_accepted_obj, "num_accepted");
  num_accepted.expect_dtype({DType::kInt32}).expect_shape({batch}, {"B"}).expect_contiguous();
  num_accepted.expect_same_device(k);
  Array new_lens = Array::from_python(new_lens_obj, "new_lens", true);
  new_lens.expect_dtype({DType::kInt32}).expect_shape({batch}).expect_contiguous();
  new_lens.expect_same_device(k);
  Array status = Array::from_python(status_obj, "status", true);
  status.expect_dtype({DType::kInt32}).expect_shape({batch, 2}).expect_contiguous();
  status.expect_same_device(k);

  const int64_t strides[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int path_len = static_cast<int>(path.size(1));
  const DeviceScope device_scope = prepare_device(k);
  const bool on_cuda = device_scope.on_cuda();
  py::gil_scoped_release nogil;
  if (!on_cuda) {
    cpu::compact_kv(k.raw(), v.raw(), dtype_size(k.dtype()), strides, batch, k.size(1), k.size(2),
                    k.size(3), prefix_lens.data<int32_t>(), path.data<int32_t>(), path_len,
                    num_accepted.data<int32_t>(), new_lens.data<int32_t>(), status.data<int32_t>());
    return;
  }
#ifdef SPECDECODE_WITH_CUDA
  check_cuda(cuda::compact_kv(k.raw(), v.raw(), dtype_size(k.dtype()), strides, batch, k.size(1),
                              k.size(2), k.size(3), prefix_lens.data<int32_t>(),
                              path.data<int32_t>(), path_len, num_accepted.data<int32_t>(),
                              new_lens.data<int32_t>(), status.data<int32_t>(), as_stream(stream)),
             "compact_kv");
#endif
}

}  // namespace

void register_attention_ops(py::module_& m) {
  m.def("tree_attention", &tree_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("prefix_lens"), py::arg("tree_mask"), py::arg("out"), py::arg("lse"),
        py::arg("status"), py::arg("scale"), py::arg("part_o") = py::none(),
        py::arg("part_lse") = py::none(), py::arg("stream") = 0,
        "Tree-masked attention over a KV cache; fills out (and lse) in place.");
  m.def("compact_kv", &compact_kv, py::arg("k_cache"), py::arg("v_cache"), py::arg("prefix_lens"),
        py::arg("path"), py::arg("num_accepted"), py::arg("new_lens"), py::arg("status"),
        py::arg("stream") = 0, "Moves the accepted path's K/V rows in place; fills new_lens.");
#ifdef SPECDECODE_WITH_CUDA
  m.def(
      "tree_attention_block_rows",
      [](int64_t batch, int64_t kv_heads, int64_t rows, int head_dim, bool float32, int device) {
        const auto at_least_one = [](int64_t value, const char* name) {
          if (value < 1) {
            throw_value_error(std::string(name) + ": expected at least 1, got " +
                              std::to_string(value));
          }
        };
        at_least_one(batch, "batch");
        at_least_one(kv_heads, "kv_heads");
        at_least_one(rows, "rows");
        at_least_one(head_dim, "head_dim");
        return cuda::tree_attention_block_rows(batch, kv_heads, rows, head_dim,
                                               float32 ? AttnDType::kFloat32 : AttnDType::kBFloat16,
                                               device);
      },
      py::arg("batch"), py::arg("kv_heads"), py::arg("rows"), py::arg("head_dim"),
      py::arg("float32"), py::arg("device"),
      "Query rows per thread block of the CUDA tree_attention on a device for a launch of B "
      "sequences, Hkv KV heads and `rows` rows per KV head (the unit of its split count).");
#endif
  m.def("attention_isa", &cpu::attention_isa, "The CPU code path of tree_attention.");
  m.def(
      "set_attention_isa",
      [](const std::string& name) { return cpu::set_attention_isa(name.c_str()); }, py::arg("name"),
      "Forces a CPU code path (testing); '' restores the best available.");
}

}  // namespace sd
