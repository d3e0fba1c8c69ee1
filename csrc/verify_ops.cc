// Bindings for batched verification (verify) and the Philox generator it uses.
#include <algorithm>
#include <cstdint>
#include <string>

#include "array.h"
#include "dispatch.h"
#include "registry.h"
#include "specdecode/philox.h"
#include "specdecode/verify.h"
#include "specdecode/verify_ops.h"

#ifdef SPECDECODE_WITH_CUDA
#include "verify.cuh"
#endif

namespace sd {
namespace {

cpu::VerifyDType float_code(const Array& a) {
  switch (a.dtype()) {
    case DType::kFloat16:
      return cpu::VerifyDType::kFloat16;
    case DType::kBFloat16:
      return cpu::VerifyDType::kBFloat16;
    default:
      return cpu::VerifyDType::kFloat32;
  }
}

void check_param(const Array& a, const Array& like, DType dtype, int64_t batch) {
  a.expect_dtype({dtype}).expect_shape({batch}, {"B"}).expect_contiguous().expect_same_device(like);
}

// A call's per-sequence processing parameters, each [B] on the device of `like`.
struct Processing {
  Array temperature;  // float32
  Array top_k;        // int32
  Array top_p;        // float32
};

Processing processing_arrays(py::handle temperature_obj, py::handle top_k_obj, py::handle top_p_obj,
                             const Array& like, int64_t batch) {
  Processing p{Array::from_python(temperature_obj, "temperature"),
               Array::from_python(top_k_obj, "top_k"), Array::from_python(top_p_obj, "top_p")};
  check_param(p.temperature, like, DType::kFloat32, batch);
  check_param(p.top_k, like, DType::kInt32, batch);
  check_param(p.top_p, like, DType::kFloat32, batch);
  return p;
}

void check_vocab(int64_t vocab, const char* name) {
  if (vocab < 1 || vocab > verify::kMaxVocab) {
    throw_value_error(std::string(name) + ": the vocabulary size must be in [1, " +
                      std::to_string(verify::kMaxVocab) + "], got V = " + std::to_string(vocab));
  }
}

void check_output(const Array& out, const Array& like, std::initializer_list<int64_t> shape) {
  out.expect_dtype({DType::kInt32})
      .expect_shape(shape)
      .expect_contiguous()
      .expect_same_device(like);
}

void verify_binding(py::handle target_obj, py::handle draft_obj, py::handle draft_deterministic_obj,
                    py::handle tokens_obj, py::handle parents_obj, py::handle num_nodes_obj,
                    py::handle allow_obj, py::handle temperature_obj, py::handle top_k_obj,
                    py::handle top_p_obj, py::handle seed_obj, py::handle offset_obj, bool logits,
                    int method, float eps, float alpha, int topk_accept,
                    bool correction_from_target, int max_depth, py::handle emitted_obj,
                    py::handle num_emitted_obj, py::handle path_obj, py::handle status_obj,
                    py::handle num_accepted_obj, std::intptr_t stream, py::handle workspace_obj,
                    int final_slices) {
  Array target = Array::from_python(target_obj, "target");
  target.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16})
      .expect_ndim(3)
      .expect_contiguous();
  const int64_t batch = target.size(0), n = target.size(1), vocab = target.size(2);
  if (n < 1 || n > kMaxTreeNodes) {
    throw_value_error("target: a draft tree has 1 to " + std::to_string(kMaxTreeNodes) +
                      " nodes, got N = " + std::to_string(n));
  }
  check_vocab(vocab, "target");
  std::optional<Array> draft = optional_array(draft_obj, "draft_probs");
  if (draft) {
    draft->expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16})
        .expect_shape({batch, n, vocab}, {"B", "N", "V"})
        .expect_contiguous()
        .expect_same_device(target);
  }
  std::optional<Array> draft_deterministic =
      optional_array(draft_deterministic_obj, "draft_deterministic");
  if (draft_deterministic) {
    if (!draft) throw_value_error("draft_deterministic: only meaningful with draft_probs");
    draft_deterministic->expect_dtype({DType::kBool, DType::kUInt8})
        .expect_shape({batch}, {"B"})
        .expect_contiguous()
        .expect_same_device(target);
  }
  Array tokens = Array::from_python(tokens_obj, "tokens");
  tokens.expect_dtype({DType::kInt32}).expect_shape({batch, n}, {"B", "N"}).expect_contiguous();
  tokens.expect_same_device(target);
  std::optional<Array> parents = optional_array(parents_obj, "parents");
  if (parents) {
    parents->expect_dtype({DType::kInt32})
        .expect_shape({batch, n}, {"B", "N"})
        .expect_contiguous()
        .expect_same_device(target);
  }
  std::optional<Array> num_nodes = optional_array(num_nodes_obj, "num_nodes");
  if (num_nodes) check_param(*num_nodes, target, DType::kInt32, batch);
  std::optional<Array> allow = optional_array(allow_obj, "allow");
  if (allow) {
    allow->expect_dtype({DType::kBool, DType::kUInt8})
        .expect_shape({batch, n}, {"B", "N"})
        .expect_contiguous()
        .expect_same_device(target);
  }
  const Processing proc = processing_arrays(temperature_obj, top_k_obj, top_p_obj, target, batch);
  Array seed = Array::from_python(seed_obj, "seed");
  check_param(seed, target, DType::kInt64, batch);
  Array offset = Array::from_python(offset_obj, "offset");
  check_param(offset, target, DType::kInt64, batch);
  if (method < verify::kExact || method > verify::kBlock) {
    throw_value_error("method: unknown method code " + std::to_string(method));
  }
  if (max_depth < 0 || max_depth >= kMaxTreeNodes) {
    throw_value_error("max_depth: expected 0 <= max_depth < " + std::to_string(kMaxTreeNodes) +
                      ", got " + std::to_string(max_depth));
  }
  const int64_t width = max_depth + 1;
  Array emitted = Array::from_python(emitted_obj, "emitted", true);
  check_output(emitted, target, {batch, width});
  Array num_emitted = Array::from_python(num_emitted_obj, "num_emitted", true);
  check_output(num_emitted, target, {batch});
  Array path = Array::from_python(path_obj, "path", true);
  check_output(path, target, {batch, width});
  Array status = Array::from_python(status_obj, "status", true);
  check_output(status, target, {batch});
  Array num_accepted = Array::from_python(num_accepted_obj, "num_accepted", true);
  check_output(num_accepted, target, {batch});

  verify::VerifyArgs args{};
  args.target = target.raw();
  args.draft = draft ? draft->raw() : nullptr;
  args.draft_deterministic = draft_deterministic ? draft_deterministic->data<uint8_t>() : nullptr;
  args.tokens = tokens.data<int32_t>();
  args.parents = parents ? parents->data<int32_t>() : nullptr;
  args.num_nodes = num_nodes ? num_nodes->data<int32_t>() : nullptr;
  args.allow = allow ? allow->data<uint8_t>() : nullptr;
  args.temperature = proc.temperature.data<float>();
  args.top_k = proc.top_k.data<int32_t>();
  args.top_p = proc.top_p.data<float>();
  args.seed = seed.data<int64_t>();
  args.offset = offset.data<int64_t>();
  args.batch = batch;
  args.n = static_cast<int>(n);
  args.vocab = vocab;
  args.max_depth = max_depth;
  args.logits = logits;
  args.method = method;
  args.eps = eps;
  args.alpha = alpha;
  args.topk_accept = topk_accept;
  args.correction_from_target = correction_from_target;
  args.emitted = emitted.data<int32_t>();
  args.num_emitted = num_emitted.data<int32_t>();
  args.path = path.data<int32_t>();
  args.status = status.data<int32_t>();
  args.num_accepted = num_accepted.data<int32_t>();
  const cpu::VerifyDType target_code = float_code(target);
  const cpu::VerifyDType draft_code = draft ? float_code(*draft) : cpu::VerifyDType::kNone;

  // The final draw's chunk sums run in final_slices slices of the vocabulary's chunks: on CUDA
  // one thread block per (sequence, slice), >= 1; on the CPU 0 is the production path and >= 1
  // runs the GPU's phases on the CPU (a testing knob; same results).
  if (final_slices < 0 || final_slices > verify::kMaxChunks) {
    throw_value_error("final_slices: expected 0 <= final_slices <= " +
                      std::to_string(verify::kMaxChunks) + ", got " + std::to_string(final_slices));
  }
  // CUDA: the phases hand their data over in caller-allocated device memory (native code
  // allocates nothing on the GPU): uint8 [>= verify_workspace_bytes(B, V)], 16-byte aligned.
  std::optional<Array> workspace = optional_array(workspace_obj, "workspace", true);
  const DeviceScope device_scope = prepare_device(target);
  const bool on_cuda = device_scope.on_cuda();
  if (on_cuda) {
    if (!workspace) throw_value_error("workspace: required for CUDA inputs");
    workspace->expect_dtype({DType::kUInt8}).expect_ndim(1).expect_contiguous();
    workspace->expect_same_device(target);
    const int64_t need = verify::final_workspace_bytes(batch, vocab);
    if (workspace->size(0) < need) {
      throw_value_error("workspace: expected at least " + std::to_string(need) + " bytes for B = " +
                        std::to_string(batch) + ", V = " + std::to_string(vocab) + ", got " +
                        std::to_string(workspace->size(0)));
    }
    if (reinterpret_cast<std::uintptr_t>(workspace->raw()) % 16 != 0) {
      throw_value_error("workspace: expected a 16-byte aligned buffer");
    }
    if (final_slices < 1) throw_value_error("final_slices: expected >= 1 for CUDA inputs");
  }
  py::gil_scoped_release nogil;
  if (!on_cuda) {
    cpu::verify(args, target_code, draft_code, final_slices);
    return;
  }
