//! Two sessions joined by a simulated reliable connection: messages arrive in order per
//! direction, each SEND or WRITE with immediate needs a receive the peer posted (none posted is
//! the hardware's receiver-not-ready: a credit bug), WRITEs copy into the advertised memory.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use djinn_memory::HostBuf;
use proptest::prelude::*;

use super::{Action, Session, SessionConfig};
use crate::{
    DType, DataMessage, Message, OutFrame, Payload, PayloadAlloc, RecvEvent, Refusal, SharedBytes, TensorDesc,
};

enum Wire {
    Send(Vec<u8>),
    Write { xfer: u32, segments: Vec<(u64, Vec<u8>)> },
}

/// Refuses payloads larger than `max` (as a node over its budget would).
struct Alloc {
    max: usize,
}

impl PayloadAlloc for Alloc {
    fn alloc(&mut self, _message: &Message, len: usize) -> Result<Payload, Refusal> {
        if len > self.max {
            return Err(Refusal { code: crate::ErrorCode::OverBudget, message: format!("{len} bytes") });
        }
        Ok(Payload { buf: HostBuf::zeroed(len)?, reservation: None })
    }
}

struct Side {
    session: Session,
    posted: VecDeque<u32>,
    outbox: VecDeque<Wire>,
    delivered: Vec<(u64, Vec<u8>)>,
    refused: Vec<u64>,
    /// Ids of delivered and refused frames, in the order the session handed them out.
    order: Vec<u64>,
    alloc: Alloc,
}

impl Side {
    fn new(config: SessionConfig, max: usize) -> Self {
        Self {
            session: Session::new(config),
            posted: VecDeque::new(),
            outbox: VecDeque::new(),
            delivered: Vec::new(),
            refused: Vec::new(),
            order: Vec::new(),
            alloc: Alloc { max },
        }
    }

    fn run_actions(&mut self) {
        while let Some(action) = self.session.poll_action() {
            match action {
                Action::PostRecv { slot } => self.posted.push_back(slot),
                Action::Send { len } => {
                    assert!(len <= self.session.config().slot_size as usize, "a SEND larger than a slot");
                    let mut bytes = vec![0; len];
                    assert_eq!(self.session.write_send(&mut bytes), len);
                    self.outbox.push_back(Wire::Send(bytes));
                }
                // The simulation's "address" of an incoming transfer is its id.
                Action::Register { xfer } => self.session.advertise(xfer, u64::from(xfer), 7),
                Action::Write { xfer, addr, rkey } => {
                    assert_eq!(rkey, 7);
                    let segments = self
                        .session
                        .outgoing_segments(xfer)
                        .expect("a write of a known transfer")
                        .map(|(offset, bytes)| (offset, bytes.to_vec()))
                        .collect();
                    self.outbox.push_back(Wire::Write { xfer: addr as u32, segments });
                    self.session.on_write_sent(xfer);
                }
            }
        }
        while let Some(event) = self.session.poll_event() {
            match event {
                RecvEvent::Frame(f) => {
                    let bytes = f.payload.map(|p| p.buf.as_slice().to_vec()).unwrap_or_default();
                    self.order.push(f.request_id);
                    self.delivered.push((f.request_id, bytes));
                }
                RecvEvent::Rejected { request_id, .. } => {
                    self.order.push(request_id);
                    self.refused.push(request_id);
                }
                RecvEvent::Fatal(e) => panic!("fatal: {e}"),
            }
        }
    }

    /// Delivers one message from the peer's outbox; false when there was none.
    fn receive_from(&mut self, peer: &mut Side) -> bool {
        let Some(wire) = peer.outbox.pop_front() else { return false };
        let slot = self.posted.pop_front().expect("receiver not ready: a message without a posted receive");
        match wire {
            Wire::Send(bytes) => self.session.on_receive(slot, &bytes, &mut self.alloc).expect("protocol"),
            Wire::Write { xfer, segments } => {
                let buf = self.session.incoming_buffer(xfer).expect("a write into advertised memory");
                for (offset, bytes) in segments {
                    buf.buf.as_mut_slice()[offset as usize..offset as usize + bytes.len()].copy_from_slice(&bytes);
                }
                self.session.on_write_received(slot, xfer).expect("protocol");
            }
        }
        true
    }
}

/// Delivers whatever either side has for the other until neither has anything left.
fn settle(a: &mut Side, b: &mut Side) {
    loop {
        b.run_actions();
        a.run_actions();
        if !(a.receive_from(b) | b.receive_from(a)) {
            break;
        }
    }
    b.run_actions();
}

fn put(id: u64, len: usize) -> (Message, Vec<u8>) {
    let bytes: Vec<u8> = (0..len).map(|i| (i as u64 * 31 + id) as u8).collect();
    let tensor = TensorDesc::new(DType::U8, vec![len as u64]).expect("desc");
    (Message::Data(DataMessage::Put { name: format!("t{id}"), tensor }), bytes)
}

