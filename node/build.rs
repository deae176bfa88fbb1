include!("../build/libtorch_link.rs");

// The node links the executor, and with it libtorch: its tests find it as the binary does.
fn main() {
    link_libtorch();
}
