//! The epoll backend: one thread, edge-triggered readiness through mio, vectored reads into the
//! frame reader's targets and vectored writes from the send queue.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use mio::net::{TcpListener, TcpStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;

use super::accept::AcceptBackoff;
use super::server::{Conn, Core, ServerCounters, ShutdownHandle};
use super::tls::TlsWire;
use crate::rdma::{Completion, RdmaContext, RdmaError, connection_key};
use djinn_node_core::{LocalNode, Service};

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX - 2);
const RDMA: Token = Token(usize::MAX - 3);
/// Polling of the RDMA completion queue between two epoll rounds while busy.
const RDMA_SPIN: std::time::Duration = std::time::Duration::from_micros(20);
/// Slices handed to one `writev`.
const MAX_IOV: usize = 64;

struct MioConn {
    stream: TcpStream,
    /// Set where the node speaks TLS: the bytes of `stream` are its records.
    tls: Option<Box<TlsWire>>,
    conn: Conn,
    /// Readiness seen and not yet used up (edge-triggered: cleared on `WouldBlock`).
    readable: bool,
    writable: bool,
    scheduled: bool,
}

impl MioConn {
    /// TLS records waiting for the socket.
    fn records_waiting(&self) -> bool {
        self.tls.as_ref().is_some_and(|tls| tls.wants_write())
    }

    /// Replies queued, or TLS records waiting for the socket.
    fn has_output(&self) -> bool {
        !self.conn.queue.is_empty() || self.records_waiting()
    }

    /// Done, its last TLS records written too (unless it is dropped).
    fn is_done(&self) -> bool {
        self.conn.is_done() && (self.conn.is_dropped() || !self.records_waiting())
    }
}

pub(crate) struct MioServer<S> {
    poll: Poll,
    listener: TcpListener,
    flag: Arc<AtomicBool>,
    wake: Arc<dyn Fn() + Send + Sync>,
    core: Core<S>,
    conns: Slab<MioConn>,
    ready: Vec<usize>,
    rdma: Option<Arc<RdmaContext>>,
    completions: Vec<Result<Completion, RdmaError>>,
    /// Set while accepting waits (out of descriptors): epoll is edge-triggered and the listener
    /// stays ready, so it is tried again at the time this says, not on an event.
    accept_backoff: AcceptBackoff,
}

