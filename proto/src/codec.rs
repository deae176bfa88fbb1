//! Framing without I/O. [`FrameReader`] turns received bytes into frames: the driver asks it
//! where to read ([`FrameReader::read_target`]), reads, reports how many bytes arrived
//! ([`FrameReader::on_read`]) and collects events ([`FrameReader::next_event`]). [`SendQueue`]
//! holds outgoing frames and hands the driver the slices to write. Neither touches a socket, so
//! both are tested and fuzzed alone, and the mio, io_uring and blocking drivers share them.
//!
//! Payloads are read straight into their final buffer: once a frame's metadata is known, the
//! reader points the driver at the payload buffer first and its small staging buffer second, so
//! only the payload bytes that arrive in the same read as their header are copied (at most one
//! staging buffer's worth per frame).

use std::collections::VecDeque;
use std::io::IoSlice;
use std::mem;
use std::sync::Arc;

use djinn_memory::HostBuf;
use djinn_memory::Reservation;

use super::error::{ErrorCode, ProtocolError};
use super::header::{FrameHeader, HEADER_LEN};
use super::limits::Limits;
use super::message::Kind;
use super::message::Message;
use super::tensor::{self, check_tensor_lens, paddings};

/// Bytes read ahead of the frame being decoded.
pub const STAGING_LEN: usize = 64 * 1024;

/// The memory a frame's payload was received into, and the budget it holds while it lives.
#[derive(Debug)]
pub struct Payload {
    pub buf: HostBuf,
    pub reservation: Option<Reservation>,
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_slice()
    }
}

/// A decoded frame.
#[derive(Debug)]
pub struct Frame {
    pub request_id: u64,
    pub message: Message,
    /// Present when the message has tensors; laid out by [`payload_layout`].
    pub payload: Option<Payload>,
}

/// Why one request was refused; the connection itself stays usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

impl From<ProtocolError> for Refusal {
    fn from(e: ProtocolError) -> Self {
        Self { code: e.code(), message: e.to_string() }
    }
}

impl From<djinn_memory::OverBudget> for Refusal {
    fn from(e: djinn_memory::OverBudget) -> Self {
        let code = if e.tenant.is_some() { ErrorCode::QuotaExceeded } else { ErrorCode::OverBudget };
        Self { code, message: e.to_string() }
    }
}

impl From<djinn_memory::AllocError> for Refusal {
    fn from(e: djinn_memory::AllocError) -> Self {
        Self { code: ErrorCode::OutOfMemory, message: e.to_string() }
    }
}

/// Decides where a payload goes, after its metadata was validated and before any of its bytes
/// are read: the place for budget checks, so nothing is allocated for a refused request.
pub trait PayloadAlloc {
    fn alloc(&mut self, message: &Message, len: usize) -> Result<Payload, Refusal>;
}

#[derive(Debug)]
pub enum RecvEvent {
    Frame(Frame),
    /// The frame was read and dropped; answer `request_id` with this refusal.
    Rejected {
        request_id: u64,
        refusal: Refusal,
    },
    /// The stream cannot be framed any more: report the error and close.
    Fatal(ProtocolError),
}

enum State {
    Header,
    Meta { header: FrameHeader, kind: Kind },
    Payload { request_id: u64, message: Message, payload: Payload, filled: usize },
    Discard { request_id: u64, remaining: u64, refusal: Refusal },
    Failed,
}

/// The staging a reader keeps between frames: [`STAGING_LEN`], or less where the limits allow
/// no frame head that large (a connection before its hello).
fn base_staging(limits: &Limits) -> usize {
    STAGING_LEN.min(HEADER_LEN + limits.max_meta as usize)
}

/// Where the next read should put its bytes: `payload` first (may be empty), then `staging`.
#[derive(Debug)]
pub struct ReadTarget<'a> {
    pub payload: &'a mut [u8],
    pub staging: &'a mut [u8],
}

pub struct FrameReader {
    limits: Limits,
    staging: Vec<u8>,
    start: usize,
    end: usize,
    state: State,
}

impl std::fmt::Debug for FrameReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameReader").field("buffered", &(self.end - self.start)).finish()
    }
}

