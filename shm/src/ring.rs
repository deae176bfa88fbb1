//! A single-producer single-consumer ring of messages in a shared region.
//!
//! Layout, at the ring's offset in its region: a header of three cache lines (the producer's
//! position; the consumer's position with the word a producer waiting for room sleeps on and
//! its flag; the word the consumer sleeps on and its flag), then the data.
//! Positions count bytes ever written or consumed; each side keeps its own position to itself
//! and only publishes it, so a peer that writes garbage into the header can make the other side
//! see a corrupt ring but never make it read or write outside it. A message is an 8-byte record
//! header (its length) and its bytes, padded to 8; a record never wraps: when the space left
//! before the end is too short the producer writes a skip record there and starts again at the
//! beginning.
//!
//! The consumer sleeps on a futex shared between the processes (not a private one) after a
//! short spin; the producer bumps the wake-up word after each message and calls into the kernel
//! only when the consumer said it sleeps. A producer that finds the ring full sleeps the same
//! way on the consumer's word, which the consumer bumps as it gives room back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::thread::futex;

use crate::{Region, ShmError};

/// Bytes of a ring's header, before its data.
pub const RING_HEADER: usize = 3 * LINE;

const LINE: usize = 64;
const TAIL: usize = 0;
const HEAD: usize = LINE;
const ROOM: usize = LINE + 8;
const ROOM_WAITING: usize = LINE + 12;
const WAKE: usize = 2 * LINE;
const WAITING: usize = 2 * LINE + 4;
/// A record's header: the message's length (u32), then 4 bytes unused.
const RECORD: usize = 8;
/// The length a skip record carries.
const SKIP: u32 = u32::MAX;
/// How long a consumer polls before it sleeps, unless told otherwise
/// ([`Consumer::set_spin`]): a message that comes in that window costs no wake-up.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The bytes a ring takes whose largest message is `max_message` bytes and which holds about
/// `messages` of them at once.
pub fn ring_len(max_message: usize, messages: usize) -> usize {
    RING_HEADER + messages.max(1) * (RECORD + pad(max_message))
}

fn pad(len: usize) -> usize {
    len.div_ceil(8) * 8
}

/// What went wrong with a ring.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    #[error("a message of {len} bytes; this ring holds at most {max}")]
    TooLarge { len: usize, max: usize },
    #[error("the ring is full: {free} bytes free, {need} needed")]
    Full { free: usize, need: usize },
    /// [`Consumer::pop_with`]'s caller gave a buffer of another length than the message's (the
    /// message stays in the ring).
    #[error("a buffer of {got} bytes for a message of {len}")]
    WrongBuffer { len: usize, got: usize },
    /// The peer wrote what no well-behaved peer writes: the ring is not to be used again.
    #[error("the ring's shared state is corrupt: {0}")]
    Corrupt(&'static str),
}

/// Where a ring lies in its region.
#[derive(Debug, Clone)]
struct Place {
    region: Arc<Region>,
    offset: usize,
    /// Data bytes (a multiple of 8).
    capacity: usize,
}

impl Place {
    fn new(region: Arc<Region>, offset: usize, len: usize) -> Result<Self, ShmError> {
        let bad = || ShmError::BadRing { offset, len, region: region.len() };
        let end = offset.checked_add(len).ok_or_else(bad)?;
        if !offset.is_multiple_of(LINE) || end > region.len() || len < RING_HEADER + 2 * RECORD {
            return Err(bad());
        }
        let capacity = (len - RING_HEADER) / 8 * 8;
        Ok(Self { region, offset, capacity })
    }

    fn u64_at(&self, at: usize) -> &AtomicU64 {
        // SAFETY: within the ring's header (checked in `new`), 8-byte aligned (the region is
        // page-aligned and `offset` a multiple of 64), and alive as long as `self.region`.
        unsafe { &*self.region.at(self.offset + at).cast::<AtomicU64>() }
    }

    fn u32_at(&self, at: usize) -> &AtomicU32 {
        // SAFETY: as in `u64_at`, 4-byte aligned.
        unsafe { &*self.region.at(self.offset + at).cast::<AtomicU32>() }
    }

    fn tail(&self) -> &AtomicU64 {
        self.u64_at(TAIL)
    }

    fn head(&self) -> &AtomicU64 {
        self.u64_at(HEAD)
    }

    fn wake(&self) -> &AtomicU32 {
        self.u32_at(WAKE)
    }

    fn waiting(&self) -> &AtomicU32 {
        self.u32_at(WAITING)
    }

    fn room(&self) -> &AtomicU32 {
        self.u32_at(ROOM)
    }

