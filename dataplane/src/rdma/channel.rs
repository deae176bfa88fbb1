//! One connection's RDMA driver: carries out a [`Session`]'s actions with verbs (registered
//! receive and send slots, memory registered per transfer) and feeds completions back to it.
//! The same driver serves the node's poller and the client.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use djinn_memory::HostBuf;

use super::verbs::{
    Completion, CompletionKind, Domain, EndpointInfo, QueueDepths, RcEndpoint, RdmaContext, RdmaError, Registered,
};
use djinn_proto::rdma::{Action, Session, SessionConfig, SessionError};
use djinn_proto::{Message, OutFrame, PayloadAlloc, ProtocolError, RdmaParams, RecvEvent};

/// Why an RDMA connection stopped.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error(transparent)]
    Rdma(#[from] RdmaError),
    #[error("peer broke the RDMA protocol: {0}")]
    Session(#[from] SessionError),
    #[error("allocating RDMA slots: {0}")]
    Alloc(#[from] djinn_memory::AllocError),
    /// The frame to send does not match its message (nothing was sent; the connection is fine).
    #[error("inconsistent frame: {0}")]
    Request(#[source] ProtocolError),
}

/// `wr_id` = connection key (32 bits) | tag (8) | index (24).
mod tag {
    pub const RECV: u64 = 1;
    pub const SEND: u64 = 2;
    pub const WRITE_LAST: u64 = 3;
    pub const WRITE_PART: u64 = 4;
}
const INLINE: u64 = 0x00ff_ffff;
/// Largest single WRITE; larger segments are split.
const MAX_WRITE: usize = 1 << 30;
/// One inline SEND in this many asks for a completion. An inline SEND's completion carries
/// nothing we need (its bytes were copied at posting), and every completion costs the device
/// and both pollers work; the occasional signalled one lets the send queue reclaim the
/// unsignalled ones before it (well within its depth).
const SIGNAL_EVERY: u32 = 16;

fn wr_id(key: u32, tag: u64, index: u64) -> u64 {
    (u64::from(key) << 32) | (tag << 24) | (index & 0x00ff_ffff)
}

/// The connection a work request belongs to.
pub fn connection_key(wr_id: u64) -> u32 {
    (wr_id >> 32) as u32
}

// Fields drop in order: the queue pair first, then the registrations, then the memory.
pub struct RdmaChannel {
    endpoint: RcEndpoint,
    incoming_mrs: HashMap<u32, Registered>,
    outgoing_mrs: HashMap<u32, Vec<Registered>>,
    recv_mr: Registered,
    send_mr: Registered,
    session: Session,
    recv_slots: HostBuf,
    send_slots: HostBuf,
    key: u32,
    /// This connection's own protection domain (after the queue pair and the registrations).
    domain: Domain,
    slot_size: usize,
    free_send: Vec<u32>,
    /// Lengths of the session's SENDs not posted yet, in order (one waits for a free send
    /// slot, the rest behind it).
    pending_sends: VecDeque<usize>,
    /// Where an inline SEND is written before posting (its bytes are copied into the work
    /// request, so one buffer serves them all).
    inline: Vec<u8>,
    /// Inline SENDs posted since the last signalled one.
    unsignaled: u32,
    /// Receive slots to post together.
    to_post: Vec<u32>,
    /// Whether the memory transfers are received into keeps its registration for its next
    /// transfer ([`Self::keep_registrations`]).
    keep_registrations: bool,
    registrations: Registrations,
}

/// How often a connection registered the memory its transfers were received into.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Registrations {
    /// Memory registered with the device (`ibv_reg_mr`).
    pub made: u64,
    /// Transfers received into memory whose registration was kept from an earlier one.
    pub reused: u64,
}

impl std::fmt::Debug for RdmaChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaChannel").field("key", &self.key).field("session", &self.session).finish()
    }
}

