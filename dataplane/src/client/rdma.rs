//! The connection's RDMA path: its queue pair, set up over the TCP stream, and requests
//! exchanged over it from the caller's memory.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use djinn_proto::rdma::SessionConfig;
use djinn_proto::{DataMessage, Frame, Message, OutFrame, RecvEvent, SharedBytes};

use super::{ClientConn, ClientError, PoolAlloc, reply_of};
use crate::rdma::{ChannelError, Completion, RdmaChannel, RdmaContext, RdmaError, RdmaPort, Registrations};

/// The client's RDMA path: its own context (one queue pair) and the channel.
pub(super) struct RdmaPath {
    // The channel (queue pair) goes before the context.
    channel: RdmaChannel,
    ctx: Arc<RdmaContext>,
    completions: Vec<Result<Completion, RdmaError>>,
    /// The outcomes of the requests in flight, by request id from the first (kept between
    /// requests so that a single request allocates nothing here).
    pub(super) replies: Vec<Option<Result<Frame, ClientError>>>,
}

/// Bytes the caller lends for the length of one request, as a frame's payload. The frame
/// lives in the RDMA path, which [`ClientConn::request_rdma`] holds as a local while the
/// request runs and puts back only once its session holds no frame any more (every reply in,
/// every WRITE complete, every announced transfer written or refused); on an error, a timeout
/// or a panic the path is dropped instead, its queue pair first. So no `Lent` outlives the
/// borrow it was made from, and the caller may free the memory as soon as the call returns.
struct Lent {
    ptr: *const u8,
    len: usize,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see the type's comment.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

// SAFETY: read-only access to memory the caller keeps alive for the request.
unsafe impl Send for Lent {}
// SAFETY: as above.
unsafe impl Sync for Lent {}

impl ClientConn {
    /// How often the memory replies were received into over RDMA was registered, and how
    /// often a registration was kept from an earlier reply (none over TCP).
    pub fn rdma_registrations(&self) -> Registrations {
        self.rdma.as_ref().map(|path| path.channel.registrations()).unwrap_or_default()
    }

    /// "rdma" once frames go over RDMA, else "tcp".
    pub fn transport(&self) -> &'static str {
        if self.rdma.is_some() { "rdma" } else { "tcp" }
    }

    /// Moves this connection's frames to RDMA: sets up a queue pair on `port`, exchanges the
    /// two sides' parameters over TCP, connects. The TCP connection stays (it tells when the
    /// node goes away).
    pub fn upgrade_to_rdma(&mut self, port: &RdmaPort, config: SessionConfig) -> Result<(), ClientError> {
        let peer = self.peer;
        let rdma = |source: ChannelError| ClientError::Rdma { peer, source };
        let ctx = RdmaContext::new(port, RdmaChannel::completion_entries(&config)).map_err(|e| rdma(e.into()))?;
        let mut channel = RdmaChannel::new(&ctx, 0, config).map_err(rdma)?;
        // The context is this connection's alone, and the node may see what it sends here.
        channel.keep_registrations();
        let ask = channel.params();
        let reply = self.request(&Message::Data(DataMessage::RdmaConnect(ask)), &[])?;
        let Message::Data(DataMessage::RdmaAccept(node)) = reply.message else {
            return Err(ClientError::UnexpectedReply {
                peer,
                request_id: reply.request_id,
                kind: reply.message.kind().name(),
            });
        };
        if (node.slots, node.slot_size) != (ask.slots, ask.slot_size) {
            self.broken = true;
            return Err(ClientError::NoRdma(format!(
                "the node uses {} slots of {} bytes, not {} of {}",
                node.slots, node.slot_size, ask.slots, ask.slot_size
            )));
        }
        if let Err(e) = channel.connect(&node) {
            // The node already routes this connection's replies to RDMA: it is unusable now.
            self.broken = true;
            return Err(rdma(e));
        }
        self.rdma = Some(RdmaPath { channel, ctx, completions: Vec::new(), replies: Vec::new() });
        Ok(())
    }

    /// The outcome of the one request [`Self::request_rdma`] just completed.
    pub(super) fn take_rdma_reply(&mut self) -> Result<Frame, ClientError> {
        let reply = self.rdma.as_mut().and_then(|path| path.replies.pop()).flatten();
        reply.unwrap_or(Err(ClientError::Closed { peer: self.peer }))
    }

    /// Sends `batch` over RDMA as requests `first..` and waits for all their replies, which it
    /// leaves in the path's `replies`, in order. The path comes back to the connection only
    /// when none of the batch's frames (which lend the caller's memory) is left in it; else it
    /// is dropped here, and the connection with it.
    pub(super) fn request_rdma(&mut self, first: u64, batch: &[(&Message, &[&[u8]])]) -> Result<(), ClientError> {
        let Some(mut path) = self.rdma.take() else { return Err(ClientError::Closed { peer: self.peer }) };
        let result = self.exchange_rdma(&mut path, first, batch);
        if result.is_ok() && !path.channel.holds_frames() {
            self.rdma = Some(path);
        } else {
            // Dropping the path destroys the queue pair before the registrations and the
            // frames go: nothing reads the lent memory after this.
            self.broken = true;
        }
        result
    }

