//! A ring pair between this test and a child process started by exec (the test binary again,
//! running the ignored `child_echoes` below), sharing a memfd it inherits: what the node and an
//! executor process will do.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use djinn_shm::{Consumer, Producer, Region, ring_len};

/// Each ring holds a few of the largest messages.
const RING: usize = 64 * 1024;
/// Where the child finds the region's descriptor.
const CHILD_FD: i32 = 3;
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
    for _ in 0..1000 {
        match to.push(message) {
            Ok(()) => return,
            Err(djinn_shm::RingError::Full { .. }) => to.wait_for_room(WAIT),
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
    let mut command = std::process::Command::new(std::env::current_exe().expect("this test binary"));
    command.args(["--exact", "child_echoes", "--include-ignored", "--nocapture"]).env("DJINN_SHM_TEST_CHILD", "1");
    let mut child = djinn_shm::spawn_with_fds(&mut command, &[(region.fd(), CHILD_FD)]).expect("the child starts");

    // One at a time, then a burst that fills the ring both ways: each side sleeps for room.
    let mut out = Vec::new();
    for i in 0..300 {
        let sent = message(i);
        send(&mut to_child, &sent);
        receive(&mut from_child, &mut out);
        let echoed: Vec<u8> = sent.iter().rev().copied().collect();
        assert_eq!(out, echoed, "message {i}");
    }
    let burst = std::thread::scope(|s| {
        let sender = s.spawn(|| (300..600).for_each(|i| send(&mut to_child, &message(i))));
        for i in 300..600 {
            receive(&mut from_child, &mut out);
            assert_eq!(out, message(i).into_iter().rev().collect::<Vec<u8>>(), "message {i}");
        }
        sender.join()
    });
    assert!(burst.is_ok());
    send(&mut to_child, b"stop");
    assert!(child.wait().expect("the child ends").success());
}

#[test]
fn descriptor_numbers_that_clash_are_refused_before_anything_starts() {
    let region = Region::create("djinn-shm-test", 4096).expect("a region");
    let mut command = std::process::Command::new("true");
    for at in [0, 2] {
        assert!(djinn_shm::spawn_with_fds(&mut command, &[(region.fd(), at)]).is_err(), "{at}");
    }
    let twice = [(region.fd(), 5), (region.fd(), 5)];
    assert!(djinn_shm::spawn_with_fds(&mut command, &twice).is_err());
    // A source at another's number is fine: each is copied out of the way first.
    let crossed = [(region.fd(), 7), (region.fd(), region.fd().as_raw_fd())];
    let mut child = djinn_shm::spawn_with_fds(&mut command, &crossed).expect("started");
    assert!(child.wait().expect("ended").success());
}

/// The child's side: echoes each message reversed until "stop". Started by the test above.
#[test]
#[ignore = "the child process of a_child_process_echoes_messages_through_two_rings_in_an_inherited_memfd"]
fn child_echoes() {
    assert!(std::env::var_os("DJINN_SHM_TEST_CHILD").is_some(), "started by the parent test");
    // SAFETY: the parent placed the region's descriptor there for this process to own, and
    // nothing else here uses it.
    let fd = unsafe { djinn_shm::inherited(CHILD_FD) }.expect("the region's descriptor");
    let region = Arc::new(Region::open(fd).expect("the region"));
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
    assert_eq!(echoed, 600);
}