impl RdmaChannel {
    /// A queue pair with its slots registered, not yet connected. `key` names the connection
    /// in completions ([`connection_key`]).
    pub fn new(ctx: &Arc<RdmaContext>, key: u32, config: SessionConfig) -> Result<Self, ChannelError> {
        let session = Session::new(config);
        let config = *session.config();
        let slots = config.slots as usize;
        let slot_size = config.slot_size as usize;
        let depths = Self::depths(&config);
        // The connection's own protection domain: its peer can write only into memory
        // registered for this connection's transfers.
        let domain = ctx.new_domain()?;
        let endpoint = RcEndpoint::in_domain(ctx, &domain, depths)?;
        let endpoint_inline = endpoint.max_inline() as usize;
        let recv_slots = HostBuf::zeroed(slots * slot_size)?;
        let send_slots = HostBuf::zeroed(slots * slot_size)?;
        // SAFETY: the slot buffers are fields of the channel and outlive their registrations
        // and the queue pair (dropped first, see the field order).
        let (recv_mr, send_mr) = unsafe {
            (
                domain.register_local(recv_slots.as_ptr(), recv_slots.len())?,
                domain.register_local(send_slots.as_ptr(), send_slots.len())?,
            )
        };
        Ok(Self {
            key,
            domain,
            endpoint,
            session,
            slot_size,
            recv_mr,
            recv_slots,
            send_mr,
            send_slots,
            free_send: (0..config.slots).rev().collect(),
            pending_sends: VecDeque::new(),
            inline: vec![0; endpoint_inline],
            unsignaled: 0,
            to_post: Vec::with_capacity(slots),
            keep_registrations: false,
            registrations: Registrations::default(),
            incoming_mrs: HashMap::new(),
            outgoing_mrs: HashMap::new(),
        })
    }

    /// Queue depths of a connection: a receive per slot, and room for each slot's SEND plus
    /// the WRITEs of the transfers in flight.
    fn depths(config: &SessionConfig) -> QueueDepths {
        QueueDepths { send: config.slots * 4, recv: config.slots, ..QueueDepths::default() }
    }

    /// Completion queue entries one connection can need at once (its work requests in flight).
    pub fn completion_entries(config: &SessionConfig) -> u32 {
        let depths = Self::depths(&config.normalized());
        depths.send + depths.recv
    }

    pub fn key(&self) -> u32 {
        self.key
    }

    /// Keeps the registration of the memory a transfer is received into with that memory, for
    /// its next transfers ([`RdmaContext::register_kept`]): a buffer recycled through a pool
    /// is registered once, not once per transfer. Only where this channel's context serves
    /// this connection alone (a client's): the peer can write into a kept buffer later, and a
    /// node shares its context between tenants.
    pub fn keep_registrations(&mut self) {
        self.keep_registrations = true;
    }

    pub fn registrations(&self) -> Registrations {
        self.registrations
    }

    /// This side of the connection, as the handshake carries it.
    pub fn params(&self) -> RdmaParams {
        let info = self.endpoint.info();
        let config = self.session.config();
        RdmaParams {
            qp_number: info.qp_number,
            psn: info.psn,
            gid: info.gid,
            mtu: info.mtu,
            slots: config.slots,
            slot_size: config.slot_size,
        }
    }

    pub fn config(&self) -> &SessionConfig {
        self.session.config()
    }

    /// Connects to the peer the handshake described and posts the receives.
    pub fn connect(&mut self, remote: &RdmaParams) -> Result<(), ChannelError> {
        let remote = EndpointInfo { qp_number: remote.qp_number, psn: remote.psn, gid: remote.gid, mtu: remote.mtu };
        self.endpoint.connect(&remote)?;
        self.drive()
    }

    pub fn send_frame(&mut self, frame: OutFrame) -> Result<(), ChannelError> {
        self.session.send_frame(frame);
        self.drive()
    }

    /// Sends a small frame without building an [`OutFrame`] ([`Session::send_message`]);
    /// the frame's length, or `None` when it is too large for that.
    pub fn send_message<T>(
        &mut self,
        request_id: u64,
        message: &Message,
        tensors: &[T],
    ) -> Result<Option<usize>, ChannelError>
    where
        T: std::ops::Deref,
        T::Target: AsRef<[u8]>,
    {
        let sent = self.session.send_message(request_id, message, tensors).map_err(ChannelError::Request)?;
        if sent.is_some() {
            self.drive()?;
        }
        Ok(sent)
    }

