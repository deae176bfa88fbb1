//! A compromised node as its own process, for the Python client's tests:
//! `hostile_node UPSTREAM [--kept-moved-to ADDR] [--session-moved-to ADDR]
//! [--endless-lists same|advancing] [--oversized-reply BYTES]`. It prints
//! `hostile node listening on ADDR`, then relays to the real node at UPSTREAM but for what it
//! answers itself (see tests/support/hostile_node.rs).

#[path = "../../tests/support/hostile_node.rs"]
mod hostile_node;

use std::io::Write;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(upstream) = args.next() else {
        eprintln!("usage: hostile_node UPSTREAM [ATTACK FLAGS]");
        std::process::exit(2);
    };
    let attack = hostile_node::Attack::from_args(args).unwrap_or_else(|e| {
        eprintln!("hostile_node: {e}");
        std::process::exit(2);
    });
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    println!("hostile node listening on {}", listener.local_addr().expect("address"));
    let _ = std::io::stdout().flush();
    hostile_node::serve(listener, &upstream, &attack);
}
