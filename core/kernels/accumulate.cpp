#include "core/kernels/accumulate.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace tessel::kernels {
namespace {

template <typename T>
void add_loop(float* d, const T* s, int64_t n) {
  at::parallel_for(0, n, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) d[i] += static_cast<float>(s[i]);
  });
}

}  // namespace

void add_widened(const torch::Tensor& dst, const torch::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == torch::kFloat32 && dst.sizes() == src.sizes(),
              "add_widened: dst must be fp32 and src the same shape");
  const bool loop = dst.is_cpu() && src.is_cpu() && dst.is_contiguous() && src.is_contiguous();
  if (loop && src.scalar_type() == torch::kBFloat16)
    return add_loop(dst.data_ptr<float>(), src.const_data_ptr<c10::BFloat16>(), dst.numel());
  if (loop && src.scalar_type() == torch::kHalf)
    return add_loop(dst.data_ptr<float>(), src.const_data_ptr<c10::Half>(), dst.numel());
  dst.add_(src);  // same dtype, or CUDA (which casts in the kernel)
}

}  // namespace tessel::kernels
