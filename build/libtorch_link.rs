// Shared by the build scripts of the crates whose binaries and tests link libtorch (included
// with `include!`). `LIBTORCH` comes from .cargo/config.toml: the torch wheel in .venv (or, for
// scripts/gpu-bundle.sh, the torch the bundle is for).
fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Ok(libtorch) = std::env::var("LIBTORCH") else {
        println!("cargo:warning=LIBTORCH is not set: run scripts/setup.sh");
        return;
    };
    let lib = format!("{libtorch}/lib");
    // Run without LD_LIBRARY_PATH: from the torch built against, or, for a bundle built for
    // another host (scripts/gpu-bundle.sh), from that host's torch/lib.
    println!("cargo:rerun-if-env-changed=DJINN_TORCH_RPATH");
    let rpath = std::env::var("DJINN_TORCH_RPATH").unwrap_or_else(|_| lib.clone());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
    // rustc links with --as-needed, which drops libtorch_cuda (nothing references it by name)
    // and with it every CUDA kernel: keep it, so a GPU host sees CUDA.
    if std::path::Path::new(&format!("{lib}/libtorch_cuda.so")).exists() {
        println!("cargo:rustc-link-arg=-L{lib}");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