#ifdef SPECDECODE_WITH_CUDA
  check_cuda(cuda::verify(args, static_cast<int>(target_code), static_cast<int>(draft_code),
                          workspace->raw(), final_slices, as_stream(stream)),
             "verify");
#endif
}

// The sampling distribution of rows [B, V] (logits or probabilities) into probs float32 [B, V]
// and status int32 [B], in place.
void sampling_probs_binding(py::handle rows_obj, py::handle temperature_obj, py::handle top_k_obj,
                            py::handle top_p_obj, bool logits, py::handle probs_obj,
                            py::handle status_obj, std::intptr_t stream) {
  Array rows = Array::from_python(rows_obj, "logits");
  rows.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16})
      .expect_ndim(2)
      .expect_contiguous();
  const int64_t batch = rows.size(0), vocab = rows.size(1);
  check_vocab(vocab, "logits");
  const Processing proc = processing_arrays(temperature_obj, top_k_obj, top_p_obj, rows, batch);
  Array probs = Array::from_python(probs_obj, "probs", true);
  probs.expect_dtype({DType::kFloat32})
      .expect_shape({batch, vocab}, {"B", "V"})
      .expect_contiguous()
      .expect_same_device(rows);
  Array status = Array::from_python(status_obj, "status", true);
  check_output(status, rows, {batch});

  verify::DistributionArgs args{};
  args.rows = rows.raw();
  args.temperature = proc.temperature.data<float>();
  args.top_k = proc.top_k.data<int32_t>();
  args.top_p = proc.top_p.data<float>();
  args.batch = batch;
  args.vocab = vocab;
  args.logits = logits;
  args.probs = probs.data<float>();
  args.status = status.data<int32_t>();
  const cpu::VerifyDType code = float_code(rows);
  const DeviceScope device_scope = prepare_device(rows);
  const bool on_cuda = device_scope.on_cuda();
  py::gil_scoped_release nogil;
  if (!on_cuda) {
    cpu::sampling_distribution(args, code);
    return;
  }
