//! The io_uring backend: the same protocol core as the mio backend, with completion-based I/O.
//! Each connection has at most one `readv` and one `writev` in flight; their iovecs point into
//! the frame reader's targets and the send queue's frames, which stay put until the completion
//! arrives (a connection is only freed once none of its operations is in flight).

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use io_uring::{IoUring, opcode, squeue, types};
use slab::Slab;

use super::accept::AcceptBackoff;
use super::server::{Conn, Core, ServerCounters, ShutdownHandle};
use djinn_node_core::{LocalNode, Service};

const RING_ENTRIES: u32 = 1024;
const MAX_IOV: usize = 64;

/// Operation tag in the low three bits of `user_data`; the connection key is above it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Accept = 0,
    Read = 1,
    Write = 2,
    Wake = 3,
    Cancel = 4,
}

fn user_data(op: Op, key: usize) -> u64 {
    ((key as u64) << 3) | op as u64
}

fn decode(user_data: u64) -> (Op, usize) {
    let op = match user_data & 7 {
        0 => Op::Accept,
        1 => Op::Read,
        2 => Op::Write,
        3 => Op::Wake,
        _ => Op::Cancel,
    };
    (op, (user_data >> 3) as usize)
}

struct UringConn {
    stream: TcpStream,
    conn: Conn,
    reading: bool,
    writing: bool,
    cancelled: bool,
    failed: bool,
    /// The iovecs of the operations in flight; boxed so their address is stable.
    read_iov: Box<[libc::iovec; 2]>,
    write_iov: Box<[libc::iovec; MAX_IOV]>,
}

impl UringConn {
    fn should_close(&self) -> bool {
        self.failed || self.conn.is_done()
    }
}

pub(crate) struct UringServer<S> {
    ring: IoUring,
    listener: std::net::TcpListener,
    wake_fd: Arc<OwnedFd>,
    wake_buf: Box<u64>,
    wake: Arc<dyn Fn() + Send + Sync>,
    flag: Arc<AtomicBool>,
    core: Core<S>,
    conns: Slab<UringConn>,
    dirty: Vec<usize>,
    /// Set while accepting waits (out of descriptors): no accept is armed until then.
    accept_backoff: AcceptBackoff,
}

fn empty_iovec() -> libc::iovec {
    libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }
}

