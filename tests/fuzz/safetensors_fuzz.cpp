// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for accel's torch-free safetensors header validator: any
// input must either throw accel::Error or yield a header whose invariants hold
// (tensors tile the data buffer, byte counts match shapes).
#include <accel/checkpoint/detail/safetensors_format.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace d = accel::ckpt::detail;
  try {
    const d::SafetensorsHeader h = d::parse_safetensors(data, size, "fuzz-input");
    if (h.data_start + h.data_size != size) std::abort();
    std::uint64_t covered = 0;
    for (const d::TensorInfo& t : h.tensors) {
      if (t.begin != covered || t.end < t.begin || t.end > h.data_size) std::abort();
      std::uint64_t bytes = *d::dtype_size(t.dtype);
      for (std::int64_t dim : t.shape) {
        if (dim < 0) std::abort();
        bytes *= static_cast<std::uint64_t>(dim);
      }
      if (bytes != t.end - t.begin) std::abort();
      // Touch the tensor's bytes: ASan reports any read outside the input.
      volatile std::uint8_t sink = 0;
      for (std::uint64_t i = t.begin; i < t.end; ++i) sink = sink ^ data[h.data_start + i];
      (void)sink;
      covered = t.end;
    }
    if (covered != h.data_size) std::abort();
  } catch (const accel::Error&) {
    // Rejected input: the expected outcome for almost everything.
  }
  return 0;
}
