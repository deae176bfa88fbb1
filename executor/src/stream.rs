//! Models larger than their share of device memory: the residency plan (which blocks stay on
//! the device, which stream) and the streaming itself, through a skip-end ring
//! ([`djinn_memory::SkipEndRing`]) over one fixed region.
//!
//! A streamed block's parameters are copied once, at registration, into one host buffer laid
//! out exactly as the block's slot will be (each tensor aligned to [`SLOT_ALIGN`]), so that
//! bringing the block in is one copy. The module's own parameter tensors are then emptied; just
//! before the block runs they are re-pointed (`set_data`) at views into the block's slot. While
//! a block computes, a copy thread brings the next blocks into the ring as far as the ring has
//! room; a slot is released only once the block that reads it has run.
//!
//! The region is a tensor of bytes from libtorch's allocator on the model's device. On a CUDA
//! node the host copies are pinned and a copy stream brings blocks in: the host waits for a
//! block's copy (its event) before queuing the block's compute, and each copy into a slot waits,
//! on the device, for an event recorded on torch's stream after the compute that last read the
//! slot. On a CPU node a copy thread stands in for the copy stream, and compute is synchronous.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use djinn_gpudirect::{CopyStream, CudaContext, Event, PinnedBuf};
use djinn_memory::{HostBuf, SLOT_ALIGN, SkipEndRing, Slot};
use tch::{Device, Kind, Tensor};

use crate::error::ExecError;
use crate::tensors::tensor_bytes;
use crate::value::ModelValue;
use djinn_sync::Locked;

/// Which blocks stream, and the ring they stream through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub streamed: Vec<bool>,
    /// Bytes of the ring (0 when nothing streams).
    pub ring: u64,
}

impl Plan {
    /// Device bytes the plan holds: resident blocks and the ring.
    pub fn device_bytes(&self, slot_lens: &[u64]) -> u64 {
        let resident: u64 = slot_lens.iter().zip(&self.streamed).filter(|(_, s)| !**s).map(|(l, _)| l).sum();
        resident + self.ring
    }
}

/// Plans a model whose blocks take `slot_lens` bytes each (as laid out in a slot) into
/// `available` device bytes. Everything is resident when it fits. Otherwise the ring holds two
/// of the largest streamed blocks (one computing while the next arrives) when the budget has
/// room for two of the model's largest block, else one; and the largest blocks that fit beside
/// that ring stay resident, which streams the fewest bytes per forward.
pub fn plan(slot_lens: &[u64], available: u64) -> Result<Plan, ExecError> {
    let lens: Vec<u64> = slot_lens.iter().map(|l| l.next_multiple_of(SLOT_ALIGN)).collect();
    if lens.iter().sum::<u64>() <= available {
        return Ok(Plan { streamed: vec![false; lens.len()], ring: 0 });
    }
    let (largest_block, largest) = lens.iter().copied().enumerate().max_by_key(|(_, l)| *l).unwrap_or_default();
    if largest > available {
        return Err(ExecError::BlockTooLarge { block: largest_block, len: largest, available });
    }
    let slots = if available >= 2 * largest { 2 } else { 1 };
    // A block without weights has nothing to stream.
    let mut streamed: Vec<bool> = lens.iter().map(|&l| l > 0).collect();
    let mut resident = 0;
    let mut by_size: Vec<usize> = (0..lens.len()).collect();
    by_size.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    for &i in by_size.iter().filter(|&&i| lens[i] > 0) {
        // Keep block i if the ring for the blocks still streamed fits beside it.
        let rest = (0..lens.len()).filter(|&j| j != i && streamed[j]).map(|j| lens[j]).max().unwrap_or(0);
        if resident + lens[i] + slots * rest <= available {
            streamed[i] = false;
            resident += lens[i];
        }
    }
    let largest_streamed = (0..lens.len()).filter(|&j| streamed[j]).map(|j| lens[j]).max().unwrap_or(0);
    let ring = if resident + 2 * largest_streamed <= available { 2 * largest_streamed } else { largest_streamed };
    Ok(Plan { streamed, ring })
}

/// A parameter of a streamed block, and where it sits in the block's slot.
struct Param {
    /// The module's own parameter (a handle on the same tensor): re-pointed before each run.
    tensor: Tensor,
    shape: Vec<i64>,
    kind: Kind,
    offset: u64,
}

