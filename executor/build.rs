include!("../build/libtorch_link.rs");

fn main() {
    link_libtorch();
    compile_dispatch_shim();
}

/// The C++ that calls libtorch's dispatcher by operator name (csrc/dispatch.cpp) and the node's
/// CPU allocator (csrc/allocator.cpp), compiled
/// against the same libtorch's headers with the flags torch-sys uses: C++17 and the C++ ABI of
/// the pip wheels (`LIBTORCH_CXX11_ABI` to change it, as for torch-sys).
fn compile_dispatch_shim() {
    println!("cargo:rerun-if-changed=csrc/dispatch.cpp");
    println!("cargo:rerun-if-changed=csrc/allocator.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let Ok(libtorch) = std::env::var("LIBTORCH") else {
        return;
    };
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .warnings(false)
        .include(format!("{libtorch}/include"))
        .include(format!("{libtorch}/include/torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .file("csrc/dispatch.cpp")
        .file("csrc/allocator.cpp")
        .compile("djinn_dispatch");
}
