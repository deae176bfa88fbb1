//! The receiving side of an RDMA session (the protocol core behind the RDMA transport, with no
//! verbs in it) fed arbitrary SENDs and WRITE completions from a peer, with a driver that
//! carries out the actions it asks for. Checks that:
//! - a message that breaks the protocol is a `SessionError` (the driver then closes the
//!   connection), never a panic;
//! - the allocator is never asked for more than the payload limit, nor for 0 bytes;
//! - every action names a slot or transfer the session knows, and `write_send` fills exactly
//!   the length its `Send` action gave;
//! - every frame it hands out survives `Message::encode` → `Message::decode` unchanged.
//!
//! Input layout, repeated: an operation byte (low 2 bits: 0 = a SEND into the next posted
//! receive slot, whose length is the next two bytes (little-endian, at most a slot) and whose
//! bytes follow; 1 = a WRITE with
//! immediate landing for the transfer named by the next byte; 2 = run the driver over the
//! pending actions; 3 = take the events), then its operands.

use std::collections::{HashSet, VecDeque};

use djinn_memory::HostBuf;
use djinn_proto::rdma::{Action, RDMA_HEADER_LEN, Session, SessionConfig};
use djinn_proto::{ErrorCode, Limits, Message, Payload, PayloadAlloc, RecvEvent, Refusal};

const MAX_PAYLOAD: u64 = 1 << 20;

struct FuzzAlloc;

impl PayloadAlloc for FuzzAlloc {
    fn alloc(&mut self, _message: &Message, len: usize) -> Result<Payload, Refusal> {
        assert!(len as u64 <= MAX_PAYLOAD, "asked to allocate {len} bytes, over the limit");
        assert!(len > 0, "asked to allocate an empty payload");
        if len > 256 << 10 {
            return Err(Refusal { code: ErrorCode::OverBudget, message: format!("{len} bytes") });
        }
        Ok(Payload { buf: HostBuf::zeroed(len)?, reservation: None })
    }
}

fn check_frame(event: RecvEvent, limits: &Limits) {
    if let RecvEvent::Frame(frame) = event {
        let mut meta = Vec::new();
        frame.message.encode(&mut meta);
        let again = Message::decode(frame.message.kind(), &meta, limits)
            .unwrap_or_else(|e| panic!("{:?} does not decode again: {e}", frame.message));
        let mut meta_again = Vec::new();
        again.encode(&mut meta_again);
        assert_eq!(meta, meta_again);
    }
}

pub fn run(data: &[u8]) {
    let limits = Limits { max_payload: MAX_PAYLOAD, max_meta: 1 << 16, ..Default::default() };
    let config = SessionConfig { slots: 8, slot_size: 1024, limits };
    let mut session = Session::new(config);
    let mut posted: VecDeque<u32> = VecDeque::new();
    let mut registered: HashSet<u32> = HashSet::new();
    let mut input = data;
    let mut take = |n: usize| -> Option<Vec<u8>> {
        (input.len() >= n).then(|| {
            let (head, rest) = input.split_at(n);
            input = rest;
            head.to_vec()
        })
    };
    while let Some(op) = take(1).map(|b| b[0]) {
        let result = match op & 3 {
            0 => {
                let Some(len) = take(2).map(|b| usize::from(u16::from_le_bytes([b[0], b[1]]))) else { break };
                let Some(bytes) = take(len.min(config.slot_size as usize)) else { break };
                // The hardware puts a SEND in a posted receive, or fails the QP.
                let Some(slot) = posted.pop_front() else { break };
                session.on_receive(slot, &bytes, &mut FuzzAlloc)
            }
            1 => {
                let Some(xfer) = take(1).map(|b| u32::from(b[0])) else { break };
                let Some(slot) = posted.pop_front() else { break };
                session.on_write_received(slot, xfer)
            }
            2 => {
                while let Some(action) = session.poll_action() {
                    match action {
                        Action::PostRecv { slot } => {
                            assert!(slot < config.slots, "slot {slot} of {}", config.slots);
                            assert!(!posted.contains(&slot), "slot {slot} posted twice");
                            posted.push_back(slot);
                        }
                        Action::Send { len } => {
                            assert!(len >= RDMA_HEADER_LEN && len <= config.slot_size as usize, "SEND of {len}");
                            let mut buf = vec![0u8; len];
                            assert_eq!(session.write_send(&mut buf), len);
                        }
                        Action::Register { xfer } => {
                            assert!(session.incoming_buffer(xfer).is_some(), "registering unknown transfer {xfer}");
                            registered.insert(xfer);
                            session.advertise(xfer, 0x1000, 7);
                        }
                        Action::Write { xfer, .. } => {
                            assert!(session.outgoing_segments(xfer).is_some());
                            session.on_write_sent(xfer);
                        }
                    }
                }
                Ok(())
            }
            _ => {
                while let Some(event) = session.poll_event() {
                    check_frame(event, &limits);
                }
                Ok(())
            }
        };
        if result.is_err() {
            // The driver closes the connection: nothing more arrives.
            return;
        }
    }
}
