//! Host memory the data plane receives into and the executor computes from.
//!
//! Touching fresh pages costs about five times a copy into pages already touched (see
//! `shared/notes/machine.md`), so large buffers are recycled through a [`BufferPool`] instead of
//! going back to the kernel after every request.

use std::alloc::{self, Layout};
use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use djinn_sync::Locked;

/// Alignment of every buffer of at least this many bytes: enough for any dtype and for
/// vectorised kernels. A smaller buffer is aligned to the largest power of two it holds, up to
/// 16 (what the allocator gives such a block without the cost of an aligned allocation), which
/// is a multiple of the element size of any dtype it can hold ([`align_for`]).
pub const BUFFER_ALIGN: usize = 64;

/// The alignment of a buffer of `len` bytes.
pub fn align_for(len: usize) -> usize {
    if len >= BUFFER_ALIGN { BUFFER_ALIGN } else { (1 << len.max(1).ilog2()).min(16) }
}

/// From this size on, buffers come straight from `mmap` (page aligned, zeroed by the kernel).
const MMAP_THRESHOLD: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
#[error("cannot allocate {bytes} bytes of host memory: {reason}")]
pub struct AllocError {
    pub bytes: usize,
    pub reason: String,
}

/// Memory obtained from the allocator or from `mmap`, without a logical length.
struct RawBuf {
    ptr: NonNull<u8>,
    cap: usize,
    /// What describes this memory itself (its registration with an RDMA device): kept as long
    /// as the memory, through trips back to a pool, and dropped before it is freed. Boxed
    /// twice so that every buffer, attached or not, grows by one pointer only.
    attachment: Option<Box<Attachment>>,
}

struct Attachment(Box<dyn Any + Send + Sync>);

impl RawBuf {
    fn allocate(cap: usize) -> Result<Self, AllocError> {
        if cap == 0 {
            // A dangling, aligned pointer: never dereferenced for a zero-length slice.
            let ptr = NonNull::new(BUFFER_ALIGN as *mut u8).expect("non-zero");
            return Ok(Self { ptr, cap: 0, attachment: None });
        }
        if cap >= MMAP_THRESHOLD {
            let cap = cap.next_multiple_of(page_size());
            // SAFETY: anonymous private mapping with no address hint; the result is checked.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    cap,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(AllocError { bytes: cap, reason: std::io::Error::last_os_error().to_string() });
            }
            let ptr = NonNull::new(ptr.cast::<u8>())
                .ok_or_else(|| AllocError { bytes: cap, reason: "mmap returned null".into() })?;
            return Ok(Self { ptr, cap, attachment: None });
        }
        let layout = Self::small_layout(cap)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr =
            NonNull::new(ptr).ok_or_else(|| AllocError { bytes: cap, reason: "allocator returned null".into() })?;
        Ok(Self { ptr, cap, attachment: None })
    }

    fn small_layout(cap: usize) -> Result<Layout, AllocError> {
        Layout::from_size_align(cap, align_for(cap)).map_err(|e| AllocError { bytes: cap, reason: e.to_string() })
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // Before the memory goes: a registration must not outlive what it registers.
        drop(self.attachment.take());
        if self.cap == 0 {
            return;
        }
        if self.cap >= MMAP_THRESHOLD {
            // SAFETY: this mapping was created by `allocate` with exactly this length.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
        } else if let Ok(layout) = Self::small_layout(self.cap) {
            // SAFETY: allocated by `alloc_zeroed` with this same layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

// SAFETY: a RawBuf is the unique owner of its memory.
unsafe impl Send for RawBuf {}
// SAFETY: shared access only ever reads.
unsafe impl Sync for RawBuf {}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|s| s.is_power_of_two()).unwrap_or(4096)
}

/// An owned, aligned ([`align_for`]), initialised host buffer of a fixed length. When it came from a
/// pool, dropping it hands the memory back to that pool.
pub struct HostBuf {
    raw: Option<RawBuf>,
    len: usize,
    pool: Option<Arc<PoolShared>>,
}

impl HostBuf {
    /// A buffer of no bytes; allocates nothing.
    pub fn empty() -> Self {
        Self { raw: None, len: 0, pool: None }
    }

