// DecoderStack: a model's plain decoder layers (llmplug.layers.decoder.fast_path) run in C++, one call a step for
// every layer. At one decode token the kernels of a layer take ~100 us and its Python (the straight-line run's calls,
// views and checks) ~60 us more; here a step pays ~1 us of dispatch a kernel. Each layer calls the same kernels as
// fast_path._run, with the same arguments in the same order, so its outputs are that run's bit for bit
// (tests/models/test_decoder_fast_path.py checks it).
//
// A linear is one of the methods the layers compute with (llmplug.layers.decoder.native_stack): llmplug's int4
// or W4A8 matmul (then its bias added), oneDNN's packed linear (mkldnn::_linear_pointwise) or F.linear
// (at::linear), the last two called by their row plan (layers/row_invariance.py RowPlan: fewer rows than
// `min_rows` padded with zero rows, or the rows in calls of exactly `tile`, the last padded). The kernels are reached
// through the dispatcher (ops.cpp, int4.cpp, w4a8.cpp, oneDNN): a typed handle where llmplug registered the kernel,
// a boxed call for oneDNN's, looked up once.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
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
  using CacheAndAttend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                                    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                    int64_t, int64_t, const std::optional<at::Tensor>&);
  c10::TypedOperatorHandle<CacheAndAttend> cache_and_attend = kernel<CacheAndAttend>("llmplug_cpu::cache_and_attend");
  c10::OperatorHandle packed_linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                      int64_t)>
      amx_linear = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                     int64_t)>("llmplug_cpu::amx_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                      int64_t)>
      amx_linear_silu_and_mul = kernel<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                  const std::optional<at::Tensor>&, int64_t)>(
          "llmplug_cpu::amx_linear_silu_and_mul");
  using AmxLinearRotary = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                     const at::Tensor&, const at::Tensor&, int64_t, int64_t);
  c10::TypedOperatorHandle<AmxLinearRotary> amx_linear_rotary =
      kernel<AmxLinearRotary>("llmplug_cpu::amx_linear_rotary");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)> w4a8_matmul =
      kernel<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("llmplug_cpu::w4a8_matmul");

  static const Kernels& get() {
    static const Kernels kernels;  // after the library's registrations: the first run, never at load
    return kernels;
  }
};

// native_stack.py's numbering
enum class LinearKind : int64_t { kInt4 = 0, kPacked = 1, kDense = 2, kAmx = 3, kW4A8 = 4 };

// One linear: int4 (weights: qweight, scales, zeros in NativeInt4's layout), oneDNN packed (weights: the packed
// weight), dense (weights: the weight), AMX (weights: amx_linear's packed tiles; group_size: its out_features) or
// W4A8 (weights: w4a8_matmul's packed blocks; group_size: its out_features);
// its bias (undefined: none); its row plan's min_rows and tile (oneDNN and dense kinds; tile 0: none)
struct Linear {
  LinearKind kind;
  at::Tensor w0, w1, w2, bias;
  int64_t group_size, min_rows, tile;

  at::Tensor operator()(const Kernels& k, const at::Tensor& x) const {
    if (kind == LinearKind::kInt4 || kind == LinearKind::kW4A8) {
      at::Tensor y = kind == LinearKind::kInt4 ? k.int4_matmul.call(x, w0, w1, w2, group_size)
                                               : k.w4a8_matmul.call(x, w0, group_size);
      if (bias.defined()) y.add_(bias);  // as Int4LinearMethod: y += bias
      return y;
    }
    if (kind == LinearKind::kAmx) return k.amx_linear.call(x, w0, bias_or_none(), group_size);  // no plan needed
    const int64_t rows = x.size(0);  // as RowPlan calls the matmul
    if (tile > 0) {  // calls of exactly `tile` rows, the last one padded with zero rows
      const at::Tensor padded = pad(x, (rows + tile - 1) / tile * tile);
      std::vector<at::Tensor> parts;
      for (const at::Tensor& part : padded.split(tile)) parts.push_back(dense(k, part));
      return at::cat(parts).narrow(0, 0, rows);
    }
    if (rows < min_rows) return dense(k, pad(x, min_rows)).narrow(0, 0, rows);  // fewer rows padded
    return dense(k, x);
  }

  // silu_and_mul of this linear's x (a gate_up's): one call where the kind is AMX and the gate and up halves are
  // whole tiles (fast_path._silu_and_mul_of), the same bits.
  at::Tensor silu_and_mul(const Kernels& k, const at::Tensor& x) const {
    if (kind == LinearKind::kAmx && group_size % 32 == 0)
      return k.amx_linear_silu_and_mul.call(x, w0, bias_or_none(), group_size);
    return k.silu_and_mul.call((*this)(k, x));
  }

  // This linear's x (a qkv's) with its first `columns` outputs (heads of head_dim) rotated rotate-half by cos and sin
  // [T, 1, head_dim]: one call where the kind is AMX and the rotary takes whole heads of a multiple of 32 dims
  // (fast_path._qkv_rotated), the same bits as the product and rotary_embedding; an undefined tensor elsewhere.
  at::Tensor rotated(const Kernels& k, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool neox,
                     int64_t columns, int64_t head_dim) const {
    if (kind != LinearKind::kAmx || !neox || head_dim % 32 != 0 || cos.size(-1) != head_dim) return {};
    return k.amx_linear_rotary.call(x, w0, bias_or_none(), group_size, cos, sin, columns, head_dim);
  }

