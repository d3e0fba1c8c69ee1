#include "array.h"

#include <sstream>
#include <utility>

#ifdef SPECDECODE_WITH_CUDA
#include "runtime.cuh"
#endif

namespace sd {

void throw_value_error(const std::string& msg) { throw py::value_error(msg); }
void throw_type_error(const std::string& msg) { throw py::type_error(msg); }

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt32:
      return "uint32";
    case DType::kUInt8:
      return "uint8";
    case DType::kBool:
      return "bool";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    default:
      return "an unsupported dtype";
  }
}

int dtype_size(DType dt) {
  switch (dt) {
    case DType::kInt64:
    case DType::kFloat64:
      return 8;
    case DType::kInt32:
    case DType::kUInt32:
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kUInt8:
    case DType::kBool:
      return 1;
    default:
      return 0;
  }
}

std::string Device::str() const {
  return kind == DeviceKind::kCPU ? std::string("cpu") : "cuda:" + std::to_string(index);
}

namespace {

DType to_dtype(const SdDLDataType& t) {
  if (t.lanes != 1) return DType::kOther;
  switch (t.code) {
    case kSdDLInt:
      if (t.bits == 32) return DType::kInt32;
      if (t.bits == 64) return DType::kInt64;
      break;
    case kSdDLUInt:
      if (t.bits == 32) return DType::kUInt32;
      if (t.bits == 8) return DType::kUInt8;
      break;
    case kSdDLFloat:
      if (t.bits == 16) return DType::kFloat16;
      if (t.bits == 32) return DType::kFloat32;
      if (t.bits == 64) return DType::kFloat64;
      break;
    case kSdDLBfloat:
      if (t.bits == 16) return DType::kBFloat16;
      break;
    case kSdDLBool:
      if (t.bits == 8) return DType::kBool;
      break;
    default:
      break;
  }
  return DType::kOther;
}

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// torch.Tensor.__dlpack__ is Python code costing microseconds per array; torch's C-level
// to_dlpack does the same export (no stream sync, like stream=-1) in a fraction of that. Exact
// torch.Tensor / Parameter objects take that path; subclasses keep the protocol.
bool torch_fast_export(py::handle obj, py::object* capsule) {
  static PyTypeObject* tensor_type = nullptr;
  static PyTypeObject* parameter_type = nullptr;
  static PyObject* to_dlpack = nullptr;
  if (!tensor_type) {
    PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");
    if (!torch) return false;  // torch not imported (yet): nothing of its can reach us
    py::module_ mod = py::reinterpret_borrow<py::module_>(torch);
    if (!py::hasattr(mod, "_C") || !py::hasattr(mod.attr("_C"), "_to_dlpack")) return false;
    // Kept for the life of the process.
    to_dlpack = py::object(mod.attr("_C").attr("_to_dlpack")).release().ptr();
    parameter_type = reinterpret_cast<PyTypeObject*>(
        py::object(mod.attr("nn").attr("Parameter")).release().ptr());
    tensor_type = reinterpret_cast<PyTypeObject*>(py::object(mod.attr("Tensor")).release().ptr());
  }
  PyTypeObject* type = Py_TYPE(obj.ptr());
  if (type != tensor_type && type != parameter_type) return false;
  PyObject* result = PyObject_CallOneArg(to_dlpack, obj.ptr());
  if (!result) throw py::error_already_set();
  *capsule = py::reinterpret_steal<py::object>(result);
  return true;
}

// Asks the producer for a capsule: the versioned protocol first, the legacy one for producers
// that do not know max_version. CUDA producers are told not to synchronise (stream -1): our
// kernels run on the caller's current stream, the one that produced the data.
py::object export_capsule(py::handle obj, const char* name) {
  py::object fast;
  if (torch_fast_export(obj, &fast)) return fast;
  if (!py::hasattr(obj, "__dlpack__")) {
    throw_type_error(std::string(name) +
                     ": expected an array that supports DLPack (torch.Tensor, numpy.ndarray, "
                     "cupy.ndarray, ...), got " +
                     type_name(obj));
  }
  int device_type = kSdDLCPU;
  if (py::hasattr(obj, "__dlpack_device__")) {
    py::tuple dev = obj.attr("__dlpack_device__")();
    device_type = dev[0].cast<int>();
  }
  py::dict kwargs;
  if (device_type == kSdDLCUDA || device_type == kSdDLCUDAManaged) kwargs["stream"] = -1;
  try {
    kwargs["max_version"] = py::make_tuple(1, 0);
    try {
      return obj.attr("__dlpack__")(**kwargs);
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) throw;
      PyDict_DelItemString(kwargs.ptr(), "max_version");
      return obj.attr("__dlpack__")(**kwargs);
    }
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_BufferError)) {
      throw_value_error(std::string(name) +
                        ": cannot be exported through DLPack: " + std::string(py::str(e.value())));
    }
    throw;
  }
}

}  // namespace

