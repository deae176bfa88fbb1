//! Verbs on a real RDMA device. The tests that need one are ignored unless asked for
//! (`--include-ignored`), and then need `DJINN_RDMA_DEVICE` to name it (the soft-RoCE VM of
//! scripts/softroce-vm.sh sets it to rxe0): asked for where there is none, they fail.

mod support;

use std::time::{Duration, Instant};

use djinn_dataplane::rdma::{
    Completion, CompletionKind, NoRdma, QueueDepths, RcEndpoint, RdmaContext, RdmaError, RdmaPort, find_port,
};
use djinn_memory::HostBuf;
use support::pattern;

/// The port of the device `DJINN_RDMA_DEVICE` names. Panics where it is not set: a test that
/// needs a device and was run without one fails rather than passing without testing anything.
fn device_port() -> RdmaPort {
    let name = std::env::var("DJINN_RDMA_DEVICE").unwrap_or_else(|_| {
        panic!(
            "this test needs an RDMA device and DJINN_RDMA_DEVICE is not set (scripts/softroce-vm.sh runs the RDMA \
             tests on rxe0 in a soft-RoCE VM)"
        )
    });
    find_port(Some(&name)).unwrap_or_else(|e| panic!("DJINN_RDMA_DEVICE={name}: {e}"))
}

/// Polls the shared completion queue until the work requests `want` completed (or one failed).
fn wait(ctx: &RdmaContext, want: &[u64]) -> Result<Vec<Completion>, RdmaError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got: Vec<Completion> = Vec::new();
    let mut failed = None;
    while !want.iter().all(|w| got.iter().any(|c| c.wr_id == *w)) && failed.is_none() {
        ctx.poll(|c| match c {
            Ok(c) => got.push(c),
            Err(e) => failed = Some(e),
        })?;
        assert!(Instant::now() < deadline, "completions did not arrive: {got:?}");
    }
    failed.map_or(Ok(got), Err)
}

