// DecodeStack: a decode step's whole decoder stack in one call from Python (model/decode_stack.py).
// At one or a few rows a decode step's kernels are short (SmolLM2's layer: about 140 us of
// weights at one row), and calling each from Python (a layer's 11 ops: the norms, 4 linears,
// RoPE, the KV write, attention, SiLU-and-mul, with their views and the attention backend's
// choices) costs about as much again. Here each layer runs the same kernels in the same order,
// called from C++: the elementwise ops and the attention directly (ops.h), each linear through
// the dispatcher with the arguments its module gave at build (`add_linear`: whatever op the
// module's own forward would run for the stack's row count, so any packed or dense format
// plugs in without a line here; a linear whose parts are packed in different formats gives one
// op per part, `add_linear_part`, their outputs concatenated). Same ops, same order, same
// results as the Python forward.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "ops.h"

namespace pagedkv_cpu {
namespace {

// One op of a linear: y = op(..., x, ...), x its argument `x_index`, the op's other arguments
// filled at build from the pools the module gave, in its schema's order.
struct StackOp {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  size_t x_index = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    torch::jit::Stack stack;
    stack.reserve(args.size() + 1);
    stack.insert(stack.end(), args.begin(), args.begin() + x_index);
    stack.emplace_back(x);
    stack.insert(stack.end(), args.begin() + x_index, args.end());
    op.callBoxed(stack);
    return stack[0].toTensor();
  }
};

// One linear: one op (the common case, its output returned as it is), or several on the same x
// (a fused projection whose parts are packed in different formats) whose outputs are
// concatenated along the last dim, then `bias` (if any) added once, as the module's forward.
struct StackLinear {
  std::vector<StackOp> ops;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    if (ops.size() == 1 && !bias.has_value()) return ops[0](x);
    std::vector<at::Tensor> outs;
    outs.reserve(ops.size());
    for (const auto& op : ops) outs.push_back(op(x));
    at::Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, -1);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
};

struct StackLayer {
  at::Tensor input_norm, post_attention_norm;
  std::vector<StackLinear> linears;  // qkv, o, gate_up, down
};

// A schema argument filled from the pools: Tensor / Tensor? from `tensors`, int from `ints`,
// str / str? from `strs`, an optional scalar list empty, anything else its default; an
// argument of another type without a default is an error naming it.
c10::IValue schema_argument(const c10::Argument& arg, const std::string& op,
                            const std::vector<c10::optional<at::Tensor>>& tensors, size_t& ti,
                            const std::vector<int64_t>& ints, size_t& ii,
                            const std::vector<std::string>& strs, size_t& si) {
  const std::string type = arg.type()->str();
  auto take = [&](auto& pool, size_t& i, const char* what) -> const auto& {
    TORCH_CHECK(i < pool.size(), "DecodeStack.add_linear: ", op, " needs more ", what,
                " arguments (for ", arg.name(), ")");
    return pool[i++];
  };
  if (type == "Tensor") {
    const auto& t = take(tensors, ti, "tensor");
    TORCH_CHECK(t.has_value(), "DecodeStack.add_linear: ", op, "'s ", arg.name(),
                " may not be None");
    return *t;
  }
  if (type == "Tensor?") {
    const auto& t = take(tensors, ti, "tensor");
    return t.has_value() ? c10::IValue(*t) : c10::IValue();
  }
  if (type == "int") return take(ints, ii, "int");
  if (type == "str" || type == "str?") return take(strs, si, "str");
  if (type == "Scalar?[]") return c10::List<c10::optional<at::Scalar>>();
  if (arg.default_value().has_value()) return *arg.default_value();
  TORCH_CHECK(false, "DecodeStack.add_linear: ", op, "'s argument ", arg.name(), " of type ", type,
              " cannot be given");
}