Array Array::from_python(py::handle obj, const char* name, bool writable) {
  py::object capsule = PyCapsule_CheckExact(obj.ptr()) ? py::reinterpret_borrow<py::object>(obj)
                                                       : export_capsule(obj, name);
  Array a;
  a.name_ = name;
  const char* cap_name = PyCapsule_GetName(capsule.ptr());
  const SdDLTensor* t = nullptr;
  if (cap_name && std::string(cap_name) == "dltensor_versioned") {
    auto* m = static_cast<SdDLManagedTensorVersioned*>(
        PyCapsule_GetPointer(capsule.ptr(), "dltensor_versioned"));
    if (!m) throw py::error_already_set();
    if (m->version.major != 1) {
      throw_type_error(std::string(name) + ": unsupported DLPack version " +
                       std::to_string(m->version.major) + "." + std::to_string(m->version.minor));
    }
    if (writable && (m->flags & kSdDLFlagReadOnly)) {
      throw_value_error(std::string(name) + ": is read-only but is written to");
    }
    PyCapsule_SetName(capsule.ptr(), "used_dltensor_versioned");
    a.versioned_ = m;
    t = &m->dl_tensor;
  } else if (cap_name && std::string(cap_name) == "dltensor") {
    auto* m = static_cast<SdDLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
    if (!m) throw py::error_already_set();
    PyCapsule_SetName(capsule.ptr(), "used_dltensor");
    a.legacy_ = m;
    t = &m->dl_tensor;
  } else {
    throw_type_error(std::string(name) + ": not a DLPack capsule (already consumed?)");
  }

  a.dtype_ = to_dtype(t->dtype);
  switch (t->device.device_type) {
    case kSdDLCPU:
    case kSdDLCUDAHost:
      a.device_ = {DeviceKind::kCPU, 0};
      break;
    case kSdDLCUDA:
    case kSdDLCUDAManaged:
      a.device_ = {DeviceKind::kCUDA, t->device.device_id};
      break;
    default:
      throw_type_error(std::string(name) + ": unsupported device type " +
                       std::to_string(t->device.device_type) + " (expected CPU or CUDA)");
  }
  // A producer's lie about sizes is beyond checking, but a negative one is visibly malformed, and
  // a negative size would act as a wildcard in expect_shape (-1 means "any").
  if (t->ndim < 0 || (t->ndim > 0 && !t->shape)) {
    throw_value_error(std::string(name) + ": malformed DLPack tensor (ndim " +
                      std::to_string(t->ndim) + (t->shape ? "" : ", no shape") + ")");
  }
  a.shape_.assign(t->shape, t->shape + t->ndim);
  for (int64_t s : a.shape_) {
    if (s < 0) throw_value_error(std::string(name) + ": negative size in shape " + a.shape_str());
  }
  a.strides_.resize(t->ndim);
  if (t->strides) {
    a.strides_.assign(t->strides, t->strides + t->ndim);
  } else {
    int64_t s = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {
      a.strides_[d] = s;
      s *= a.shape_[d];
    }
  }
  a.data_ = static_cast<char*>(t->data) + t->byte_offset;
  return a;
}

Array::Array(Array&& o) noexcept
    : name_(o.name_),
      data_(o.data_),
      dtype_(o.dtype_),
      device_(o.device_),
      shape_(std::move(o.shape_)),
      strides_(std::move(o.strides_)),
      legacy_(std::exchange(o.legacy_, nullptr)),
      versioned_(std::exchange(o.versioned_, nullptr)) {}

Array::~Array() { release(); }

void Array::release() {
  if (legacy_ && legacy_->deleter) legacy_->deleter(legacy_);
  if (versioned_ && versioned_->deleter) versioned_->deleter(versioned_);
  legacy_ = nullptr;
  versioned_ = nullptr;
}

int64_t Array::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

bool Array::is_contiguous() const {
  // An empty array has no element to be out of place; producers export it with any strides
  // (numpy uses 0).
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int d = ndim() - 1; d >= 0; --d) {
    if (shape_[d] != 1 && strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

std::string Array::shape_str() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim(); ++d) os << (d ? ", " : "") << shape_[d];
  os << "]";
  return os.str();
}