impl FrameReader {
    pub fn new(limits: Limits) -> Self {
        Self { limits, staging: vec![0; base_staging(&limits)], start: 0, end: 0, state: State::Header }
    }

    /// Holds later frames to `limits` (a connection's own, once its peer authenticated).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        let base = base_staging(&limits);
        if self.staging.len() < base {
            self.staging.resize(base, 0);
        }
    }

    /// Bytes of staging held now.
    #[cfg(test)]
    pub(crate) fn staging_capacity(&self) -> usize {
        self.staging.capacity()
    }

    /// True between frames with nothing buffered: a close here is a clean one.
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Header) && self.start == self.end
    }

    /// The buffers the next read fills, in order. Call after [`Self::next_event`] returned
    /// `None`; the driver must not report more bytes than the two slices hold.
    pub fn read_target(&mut self) -> ReadTarget<'_> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // Grown for a large metadata section: give it back once that frame is decoded.
            let base = base_staging(&self.limits);
            if matches!(self.state, State::Header) && self.staging.len() > base {
                self.staging.truncate(base);
                self.staging.shrink_to_fit();
            }
        }
        let need = match &self.state {
            State::Meta { header, .. } => header.meta_len.get() as usize,
            _ => HEADER_LEN,
        };
        if self.staging.len() - self.start < need || self.staging.len() - self.end < HEADER_LEN {
            self.staging.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.staging.len() < need {
                // Bounded by `limits.max_meta`, checked with the header.
                self.staging.resize(need, 0);
            }
        }
        let staging = &mut self.staging[self.end..];
        let payload = match &mut self.state {
            State::Payload { payload, filled, .. } => &mut payload.buf.as_mut_slice()[*filled..],
            _ => &mut [][..],
        };
        ReadTarget { payload, staging }
    }

    /// Records that a read put `n` bytes into the last [`ReadTarget`].
    pub fn on_read(&mut self, mut n: usize) {
        if let State::Payload { payload, filled, .. } = &mut self.state {
            let into_payload = n.min(payload.buf.len() - *filled);
            *filled += into_payload;
            n -= into_payload;
        }
        debug_assert!(self.end + n <= self.staging.len());
        self.end = (self.end + n).min(self.staging.len());
    }

    /// The peer closed its side. Returns the error to report when that cut a frame short.
    pub fn on_eof(&mut self) -> Option<ProtocolError> {
        let buffered = (self.end - self.start) as u64;
        let error = match &self.state {
            State::Failed => return None,
            State::Header if buffered == 0 => return None,
            State::Header => {
                ProtocolError::Truncated { part: "header", received: buffered, expected: HEADER_LEN as u64 }
            }
            State::Meta { header, .. } => ProtocolError::Truncated {
                part: "metadata",
                received: buffered,
                expected: header.meta_len.get().into(),
            },
            State::Payload { payload, filled, .. } => ProtocolError::Truncated {
                part: "payload",
                received: *filled as u64,
                expected: payload.buf.len() as u64,
            },
            State::Discard { remaining, .. } => {
                ProtocolError::Truncated { part: "payload", received: 0, expected: *remaining }
            }
        };
        self.state = State::Failed;
        Some(error)
    }

    /// Decodes what has been read; `None` means more bytes are needed.
    pub fn next_event(&mut self, alloc: &mut dyn PayloadAlloc) -> Option<RecvEvent> {
        loop {
            let avail = self.end - self.start;
            match mem::replace(&mut self.state, State::Failed) {
                State::Failed => return None,
                State::Header => {
                    let Some(header) = FrameHeader::parse(&self.staging[self.start..self.end]) else {
                        self.state = State::Header;
                        return None;
                    };
                    self.start += HEADER_LEN;
                    if let Err(e) = header.validate(&self.limits) {
                        return Some(RecvEvent::Fatal(e));
                    }
                    let request_id = header.request_id.get();
                    self.state = match Kind::from_wire(header.kind.get()) {
                        Some(kind) => State::Meta { header, kind },
                        None => State::Discard {
                            request_id,
                            remaining: u64::from(header.meta_len.get()) + header.payload_len.get(),
                            refusal: ProtocolError::UnknownKind { kind: header.kind.get() }.into(),
                        },
                    };
                }
                State::Meta { header, kind } => {
                    let meta_len = header.meta_len.get() as usize;
                    if avail < meta_len {
                        self.state = State::Meta { header, kind };
                        return None;
                    }
                    let meta = &self.staging[self.start..self.start + meta_len];
                    self.start += meta_len;
                    let request_id = header.request_id.get();
                    let payload_len = header.payload_len.get();
                    let allocated = decode_body(&header, kind, meta, &self.limits, alloc);
                    match allocated {
                        Ok((message, None)) => {
                            self.state = State::Header;
                            return Some(RecvEvent::Frame(Frame { request_id, message, payload: None }));
                        }
                        Ok((message, Some(payload))) => {
                            self.state = State::Payload { request_id, message, payload, filled: 0 };
                        }
                        Err(refusal) => {
                            self.state = State::Discard { request_id, remaining: payload_len, refusal };
                        }
                    }
                }
                State::Payload { request_id, message, mut payload, mut filled } => {
                    let dst = &mut payload.buf.as_mut_slice()[filled..];
                    let n = dst.len().min(avail);
                    dst[..n].copy_from_slice(&self.staging[self.start..self.start + n]);
                    self.start += n;
                    filled += n;
                    if filled < payload.buf.len() {
                        self.state = State::Payload { request_id, message, payload, filled };
                        return None;
                    }
                    self.state = State::Header;
                    return Some(RecvEvent::Frame(Frame { request_id, message, payload: Some(payload) }));
                }
                State::Discard { request_id, remaining, refusal } => {
                    let n = remaining.min(avail as u64);
                    self.start += n as usize;
                    if n < remaining {
                        self.state = State::Discard { request_id, remaining: remaining - n, refusal };
                        return None;
                    }
                    self.state = State::Header;
                    return Some(RecvEvent::Rejected { request_id, refusal });
                }
            }
        }
    }
}

