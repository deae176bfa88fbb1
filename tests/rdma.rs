//! Verbs on a real RDMA device. These run where `DJINN_RDMA_DEVICE` names one (the soft-RoCE VM
//! of scripts/softroce-vm.sh sets it to rxe0); elsewhere they print why they ran nothing.

mod support;

use std::time::{Duration, Instant};

use djinn_dataplane::rdma::{
    Completion, CompletionKind, QueueDepths, RcEndpoint, RdmaContext, RdmaError, RdmaPort, find_port,
};
use djinn_gpudirect::HostBuf;
use support::pattern;

fn device_port() -> Option<RdmaPort> {
    let Ok(name) = std::env::var("DJINN_RDMA_DEVICE") else {
        eprintln!(
            "skipped: DJINN_RDMA_DEVICE is not set (no RDMA device here; scripts/softroce-vm.sh runs this on rxe0)"
        );
        return None;
    };
    Some(find_port(Some(&name)).unwrap_or_else(|e| panic!("DJINN_RDMA_DEVICE={name}: {e}")))
}

/// Polls the shared completion queue until `want` completions arrived (or one failed).
fn wait(ctx: &RdmaContext, want: usize) -> Result<Vec<Completion>, RdmaError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    let mut failed = None;
    while got.len() < want && failed.is_none() {
        ctx.poll(|c| match c {
            Ok(c) => got.push(c),
            Err(e) => failed = Some(e),
        })?;
        assert!(Instant::now() < deadline, "completions did not arrive: {got:?}");
    }
    failed.map_or(Ok(got), Err)
}

#[test]
fn a_host_without_rdma_is_told_so_without_a_panic() {
    match find_port(None) {
        Ok(port) => eprintln!("this host has RDMA: {port}"),
        Err(e) => eprintln!("no RDMA here, as expected on these hosts: {e}"),
    }
}

#[test]
fn send_and_write_with_immediate_between_two_queue_pairs() {
    let Some(port) = device_port() else { return };
    let ctx = RdmaContext::new(&port, 1024).unwrap();
    let mut a = RcEndpoint::new(&ctx, QueueDepths::default()).unwrap();
    let mut b = RcEndpoint::new(&ctx, QueueDepths::default()).unwrap();
    let (ia, ib) = (a.info(), b.info());
    a.connect(&ib).unwrap();
    b.connect(&ia).unwrap();

    // A small SEND, inline, into a posted receive.
    let slot = HostBuf::zeroed(4096).unwrap();
    // SAFETY: `slot` outlives the registration and the receives below.
    let slot_mr = unsafe { ctx.register(slot.as_ptr(), slot.len()) }.unwrap();
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { b.post_recv(1, &slot_mr, slot_mr.addr, 4096) }.unwrap();
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { a.post_send(2, b"hello over rdma", None) }.unwrap();
    let got = wait(&ctx, 2).unwrap();
    let recv = got.iter().find(|c| c.wr_id == 1).expect("receive completion");
    assert_eq!((recv.kind, recv.byte_len), (CompletionKind::Receive, 15));
    assert_eq!(&slot.as_slice()[..15], b"hello over rdma");

    // 1 MiB by RDMA WRITE with immediate, straight into the peer's buffer.
    let src = HostBuf::copy_from(&pattern(1 << 20, 5)).unwrap();
    let dst = HostBuf::zeroed(1 << 20).unwrap();
    // SAFETY: both buffers outlive their registrations and the write.
    let (src_mr, dst_mr) =
        // SAFETY: the buffers named are registered above and outlive this work request.
        unsafe { (ctx.register(src.as_ptr(), src.len()).unwrap(), ctx.register(dst.as_ptr(), dst.len()).unwrap()) };
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { b.post_recv(3, &slot_mr, slot_mr.addr, 4096) }.unwrap();
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { a.post_write_imm(4, &src_mr, src_mr.addr, 1 << 20, dst_mr.rkey(), dst_mr.addr, 0xabc) }.unwrap();
    let got = wait(&ctx, 2).unwrap();
    let landed = got.iter().find(|c| c.wr_id == 3).expect("write-with-immediate completion");
    assert_eq!((landed.kind, landed.imm), (CompletionKind::ReceiveWrite, Some(0xabc)));
    assert!(dst.as_slice() == src.as_slice(), "the written bytes differ");

    // A write with a wrong key fails its work request: a typed error, not a hang.
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { b.post_recv(5, &slot_mr, slot_mr.addr, 4096) }.unwrap();
    // SAFETY: the buffers named are registered above and outlive this work request.
    unsafe { a.post_write_imm(6, &src_mr, src_mr.addr, 64, dst_mr.rkey() ^ 0x5a5a, dst_mr.addr, 1) }.unwrap();
    let err = wait(&ctx, 1).unwrap_err();
    assert!(matches!(err, RdmaError::Completion { .. }), "{err}");
}
