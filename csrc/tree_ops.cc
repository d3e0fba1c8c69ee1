// Bindings for the tree utilities: tree_info and tree_paths.
#include <cstdint>
#include <string>

#include "array.h"
#include "dispatch.h"
#include "registry.h"
#include "specdecode/host_device.h"
#include "specdecode/tree_ops.h"

#ifdef SPECDECODE_WITH_CUDA
#include "tree.cuh"
#endif

namespace sd {
namespace {

// parents int32 [B, N] with 1 <= N <= kMaxTreeNodes, contiguous. Returns (B, N).
std::pair<int64_t, int> check_parents(const Array& parents) {
  parents.expect_dtype({DType::kInt32}).expect_ndim(2).expect_contiguous();
  const int64_t n = parents.size(1);
  if (n < 1 || n > kMaxTreeNodes) {
    throw_value_error("parents: a tree has 1 to " + std::to_string(kMaxTreeNodes) +
                      " nodes, got N = " + std::to_string(n));
  }
  return {parents.size(0), static_cast<int>(n)};
}

void check_output(const Array& out, const Array& like, DType dtype,
                  std::initializer_list<int64_t> shape) {
  out.expect_dtype({dtype}).expect_shape(shape).expect_contiguous().expect_same_device(like);
}

void tree_info(py::handle parents_obj, py::handle depth_obj, py::handle mask_obj,
               py::handle num_nodes_obj, py::handle status_obj, std::intptr_t stream) {
  Array parents = Array::from_python(parents_obj, "parents");
  const auto [batch, n] = check_parents(parents);
  const DeviceScope device_scope = prepare_device(parents);
  const bool on_cuda = device_scope.on_cuda();
  const int words = mask_words(n);
  Array depth = Array::from_python(depth_obj, "depth", true);
  check_output(depth, parents, DType::kInt32, {batch, n});
  std::optional<Array> mask = optional_array(mask_obj, "mask", true);
  if (mask) check_output(*mask, parents, DType::kUInt32, {batch, n, words});
  Array num_nodes = Array::from_python(num_nodes_obj, "num_nodes", true);
  check_output(num_nodes, parents, DType::kInt32, {batch});
  Array status = Array::from_python(status_obj, "status", true);
  check_output(status, parents, DType::kInt32, {batch, 2});

  uint32_t* mask_ptr = mask ? mask->data<uint32_t>() : nullptr;
  py::gil_scoped_release nogil;
  if (!on_cuda) {
    cpu::tree_info(parents.data<int32_t>(), batch, n, depth.data<int32_t>(), mask_ptr,
                   num_nodes.data<int32_t>(), status.data<int32_t>());
    return;
  }
#ifdef SPECDECODE_WITH_CUDA
  check_cuda(cuda::tree_info(parents.data<int32_t>(), batch, n, depth.data<int32_t>(), mask_ptr,
                             num_nodes.data<int32_t>(), status.data<int32_t>(), as_stream(stream)),
             "tree_info");
#endif
}

void tree_paths(py::handle parents_obj, py::handle depth_obj, py::handle num_nodes_obj,
                py::handle paths_obj, py::handle num_paths_obj, py::handle status_obj,
                std::intptr_t stream) {
  Array parents = Array::from_python(parents_obj, "parents");
  const auto [batch, n] = check_parents(parents);
  const DeviceScope device_scope = prepare_device(parents);
  const bool on_cuda = device_scope.on_cuda();
  Array depth = Array::from_python(depth_obj, "depth");
  check_output(depth, parents, DType::kInt32, {batch, n});
  Array num_nodes = Array::from_python(num_nodes_obj, "num_nodes");
  check_output(num_nodes, parents, DType::kInt32, {batch});
  std::optional<Array> paths = optional_array(paths_obj, "paths", true);
  int max_paths = 0, path_len = 0;
  if (paths) {
    paths->expect_dtype({DType::kInt32})
        .expect_ndim(3)
        .expect_contiguous()
        .expect_same_device(parents);
    paths->expect_shape({batch, -1, -1}, {"B", "L", "D+1"});
    if (paths->size(1) > kMaxTreeNodes || paths->size(2) > kMaxTreeNodes) {
      throw_value_error("paths: at most " + std::to_string(kMaxTreeNodes) +
                        " paths of at most that many nodes, got " + paths->shape_str());
    }
    max_paths = static_cast<int>(paths->size(1));
    path_len = static_cast<int>(paths->size(2));
  }
  Array num_paths = Array::from_python(num_paths_obj, "num_paths", true);
  check_output(num_paths, parents, DType::kInt32, {batch});
  Array status = Array::from_python(status_obj, "status", true);
  check_output(status, parents, DType::kInt32, {batch});

  int32_t* paths_ptr = paths ? paths->data<int32_t>() : nullptr;
  py::gil_scoped_release nogil;
  if (!on_cuda) {
    cpu::tree_paths(parents.data<int32_t>(), depth.data<int32_t>(), num_nodes.data<int32_t>(),
                    batch, n, max_paths, path_len, paths_ptr, num_paths.data<int32_t>(),
                    status.data<int32_t>());
    return;
  }
#ifdef SPECDECODE_WITH_CUDA
  check_cuda(cuda::tree_paths(parents.data<int32_t>(), depth.data<int32_t>(),
                              num_nodes.data<int32_t>(), batch, n, max_paths, path_len, paths_ptr,
                              num_paths.data<int32_t>(), status.data<int32_t>(), as_stream(stream)),
             "tree_paths");
#endif
}

}  // namespace

void register_tree_ops(py::module_& m) {
  m.def("tree_info", &tree_info, py::arg("parents"), py::arg("depth"), py::arg("mask"),
        py::arg("num_nodes"), py::arg("status"), py::arg("stream") = 0,
        "Validates trees and fills depth, ancestor mask (optional) and node counts in place.");
  m.def("tree_paths", &tree_paths, py::arg("parents"), py::arg("depth"), py::arg("num_nodes"),
        py::arg("paths"), py::arg("num_paths"), py::arg("status"), py::arg("stream") = 0,
        "Counts leaves and, when paths is given, fills the root-to-leaf paths in place.");
}

}  // namespace sd