    fn room_waiting(&self) -> &AtomicU32 {
        self.u32_at(ROOM_WAITING)
    }

    /// The address of data byte `at` (at most `capacity`: the end, for a copy of nothing).
    fn data(&self, at: usize) -> *mut u8 {
        debug_assert!(at <= self.capacity);
        self.region.at(self.offset + RING_HEADER + at)
    }

    /// The largest message the ring takes.
    fn max_message(&self) -> usize {
        (self.capacity - RECORD).min(u32::MAX as usize - 1)
    }
}

/// Zeroes a ring's header at `offset` (`len` bytes in all) before either end attaches.
fn init(region: &Arc<Region>, offset: usize, len: usize) -> Result<Place, ShmError> {
    let place = Place::new(Arc::clone(region), offset, len)?;
    place.tail().store(0, Ordering::SeqCst);
    place.head().store(0, Ordering::SeqCst);
    place.wake().store(0, Ordering::SeqCst);
    place.waiting().store(0, Ordering::SeqCst);
    place.room().store(0, Ordering::SeqCst);
    place.room_waiting().store(0, Ordering::SeqCst);
    Ok(place)
}

/// The writing end of a ring.
#[derive(Debug)]
pub struct Producer {
    place: Place,
    /// Bytes ever written: this end's own count, published to the header.
    tail: u64,
    /// The consumer's position as the last push read it: room comes back when it moves on.
    seen_head: u64,
}

/// The reading end of a ring.
#[derive(Debug)]
pub struct Consumer {
    place: Place,
    /// Bytes ever consumed: this end's own count, published to the header.
    head: u64,
    spin: Duration,
}

impl Producer {
    /// Makes a new, empty ring of `len` bytes at `offset` in `region` and its producer (the
    /// consumer attaches with [`Consumer::attach`], in this process or another).
    pub fn create(region: &Arc<Region>, offset: usize, len: usize) -> Result<Self, ShmError> {
        Ok(Self { place: init(region, offset, len)?, tail: 0, seen_head: 0 })
    }

    /// The producer of a ring made with [`Consumer::create`], in this process or another.
    pub fn attach(region: &Arc<Region>, offset: usize, len: usize) -> Result<Self, ShmError> {
        let place = Place::new(Arc::clone(region), offset, len)?;
        let tail = place.tail().load(Ordering::SeqCst);
        let seen_head = place.head().load(Ordering::SeqCst);
        Ok(Self { place, tail, seen_head })
    }

    /// The largest message this ring takes.
    pub fn max_message(&self) -> usize {
        self.place.max_message()
    }

    /// Writes `message` at the end of the ring, and wakes the consumer if it sleeps.
    pub fn push(&mut self, message: &[u8]) -> Result<(), RingError> {
        let cap = self.place.capacity;
        if message.len() > self.max_message() {
            return Err(RingError::TooLarge { len: message.len(), max: self.max_message() });
        }
        let need = RECORD + pad(message.len());
        let head = self.place.head().load(Ordering::Acquire);
        self.seen_head = head;
        let used = self.tail.checked_sub(head).ok_or(RingError::Corrupt("the consumer is ahead of the producer"))?;
        let mut used =
            usize::try_from(used).ok().filter(|&u| u <= cap).ok_or(RingError::Corrupt("more used than held"))?;
        let pos = (self.tail % cap as u64) as usize;
        let to_end = cap - pos;
        if to_end < need {
            // A record never wraps: it goes at the beginning, past a skip record over the end,
            // written as soon as the skip fits (even when the message then does not, so that
            // the consumer, popping the skip, frees the room the message waits for).
            if used + to_end > cap {
                return Err(RingError::Full { free: cap - used, need: to_end + need });
            }
            self.write_len(pos, SKIP);
            self.tail += to_end as u64;
            used += to_end;
            self.publish();
        }
        if used + need > cap {
            return Err(RingError::Full { free: cap - used, need });
        }
        let pos = (self.tail % cap as u64) as usize;
        self.write_len(pos, message.len() as u32);
        // SAFETY: `need` bytes from `pos` lie within the data (no record wraps), in space the
        // consumer has given back (`used + need <= cap`), so it reads none of them until the
        // tail says so.
        unsafe { std::ptr::copy_nonoverlapping(message.as_ptr(), self.place.data(pos + RECORD), message.len()) };
        self.tail += need as u64;
        self.publish();
        Ok(())
    }

    /// Publishes the tail, and wakes the consumer if it sleeps.
    fn publish(&self) {
        self.place.tail().store(self.tail, Ordering::SeqCst);
        bump(self.place.wake(), self.place.waiting());
    }

