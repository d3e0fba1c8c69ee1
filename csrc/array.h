// A borrowed view of an array handed over through DLPack, with the checks every op needs.
//
// Array::from_python consumes obj.__dlpack__() (or a DLPack capsule given directly), keeps the
// producer's tensor alive for the lifetime of the Array and releases it in the destructor.
// Arrays must be destroyed with the GIL held (numpy's deleter touches Python objects): create
// them before py::gil_scoped_release and let them die after it.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "dlpack.h"

namespace sd {
namespace py = pybind11;

enum class DType {
  kInt32,
  kInt64,
  kUInt32,
  kUInt8,
  kBool,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
  kOther
};

const char* dtype_name(DType dt);
int dtype_size(DType dt);

enum class DeviceKind { kCPU, kCUDA };

struct Device {
  DeviceKind kind;
  int index;
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
};

class Array {
 public:
  // Consumes obj (an object with __dlpack__, or a DLPack capsule). `name` is the argument name
  // used in error messages; `writable` rejects read-only producers (outputs).
  static Array from_python(py::handle obj, const char* name, bool writable = false);

  Array(Array&& other) noexcept;
  Array& operator=(Array&& other) = delete;
  Array(const Array&) = delete;
  ~Array();

  const char* name() const { return name_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int dim) const { return shape_[dim < 0 ? dim + ndim() : dim]; }
  int64_t stride(int dim) const { return strides_[dim < 0 ? dim + ndim() : dim]; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_str() const;

  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }
  void* raw() const { return data_; }

  // ---- checks: each throws TypeError/ValueError naming the argument ----
  const Array& expect_dtype(std::initializer_list<DType> allowed) const;
  const Array& expect_ndim(int ndim) const;
  // -1 in `shape` matches any size; `names` labels the dimensions in the message ("B", "N").
  const Array& expect_shape(std::initializer_list<int64_t> shape,
                            std::initializer_list<const char*> names = {}) const;
  const Array& expect_contiguous() const;
  // Last dimension contiguous, other strides free (views into larger buffers).
  const Array& expect_inner_contiguous() const;
  const Array& expect_same_device(const Array& other) const;
  const Array& expect_same_dtype(const Array& other) const;

 private:
  Array() = default;
  void release();

  const char* name_ = "";
  void* data_ = nullptr;
  DType dtype_ = DType::kOther;
  Device device_{DeviceKind::kCPU, 0};
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  SdDLManagedTensor* legacy_ = nullptr;
  SdDLManagedTensorVersioned* versioned_ = nullptr;
};

// Array::from_python, or nullopt for None.
std::optional<Array> optional_array(py::handle obj, const char* name, bool writable = false);

// An op's hold on the CUDA device of its arrays: that device is the calling thread's current one
// while the scope lives, and the caller's current device comes back when it ends (the op
// returned or threw), so that an op on cuda:1 leaves torch's current device as it was.
// Made by prepare_device; lives to the end of the op's binding function.
class DeviceScope {
 public:
  DeviceScope(bool on_cuda, int previous) : on_cuda_(on_cuda), previous_(previous) {}
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope();
  // Whether the arrays take the CUDA path.
  bool on_cuda() const { return on_cuda_; }

 private:
  bool on_cuda_;
  int previous_;  // the device to give back (cuda::leave_device), -1 for none
};

// Raises ValueError naming the argument when a CUDA array reaches a build without CUDA; on CUDA
// builds makes the array's device current for the scope's lifetime. on_cuda() is true for CUDA
// arrays. In the CUDA emulator's module (SPECDECODE_CUDA_EMULATED) host arrays are the emulated
// device's (sd::emu::array_device): on_cuda() for them, ValueError for real CUDA arrays.
DeviceScope prepare_device(const Array& a);

// Throws RuntimeError with the CUDA runtime's message when code != 0.
void check_cuda(int code, const char* what);

[[noreturn]] void throw_value_error(const std::string& msg);
[[noreturn]] void throw_type_error(const std::string& msg);

}  // namespace sd