/// Decodes a frame's metadata (its header already validated) and, when it has a payload, asks
/// `alloc` for the memory it will land in. A refusal leaves the frame to be skipped; the
/// stream stays in step. Shared by the byte-stream reader and the RDMA transport.
pub fn decode_body(
    header: &FrameHeader,
    kind: Kind,
    meta: &[u8],
    limits: &Limits,
    alloc: &mut dyn PayloadAlloc,
) -> Result<(Message, Option<Payload>), Refusal> {
    let payload_len = header.payload_len.get();
    let message = Message::decode(kind, meta, limits)?;
    let expected = tensor::payload_len(message.tensors())?;
    if expected != payload_len {
        return Err(ProtocolError::PayloadMismatch { announced: payload_len, expected }.into());
    }
    if payload_len == 0 {
        return Ok((message, None));
    }
    let len = usize::try_from(payload_len)
        .map_err(|_| Refusal::from(ProtocolError::FrameTooLarge { len: payload_len, limit: usize::MAX as u64 }))?;
    let payload = alloc.alloc(&message, len)?;
    Ok((message, Some(payload)))
}

/// Writes the header and metadata of `message` into `out` (cleared first) and returns the
/// payload length the header announces.
pub fn encode_head(out: &mut Vec<u8>, request_id: u64, message: &Message) -> Result<u64, ProtocolError> {
    out.clear();
    append_head(out, request_id, message)
}

/// Appends the header and metadata of `message` to `out` and returns the payload length the
/// header announces. On error, `out` may hold part of the head: truncate it.
pub fn append_head(out: &mut Vec<u8>, request_id: u64, message: &Message) -> Result<u64, ProtocolError> {
    let start = out.len();
    out.resize(start + HEADER_LEN, 0);
    message.encode(out);
    let meta_len = out.len() - start - HEADER_LEN;
    let meta_len = u32::try_from(meta_len)
        .map_err(|_| ProtocolError::MetaTooLarge { len: meta_len as u64, limit: u32::MAX.into() })?;
    let payload_len = tensor::payload_len(message.tensors())?;
    let header = FrameHeader::new(message.kind(), request_id, meta_len, payload_len);
    out[start..start + HEADER_LEN].copy_from_slice(zerocopy::IntoBytes::as_bytes(&header));
    Ok(payload_len)
}

