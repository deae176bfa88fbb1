//! A registration's archives as a node assembles them: an announcement (block lengths and a
//! fingerprint) and chunks at arbitrary offsets, checked against a plain model of the same
//! rules:
//! - the announcement is refused exactly when it has no block or its lengths overflow 64 bits;
//! - a chunk is taken exactly when it starts where the bytes so far end and does not go past the
//!   announced length; a refused chunk changes nothing;
//! - `verify` passes exactly when every byte arrived and they hash to the announced fingerprint;
//! - each block's reader gives back exactly that block's bytes, whatever the chunks' boundaries
//!   and the reads' sizes.
//!
//! Input layout: byte 0 = number of blocks (low 3 bits) and flags (bit 3: the fingerprint of the
//! bytes that will be sent, else 32 bytes from the input; bit 4: each block length is a u64, else
//! a u8); the block lengths; the fingerprint if taken from the input; then chunks, each an offset
//! byte (0: where the bytes end; 1: a u64 follows; else the byte itself), a length byte, and that
//! many bytes; a read-size byte for the readers closes the input.

use std::io::Read;

use djinn_memory::HostBuf;
use djinn_proto::{ArchiveError, Archives, Fingerprint, Payload};

struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        (self.0.len() >= n).then(|| {
            let (head, rest) = self.0.split_at(n);
            self.0 = rest;
            head
        })
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
}

pub fn run(data: &[u8]) {
    let mut input = Input(data);
    let Some(head) = input.byte() else { return };
    let count = usize::from(head & 7);
    let mut lens = Vec::with_capacity(count);
    for _ in 0..count {
        let len = if head & 0x10 != 0 { input.u64() } else { input.byte().map(u64::from) };
        let Some(len) = len else { return };
        lens.push(len);
    }
    let announced = if head & 0x08 != 0 {
        None
    } else {
        match input.take(32) {
            Some(b) => Some(Fingerprint(b.try_into().unwrap())),
            None => return,
        }
    };
    let total = lens.iter().try_fold(0u64, |a, &b| a.checked_add(b));

    // The chunks, and the bytes the model expects to have been taken.
    let mut chunks = Vec::new();
    while input.0.len() > 2 {
        let offset = match input.byte() {
            Some(0) => None,
            Some(1) => input.u64(),
            b => b.map(u64::from),
        };
        let Some(len) = input.byte() else { break };
        let Some(bytes) = input.take(len.into()) else { break };
        chunks.push((offset, bytes));
    }
    let read_size = usize::from(input.byte().unwrap_or(0)) + 1;

    // The fingerprint of what would be sent if every chunk were taken in order (an announced
    // fingerprint of the right bytes exercises the passing path).
    let sent: Vec<u8> = chunks.iter().flat_map(|(_, b)| b.iter().copied()).collect();
    let fingerprint = announced.unwrap_or_else(|| {
        let mut start = 0usize;
        let blocks: Vec<&[u8]> = lens
            .iter()
            .map(|&len| {
                let end = start.saturating_add(usize::try_from(len).unwrap_or(usize::MAX)).min(sent.len());
                let block = &sent[start.min(end)..end];
                start = end;
                block
            })
            .collect();
        Fingerprint::of_blocks(&blocks)
    });

    let mut archives = match Archives::new(fingerprint, lens.clone()) {
        Ok(a) => {
            assert!(count > 0 && total.is_some());
            a
        }
        Err(e) => {
            let expected = if count == 0 { ArchiveError::NoBlocks } else { ArchiveError::TooLong };
            assert!(count == 0 || total.is_none());
            assert_eq!(e, expected);
            return;
        }
    };
    let total = total.unwrap();
    assert_eq!(archives.total(), total);

    let mut received: Vec<u8> = Vec::new();
    for (offset, bytes) in chunks {
        let offset = offset.unwrap_or(received.len() as u64);
        let fits = received.len() as u64 + bytes.len() as u64 <= total;
        let payload = match HostBuf::copy_from(bytes) {
            Ok(buf) => Payload { buf, reservation: None },
            Err(_) => return,
        };
        let result = archives.add(offset, payload);
        assert_eq!(result.is_ok(), offset == received.len() as u64 && fits, "{result:?}");
        if result.is_ok() {
            received.extend_from_slice(bytes);
        }
        assert_eq!(archives.received(), received.len() as u64);
    }

    let complete = received.len() as u64 == total;
    let blocks: Vec<&[u8]> = {
        let mut start = 0usize;
        lens.iter()
            .map(|&len| {
                let end = (start as u64).saturating_add(len).min(received.len() as u64) as usize;
                let block = &received[start..end];
                start = end;
                block
            })
            .collect()
    };
    let verified = archives.verify();
    assert_eq!(verified.is_ok(), complete && Fingerprint::of_blocks(&blocks) == fingerprint, "{verified:?}");

    // Every block reads back as it was sent (as much of it as arrived).
    for (reader, expected) in archives.blocks().into_iter().zip(&blocks) {
        let mut reader = reader;
        let mut got = Vec::new();
        let mut buf = vec![0u8; read_size];
        loop {
            let n = reader.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(&got, expected);
    }
    for (reader, expected) in archives.blocks().into_iter().zip(&blocks) {
        assert_eq!(&reader.slices().flatten().copied().collect::<Vec<u8>>(), expected);
    }
}
