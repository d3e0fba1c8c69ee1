// specdecode._C: the native module. Functions here take DLPack arrays for inputs and
// preallocated outputs, validate everything, release the GIL and dispatch to src/ (CPU) or
// cuda/ (GPU). The public, documented API is python/specdecode/ops.py.
#include <pybind11/pybind11.h>

#include "registry.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "specdecode native kernels (internal; use specdecode.ops)";
  sd::register_info(m);
  sd::register_tree_ops(m);
  sd::register_ngram_ops(m);
  sd::register_attention_ops(m);
  sd::register_verify_ops(m);
  sd::register_verify_math_ops(m);
  sd::register_host_device_ops(m);
}
