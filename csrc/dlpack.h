// The DLPack ABI (https://github.com/dmlc/dlpack), declared here from its published
// specification: the legacy DLManagedTensor (capsule "dltensor") and the versioned
// DLManagedTensorVersioned of DLPack >= 1.0 (capsule "dltensor_versioned").
#pragma once

#include <cstdint>

extern "C" {

enum SdDLDeviceType : int32_t {
  kSdDLCPU = 1,
  kSdDLCUDA = 2,
  kSdDLCUDAHost = 3,
  kSdDLCUDAManaged = 13,
};

struct SdDLDevice {
  int32_t device_type;
  int32_t device_id;
};

enum SdDLDataTypeCode : uint8_t {
  kSdDLInt = 0,
  kSdDLUInt = 1,
  kSdDLFloat = 2,
  kSdDLBfloat = 4,
  kSdDLBool = 6,
};

struct SdDLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct SdDLTensor {
  void* data;
  SdDLDevice device;
  int32_t ndim;
  SdDLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};

struct SdDLManagedTensor {
  SdDLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(SdDLManagedTensor* self);
};

struct SdDLPackVersion {
  uint32_t major;
  uint32_t minor;
};

constexpr uint64_t kSdDLFlagReadOnly = 1ull << 0;

struct SdDLManagedTensorVersioned {
  SdDLPackVersion version;
  void* manager_ctx;
  void (*deleter)(SdDLManagedTensorVersioned* self);
  uint64_t flags;
  SdDLTensor dl_tensor;
};

}  // extern "C"
