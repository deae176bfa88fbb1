// Runs ATen operators by name through libtorch's dispatcher: the one piece of C++ a node needs
// to run a graph (executor/src/graph). No TorchScript compiler or interpreter is involved.
//
// A `djinn_call` is one node of a graph, prepared once: the operator handle and an argument
// stack in the schema's order, its constants and defaults filled in. A run copies that stack
// (reference counts only), puts the arguments that vary (tensors, sizes) in their slots and
// calls, so the prepared call never changes and holds no run's tensors.
//
// Tensors cross as `at::Tensor*`, which is what tch's `C_tensor` is: borrowed on the way in,
// new (owned by the caller, freed with tch's `at_free`) on the way out.

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/ExpandUtils.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

// A Python number where the schema has a Tensor, as Python's argument parser passes it: a CPU
// scalar tensor marked as a wrapped number, which takes part in type promotion as a number.
at::Tensor wrapped_number(const c10::Scalar& s) {
    at::Tensor t = c10::scalar_to_tensor(s);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
}

// The device a type code from Rust names: 0 the CPU, 1 CUDA device `index`, 2 the meta device
// (sizes and dtypes only, no memory: what a run's plan is computed on).
c10::Device device_of(int32_t type, int32_t index) {
    switch (type) {
        case 1: return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
        case 2: return c10::Device(c10::kMeta);
        default: return c10::Device(c10::kCPU);
    }
}

char* copy_message(const std::string& s) {
    char* out = static_cast<char*>(std::malloc(s.size() + 1));
    if (out != nullptr) {
        std::memcpy(out, s.c_str(), s.size() + 1);
    }
    return out;
}

// Runs `f`, turning any exception into an error message for Rust; returns 0 on success.
template <typename F>
int guarded(char** err, F&& f) {
    try {
        f();
        return 0;
    } catch (const c10::Error& e) {
        *err = copy_message(e.what_without_backtrace());
    } catch (const std::exception& e) {
        *err = copy_message(e.what());
    } catch (...) {
        *err = copy_message("unknown C++ exception");
    }
    return 1;
}

// A size (SymInt) at or below -2^62 is how c10 marks a symbolic one: its bits are read as a
// pointer to a SymNode. libtorch unpacks a SymInt[] argument from a list of ints unchecked
// (as_strided's meta kernel took [-2^63] for a symbolic size, and the tensor it made threw on
// reading its sizes; another value is another pointer), so no such value reaches a kernel.
void check_sym_ints(const c10::Argument& argument, const c10::IValue& value) {
    c10::TypePtr type = argument.real_type();
    if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
    if (auto list = type->cast<c10::ListType>()) type = list->getElementType();
    if (type->kind() != c10::TypeKind::SymIntType) return;
    auto check = [&](const c10::IValue& v) {
        TORCH_CHECK(!v.isInt() || c10::SymInt::check_range(v.toInt()), "argument '", argument.name(), "': ",
                    v.toInt(), " is not a size (libtorch takes one below -2^62 for a pointer)");
    };
    if (value.isList()) {
        for (const auto& item : value.toListRef()) check(item);
    } else {
        check(value);
    }
}

}  // namespace

// Meta kernels for the allowlisted operators that libtorch's C++ has none for (PyTorch keeps
// theirs in Python, torch/_meta_registrations.py, which a node does not have): each gives the
// output's sizes and dtype from its arguments', so that a run's plan goes past them. Boxed, so
// that no C++ signature has to match each libtorch's exactly; an argument that is not what the
// kernel expects fails the plan at that operator, never the node.
namespace meta {

using Stack = torch::jit::Stack;

std::vector<int64_t> ints(const c10::IValue& v) {
    std::vector<int64_t> out;
    for (const auto& item : v.toListRef()) {
        out.push_back(item.isInt() ? item.toInt() : item.toSymInt().guard_int(__FILE__, __LINE__));
    }
    return out;
}

const c10::IValue& arg(const Stack* stack, size_t n, size_t i) { return (*stack)[stack->size() - n + i]; }

void give(Stack* stack, size_t n, at::Tensor out) {
    torch::jit::drop(*stack, n);
    torch::jit::push(*stack, std::move(out));
}

at::Tensor empty(c10::IntArrayRef sizes, at::ScalarType dtype) {
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(c10::kMeta));
}