/// Host memory holding a streamed block's weights: pinned on a CUDA node, so that its copies
/// run at the link's rate and asynchronously to the host.
enum HostWeights {
    Plain(HostBuf),
    Pinned(PinnedBuf),
}

impl HostWeights {
    fn zeroed(len: usize, cuda: Option<&Arc<CudaContext>>) -> Result<Self, ExecError> {
        Ok(match cuda {
            Some(context) => Self::Pinned(PinnedBuf::zeroed(context, len)?),
            None => Self::Plain(HostBuf::zeroed(len).map_err(|e| ExecError::Internal(e.to_string()))?),
        })
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Plain(b) => b.as_slice(),
            Self::Pinned(b) => b.as_slice(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Self::Plain(b) => b.as_mut_slice(),
            Self::Pinned(b) => b.as_mut_slice(),
        }
    }
}

/// A streamed block's weights, in host memory laid out as in its slot.
pub struct StreamedBlock {
    params: Vec<Param>,
    host: HostWeights,
}

impl StreamedBlock {
    /// Bytes `params` (a block's parameters) take in a slot, each aligned to [`SLOT_ALIGN`].
    pub fn slot_len(params: &[(String, Tensor)]) -> u64 {
        Self::layout(params).1
    }

    fn layout(params: &[(String, Tensor)]) -> (Vec<u64>, u64) {
        let mut end = 0u64;
        let offsets = params
            .iter()
            .map(|(_, t)| {
                let offset = end.next_multiple_of(SLOT_ALIGN);
                end = offset + tensor_bytes(t);
                offset
            })
            .collect();
        (offsets, end)
    }

    /// Moves a block's weights (`named`: handles on the tensors the block runs with) into host
    /// memory (pinned in `cuda`'s context, if given): the block keeps empty tensors (it cannot
    /// run unbound) until [`Streamer`] binds them to a slot.
    pub fn take(named: Vec<(String, Tensor)>, cuda: Option<&Arc<CudaContext>>) -> Result<Self, ExecError> {
        let (offsets, len) = Self::layout(&named);
        let mut host = HostWeights::zeroed(len as usize, cuda)?;
        let mut params = Vec::with_capacity(named.len());
        for ((_, mut tensor), offset) in named.into_iter().zip(offsets) {
            let contiguous = tensor.f_contiguous()?.f_to_device(Device::Cpu)?;
            let bytes = tensor_bytes(&contiguous) as usize;
            let dst = &mut host.as_mut_slice()[offset as usize..offset as usize + bytes];
            contiguous.f_copy_data_u8(dst, contiguous.numel())?;
            let (shape, kind) = (tensor.size(), tensor.kind());
            tensor.set_data(&Tensor::f_empty([0], (kind, tensor.device()))?);
            params.push(Param { tensor, shape, kind, offset });
        }
        Ok(Self { params, host })
    }

    fn len(&self) -> u64 {
        self.host.as_slice().len() as u64
    }
}

impl std::fmt::Debug for StreamedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedBlock").field("params", &self.params.len()).field("bytes", &self.len()).finish()
    }
}

/// Counters of one streamed model.
#[derive(Debug, Default)]
pub struct StreamStats {
    pub bytes_streamed: AtomicU64,
    /// Time blocks waited for their weights to arrive.
    pub stall_ns: AtomicU64,
    pub ring_bytes: AtomicU64,
    pub ring_peak_bytes: AtomicU64,
}

/// A copy in flight: block `block` into `slot`.
#[derive(Debug)]
struct InFlight {
    block: usize,
    slot: Slot,
    arrival: Arrival,
}

/// How to know a copy is done.
enum Arrival {
    /// The copy thread's count has reached `seq`.
    Copied { done: Arc<Done>, seq: u64 },
    /// This event on the copy stream has completed.
    Event(Event),
}

impl Arrival {
    /// Blocks until the copy has arrived.
    fn wait(&self) -> Result<(), ExecError> {
        match self {
            Self::Copied { done, seq } => {
                done.wait(*seq);
                Ok(())
            }
            Self::Event(event) => Ok(event.synchronize()?),
        }
    }
}

impl std::fmt::Debug for Arrival {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Copied { seq, .. } => write!(f, "Copied({seq})"),
            Self::Event(event) => event.fmt(f),
        }
    }
}