/// Zero bytes for the padding between tensors of a payload.
pub static ZEROS: [u8; 64] = [0; 64];

/// Tensor bytes shared with whoever else holds them (the store, the executor).
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

#[derive(Clone)]
enum Segment {
    Bytes(SharedBytes),
    Zeros(usize),
}

impl Segment {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Bytes(b) => (**b).as_ref(),
            Self::Zeros(n) => &ZEROS[..*n],
        }
    }
}

/// A frame ready to send: its head and its payload segments, none of them copied.
#[derive(Clone)]
pub struct OutFrame {
    head: Vec<u8>,
    segments: Vec<Segment>,
    len: u64,
}

impl std::fmt::Debug for OutFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutFrame").field("len", &self.len).finish()
    }
}

impl OutFrame {
    /// `tensors` hold the bytes of `message.tensors()`, in order and of the described lengths.
    pub fn new(request_id: u64, message: &Message, tensors: Vec<SharedBytes>) -> Result<Self, ProtocolError> {
        let mut head = Vec::with_capacity(64);
        let payload_len = encode_head(&mut head, request_id, message)?;
        let descs = message.tensors();
        check_tensor_lens(descs, tensors.iter().map(|t| (**t).as_ref().len()))?;
        let mut segments = Vec::with_capacity(tensors.len() * 2);
        for (padding, bytes) in paddings(descs).zip(tensors) {
            if padding > 0 {
                segments.push(Segment::Zeros(padding));
            }
            segments.push(Segment::Bytes(bytes));
        }
        Ok(Self { len: head.len() as u64 + payload_len, head, segments })
    }

    /// Bytes on the wire.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The header and metadata.
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    pub fn payload_len(&self) -> u64 {
        self.len - self.head.len() as u64
    }

    /// The tensors' bytes with their offsets in the payload (padding left out).
    pub fn payload_segments(&self) -> impl Iterator<Item = (u64, &[u8])> {
        let mut offset = 0u64;
        self.segments.iter().filter_map(move |segment| {
            let bytes = segment.as_slice();
            let at = offset;
            offset += bytes.len() as u64;
            matches!(segment, Segment::Bytes(_)).then_some((at, bytes))
        })
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every byte of the frame, in order: head, tensors and padding.
    pub fn slices(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(self.head.as_slice()).chain(self.segments.iter().map(Segment::as_slice))
    }
}

/// Fills `out` with what is left of `slices` once their first `sent` bytes are written, in
/// order; returns how many it filled. A writer keeps only the count of bytes written.
pub fn unsent_slices<'a>(slices: impl IntoIterator<Item = &'a [u8]>, sent: u64, out: &mut [IoSlice<'a>]) -> usize {
    let mut filled = 0;
    let mut skip = sent;
    for slice in slices {
        if filled == out.len() {
            break;
        }
        let len = slice.len() as u64;
        if skip >= len {
            skip -= len;
            continue;
        }
        out[filled] = IoSlice::new(&slice[skip as usize..]);
        filled += 1;
        skip = 0;
    }
    filled
}

/// Outgoing frames of one connection, in order, with how much of the first is already sent.
#[derive(Debug, Default)]
pub struct SendQueue {
    frames: VecDeque<OutFrame>,
    sent: u64,
    queued: u64,
}

impl SendQueue {
    pub fn push(&mut self, frame: OutFrame) {
        self.queued += frame.len;
        self.frames.push_back(frame);
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Bytes waiting to be written.
    pub fn queued_bytes(&self) -> u64 {
        self.queued - self.sent
    }

    pub fn queued_frames(&self) -> usize {
        self.frames.len()
    }

    /// Fills `out` with the next slices to write, in order; returns how many it filled.
    pub fn write_slices<'a>(&'a self, out: &mut [IoSlice<'a>]) -> usize {
        unsent_slices(self.frames.iter().flat_map(OutFrame::slices), self.sent, out)
    }

    /// Records that `n` bytes were written; frames fully sent are dropped.
    pub fn on_written(&mut self, n: usize) {
        self.sent += n as u64;
        while let Some(front) = self.frames.front() {
            if self.sent < front.len {
                break;
            }
            self.sent -= front.len;
            self.queued -= front.len;
            self.frames.pop_front();
        }
    }
}