size_t arity(const c10::OperatorHandle& op) { return op.schema().arguments().size(); }

// Same sizes and dtype as the first argument (relu, hardtanh, flip).
void like_self(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& self = arg(stack, n, 0).toTensor();
    give(stack, n, empty(self.sizes(), self.scalar_type()));
}

void is_nan(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    give(stack, n, empty(arg(stack, n, 0).toTensor().sizes(), at::kBool));
}

// Broadcast over the tensor arguments, the dtype promoted from the first two (numbers as
// Python's type promotion treats them): shifts, floor_divide, rsub, remainder, where.
void broadcast(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    std::vector<int64_t> sizes;
    std::vector<c10::IValue> operands;
    for (size_t i = 0; i < n; ++i) {
        const c10::IValue& v = arg(stack, n, i);
        if (v.isTensor()) {
            sizes = at::infer_size(sizes, v.toTensor().sizes());
        }
        if (v.isTensor() || v.isScalar()) {
            operands.push_back(v);
        }
    }
    // where(condition, self, other): the condition takes no part in the dtype.
    size_t first = op.schema().name() == "aten::where" ? 1 : 0;
    TORCH_CHECK(operands.size() >= first + 2, "two operands");
    const c10::IValue& a = operands[first];
    const c10::IValue& b = operands[first + 1];
    at::ScalarType dtype;
    if (a.isTensor() && b.isTensor()) {
        dtype = at::result_type(a.toTensor(), b.toTensor());
    } else if (a.isTensor()) {
        dtype = at::result_type(a.toTensor(), b.toScalar());
    } else {
        dtype = at::result_type(a.toScalar(), b.toTensor());
    }
    give(stack, n, empty(sizes, dtype));
}

void index_select(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& self = arg(stack, n, 0).toTensor();
    int64_t dim = arg(stack, n, 1).toInt();
    const at::Tensor& index = arg(stack, n, 2).toTensor();
    std::vector<int64_t> sizes = self.sizes().vec();
    if (!sizes.empty()) {
        sizes[c10::maybe_wrap_dim(dim, self.dim())] = index.numel();
    }
    give(stack, n, empty(sizes, self.scalar_type()));
}

// A reduction to one element (max, min, prod); prod's dtype as torch's: integers to int64.
void to_scalar(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& self = arg(stack, n, 0).toTensor();
    at::ScalarType dtype = self.scalar_type();
    if (op.schema().name() == "aten::prod") {
        const c10::IValue& given = arg(stack, n, 1);
        dtype = !given.isNone() ? given.toScalarType()
                : at::isIntegralType(dtype, /*includeBool=*/true) ? at::kLong : dtype;
    }
    give(stack, n, empty({}, dtype));
}

// var.correction(self, dim?, correction?, keepdim): a float of the reduced sizes. A 0-dim
// tensor reduces over dimension 0 or -1 (as libtorch wraps them) to a 0-dim result.
void variance(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& self = arg(stack, n, 0).toTensor();
    const c10::IValue& dims = arg(stack, n, 1);
    bool keepdim = arg(stack, n, 3).toBool();
    std::vector<bool> reduced(self.dim(), dims.isNone());
    if (!dims.isNone()) {
        std::vector<int64_t> given = ints(dims);
        // maybe_wrap_dim throws past the rank; for a 0-dim tensor it admits 0 and -1, which
        // index no size here.
        for (int64_t d : given) {
            int64_t wrapped = c10::maybe_wrap_dim(d, self.dim());
            if (wrapped < self.dim()) reduced[wrapped] = true;
        }
        if (given.empty()) std::fill(reduced.begin(), reduced.end(), true);
    }
    std::vector<int64_t> sizes;
    for (int64_t d = 0; d < self.dim(); ++d) {
        if (!reduced[d]) sizes.push_back(self.size(d));
        else if (keepdim) sizes.push_back(1);
    }
    give(stack, n, empty(sizes, at::toRealValueType(self.scalar_type())));
}