/// What brings blocks into the region: a thread on a CPU node, a copy stream on a CUDA node.
enum Mover {
    Thread(Copier),
    Cuda {
        context: Arc<CudaContext>,
        stream: CopyStream,
        /// Recorded on torch's stream after the compute that read the slots released last;
        /// the copy stream waits for it, so no copy overwrites a slot still being read. Kept
        /// alive until the next release replaces it.
        released: Option<Event>,
    },
}

impl Mover {
    fn new(device: Device) -> Result<Self, ExecError> {
        Ok(match device {
            Device::Cuda(ordinal) => {
                let context = CudaContext::primary(ordinal as i32)?;
                Self::Cuda { stream: CopyStream::new(&context)?, context, released: None }
            }
            _ => Self::Thread(Copier::start()?),
        })
    }

    /// Starts copying `len` bytes from `src` to `dst`.
    ///
    /// # Safety
    /// `src` (host memory, pinned for a CUDA mover) and `dst` (the region) must stay valid for
    /// `len` bytes until the copy has arrived, and nothing may read `dst` before then.
    unsafe fn copy(&mut self, src: *const u8, dst: *mut u8, len: usize) -> Result<Arrival, ExecError> {
        match self {
            Self::Thread(copier) => {
                copier.copy(src, dst, len).map(|seq| Arrival::Copied { done: Arc::clone(&copier.done), seq })
            }
            // SAFETY: the caller's contract.
            Self::Cuda { stream, .. } => Ok(Arrival::Event(unsafe { stream.copy_to_device(dst as u64, src, len) }?)),
        }
    }

    /// The compute queued so far has read its slots for the last time: later copies wait for
    /// it. (On a CPU node that compute has already finished.)
    fn released(&mut self) -> Result<(), ExecError> {
        if let Self::Cuda { context, stream, released } = self {
            let event = Event::on_torch_stream(context)?;
            stream.wait_for(&event)?;
            *released = Some(event);
        }
        Ok(())
    }
}

/// Runs the streamed blocks of one model through its ring, one forward at a time.
pub struct Streamer {
    // Declared first, so dropped first: its copies finish (the thread is joined, the stream
    // synchronised) before the memory they copy between (host weights, the region) goes.
    mover: Mover,
    blocks: Vec<Option<StreamedBlock>>,
    /// Streamed blocks in execution order.
    order: Vec<usize>,
    /// Position in `order` of the next block to bring in.
    next: usize,
    in_flight: VecDeque<InFlight>,
    ring: SkipEndRing,
    /// Bytes on the model's device (libtorch's allocator).
    region: Tensor,
    /// `region`'s first [`SLOT_ALIGN`]ed byte.
    base: *mut u8,
    device: Device,
    stats: Arc<StreamStats>,
}

// SAFETY: `base` points into `region`, which the streamer owns and moves with it; the tensors
// are handles that libtorch lets any one thread use at a time.
unsafe impl Send for Streamer {}

impl Streamer {
    /// `blocks[i]` is `Some` for each streamed block (taken with pinned memory of `device`'s
    /// context on CUDA); `ring` bytes of region on `device`.
    pub fn new(blocks: Vec<Option<StreamedBlock>>, ring: u64, device: Device) -> Result<Self, ExecError> {
        let ring = SkipEndRing::new(ring);
        for (i, b) in blocks.iter().enumerate() {
            if let Some(b) = b
                && b.len().next_multiple_of(SLOT_ALIGN) > ring.capacity()
            {
                return Err(ExecError::BlockTooLarge { block: i, len: b.len(), available: ring.capacity() });
            }
        }
        let region = Tensor::f_zeros([(ring.capacity() + SLOT_ALIGN) as i64], (Kind::Uint8, device))?;
        let start = region.data_ptr().cast::<u8>();
        let base = start.wrapping_add(start.align_offset(SLOT_ALIGN as usize));
        let stats = Arc::new(StreamStats::default());
        stats.ring_bytes.store(ring.capacity(), Ordering::Relaxed);
        let order = blocks.iter().enumerate().filter(|(_, b)| b.is_some()).map(|(i, _)| i).collect();
        let mut mover = Mover::new(device)?;
        // The region came from torch's allocator, ordered on torch's stream (its zeroing, and
        // whatever used that memory before): the first copies into it must follow that work.
        mover.released()?;
        Ok(Self { mover, blocks, order, next: 0, in_flight: VecDeque::new(), ring, region, base, device, stats })
    }

    pub fn stats(&self) -> Arc<StreamStats> {
        Arc::clone(&self.stats)
    }