// f() under the op's name for torch.profiler (the ops called directly skip the dispatcher,
// which would record them): a profile of a step run here reads as the Python forward's.
template <typename F>
auto recorded(const char* op, F&& f) {
  RECORD_FUNCTION(op, std::vector<c10::IValue>());
  return f();
}

}  // namespace

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
              at::Tensor final_norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        final_norm_(std::move(final_norm)) {}

  // A new last layer with its two RMSNorm weights; its linears follow (add_linear).
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm) {
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), {}});
  }

  // The last layer's next linear (qkv, o, gate_up, down in that order): the op `name`
  // ("namespace::op", overload "" or its name) called with x as its argument `x_index`, its
  // other arguments from the pools in schema order.
  void add_linear(const std::string& name, const std::string& overload, int64_t x_index,
                  std::vector<c10::optional<at::Tensor>> tensors, std::vector<int64_t> ints,
                  std::vector<std::string> strs) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4,
                "DecodeStack.add_linear: add_layer first; a layer has 4 linears");
    StackLinear linear;
    linear.ops.push_back(make_op("add_linear", name, overload, x_index, tensors, ints, strs));
    layers_.back().linears.push_back(std::move(linear));
  }

  // Another op of the last linear, on the same x (arguments as add_linear's): its output
  // follows the earlier ops' along the last dim.
  void add_linear_part(const std::string& name, const std::string& overload, int64_t x_index,
                       std::vector<c10::optional<at::Tensor>> tensors, std::vector<int64_t> ints,
                       std::vector<std::string> strs) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().linears.empty(),
                "DecodeStack.add_linear_part: add_linear first");
    layers_.back().linears.back().ops.push_back(
        make_op("add_linear_part", name, overload, x_index, tensors, ints, strs));
  }

  // The last linear's bias [N], added once to its ops' concatenated outputs.
  void set_linear_bias(at::Tensor bias) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().linears.empty(),
                "DecodeStack.set_linear_bias: add_linear first");
    layers_.back().linears.back().bias = std::move(bias);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The final hidden states [M, hidden] after the final norm, for x [M, hidden] (the token
  // embeddings; used as the residual stream, so changed in place) of M decodes, one token each:
  // every layer writes its new K/V into k_caches[i] / v_caches[i] at `slot_mapping` and attends
  // (paged_decode_attention: `block_tables`, `first_pos[i]`, `seq_lens`) as the Python forward
  // does, with RoPE by `positions` from the cos / signed-sin tables.
  at::Tensor run(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                 std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                 at::Tensor block_tables, std::vector<at::Tensor> first_pos,
                 at::Tensor seq_lens, at::Tensor slot_mapping) const {
    const int64_t n = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n &&
                    static_cast<int64_t>(v_caches.size()) == n &&
                    static_cast<int64_t>(first_pos.size()) == n,
                "DecodeStack.run: one K cache, V cache and first-position tensor per layer");
    for (const auto& layer : layers_)
      TORCH_CHECK(layer.linears.size() == 4, "DecodeStack.run: a layer lacks its linears");
    const int64_t m = x.size(0), qkv_heads = heads_ + 2 * kv_heads_;
    at::Tensor residual = x, h;
    for (int64_t i = 0; i < n; ++i) {
      const StackLayer& layer = layers_[i];
      h = i == 0 ? recorded("pagedkv_cpu::rms_norm",
                            [&] { return rms_norm(x, layer.input_norm, eps_); })
                 : recorded("pagedkv_cpu::add_rms_norm_",
                            [&] { return add_rms_norm_(x, residual, layer.input_norm, eps_); });
      at::Tensor qkv = layer.linears[0](h).view({m, qkv_heads, head_dim_});
      at::Tensor qk = qkv.narrow(1, 0, heads_ + kv_heads_);
      recorded("pagedkv_cpu::rope_", [&] { rope_(qk, positions, cos, sin); });
      recorded("pagedkv_cpu::write_kv_", [&] {
        write_kv_(qkv.narrow(1, heads_, kv_heads_), qkv.narrow(1, heads_ + kv_heads_, kv_heads_),
                  k_caches[i], v_caches[i], slot_mapping);
      });
      at::Tensor out = at::empty({m, heads_, head_dim_}, x.options());
      recorded("pagedkv_cpu::paged_decode_attention", [&] {
        paged_decode_attention(qkv.narrow(1, 0, heads_), k_caches[i], v_caches[i], block_tables,
                               first_pos[i], seq_lens, scale_, out, c10::nullopt);
      });
      at::Tensor o = layer.linears[1](out.view({m, heads_ * head_dim_}));
      h = recorded("pagedkv_cpu::add_rms_norm_", [&] {
        return add_rms_norm_(o, residual, layer.post_attention_norm, eps_);
      });
      at::Tensor gate_up = layer.linears[2](h);
      x = layer.linears[3](
          recorded("pagedkv_cpu::silu_and_mul", [&] { return silu_and_mul(gate_up); }));
    }
    return recorded("pagedkv_cpu::add_rms_norm_",
                    [&] { return add_rms_norm_(x, residual, final_norm_, eps_); });
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor final_norm_;
  std::vector<StackLayer> layers_;

  // The op `name` with its arguments but x filled from the pools (`method`: the caller, for
  // the errors).
  static StackOp make_op(const char* method, const std::string& name,
                         const std::string& overload, int64_t x_index,
                         const std::vector<c10::optional<at::Tensor>>& tensors,
                         const std::vector<int64_t>& ints, const std::vector<std::string>& strs) {
    StackOp op{c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()),
               {}};
    const auto& arguments = op.op.schema().arguments();
    TORCH_CHECK(x_index >= 0 && x_index < static_cast<int64_t>(arguments.size()),
                "DecodeStack.", method, ": ", name, " has no argument ", x_index);
    op.x_index = static_cast<size_t>(x_index);
    size_t ti = 0, ii = 0, si = 0;
    for (size_t a = 0; a < arguments.size(); ++a)
      if (a != op.x_index)
        op.args.push_back(schema_argument(arguments[a], name, tensors, ti, ints, ii, strs, si));
    TORCH_CHECK(ti == tensors.size() && ii == ints.size() && si == strs.size(),
                "DecodeStack.", method, ": ", name, " was given more arguments than it takes");
    return op;
  }
};

}  // namespace pagedkv_cpu

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  using pagedkv_cpu::DecodeStack;
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_linear", &DecodeStack::add_linear)
      .def("add_linear_part", &DecodeStack::add_linear_part)
      .def("set_linear_bias", &DecodeStack::set_linear_bias)
      .def("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run);
}
