//! The shim's C ABI (csrc/dispatch.cpp) and the safe pieces over it: its messages, a request's
//! generator, its meta kernels and meta tensors. Prepared calls are made in `prepare.rs` and run
//! in `steps.rs`.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr::NonNull;

use tch::{Device, Tensor};

use crate::error::ExecError;

#[repr(C)]
pub struct Call {
    _private: [u8; 0],
}

pub const OUT_NONE: i32 = 0;
pub const OUT_TENSOR: i32 = 1;
pub const OUT_INT: i32 = 2;
pub const OUT_DOUBLE: i32 = 3;
pub const OUT_BOOL: i32 = 4;
pub const OUT_LIST: i32 = 5;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Out {
    pub tag: i32,
    pub i: i64,
    pub d: f64,
    pub tensor: *mut c_void,
}

pub const ARG_NONE: i32 = 0;
pub const ARG_INT: i32 = 1;
pub const ARG_DOUBLE: i32 = 2;
pub const ARG_BOOL: i32 = 3;
pub const ARG_TENSOR: i32 = 4;
pub const ARG_INT_LIST: i32 = 5;
pub const ARG_DOUBLE_LIST: i32 = 6;
pub const ARG_TENSOR_LIST: i32 = 7;
pub const ARG_OPT_TENSOR_LIST: i32 = 8;
pub const ARG_WRAPPED_INT: i32 = 9;
pub const ARG_WRAPPED_DOUBLE: i32 = 10;
pub const ARG_WRAPPED_BOOL: i32 = 11;
pub const ARG_GENERATOR: i32 = 12;

#[repr(C)]
pub struct VaryingArg {
    pub index: usize,
    pub kind: i32,
    pub i: i64,
    pub d: f64,
    pub tensor: *const c_void,
    pub ints: *const i64,
    pub doubles: *const f64,
    pub tensors: *const *const c_void,
    pub len: usize,
    pub generator: *const c_void,
}

unsafe extern "C" {
    pub fn djinn_free_message(message: *mut c_char);
    pub fn djinn_register_meta_kernels(err: *mut *mut c_char) -> c_int;
    pub fn djinn_generator_new(kind: i32, index: i32, seed: u64, err: *mut *mut c_char) -> *mut c_void;
    pub fn djinn_generator_free(generator: *mut c_void);
    pub fn djinn_call_new(
        name: *const c_char,
        overload: *const c_char,
        schema: *mut *mut c_char,
        err: *mut *mut c_char,
    ) -> *mut Call;
    pub fn djinn_call_free(call: *mut Call);
    pub fn djinn_meta_like(tensor: *const c_void, err: *mut *mut c_char) -> *mut c_void;
    pub fn djinn_call_set_none(call: *mut Call, i: usize);
    pub fn djinn_call_set_int(call: *mut Call, i: usize, v: i64);
    pub fn djinn_call_set_double(call: *mut Call, i: usize, v: f64);
    pub fn djinn_call_set_bool(call: *mut Call, i: usize, v: bool);
    pub fn djinn_call_set_wrapped_int(call: *mut Call, i: usize, v: i64);
    pub fn djinn_call_set_wrapped_double(call: *mut Call, i: usize, v: f64);
    pub fn djinn_call_set_wrapped_bool(call: *mut Call, i: usize, v: bool);
    pub fn djinn_call_plan_on_meta(call: *mut Call);
    pub fn djinn_call_set_device(call: *mut Call, i: usize, kind: i32, index: i32);
    pub fn djinn_call_set_string(call: *mut Call, i: usize, s: *const c_char);
    pub fn djinn_call_set_int_list(call: *mut Call, i: usize, v: *const i64, n: usize);
    pub fn djinn_call_set_double_list(call: *mut Call, i: usize, v: *const f64, n: usize);
    pub fn djinn_call_set_bool_list(call: *mut Call, i: usize, v: *const bool, n: usize);
    pub fn djinn_call_run(
        call: *const Call,
        varying: *const VaryingArg,
        n_varying: usize,
        outs: *mut Out,
        cap: usize,
        n: *mut usize,
        err: *mut *mut c_char,
    ) -> c_int;
}