/// Runs everywhere: a host without RDMA gets a typed error that says so (no panic); where
/// `DJINN_RDMA_DEVICE` names a device, a port is found, of that device when asked by name.
#[test]
fn a_host_without_rdma_is_told_so_without_a_panic() {
    match (std::env::var("DJINN_RDMA_DEVICE"), find_port(None)) {
        (Ok(name), found) => {
            let port = found.unwrap_or_else(|e| panic!("DJINN_RDMA_DEVICE={name}, and no port found: {e}"));
            assert!(port.port >= 1 && [256, 512, 1024, 2048, 4096].contains(&port.mtu), "{port:?}");
            assert_eq!(find_port(Some(&name)).expect("the device named").device, name);
        }
        (Err(_), Ok(port)) => assert!(port.to_string().starts_with(&port.device), "{port}"),
        (Err(_), Err(e)) => {
            let says_so = match &e {
                NoRdma::Unsupported(_) => e.to_string().starts_with("this host has no RDMA support"),
                NoRdma::NoDevice(None) => e.to_string() == "no RDMA device",
                NoRdma::Unusable { device, .. } => e.to_string().starts_with(&format!("RDMA device {device}: ")),
                NoRdma::NoDevice(Some(_)) => false,
            };
            assert!(says_so, "{e:?}: {e}");
        }
    }
    // A device by a name no device has: a typed error that names it, or says there is no RDMA.
    match find_port(Some("djinn-no-such-device")) {
        Err(NoRdma::NoDevice(Some(name))) => assert_eq!(name, "djinn-no-such-device"),
        Err(e @ NoRdma::Unsupported(_)) => assert!(e.to_string().contains("no RDMA support"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        NoRdma::NoDevice(Some("djinn-no-such-device".into())).to_string(),
        "no RDMA device named djinn-no-such-device"
    );
}

/// Two queue pairs on one context, connected to each other.
fn connected_pair(port: &RdmaPort) -> (std::sync::Arc<RdmaContext>, RcEndpoint, RcEndpoint) {
    let ctx = RdmaContext::new(port, 1024).unwrap();
    let mut a = RcEndpoint::new(&ctx, QueueDepths::default()).unwrap();
    let mut b = RcEndpoint::new(&ctx, QueueDepths::default()).unwrap();
    let (ia, ib) = (a.info(), b.info());
    a.connect(&ib).unwrap();
    b.connect(&ia).unwrap();
    (ctx, a, b)
}

#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn send_and_write_with_immediate_between_two_queue_pairs() {
    let port = device_port();
    let (ctx, mut a, mut b) = connected_pair(&port);

    // A small SEND, inline, into a posted receive.
    let slot = HostBuf::zeroed(4096).unwrap();
    // SAFETY: `slot` outlives the registration and the receives below.
    let slot_mr = unsafe { ctx.register_local(slot.as_ptr(), slot.len()) }.unwrap();
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { b.post_recv(1, &slot_mr, slot_mr.addr, 4096) }.unwrap();
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { a.post_send(2, b"hello over rdma", None, true) }.unwrap();
    let got = wait(&ctx, &[1, 2]).unwrap();
    let recv = got.iter().find(|c| c.wr_id == 1).expect("receive completion");
    assert_eq!((recv.kind, recv.byte_len), (CompletionKind::Receive, 15));
    assert_eq!(&slot.as_slice()[..15], b"hello over rdma");

    // 1 MiB by RDMA WRITE with immediate, straight into the peer's buffer.
    let src = HostBuf::copy_from(&pattern(1 << 20, 5)).unwrap();
    let dst = HostBuf::zeroed(1 << 20).unwrap();
    // SAFETY: both buffers outlive their registrations and the write.
    let (src_mr, dst_mr) =
        // SAFETY: the buffers named are registered above and outlive this work request.
        unsafe { (ctx.register_local(src.as_ptr(), src.len()).unwrap(), ctx.register_for_peer_writes(dst.as_ptr(), dst.len()).unwrap()) };
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { b.post_recv(3, &slot_mr, slot_mr.addr, 4096) }.unwrap();
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { a.post_write(4, &src_mr, src_mr.addr, 1 << 20, dst_mr.rkey(), dst_mr.addr, Some(0xabc)) }.unwrap();
    let got = wait(&ctx, &[3, 4]).unwrap();
    let landed = got.iter().find(|c| c.wr_id == 3).expect("write-with-immediate completion");
    assert_eq!((landed.kind, landed.imm), (CompletionKind::ReceiveWrite, Some(0xabc)));
    assert!(dst.as_slice() == src.as_slice(), "the written bytes differ");

    // A write with a wrong key fails its work request: a typed error, not a hang.
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { b.post_recv(5, &slot_mr, slot_mr.addr, 4096) }.unwrap();
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { a.post_write(6, &src_mr, src_mr.addr, 64, dst_mr.rkey() ^ 0x5a5a, dst_mr.addr, Some(1)) }.unwrap();
    let err = wait(&ctx, &[6]).unwrap_err();
    assert!(matches!(err, RdmaError::Completion { status: 10, .. }), "{err}");
    assert!(err.to_string().contains("remote access error"), "{err}");
}

/// Memory registered for local use (send and receive slots, the tensors a node writes to its
/// peers) refuses a peer's WRITE even with the right key: only the memory a transfer is
/// received into is open to the peer's writes.
#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn memory_registered_for_local_use_refuses_the_peers_writes() {
    let port = device_port();
    let (ctx, mut a, _peer) = connected_pair(&port);
    let src = HostBuf::copy_from(&pattern(4096, 9)).unwrap();
    let local = HostBuf::zeroed(4096).unwrap();
    // SAFETY: both buffers outlive their registrations and the write.
    let (src_mr, local_mr) =
        unsafe { (ctx.register_local(src.as_ptr(), 4096).unwrap(), ctx.register_local(local.as_ptr(), 4096).unwrap()) };
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { a.post_write(1, &src_mr, src_mr.addr, 64, local_mr.rkey(), local_mr.addr, None) }.unwrap();
    let err = wait(&ctx, &[1]).unwrap_err();
    assert!(err.to_string().contains("remote access error"), "{err}");
    assert!(local.as_slice().iter().all(|&b| b == 0), "nothing was written");
}

