//! The bytes of a model's block archives as a registration brings them: announced by
//! `RegisterBegin` (the fingerprint and each block's length), then appended chunk by chunk,
//! kept as received (never copied together), and checked against the fingerprint once whole.

use std::io::Read;

use super::codec::Payload;
use crate::Fingerprint;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArchiveError {
    #[error("a model needs at least one block")]
    NoBlocks,
    #[error("the block lengths add up to more than 2^64 bytes")]
    TooLong,
    #[error("chunk at offset {offset}, expected {expected}")]
    OutOfOrder { offset: u64, expected: u64 },
    #[error("chunk ends at {end} past the model's {total} bytes")]
    PastTheEnd { end: u64, total: u64 },
    #[error("{received} of {total} bytes uploaded")]
    Incomplete { received: u64, total: u64 },
    #[error("the archives hash to {computed}, not to the announced fingerprint {announced}")]
    Fingerprint { computed: Fingerprint, announced: Fingerprint },
}

#[derive(Debug)]
pub struct Archives {
    fingerprint: Fingerprint,
    block_lens: Vec<u64>,
    total: u64,
    received: u64,
    chunks: Vec<Payload>,
}

impl Archives {
    pub fn new(fingerprint: Fingerprint, block_lens: Vec<u64>) -> Result<Self, ArchiveError> {
        if block_lens.is_empty() {
            return Err(ArchiveError::NoBlocks);
        }
        let total = block_lens.iter().try_fold(0u64, |a, &b| a.checked_add(b)).ok_or(ArchiveError::TooLong)?;
        Ok(Self { fingerprint, block_lens, total, received: 0, chunks: Vec::new() })
    }

    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    pub fn block_lens(&self) -> &[u64] {
        &self.block_lens
    }

    /// Bytes announced.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Appends the chunk that starts at `offset`; chunks come in order, and none goes past the
    /// announced length.
    pub fn add(&mut self, offset: u64, chunk: Payload) -> Result<(), ArchiveError> {
        let len = chunk.buf.len() as u64;
        if offset != self.received {
            return Err(ArchiveError::OutOfOrder { offset, expected: self.received });
        }
        let end = self.received.checked_add(len).filter(|&end| end <= self.total);
        let Some(end) = end else {
            return Err(ArchiveError::PastTheEnd { end: self.received.saturating_add(len), total: self.total });
        };
        self.received = end;
        self.chunks.push(chunk);
        Ok(())
    }

    /// The chunks as they arrived, in order (to pass the archives on to another process).
    pub fn into_chunks(self) -> Vec<Payload> {
        self.chunks
    }

    /// Checks that every byte arrived and that they hash to the announced fingerprint.
    pub fn verify(&self) -> Result<(), ArchiveError> {
        if self.received != self.total {
            return Err(ArchiveError::Incomplete { received: self.received, total: self.total });
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update(&(self.block_lens.len() as u64).to_le_bytes());
        for (reader, len) in self.blocks().into_iter().zip(&self.block_lens) {
            hasher.update(&len.to_le_bytes());
            for slice in reader.slices() {
                hasher.update(slice);
            }
        }
        let computed = Fingerprint(*hasher.finalize().as_bytes());
        if computed != self.fingerprint {
            return Err(ArchiveError::Fingerprint { computed, announced: self.fingerprint });
        }
        Ok(())
    }

    /// A reader of each block's archive, across the chunks it spans.
    pub fn blocks(&self) -> Vec<BlockReader<'_>> {
        let mut start = 0;
        self.block_lens
            .iter()
            .map(|&len| {
                let reader = BlockReader::new(&self.chunks, start, len);
                start += len;
                reader
            })
            .collect()
    }
}

/// Reads bytes `start..start + len` of a list of chunks.
#[derive(Debug)]
pub struct BlockReader<'a> {
    chunks: &'a [Payload],
    chunk: usize,
    offset: usize,
    left: u64,
}

impl<'a> BlockReader<'a> {
    fn new(chunks: &'a [Payload], start: u64, len: u64) -> Self {
        let mut chunk = 0;
        let mut start = start;
        while chunk < chunks.len() && start >= chunks[chunk].buf.len() as u64 {
            start -= chunks[chunk].buf.len() as u64;
            chunk += 1;
        }
        Self { chunks, chunk, offset: start as usize, left: len }
    }

    /// The block's bytes as slices of the chunks, in order.
    pub fn slices(self) -> impl Iterator<Item = &'a [u8]> {
        let mut reader = self;
        std::iter::from_fn(move || {
            while reader.left > 0 && reader.chunk < reader.chunks.len() {
                let bytes = &reader.chunks[reader.chunk].buf.as_slice()[reader.offset..];
                let n = bytes.len().min(reader.left as usize);
                reader.chunk += 1;
                reader.offset = 0;
                reader.left -= n as u64;
                if n > 0 {
                    return Some(&bytes[..n]);
                }
            }
            None
        })
    }
}

impl Read for BlockReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.left > 0 && self.chunk < self.chunks.len() {
            let bytes = &self.chunks[self.chunk].buf.as_slice()[self.offset..];
            if bytes.is_empty() {
                self.chunk += 1;
                self.offset = 0;
                continue;
            }
            let n = bytes.len().min(out.len()).min(self.left as usize);
            out[..n].copy_from_slice(&bytes[..n]);
            self.offset += n;
            self.left -= n as u64;
            return Ok(n);
        }
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use djinn_memory::HostBuf;

    fn chunk(bytes: &[u8]) -> Payload {
        Payload { buf: HostBuf::copy_from(bytes).unwrap(), reservation: None }
    }

    #[test]
    fn chunks_are_read_back_across_their_boundaries() {
        let blocks: [&[u8]; 2] = [b"abc", b"defg"];
        let mut archives = Archives::new(Fingerprint::of_blocks(&blocks), vec![3, 4]).unwrap();
        archives.add(0, chunk(b"ab")).unwrap();
        archives.add(2, chunk(b"cdef")).unwrap();
        assert_eq!(archives.add(5, chunk(b"g")), Err(ArchiveError::OutOfOrder { offset: 5, expected: 6 }));
        assert_eq!(archives.verify(), Err(ArchiveError::Incomplete { received: 6, total: 7 }));
        assert!(matches!(archives.add(6, chunk(b"gh")), Err(ArchiveError::PastTheEnd { end: 8, total: 7 })));
        archives.add(6, chunk(b"g")).unwrap();
        let read: Vec<Vec<u8>> = archives
            .blocks()
            .into_iter()
            .map(|mut r| {
                let mut v = Vec::new();
                r.read_to_end(&mut v).unwrap();
                v
            })
            .collect();
        assert_eq!(read, vec![b"abc".to_vec(), b"defg".to_vec()]);
        archives.verify().unwrap();
    }

    #[test]
    fn another_split_of_the_same_bytes_is_another_model() {
        let mut archives = Archives::new(Fingerprint::of_blocks(&[b"abcdefg"]), vec![3, 4]).unwrap();
        archives.add(0, chunk(b"abcdefg")).unwrap();
        assert!(matches!(archives.verify(), Err(ArchiveError::Fingerprint { .. })));
        assert_eq!(Archives::new(Fingerprint([0; 32]), vec![]).unwrap_err(), ArchiveError::NoBlocks);
        assert_eq!(Archives::new(Fingerprint([0; 32]), vec![u64::MAX, 1]).unwrap_err(), ArchiveError::TooLong);
    }
}