    /// Waits until the consumer may have given room back since the last `push` (one that
    /// said the ring was full), or `timeout` has passed: polls a little, then sleeps on the
    /// shared futex. A wake-up may be spurious; push again to see.
    pub fn wait_for_room(&self, timeout: Duration) {
        let moved = || self.place.head().load(Ordering::SeqCst) != self.seen_head;
        sleep_until(self.place.room(), self.place.room_waiting(), moved, DEFAULT_SPIN, timeout);
    }

    fn write_len(&self, pos: usize, len: u32) {
        let record = u64::from(len).to_ne_bytes();
        // SAFETY: a record header at an 8-aligned position with at least 8 bytes to the end.
        unsafe { std::ptr::copy_nonoverlapping(record.as_ptr(), self.place.data(pos), RECORD) };
    }
}

impl Consumer {
    /// Makes a new, empty ring of `len` bytes at `offset` in `region` and its consumer (the
    /// producer attaches with [`Producer::attach`], in this process or another).
    pub fn create(region: &Arc<Region>, offset: usize, len: usize) -> Result<Self, ShmError> {
        Ok(Self { place: init(region, offset, len)?, head: 0, spin: DEFAULT_SPIN })
    }

    /// The consumer of a ring made with [`Producer::create`], in this process or another.
    pub fn attach(region: &Arc<Region>, offset: usize, len: usize) -> Result<Self, ShmError> {
        let place = Place::new(Arc::clone(region), offset, len)?;
        let head = place.head().load(Ordering::SeqCst);
        Ok(Self { place, head, spin: DEFAULT_SPIN })
    }

    /// Copies the next message into `out` (replacing what it held): false when the ring is
    /// empty.
    pub fn pop(&mut self, out: &mut Vec<u8>) -> Result<bool, RingError> {
        let popped = self.pop_with(|len| {
            // Overwritten whole: only bytes past what `out` held are zeroed first.
            out.resize(len, 0);
            Ok::<_, std::convert::Infallible>(&mut out[..])
        })?;
        Ok(popped.is_some())
    }

    /// Copies the next message into the buffer `make` gives for its length (for a message to go
    /// straight where it is used): `None` when the ring is empty; the message stays when `make`
    /// fails, and its error is given back.
    pub fn pop_with<B: AsMut<[u8]>, E>(
        &mut self,
        make: impl FnOnce(usize) -> Result<B, E>,
    ) -> Result<Option<Result<B, E>>, RingError> {
        let Some((pos, len)) = self.next()? else { return Ok(None) };
        let mut out = match make(len) {
            Ok(out) => out,
            Err(e) => return Ok(Some(Err(e))),
        };
        let to = out.as_mut();
        if to.len() != len {
            return Err(RingError::WrongBuffer { len, got: to.len() });
        }
        // SAFETY: `len` bytes after the record header lie within the data and were published by
        // the producer's tail; the producer writes them no more until the head below gives them
        // back. (A misbehaving peer may still write them meanwhile: the copy then holds
        // garbage, which whoever decodes it must refuse, and nothing here reads them again.)
        unsafe { std::ptr::copy_nonoverlapping(self.place.data(pos + RECORD), to.as_mut_ptr(), len) };
        self.consumed(RECORD + pad(len));
        Ok(Some(Ok(out)))
    }

    /// The next message's place and length, past any skip record: `None` when the ring is
    /// empty.
    fn next(&mut self) -> Result<Option<(usize, usize)>, RingError> {
        let cap = self.place.capacity;
        loop {
            let tail = self.place.tail().load(Ordering::SeqCst);
            let avail = tail.checked_sub(self.head).ok_or(RingError::Corrupt("the producer went back"))?;
            let avail = usize::try_from(avail)
                .ok()
                .filter(|&a| a <= cap)
                .ok_or(RingError::Corrupt("more written than held"))?;
            if avail == 0 {
                return Ok(None);
            }
            let pos = (self.head % cap as u64) as usize;
            let to_end = cap - pos;
            if avail < RECORD || to_end < RECORD {
                return Err(RingError::Corrupt("a record cut short"));
            }
            let len = self.read_len(pos);
            if len == SKIP {
                if to_end > avail {
                    return Err(RingError::Corrupt("a skip past what was written"));
                }
                self.consumed(to_end);
                continue;
            }
            let len = len as usize;
            if RECORD + pad(len) > to_end.min(avail) {
                return Err(RingError::Corrupt("a message longer than what was written"));
            }
            return Ok(Some((pos, len)));
        }
    }