/// Every RDMA connection has its own protection domain: memory registered for one connection's
/// peer writes refuses a WRITE that comes through another connection's queue pair, even with
/// the right key and address (a client cannot write into another client's transfers); the
/// same WRITE into memory of the queue pair's own domain lands.
#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn a_peer_cannot_write_into_another_connections_memory() {
    let port = device_port();
    let ctx = RdmaContext::new(&port, 1024).unwrap();
    let (victims, attackers) = (ctx.new_domain().unwrap(), ctx.new_domain().unwrap());
    // The node's end of the attacker's connection, in the attacker's domain, and the attacker.
    let mut node_end = RcEndpoint::in_domain(&ctx, &attackers, QueueDepths::default()).unwrap();
    let mut attacker = RcEndpoint::new(&ctx, QueueDepths::default()).unwrap();
    let (a, b) = (node_end.info(), attacker.info());
    node_end.connect(&b).unwrap();
    attacker.connect(&a).unwrap();
    let src = HostBuf::copy_from(&pattern(4096, 3)).unwrap();
    let (theirs, own) = (HostBuf::zeroed(4096).unwrap(), HostBuf::zeroed(4096).unwrap());
    // SAFETY: the buffers outlive their registrations and the writes below.
    let (src_mr, theirs_mr, own_mr) = unsafe {
        (
            ctx.register_local(src.as_ptr(), 4096).unwrap(),
            victims.register_for_peer_writes(theirs.as_ptr(), 4096).unwrap(),
            attackers.register_for_peer_writes(own.as_ptr(), 4096).unwrap(),
        )
    };
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { attacker.post_write(1, &src_mr, src_mr.addr, 4096, theirs_mr.rkey(), theirs_mr.addr, None) }.unwrap();
    let err = wait(&ctx, &[1]).unwrap_err();
    assert!(err.to_string().contains("remote access error"), "{err}");
    assert!(theirs.as_slice().iter().all(|&b| b == 0), "nothing was written into the other connection's memory");

    // A fresh pair (the failed WRITE broke the first): memory of its own domain takes it.
    let mut node_end = RcEndpoint::in_domain(&ctx, &attackers, QueueDepths::default()).unwrap();
    let mut attacker = RcEndpoint::new(&ctx, QueueDepths::default()).unwrap();
    let (a, b) = (node_end.info(), attacker.info());
    node_end.connect(&b).unwrap();
    attacker.connect(&a).unwrap();
    // SAFETY: as above.
    unsafe { attacker.post_write(2, &src_mr, src_mr.addr, 4096, own_mr.rkey(), own_mr.addr, None) }.unwrap();
    wait(&ctx, &[2]).unwrap();
    assert!(own.as_slice() == src.as_slice());
}

/// Options for a client that must use RDMA on the device under test.
fn rdma_options(device: &str) -> djinn_client::ClientOptions {
    djinn_client::ClientOptions {
        transport: djinn_client::Transport::Rdma,
        rdma_device: Some(device.to_owned()),
        timeout: Some(Duration::from_secs(120)),
        ..Default::default()
    }
}

/// A client of `addr` over TCP (one watching the node's counters).
fn tcp_client(addr: std::net::SocketAddr) -> djinn_client::Client {
    let options = djinn_client::ClientOptions { transport: djinn_client::Transport::Tcp, ..Default::default() };
    djinn_client::Client::connect_with(addr, options).unwrap()
}

/// A client of `addr` that must be, and is, on RDMA.
fn rdma_client(addr: std::net::SocketAddr, device: &str) -> djinn_client::Client {
    let client = djinn_client::Client::connect_with(addr, rdma_options(device)).unwrap();
    assert_eq!(client.transport(), "rdma");
    client
}

fn rdma_node(device: &str, extra: &[&str]) -> support::Node {
    let mut args = vec!["--transport", "rdma", "--rdma-device", device];
    args.extend_from_slice(extra);
    support::Node::start("mio", &args)
}

#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn tensors_from_1_kib_to_256_mib_go_over_rdma_byte_exact() {
    let port = device_port();
    let node = rdma_node(&port.device, &[]);
    let mut client = rdma_client(node.addr, &port.device);
    for (i, len) in [1usize << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20].into_iter().enumerate() {
        let data = pattern(len, i as u64);
        client.put("t", djinn_client::DType::U8, &[len as u64], &data).unwrap();
        let back = client.get("t").unwrap();
        assert!(back.bytes() == data.as_slice(), "{len} bytes differ after the round trip");
    }
    assert_eq!(client.transport(), "rdma");
}