/// Queues a frame built as an [`OutFrame`], or (`encoded`) encoded into the session when it is
/// small enough.
fn send(session: &mut Session, id: u64, message: &Message, bytes: &[u8], encoded: bool) {
    if encoded && session.send_message(id, message, &[bytes]).expect("a consistent frame").is_some() {
        return;
    }
    let shared = Arc::new(bytes.to_vec()) as SharedBytes;
    session.send_frame(OutFrame::new(id, message, vec![shared]).expect("frame"));
}

proptest! {
    #[test]
    fn every_frame_arrives_in_order_without_overrunning_receives(
        slots in 4u32..40,
        slot_size in 256u32..2048,
        sizes in prop::collection::vec((any::<bool>(), 0usize..6000, any::<bool>()), 1..60),
        schedule in prop::collection::vec(0u8..4, 0..400),
        refuse_over in prop::option::of(1000usize..5000),
    ) {
        let config = SessionConfig { slots, slot_size, ..SessionConfig::default() };
        let max = refuse_over.unwrap_or(usize::MAX);
        let mut a = Side::new(config, max);
        let mut b = Side::new(config, max);
        let mut expected: [HashMap<u64, Vec<u8>>; 2] = [HashMap::new(), HashMap::new()];
        let mut to_send: VecDeque<(bool, u64, usize, bool)> =
            sizes.iter().enumerate().map(|(i, &(dir, len, encoded))| (dir, i as u64 + 1, len, encoded)).collect();
        a.run_actions();
        b.run_actions();
        let mut steps = schedule.into_iter().chain(std::iter::repeat(3)).take(200_000);
        loop {
            let idle = to_send.is_empty() && a.outbox.is_empty() && b.outbox.is_empty();
            if idle {
                break;
            }
            match steps.next() {
                Some(0) | Some(3) if !to_send.is_empty() => {
                    let (a_to_b, id, len, encoded) = to_send.pop_front().unwrap();
                    let (message, bytes) = put(id, len);
                    let (from, to) = if a_to_b { (&mut a, 1) } else { (&mut b, 0) };
                    send(&mut from.session, id, &message, &bytes, encoded);
                    expected[to].insert(id, bytes);
                }
                Some(1) => { b.receive_from(&mut a); }
                Some(2) => { a.receive_from(&mut b); }
                Some(_) => {
                    if !b.receive_from(&mut a) {
                        a.receive_from(&mut b);
                    }
                }
                None => prop_assert!(false, "no progress: a deadlock"),
            }
            a.run_actions();
            b.run_actions();
        }
        for (side, expected) in [(&a, &expected[0]), (&b, &expected[1])] {
            let mut ids: Vec<u64> = side.delivered.iter().map(|(id, _)| *id).chain(side.refused.iter().copied()).collect();
            ids.sort();
            let mut want: Vec<u64> = expected.keys().copied().collect();
            want.sort();
            prop_assert_eq!(ids, want, "every frame is delivered or refused");
            for (id, bytes) in &side.delivered {
                prop_assert_eq!(bytes, &expected[id], "frame {} arrived changed", id);
            }
            for id in &side.refused {
                prop_assert!(expected[id].len() > max, "frame {} refused below the limit", id);
            }
            // Ids grow in sending order: frames come out in the order they were sent.
            let mut sorted = side.order.clone();
            sorted.sort();
            prop_assert_eq!(&side.order, &sorted, "frames out of order");
            prop_assert!(side.session.is_idle(), "state left behind: {:?}", side.session);
            prop_assert_eq!(side.session.backlog(), (0, 0), "frames counted as held after all went");
        }
    }
}

/// Slots waiting to be posted again are not credits yet: a peer sending as fast as its credits
/// allow, while the receiver's driver has not posted anything, never finds its receives gone.
#[test]
fn slots_not_posted_again_are_not_credited() {
    let config = SessionConfig { slots: 16, slot_size: 512, ..SessionConfig::default() };
    let mut a = Side::new(config, usize::MAX);
    let mut b = Side::new(config, usize::MAX);
    a.run_actions();
    b.run_actions();
    // b uses two slots (fewer than a repost batch) and answers once, carrying its credits.
    for id in 1..=2 {
        let (message, bytes) = put(id, 10);
        send(&mut a.session, id, &message, &bytes, true);
        a.run_actions();
        assert!(b.receive_from(&mut a));
    }
    b.run_actions();
    let (message, bytes) = put(3, 10);
    send(&mut b.session, 3, &message, &bytes, true);
    b.run_actions();
    assert!(a.receive_from(&mut b));
    a.run_actions();
    // a sends all it may; b's driver posts nothing meanwhile.
    for id in 4..40 {
        let (message, bytes) = put(id, 10);
        send(&mut a.session, id, &message, &bytes, true);
    }
    a.run_actions();
    let mut delivered = 0;
    while b.receive_from(&mut a) {
        delivered += 1;
    }
    assert!(delivered >= 10, "a was held back too much: {delivered} frames");
    // Catching up, everything arrives.
    settle(&mut a, &mut b);
    assert_eq!(b.delivered.len(), 38);
}