    pub fn poll_event(&mut self) -> Option<RecvEvent> {
        self.session.poll_event()
    }

    /// True when no WRITE of ours is in flight (the memory it reads may be released).
    pub fn writes_done(&self) -> bool {
        self.outgoing_mrs.is_empty()
    }

    /// What the session holds for the peer ([`Session::backlog`]): frames and bytes.
    pub fn backlog(&self) -> (usize, u64) {
        self.session.backlog()
    }

    /// The frames held that wait on the peer ([`Session::waiting_on_peer`]).
    pub fn waiting_on_peer(&self) -> usize {
        self.session.waiting_on_peer()
    }

    /// Bytes handed to the device for the peer so far ([`Session::sent_bytes`]).
    pub fn sent_bytes(&self) -> u64 {
        self.session.sent_bytes()
    }

    /// True while a frame given to [`Self::send_frame`] is held: queued, announced, or being
    /// written ([`Session::holds_frames`]); its payload's memory must stay.
    pub fn holds_frames(&self) -> bool {
        self.session.holds_frames()
    }

    /// Feeds one of this connection's completions to the protocol.
    pub fn on_completion(&mut self, c: Completion, alloc: &mut dyn PayloadAlloc) -> Result<(), ChannelError> {
        let index = (c.wr_id & 0x00ff_ffff) as u32;
        match (c.wr_id >> 24) & 0xff {
            tag::RECV => match (c.kind, c.imm) {
                (CompletionKind::ReceiveWrite, Some(xfer)) => {
                    self.incoming_mrs.remove(&xfer);
                    self.session.on_write_received(index, xfer)?;
                }
                _ => {
                    let start = index as usize * self.slot_size;
                    let end = start + (c.byte_len as usize).min(self.slot_size);
                    self.session.on_receive(index, &self.recv_slots.as_slice()[start..end], alloc)?;
                }
            },
            tag::SEND if u64::from(index) != INLINE => {
                self.free_send.push(index);
                self.flush_sends()?;
            }
            tag::WRITE_LAST => {
                self.outgoing_mrs.remove(&index);
                self.session.on_write_sent(index);
            }
            _ => {}
        }
        self.drive()
    }

    fn drive(&mut self) -> Result<(), ChannelError> {
        while let Some(action) = self.session.poll_action() {
            match action {
                Action::PostRecv { slot } => {
                    // The session asks for reposts in batches: post a run of them in one call.
                    self.to_post.push(slot);
                    if matches!(self.session.peek_action(), Some(Action::PostRecv { .. })) {
                        continue;
                    }
                    let (key, base, size) = (self.key, self.recv_mr.addr, self.slot_size as u64);
                    let recvs = self
                        .to_post
                        .drain(..)
                        .map(|slot| (wr_id(key, tag::RECV, slot.into()), base + u64::from(slot) * size));
                    // SAFETY: the slots lie in the registered receive buffer, which outlives
                    // the queue pair.
                    unsafe { self.endpoint.post_recvs(&self.recv_mr, self.slot_size as u32, recvs) }?;
                }
                Action::Send { len } => {
                    self.pending_sends.push_back(len);
                    self.flush_sends()?;
                }
                Action::Register { xfer } => {
                    let Some(payload) = self.session.incoming_buffer(xfer) else { continue };
                    let (mr, reused) = if self.keep_registrations {
                        self.domain.register_kept(&mut payload.buf)?
                    } else {
                        let (ptr, len) = (payload.buf.as_ptr(), payload.buf.len());
                        // SAFETY: the payload stays in the session until its WRITE lands (then
                        // the registration is dropped first, in `on_completion`).
                        (unsafe { self.domain.register_for_peer_writes(ptr, len) }?, false)
                    };
                    if reused {
                        self.registrations.reused += 1;
                    } else {
                        self.registrations.made += 1;
                    }
                    // The payload starts where the registered memory does.
                    let (addr, rkey) = (mr.addr, mr.rkey());
                    self.incoming_mrs.insert(xfer, mr);
                    self.session.advertise(xfer, addr, rkey);
                }
                Action::Write { xfer, addr, rkey } => self.post_writes(xfer, addr, rkey)?,
            }
        }
        Ok(())
    }