// _adaptive_avg_pool2d/3d(self, output_size): the leading sizes, then the output size.
void adaptive_pool(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& self = arg(stack, n, 0).toTensor();
    std::vector<int64_t> out = ints(arg(stack, n, 1));
    TORCH_CHECK(static_cast<int64_t>(out.size()) <= self.dim(), "output size longer than the input's rank");
    std::vector<int64_t> sizes(self.sizes().begin(), self.sizes().end() - out.size());
    sizes.insert(sizes.end(), out.begin(), out.end());
    give(stack, n, empty(sizes, self.scalar_type()));
}

// reflection_pad2d(self, [left, right, top, bottom]).
void reflection_pad(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& self = arg(stack, n, 0).toTensor();
    std::vector<int64_t> pad = ints(arg(stack, n, 1));
    TORCH_CHECK(pad.size() == 4 && self.dim() >= 2, "reflection_pad2d's padding");
    std::vector<int64_t> sizes = self.sizes().vec();
    sizes[sizes.size() - 1] += pad[0] + pad[1];
    sizes[sizes.size() - 2] += pad[2] + pad[3];
    give(stack, n, empty(sizes, self.scalar_type()));
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding,
// groups): libtorch picks a backend's kernel by device, and the meta device has none.
void convolution(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& input = arg(stack, n, 0).toTensor();
    const at::Tensor& weight = arg(stack, n, 1).toTensor();
    std::vector<int64_t> stride = ints(arg(stack, n, 3)), padding = ints(arg(stack, n, 4));
    std::vector<int64_t> dilation = ints(arg(stack, n, 5)), output_padding = ints(arg(stack, n, 7));
    bool transposed = arg(stack, n, 6).toBool();
    const c10::IValue& g = arg(stack, n, 8);
    int64_t groups = g.isInt() ? g.toInt() : g.toSymInt().guard_int(__FILE__, __LINE__);
    int64_t spatial = input.dim() - 2;
    TORCH_CHECK(spatial >= 1 && weight.dim() == input.dim(), "convolution's ranks");
    // Each list has one entry, or one per spatial dimension (as libtorch expands them); checked
    // before the arithmetic below, as libtorch checks them before it runs.
    for (const auto* v : {&stride, &padding, &dilation, &output_padding}) {
        TORCH_CHECK(v->size() <= 1 || static_cast<int64_t>(v->size()) == spatial,
                    "a convolution's stride, padding, dilation or output padding has ", v->size(),
                    " entries for ", spatial, " spatial dimensions");
    }
    auto positive = [](const std::vector<int64_t>& v) { return std::all_of(v.begin(), v.end(), [](int64_t x) { return x > 0; }); };
    auto non_negative = [](const std::vector<int64_t>& v) { return std::all_of(v.begin(), v.end(), [](int64_t x) { return x >= 0; }); };
    TORCH_CHECK(positive(stride) && positive(dilation) && groups > 0, "non-positive stride, dilation or groups");
    TORCH_CHECK(non_negative(padding) && non_negative(output_padding), "negative padding");
    auto at_or = [](const std::vector<int64_t>& v, int64_t i, int64_t otherwise) {
        return v.empty() ? otherwise : v[v.size() == 1 ? 0 : i];
    };
    // Sizes past what a tensor can hold fail here, not by overflowing the arithmetic.
    auto checked = [](bool overflowed) { TORCH_CHECK(!overflowed, "a convolution's output size overflows"); };
    int64_t channels = weight.size(0);
    if (transposed) checked(c10::mul_overflows(weight.size(1), groups, &channels));
    std::vector<int64_t> sizes{input.size(0), channels};
    for (int64_t d = 0; d < spatial; ++d) {
        int64_t in = input.size(d + 2), k = weight.size(d + 2);
        int64_t s = at_or(stride, d, 1), p = at_or(padding, d, 0), dl = at_or(dilation, d, 1);
        int64_t span = 0, out = 0, twice_p = 0;
        checked(c10::mul_overflows(dl, k - 1, &span) || c10::mul_overflows(p, int64_t{2}, &twice_p));
        if (transposed) {
            checked(c10::mul_overflows(in - 1, s, &out) || c10::add_overflows(out, span, &out) ||
                    c10::add_overflows(out, at_or(output_padding, d, 0), &out) ||
                    c10::add_overflows(out, int64_t{1} - twice_p, &out));
        } else {
            checked(c10::add_overflows(in, twice_p, &out));
            out = (out - span - 1) / s + 1;
        }
        sizes.push_back(out);
    }
    give(stack, n, empty(sizes, input.scalar_type()));
}

// Normalisations: the output like the input; the saved statistics as `stats` sizes them.
void give_normalised(Stack* stack, size_t n, const at::Tensor& input, c10::IntArrayRef stats) {
    at::ScalarType dtype = input.scalar_type();
    at::Tensor out = empty(input.sizes(), dtype), a = empty(stats, dtype), b = empty(stats, dtype);
    torch::jit::drop(*stack, n);
    torch::jit::push(*stack, std::move(out), std::move(a), std::move(b));
}

// native_layer_norm(input, normalized_shape, ...): statistics per leading index.
void layer_norm(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& input = arg(stack, n, 0).toTensor();
    int64_t normalised = static_cast<int64_t>(ints(arg(stack, n, 1)).size());
    TORCH_CHECK(normalised <= input.dim(), "normalized_shape longer than the input's rank");
    std::vector<int64_t> stats(input.sizes().begin(), input.sizes().end() - normalised);
    stats.resize(input.dim(), 1);
    give_normalised(stack, n, input, stats);
}

// _native_batch_norm_legit_no_training: with running statistics, none are saved.
void batch_norm_eval(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    give_normalised(stack, n, arg(stack, n, 0).toTensor(), {0});
}

int64_t int_of(const c10::IValue& v) { return v.isInt() ? v.toInt() : v.toSymInt().guard_int(__FILE__, __LINE__); }

// _native_batch_norm_legit.no_stats and native_group_norm: statistics per channel (per
// sample and group), at most the input's size; bounded by the channels here.
// native_group_norm(input, weight?, bias?, N, C, HxW, group, eps): its statistics are [N, group],
// from the arguments as libtorch takes them, so they are checked as libtorch checks them first
// (and N * C * HxW without overflow): a group of 2^63 - 1 made two statistics of 2^63 bytes each,
// whose sum overflowed the plan's count (graph_exec's finding).
void batch_norm_stats(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& input = arg(stack, n, 0).toTensor();
    int64_t channels = input.dim() > 1 ? input.size(1) : 1;
    if (op.schema().name() == "aten::native_group_norm") {
        int64_t N = int_of(arg(stack, n, 3)), C = int_of(arg(stack, n, 4)), HxW = int_of(arg(stack, n, 5));
        int64_t group = arg(stack, n, 6).toInt(), NC = 0, NCHxW = 0;
        TORCH_CHECK(N >= 0 && C >= 0 && HxW >= 0, "native_group_norm: negative N, C or HxW");
        TORCH_CHECK(group > 0 && C % group == 0, "native_group_norm: ", C, " channels in ", group, " groups");
        TORCH_CHECK(!c10::mul_overflows(N, C, &NC) && !c10::mul_overflows(NC, HxW, &NCHxW) && NCHxW == input.numel(),
                    "native_group_norm: N * C * HxW is not the input's ", input.numel(), " elements");
        give_normalised(stack, n, input, {N, group});
    } else {
        give_normalised(stack, n, input, {channels});
    }
}

// scaled_dot_product_attention(query [.., L, E], key, value [.., S, Ev]) -> [.., L, Ev].
void attention(const c10::OperatorHandle& op, Stack* stack) {
    size_t n = arity(op);
    const at::Tensor& query = arg(stack, n, 0).toTensor();
    const at::Tensor& value = arg(stack, n, 2).toTensor();
    TORCH_CHECK(query.dim() >= 2 && value.dim() >= 2, "attention's ranks");
    std::vector<int64_t> sizes = query.sizes().vec();
    sizes.back() = value.size(-1);
    if (sizes.size() != 4) {
        give(stack, n, empty(sizes, query.scalar_type()));
        return;
    }
    // As the fused kernels lay it out: [batch, query, head, dim] in memory, heads second in sizes.
    at::Tensor out = empty({sizes[0], sizes[2], sizes[1], sizes[3]}, query.scalar_type()).transpose(1, 2);
    give(stack, n, std::move(out));
}

}  // namespace meta