/// A transfer announced again while its payload is on its way is a broken peer: the memory the
/// first announcement was given (registered for the peer's WRITEs) is not replaced, and the
/// connection ends.
#[test]
fn a_transfer_announced_twice_ends_the_session() {
    let config = SessionConfig { slots: 8, slot_size: 512, ..SessionConfig::default() };
    let mut a = Side::new(config, usize::MAX);
    let mut b = Side::new(config, usize::MAX);
    a.run_actions();
    b.run_actions();
    let (message, bytes) = put(1, 4000);
    send(&mut a.session, 1, &message, &bytes, false);
    a.run_actions();
    let Some(Wire::Send(rts)) = a.outbox.front() else { panic!("an announcement") };
    let rts = rts.clone();
    assert!(b.receive_from(&mut a), "the announcement");
    b.run_actions();
    let xfer = u32::from_le_bytes(rts[4..8].try_into().unwrap());
    let before = b.session.incoming_buffer(xfer).map(|p| p.buf.as_slice().as_ptr());
    let slot = b.posted.pop_front().unwrap();
    let e = b.session.on_receive(slot, &rts, &mut b.alloc).unwrap_err();
    assert_eq!(e, super::SessionError::DuplicateTransfer(xfer));
    let after = b.session.incoming_buffer(xfer).map(|p| p.buf.as_slice().as_ptr());
    assert!(before.is_some() && before == after, "the first transfer's memory stays");
}

/// Frames for a peer that returns no credits wait, and the session says how many and how large
/// (what the node bounds a connection's replies by); once the peer takes them, they go, and
/// the bytes sent move.
#[test]
fn what_waits_for_credits_is_counted_until_it_goes() {
    let config = SessionConfig { slots: 8, slot_size: 512, ..SessionConfig::default() };
    let mut a = Side::new(config, usize::MAX);
    let mut b = Side::new(config, usize::MAX);
    a.run_actions();
    b.run_actions();
    assert_eq!(a.session.backlog(), (0, 0));
    let mut lens = 0;
    for id in 1..=200 {
        let (message, bytes) = put(id, (id as usize * 37) % 3000);
        lens += bytes.len() as u64;
        send(&mut a.session, id, &message, &bytes, id % 2 == 0);
        a.run_actions();
    }
    let sent = a.session.sent_bytes();
    assert!(sent > 0, "some went while credits lasted");
    // b never takes what a sent: a's credits run out and the rest waits.
    let (frames, bytes) = a.session.backlog();
    assert!(frames > 150 && frames <= 200, "{frames} frames held");
    assert!(bytes > lens / 2, "{bytes} bytes held of {lens}");
    for _ in 0..10 {
        a.run_actions();
    }
    assert_eq!(a.session.sent_bytes(), sent, "nothing moves without credits");
    settle(&mut a, &mut b);
    assert_eq!(b.delivered.len(), 200);
    assert_eq!(a.session.backlog(), (0, 0));
    assert!(a.session.sent_bytes() > sent + lens / 2);
}

/// A large frame waits on the peer until the peer says where to write it; while the device
/// writes it, it is still held (its memory must stay) but waits on no peer: a node does not
/// take a slow WRITE for a stalled peer.
#[test]
fn a_transfer_the_device_is_writing_waits_on_no_peer() {
    let config = SessionConfig { slots: 8, slot_size: 512, ..SessionConfig::default() };
    let (mut a, mut b) = (Side::new(config, usize::MAX), Side::new(config, usize::MAX));
    a.run_actions();
    b.run_actions();
    let (message, bytes) = put(1, 64 << 10);
    send(&mut a.session, 1, &message, &bytes, false);
    a.run_actions();
    assert_eq!((a.session.backlog().0, a.session.waiting_on_peer()), (1, 1), "announced, waiting for the answer");
    while b.receive_from(&mut a) {
        b.run_actions();
    }
    assert!(a.receive_from(&mut b), "the peer's answer");
    let mut writing = None;
    while let Some(action) = a.session.poll_action() {
        match action {
            Action::PostRecv { slot } => a.posted.push_back(slot),
            Action::Write { xfer, .. } => writing = Some(xfer),
            other => panic!("{other:?}"),
        }
    }
    let xfer = writing.expect("the WRITE, posted");
    assert_eq!((a.session.backlog().0, a.session.waiting_on_peer()), (1, 0), "held, waiting on no peer");
    a.session.on_write_sent(xfer);
    assert_eq!((a.session.backlog().0, a.session.waiting_on_peer()), (0, 0));
}