    /// A fresh zeroed buffer, not pooled.
    pub fn zeroed(len: usize) -> Result<Self, AllocError> {
        Ok(Self { raw: Some(RawBuf::allocate(len)?), len, pool: None })
    }

    /// A buffer holding a copy of `bytes`.
    pub fn copy_from(bytes: &[u8]) -> Result<Self, AllocError> {
        let mut buf = Self::zeroed(bytes.len())?;
        buf.as_mut_slice().copy_from_slice(bytes);
        Ok(buf)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of memory behind the buffer (at least `len`).
    pub fn capacity(&self) -> usize {
        self.raw.as_ref().map_or(0, |r| r.cap)
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.raw.as_ref().map_or(NonNull::dangling().as_ptr(), |r| r.ptr.as_ptr())
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.raw {
            // SAFETY: `len <= cap` bytes, initialised at allocation, owned by `self`.
            Some(raw) => unsafe { std::slice::from_raw_parts(raw.ptr.as_ptr(), self.len) },
            None => &[],
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.raw {
            // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
            Some(raw) => unsafe { std::slice::from_raw_parts_mut(raw.ptr.as_ptr(), self.len) },
            None => &mut [],
        }
    }

    /// What [`Self::attach`] kept with this buffer's memory, if it is a `T`.
    pub fn attachment<T: Any>(&self) -> Option<&T> {
        self.raw.as_ref()?.attachment.as_ref()?.0.downcast_ref()
    }

    /// Keeps `value` with this buffer's memory (all [`Self::capacity`] bytes of it) for as long
    /// as the memory lives, also while it waits in a pool for its next use, and drops it
    /// before the memory is freed; it replaces what was attached before. For what describes
    /// the memory itself, such as its registration with an RDMA device. A buffer of no
    /// memory keeps nothing.
    pub fn attach<T: Any + Send + Sync>(&mut self, value: T) {
        if let Some(raw) = &mut self.raw {
            raw.attachment = Some(Box::new(Attachment(Box::new(value))));
        }
    }
}

impl AsRef<[u8]> for HostBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsMut<[u8]> for HostBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("pooled", &self.pool.is_some())
            .finish()
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if let (Some(pool), Some(raw)) = (self.pool.take(), self.raw.take()) {
            pool.give_back(raw);
        }
    }
}

/// Counters of a [`BufferPool`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held by free buffers waiting for reuse.
    pub retained_bytes: u64,
    /// Takes served by a recycled buffer.
    pub hits: u64,
    /// Takes that allocated fresh memory.
    pub misses: u64,
}

/// Recycles large host buffers. A take is served by the smallest free buffer whose capacity is
/// at least the length asked for and at most twice it; the pool keeps at most `max_retained`
/// bytes of free buffers and returns the rest to the system.
#[derive(Clone)]
pub struct BufferPool {
    shared: Arc<PoolShared>,
}