const Array& Array::expect_dtype(std::initializer_list<DType> allowed) const {
  for (DType dt : allowed) {
    if (dt == dtype_) return *this;
  }
  std::string want;
  int i = 0;
  for (DType dt : allowed) {
    if (i++) want += (i == static_cast<int>(allowed.size()) ? " or " : ", ");
    want += dtype_name(dt);
  }
  throw_type_error(std::string(name_) + ": expected dtype " + want + ", got " + dtype_name(dtype_));
}

const Array& Array::expect_ndim(int nd) const {
  if (ndim() != nd) {
    throw_value_error(std::string(name_) + ": expected " + std::to_string(nd) +
                      " dimensions, got shape " + shape_str());
  }
  return *this;
}

const Array& Array::expect_shape(std::initializer_list<int64_t> shape,
                                 std::initializer_list<const char*> names) const {
  bool ok = ndim() == static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) {
    if (ok && s >= 0 && shape_[d] != s) ok = false;
    ++d;
  }
  if (ok) return *this;
  std::ostringstream os;
  os << name_ << ": expected shape [";
  d = 0;
  auto name_it = names.begin();
  for (int64_t s : shape) {
    os << (d++ ? ", " : "");
    const char* label = name_it != names.end() ? *name_it++ : nullptr;
    if (label) os << label << (s >= 0 ? "=" : "");
    if (s >= 0)
      os << s;
    else if (!label)
      os << "*";
  }
  os << "], got " << shape_str();
  throw_value_error(os.str());
}

const Array& Array::expect_contiguous() const {
  if (!is_contiguous()) {
    throw_value_error(std::string(name_) +
                      ": must be contiguous (row-major); call .contiguous() first");
  }
  return *this;
}

const Array& Array::expect_inner_contiguous() const {
  // Empty arrays come with any strides (numpy exports 0), as in is_contiguous.
  if (ndim() > 0 && numel() > 0 && shape_.back() != 1 && strides_.back() != 1) {
    throw_value_error(std::string(name_) + ": the last dimension must be contiguous (stride 1)");
  }
  return *this;
}

const Array& Array::expect_same_device(const Array& other) const {
  if (device_ != other.device_) {
    throw_value_error(std::string(name_) + " is on " + device_.str() + " but " + other.name_ +
                      " is on " + other.device_.str() + "; all arrays must be on one device");
  }
  return *this;
}

const Array& Array::expect_same_dtype(const Array& other) const {
  if (dtype_ != other.dtype_) {
    throw_type_error(std::string(name_) + " is " + dtype_name(dtype_) + " but " + other.name_ +
                     " is " + dtype_name(other.dtype_) + "; they must have the same dtype");
  }
  return *this;
}

std::optional<Array> optional_array(py::handle obj, const char* name, bool writable) {
  if (obj.is_none()) return std::nullopt;
  return Array::from_python(obj, name, writable);
}

DeviceScope::~DeviceScope() {
#ifdef SPECDECODE_WITH_CUDA
  cuda::leave_device(previous_);
#endif
}

DeviceScope prepare_device(const Array& a) {
#if defined(SPECDECODE_CUDA_EMULATED)
  // The CUDA emulator's devices are the host (cuda/emu): host arrays take the CUDA path.
  if (a.device().kind != DeviceKind::kCPU) {
    throw_value_error(std::string(a.name()) + ": is on " + a.device().str() +
                      ", but the CUDA emulator (specdecode._cuda_emu) takes host arrays only");
  }
  const int index = cuda::emulated_array_device();
#elif defined(SPECDECODE_WITH_CUDA)
  if (a.device().kind == DeviceKind::kCPU) return DeviceScope(false, -1);
  const int index = a.device().index;
#else
  if (a.device().kind == DeviceKind::kCPU) return DeviceScope(false, -1);
  throw_value_error(std::string(a.name()) + ": is on " + a.device().str() +
                    ", but this build of specdecode has no CUDA backend; reinstall with nvcc on "
                    "PATH and SPECDECODE_CUDA=ON, or move the data to the CPU");
#endif
#ifdef SPECDECODE_WITH_CUDA
  int previous = -1;
  std::string err;
  if (!cuda::enter_device(index, &previous, &err)) {
    throw std::runtime_error(std::string(a.name()) + ": cannot use cuda:" + std::to_string(index) +
                             ": " + err);
  }
  return DeviceScope(true, previous);
#endif
}

void check_cuda(int code, const char* what) {
  if (code == 0) return;
#ifdef SPECDECODE_WITH_CUDA
  throw std::runtime_error(std::string(what) + ": CUDA error: " + cuda::error_string(code));
#else
  throw std::runtime_error(std::string(what) + ": CUDA error " + std::to_string(code));
#endif
}

}  // namespace sd