struct djinn_call {
    c10::OperatorHandle op;
    std::vector<c10::IValue> args;
    // A plan's call: its wrapped numbers are made meta tensors before it runs, or an operator
    // whose only tensors are numbers (`repeat` of a number) would compute on real memory.
    bool on_meta = false;
    explicit djinn_call(c10::OperatorHandle handle) : op(std::move(handle)) {}
};

// One output value, flattened: a list is a LIST entry with its length, then its items.
enum djinn_out_tag : int32_t { OUT_NONE = 0, OUT_TENSOR = 1, OUT_INT = 2, OUT_DOUBLE = 3, OUT_BOOL = 4, OUT_LIST = 5 };
struct djinn_out {
    int32_t tag;
    int64_t i;
    double d;
    at::Tensor* tensor;
};

extern "C" {

void djinn_free_message(char* message) { std::free(message); }

// Registers the meta kernels above with the dispatcher, once per process (the library stays
// registered for the process's life). Returns 0, or 1 with a message.
int djinn_register_meta_kernels(char** err) {
    return guarded(err, [] {
        static torch::Library* library = [] {
            auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__);
            using F = torch::CppFunction;
            for (const char* name : {"relu", "hardtanh", "flip"}) lib->impl(name, F::makeFromBoxedFunction<&meta::like_self>());
            lib->impl("isnan", F::makeFromBoxedFunction<&meta::is_nan>());
            for (const char* name : {"where.self", "__lshift__.Scalar", "__lshift__.Tensor", "__rshift__.Scalar",
                                     "__rshift__.Tensor", "floor_divide", "rsub.Tensor", "remainder.Scalar_Tensor"}) {
                lib->impl(name, F::makeFromBoxedFunction<&meta::broadcast>());
            }
            lib->impl("index_select", F::makeFromBoxedFunction<&meta::index_select>());
            for (const char* name : {"max", "min", "prod"}) lib->impl(name, F::makeFromBoxedFunction<&meta::to_scalar>());
            lib->impl("var.correction", F::makeFromBoxedFunction<&meta::variance>());
            for (const char* name : {"_adaptive_avg_pool2d", "_adaptive_avg_pool3d"}) {
                lib->impl(name, F::makeFromBoxedFunction<&meta::adaptive_pool>());
            }
            lib->impl("reflection_pad2d", F::makeFromBoxedFunction<&meta::reflection_pad>());
            lib->impl("convolution", F::makeFromBoxedFunction<&meta::convolution>());
            lib->impl("native_layer_norm", F::makeFromBoxedFunction<&meta::layer_norm>());
            lib->impl("_native_batch_norm_legit_no_training", F::makeFromBoxedFunction<&meta::batch_norm_eval>());
            for (const char* name : {"_native_batch_norm_legit.no_stats", "native_group_norm"}) {
                lib->impl(name, F::makeFromBoxedFunction<&meta::batch_norm_stats>());
            }
            lib->impl("scaled_dot_product_attention", F::makeFromBoxedFunction<&meta::attention>());
            return lib;
        }();
        (void)library;
    });
}

