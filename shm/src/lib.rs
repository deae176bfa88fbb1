//! Memory shared between a node and its executor processes, with no libtorch and no sockets in
//! it: a [`Region`] (a memfd mapped in each process that holds its descriptor) and, in a region,
//! single-producer single-consumer rings of messages ([`Producer`], [`Consumer`]).
//!
//! Each side treats the other as untrusted: what it reads of the shared header (the other
//! side's position, a message's length) is checked before it is used, so a process that writes
//! garbage there gets [`RingError::Corrupt`] from its peer, never a read outside the ring; and
//! a message is copied out of the ring before anyone decodes it, so its bytes cannot change
//! under the decoder.
//!
//! The other process is started by exec with the region's descriptor at a known number
//! ([`spawn_with_fds`], [`inherited`]).

mod child;
mod region;
mod ring;

pub use child::{inherited, spawn_with_fds};
pub use region::Region;
pub use ring::{Consumer, DEFAULT_SPIN, Producer, RING_HEADER, RingError, ring_len};

/// Why a region could not be made or mapped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    #[error("cannot {what}: {source}")]
    Os { what: &'static str, source: std::io::Error },
    #[error("a region of {0} bytes: a region is at least a page and fits the address space")]
    BadSize(u64),
    #[error("a ring at {offset}+{len} does not fit a region of {region} bytes, or is not 8-byte aligned")]
    BadRing { offset: usize, len: usize, region: usize },
}

impl ShmError {
    fn os(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> Self {
        move |e| Self::Os { what, source: e.into() }
    }
}
