//! Frames over one reliable connection, without I/O: what to post (receives, SENDs, WRITEs
//! with immediate) and which frames completions make. Both ends run the same machine.
//!
//! - A frame that fits a receive slot goes as one SEND (`EAGER`).
//! - A larger one is announced (`RTS`: its head and payload length); the receiver takes memory
//!   for the payload (its budget decides, before anything moves), registers it and answers
//!   `CTS` (address, key), or `REFUSE`; the sender then RDMA-WRITEs the payload straight into
//!   that memory, the last WRITE carrying the transfer id as immediate.
//! - Every SEND and WRITE with immediate consumes one receive the peer posted. Each side tells
//!   the other how many receives it has posted again since it last said (`credits` in every
//!   message; a `CREDIT` message when there is nothing else to send and half the slots are
//!   owed). One credit is kept back for that message, so the two sides never wait on each
//!   other with credits owed.

use std::collections::{HashMap, VecDeque};

use crate::{
    FrameHeader, HEADER_LEN, Kind, Limits, Message, OutFrame, Payload, PayloadAlloc, ProtocolError, RecvEvent, Refusal,
    append_head, check_tensor_lens, decode_body, paddings, payload_len,
};

/// Transfer ids run from 1 to this, then wrap.
pub const MAX_XFER: u32 = 0x00ff_ffff;

/// Bytes of the header that starts every SEND.
pub const RDMA_HEADER_LEN: usize = 16;

/// Frames up to this size are encoded into the session's own buffer ([`Session::send_message`]):
/// copying so few bytes twice costs less than building an [`OutFrame`]. Larger ones are built
/// as frames and copied once, into a send slot.
pub const ENCODE_MAX: usize = 1024;

/// Written bytes at the front of the encoded-frame buffer are dropped past this much.
const COMPACT_AFTER: usize = 64 * 1024;

mod op {
    pub const EAGER: u8 = 1;
    pub const RTS: u8 = 2;
    pub const CTS: u8 = 3;
    pub const CREDIT: u8 = 4;
    pub const REFUSE: u8 = 5;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionConfig {
    /// Receives each side keeps posted.
    pub slots: u32,
    /// Bytes of each receive slot; a frame of at most `slot_size - RDMA_HEADER_LEN` bytes goes
    /// eagerly.
    pub slot_size: u32,
    pub limits: Limits,
}

impl SessionConfig {
    /// The configuration a session runs with: at least four slots, so that a `CREDIT` message
    /// always returns at least two credits.
    pub fn normalized(self) -> Self {
        Self { slots: self.slots.max(4), ..self }
    }
}

impl Default for SessionConfig {
    fn default() -> Self {
        // Frames up to about 128 KiB go in one SEND: below that, the rendezvous's two extra
        // messages and two memory registrations cost more than copying into a slot.
        Self { slots: 32, slot_size: 128 * 1024, limits: Limits::default() }
    }
}

/// The peer broke the protocol: the connection cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("RDMA message too short ({0} bytes)")]
    Short(usize),
    #[error("unknown RDMA operation {0}")]
    UnknownOp(u8),
    #[error("no transfer {0} in progress")]
    UnknownTransfer(u32),
    #[error("transfer {0} announced again while its payload is on its way")]
    DuplicateTransfer(u32),
    #[error("eager frame: {0}")]
    Frame(String),
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Post receive slot `slot` (again).
    PostRecv { slot: u32 },
    /// SEND the next queued message, of `len` bytes: inline when small, else from a registered
    /// send buffer; [`Session::write_send`] writes it there. SENDs go out in the order of these
    /// actions.
    Send { len: usize },
    /// Register the memory of incoming transfer `xfer` ([`Session::incoming_buffer`]) and
    /// call [`Session::advertise`] with its address and key.
    Register { xfer: u32 },
    /// RDMA-WRITE the payload of outgoing transfer `xfer` ([`Session::outgoing_segments`]) to
    /// `addr` under `rkey`, the last WRITE with immediate `xfer`; then call
    /// [`Session::on_write_sent`] once the WRITEs complete.
    Write { xfer: u32, addr: u64, rkey: u32 },
}

/// A SEND waiting for the driver to copy it out ([`Session::write_send`]).
struct QueuedSend {
    head: [u8; RDMA_HEADER_LEN],
    body: SendBody,
}