 private:
  static at::Tensor pad(const at::Tensor& x, int64_t rows) {  // row_invariance._pad_rows
    return x.size(0) == rows ? x : at::cat({x, x.new_zeros({rows - x.size(0), x.size(1)})});
  }

  at::Tensor dense(const Kernels& k, const at::Tensor& x) const {
    return kind == LinearKind::kDense ? at::linear(x, w0, bias_or_none()) : packed(k, x);
  }

  std::optional<at::Tensor> bias_or_none() const { return bias.defined() ? std::optional(bias) : std::nullopt; }

  at::Tensor packed(const Kernels& k, const at::Tensor& x) const {  // packed_linear.py's _packed_linear
    torch::jit::Stack stack{x, w0, bias_or_none(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                            std::optional<std::string>("")};
    k.packed_linear.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

struct Layer {
  at::Tensor input_norm, mlp_norm, kv_cache;
  double input_eps, mlp_eps, scale;
  Linear qkv, o, gate_up, down;
  int64_t q_size, kv_size, head_dim, rotary_heads, rope, window, chunk;  // rope: index into the step's ropes, -1: none
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  // One layer's parts, in run order. linears: qkv's, o's, gate_up's and down's three weight tensors each (unused
  // ones empty); biases: theirs (4), an empty tensor for none; linear_ints: each linear's kind, group size (int4),
  // min_rows and tile (dense kinds), 16 in all; ints: q_size, kv_size, head_dim, rotary_heads, rope, window, chunk;
  // floats: input_eps, mlp_eps, the attention's scale.
  void add_layer(at::Tensor input_norm, at::Tensor mlp_norm, at::Tensor kv_cache, std::vector<at::Tensor> linears,
                 std::vector<at::Tensor> biases, std::vector<int64_t> linear_ints, std::vector<int64_t> ints,
                 std::vector<double> floats) {
    TORCH_CHECK(linears.size() == 12 && biases.size() == 4 && linear_ints.size() == 16 && ints.size() == 7 &&
                    floats.size() == 3,
                "llmplug_cpu::DecoderStack.add_layer: 12 linear tensors, 4 biases, 16 linear ints, 7 ints and 3 "
                "floats expected");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
                "llmplug_cpu::DecoderStack.add_layer: a two-plane kv_cache [2, Hkv, blocks, block_size, D] expected");
    auto linear = [&](int i) {
      const int64_t kind = linear_ints[4 * i];
      TORCH_CHECK(kind >= 0 && kind <= 4, "llmplug_cpu::DecoderStack.add_layer: unknown linear kind ", kind);
      const at::Tensor& bias = biases[i];
      return Linear{static_cast<LinearKind>(kind), linears[3 * i], linears[3 * i + 1], linears[3 * i + 2],
                    bias.numel() ? bias : at::Tensor(), linear_ints[4 * i + 1], linear_ints[4 * i + 2],
                    linear_ints[4 * i + 3]};
    };
    layers_.push_back(Layer{input_norm, mlp_norm, kv_cache, floats[0], floats[1], floats[2], linear(0), linear(1),
                            linear(2), linear(3), ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6]});
  }

  // Every layer on hidden [T, hidden] (and the residual stream, none before the first layer) -> the last layer's
  // (output, residual). ropes: each rotation's cos, sin [T, 1, R] and whether it is rotate-half; the attention
  // metadata as cache_and_attend takes it (prompt_lens: each request's prompt length, or none).
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, std::optional<at::Tensor> residual_in,
                                         std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                         std::vector<int64_t> neox, at::Tensor slot_mapping, at::Tensor block_tables,
                                         at::Tensor query_start_loc, at::Tensor seq_lens,
                                         std::optional<at::Tensor> prompt_lens) {
    const Kernels& k = Kernels::get();
    at::Tensor residual = residual_in.value_or(at::Tensor());
    for (const Layer& layer : layers_) {
      at::Tensor x = residual.defined() ? k.fused_add_rms_norm.call(hidden, residual, layer.input_norm, layer.input_eps)
                                        : k.rms_norm.call(hidden, layer.input_norm, layer.input_eps);
      residual = hidden;  // the stream: the first layer's input, else hidden + residual written into hidden
      const int64_t k_end = layer.q_size + layer.kv_size;
      at::Tensor qkv;
      if (layer.rope < 0) {
        qkv = layer.qkv(k, x);
      } else {
        const auto r = static_cast<size_t>(layer.rope);
        qkv = layer.qkv.rotated(k, x, cos[r], sin[r], neox[r] != 0, k_end, layer.head_dim);
        if (!qkv.defined()) {
          qkv = layer.qkv(k, x);
          k.rotary_embedding.call(qkv.narrow(1, 0, k_end).view({qkv.size(0), layer.rotary_heads, layer.head_dim}),
                                  cos[r], sin[r], neox[r] != 0);
        }
      }
      const at::Tensor attended = k.cache_and_attend.call(
          qkv.narrow(1, 0, layer.q_size), qkv.narrow(1, layer.q_size, layer.kv_size),
          qkv.narrow(1, k_end, qkv.size(1) - k_end), layer.kv_cache, slot_mapping, block_tables, query_start_loc,
          seq_lens, layer.scale, layer.window, layer.chunk, prompt_lens);
      hidden = layer.o(k, attended);
      x = k.fused_add_rms_norm.call(hidden, residual, layer.mlp_norm, layer.mlp_eps);
      residual = hidden;
      hidden = layer.down(k, layer.gate_up.silu_and_mul(k, x));
    }
    return {hidden, residual};
  }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmplug_cpu, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("run", &DecoderStack::run);
}