/// Takes a message the shim allocated.
pub(super) fn take_message(message: *mut c_char) -> String {
    if message.is_null() {
        return "unknown error".into();
    }
    // SAFETY: a NUL-terminated string from the shim's `copy_message`, freed once, here.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
    // SAFETY: as above.
    unsafe { djinn_free_message(message) };
    text
}

/// One request's generator: random operators draw from it and from nothing shared.
pub(super) struct RequestGenerator(pub(super) NonNull<c_void>);

impl RequestGenerator {
    pub(super) fn new(device: Device) -> Result<Self, ExecError> {
        let (kind, index) = match device {
            Device::Cuda(n) => (1, n as i32),
            _ => (0, -1),
        };
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: plain values in; a new generator or an error message out.
        let raw = unsafe { djinn_generator_new(kind, index, fresh_seed(), &mut err) };
        NonNull::new(raw).map(Self).ok_or_else(|| ExecError::Execution(format!("a generator: {}", take_message(err))))
    }
}

impl Drop for RequestGenerator {
    fn drop(&mut self) {
        // SAFETY: made by `djinn_generator_new`, freed once.
        unsafe { djinn_generator_free(self.0.as_ptr()) };
    }
}

/// A seed no other request can predict: from the kernel's random source.
fn fresh_seed() -> u64 {
    let mut seed = [0u8; 8];
    // SAFETY: getrandom writes at most the 8 bytes of `seed`.
    let n = unsafe { libc::getrandom(seed.as_mut_ptr().cast(), seed.len(), 0) };
    if n != seed.len() as isize {
        // No getrandom (very old kernels): the clock and the address of a stack slot.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return now.as_nanos() as u64 ^ (&seed as *const _ as u64).rotate_left(32);
    }
    u64::from_le_bytes(seed)
}

/// Registers the shim's meta kernels (for the operators libtorch's C++ has none for), once per
/// process. Without them plans stop at those operators: a warning, not a failure.
pub(super) fn register_meta_kernels() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: an out-pointer for a message, written on failure.
        if unsafe { djinn_register_meta_kernels(&mut err) } != 0 {
            tracing::warn!(error = %take_message(err), "meta kernels not registered: plans stop at their operators");
        }
    });
}