    /// Posts the queued SENDs in order, stopping at one that needs a send slot when none is
    /// free (a later, inline one must not overtake it: the peer reads them in order).
    fn flush_sends(&mut self) -> Result<(), ChannelError> {
        while let Some(&len) = self.pending_sends.front() {
            if len <= self.inline.len() {
                let written = self.session.write_send(&mut self.inline[..len]);
                debug_assert_eq!(written, len, "the session's SENDs and its actions out of step");
                self.unsignaled += 1;
                let signaled = self.unsignaled == SIGNAL_EVERY;
                if signaled {
                    self.unsignaled = 0;
                }
                // SAFETY: inline data is copied into the work request.
                unsafe {
                    self.endpoint.post_send(wr_id(self.key, tag::SEND, INLINE), &self.inline[..len], None, signaled)
                }?;
            } else {
                let Some(slot) = self.free_send.pop() else { break };
                self.post_from_slot(slot, len)?;
            }
            self.pending_sends.pop_front();
        }
        Ok(())
    }

    /// Writes the session's next SEND (`len` bytes) into send slot `slot` and posts it from
    /// there.
    fn post_from_slot(&mut self, slot: u32, len: usize) -> Result<(), ChannelError> {
        let start = slot as usize * self.slot_size;
        let written = self.session.write_send(&mut self.send_slots.as_mut_slice()[start..start + len]);
        debug_assert_eq!(written, len, "the session's SENDs and its actions out of step");
        // SAFETY: the send slot stays untouched until this send completes (it is only reused
        // after its completion frees it).
        let sent = unsafe {
            let slice = std::slice::from_raw_parts(self.send_slots.as_ptr().add(start), len);
            self.endpoint.post_send(wr_id(self.key, tag::SEND, slot.into()), slice, Some(&self.send_mr), true)
        };
        sent.map_err(Into::into)
    }

    /// Writes an outgoing transfer's tensors to the peer's advertised memory, the last WRITE
    /// carrying the transfer id as immediate.
    fn post_writes(&mut self, xfer: u32, addr: u64, rkey: u32) -> Result<(), ChannelError> {
        let mut pieces: Vec<(u64, *const u8, usize)> = Vec::new();
        if let Some(segments) = self.session.outgoing_segments(xfer) {
            for (offset, bytes) in segments {
                for (i, chunk) in bytes.chunks(MAX_WRITE).enumerate() {
                    pieces.push((offset + (i * MAX_WRITE) as u64, chunk.as_ptr(), chunk.len()));
                }
            }
        }
        let mut mrs = Vec::with_capacity(pieces.len());
        let last = pieces.len().saturating_sub(1);
        for (i, &(offset, ptr, len)) in pieces.iter().enumerate() {
            // SAFETY: the bytes belong to the frame the session keeps in `writing` until
            // `on_write_sent`, which comes after this WRITE's completion; the registration is
            // kept as long (in `outgoing_mrs`).
            let mr = unsafe { self.domain.register_local(ptr, len) }?;
            let remote = addr + offset;
            let (tag, imm) = if i == last { (tag::WRITE_LAST, Some(xfer)) } else { (tag::WRITE_PART, None) };
            // SAFETY: as above.
            unsafe {
                self.endpoint.post_write(wr_id(self.key, tag, xfer.into()), &mr, mr.addr, len as u32, rkey, remote, imm)
            }?;
            mrs.push(mr);
        }
        if pieces.is_empty() {
            // Nothing to write (a payload of empty tensors): the immediate alone completes it.
            // SAFETY: a zero-length write reads no memory.
            unsafe {
                self.endpoint.post_write(
                    wr_id(self.key, tag::WRITE_LAST, xfer.into()),
                    &self.send_mr,
                    self.send_mr.addr,
                    0,
                    rkey,
                    addr,
                    Some(xfer),
                )
            }?;
        }
        self.outgoing_mrs.insert(xfer, mrs);
        Ok(())
    }
}
