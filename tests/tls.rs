//! TLS on the data plane: nodes started with a certificate speak only TLS on TCP; clients that
//! trust it are served as over plain TCP (tensors byte-exact, models, pushes between nodes);
//! what crosses the wire is neither the token nor the tensors' bytes; clients that do not trust
//! it, or speak plain TCP, are refused and the node serves on.

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread;

use djinn_client::{Client, ClientOptions, ClientTls, DType, TensorRef, TensorSource, Value};
use support::{pattern, register, spawn_listening};

const ALICE: &str = "alice-token-0123456789abcdef";

fn start_node(dir: &Path, cert: &Path, key: &Path, extra: &[&str]) -> (support::Killed, String) {
    let tokens = dir.join("tokens.json");
    if !tokens.exists() {
        let json =
            serde_json::json!({ "principals": [{ "name": "alice", "tokens": [ALICE], "rights": ["torchscript"] }] });
        std::fs::write(&tokens, json.to_string()).unwrap();
    }
    let mut command = Command::new(env!("CARGO_BIN_EXE_djinn"));
    command
        .args(["node", "--listen", "127.0.0.1:0", "--log", "error", "--auth-file"])
        .arg(&tokens)
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .args(extra)
        .env_remove("DJINN_TOKEN");
    let (child, addr) = spawn_listening(command, "djinn node listening on ");
    (support::Killed(child), addr)
}

fn options(roots: &Path) -> ClientOptions {
    let tls = ClientTls::trusting(&std::fs::read(roots).unwrap()).unwrap();
    ClientOptions { token: ALICE.into(), tls: Some(tls), ..Default::default() }
}

/// Forwards one connection to `to` and keeps every byte that crossed, both ways.
fn recording_proxy(to: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&seen);
    thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let node = TcpStream::connect(to).unwrap();
        let pump = |mut from: TcpStream, mut to: TcpStream, seen: Arc<Mutex<Vec<u8>>>| {
            thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 16];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(std::net::Shutdown::Write);
            })
        };
        let up = pump(client.try_clone().unwrap(), node.try_clone().unwrap(), Arc::clone(&kept));
        let down = pump(node, client, kept);
        let _ = (up.join(), down.join());
    });
    (addr, seen)
}

#[test]
fn a_node_with_a_certificate_serves_tls_only() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = support::self_signed_certificate(dir.path(), "node");
    let (_node, addr) = start_node(dir.path(), &cert, &key, &[]);

    // Through a proxy that keeps what crossed: 64 MiB in and out byte-exact, a model run.
    let (proxied, seen) = recording_proxy(addr.clone());
    let mut alice = Client::connect_with(proxied.as_str(), options(&cert)).expect("a client trusting the node");
    assert_eq!(alice.transport(), "tcp");
    let data = pattern(64 << 20, 5);
    alice.put("big", DType::F32, &[16 << 20], &data).unwrap();
    assert!(alice.get("big").unwrap().bytes() == &data[..], "64 MiB back byte-exact");
    let halves = register(&mut alice, &["halves"]);
    let x = [1.5f32, -2.0, 3.25];
    let x_bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let idx = 41i64.to_le_bytes();
    let inputs = [
        TensorRef { dtype: DType::F32, shape: &[3], bytes: &x_bytes },
        TensorRef { dtype: DType::I64, shape: &[1], bytes: &idx },
    ];
    let out = alice.execute(&halves, &[Value::Tensor(0), Value::Tensor(1)], &inputs).unwrap();
    let doubled: Vec<u8> = x.iter().flat_map(|v| (v * 2.0).to_le_bytes()).collect();
    assert_eq!(out.tensor_bytes(0), &doubled[..]);
    assert_eq!(out.tensor_bytes(1), 42i64.to_le_bytes());
    drop(alice);
    let wire = seen.lock().unwrap().clone();
    assert!(wire.len() > 128 << 20, "{} bytes crossed", wire.len());
    let found = |needle: &[u8]| wire.windows(needle.len()).any(|w| w == needle);
    assert!(!found(ALICE.as_bytes()), "the token crossed in clear");
    assert!(!found(&data[1 << 20..(1 << 20) + 64]), "the tensor's bytes crossed in clear");

    // A client that trusts another certificate, and one speaking plain TCP, are refused.
    let (other, _) = support::self_signed_certificate(dir.path(), "other");
    let untrusted = Client::connect_with(addr.as_str(), options(&other)).unwrap_err();
    assert!(untrusted.to_string().contains("invalid peer certificate"), "{untrusted}");
    let plain =
        ClientOptions { token: ALICE.into(), timeout: Some(std::time::Duration::from_secs(5)), ..Default::default() };
    assert!(Client::connect_with(addr.as_str(), plain).is_err(), "plain TCP gets no hello");
    let mut alice = Client::connect_with(addr.as_str(), options(&cert)).expect("served on");
    assert!(alice.get("big").unwrap().bytes() == &data[..]);

    // The io_uring backend does not speak TLS: said at start.
    let mut uring = Command::new(env!("CARGO_BIN_EXE_djinn"));
    uring.args(["node", "--listen", "127.0.0.1:0", "--tcp-backend", "uring", "--tls-cert"]).arg(&cert);
    let out = uring.arg("--tls-key").arg(&key).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs --tcp-backend mio"), "{out:?}");
}