/// A client's reply buffers come back to its pool with their registration, so a large reply
/// (received by rendezvous) lands in memory registered once, not once per reply; the bytes are
/// the reply's every time, also after the tensor changed.
#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn a_clients_reply_memory_is_registered_once() {
    use djinn_client::{DType, Registrations};
    let port = device_port();
    let node = rdma_node(&port.device, &[]);
    let mut client = rdma_client(node.addr, &port.device);
    let len = 1usize << 20; // above the eager size: RDMA-WRITten into memory the client registers
    let first = pattern(len, 11);
    client.put("x", DType::U8, &[len as u64], &first).unwrap();
    for _ in 0..20 {
        assert!(client.get("x").unwrap().bytes() == first.as_slice());
    }
    assert_eq!(client.rdma_registrations(), Registrations { made: 1, reused: 19 });

    // Eight in flight: the recycled buffer and seven new ones, then all eight again.
    let second = pattern(len, 12);
    client.put("x", DType::U8, &[len as u64], &second).unwrap();
    for round in 0..2 {
        let replies = client.get_many(&["x"; 8]).unwrap();
        assert!(replies.iter().all(|t| t.bytes() == second.as_slice()), "round {round}");
    }
    assert_eq!(client.rdma_registrations(), Registrations { made: 8, reused: 28 });
}

#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn sixteen_clients_at_once_over_rdma() {
    let port = device_port();
    let node = std::sync::Arc::new(rdma_node(&port.device, &[]));
    let threads: Vec<_> = (0..16u64)
        .map(|id| {
            let node = std::sync::Arc::clone(&node);
            let device = port.device.clone();
            std::thread::spawn(move || {
                let mut client = rdma_client(node.addr, &device);
                let name = format!("c{id}");
                for i in 0..40u64 {
                    // Small (eager) and large (rendezvous) frames, interleaved.
                    let len = if i % 4 == 0 { 100_000 } else { 1000 + (i * 37) as usize };
                    let data = pattern(len, id * 100 + i);
                    client.put(&name, djinn_client::DType::U8, &[len as u64], &data).unwrap();
                    assert!(client.get(&name).unwrap().bytes() == data.as_slice(), "client {id} call {i}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a client failed");
    }
}

#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn thousands_of_small_round_trips_on_one_connection() {
    // Many times the send queue's depth: inline SENDs are signalled one in 16, so this wraps
    // the queue on unsignalled ones and on credit messages again and again.
    let port = device_port();
    let node = rdma_node(&port.device, &[]);
    let mut client = rdma_client(node.addr, &port.device);
    for i in 0..3000u64 {
        let data = pattern(1 + (i % 97) as usize, i);
        client.put("small", djinn_client::DType::U8, &[data.len() as u64], &data).unwrap();
        assert!(client.get("small").unwrap().bytes() == data.as_slice(), "round trip {i}");
    }
}

#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn gets_in_flight_together_over_rdma_come_back_in_order() {
    let port = device_port();
    let node = rdma_node(&port.device, &[]);
    let mut client = rdma_client(node.addr, &port.device);
    support::many_gets_come_back_in_order(&mut client);
}

#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn a_model_executed_over_rdma_gives_what_it_gives_over_tcp() {
    let port = device_port();
    let node = rdma_node(&port.device, &[]);
    let mut over_rdma = rdma_client(node.addr, &port.device);
    let tcp = djinn_client::ClientOptions { transport: djinn_client::Transport::Tcp, ..Default::default() };
    let mut over_tcp = djinn_client::Client::connect_with(node.addr, tcp).unwrap();
    assert_eq!((over_rdma.transport(), over_tcp.transport()), ("rdma", "tcp"));
    let blocks = vec![support::archive("mlp")];
    let fingerprint = over_rdma.register_model(&blocks, |_, _| {}).unwrap().fingerprint;
    let x: Vec<u8> = pattern(4 * 256, 3).iter().flat_map(|&b| ((b as f32 - 128.0) / 64.0).to_le_bytes()).collect();
    let input = [djinn_client::TensorRef { dtype: djinn_client::DType::F32, shape: &[4, 256], bytes: &x }];
    let a = over_rdma.execute(&fingerprint, &[djinn_client::Value::Tensor(0)], &input).unwrap();
    let b = over_tcp.execute(&fingerprint, &[djinn_client::Value::Tensor(0)], &input).unwrap();
    assert_eq!(a.tensors, b.tensors);
    assert!(a.tensor_bytes(0) == b.tensor_bytes(0));
    // A 64 MiB identity both ways, over RDMA.
    let identity = over_rdma.register_model(&[support::archive("identity")], |_, _| {}).unwrap().fingerprint;
    let big = pattern(64 << 20, 9);
    let input = [djinn_client::TensorRef { dtype: djinn_client::DType::U8, shape: &[64 << 20], bytes: &big }];
    let out = over_rdma.execute(&identity, &[djinn_client::Value::Tensor(0)], &input).unwrap();
    assert!(out.tensor_bytes(0) == big.as_slice());
}