impl<S: Service> UringServer<S> {
    /// `make_core` gets the function that wakes this poller from another thread.
    pub fn new(
        listener: std::net::TcpListener,
        make_core: impl FnOnce(Arc<dyn Fn() + Send + Sync>) -> Core<S>,
    ) -> io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        // SAFETY: eventfd has no memory preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        let wake_fd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let fd = Arc::clone(&wake_fd);
        let wake: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to an eventfd we keep open.
            let rc = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
            if rc != 8 {
                tracing::error!(error = %io::Error::last_os_error(), "cannot wake the poller");
            }
        });
        Ok(Self {
            ring,
            listener,
            wake_fd,
            wake_buf: Box::new(0),
            flag: Arc::new(AtomicBool::new(false)),
            core: make_core(Arc::clone(&wake)),
            wake,
            conns: Slab::new(),
            dirty: Vec::new(),
            accept_backoff: AcceptBackoff::default(),
        })
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle::new(Arc::clone(&self.flag), Arc::clone(&self.wake))
    }

    pub fn local_node(&self) -> LocalNode {
        self.core.local_node()
    }

    /// Queues a submission, flushing the queue to the kernel first when it is full.
    fn push(&mut self, entry: squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: every entry's buffers live until its completion (see the module comment).
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
    }

    fn arm_accept(&mut self) -> io::Result<()> {
        let entry =
            opcode::Accept::new(types::Fd(self.listener.as_raw_fd()), std::ptr::null_mut(), std::ptr::null_mut())
                .flags(libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK)
                .build()
                .user_data(user_data(Op::Accept, 0));
        self.push(entry)
    }

    fn arm_wake(&mut self) -> io::Result<()> {
        let buf: *mut u64 = &mut *self.wake_buf;
        let entry = opcode::Read::new(types::Fd(self.wake_fd.as_raw_fd()), buf.cast(), 8)
            .build()
            .user_data(user_data(Op::Wake, 0));
        self.push(entry)
    }

    pub fn run(mut self) -> io::Result<ServerCounters> {
        self.arm_accept()?;
        self.arm_wake()?;
        let mut completions: Vec<(u64, i32)> = Vec::with_capacity(RING_ENTRIES as usize);
        while !self.flag.load(Ordering::Acquire) {
            let now = Instant::now();
            let turn = self.core.begin_turn(now);
            if turn.resume_reads {
                self.dirty.extend(self.conns.iter().map(|(key, _)| key));
            }
            if self.accept_backoff.due(now) {
                self.arm_accept()?;
            }
            if turn.check_deadlines {
                self.core.on_tick(now);
                for (key, c) in self.conns.iter_mut() {
                    if self.core.check_timeouts(&mut c.conn, now) {
                        self.dirty.push(key);
                    }
                }
            }
            if self.core.serve_local() {
                self.core.worked();
            }
            while let Some((slot, to, reply)) = self.core.next_deferred() {
                self.core.worked();
                if let Some(c) = self.conns.get_mut(slot) {
                    self.core.deliver(&mut c.conn, to, reply);
                    self.dirty.push(slot);
                }
            }
            // As in the mio backend: the drained list keeps its capacity for the next round.
            let mut dirty = std::mem::take(&mut self.dirty);
            for key in dirty.drain(..) {
                self.schedule(key)?;
            }
            if self.dirty.is_empty() {
                self.dirty = dirty;
            }
            // Entering without waiting while busy also runs the kernel's pending completion work.
            let busy = self.core.keep_polling(now);
            // Asleep, it still wakes for the next deadline check while connections are open, to
            // accept again after a failure, and for the service's next expiry.
            let next_check = (!self.conns.is_empty()).then(|| self.core.next_deadline_check());
            let wake_at =
                [next_check, self.accept_backoff.retry_at(), self.core.next_expiry()].into_iter().flatten().min();
            let entered = if busy {
                self.ring.submit()
            } else if let Some(at) = wake_at {
                let wait = types::Timespec::from(at.saturating_duration_since(Instant::now()));
                self.ring.submitter().submit_with_args(1, &types::SubmitArgs::new().timespec(&wait))
            } else {
                self.ring.submit_and_wait(1)
            };
            match entered {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::ETIME)) => {}
                Err(e) => return Err(e),
            }
            completions.clear();
            completions.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            // The core's time for the completions: one clock read after the wait.
            let now = Instant::now();
            self.core.set_now(now);
            if !completions.is_empty() {
                self.core.worked();
            } else if busy {
                std::thread::yield_now();
            }
            for &(data, result) in &completions {
                self.complete(data, result)?;
            }
        }
        tracing::info!(open = self.conns.len(), "poller stopping");
        // Dropping the ring cancels whatever is in flight before the buffers go.
        let Self { ring, conns, mut core, .. } = self;
        drop(ring);
        for (_, c) in conns {
            core.on_close(&c.conn);
        }
        Ok(core.counters)
    }

    fn complete(&mut self, data: u64, result: i32) -> io::Result<()> {
        let (op, key) = decode(data);
        match op {
            Op::Wake => self.arm_wake(),
            // The cancelled operations complete on their own (with ECANCELED).
            Op::Cancel => Ok(()),
            Op::Accept => {
                if result >= 0 {
                    self.accept_backoff.accepted();
                    // SAFETY: the kernel handed us this new descriptor.
                    let stream = unsafe { TcpStream::from_raw_fd(result as RawFd) };
                    self.on_accept(stream);
                } else if !self.accept_backoff.failed(&io::Error::from_raw_os_error(-result), Instant::now()) {
                    // Armed again when the wait is over (see `run`).
                    self.core.counters.accept_backoffs += 1;
                    return Ok(());
                }
                self.arm_accept()
            }
            Op::Read | Op::Write => {
                let Some(c) = self.conns.get_mut(key) else { return Ok(()) };
                let core = &mut self.core;
                if op == Op::Read {
                    c.reading = false;
                } else {
                    c.writing = false;
                }
                match result {
                    0 if op == Op::Read => core.on_eof(&mut c.conn),
                    0 => c.failed = true,
                    n if n > 0 && op == Op::Read => {
                        core.on_bytes_read(&mut c.conn, n as usize);
                        core.process(&mut c.conn);
                    }
                    n if n > 0 => {
                        core.on_bytes_written(&mut c.conn, n as usize);
                        // Replies drained: frames held back by back-pressure may go on.
                        if !c.reading {
                            core.process(&mut c.conn);
                        }
                    }
                    n if -n == libc::EAGAIN || -n == libc::EINTR => {}
                    n => {
                        if -n != libc::ECANCELED {
                            tracing::debug!(peer = %c.conn.peer, error = %io::Error::from_raw_os_error(-n), "connection lost");
                        }
                        c.failed = true;
                    }
                }
                self.dirty.push(key);
                Ok(())
            }
        }
    }

    fn on_accept(&mut self, stream: TcpStream) {
        let peer = match stream.peer_addr() {
            Ok(peer) => peer,
            Err(e) => {
                tracing::debug!(error = %e, "accepted connection already gone");
                return;
            }
        };
        if !self.core.may_accept(peer, self.conns.len()) {
            return;
        }
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        let entry = self.conns.vacant_entry();
        let key = entry.key();
        let conn = self.core.on_accept(peer, key);
        entry.insert(UringConn {
            stream,
            conn,
            reading: false,
            writing: false,
            cancelled: false,
            failed: false,
            read_iov: Box::new([empty_iovec(); 2]),
            write_iov: Box::new([empty_iovec(); MAX_IOV]),
        });
        self.dirty.push(key);
    }

    /// Starts the reads and writes a connection is ready for, or closes it.
    fn schedule(&mut self, key: usize) -> io::Result<()> {
        let Some(c) = self.conns.get_mut(key) else { return Ok(()) };
        let fd = types::Fd(c.stream.as_raw_fd());
        let mut entries: [Option<squeue::Entry>; 2] = [None, None];
        if c.should_close() {
            if !c.reading && !c.writing {
                let c = self.conns.remove(key);
                self.core.on_close(&c.conn);
                return Ok(());
            }
            if !c.cancelled {
                c.cancelled = true;
                entries[0] = Some(
                    opcode::AsyncCancel2::new(types::CancelBuilder::fd(fd).all())
                        .build()
                        .user_data(user_data(Op::Cancel, key)),
                );
            }
        } else {
            if !c.writing && !c.conn.queue.is_empty() {
                let mut slices = [IoSlice::new(&[]); MAX_IOV];
                let n = c.conn.queue.write_slices(&mut slices);
                for (dst, src) in c.write_iov.iter_mut().zip(&slices[..n]) {
                    *dst = libc::iovec { iov_base: src.as_ptr() as *mut _, iov_len: src.len() };
                }
                c.writing = true;
                entries[0] = Some(
                    opcode::Writev::new(fd, c.write_iov.as_ptr(), n as u32)
                        .build()
                        .user_data(user_data(Op::Write, key)),
                );
            }
            if !c.reading && self.core.wants_read(&c.conn) {
                let target = c.conn.reader.read_target();
                let parts = [target.payload, target.staging];
                let mut n = 0;
                for part in parts.into_iter().filter(|p| !p.is_empty()) {
                    c.read_iov[n] = libc::iovec { iov_base: part.as_mut_ptr().cast(), iov_len: part.len() };
                    n += 1;
                }
                c.reading = true;
                entries[1] = Some(
                    opcode::Readv::new(fd, c.read_iov.as_ptr(), n as u32).build().user_data(user_data(Op::Read, key)),
                );
            }
        }
        for entry in entries.into_iter().flatten() {
            self.push(entry)?;
        }
        Ok(())
    }
}