// A generator of its own for one request's run on a device (type: 0 CPU, 1 CUDA), seeded with
// `seed`: a copy of the device's default generator's kind, never the default itself, so no
// request's draws depend on or reveal another's.
at::Generator* djinn_generator_new(int32_t type, int32_t index, uint64_t seed, char** err) {
    at::Generator* out = nullptr;
    guarded(err, [&] {
        at::Device device = device_of(type, index);
        at::Generator base = at::globalContext().defaultGenerator(device);
        at::Generator gen;
        {
            std::lock_guard<std::mutex> lock(base.mutex());
            gen = base.clone();
        }
        gen.set_current_seed(seed);
        out = new at::Generator(std::move(gen));
    });
    return out;
}

void djinn_generator_free(at::Generator* gen) { delete gen; }

// Prepares a call of `name`.`overload` ("" for the default overload). Writes the operator's
// schema as the dispatcher has it into `*schema` (the caller compares it with the allowlist's).
djinn_call* djinn_call_new(const char* name, const char* overload, char** schema, char** err) {
    djinn_call* call = nullptr;
    guarded(err, [&] {
        auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
        std::ostringstream s;
        s << handle.schema();
        *schema = copy_message(s.str());
        call = new djinn_call(handle);
        call->args.resize(handle.schema().arguments().size());
        // Defaults from the schema; the runner overwrites what the graph gives.
        const auto& arguments = handle.schema().arguments();
        for (size_t i = 0; i < arguments.size(); ++i) {
            if (arguments[i].default_value().has_value()) {
                call->args[i] = *arguments[i].default_value();
            }
        }
    });
    return call;
}