    fn exchange_rdma(
        &mut self,
        path: &mut RdmaPath,
        first: u64,
        batch: &[(&Message, &[&[u8]])],
    ) -> Result<(), ClientError> {
        let peer = self.peer;
        let rdma = |source| match source {
            ChannelError::Request(e) => ClientError::Request(e),
            source => ClientError::Rdma { peer, source },
        };
        for (request_id, (message, tensors)) in (first..).zip(batch) {
            // A small request is encoded straight into the session; a large one is written
            // from the caller's memory.
            let sent = match path.channel.send_message(request_id, message, tensors).map_err(rdma)? {
                Some(len) => len as u64,
                None => {
                    let lent = tensors
                        .iter()
                        .map(|t| Arc::new(Lent { ptr: t.as_ptr(), len: t.len() }) as SharedBytes)
                        .collect();
                    let frame = OutFrame::new(request_id, message, lent).map_err(ClientError::Request)?;
                    let len = frame.len();
                    path.channel.send_frame(frame).map_err(rdma)?;
                    len
                }
            };
            self.bytes_sent += sent;
        }
        let deadline = self.options.timeout.map(|t| Instant::now() + t);
        let mut spin_until = Instant::now() + self.options.spin;
        let replies = &mut path.replies;
        replies.clear();
        replies.resize_with(batch.len(), || None);
        let mut missing = batch.len();
        loop {
            if missing > 0
                && let Some(event) = path.channel.poll_event()
            {
                let id = match &event {
                    RecvEvent::Frame(frame) => frame.request_id,
                    RecvEvent::Rejected { request_id, .. } => *request_id,
                    RecvEvent::Fatal(_) => 0,
                };
                let Some(slot) =
                    id.checked_sub(first).and_then(|i| replies.get_mut(i as usize)).filter(|r| r.is_none())
                else {
                    // Not one of ours (or a connection-level error, id 0): the connection is done.
                    return Err(reply_of(peer, first, event).err().unwrap_or(ClientError::UnexpectedReply {
                        peer,
                        request_id: id,
                        kind: "reply",
                    }));
                };
                let outcome = reply_of(peer, id, event);
                if let Ok(frame) = &outcome {
                    self.bytes_received += frame.payload.as_ref().map_or(0, |p| p.buf.len() as u64);
                }
                *slot = Some(outcome);
                missing -= 1;
                continue;
            }
            // A node may answer before taking a large request's payload (a refusal): its
            // transfer is then refused or written before the request counts as done.
            if missing == 0 && path.channel.writes_done() && !path.channel.holds_frames() {
                return Ok(());
            }
            let mut completions = std::mem::take(&mut path.completions);
            path.ctx.poll(|c| completions.push(c)).map_err(|e| ClientError::Rdma { peer, source: e.into() })?;
            let progressed = !completions.is_empty();
            for c in completions.drain(..) {
                let c = c.map_err(|e| ClientError::Rdma { peer, source: e.into() })?;
                let mut oversized = None;
                let alloc = &mut PoolAlloc { pool: &self.pool, bound: self.reply_bound, oversized: &mut oversized };
                path.channel.on_completion(c, alloc).map_err(|source| ClientError::Rdma { peer, source })?;
                if let Some(announced) = oversized {
                    // The error drops the path (see request_rdma): its transfer is never taken.
                    return Err(ClientError::ReplyTooLarge { peer, announced, bound: self.reply_bound });
                }
            }
            path.completions = completions;
            if progressed {
                spin_until = Instant::now() + self.options.spin;
                continue;
            }
            if Instant::now() < spin_until {
                // Polling the completion queue is a memory read, no system call: spin on it
                // (the node is on another host, or at least another core).
                std::hint::spin_loop();
                continue;
            }
            // Sleep until a completion, or the node's end of the TCP connection moving (it
            // closes when the node goes away), or the deadline.
            path.ctx.arm().map_err(|e| ClientError::Rdma { peer, source: e.into() })?;
            let mut any = false;
            path.ctx
                .poll(|c| {
                    any = true;
                    path.completions.push(c);
                })
                .map_err(|e| ClientError::Rdma { peer, source: e.into() })?;
            if any {
                continue;
            }
            let mut fds = [
                libc::pollfd { fd: path.ctx.fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let timeout_ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ClientError::Timeout { peer, timeout: self.options.timeout.unwrap_or_default() });
                    }
                    left.as_millis().clamp(1, i32::MAX as u128) as i32
                }
            };
            // SAFETY: two valid pollfds for the duration of the call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
            if rc > 0 {
                if fds[0].revents != 0 {
                    path.ctx.ack_events();
                }
                if fds[1].revents != 0 {
                    let mut byte = [0u8; 1];
                    // SAFETY: a one-byte read into a live buffer.
                    let n = unsafe { libc::recv(self.stream.as_raw_fd(), byte.as_mut_ptr().cast(), 1, libc::MSG_PEEK) };
                    if n == 0 || (n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock) {
                        return Err(ClientError::Closed { peer });
                    }
                }
            }
        }
    }
}
