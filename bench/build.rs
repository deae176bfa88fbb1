include!("../build/libtorch_link.rs");

// The benchmarks link the executor, and with it libtorch: their tests find it as the binary does.
fn main() {
    link_libtorch();
}