void djinn_call_free(djinn_call* call) { delete call; }

// A tensor on the meta device with `t`'s sizes, strides and dtype: an input of a run's plan.
at::Tensor* djinn_meta_like(const at::Tensor* t, char** err) {
    at::Tensor* out = nullptr;
    guarded(err, [&] {
        out = new at::Tensor(at::empty_strided(t->sizes(), t->strides(), t->options().device(c10::kMeta)));
    });
    return out;
}

// A CPU tensor of `nbytes` bytes (uint8) over `data`, whose memory `context` owns: `release`
// is called on `context` once, when no tensor uses the memory any more, however the tensors
// that view it were shared (at once if the tensor could not be made). Memory that Rust owns
// then lives as long as any tensor over it, never shorter.
at::Tensor* djinn_owned_bytes(void* data, int64_t nbytes, void* context, void (*release)(void*), char** err) {
    std::shared_ptr<void> owner(context, release);
    at::Tensor* out = nullptr;
    guarded(err, [&] {
        auto options = at::TensorOptions().dtype(at::kByte).device(c10::kCPU);
        out = new at::Tensor(at::from_blob(data, {nbytes}, [owner](void*) {}, options));
    });
    return out;
}

// What memory `t` is a view of: its storage's identity and length in bytes (tensors that share
// a storage share the memory; a meta tensor's storage has a length and no data).
void djinn_tensor_storage(const at::Tensor* t, uintptr_t* id, uint64_t* nbytes) {
    if (!t->defined() || !t->has_storage()) {
        *id = 0;
        *nbytes = 0;
        return;
    }
    const c10::Storage& storage = t->storage();
    *id = reinterpret_cast<uintptr_t>(storage.unsafeGetStorageImpl());
    *nbytes = static_cast<uint64_t>(storage.nbytes());
}

