#[macro_use]
pub mod utils;

pub use utils::{
    get_num_interop_threads, get_num_threads, manual_seed, set_num_interop_threads,
    set_num_threads, QEngine,
};

pub(crate) mod device;
pub(crate) mod image;
pub mod jit;
pub mod kind;
pub(crate) mod layout;
pub(crate) mod optimizer;
#[cfg(feature = "python-extension")]
pub mod python;
pub(crate) mod scalar;
pub(crate) mod stream;
pub(crate) mod tensor;
pub(crate) mod tensor_fallible_generated;
pub(crate) mod tensor_generated;