/// A tensor on the meta device shaped as `t` (sizes, strides, dtype).
pub(super) fn meta_like(t: &Tensor) -> Result<Tensor, ExecError> {
    let mut err: *mut c_char = std::ptr::null_mut();
    // SAFETY: `t` is a live tensor borrowed for the call; the result is a new at::Tensor.
    let raw = unsafe { djinn_meta_like(t.as_ptr().cast(), &mut err) };
    if raw.is_null() {
        return Err(ExecError::Internal(format!("a meta tensor: {}", take_message(err))));
    }
    // SAFETY: a new at::Tensor from the shim, owned from here (tch frees it on drop).
    Ok(unsafe { Tensor::from_ptr(raw.cast()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::RtValue;
    use crate::graph::fixtures::one_operator;
    use crate::graph::steps::run_call;
    use djinn_graph::Arg;
    use tch::Kind;

    fn on_cpu_and_meta(
        op: &str,
        args: Vec<Arg>,
        kwargs: &[(&str, Arg)],
        inputs: &[Tensor],
        outputs: usize,
    ) -> [Vec<(Vec<i64>, Kind)>; 2] {
        let graph = one_operator(op, args, kwargs, inputs, outputs);
        let described = |values: Vec<RtValue>| {
            values
                .iter()
                .map(|v| match v {
                    RtValue::Tensor(t) => (t.size(), t.kind()),
                    other => panic!("{op}: {other:?}"),
                })
                .collect::<Vec<_>>()
        };
        let real = described(graph.run(inputs.iter().map(Tensor::shallow_clone).collect()).unwrap());
        // The plan's path: meta inputs through the plan's calls.
        let mut env: Vec<Option<RtValue>> = (0..graph.checked.graphs[0].values).map(|_| None).collect();
        for (i, t) in inputs.iter().enumerate() {
            env[i] = Some(RtValue::Tensor(meta_like(t).unwrap()));
        }
        let call = graph.plan_calls[0][0].as_ref().unwrap();
        let meta = run_call(call, &env, None, &mut Vec::new()).unwrap_or_else(|e| panic!("{op} on meta: {e}"));
        [real, described(meta)]
    }

    #[test]
    fn the_nodes_meta_kernels_give_the_sizes_and_dtypes_libtorch_computes() {
        let f = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
        let int = |s: &[i64], k: Kind| Tensor::randint(7, s, (k, Device::Cpu)) + 1;
        let (v, i, fl, b) = (Arg::Value, Arg::Int, |x: &str| Arg::Float(x.into()), Arg::Bool);
        let ints = |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect());
        let x = f(&[3, 4]);
        let image = f(&[2, 4, 9, 9]);
        let cases: Vec<(&str, Vec<Arg>, Vec<Tensor>, usize)> = vec![
            ("aten::relu", vec![v(0)], vec![x.shallow_clone()], 1),
            ("aten::hardtanh", vec![v(0), fl("-1.0"), fl("1.0")], vec![x.shallow_clone()], 1),
            ("aten::flip", vec![v(0), ints(&[0])], vec![x.shallow_clone()], 1),
            ("aten::isnan", vec![v(0)], vec![x.shallow_clone()], 1),
            (
                "aten::where.self",
                vec![v(0), v(1), v(2)],
                vec![f(&[3, 1]).gt(0.0), f(&[1, 4]), Tensor::randn([3, 4], (Kind::Double, Device::Cpu))],
                1,
            ),
            ("aten::__lshift__.Scalar", vec![v(0), i(2)], vec![int(&[3], Kind::Int)], 1),
            ("aten::__rshift__.Tensor", vec![v(0), v(1)], vec![int(&[3, 1], Kind::Int), int(&[4], Kind::Int64)], 1),
            ("aten::floor_divide", vec![v(0), v(1)], vec![f(&[3, 4]), f(&[4])], 1),
            ("aten::rsub.Tensor", vec![v(0), v(1)], vec![f(&[2, 1]), f(&[3])], 1),
            ("aten::remainder.Scalar_Tensor", vec![i(3), v(0)], vec![int(&[5], Kind::Int)], 1),
            ("aten::index_select", vec![v(0), i(1), v(1)], vec![f(&[5, 6]), Tensor::from_slice(&[0i64, 5, 2])], 1),
            ("aten::max", vec![v(0)], vec![x.shallow_clone()], 1),
            ("aten::min", vec![v(0)], vec![int(&[4], Kind::Int)], 1),
            ("aten::prod", vec![v(0)], vec![int(&[4], Kind::Int)], 1),
            ("aten::_adaptive_avg_pool2d", vec![v(0), ints(&[3, 2])], vec![image.shallow_clone()], 1),
            ("aten::_adaptive_avg_pool3d", vec![v(0), ints(&[1, 2, 3])], vec![f(&[2, 3, 4, 5, 6])], 1),
            ("aten::reflection_pad2d", vec![v(0), ints(&[1, 2, 3, 0])], vec![image.shallow_clone()], 1),
            (
                "aten::convolution",
                vec![v(0), v(1), v(2), ints(&[2, 1]), ints(&[1, 0]), ints(&[1, 2]), b(false), ints(&[0, 0]), i(2)],
                vec![image.shallow_clone(), f(&[6, 2, 3, 3]), f(&[6])],
                1,
            ),
            (
                "aten::convolution",
                vec![v(0), v(1), Arg::None, ints(&[2, 2]), ints(&[1, 1]), ints(&[1, 1]), b(true), ints(&[1, 0]), i(1)],
                vec![image.shallow_clone(), f(&[4, 3, 3, 3])],
                1,
            ),
            (
                "aten::convolution",
                vec![v(0), v(1), Arg::None, ints(&[1]), ints(&[2]), ints(&[1]), b(false), ints(&[0]), i(1)],
                vec![f(&[2, 4, 10]), f(&[5, 4, 3])],
                1,
            ),
            (
                "aten::native_layer_norm",
                vec![v(0), ints(&[8]), v(1), v(2), fl("1e-05")],
                vec![f(&[2, 3, 8]), f(&[8]), f(&[8])],
                3,
            ),
            (
                "aten::_native_batch_norm_legit_no_training",
                vec![v(0), v(1), v(2), v(3), v(4), fl("0.1"), fl("1e-05")],
                vec![image.shallow_clone(), f(&[4]), f(&[4]), f(&[4]), f(&[4]).abs()],
                3,
            ),
            (
                "aten::_native_batch_norm_legit.no_stats",
                vec![v(0), v(1), v(2), b(true), fl("0.1"), fl("1e-05")],
                vec![image.shallow_clone(), f(&[4]), f(&[4])],
                3,
            ),
            (
                "aten::native_group_norm",
                vec![v(0), v(1), v(2), i(2), i(4), i(81), i(2), fl("1e-05")],
                vec![image.shallow_clone(), f(&[4]), f(&[4])],
                3,
            ),
            (
                "aten::scaled_dot_product_attention",
                vec![v(0), v(1), v(2)],
                vec![f(&[2, 4, 5, 8]), f(&[2, 4, 7, 8]), f(&[2, 4, 7, 16])],
                1,
            ),
        ];
        for (op, args, inputs, outputs) in cases {
            let [real, meta] = on_cpu_and_meta(op, args, &[], &inputs, outputs);
            assert_eq!(meta, real, "{op}");
        }
        // Keyword arguments.
        for (op, args, kwargs, input) in [
            ("aten::prod", vec![v(0)], vec![("dtype", Arg::Dtype("float64".into()))], x),
            ("aten::var.correction", vec![v(0), ints(&[1])], vec![("correction", i(1))], f(&[3, 4, 5])),
            ("aten::var.correction", vec![v(0), ints(&[-1, 0])], vec![("keepdim", b(true))], f(&[3, 4, 5])),
            ("aten::var.correction", vec![v(0)], vec![], f(&[3, 4, 5])),
            // A 0-dim tensor over its dimension 0 or -1.
            ("aten::var.correction", vec![v(0), ints(&[0])], vec![], f(&[])),
            ("aten::var.correction", vec![v(0), ints(&[-1])], vec![("keepdim", b(true))], f(&[])),
        ] {
            let [real, meta] = on_cpu_and_meta(op, args, &kwargs, &[input], 1);
            assert_eq!(meta, real, "{op} {kwargs:?}");
        }
        // What libtorch refuses, the meta kernel refuses too, before its arithmetic (a zero
        // stride would divide by zero): the plan stops there and the run fails, typed.
        let conv = one_operator(
            "aten::convolution",
            vec![v(0), v(1), Arg::None, ints(&[0, 1]), ints(&[0, 0]), ints(&[1, 1]), b(false), ints(&[0, 0]), i(1)],
            &[],
            &[image.shallow_clone(), f(&[4, 4, 3, 3])],
            1,
        );
        let inputs = [image.shallow_clone(), f(&[4, 4, 3, 3])];
        assert_eq!(conv.estimate_run(&inputs).unwrap().stopped_at.as_deref(), Some("aten::convolution"));
        let e = conv.run(inputs.iter().map(Tensor::shallow_clone).collect()).unwrap_err();
        assert!(e.to_string().contains("stride"), "{e}");
        // Lists shorter than the spatial dimensions (which the kernel read past, then divided by
        // what it read).
        let pair = || ints(&[1, 1]);
        let volume = [f(&[1, 2, 3, 3, 3]), f(&[2, 2, 1, 1, 1])];
        let conv = one_operator(
            "aten::convolution",
            vec![v(0), v(1), Arg::None, pair(), ints(&[0, 0]), pair(), b(false), ints(&[0, 0]), i(1)],
            &[],
            &volume,
            1,
        );
        assert_eq!(conv.estimate_run(&volume).unwrap().stopped_at.as_deref(), Some("aten::convolution"));
        conv.run(volume.iter().map(Tensor::shallow_clone).collect()).unwrap_err();
    }
}