// Setters of the constant argument `i`, at preparation (the caller checked `i` against the
// schema's arity). Tensors are never constants: weights are values of the graph.
void djinn_call_set_none(djinn_call* c, size_t i) { c->args[i] = c10::IValue(); }
void djinn_call_set_int(djinn_call* c, size_t i, int64_t v) { c->args[i] = c10::IValue(v); }
void djinn_call_set_double(djinn_call* c, size_t i, double v) { c->args[i] = c10::IValue(v); }
void djinn_call_set_bool(djinn_call* c, size_t i, bool v) { c->args[i] = c10::IValue(v); }
void djinn_call_set_wrapped_int(djinn_call* c, size_t i, int64_t v) { c->args[i] = c10::IValue(wrapped_number(v)); }
void djinn_call_set_wrapped_double(djinn_call* c, size_t i, double v) { c->args[i] = c10::IValue(wrapped_number(v)); }
void djinn_call_set_wrapped_bool(djinn_call* c, size_t i, bool v) { c->args[i] = c10::IValue(wrapped_number(v)); }
void djinn_call_plan_on_meta(djinn_call* c) { c->on_meta = true; }
void djinn_call_set_device(djinn_call* c, size_t i, int32_t type, int32_t index) {
    c->args[i] = c10::IValue(device_of(type, index));
}
void djinn_call_set_string(djinn_call* c, size_t i, const char* s) { c->args[i] = c10::IValue(std::string(s)); }
void djinn_call_set_int_list(djinn_call* c, size_t i, const int64_t* v, size_t n) {
    c->args[i] = c10::IValue(std::vector<int64_t>(v, v + n));
}
void djinn_call_set_double_list(djinn_call* c, size_t i, const double* v, size_t n) {
    c->args[i] = c10::IValue(std::vector<double>(v, v + n));
}
void djinn_call_set_bool_list(djinn_call* c, size_t i, const bool* v, size_t n) {
    c10::List<bool> list;
    for (size_t k = 0; k < n; ++k) list.push_back(v[k]);
    c->args[i] = c10::IValue(std::move(list));
}
// An argument that varies from run to run (it names a value of the graph), for slot `index`.
enum djinn_arg_kind : int32_t {
    ARG_NONE = 0, ARG_INT = 1, ARG_DOUBLE = 2, ARG_BOOL = 3, ARG_TENSOR = 4,
    ARG_INT_LIST = 5, ARG_DOUBLE_LIST = 6, ARG_TENSOR_LIST = 7, ARG_OPT_TENSOR_LIST = 8,
    ARG_WRAPPED_INT = 9, ARG_WRAPPED_DOUBLE = 10, ARG_WRAPPED_BOOL = 11, ARG_GENERATOR = 12,
};
struct djinn_arg {
    size_t index;
    int32_t kind;
    int64_t i;
    double d;
    const at::Tensor* tensor;
    const int64_t* ints;
    const double* doubles;
    const at::Tensor* const* tensors;
    size_t len;
    const at::Generator* generator;
};

static c10::IValue to_ivalue(const djinn_arg& a) {
    switch (a.kind) {
        case ARG_INT: return c10::IValue(a.i);
        case ARG_DOUBLE: return c10::IValue(a.d);
        case ARG_BOOL: return c10::IValue(a.i != 0);
        case ARG_TENSOR: return c10::IValue(*a.tensor);
        case ARG_WRAPPED_INT: return c10::IValue(wrapped_number(a.i));
        case ARG_WRAPPED_DOUBLE: return c10::IValue(wrapped_number(a.d));
        case ARG_WRAPPED_BOOL: return c10::IValue(wrapped_number(a.i != 0));
        case ARG_GENERATOR: return c10::IValue(*a.generator);
        case ARG_INT_LIST: return c10::IValue(std::vector<int64_t>(a.ints, a.ints + a.len));
        case ARG_DOUBLE_LIST: return c10::IValue(std::vector<double>(a.doubles, a.doubles + a.len));
        case ARG_TENSOR_LIST: {
            c10::List<at::Tensor> list;
            for (size_t k = 0; k < a.len; ++k) list.push_back(*a.tensors[k]);
            return c10::IValue(std::move(list));
        }
        case ARG_OPT_TENSOR_LIST: {
            c10::List<std::optional<at::Tensor>> list;
            for (size_t k = 0; k < a.len; ++k) {
                list.push_back(a.tensors[k] == nullptr ? std::optional<at::Tensor>() : std::optional<at::Tensor>(*a.tensors[k]));
            }
            return c10::IValue(std::move(list));
        }
        default: return c10::IValue();
    }
}