#ifdef SPECDECODE_WITH_CUDA
  check_cuda(cuda::sampling_distribution(args, static_cast<int>(code), as_stream(stream)),
             "sampling_probs");
#endif
}

// Philox4x32-10 on the CPU, for known-answer tests: counter uint32 [M, 4], key uint32 [M, 2].
void philox_binding(py::handle counter_obj, py::handle key_obj, py::handle out_obj) {
  Array counter = Array::from_python(counter_obj, "counter");
  counter.expect_dtype({DType::kUInt32}).expect_shape({-1, 4}, {"M", "4"}).expect_contiguous();
  const int64_t m = counter.size(0);
  Array key = Array::from_python(key_obj, "key");
  key.expect_dtype({DType::kUInt32}).expect_shape({m, 2}, {"M", "2"}).expect_contiguous();
  Array out = Array::from_python(out_obj, "out", true);
  out.expect_dtype({DType::kUInt32}).expect_shape({m, 4}, {"M", "4"}).expect_contiguous();
  for (const Array* a : {&counter, &key, &out}) {
    if (a->device().kind != DeviceKind::kCPU)
      throw_value_error(std::string(a->name()) + ": expected a CPU array");
  }
  const uint32_t* c = counter.data<uint32_t>();
  const uint32_t* k = key.data<uint32_t>();
  uint32_t* o = out.data<uint32_t>();
  for (int64_t i = 0; i < m; ++i) {
    const Philox4 r =
        philox4x32_10(c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3], k[2 * i], k[2 * i + 1]);
    for (int j = 0; j < 4; ++j) o[4 * i + j] = r.v[j];
  }
}