#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn a_peer_that_dies_mid_transfer_is_a_typed_error_and_the_node_goes_on() {
    use djinn_client::ClientError;
    let port = device_port();
    let big = 256u64 << 20;
    // The node dies under a client, once the put is under way (the node took the memory its
    // payload is written into): the client's request fails, typed, within its timeout.
    let node = rdma_node(&port.device, &[]);
    let mut options = rdma_options(&port.device);
    options.timeout = Some(Duration::from_secs(10));
    let mut client = djinn_client::Client::connect_with(node.addr, options).unwrap();
    let mut watcher = tcp_client(node.addr);
    let data = pattern(big as usize, 4);
    let killer = std::thread::spawn(move || {
        support::wait_for_counter_at_least(&mut watcher, "budget_used_bytes", big);
        drop(node);
    });
    let err = client.put("big", djinn_client::DType::U8, &[big], &data).unwrap_err();
    killer.join().expect("the put was not seen under way");
    eprintln!("the client saw: {err}");
    assert!(
        matches!(
            err,
            ClientError::Io { .. }
                | ClientError::Timeout { .. }
                | ClientError::Closed { .. }
                | ClientError::Rdma { .. }
        ),
        "the node vanished, not {err:?}"
    );

    // A client dies under the node, once its put is under way: the node keeps serving the
    // others and keeps nothing of the put.
    let node = rdma_node(&port.device, &[]);
    let mut other = rdma_client(node.addr, &port.device);
    let file = std::env::temp_dir().join(format!("djinn-rdma-big-{}", std::process::id()));
    std::fs::write(&file, pattern(big as usize, 5)).unwrap();
    let mut put = std::process::Command::new(env!("CARGO_BIN_EXE_djinn"))
        .args(["--log", "error", "--transport", "rdma", "put", &node.addr.to_string(), "gone", "--dtype", "u8"])
        .arg("--file")
        .arg(&file)
        .spawn()
        .unwrap();
    support::wait_for_counter_at_least(&mut other, "budget_used_bytes", big);
    put.kill().unwrap();
    put.wait().unwrap();
    std::fs::remove_file(&file).ok();
    other.put("ok", djinn_client::DType::U8, &[3], &[1, 2, 3]).unwrap();
    assert_eq!(other.get("ok").unwrap().bytes(), &[1, 2, 3]);
    node.wait_for_stat(&mut other, "connections_open", 1);
    // Its 3 bytes, and a page and its name of bookkeeping: nothing of the abandoned put (had the
    // put finished before it was killed, "gone" would be kept).
    assert_eq!(node.stat(&mut other, "budget_used_bytes"), 3 + 4096 + "ok".len() as u64);
}

