// Each op family registers its bindings from its own file; module.cc calls them all.
#pragma once

#include <pybind11/pybind11.h>

namespace sd {
void register_info(pybind11::module_& m);
void register_tree_ops(pybind11::module_& m);
void register_ngram_ops(pybind11::module_& m);
void register_attention_ops(pybind11::module_& m);
void register_verify_ops(pybind11::module_& m);
void register_verify_math_ops(pybind11::module_& m);
void register_host_device_ops(pybind11::module_& m);
}  // namespace sd
