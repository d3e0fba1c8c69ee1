// specdecode._cuda_emu: the ops of specdecode._C with their CUDA path, run by the CUDA emulator
// (cuda/emu) on host arrays. The same binding code as _C (csrc/*_ops.cc), compiled with
// SPECDECODE_CUDA_EMULATED: every host array takes the CUDA dispatch, the launchers of cuda/ run
// the kernels on the emulator. For tests of the CUDA kernels on machines with no GPU; see
// docs/developing.md.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "../array.h"
#include "../registry.h"
#include "cuda_runtime_api.h"
#include "selftest.h"

namespace py = pybind11;

namespace {

sd::emu::Schedule schedule_of(const std::string& name) {
  if (name == "forward") return sd::emu::Schedule::kForward;
  if (name == "reverse") return sd::emu::Schedule::kReverse;
  if (name == "shuffled") return sd::emu::Schedule::kShuffled;
  throw py::value_error("schedule: expected 'forward', 'reverse' or 'shuffled', got '" + name +
                        "'");
}

}  // namespace

PYBIND11_MODULE(_cuda_emu, m) {
  m.doc() = "specdecode's CUDA kernels on the CUDA emulator (internal; for tests)";
  sd::register_tree_ops(m);
  sd::register_attention_ops(m);
  sd::register_verify_ops(m);
  sd::register_host_device_ops(m);

  m.def(
      "set_schedule",
      [](const std::string& name, uint64_t seed) {
        sd::emu::set_schedule(schedule_of(name), seed);
      },
      py::arg("schedule"), py::arg("seed") = 0,
      "Order of the threads between barriers and of the blocks of a grid: 'forward', 'reverse' "
      "or 'shuffled' (seeded).");
  m.def(
      "stats",
      [] {
        const sd::emu::Stats s = sd::emu::stats();
        py::dict d;
        d["launches"] = s.launches;
        d["blocks"] = s.blocks;
        d["threads"] = s.threads;
        d["block_barriers"] = s.block_barriers;
        d["warp_syncs"] = s.warp_syncs;
        d["shuffles"] = s.shuffles;
        d["mmas"] = s.mmas;
        d["launch_device"] = s.launch_device;
        return d;
      },
      "Counters since the last reset_stats(): launches, blocks, threads, released block "
      "barriers, warp syncs, shuffles and tensor-core products (mma.sync); launch_device, the "
      "device current at the last launch (-1 before one).");
  m.def("reset_stats", &sd::emu::reset_stats);
  m.def(
      "set_compute_capability",
      [](int major, int minor) {
        if (major < 1 || minor < 0) {
          throw py::value_error("compute capability: expected major >= 1 and minor >= 0, got " +
                                std::to_string(major) + "." + std::to_string(minor));
        }
        sd::emu::set_compute_capability(major, minor);
      },
      py::arg("major"), py::arg("minor") = 0,
      "The compute capability the emulated device reports (default 9.0); below 8.0 the "
      "launchers take their paths without tensor cores.");

  m.def(
      "reset_devices",
      [](int count, int array_device) {
        if (count < 1 || array_device < 0) {
          throw py::value_error("reset_devices: expected count >= 1 and array_device >= 0, got " +
                                std::to_string(count) + " and " + std::to_string(array_device));
        }
        sd::emu::reset_devices(count, array_device);
      },
      py::arg("count") = 1, py::arg("array_device") = 0,
      "`count` emulated devices (default 1), none with an active primary context, device 0 "
      "current on the calling thread; the ops' host arrays are on `array_device` (which may "
      "name a device the emulator lacks, to test the ops' error).");
  m.def("current_device", &sd::emu::current_device,
        "The calling thread's current emulated device (cudaGetDevice).");
  m.def(
      "set_device",
      [](int device) {
        const cudaError_t err = sd::emu::set_current_device(device);
        cudaGetLastError();
        if (err != cudaSuccess) throw py::value_error(sd::emu::last_message());
      },
      py::arg("device"),
      "cudaSetDevice on the calling thread, as a caller such as torch does (activates the "
      "device's primary context).");
  m.def("primary_context_active", &sd::emu::primary_context_active, py::arg("device"),
        "Whether an emulated device's primary context is active (cuDevicePrimaryCtxGetState).");
  m.def(
      "_selftest_shuffles",
      [](py::handle out_obj) {
        sd::Array out = sd::Array::from_python(out_obj, "out", true);
        out.expect_dtype({sd::DType::kInt32}).expect_shape({8 * 32}).expect_contiguous();
        return sd::emu::selftest_shuffles(out.data<int32_t>());
      },
      "Shuffle cases on one warp into out (int32 [8 * 32], host); returns the case count.");
  m.def(
      "_selftest_neighbour",
      [](py::handle out_obj, int threads, bool with_barrier) {
        sd::Array out = sd::Array::from_python(out_obj, "out", true);
        out.expect_dtype({sd::DType::kFloat32}).expect_shape({threads}).expect_contiguous();
        return sd::emu::selftest_neighbour(out.data<float>(), threads, with_barrier);
      },
      "out[t] = shared[(t + 1) % threads] after each thread wrote shared[t] = t.");
  m.def(
      "_selftest_static_shared",
      [](py::handle out_obj) {
        sd::Array out = sd::Array::from_python(out_obj, "out", true);
        out.expect_dtype({sd::DType::kFloat32}).expect_shape({2}).expect_contiguous();
        return sd::emu::selftest_static_shared(out.data<float>());
      },
      "out[b] = a static shared float as block b found it (before writing it).");
  m.def(
      "_selftest_mma",
      [](py::handle a_obj, py::handle b_obj, bool bf16, py::handle d_obj) {
        sd::Array a = sd::Array::from_python(a_obj, "a", false);
        sd::Array b = sd::Array::from_python(b_obj, "b", false);
        sd::Array d = sd::Array::from_python(d_obj, "d", true);
        const sd::DType t = bf16 ? sd::DType::kBFloat16 : sd::DType::kFloat16;
        a.expect_dtype({t}).expect_shape({16, 16}).expect_contiguous();
        b.expect_dtype({t}).expect_shape({16, 8}).expect_contiguous();
        d.expect_dtype({sd::DType::kFloat32}).expect_shape({16, 8}).expect_contiguous();
        return sd::emu::selftest_mma(a.data<uint16_t>(), b.data<uint16_t>(), bf16, d.data<float>());
      },
      py::arg("a"), py::arg("b"), py::arg("bf16"), py::arg("d"),
      "d = a b (a [16, 16], b [16, 8] bf16 or fp16, d [16, 8] float32) by one emulated "
      "mma.sync m16n8k16, each lane loading its fragments by the documented layout.");
  m.def(
      "_selftest_ldmatrix",
      [](py::handle m_obj, bool trans, py::handle out_obj) {
        sd::Array mat = sd::Array::from_python(m_obj, "m", false);
        sd::Array out = sd::Array::from_python(out_obj, "out", true);
        mat.expect_dtype({sd::DType::kBFloat16, sd::DType::kFloat16})
            .expect_shape({16, 16})
            .expect_contiguous();
        out.expect_dtype({sd::DType::kInt32}).expect_shape({32, 4}).expect_contiguous();
        return sd::emu::selftest_ldmatrix(mat.data<uint16_t>(), trans, out.data<uint32_t>());
      },
      py::arg("m"), py::arg("trans"), py::arg("out"),
      "out[lane] = the four registers one emulated ldmatrix.x4 (.trans with `trans`) gives each "
      "lane for the quadrants of m [16, 16] (bf16 or fp16); out int32 [32, 4].");
  m.def("_selftest_shared_overflow", &sd::emu::selftest_shared_overflow,
        "Writes one float past a block's dynamic shared memory: faults (run it in a child).");
  m.def("_selftest_rule", &sd::emu::selftest_rule,
        "Launches a kernel that breaks the named rule; returns the launch's error message.");
}
