// DecoderStack: a model's plain decoder layers (llmplug.layers.decoder.fast_path) run in C++, one call a step for
// every layer, with int4 weights (llmplug_cpu::int4_matmul). At one decode token the kernels of a layer take ~100 us
// and its Python (the straight-line run's calls, views and checks) ~60 us more; here a step pays ~1 us of dispatch
// a kernel. Each layer calls the same kernels as fast_path._run, with the same arguments in the same order, so its
// outputs are that run's bit for bit (tests/models/test_decoder_fast_path.py checks it).
//
// The kernels are reached through the dispatcher (they live in ops.cpp and int4.cpp): a typed handle, looked up
// once, called with the exact C++ signature each kernel registered.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t)>
      int4_matmul = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t)>("llmplug_cpu::int4_matmul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      kernel<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("llmplug_cpu::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(at::Tensor, const at::Tensor&, const at::Tensor&, double)> fused_add_rms_norm =
      kernel<at::Tensor(at::Tensor, const at::Tensor&, const at::Tensor&, double)>("llmplug_cpu::fused_add_rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      kernel<at::Tensor(const at::Tensor&)>("llmplug_cpu::silu_and_mul");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, bool)> rotary_embedding =
      kernel<void(at::Tensor, const at::Tensor&, const at::Tensor&, bool)>("llmplug_cpu::rotary_embedding");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double, int64_t, int64_t)>
      cache_and_attend =
          kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, int64_t)>(
              "llmplug_cpu::cache_and_attend");

  static const Kernels& get() {
    static const Kernels kernels;  // after the library's registrations: the first run, never at load
    return kernels;
  }
};

// An [N, K] weight in NativeInt4's layout, and its bias (undefined: none)
struct Int4Linear {
  at::Tensor qweight, scales, zeros, bias;
  int64_t group_size;

  at::Tensor operator()(const Kernels& k, const at::Tensor& x) const {
    at::Tensor y = k.int4_matmul.call(x, qweight, scales, zeros, group_size);
    if (bias.defined()) y.add_(bias);  // as Int4LinearMethod: y += bias
    return y;
  }
};

struct Layer {
  at::Tensor input_norm, mlp_norm, kv_cache;
  double input_eps, mlp_eps, scale;
  Int4Linear qkv, o, gate_up, down;
  int64_t q_size, kv_size, head_dim, rotary_heads, rope, window, chunk;  // rope: index into the step's ropes, -1: none
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  // One layer's parts, in run order. linears: qweight, scales, zeros of qkv, o, gate_up and down (12 tensors);
  // biases: theirs (4), an empty tensor for none; group_sizes: theirs (4). ints: q_size, kv_size, head_dim,
  // rotary_heads, rope, window, chunk; floats: input_eps, mlp_eps, the attention's scale.
  void add_layer(at::Tensor input_norm, at::Tensor mlp_norm, at::Tensor kv_cache, std::vector<at::Tensor> linears,
                 std::vector<at::Tensor> biases, std::vector<int64_t> group_sizes, std::vector<int64_t> ints,
                 std::vector<double> floats) {
    TORCH_CHECK(linears.size() == 12 && biases.size() == 4 && group_sizes.size() == 4 && ints.size() == 7 &&
                    floats.size() == 3,
                "llmplug_cpu::DecoderStack.add_layer: 12 linear tensors, 4 biases, 4 group sizes, 7 ints and 3 "
                "floats expected");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
                "llmplug_cpu::DecoderStack.add_layer: a two-plane kv_cache [2, Hkv, blocks, block_size, D] expected");
    auto linear = [&](int i) {
      const at::Tensor& bias = biases[i];
      return Int4Linear{linears[3 * i], linears[3 * i + 1], linears[3 * i + 2],
                        bias.numel() ? bias : at::Tensor(), group_sizes[i]};
    };
    layers_.push_back(Layer{input_norm, mlp_norm, kv_cache, floats[0], floats[1], floats[2], linear(0), linear(1),
                            linear(2), linear(3), ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6]});
  }

  // Every layer on hidden [T, hidden] (and the residual stream, none before the first layer) -> the last layer's
  // (output, residual). ropes: each rotation's cos, sin [T, 1, R] and whether it is rotate-half; the attention
  // metadata as cache_and_attend takes it.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, std::optional<at::Tensor> residual_in,
                                         std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                         std::vector<int64_t> neox, at::Tensor slot_mapping, at::Tensor block_tables,
                                         at::Tensor query_start_loc, at::Tensor seq_lens) {
    const Kernels& k = Kernels::get();
    at::Tensor residual = residual_in.value_or(at::Tensor());
    for (const Layer& layer : layers_) {
      at::Tensor x = residual.defined() ? k.fused_add_rms_norm.call(hidden, residual, layer.input_norm, layer.input_eps)
                                        : k.rms_norm.call(hidden, layer.input_norm, layer.input_eps);
      residual = hidden;  // the stream: the first layer's input, else hidden + residual written into hidden
      const at::Tensor qkv = layer.qkv(k, x);
      const int64_t tokens = qkv.size(0), k_end = layer.q_size + layer.kv_size;
      if (layer.rope >= 0) {
        const auto r = static_cast<size_t>(layer.rope);
        k.rotary_embedding.call(qkv.narrow(1, 0, k_end).view({tokens, layer.rotary_heads, layer.head_dim}), cos[r],
                                sin[r], neox[r] != 0);
      }
      const at::Tensor attended = k.cache_and_attend.call(
          qkv.narrow(1, 0, layer.q_size), qkv.narrow(1, layer.q_size, layer.kv_size),
          qkv.narrow(1, k_end, qkv.size(1) - k_end), layer.kv_cache, slot_mapping, block_tables, query_start_loc,
          seq_lens, layer.scale, layer.window, layer.chunk);
      hidden = layer.o(k, attended);
      x = k.fused_add_rms_norm.call(hidden, residual, layer.mlp_norm, layer.mlp_eps);
      residual = hidden;
      hidden = layer.down(k, k.silu_and_mul.call(layer.gate_up(k, x)));
    }
    return {hidden, residual};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmplug_cpu, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("run", &DecoderStack::run)
      .def("num_layers", &DecoderStack::num_layers);
}