// Calls the operator under inference mode on the prepared arguments with `varying` put in
// their slots (the prepared call is not changed: runs may share it across threads). Writes at
// most `cap` flattened outputs into `outs` and their count into `*n`; output tensors are new
// and the caller's.
int djinn_call_run(const djinn_call* c, const djinn_arg* varying, size_t n_varying, djinn_out* outs, size_t cap,
                   size_t* n, char** err) {
    size_t count = 0;
    int rc = guarded(err, [&] {
        c10::InferenceMode guard;
        torch::jit::Stack stack(c->args.begin(), c->args.end());
        for (size_t k = 0; k < n_varying; ++k) {
            TORCH_CHECK(varying[k].index < stack.size(), "argument slot out of range");
            stack[varying[k].index] = to_ivalue(varying[k]);
        }
        if (c->on_meta) {
            for (auto& v : stack) {
                if (!v.isTensor() || v.toTensor().is_meta()) continue;
                const at::Tensor& t = v.toTensor();
                at::Tensor meta = at::empty(t.sizes(), t.options().device(c10::kMeta));
                meta.unsafeGetTensorImpl()->set_wrapped_number(t.unsafeGetTensorImpl()->is_wrapped_number());
                v = c10::IValue(std::move(meta));
            }
        }
        const auto& arguments = c->op.schema().arguments();
        for (size_t k = 0; k < arguments.size() && k < stack.size(); ++k) check_sym_ints(arguments[k], stack[k]);
        c->op.callBoxed(&stack);
        auto push = [&](const c10::IValue& v, auto& self) -> void {
            TORCH_CHECK(count < cap, "the operator returned more values than the graph expects");
            djinn_out& o = outs[count++];
            o = djinn_out{OUT_NONE, 0, 0.0, nullptr};
            if (v.isTensor()) {
                o.tag = OUT_TENSOR;
                o.tensor = new at::Tensor(v.toTensor());
            } else if (v.isInt()) {
                o.tag = OUT_INT;
                o.i = v.toInt();
            } else if (v.isDouble()) {
                o.tag = OUT_DOUBLE;
                o.d = v.toDouble();
            } else if (v.isBool()) {
                o.tag = OUT_BOOL;
                o.i = v.toBool();
            } else if (v.isList()) {
                auto list = v.toListRef();
                o.tag = OUT_LIST;
                o.i = static_cast<int64_t>(list.size());
                for (const auto& item : list) self(item, self);
            } else if (v.isTuple()) {
                const auto& items = v.toTupleRef().elements();
                o.tag = OUT_LIST;
                o.i = static_cast<int64_t>(items.size());
                for (const auto& item : items) self(item, self);
            } else if (!v.isNone()) {
                TORCH_CHECK(false, "the operator returned a ", v.tagKind(), ", which graphs do not carry");
            }
        };
        for (const auto& v : stack) push(v, push);
    });
    if (rc != 0) {
        // Outputs flattened before the failure are not the caller's: free them.
        for (size_t k = 0; k < count; ++k) delete outs[k].tensor;
        count = 0;
    }
    *n = count;
    return rc;
}

}  // extern "C"
