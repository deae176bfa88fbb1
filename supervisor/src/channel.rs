//! The shared region between the node and one executor process, and the four rings in it: jobs
//! and their bulk bytes down, answers and theirs up.
//!
//! A message's bulk bytes go as records of a ring of their own, placed before the message and
//! taken up, in the same order, while it is decoded (copied straight into the buffer that
//! holds them from then on). A span names its record by its number, so a record placed for a
//! message that was never sent (its encoding failed part way) is dropped by the next take.

use std::sync::Arc;
use std::time::Duration;

use djinn_memory::{BufferPool, HostBuf};
use djinn_node_core::link::{Bulk, LinkError, Span};
use djinn_proto::{Limits, SharedBytes};
use djinn_shm::{Consumer, Producer, Region, RingError};

use crate::SupervisorError;

/// The layout's first bytes: what says the region is a link's, and which version.
const MAGIC: u64 = u64::from_le_bytes(*b"DJNNLINK");
const VERSION: u64 = 1;
/// The layout page before the rings.
const LAYOUT: usize = 4096;

/// The sizes of a link's rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkSizes {
    /// Bytes of each message ring (jobs, answers): many messages of a few KiB.
    pub messages: usize,
    /// Bytes of each bulk ring: the largest payload or reply tensor the link carries, with
    /// room for a few smaller ones. Pages are taken as bytes are first written to them, and
    /// stay: a ring that has wrapped once holds its whole size in memory.
    pub bulk: usize,
}

impl Default for LinkSizes {
    fn default() -> Self {
        Self { messages: 4 << 20, bulk: 256 << 20 }
    }
}

impl LinkSizes {
    fn rounded(self) -> Self {
        Self { messages: self.messages.next_multiple_of(64), bulk: self.bulk.next_multiple_of(64) }
    }

    fn total(self) -> Option<usize> {
        let s = self.rounded();
        LAYOUT.checked_add(s.messages.checked_add(s.bulk)?.checked_mul(2)?)
    }

    /// The offsets of the jobs ring, its bulk ring, the answers ring and its bulk ring.
    fn offsets(self) -> [usize; 4] {
        let s = self.rounded();
        [LAYOUT, LAYOUT + s.messages, LAYOUT + s.messages + s.bulk, LAYOUT + 2 * s.messages + s.bulk]
    }
}

/// The limits a link's messages are decoded under: the protocol's, with room for any reply
/// metadata a node sends.
pub(crate) fn link_limits() -> Limits {
    Limits { max_meta: 64 << 20, max_payload: u64::MAX, ..Limits::default() }
}

/// The node's ends: it sends jobs and takes answers.
pub(crate) struct NodeEnds {
    pub jobs: Producer,
    pub job_bulk: BulkOut,
    pub answers: Consumer,
    pub answer_bulk: BulkIn,
}

/// The executor's ends: it takes jobs and sends answers.
pub(crate) struct ExecutorEnds {
    pub jobs: Consumer,
    pub job_bulk: BulkIn,
    pub answers: Producer,
    pub answer_bulk: BulkOut,
}

/// A new region laid out for a link of `sizes`, and the node's ends of its rings.
pub(crate) fn create(sizes: LinkSizes) -> Result<(Arc<Region>, NodeEnds), SupervisorError> {
    let total = sizes.total().ok_or(SupervisorError::Sizes(sizes))?;
    let region = Arc::new(Region::create("djinn-executor-link", total)?);
    let s = sizes.rounded();
    let mut layout = Vec::with_capacity(32);
    for word in [MAGIC, VERSION, s.messages as u64, s.bulk as u64] {
        layout.extend_from_slice(&word.to_le_bytes());
    }
    region.write(0, &layout);
    let [jobs, job_bulk, answers, answer_bulk] = s.offsets();
    let ends = NodeEnds {
        jobs: Producer::create(&region, jobs, s.messages)?,
        job_bulk: BulkOut::new(Producer::create(&region, job_bulk, s.bulk)?),
        answers: Consumer::create(&region, answers, s.messages)?,
        answer_bulk: BulkIn::new(Consumer::create(&region, answer_bulk, s.bulk)?),
    };
    Ok((region, ends))
}

