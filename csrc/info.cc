#include <pybind11/stl.h>

#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "array.h"
#include "registry.h"
#include "specdecode/attention_ops.h"
#include "specdecode/parallel.h"
#include "specdecode/verify_ops.h"

#ifdef SPECDECODE_WITH_CUDA
#include "runtime.cuh"
#endif

#ifndef SPECDECODE_VERSION
#define SPECDECODE_VERSION "0.0.0+unknown"
#endif

namespace sd {
namespace py = pybind11;

namespace {

const char* threading_name(Threading mode) {
  switch (mode) {
    case Threading::kPool:
      return "pool";
    case Threading::kOpenMp:
      return "openmp";
    default:
      return "auto";
  }
}

py::dict threading_info() {
  const ThreadingBackend backend = threading_backend();
  py::dict d;
  d["mode"] = threading_name(threading());
  d["backend"] = backend.name;
  d["runtime"] = backend.runtime;
  return d;
}

void set_threading_mode(const std::string& mode) {
  for (Threading m : {Threading::kAuto, Threading::kPool, Threading::kOpenMp}) {
    if (mode == threading_name(m)) {
      set_threading(m);
      return;
    }
  }
  throw py::value_error("threading: expected 'auto', 'pool' or 'openmp', got '" + mode + "'");
}

// Runs `chunks` one-element chunks through parallel_for; each chunk waits (at most 2 s) until
// `expect` distinct threads have entered one, so the count shows whether the threads really ran
// side by side. Chunk `fail_chunk` throws. Returns the distinct threads seen.
int parallel_probe(int64_t chunks, int expect, int64_t fail_chunk) {
  std::mutex mu;
  std::set<std::thread::id> seen;
  {
    py::gil_scoped_release release;
    parallel_for(chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        {
          std::lock_guard<std::mutex> lock(mu);
          seen.insert(std::this_thread::get_id());
        }
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
        for (;;) {
          {
            std::lock_guard<std::mutex> lock(mu);
            if (static_cast<int>(seen.size()) >= expect) break;
          }
          if (std::chrono::steady_clock::now() > deadline) break;
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        if (c == fail_chunk) throw std::runtime_error("parallel probe: chunk " + std::to_string(c));
      }
    });
  }
  return static_cast<int>(seen.size());
}

py::dict build_info() {
  py::dict info;
  info["version"] = SPECDECODE_VERSION;
  py::list backends;
  backends.append("cpu");
  py::dict cuda;
#ifdef SPECDECODE_WITH_CUDA
  backends.append("cuda");
  const cuda::RuntimeInfo rt = cuda::query_runtime();
  cuda["compiled"] = true;
  cuda["runtime_version"] = rt.runtime_version;
  cuda["driver_version"] = rt.driver_version;
  py::list devices;
  for (const auto& d : rt.devices) {
    py::dict dev;
    dev["index"] = d.index;
    dev["name"] = d.name;
    dev["capability"] = py::make_tuple(d.major, d.minor);
    dev["total_memory"] = d.total_memory;
    devices.append(dev);
  }
  cuda["devices"] = devices;
  cuda["error"] = rt.error;
#else
  cuda["compiled"] = false;
  cuda["runtime_version"] = 0;
  cuda["driver_version"] = 0;
  cuda["devices"] = py::list();
  cuda["error"] = "built without CUDA";
#endif
  info["backends"] = backends;
  info["cuda"] = cuda;
  info["num_threads"] = num_threads();
  info["threading"] = threading_info();
  // The CPU code paths the kernels take here (vector kernels exist on x86-64 only; elsewhere
  // both report their portable paths).
  py::dict cpu_kernels;
  cpu_kernels["tree_attention"] = cpu::attention_isa();
  cpu_kernels["verify"] = cpu::verify_isa();
  info["cpu_kernels"] = cpu_kernels;
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
  return info;
}

// What the DLPack consumer sees of an array: lets tests check the boundary for every dtype and
// device without an op that takes that dtype.
py::dict describe_array(py::handle obj, bool writable) {
  Array a = Array::from_python(obj, "array", writable);
  py::dict d;
  d["dtype"] = dtype_name(a.dtype());
  d["device"] = a.device().str();
  d["shape"] = py::cast(a.shape());
  d["strides"] = py::cast(a.strides());
  d["contiguous"] = a.is_contiguous();
  d["data"] = reinterpret_cast<std::uintptr_t>(a.raw());
  return d;
}

}  // namespace

void register_info(py::module_& m) {
  m.def("build_info", &build_info, "Version, backends, CUDA runtime and devices, threads.");
  m.def("num_threads", &num_threads, "Threads the CPU kernels use.");
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 0) throw py::value_error("num_threads: must be >= 0 (0 restores the default)");
        set_num_threads(n);
      },
      py::arg("n"), "Sets the threads the CPU kernels use (0 restores the default).");
  m.def("threading", &threading_info,
        "The threading mode ('auto', 'pool', 'openmp'), the backend the next parallel op runs on "
        "('openmp' or 'pool') and the OpenMP runtime's path.");
  m.def("set_threading", &set_threading_mode, py::arg("mode"),
        "Sets the threading mode: 'auto', 'pool' or 'openmp'.");
  m.def("_parallel_probe", &parallel_probe, py::arg("chunks"), py::arg("expect"),
        py::arg("fail_chunk") = -1,
        "Internal: distinct threads that ran `chunks` chunks of a parallel_for side by side.");
  m.def("describe_array", &describe_array, py::arg("array"), py::arg("writable") = false,
        "Internal: dtype, device, shape, strides (elements) and data pointer as consumed via "
        "DLPack.");
#ifdef SPECDECODE_WITH_CUDA
  m.def("_primary_context_active", &cuda::has_primary_context, py::arg("device"),
        "Internal: whether a CUDA device's primary context is active, as the ops read it before "
        "they give a caller's current device back (true where the driver cannot say).");
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}

}  // namespace sd
