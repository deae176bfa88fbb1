//! A memfd mapped shared, read and write.

use std::ffi::c_void;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, fstat, ftruncate, memfd_create};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

use crate::ShmError;

/// A memfd and its shared mapping in this process. What lives in it is shared with every
/// process that maps the same descriptor; the mapping lasts as long as the region (rings hold
/// it by `Arc`, so it cannot go away under them).
#[derive(Debug)]
pub struct Region {
    fd: OwnedFd,
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, valid until `drop`; what is placed in it is
// reached through atomics or copied out, never through references held across threads.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// A new region of `len` bytes (zeroed), named `name` in /proc (for whoever looks).
    pub fn create(name: &str, len: usize) -> Result<Self, ShmError> {
        if len < 4096 || len > isize::MAX as usize {
            return Err(ShmError::BadSize(len as u64));
        }
        let fd = memfd_create(name, MemfdFlags::CLOEXEC).map_err(ShmError::os("create a memfd"))?;
        ftruncate(&fd, len as u64).map_err(ShmError::os("size the memfd"))?;
        Self::map(fd, len)
    }

    /// The region whose memfd another process passed (its size as the memfd's).
    pub fn open(fd: OwnedFd) -> Result<Self, ShmError> {
        let size = fstat(&fd).map_err(ShmError::os("read the memfd's size"))?.st_size;
        let len = usize::try_from(size).map_err(|_| ShmError::BadSize(size as u64))?;
        if len < 4096 || len > isize::MAX as usize {
            return Err(ShmError::BadSize(len as u64));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self, ShmError> {
        let prot = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: a new mapping at an address the kernel picks, of a descriptor we own.
        let base = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, &fd, 0) }
            .map_err(ShmError::os("map the memfd"))?;
        let base = NonNull::new(base.cast::<u8>()).ok_or(ShmError::BadSize(len as u64))?;
        Ok(Self { fd, base, len })
    }

    /// The memfd, to pass to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `bytes` into the region at `offset`: false, and nothing written, when they do not
    /// fit. For what both sides read once (a layout), not for what they share as it changes.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> bool {
        if offset.checked_add(bytes.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: within the mapping (checked above); the region's memory is plain bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.at(offset), bytes.len()) };
        true
    }

    /// Copies bytes of the region from `offset` into `out`: false when they lie past its end.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        if offset.checked_add(out.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: within the mapping (checked above); copied out, never referenced.
        unsafe { std::ptr::copy_nonoverlapping(self.at(offset), out.as_mut_ptr(), out.len()) };
        true
    }

    /// The address `offset` bytes in; the caller keeps within `len`.
    pub(crate) fn at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len);
        // SAFETY: within the mapping (the caller checks the offset against `len`).
        unsafe { self.base.as_ptr().add(offset) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; nothing outlives the region.
        if let Err(e) = unsafe { munmap(self.base.as_ptr().cast::<c_void>(), self.len) } {
            // Nothing to do but say so: the address range stays taken.
            tracing::warn!(error = %e, "munmap of a shared region failed");
        }
    }
}