/// The executor's ends of the link laid out in `region`, after checking its layout.
pub(crate) fn attach(region: &Arc<Region>) -> Result<ExecutorEnds, SupervisorError> {
    let mut layout = [0u8; 32];
    if !region.read(0, &mut layout) {
        return Err(SupervisorError::Layout("shorter than its layout"));
    }
    let word = |i: usize| u64::from_le_bytes(layout[i * 8..i * 8 + 8].try_into().unwrap_or_default());
    if word(0) != MAGIC || word(1) != VERSION {
        return Err(SupervisorError::Layout("not an executor link of this version"));
    }
    let size = |w: u64| usize::try_from(w).map_err(|_| SupervisorError::Layout("a ring past the address space"));
    let sizes = LinkSizes { messages: size(word(2))?, bulk: size(word(3))? };
    if sizes.total().is_none_or(|total| total > region.len()) {
        return Err(SupervisorError::Layout("rings past the region's end"));
    }
    let [jobs, job_bulk, answers, answer_bulk] = sizes.offsets();
    Ok(ExecutorEnds {
        jobs: Consumer::attach(region, jobs, sizes.messages)?,
        job_bulk: BulkIn::new(Consumer::attach(region, job_bulk, sizes.bulk)?),
        answers: Producer::attach(region, answers, sizes.messages)?,
        answer_bulk: BulkOut::new(Producer::attach(region, answer_bulk, sizes.bulk)?),
    })
}

/// Pushes `message`, sleeping while the ring is full for as long as `alive` says the peer is
/// there to make room.
pub(crate) fn push(ring: &mut Producer, message: &[u8], alive: &dyn Fn() -> bool) -> Result<(), RingError> {
    loop {
        match ring.push(message) {
            Err(RingError::Full { free, need }) => {
                if !alive() {
                    return Err(RingError::Full { free, need });
                }
                ring.wait_for_room(Duration::from_millis(100));
            }
            done => return done,
        }
    }
}

/// The placing end of a bulk ring.
pub(crate) struct BulkOut {
    ring: Producer,
    /// The number the next record placed gets.
    next: u64,
    /// Whether the peer is there to make room (set before each message's encoding).
    alive: Box<dyn Fn() -> bool + Send>,
}

impl BulkOut {
    fn new(ring: Producer) -> Self {
        Self { ring, next: 0, alive: Box::new(|| true) }
    }

    pub(crate) fn while_alive(&mut self, alive: impl Fn() -> bool + Send + 'static) {
        self.alive = Box::new(alive);
    }
}

impl Bulk for BulkOut {
    fn place(&mut self, bytes: SharedBytes) -> Result<Span, LinkError> {
        let bytes = (*bytes).as_ref();
        let span = Span { offset: self.next, len: bytes.len() as u64 };
        push(&mut self.ring, bytes, &*self.alive).map_err(|e| LinkError::Bulk { span, reason: e.to_string() })?;
        self.next += 1;
        Ok(span)
    }

    fn take(&mut self, span: Span) -> Result<HostBuf, LinkError> {
        Err(LinkError::Bulk { span, reason: "this end of the link places bulk bytes, it takes none".into() })
    }
}

/// The taking end of a bulk ring.
pub(crate) struct BulkIn {
    ring: Consumer,
    /// The number of the next record in the ring.
    next: u64,
    /// Where taken bytes go: large buffers come back for the next take, their pages touched
    /// already.
    pool: BufferPool,
}

/// Free buffers a bulk ring's taker keeps, and the smallest it pools.
const POOL_RETAINED: u64 = 256 << 20;
const POOL_FROM: usize = 64 << 10;

impl BulkIn {
    fn new(ring: Consumer) -> Self {
        Self { ring, next: 0, pool: BufferPool::new(POOL_RETAINED, POOL_FROM) }
    }
}

impl Bulk for BulkIn {
    fn place(&mut self, bytes: SharedBytes) -> Result<Span, LinkError> {
        let span = Span { offset: 0, len: (*bytes).as_ref().len() as u64 };
        Err(LinkError::Bulk { span, reason: "this end of the link takes bulk bytes, it places none".into() })
    }

    fn take(&mut self, span: Span) -> Result<HostBuf, LinkError> {
        let fail = |reason: String| LinkError::Bulk { span, reason };
        if span.offset < self.next {
            return Err(fail(format!("record {} was taken already (next is {})", span.offset, self.next)));
        }
        loop {
            // The bytes were placed before the message that names them: they are there.
            let taken = self
                .ring
                .pop_with(|len| {
                    if self.next == span.offset && len as u64 == span.len {
                        self.pool.take(len).map_err(|e| e.to_string())
                    } else {
                        Err(String::new())
                    }
                })
                .map_err(|e| fail(e.to_string()))?;
            match taken {
                None => return Err(fail("not in the ring".into())),
                Some(Ok(buf)) => {
                    self.next += 1;
                    return Ok(buf);
                }
                Some(Err(reason)) if self.next == span.offset => {
                    return Err(fail(if reason.is_empty() {
                        "its record is of another length".into()
                    } else {
                        reason
                    }));
                }
                // A record placed for a message never sent: dropped.
                Some(Err(_)) => {
                    let mut dropped = Vec::new();
                    self.ring.pop(&mut dropped).map_err(|e| fail(e.to_string()))?;
                    self.next += 1;
                }
            }
        }
    }
}