    /// Blocks streamed.
    pub fn streamed(&self) -> usize {
        self.order.len()
    }

    /// Bytes of the streamed blocks' host copies.
    pub fn host_bytes(&self) -> u64 {
        self.blocks.iter().flatten().map(StreamedBlock::len).sum()
    }

    /// Before block `i` runs: its weights are in its slot and its parameters point there.
    pub fn before(&mut self, i: usize) -> Result<(), ExecError> {
        if self.blocks.get(i).is_none_or(Option::is_none) {
            return Ok(());
        }
        if self.in_flight.front().is_none_or(|f| f.block != i) {
            // The previous forward stopped part-way (a block failed): start over from `i`.
            self.restart_at(i)?;
        }
        let Some(InFlight { slot, arrival, .. }) = self.in_flight.front() else {
            return Err(ExecError::Internal(format!("block {i} was not brought in")));
        };
        let slot = *slot;
        let started = Instant::now();
        arrival.wait()?;
        self.stats.stall_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let base = self.base.wrapping_add(slot.offset as usize);
        let device = self.device;
        let Some(block) = self.blocks[i].as_mut() else { return Ok(()) };
        for p in &mut block.params {
            // SAFETY: the slot holds this block's bytes (the copy above is done) and stays
            // live, unwritten, until `after` releases it; the region outlives the module's use
            // of the view (the streamer is dropped with the model).
            let view =
                unsafe { Tensor::f_from_blob(base.wrapping_add(p.offset as usize), &p.shape, &[], p.kind, device) }?;
            p.tensor.set_data(&view);
        }
        // The next blocks come in while this one computes.
        self.bring_in()
    }

    /// After block `i` ran with output `out`: its slot is released (outputs that are views of
    /// its weights are copied out first) and the following blocks brought in.
    pub fn after(&mut self, i: usize, out: ModelValue) -> Result<ModelValue, ExecError> {
        if self.blocks.get(i).is_none_or(Option::is_none) {
            return Ok(out);
        }
        let Some(done) = self.in_flight.pop_front() else { return Ok(out) };
        let range = self.base as usize + done.slot.offset as usize..self.base as usize + done.slot.end() as usize;
        let out = detach_from(out, &range)?;
        self.ring.release_oldest();
        self.mover.released()?;
        self.bring_in()?;
        Ok(out)
    }

    /// Places and starts copying the next streamed blocks, in order, while the ring has room
    /// (each block at most once ahead: the ring may hold the next forward's first blocks).
    fn bring_in(&mut self) -> Result<(), ExecError> {
        while self.in_flight.len() < self.order.len() {
            let block = self.order[self.next];
            let Some(weights) = self.blocks[block].as_ref() else { break };
            let placed = self.ring.place(weights.len());
            let placed = placed.map_err(|e| ExecError::BlockTooLarge { block, len: e.len, available: e.capacity })?;
            let Some(slot) = placed else { break };
            let dst = self.base.wrapping_add(slot.offset as usize);
            let src = weights.host.as_slice();
            // SAFETY: the host weights live as long as the streamer, and the slot is the ring's
            // until `after` releases it, once the block that reads it has run.
            let arrival = unsafe { self.mover.copy(src.as_ptr(), dst, src.len()) }?;
            self.in_flight.push_back(InFlight { block, slot, arrival });
            self.stats.bytes_streamed.fetch_add(weights.len(), Ordering::Relaxed);
            self.stats.ring_peak_bytes.fetch_max(self.ring.peak(), Ordering::Relaxed);
            self.next = (self.next + 1) % self.order.len();
        }
        Ok(())
    }

    /// Drops what is in flight (after waiting for its copies) and brings blocks in from `i` on.
    fn restart_at(&mut self, i: usize) -> Result<(), ExecError> {
        if let Some(last) = self.in_flight.back() {
            last.arrival.wait()?;
        }
        self.in_flight.clear();
        while self.ring.release_oldest().is_some() {}
        self.mover.released()?;
        self.next = self.order.iter().position(|&b| b == i).unwrap_or(0);
        self.bring_in()
    }
}

impl std::fmt::Debug for Streamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamer")
            .field("streamed", &self.order.len())
            .field("ring", &self.ring.capacity())
            .field("region", &self.region.numel())
            .finish()
    }
}

