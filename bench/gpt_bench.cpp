// gpt_bench: forward + backward of one transformer block, and of the attention core alone
// (fused qkv [B, T, 3C] in, merged heads [B, T, C] out), of examples/gpt's model, one process.
// The PyTorch side is bench/peers/torch_gpt.py --micro block|attention; bench/run_gpt_bench.sh
// runs both. Prints
//
//   RESULT gpt_block impl=dtrain batch=16 model=L1-H4-C256-T128 reps=20 step_ms=..
//
// --autocast 1 runs the step (block or attention core) under dt::autocast(BFloat16)
// (tensor/autocast.h) and adds precision=bf16-autocast and attention=bf16|fp32 (what the
// attention core's products ran in) to its line; --attention-bf16 0|1 sets
// dt::setAutocastAttention (default: DT_AUTOCAST_ATTENTION). stderr names the matrix-product kernels.
//
// usage: gpt_bench --micro block|attention [--batch B] [--width C] [--heads H] [--context T] [--reps N]
//                  [--autocast 0|1] [--attention-bf16 0|1]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tensor/autocast.h"
#include "tensor/matmul_backend.h"
#include "tensor/nn/gpt.h"

namespace {

double medianMs(const std::function<void()>& fn, int reps) {
  fn();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string micro = "block";
  int64_t batch = 4, width = 256, heads = 4, context = 128;
  int reps = 20;
  bool bf16Autocast = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--micro") micro = value;
    else if (flag == "--batch") batch = std::stoll(value);
    else if (flag == "--width") width = std::stoll(value);
    else if (flag == "--heads") heads = std::stoll(value);
    else if (flag == "--context") context = std::stoll(value);
    else if (flag == "--reps") reps = std::stoi(value);
    else if (flag == "--autocast") bf16Autocast = std::stoi(value) != 0;
    else if (flag == "--attention-bf16") dt::setAutocastAttention(std::stoi(value) != 0);
    else {
      std::fprintf(stderr, "gpt_bench: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (micro != "block" && micro != "attention") {
    std::fprintf(stderr, "gpt_bench: --micro must be block or attention, got %s\n", micro.c_str());
    return 2;
  }
  dt::Generator g(0);
  const dt::nn::GptConfig config{.vocabSize = 256, .contextLength = context, .layers = 1, .heads = heads, .width = width};
  dt::nn::TransformerBlock block(config, g, g);
  std::function<void()> step;
  dt::Tensor x = dt::randn({batch, context, width}, g).setRequiresGrad(true);
  dt::Tensor qkv = dt::randn({batch, context, 3 * width}, g).setRequiresGrad(true);
  step = [&] {
    std::optional<dt::autocast> scope;
    if (bf16Autocast) scope.emplace(dt::DType::BFloat16);
    dt::sum(micro == "block" ? block(x) : dt::selfAttention(qkv, heads)).backward();
  };
  const double ms = medianMs(step, reps);
  // precision= only with --autocast 1, so the float32 line still pairs with PyTorch's.
  const bool attentionBf16 = dt::autocastAttention() && dt::bf16MatmulNative() &&
                             dt::matmulBackend() != dt::MatmulBackend::OpenBlas;
  const std::string precision =
      bf16Autocast ? std::string(" precision=bf16-autocast attention=") + (attentionBf16 ? "bf16" : "fp32") : "";
  std::printf("RESULT gpt_%s impl=dtrain batch=%lld model=L1-H%lld-C%lld-T%lld%s reps=%d step_ms=%.3f\n", micro.c_str(),
              static_cast<long long>(batch), static_cast<long long>(heads), static_cast<long long>(width),
              static_cast<long long>(context), precision.c_str(), reps, ms);
  std::fprintf(stderr, "matmul kernels: %s\n", dt::matmulKernelName().c_str());
  return 0;
}