enum SendBody {
    Empty,
    /// A whole frame (`EAGER`).
    Frame(OutFrame),
    /// A whole frame of this many bytes, next in the session's encoded bytes (`EAGER`).
    Encoded(usize),
    /// A frame's header and metadata (`RTS`).
    Head(Vec<u8>),
    /// Where to write (`CTS`).
    Target {
        addr: u64,
        rkey: u32,
    },
}

impl QueuedSend {
    fn len(&self) -> usize {
        RDMA_HEADER_LEN
            + match &self.body {
                SendBody::Empty => 0,
                SendBody::Frame(frame) => frame.len() as usize,
                SendBody::Encoded(len) => *len,
                SendBody::Head(head) => head.len(),
                SendBody::Target { .. } => 12,
            }
    }
}

/// A frame waiting for credits.
enum Outgoing {
    Frame(OutFrame),
    /// A small frame of this many bytes, in the session's encoded bytes.
    Encoded(usize),
}

struct Incoming {
    request_id: u64,
    message: crate::Message,
    payload: Payload,
}

/// One connection's protocol state.
pub struct Session {
    config: SessionConfig,
    peer_credits: u32,
    owed_credits: u32,
    next_xfer: u32,
    /// Frames waiting for credits, in order.
    waiting: VecDeque<Outgoing>,
    /// Small frames encoded by [`Session::send_message`], from `encoded_read` on: written out
    /// in the order they were queued.
    encoded: Vec<u8>,
    encoded_read: usize,
    /// Announced, waiting for the peer's CTS or REFUSE.
    announced: HashMap<u32, OutFrame>,
    /// Cleared by the peer, waiting for a credit to write: (xfer, address, key).
    cleared: VecDeque<(u32, u64, u32)>,
    /// CTS and REFUSE answers waiting for a credit: (op, xfer, len, body).
    answers: VecDeque<(u8, u32, u64, SendBody)>,
    /// Receive slots used and not posted again yet.
    used: Vec<u32>,
    /// SENDs announced by an [`Action::Send`], not yet written out.
    sends: VecDeque<QueuedSend>,
    /// Being written to the peer.
    writing: HashMap<u32, OutFrame>,
    /// Memory taken for the peer's announced payloads, until their WRITE lands.
    incoming: HashMap<u32, Incoming>,
    actions: VecDeque<Action>,
    /// What arrived, in the order the peer sent it: a large frame still being written holds
    /// back the frames after it, so requests are served in the order they were made.
    inbox: VecDeque<Inbound>,
    /// Bytes handed to the device for the peer so far: SENDs written out, payloads written.
    sent_bytes: u64,
    /// Frames queued by [`Self::send_frame`] and [`Self::send_message`] and not let go yet (a
    /// small one once its SEND is written out, a large one once its WRITEs complete or the peer
    /// refuses it), and their bytes: kept as they change, as the poller reads them per event.
    held: (usize, u64),
}

enum Inbound {
    Ready(RecvEvent),
    Writing(u32),
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("peer_credits", &self.peer_credits)
            .field("owed_credits", &self.owed_credits)
            .field("waiting", &self.waiting.len())
            .field("incoming", &self.incoming.len())
            .field("inbox", &self.inbox.len())
            .finish()
    }
}

