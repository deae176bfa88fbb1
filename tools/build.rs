include!("../build/libtorch_link.rs");

fn main() {
    link_libtorch();
}
