//! graph_exec links libtorch (through djinn-executor): its binary finds libtorch's libraries
//! where it was built against them (`LIBTORCH`, from the repository's .cargo/config.toml), with
//! no LD_LIBRARY_PATH. The other targets link no libtorch and get nothing.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg-bin=graph_exec=-Wl,-rpath,{libtorch}/lib");
    }
}