impl<S: Service> MioServer<S> {
    /// `make_core` gets the function that wakes this poller from another thread.
    pub fn new(
        listener: std::net::TcpListener,
        make_core: impl FnOnce(Arc<dyn Fn() + Send + Sync>) -> Core<S>,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let mut listener = TcpListener::from_std(listener);
        let poll = Poll::new()?;
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let wake: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
            if let Err(e) = waker.wake() {
                tracing::error!(error = %e, "cannot wake the poller");
            }
        });
        let core = make_core(Arc::clone(&wake));
        let rdma = core.config.backend.rdma().cloned();
        if let Some(ctx) = &rdma {
            poll.registry().register(&mut SourceFd(&ctx.fd()), RDMA, Interest::READABLE)?;
        }
        Ok(Self {
            poll,
            listener,
            flag: Arc::new(AtomicBool::new(false)),
            core,
            rdma,
            completions: Vec::new(),
            wake,
            conns: Slab::new(),
            ready: Vec::new(),
            accept_backoff: AcceptBackoff::default(),
        })
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle::new(Arc::clone(&self.flag), Arc::clone(&self.wake))
    }

    pub fn local_node(&self) -> LocalNode {
        self.core.local_node()
    }

    pub fn run(mut self) -> io::Result<ServerCounters> {
        let mut events = Events::with_capacity(1024);
        while !self.flag.load(Ordering::Acquire) {
            let now = Instant::now();
            let turn = self.core.begin_turn(now);
            if turn.resume_reads {
                for (key, c) in self.conns.iter_mut() {
                    if !c.scheduled {
                        c.scheduled = true;
                        self.ready.push(key);
                    }
                }
            }
            if turn.check_deadlines {
                let expired: Vec<usize> = self
                    .conns
                    .iter_mut()
                    .filter_map(|(key, c)| self.core.check_timeouts(&mut c.conn, now).then_some(key))
                    .collect();
                for key in expired {
                    self.close(key);
                }
                self.core.on_tick(now);
            }
            let busy = !self.ready.is_empty() || self.core.keep_polling(now);
            let mut timeout = busy.then_some(std::time::Duration::ZERO);
            if timeout.is_none() && self.arm_rdma() {
                timeout = Some(std::time::Duration::ZERO);
            }
            // Asleep, it still wakes for the next deadline check while connections are open,
            // to accept again after a failure, and for the service's next expiry.
            if timeout.is_none() && !self.conns.is_empty() {
                timeout = Some(self.core.next_deadline_check().saturating_duration_since(now));
            }
            for at in [self.accept_backoff.retry_at(), self.core.next_expiry()].into_iter().flatten() {
                let until = at.saturating_duration_since(now);
                timeout = Some(timeout.map_or(until, |t| t.min(until)));
            }
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            // The core's time for this turn: one clock read.
            let now = Instant::now();
            self.core.set_now(now);
            let mut worked = !events.is_empty() || !self.ready.is_empty();
            worked |= self.core.serve_local();
            while let Some((slot, to, reply)) = self.core.next_deferred() {
                worked = true;
                if let Some(c) = self.conns.get_mut(slot) {
                    self.core.deliver(&mut c.conn, to, reply);
                    if !c.scheduled {
                        c.scheduled = true;
                        self.ready.push(slot);
                    }
                }
            }
            if busy && !worked {
                if self.rdma.is_some() {
                    // Poll the completion queue (memory reads, no system call) for a while
                    // before the next epoll round.
                    let until = Instant::now() + RDMA_SPIN;
                    while Instant::now() < until && !worked {
                        worked = self.poll_rdma() > 0;
                        std::hint::spin_loop();
                    }
                } else {
                    // Spinning, and nothing came: let a client on this core run.
                    std::thread::yield_now();
                }
            }
            if self.accept_backoff.due(now) {
                self.accept()?;
            }
            for event in events.iter() {
                match event.token() {
                    LISTENER if self.accept_backoff.retry_at().is_none() => self.accept()?,
                    LISTENER => {}
                    WAKER => {}
                    RDMA => {
                        if let Some(ctx) = &self.rdma {
                            ctx.ack_events();
                        }
                    }
                    Token(key) => {
                        if let Some(c) = self.conns.get_mut(key) {
                            c.readable |= event.is_readable() || event.is_read_closed() || event.is_error();
                            c.writable |= event.is_writable() || event.is_error();
                            if !c.scheduled {
                                c.scheduled = true;
                                self.ready.push(key);
                            }
                        }
                    }
                }
            }
            worked |= self.poll_rdma() > 0;
            // Driving may schedule connections again (onto the emptied list); the drained list
            // keeps its capacity for the next round.
            let mut ready = std::mem::take(&mut self.ready);
            for key in ready.drain(..) {
                self.drive(key);
            }
            if self.ready.is_empty() {
                self.ready = ready;
            }
            if worked {
                self.core.worked();
            }
        }
        tracing::info!(open = self.conns.len(), "poller stopping");
        for c in self.conns.drain() {
            self.core.on_close(&c.conn);
        }
        Ok(self.core.counters)
    }

    /// Asks for a completion event before the poller sleeps; true when completions arrived
    /// meanwhile (the poller must not sleep then).
    fn arm_rdma(&mut self) -> bool {
        let Some(ctx) = &self.rdma else { return false };
        if let Err(e) = ctx.arm() {
            tracing::error!(error = %e, "cannot arm the RDMA completion queue");
        }
        self.poll_rdma() > 0
    }

    /// Hands every RDMA completion to its connection.
    fn poll_rdma(&mut self) -> usize {
        let Some(ctx) = &self.rdma else { return 0 };
        let mut completions = std::mem::take(&mut self.completions);
        if let Err(e) = ctx.poll(|c| completions.push(c)) {
            tracing::error!(error = %e, "polling the RDMA completion queue failed");
        }
        let n = completions.len();
        for completion in completions.drain(..) {
            let wr_id = match &completion {
                Ok(c) => c.wr_id,
                Err(e) => e.wr_id().unwrap_or_default(),
            };
            let key = connection_key(wr_id);
            let slot = (key >> 16) as usize;
            let Some(c) = self.conns.get_mut(slot) else { continue };
            if !c.conn.has_rdma_key(key) {
                continue;
            }
            self.core.on_rdma_completion(&mut c.conn, completion);
            if !c.scheduled {
                c.scheduled = true;
                self.ready.push(slot);
            }
        }
        self.completions = completions;
        n
    }

    fn accept(&mut self) -> io::Result<()> {
        loop {
            let (mut stream, peer) = match self.listener.accept() {
                Ok(accepted) => {
                    self.accept_backoff.accepted();
                    accepted
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if self.accept_backoff.failed(&e, Instant::now()) => continue,
                Err(_) => {
                    self.core.counters.accept_backoffs += 1;
                    return Ok(());
                }
            };
            if !self.core.may_accept(peer, self.conns.len()) {
                continue;
            }
            let tls = match self.core.config.backend.tls().map(TlsWire::accept).transpose() {
                Ok(tls) => tls.map(Box::new),
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "connection closed: no TLS state for it");
                    continue;
                }
            };
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
            }
            let entry = self.conns.vacant_entry();
            let key = entry.key();
            self.poll.registry().register(&mut stream, Token(key), Interest::READABLE | Interest::WRITABLE)?;
            let conn = self.core.on_accept(peer, key);
            entry.insert(MioConn { stream, tls, conn, readable: true, writable: true, scheduled: true });
            self.ready.push(key);
        }
    }

    /// Moves bytes for one connection until it would block or has used its budgets.
    fn close(&mut self, key: usize) {
        let Some(mut c) = self.conns.try_remove(key) else { return };
        if let Err(e) = self.poll.registry().deregister(&mut c.stream) {
            tracing::debug!(error = %e, "deregister failed");
        }
        self.core.on_close(&c.conn);
    }

    fn drive(&mut self, key: usize) {
        let Some(c) = self.conns.get_mut(key) else { return };
        c.scheduled = false;
        let core = &mut self.core;
        let mut read_budget = core.config.read_budget;
        let mut write_budget = core.config.read_budget;
        let result = (|| -> io::Result<()> {
            loop {
                while c.writable && c.has_output() && write_budget > 0 {
                    let written = match (&mut c.tls, c.conn.queue.is_empty()) {
                        // Only TLS records wait (a handshake's, say).
                        (Some(tls), true) => tls.flush(&mut c.stream).map(|()| None),
                        (tls, _) => {
                            let mut iov = [IoSlice::new(&[]); MAX_IOV];
                            let n = c.conn.queue.write_slices(&mut iov);
                            match tls {
                                None => c.stream.write_vectored(&iov[..n]),
                                Some(tls) => tls.write_vectored(&mut c.stream, &iov[..n]),
                            }
                            .map(Some)
                        }
                    };
                    match written {
                        Ok(None) => {}
                        Ok(Some(0)) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(Some(n)) => {
                            core.on_bytes_written(&mut c.conn, n);
                            write_budget = write_budget.saturating_sub(n);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => c.writable = false,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                // Frames left buffered by back-pressure are answered once the queue drains.
                core.process(&mut c.conn);
                if c.writable && c.has_output() && write_budget > 0 {
                    continue;
                }
                if !(c.readable && core.wants_read(&c.conn) && read_budget > 0) {
                    return Ok(());
                }
                let target = c.conn.reader.read_target();
                let mut iov = [IoSliceMut::new(target.payload), IoSliceMut::new(target.staging)];
                let iov = if iov[0].is_empty() { &mut iov[1..] } else { &mut iov[..] };
                let read = match &mut c.tls {
                    None => c.stream.read_vectored(iov),
                    Some(tls) => tls.read_vectored(&mut c.stream, iov),
                };
                match read {
                    Ok(0) => core.on_eof(&mut c.conn),
                    Ok(n) => {
                        core.on_bytes_read(&mut c.conn, n);
                        read_budget = read_budget.saturating_sub(n);
                        core.process(&mut c.conn);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => c.readable = false,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        })();
        let close = match result {
            Ok(()) => c.is_done(),
            Err(e) => {
                tracing::debug!(peer = %c.conn.peer, error = %e, "connection lost");
                true
            }
        };
        if close {
            self.close(key);
            return;
        }
        let more_reads = c.readable && self.core.wants_read(&c.conn);
        let more_writes = c.writable && c.has_output();
        if (more_reads || more_writes) && !c.scheduled {
            c.scheduled = true;
            self.ready.push(key);
        }
    }
}