struct PoolShared {
    free: Mutex<BTreeMap<usize, Vec<RawBuf>>>,
    retained: AtomicU64,
    max_retained: u64,
    min_pooled: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl BufferPool {
    /// Buffers smaller than `min_pooled` bytes are left to the allocator, which is fast for them.
    pub fn new(max_retained: u64, min_pooled: usize) -> Self {
        Self {
            shared: Arc::new(PoolShared {
                free: Mutex::new(BTreeMap::new()),
                retained: AtomicU64::new(0),
                max_retained,
                min_pooled,
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
            }),
        }
    }

    /// A buffer of exactly `len` bytes whose contents are unspecified (zeroes or old data).
    pub fn take(&self, len: usize) -> Result<HostBuf, AllocError> {
        let shared = &self.shared;
        if len < shared.min_pooled {
            return HostBuf::zeroed(len);
        }
        let recycled = {
            let mut free = shared.free.locked();
            let cap = free.range(len..=len.saturating_mul(2)).next().map(|(cap, _)| *cap);
            cap.and_then(|cap| {
                let list = free.get_mut(&cap)?;
                let raw = list.pop();
                if list.is_empty() {
                    free.remove(&cap);
                }
                raw
            })
        };
        let raw = match recycled {
            Some(raw) => {
                shared.retained.fetch_sub(raw.cap as u64, Ordering::Relaxed);
                shared.hits.fetch_add(1, Ordering::Relaxed);
                raw
            }
            None => {
                shared.misses.fetch_add(1, Ordering::Relaxed);
                RawBuf::allocate(len)?
            }
        };
        Ok(HostBuf { raw: Some(raw), len, pool: Some(Arc::clone(shared)) })
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            retained_bytes: self.shared.retained.load(Ordering::Relaxed),
            hits: self.shared.hits.load(Ordering::Relaxed),
            misses: self.shared.misses.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferPool")
            .field("max_retained", &self.shared.max_retained)
            .field("stats", &self.stats())
            .finish()
    }
}

impl PoolShared {
    fn give_back(&self, raw: RawBuf) {
        let cap = raw.cap as u64;
        if raw.cap < self.min_pooled {
            return;
        }
        let admitted = self
            .retained
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| (r + cap <= self.max_retained).then_some(r + cap))
            .is_ok();
        if admitted {
            let mut free = self.free.locked();
            free.entry(raw.cap).or_default().push(raw);
        }
        // else: `raw` drops here and its memory goes back to the system.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_zeroed() {
        for len in [0, 1, 2, 12, 16, 63, 64, 4096, MMAP_THRESHOLD - 1, MMAP_THRESHOLD + 1] {
            let buf = HostBuf::zeroed(len).unwrap();
            assert_eq!(buf.len(), len);
            assert_eq!(buf.as_ptr() as usize % align_for(len), 0, "len {len}");
            assert!(buf.as_slice().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn pool_reuses_freed_buffers_within_twice_the_length() {
        let pool = BufferPool::new(64 << 20, 4096);
        let mut a = pool.take(3 << 20).unwrap();
        a.as_mut_slice()[0] = 7;
        let ptr = a.as_ptr();
        drop(a);
        assert_eq!(pool.stats().retained_bytes, 3 << 20);
        // Too small a request for this buffer (it would waste more than half).
        let small = pool.take(1 << 20).unwrap();
        assert_ne!(small.as_ptr(), ptr);
        let b = pool.take(2 << 20).unwrap();
        assert_eq!(b.as_ptr(), ptr);
        assert_eq!(b.len(), 2 << 20);
        assert_eq!(pool.stats().hits, 1);
        assert_eq!(pool.stats().retained_bytes, 0);
    }

    #[test]
    fn pool_retains_at_most_its_limit() {
        let pool = BufferPool::new(4 << 20, 4096);
        let bufs: Vec<_> = (0..4).map(|_| pool.take(2 << 20).unwrap()).collect();
        drop(bufs);
        assert_eq!(pool.stats().retained_bytes, 4 << 20);
    }

    /// Drops before the memory it was attached to is freed, and says so.
    struct Flag(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn an_attachment_stays_with_the_memory_through_the_pool_and_goes_with_it() {
        let pool = BufferPool::new(4 << 20, 4096);
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut a = pool.take(2 << 20).unwrap();
        a.attach(Flag(Arc::clone(&dropped)));
        let ptr = a.as_ptr();
        drop(a);
        let mut b = pool.take(2 << 20).unwrap();
        assert_eq!(b.as_ptr(), ptr);
        assert!(b.attachment::<Flag>().is_some(), "recycled with its memory");
        assert!(b.attachment::<u32>().is_none(), "only as the type it is");
        assert!(pool.take(2 << 20).unwrap().attachment::<Flag>().is_none(), "fresh memory has none");
        // Replaced: the old one goes at once.
        b.attach(7u32);
        assert!(dropped.load(Ordering::SeqCst));
        assert_eq!(b.attachment::<u32>(), Some(&7));

        // Memory the pool does not keep goes with its attachment.
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut c = HostBuf::zeroed(100).unwrap();
        c.attach(Flag(Arc::clone(&dropped)));
        drop(c);
        assert!(dropped.load(Ordering::SeqCst));
        let mut empty = HostBuf::empty();
        empty.attach(1u8);
        assert!(empty.attachment::<u8>().is_none());
    }

    #[test]
    fn small_buffers_bypass_the_pool() {
        let pool = BufferPool::new(1 << 20, 4096);
        drop(pool.take(100).unwrap());
        assert_eq!(pool.stats(), PoolStats::default());
    }
}