#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn a_node_pushes_a_tensor_to_another_over_rdma() {
    use djinn_client::{DType, ErrorCode, TensorDesc, TensorSource};
    let port = device_port();
    let b = rdma_node(&port.device, &[]);
    let tcp_only = support::Node::start("mio", &["--transport", "tcp"]);
    let peers = format!("{},{}", b.addr, tcp_only.addr);
    let a = rdma_node(&port.device, &["--push-timeout", "20", "--push-peers", &peers]);
    let mut on_a = rdma_client(a.addr, &port.device);
    let to_b = b.addr.to_string();
    // Empty, eager (one SEND) and rendezvous (RDMA WRITE into the memory node b takes for it).
    for (i, len) in [0usize, 1024, 1 << 20, 64 << 20].into_iter().enumerate() {
        let bytes = pattern(len, 70 + i as u64);
        on_a.put("x", DType::U8, &[len as u64], &bytes).unwrap();
        let mut on_b = rdma_client(b.addr, &port.device);
        let grant = on_b.grant_push(&TensorDesc::new(DType::U8, vec![len as u64]).unwrap()).unwrap();
        let (pushed, path) = on_a.push(TensorSource::Named("x".into()), &to_b, &grant).unwrap();
        assert_eq!(path, "staging-rdma", "{len} bytes");
        assert!(on_b.fetch(pushed.handle).unwrap().bytes() == bytes.as_slice(), "{len} bytes arrive exactly");
        on_b.release(&[pushed.handle]).unwrap();
    }

    // A peer that offers TCP only is pushed to over TCP.
    let x_desc = TensorDesc::new(DType::U8, vec![64 << 20]).unwrap();
    let grant = tcp_only.client().grant_push(&x_desc).unwrap();
    let (pushed, path) = on_a.push(TensorSource::Named("x".into()), &tcp_only.addr.to_string(), &grant).unwrap();
    assert_eq!(path, "staging-tcp");
    assert_eq!(tcp_only.client().fetch(pushed.handle).unwrap().bytes().len(), 64 << 20);

    // The peer dies: a typed error within the push timeout; once it is back, pushes go over RDMA
    // again.
    let grant = rdma_client(b.addr, &port.device).grant_push(&x_desc).unwrap();
    b.kill();
    // (Within the push timeout, 20 s: a push that hung would end at the client's own timeout,
    // two minutes, and with another error.)
    let e = on_a.push(TensorSource::Named("x".into()), &to_b, &grant).unwrap_err();
    assert_eq!(e.remote_code(), Some(ErrorCode::PeerUnreachable), "{e}");
    let b = support::Node::start_at(&to_b, "mio", &["--transport", "rdma", "--rdma-device", &port.device]);
    on_a.put("x", DType::U8, &[3], &[7, 8, 9]).unwrap();
    let grant = rdma_client(b.addr, &port.device).grant_push(&TensorDesc::new(DType::U8, vec![3]).unwrap()).unwrap();
    let (pushed, path) = on_a.push(TensorSource::Named("x".into()), &to_b, &grant).unwrap();
    assert_eq!(path, "staging-rdma");
    assert_eq!(rdma_client(b.addr, &port.device).fetch(pushed.handle).unwrap().bytes(), &[7, 8, 9]);
}

/// Pages of their own, filled with a pattern, that can be made unreadable: whatever touches
/// them after [`Pages::forbid`] crashes the test.
struct Pages {
    ptr: *mut u8,
    len: usize,
}

impl Pages {
    fn new(len: usize, seed: u64) -> Self {
        // SAFETY: an anonymous private mapping, checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        let pages = Self { ptr: ptr.cast(), len };
        // SAFETY: the mapping is readable and writable, and ours alone.
        unsafe { std::slice::from_raw_parts_mut(pages.ptr, len) }.copy_from_slice(&pattern(len, seed));
        pages
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as self (read only while allowed, by the test).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn protect(&self, prot: libc::c_int) {
        // SAFETY: the whole mapping, page-aligned by mmap.
        let rc = unsafe { libc::mprotect(self.ptr.cast(), self.len, prot) };
        assert_eq!(rc, 0, "mprotect: {}", std::io::Error::last_os_error());
    }

    fn forbid(&self) {
        self.protect(libc::PROT_NONE);
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The memory a call sends from is not touched once the call returns: after a normal return,
/// a refusal and a timeout (the node stopped), each call's pages are made unreadable, and the
/// client's later calls, on the same connection or a new one, work (and crash nothing).
#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn memory_lent_to_a_call_is_not_read_after_it_returns() {
    use djinn_client::DType;
    let port = device_port();
    // Large enough for a rendezvous (RDMA WRITE from the lent pages); the node's budget
    // refuses the larger one before taking its payload.
    let len = 8usize << 20;
    let node = rdma_node(&port.device, &["--device-memory-budget", "24MiB"]);
    let mut options = rdma_options(&port.device);
    options.timeout = Some(Duration::from_secs(3));
    let mut client = djinn_client::Client::connect_with(node.addr, options).unwrap();
    assert_eq!(client.transport(), "rdma");

    let returned = Pages::new(len, 1);
    client.put("a", DType::U8, &[len as u64], returned.bytes()).unwrap();
    returned.forbid();

    let refused = Pages::new(4 * len, 2);
    let err = client.put("b", DType::U8, &[4 * len as u64], refused.bytes()).unwrap_err();
    assert!(err.remote_code().is_some(), "refused by the node, not {err}");
    refused.forbid();

    let later = Pages::new(len, 3);
    client.put("c", DType::U8, &[len as u64], later.bytes()).unwrap();
    assert!(client.get("a").unwrap().bytes() == pattern(len, 1).as_slice());
    client.delete("c").unwrap();

    // SAFETY: stopping and continuing our own child.
    assert_eq!(unsafe { libc::kill(node.pid(), libc::SIGSTOP) }, 0);
    let stalled = Pages::new(len, 4);
    let err = client.put("d", DType::U8, &[len as u64], stalled.bytes()).unwrap_err();
    stalled.forbid();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(node.pid(), libc::SIGCONT) }, 0);
    assert!(matches!(err, djinn_client::ClientError::Timeout { .. }), "{err}");