    fn consumed(&mut self, bytes: usize) {
        self.head += bytes as u64;
        self.place.head().store(self.head, Ordering::SeqCst);
        bump(self.place.room(), self.place.room_waiting());
    }

    /// How long [`Self::wait`] polls before it sleeps: longer where a message usually follows
    /// soon and a core can be spared, zero where cores are few.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    fn read_len(&self, pos: usize) -> u32 {
        let mut record = [0u8; RECORD];
        // SAFETY: a record header at an 8-aligned position with at least 8 bytes to the end.
        unsafe { std::ptr::copy_nonoverlapping(self.place.data(pos), record.as_mut_ptr(), RECORD) };
        u64::from_ne_bytes(record) as u32
    }

    /// Waits until a message may be there or `timeout` has passed: polls a little, then sleeps
    /// on the shared futex. A wake-up may be spurious; pop to see.
    pub fn wait(&self, timeout: Duration) {
        let tail = self.place.tail();
        let arrived = || tail.load(Ordering::SeqCst) != self.head;
        sleep_until(self.place.wake(), self.place.waiting(), arrived, self.spin, timeout);
    }
}

/// Moves `word` on and wakes the one sleeping on it, if its flag says one does.
fn bump(word: &AtomicU32, waiting: &AtomicU32) {
    word.fetch_add(1, Ordering::SeqCst);
    if waiting.load(Ordering::SeqCst) != 0 {
        // An error here (the peer unmapped?) leaves the sleeper to its timeout.
        let _ = futex::wake(word, futex::Flags::empty(), 1);
    }
}

