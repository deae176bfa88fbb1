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
#include <c10/core/InferenceMode.h>

#include <cstring>
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

}  // namespace

struct djinn_call {
    c10::OperatorHandle op;
    std::vector<c10::IValue> args;
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

// A generator of its own for one request's run on a device (type: 0 CPU, 1 CUDA), seeded with
// `seed`: a copy of the device's default generator's kind, never the default itself, so no
// request's draws depend on or reveal another's.
at::Generator* djinn_generator_new(int32_t type, int32_t index, uint64_t seed, char** err) {
    at::Generator* out = nullptr;
    guarded(err, [&] {
        at::Device device(static_cast<c10::DeviceType>(type), static_cast<c10::DeviceIndex>(index));
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

// Setters of the constant argument `i`, at preparation (the caller checked `i` against the
// schema's arity). Tensors are never constants: weights are values of the graph.
void djinn_call_set_none(djinn_call* c, size_t i) { c->args[i] = c10::IValue(); }
void djinn_call_set_int(djinn_call* c, size_t i, int64_t v) { c->args[i] = c10::IValue(v); }
void djinn_call_set_double(djinn_call* c, size_t i, double v) { c->args[i] = c10::IValue(v); }
void djinn_call_set_bool(djinn_call* c, size_t i, bool v) { c->args[i] = c10::IValue(v); }
void djinn_call_set_wrapped_int(djinn_call* c, size_t i, int64_t v) { c->args[i] = c10::IValue(wrapped_number(v)); }
void djinn_call_set_wrapped_double(djinn_call* c, size_t i, double v) { c->args[i] = c10::IValue(wrapped_number(v)); }
void djinn_call_set_wrapped_bool(djinn_call* c, size_t i, bool v) { c->args[i] = c10::IValue(wrapped_number(v)); }
void djinn_call_set_device(djinn_call* c, size_t i, int32_t type, int32_t index) {
    c->args[i] = c10::IValue(c10::Device(static_cast<c10::DeviceType>(type), static_cast<c10::DeviceIndex>(index)));
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