    let after = Pages::new(len, 5);
    client.put("e", DType::U8, &[len as u64], after.bytes()).unwrap();
    assert!(client.get("e").unwrap().bytes() == pattern(len, 5).as_slice());
    assert_eq!(client.transport(), "rdma");
    for pages in [&returned, &refused, &stalled] {
        pages.protect(libc::PROT_READ | libc::PROT_WRITE);
    }
}

/// A client that moved to RDMA and then takes none of its replies (it never polls its
/// completions, so it returns no credits) while it keeps sending requests over TCP: the node
/// holds at most `--max-queued` replies for it, stops reading it, closes it once it stalls,
/// and serves another client throughout.
#[test]
#[ignore = "needs an RDMA device (DJINN_RDMA_DEVICE; scripts/softroce-vm.sh runs these in the soft-RoCE VM)"]
fn a_client_that_takes_no_replies_over_rdma_is_bounded_and_closed() {
    use djinn_dataplane::rdma::RdmaChannel;
    use djinn_proto::rdma::SessionConfig;
    use djinn_proto::{DataMessage, Hello, Limits, Message, encode_head, transports};
    use std::io::Write;
    let port = device_port();
    let node = rdma_node(&port.device, &["--stall-timeout", "2"]);
    let mut other = rdma_client(node.addr, &port.device);
    other.put("x", djinn_client::DType::U8, &[1024], &[3; 1024]).unwrap();

    let config = SessionConfig::default();
    let ctx = RdmaContext::new(&port, RdmaChannel::completion_entries(&config)).unwrap();
    let mut channel = RdmaChannel::new(&ctx, 0, config).unwrap();
    let mut stream = std::net::TcpStream::connect(node.addr).unwrap();
    let frame = |id: u64, message: &Message| {
        let mut wire = Vec::new();
        encode_head(&mut wire, id, message).unwrap();
        wire
    };
    stream
        .write_all(&frame(
            1,
            &Message::Data(DataMessage::Hello(Hello::new(
                &Limits::default(),
                transports::TCP | transports::RDMA,
                "raw",
            ))),
        ))
        .unwrap();
    assert!(matches!(support::read_reply(&mut stream).1, Message::Data(DataMessage::HelloAck(_))));
    stream.write_all(&frame(2, &Message::Data(DataMessage::RdmaConnect(channel.params())))).unwrap();
    let Message::Data(DataMessage::RdmaAccept(theirs)) = support::read_reply(&mut stream).1 else {
        panic!("no RDMA accept")
    };
    channel.connect(&theirs).unwrap();

    // Gets over TCP, a thousand frames at a time; the replies go over RDMA and are never taken.
    // The node reads no more of them once it holds 1,024 replies (--max-queued's frames): what
    // it read is counted in `frames_in`.
    let gets: Vec<u8> =
        (0..1000).flat_map(|i| frame(10 + i, &Message::Data(DataMessage::Get { name: "x".into() }))).collect();
    stream.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let frames_before = node.stat(&mut other, "frames_in");
    let started = Instant::now();
    let mut sent = 0usize;
    while started.elapsed() < Duration::from_secs(30) {
        match stream.write(&gets) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert_eq!(other.get("x").unwrap().bytes(), &[3; 1024], "another client is served meanwhile");
    let read = node.stat(&mut other, "frames_in") - frames_before;
    eprintln!("{sent} bytes of requests written in {:?}; the node read {read} frames", started.elapsed());
    assert!(read <= 1024 + 64, "the node read {read} requests it cannot answer");
    // Closed for stalling (after --stall-timeout without its replies taken), and counted so.
    support::wait_for_counter_at_least(&mut other, "stalled_connections", 1);
    support::read_until_closed(&mut stream, "the stalled connection");
    node.wait_for_stat(&mut other, "connections_open", 1);
    assert_eq!(other.get("x").unwrap().bytes(), &[3; 1024]);
    drop(channel);
}