#[test]
fn nodes_push_to_each_other_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_a, key_a) = support::self_signed_certificate(dir.path(), "a");
    let (cert_b, key_b) = support::self_signed_certificate(dir.path(), "b");
    let roots = dir.path().join("roots.pem");
    let both = [std::fs::read(&cert_a).unwrap(), std::fs::read(&cert_b).unwrap()].concat();
    std::fs::write(&roots, both).unwrap();
    let roots_arg = roots.to_str().unwrap();
    let (_b, b_addr) = start_node(dir.path(), &cert_b, &key_b, &[]);
    let (_a, a_addr) =
        start_node(dir.path(), &cert_a, &key_a, &["--push-peers", &b_addr, "--peer-tls-roots", roots_arg]);
    let mut on_a = Client::connect_with(a_addr.as_str(), options(&roots)).unwrap();
    let mut on_b = Client::connect_with(b_addr.as_str(), options(&roots)).unwrap();
    let bytes = pattern(1 << 20, 9);
    let kept = on_a.keep(TensorRef { dtype: DType::U8, shape: &[1 << 20], bytes: &bytes }).unwrap();
    let grant = on_b.grant_push(&kept.tensor).unwrap();
    let (pushed, _) = on_a.push(TensorSource::Handle(kept.handle), &b_addr, &grant).expect("a push over TLS");
    assert!(on_b.fetch(pushed.handle).unwrap().bytes() == &bytes[..]);
}

/// What a stranger holds on a TLS node (the connection's TLS state) it holds no longer than on a
/// plain one: handshakes never finished count against `--max-unauthenticated-per-source` (more
/// are closed at once) and are closed after `--hello-timeout`, while a client is served.
#[test]
fn handshakes_never_finished_are_bounded_and_closed() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = support::self_signed_certificate(dir.path(), "node");
    // The hello timeout is long enough that the 20 strangers are all still open when the 21st
    // connects (made right after them).
    let (_node, addr) =
        start_node(dir.path(), &cert, &key, &["--hello-timeout", "5", "--max-unauthenticated-per-source", "20"]);
    let mut alice = Client::connect_with(addr.as_str(), options(&cert)).unwrap();
    alice.put("x", DType::U8, &[3], &[1, 2, 3]).unwrap();
    // A TLS record header announcing a handshake message, and nothing after it.
    let mut strangers: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut stream = TcpStream::connect(&addr).unwrap();
            stream.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).unwrap();
            stream
        })
        .collect();
    let mut over = TcpStream::connect(&addr).unwrap();
    // Refused at once (counted as such), not closed by the hello timeout.
    support::wait_for_counter_at_least(&mut alice, "unauthenticated_refused", 1);
    support::read_until_closed(&mut over, "the 21st");
    assert_eq!(alice.get("x").unwrap().bytes(), &[1, 2, 3], "a client is served meanwhile");
    support::wait_for_counter_at_least(&mut alice, "hello_timeouts", 20);
    for stream in &mut strangers {
        support::read_until_closed(stream, "a handshake not finished within the hello timeout");
    }
    assert_eq!(support::counter(&mut alice, "hello_timeouts"), 20, "the 21st did not wait for the hello timeout");
    assert_eq!(support::counter(&mut alice, "unauthenticated_refused"), 1);
    let mut again = Client::connect_with(addr.as_str(), options(&cert)).expect("a new client gets in");
    assert_eq!(again.get("x").unwrap().bytes(), &[1, 2, 3]);
}