/// Copies a tensor of `out` whose memory lies in `range` (a view of the block's weights) so
/// that it survives the slot being overwritten.
fn detach_from(out: ModelValue, range: &std::ops::Range<usize>) -> Result<ModelValue, ExecError> {
    out.map_tensors(&mut |t| {
        if t.numel() > 0 && range.contains(&(t.data_ptr() as usize)) {
            let mut copy = t.f_empty_like()?;
            copy.f_copy_(&t)?;
            Ok(copy)
        } else {
            Ok(t)
        }
    })
}

/// The copy thread: copies in the order asked, each numbered; `done.wait(n)` returns once
/// copy `n` is done.
struct Copier {
    jobs: Option<crossbeam_channel::Sender<Copy>>,
    done: Arc<Done>,
    thread: Option<JoinHandle<()>>,
    issued: u64,
}

struct Copy {
    src: *const u8,
    dst: *mut u8,
    len: usize,
}

// SAFETY: the pointers are into memory the streamer owns and keeps alive until the copier is
// joined; the ring keeps the destination free of readers until the copy is waited for.
unsafe impl Send for Copy {}

#[derive(Default)]
struct Done {
    seq: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Copier {
    fn start() -> Result<Self, ExecError> {
        let (tx, rx) = crossbeam_channel::unbounded::<Copy>();
        let done = Arc::new(Done::default());
        let thread = {
            let done = Arc::clone(&done);
            std::thread::Builder::new()
                .name("djinn-stream-copy".into())
                .spawn(move || {
                    for job in rx {
                        // SAFETY: see `Copy`: both ranges are valid and nothing else touches
                        // the destination until this copy is waited for.
                        unsafe { std::ptr::copy_nonoverlapping(job.src, job.dst, job.len) };
                        done.seq.fetch_add(1, Ordering::Release);
                        let _held = done.lock.locked();
                        done.cv.notify_all();
                    }
                })
                .map_err(|e| ExecError::Internal(format!("cannot start the copy thread: {e}")))?
        };
        Ok(Self { jobs: Some(tx), done, thread: Some(thread), issued: 0 })
    }

    fn copy(&mut self, src: *const u8, dst: *mut u8, len: usize) -> Result<u64, ExecError> {
        let sent = self.jobs.as_ref().is_some_and(|jobs| jobs.send(Copy { src, dst, len }).is_ok());
        if !sent {
            // The thread stops only when the copier is dropped.
            return Err(ExecError::Internal("the stream's copy thread has stopped".into()));
        }
        self.issued += 1;
        Ok(self.issued)
    }
}

impl Done {
    /// Returns once copy `seq` is done.
    fn wait(&self, seq: u64) {
        if self.seq.load(Ordering::Acquire) >= seq {
            return;
        }
        let mut held = self.lock.locked();
        while self.seq.load(Ordering::Acquire) < seq {
            held = self.cv.wait(held).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn everything_resident_when_it_fits() {
        let p = plan(&[1000, 2000, 3000], 10_000).unwrap();
        assert_eq!(p, Plan { streamed: vec![false; 3], ring: 0 });
    }

    #[test]
    fn a_block_larger_than_the_budget_is_an_error() {
        assert!(matches!(plan(&[1024, 8192], 4096), Err(ExecError::BlockTooLarge { block: 1, .. })));
    }

    #[test]
    fn the_largest_blocks_stay_resident_and_the_ring_holds_two_streamed_ones() {
        // 8 KiB holds two of the 4 KiB block: the ring is double. The 4 KiB block and two 1 KiB
        // blocks stay; three 1 KiB blocks stream through a 2 KiB ring.
        let lens = [1024, 1024, 4096, 1024, 1024, 1024];
        let p = plan(&lens, 8192).unwrap();
        assert_eq!(p.ring, 2048);
        assert_eq!(p.streamed, vec![false, false, false, true, true, true]);
        assert_eq!(p.device_bytes(&lens), 8192);
    }

    #[test]
    fn without_room_for_two_slots_the_ring_holds_one() {
        let lens = [1024, 1024, 4096, 1024, 1024];
        let p = plan(&lens, 7168).unwrap();
        assert!(!p.streamed[2] && p.ring == 1024 && p.device_bytes(&lens) <= 7168, "{p:?}");
    }

    #[test]
    fn the_smallest_budget_streams_everything_through_one_slot() {
        let p = plan(&[4096, 4096, 4096], 4096).unwrap();
        assert_eq!(p, Plan { streamed: vec![true; 3], ring: 4096 });
    }
}