fn header(op: u8, credits: u32, xfer: u32, len: u64) -> [u8; RDMA_HEADER_LEN] {
    let mut h = [0u8; RDMA_HEADER_LEN];
    h[0] = op;
    h[2..4].copy_from_slice(&(credits.min(u16::MAX.into()) as u16).to_le_bytes());
    h[4..8].copy_from_slice(&xfer.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h
}

impl Session {
    /// A session whose receive slots still need posting (the first actions say so). At least
    /// four slots (fewer are raised to four).
    pub fn new(config: SessionConfig) -> Self {
        let config = config.normalized();
        let actions = (0..config.slots).map(|slot| Action::PostRecv { slot }).collect();
        Self {
            config,
            peer_credits: config.slots,
            owed_credits: 0,
            next_xfer: 1,
            waiting: VecDeque::new(),
            encoded: Vec::new(),
            encoded_read: 0,
            announced: HashMap::new(),
            cleared: VecDeque::new(),
            answers: VecDeque::new(),
            used: Vec::new(),
            sends: VecDeque::new(),
            writing: HashMap::new(),
            incoming: HashMap::new(),
            actions,
            inbox: VecDeque::new(),
            sent_bytes: 0,
            held: (0, 0),
        }
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Queues a frame for the peer.
    pub fn send_frame(&mut self, frame: OutFrame) {
        self.hold(frame.len());
        self.waiting.push_back(Outgoing::Frame(frame));
        self.pump();
    }

    /// Queues a frame of `message` with `tensors` as its payload when it is small (at most
    /// [`ENCODE_MAX`] bytes, and one SEND), encoding it at once into the session's own buffer:
    /// nothing is allocated once that buffer has grown, and the tensors are not referenced after
    /// the call. Returns the frame's length, or `None`, queueing nothing, when it is larger:
    /// send it with [`Self::send_frame`].
    pub fn send_message<T>(
        &mut self,
        request_id: u64,
        message: &Message,
        tensors: &[T],
    ) -> Result<Option<usize>, ProtocolError>
    where
        T: std::ops::Deref,
        T::Target: AsRef<[u8]>,
    {
        let start = self.encoded.len();
        match self.encode_small(request_id, message, tensors) {
            Ok(true) => {
                let len = self.encoded.len() - start;
                self.hold(len as u64);
                self.waiting.push_back(Outgoing::Encoded(len));
                self.pump();
                Ok(Some(len))
            }
            other => {
                self.encoded.truncate(start);
                other.map(|_| None)
            }
        }
    }

    fn encode_small<T>(&mut self, request_id: u64, message: &Message, tensors: &[T]) -> Result<bool, ProtocolError>
    where
        T: std::ops::Deref,
        T::Target: AsRef<[u8]>,
    {
        let encode_max = self.eager_max().min(ENCODE_MAX as u64);
        let descs = message.tensors();
        // A frame too large by its payload alone is turned away before anything is encoded
        // (it is encoded once, as an `OutFrame`).
        if payload_len(descs)? > encode_max {
            return Ok(false);
        }
        check_tensor_lens(descs, tensors.iter().map(|t| (**t).as_ref().len()))?;
        let out = &mut self.encoded;
        let start = out.len();
        let payload = append_head(out, request_id, message)?;
        if (out.len() - start) as u64 + payload > encode_max {
            return Ok(false);
        }
        for (padding, bytes) in paddings(descs).zip(tensors) {
            out.resize(out.len() + padding, 0);
            out.extend_from_slice((**bytes).as_ref());
        }
        Ok(true)
    }

    /// Largest frame that goes in one SEND.
    fn eager_max(&self) -> u64 {
        u64::from(self.config.slot_size) - RDMA_HEADER_LEN as u64
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The action [`Self::poll_action`] returns next.
    pub fn peek_action(&self) -> Option<&Action> {
        self.actions.front()
    }

    /// Writes the next SEND (the oldest [`Action::Send`] not written yet) into `dst`, which
    /// must hold the length that action gave; returns that length (0 when none is queued).
    pub fn write_send(&mut self, dst: &mut [u8]) -> usize {
        let Some(send) = self.sends.pop_front() else { return 0 };
        let len = send.len();
        let Some(dst) = dst.get_mut(..len) else {
            // The driver's buffer is too small: a driver bug. Keep the SEND for a larger one.
            self.sends.push_front(send);
            return 0;
        };
        self.sent_bytes += len as u64;
        let (head, mut rest) = dst.split_at_mut(RDMA_HEADER_LEN);
        head.copy_from_slice(&send.head);
        let mut put = |bytes: &[u8]| {
            let (into, after) = std::mem::take(&mut rest).split_at_mut(bytes.len());
            into.copy_from_slice(bytes);
            rest = after;
        };
        match &send.body {
            SendBody::Empty => {}
            SendBody::Frame(frame) => {
                frame.slices().for_each(put);
                self.held = (self.held.0 - 1, self.held.1 - frame.len());
            }
            SendBody::Encoded(len) => {
                self.held = (self.held.0 - 1, self.held.1 - *len as u64);
                let end = self.encoded_read + len;
                put(&self.encoded[self.encoded_read..end]);
                self.encoded_read = end;
                if end == self.encoded.len() {
                    self.encoded.clear();
                    self.encoded_read = 0;
                } else if end >= COMPACT_AFTER && 2 * end >= self.encoded.len() {
                    // Never fully drained (a steady stream waiting on credits): drop what was
                    // written, so the buffer does not grow without bound.
                    self.encoded.drain(..end);
                    self.encoded_read = 0;
                }
            }
            SendBody::Head(bytes) => put(bytes),
            SendBody::Target { addr, rkey } => {
                put(&addr.to_le_bytes());
                put(&rkey.to_le_bytes());
            }
        }
        len
    }

    /// Frames (and refusals) that arrived, in the order the peer sent them.
    pub fn poll_event(&mut self) -> Option<RecvEvent> {
        match self.inbox.front() {
            Some(Inbound::Ready(_)) => match self.inbox.pop_front() {
                Some(Inbound::Ready(event)) => Some(event),
                _ => None,
            },
            _ => None,
        }
    }

    /// Nothing queued, announced, being written or awaited, in either direction.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.announced.is_empty()
            && self.cleared.is_empty()
            && self.answers.is_empty()
            && self.sends.is_empty()
            && self.writing.is_empty()
            && self.incoming.is_empty()
            && self.inbox.is_empty()
    }

    /// Whether a frame given to [`Self::send_frame`] is still held (waiting, announced,
    /// cleared or being written): its payload may still be read.
    pub fn holds_frames(&self) -> bool {
        self.waiting.iter().any(|o| matches!(o, Outgoing::Frame(_)))
            || self.sends.iter().any(|s| matches!(s.body, SendBody::Frame(_)))
            || !self.announced.is_empty()
            || !self.cleared.is_empty()
            || !self.writing.is_empty()
    }

    /// The memory an incoming transfer lands in (to register).
    pub fn incoming_buffer(&mut self, xfer: u32) -> Option<&mut Payload> {
        self.incoming.get_mut(&xfer).map(|i| &mut i.payload)
    }

    /// The payload of an outgoing transfer: (offset in the peer's buffer, bytes) per tensor.
    pub fn outgoing_segments(&self, xfer: u32) -> Option<impl Iterator<Item = (u64, &[u8])>> {
        self.writing.get(&xfer).map(OutFrame::payload_segments)
    }

    /// The incoming transfer's memory is registered: tell the peer where to write.
    pub fn advertise(&mut self, xfer: u32, addr: u64, rkey: u32) {
        if let Some(incoming) = self.incoming.get(&xfer) {
            let len = incoming.payload.buf.len() as u64;
            self.answers.push_back((op::CTS, xfer, len, SendBody::Target { addr, rkey }));
            self.pump();
        }
    }

    /// The WRITEs of an outgoing transfer completed: its memory may go.
    pub fn on_write_sent(&mut self, xfer: u32) {
        if let Some(frame) = self.writing.remove(&xfer) {
            self.sent_bytes += frame.payload_len();
            self.let_go(&frame);
        }
    }

    /// Frames queued for the peer and their bytes, not let go yet (waiting for credits, for a
    /// send slot, for the peer's answer to an announcement, or being written): what a peer that
    /// returns no credits makes this side hold.
    pub fn backlog(&self) -> (usize, u64) {
        self.held
    }

    /// Of the frames held, those that wait on the peer (for credits, a send slot, its answer to
    /// an announcement); not those whose WRITEs the device is carrying out, which show as sent
    /// only once they complete (under emulation a 256 MiB one takes longer than a stall window).
    pub fn waiting_on_peer(&self) -> usize {
        self.held.0 - self.writing.len()
    }

    fn hold(&mut self, len: u64) {
        self.held = (self.held.0 + 1, self.held.1 + len);
    }

    /// A large frame's WRITEs completed, or the peer refused it.
    fn let_go(&mut self, frame: &OutFrame) {
        self.held = (self.held.0 - 1, self.held.1 - frame.len());
    }

    /// Bytes handed to the device for the peer so far (it only grows): a backlog that stays
    /// while this does not move is a peer that stopped taking what it is sent.
    pub fn sent_bytes(&self) -> u64 {
        self.sent_bytes
    }

    /// A SEND landed in receive slot `slot`. The slot is posted again once its bytes are used.
    pub fn on_receive(&mut self, slot: u32, bytes: &[u8], alloc: &mut dyn PayloadAlloc) -> Result<(), SessionError> {
        if bytes.len() < RDMA_HEADER_LEN {
            return Err(SessionError::Short(bytes.len()));
        }
        let (head, body) = bytes.split_at(RDMA_HEADER_LEN);
        let credits = u32::from(u16::from_le_bytes([head[2], head[3]]));
        let xfer = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        let len = u64::from_le_bytes(head[8..16].try_into().unwrap_or_default());
        // A peer that returns more than it could have (a broken or hostile one) only harms
        // itself; the count must not overflow.
        self.peer_credits = self.peer_credits.saturating_add(credits);
        match head[0] {
            op::EAGER => self.on_eager(body, alloc)?,
            op::RTS => self.on_rts(xfer, len, body, alloc)?,
            op::CTS => {
                let (Some(addr), Some(rkey)) = (body.get(..8), body.get(8..12)) else {
                    return Err(SessionError::Short(bytes.len()));
                };
                let frame = self.announced.remove(&xfer).ok_or(SessionError::UnknownTransfer(xfer))?;
                self.writing.insert(xfer, frame);
                self.cleared.push_back((
                    xfer,
                    u64::from_le_bytes(addr.try_into().unwrap_or_default()),
                    u32::from_le_bytes(rkey.try_into().unwrap_or_default()),
                ));
            }
            op::REFUSE => {
                let frame = self.announced.remove(&xfer).ok_or(SessionError::UnknownTransfer(xfer))?;
                self.let_go(&frame);
            }
            op::CREDIT => {}
            other => return Err(SessionError::UnknownOp(other)),
        }
        self.repost(slot);
        self.pump();
        Ok(())
    }

    /// A WRITE with immediate `xfer` landed (it used receive slot `slot`): the frame is whole.
    pub fn on_write_received(&mut self, slot: u32, xfer: u32) -> Result<(), SessionError> {
        let incoming = self.incoming.remove(&xfer).ok_or(SessionError::UnknownTransfer(xfer))?;
        let frame = RecvEvent::Frame(crate::Frame {
            request_id: incoming.request_id,
            message: incoming.message,
            payload: Some(incoming.payload),
        });
        if let Some(entry) = self.inbox.iter_mut().find(|e| matches!(e, Inbound::Writing(x) if *x == xfer)) {
            *entry = Inbound::Ready(frame);
        }
        self.repost(slot);
        self.pump();
        Ok(())
    }

    /// Used slots are posted again in batches (one verbs call for several, and most messages
    /// then post none before they are answered). A slot becomes a credit for the peer only
    /// once its `PostRecv` is out, so the peer never SENDs into a receive not posted yet.
    fn repost(&mut self, slot: u32) {
        self.used.push(slot);
        if self.used.len() as u32 >= self.repost_batch() {
            self.owed_credits += self.used.len() as u32;
            self.actions.extend(self.used.drain(..).map(|slot| Action::PostRecv { slot }));
        }
    }

    /// At most a quarter of the slots wait to be posted again: the peer is left at least three
    /// quarters less the credits owed, so neither side stalls (`pump`).
    fn repost_batch(&self) -> u32 {
        (self.config.slots / 4).clamp(1, 16)
    }

    fn on_eager(&mut self, body: &[u8], alloc: &mut dyn PayloadAlloc) -> Result<(), SessionError> {
        let head = body.get(..HEADER_LEN).ok_or(SessionError::Short(body.len()))?;
        let header = FrameHeader::parse(head).ok_or(SessionError::Short(body.len()))?;
        let meta_len = header.meta_len.get() as usize;
        let meta = body.get(HEADER_LEN..HEADER_LEN + meta_len).ok_or(SessionError::Short(body.len()))?;
        let payload = &body[HEADER_LEN + meta_len..];
        if payload.len() as u64 != header.payload_len.get() {
            return Err(SessionError::Frame(format!(
                "{} payload bytes where the header says {}",
                payload.len(),
                header.payload_len.get()
            )));
        }
        self.accept_head(&header, meta, alloc, Some(payload));
        Ok(())
    }

    fn on_rts(&mut self, xfer: u32, len: u64, body: &[u8], alloc: &mut dyn PayloadAlloc) -> Result<(), SessionError> {
        let header = FrameHeader::parse(body).ok_or(SessionError::Short(body.len()))?;
        let meta_len = header.meta_len.get() as usize;
        let meta = body.get(HEADER_LEN..HEADER_LEN + meta_len).ok_or(SessionError::Short(body.len()))?;
        if len != header.payload_len.get() {
            return Err(SessionError::Frame(format!(
                "announced {len} bytes, header says {}",
                header.payload_len.get()
            )));
        }
        // The memory of the transfer in progress is registered for the peer's WRITEs: it must
        // not be replaced (and freed) under them.
        if self.incoming.contains_key(&xfer) {
            return Err(SessionError::DuplicateTransfer(xfer));
        }
        match self.accept_head(&header, meta, alloc, None) {
            Some(incoming) => {
                self.incoming.insert(xfer, incoming);
                self.inbox.push_back(Inbound::Writing(xfer));
                self.actions.push_back(Action::Register { xfer });
            }
            // Refused: the sender drops the payload.
            None => self.answers.push_back((op::REFUSE, xfer, 0, SendBody::Empty)),
        }
        Ok(())
    }

    /// Validates and decodes a frame head and takes memory for its payload through `alloc`.
    /// With the payload in hand (`eager`: copied in, it is small) the frame becomes an event;
    /// otherwise the caller gets the parked transfer. Refusals become events.
    fn accept_head(
        &mut self,
        header: &FrameHeader,
        meta: &[u8],
        alloc: &mut dyn PayloadAlloc,
        eager: Option<&[u8]>,
    ) -> Option<Incoming> {
        let request_id = header.request_id.get();
        let decoded = header
            .validate(&self.config.limits)
            .map_err(Refusal::from)
            .and_then(|()| {
                Kind::from_wire(header.kind.get())
                    .ok_or_else(|| Refusal::from(ProtocolError::UnknownKind { kind: header.kind.get() }))
            })
            .and_then(|kind| decode_body(header, kind, meta, &self.config.limits, alloc));
        let frame = |message, payload| RecvEvent::Frame(crate::Frame { request_id, message, payload });
        match (decoded, eager) {
            (Err(refusal), _) => self.inbox.push_back(Inbound::Ready(RecvEvent::Rejected { request_id, refusal })),
            (Ok((message, None)), _) => self.inbox.push_back(Inbound::Ready(frame(message, None))),
            (Ok((message, Some(mut payload))), Some(bytes)) => {
                payload.buf.as_mut_slice().copy_from_slice(bytes);
                self.inbox.push_back(Inbound::Ready(frame(message, Some(payload))));
            }
            (Ok((message, Some(payload))), None) => return Some(Incoming { request_id, message, payload }),
        }
        None
    }

    /// Queues one SEND carrying the credits owed; the caller has checked a credit is left.
    fn send(&mut self, op: u8, xfer: u32, len: u64, body: SendBody) {
        let send = QueuedSend { head: header(op, std::mem::take(&mut self.owed_credits), xfer, len), body };
        self.peer_credits -= 1;
        self.actions.push_back(Action::Send { len: send.len() });
        self.sends.push_back(send);
    }

    /// Sends what credits allow: answers first, then cleared payloads, then new frames, each
    /// needing two credits so that one is always left for a `CREDIT` message; that message
    /// goes when half the slots are owed. (Each side receiving at least four slots' worth, a
    /// `CREDIT` always returns at least two credits, enough for the peer to move.)
    fn pump(&mut self) {
        let eager_max = self.eager_max();
        while self.peer_credits >= 2 {
            if let Some((op, xfer, len, body)) = self.answers.pop_front() {
                self.send(op, xfer, len, body);
            } else if let Some((xfer, addr, rkey)) = self.cleared.pop_front() {
                // The WRITE with immediate uses one of the peer's receives.
                self.peer_credits -= 1;
                self.actions.push_back(Action::Write { xfer, addr, rkey });
            } else if let Some(outgoing) = self.waiting.pop_front() {
                match outgoing {
                    Outgoing::Encoded(len) => self.send(op::EAGER, 0, len as u64, SendBody::Encoded(len)),
                    Outgoing::Frame(frame) if frame.len() <= eager_max => {
                        self.send(op::EAGER, 0, frame.len(), SendBody::Frame(frame));
                    }
                    Outgoing::Frame(frame) => {
                        let xfer = self.next_xfer;
                        // Ids stay within 24 bits: they travel in work request ids too.
                        self.next_xfer = self.next_xfer % MAX_XFER + 1;
                        self.send(op::RTS, xfer, frame.payload_len(), SendBody::Head(frame.head().to_vec()));
                        self.announced.insert(xfer, frame);
                    }
                }
            } else {
                break;
            }
        }
        if self.owed_credits >= self.config.slots / 2 && self.peer_credits >= 1 {
            self.send(op::CREDIT, 0, 0, SendBody::Empty);
        }
    }
}

#[cfg(test)]
mod tests;