/// Polls `ready` for `spin`, then sleeps on `word` (raising `waiting` meanwhile) until the peer
/// bumps it or `timeout` has passed.
fn sleep_until(word: &AtomicU32, waiting: &AtomicU32, ready: impl Fn() -> bool, spin: Duration, timeout: Duration) {
    let until = Instant::now() + spin.min(timeout);
    while Instant::now() < until {
        if ready() {
            return;
        }
        std::hint::spin_loop();
    }
    // The word is read before the flag is raised and the condition looked at again: a bump
    // after this read moves the word, and the kernel then returns at once.
    let seen = word.load(Ordering::SeqCst);
    waiting.store(1, Ordering::SeqCst);
    if !ready() {
        let timeout = futex::Timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        // Woken, timed out, interrupted, or the word had moved on: each means look again.
        let _ = futex::wait(word, futex::Flags::empty(), seen, Some(&timeout));
    }
    waiting.store(0, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(len: usize) -> (Producer, Consumer, Arc<Region>) {
        let region = Arc::new(Region::create("djinn-ring-test", 1 << 16).expect("a region"));
        let producer = Producer::create(&region, 0, len).expect("a ring");
        let consumer = Consumer::attach(&region, 0, len).expect("its consumer");
        (producer, consumer, region)
    }

    #[test]
    fn messages_come_out_whole_and_in_order_across_the_end_of_the_ring() {
        let (mut p, mut c, _region) = ring(RING_HEADER + 64);
        let mut out = Vec::new();
        assert!(!c.pop(&mut out).unwrap(), "empty");
        for round in 0..20u8 {
            let message = vec![round; 1 + usize::from(round) % 23];
            p.push(&message).unwrap();
            assert!(c.pop(&mut out).unwrap());
            assert_eq!(out, message);
        }
        assert_eq!(p.push(&[0; 57]), Err(RingError::TooLarge { len: 57, max: 56 }));
        p.push(&[1; 40]).unwrap();
        assert!(matches!(p.push(&[2; 16]), Err(RingError::Full { .. })));
        assert!(c.pop(&mut out).unwrap());
        p.push(&[]).unwrap();
        assert!(c.pop(&mut out).unwrap() && out.is_empty(), "an empty message is a message");
    }

    #[test]
    fn a_producer_waiting_on_a_full_ring_wakes_when_the_consumer_gives_room_back() {
        let (mut p, mut c, _region) = ring(RING_HEADER + 64);
        p.push(&[1; 40]).unwrap();
        assert!(matches!(p.push(&[2; 40]), Err(RingError::Full { .. })));
        std::thread::scope(|s| {
            s.spawn(move || {
                // Past the producer's spin, so that it sleeps in the kernel.
                std::thread::sleep(Duration::from_millis(20));
                let mut out = Vec::new();
                assert!(c.pop(&mut out).unwrap());
            });
            // A hang guard: a wake-up that never comes leaves the producer to this timeout.
            let deadline = Instant::now() + Duration::from_secs(30);
            p.wait_for_room(Duration::from_secs(60));
            assert!(Instant::now() < deadline, "woken by the pop, not the timeout");
            p.push(&[2; 40]).unwrap();
        });
    }

    #[test]
    fn a_peer_that_writes_garbage_into_the_header_makes_the_ring_corrupt_not_unsafe() {
        let (mut p, mut c, _region) = ring(RING_HEADER + 64);
        let mut out = Vec::new();
        p.place.tail().store(1 << 40, Ordering::SeqCst);
        assert_eq!(c.pop(&mut out), Err(RingError::Corrupt("more written than held")));
        p.place.tail().store(8, Ordering::SeqCst);
        // A record claiming more than was written.
        p.write_len(0, 4000);
        assert_eq!(c.pop(&mut out), Err(RingError::Corrupt("a message longer than what was written")));
        c.place.head().store(99, Ordering::SeqCst);
        assert_eq!(p.push(b"x"), Err(RingError::Corrupt("the consumer is ahead of the producer")));
    }

    #[test]
    fn a_ring_must_fit_its_region_on_a_cache_line() {
        let region = Arc::new(Region::create("djinn-ring-test", 4096).unwrap());
        assert!(Producer::create(&region, 8, 1024).is_err(), "not on a cache line");
        assert!(Producer::create(&region, 0, 8192).is_err(), "past the region");
        assert!(Producer::create(&region, 0, RING_HEADER).is_err(), "no room for a record");
        assert!(Producer::create(&region, 2048, 2048).is_ok());
    }

    proptest::proptest! {
        /// Whatever a peer leaves in the header and the data, each end attached to it answers
        /// every call with a message of at most the ring's capacity, an empty ring, or an
        /// error: it never panics, and never reads or writes outside the ring.
        #[test]
        fn garbage_left_by_a_peer_gives_errors_not_panics(
            tail in proptest::prelude::any::<u64>(),
            head in proptest::prelude::any::<u64>(),
            near in proptest::bool::ANY,
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
        ) {
            let (p, _, region) = ring(RING_HEADER + 512);
            // Near each other, the positions pass the first checks and the records get read.
            let tail = if near { head.wrapping_add(tail % 600) } else { tail };
            p.place.tail().store(tail, Ordering::SeqCst);
            p.place.head().store(head, Ordering::SeqCst);
            // SAFETY: within the ring's data, which nothing else touches in this test.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.place.data(0), data.len()) };
            let mut c = Consumer::attach(&region, 0, RING_HEADER + 512).unwrap();
            let mut out = Vec::new();
            for _ in 0..80 {
                match c.pop(&mut out) {
                    Ok(true) => proptest::prop_assert!(out.len() <= 512),
                    Ok(false) | Err(_) => break,
                }
            }
            let mut p = Producer::attach(&region, 0, RING_HEADER + 512).unwrap();
            for len in [0, 7, 100, 504] {
                if p.push(&vec![1; len]).is_err() {
                    break;
                }
            }
        }

        /// Whatever the sizes and the interleaving: every message pushed comes out once, whole,
        /// in order; a push is refused as full only when the ring's free bytes are short of
        /// what it needs (wrapping included), and as too large only past the largest message.
        #[test]
        fn what_goes_in_comes_out_once_in_order(
            steps in proptest::collection::vec((proptest::bool::ANY, 0usize..200), 1..400),
            cap in 2usize..64,
        ) {
            let (mut p, mut c, _region) = ring(RING_HEADER + cap * 8);
            let mut sent = std::collections::VecDeque::new();
            let mut out = Vec::new();
            let mut n = 0u32;
            for (push, len) in steps {
                if push {
                    n += 1;
                    let message: Vec<u8> = (0..len).map(|i| (i as u32 ^ n) as u8).collect();
                    match p.push(&message) {
                        Ok(()) => sent.push_back(message),
                        Err(RingError::TooLarge { max, .. }) => proptest::prop_assert!(len > max),
                        Err(RingError::Full { free, need }) => proptest::prop_assert!(free < need),
                        Err(e) => proptest::prop_assert!(false, "{e}"),
                    }
                } else {
                    match sent.pop_front() {
                        Some(expected) => {
                            proptest::prop_assert!(c.pop(&mut out).unwrap());
                            proptest::prop_assert_eq!(&out, &expected);
                        }
                        None => proptest::prop_assert!(!c.pop(&mut out).unwrap()),
                    }
                }
            }
            while let Some(expected) = sent.pop_front() {
                proptest::prop_assert!(c.pop(&mut out).unwrap());
                proptest::prop_assert_eq!(&out, &expected);
            }
            proptest::prop_assert!(!c.pop(&mut out).unwrap());
        }
    }
}
