//! Where streamed blocks go in the ring buffer: the placement rules alone, no memory and no
//! copies (the executor owns those), so that they can be tested for every sequence of sizes.
//!
//! One fixed region of `capacity` bytes. Blocks are placed in execution order, each as one
//! contiguous slot starting on a [`SLOT_ALIGN`] boundary, right after the previous one. A block
//! that does not fit between that point and the end of the region starts at offset 0 instead:
//! the end is skipped, a block is never split. A slot stays live until its block has run; a
//! placement that would overlap a live slot is refused until the oldest live slot is released
//! (blocks run, and so release, in the order they were placed).

use std::collections::VecDeque;

/// Alignment of every slot (and of every tensor inside one): what CUDA's own allocator gives.
pub const SLOT_ALIGN: u64 = 256;

/// A block's place in the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub offset: u64,
    pub len: u64,
}

impl Slot {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }

    fn overlaps(&self, other: &Slot) -> bool {
        self.offset < other.end() && other.offset < self.end()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a block of {len} bytes cannot be streamed through a ring of {capacity} bytes")]
pub struct BlockTooLarge {
    pub len: u64,
    pub capacity: u64,
}

#[derive(Debug)]
pub struct SkipEndRing {
    capacity: u64,
    /// Where the next slot starts if it fits before the end.
    head: u64,
    /// Oldest first.
    live: VecDeque<Slot>,
    peak: u64,
}

impl SkipEndRing {
    /// A ring over `capacity` bytes (rounded down to a multiple of [`SLOT_ALIGN`]).
    pub fn new(capacity: u64) -> Self {
        Self { capacity: capacity - capacity % SLOT_ALIGN, head: 0, live: VecDeque::new(), peak: 0 }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Places the next block, of `len` bytes. `Ok(None)`: its place still holds a live slot;
    /// release the oldest and ask again (an empty ring always has room for a block that fits).
    pub fn place(&mut self, len: u64) -> Result<Option<Slot>, BlockTooLarge> {
        let len = len.next_multiple_of(SLOT_ALIGN);
        if len > self.capacity {
            return Err(BlockTooLarge { len, capacity: self.capacity });
        }
        let offset = if self.head + len <= self.capacity { self.head } else { 0 };
        let slot = Slot { offset, len };
        if self.live.iter().any(|live| live.overlaps(&slot)) {
            return Ok(None);
        }
        self.live.push_back(slot);
        self.head = slot.end();
        self.peak = self.peak.max(self.used());
        Ok(Some(slot))
    }

    /// The block in the oldest live slot has run: its bytes may be overwritten.
    pub fn release_oldest(&mut self) -> Option<Slot> {
        let slot = self.live.pop_front();
        if self.live.is_empty() {
            // Nothing live: the next block may as well start at the beginning.
            self.head = 0;
        }
        slot
    }

    /// Live slots, oldest first.
    pub fn live(&self) -> impl Iterator<Item = &Slot> {
        self.live.iter()
    }

    /// Bytes in live slots.
    pub fn used(&self) -> u64 {
        self.live.iter().map(|s| s.len).sum()
    }

    /// The most bytes ever live at once.
    pub fn peak(&self) -> u64 {
        self.peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_block_that_does_not_fit_before_the_end_starts_at_zero() {
        let mut ring = SkipEndRing::new(1024);
        assert_eq!(ring.place(300).unwrap(), Some(Slot { offset: 0, len: 512 }));
        assert_eq!(ring.place(256).unwrap(), Some(Slot { offset: 512, len: 256 }));
        // 512 more bytes do not fit in the last 256: the end is skipped, and offset 0 is live.
        assert_eq!(ring.place(512).unwrap(), None);
        ring.release_oldest();
        assert_eq!(ring.place(512).unwrap(), Some(Slot { offset: 0, len: 512 }));
        assert_eq!(ring.place(2048), Err(BlockTooLarge { len: 2048, capacity: 1024 }));
    }

    proptest! {
        /// For any capacity and any sequence of block sizes, placed and released in order: live
        /// slots never overlap, lie inside the region whole, start aligned, and never hold more
        /// than the capacity; a refusal means a live slot is in the way; an oversized block is
        /// an error.
        #[test]
        fn live_slots_never_overlap_and_fit_the_region(
            capacity in 256u64..64 * 1024,
            ops in prop::collection::vec((any::<bool>(), 0u64..24 * 1024), 1..200),
        ) {
            let mut ring = SkipEndRing::new(capacity);
            let capacity = ring.capacity();
            for (place, len) in ops {
                if place {
                    let before: Vec<Slot> = ring.live().copied().collect();
                    match ring.place(len) {
                        Err(e) => prop_assert!(len.next_multiple_of(SLOT_ALIGN) > capacity, "{e}"),
                        Ok(None) => prop_assert!(!before.is_empty(), "an empty ring refused {len} bytes"),
                        Ok(Some(slot)) => {
                            prop_assert_eq!(slot.offset % SLOT_ALIGN, 0);
                            prop_assert!(slot.len >= len && slot.end() <= capacity);
                        }
                    }
                } else {
                    ring.release_oldest();
                }
                let live: Vec<Slot> = ring.live().copied().collect();
                for (i, a) in live.iter().enumerate() {
                    prop_assert!(a.end() <= capacity && a.offset % SLOT_ALIGN == 0);
                    for b in &live[i + 1..] {
                        prop_assert!(!a.overlaps(b), "{a:?} overlaps {b:?}");
                    }
                }
                prop_assert!(ring.used() <= capacity && ring.peak() <= capacity);
            }
        }
    }
}
