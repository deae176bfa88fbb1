//! A ring pair between this test and a child process started by exec (the test binary again,
//! running the ignored `child_echoes` below), sharing a memfd it inherits: what the node and an
//! executor process will do.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use djinn_shm::{Consumer, Producer, Region, ring_len};

/// Each ring holds a few of the largest messages.
const RING: usize = 64 * 1024;
/// A hang guard: a wake-up that never comes fails the test (after this, per message).
const WAIT: Duration = Duration::from_secs(60);

fn message(i: usize) -> Vec<u8> {
    (0..(i * 37) % 5000).map(|j| (i + j) as u8).collect()
}

/// The next message from `from`, waiting for it.
fn receive(from: &mut Consumer, out: &mut Vec<u8>) {
    for _ in 0..2 {
        if from.pop(out).expect("a well-formed ring") {
            return;
        }
        from.wait(WAIT);
    }
    assert!(from.pop(out).expect("a well-formed ring"), "no message within {WAIT:?}");
}

/// Pushes `message`, waiting while the ring is full.
fn send(to: &mut Producer, message: &[u8]) {
    for _ in 0..100_000 {
        match to.push(message) {
            Ok(()) => return,
            Err(djinn_shm::RingError::Full { .. }) => std::thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    panic!("the ring stayed full");
}

#[test]
fn a_child_process_echoes_messages_through_two_rings_in_an_inherited_memfd() {
    let region = Arc::new(Region::create("djinn-shm-test", 2 * RING).expect("a region"));
    assert!(ring_len(5000, 8) <= RING);
    let mut to_child = Producer::create(&region, 0, RING).expect("a ring");
    let mut from_child = Consumer::create(&region, RING, RING).expect("a ring back");
    // The child inherits a copy of the descriptor (the region's own closes on exec).
    let inherited = rustix::io::dup(region.fd()).expect("dup");
    rustix::io::fcntl_setfd(&inherited, rustix::io::FdFlags::empty()).expect("inheritable");
    let mut child = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args(["--exact", "child_echoes", "--include-ignored", "--nocapture"])
        .env("DJINN_SHM_TEST_FD", inherited.as_raw_fd().to_string())
        .spawn()
        .expect("the child starts");
    drop(inherited);

    let mut out = Vec::new();
    for i in 0..300 {
        let sent = message(i);
        send(&mut to_child, &sent);
        receive(&mut from_child, &mut out);
        let echoed: Vec<u8> = sent.iter().rev().copied().collect();
        assert_eq!(out, echoed, "message {i}");
    }
    send(&mut to_child, b"stop");
    assert!(child.wait().expect("the child ends").success());
}

/// The child's side: echoes each message reversed until "stop". Started by the test above.
#[test]
#[ignore = "the child process of a_child_process_echoes_messages_through_two_rings_in_an_inherited_memfd"]
fn child_echoes() {
    let fd: i32 = std::env::var("DJINN_SHM_TEST_FD").expect("started by the parent test").parse().expect("an fd");
    // SAFETY: the parent passed this descriptor for this process to own; nothing else uses it.
    let region = Arc::new(Region::open(unsafe { OwnedFd::from_raw_fd(fd) }).expect("the region"));
    let mut from_parent = Consumer::attach(&region, 0, RING).expect("the ring");
    let mut to_parent = Producer::attach(&region, RING, RING).expect("the ring back");
    let mut out = Vec::new();
    let mut echoed = 0;
    loop {
        receive(&mut from_parent, &mut out);
        if out == b"stop" {
            break;
        }
        out.reverse();
        send(&mut to_parent, &out);
        echoed += 1;
    }
    assert_eq!(echoed, 300);
}