// The canonical chunk sums of a float32 row on the CPU, for tests: with lanes = false through
// verify::chunk_sum (what every executor's sums equal), with lanes = true lane by lane
// (verify::chunk_lane_sum for lanes 0..7, then verify::combine_lanes), as the CUDA kernels of the
// final draw take them. values float32 [V], out float32 [ceil(V / 256)].
void canonical_chunk_sums_binding(py::handle values_obj, py::handle out_obj, bool lanes) {
  Array values = Array::from_python(values_obj, "values");
  values.expect_dtype({DType::kFloat32}).expect_shape({-1}, {"V"}).expect_contiguous();
  const int64_t n = values.size(0);
  Array out = Array::from_python(out_obj, "out", true);
  out.expect_dtype({DType::kFloat32})
      .expect_shape({static_cast<int64_t>(verify::num_chunks(n))}, {"chunks"})
      .expect_contiguous();
  for (const Array* a : {&values, &out}) {
    if (a->device().kind != DeviceKind::kCPU)
      throw_value_error(std::string(a->name()) + ": expected a CPU array");
  }
  const float* v = values.data<float>();
  float* o = out.data<float>();
  const auto load = [v](int64_t i) { return v[i]; };
  for (int c = 0; c < verify::num_chunks(n); ++c) {
    const int64_t begin = static_cast<int64_t>(c) * verify::kChunk;
    const int64_t end = std::min<int64_t>(begin + verify::kChunk, n);
    if (!lanes) {
      o[c] = verify::chunk_sum(load, begin, end);
      continue;
    }
    float l[8];
    for (int j = 0; j < 8; ++j) l[j] = verify::chunk_lane_sum(load, begin, end, j);
    o[c] = verify::combine_lanes(l);
  }
}

}  // namespace

void register_verify_ops(py::module_& m) {
  m.def("verify", &verify_binding, py::arg("target"), py::arg("draft"),
        py::arg("draft_deterministic"), py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"),
        py::arg("allow"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("offset"), py::arg("logits"), py::arg("method"), py::arg("eps"),
        py::arg("alpha"), py::arg("topk_accept"), py::arg("correction_from_target"),
        py::arg("max_depth"), py::arg("emitted"), py::arg("num_emitted"), py::arg("path"),
        py::arg("status"), py::arg("num_accepted"), py::arg("stream") = 0,
        py::arg("workspace") = py::none(), py::arg("final_slices") = 0,
        "Verifies draft trees against target rows; fills the outputs in place. CUDA inputs need "
        "a uint8 workspace of verify_workspace_bytes(B, V) bytes and final_slices >= 1.");
  m.def("sampling_probs", &sampling_probs_binding, py::arg("logits"), py::arg("temperature"),
        py::arg("top_k"), py::arg("top_p"), py::arg("is_logits"), py::arg("probs"),
        py::arg("status"), py::arg("stream") = 0,
        "The sampling distribution of each row as verify processes a target row; fills probs "
        "and status in place.");
  m.def(
      "verify_workspace_bytes",
      [](int64_t batch, int64_t vocab) {
        if (batch < 0 || vocab < 1 || vocab > verify::kMaxVocab) {
          throw_value_error("verify_workspace_bytes: expected B >= 0 and 1 <= V <= " +
                            std::to_string(verify::kMaxVocab));
        }
        return verify::final_workspace_bytes(batch, vocab);
      },
      py::arg("batch"), py::arg("vocab"),
      "Bytes of the device workspace verify needs for CUDA inputs of batch B, vocabulary V.");
  m.def("canonical_chunk_sums", &canonical_chunk_sums_binding, py::arg("values"), py::arg("out"),
        py::arg("lanes"),
        "Canonical chunk sums of a float32 row on the CPU, whole or lane by lane (for tests).");
  m.def("philox4x32_10", &philox_binding, py::arg("counter"), py::arg("key"), py::arg("out"),
        "Philox4x32-10 of each (counter, key) row, on the CPU (for known-answer tests).");
}

}  // namespace sd
