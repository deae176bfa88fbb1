//! Frames over the connection's TCP stream (TLS records where it speaks TLS): written
//! vectored from the caller's memory, read into the frame reader's targets.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use djinn_proto::{Frame, Message, ZEROS, check_tensor_lens, encode_head, paddings, unsent_slices};

use super::{ClientConn, ClientError, PoolAlloc, reply_of};

impl ClientConn {
    pub(super) fn send(&mut self, request_id: u64, message: &Message, tensors: &[&[u8]]) -> Result<(), ClientError> {
        encode_head(&mut self.head, request_id, message).map_err(ClientError::Request)?;
        let descs = message.tensors();
        check_tensor_lens(descs, tensors.iter().map(|t| t.len())).map_err(ClientError::Request)?;
        let mut slices: Vec<&[u8]> = Vec::with_capacity(1 + 2 * tensors.len());
        slices.push(&self.head);
        for (padding, bytes) in paddings(descs).zip(tensors) {
            if padding > 0 {
                slices.push(&ZEROS[..padding]);
            }
            slices.push(bytes);
        }
        let deadline = self.options.timeout.map(|t| Instant::now() + t);
        let total: u64 = slices.iter().map(|s| s.len() as u64).sum();
        let mut written = 0;
        while written < total {
            let mut iov = [IoSlice::new(&[]); 64];
            let count = unsent_slices(slices.iter().copied(), written, &mut iov);
            let sent = match &mut self.tls {
                None => send_vectored(&self.stream, &iov[..count]),
                Some(tls) => tls.write_vectored(&mut &self.stream, &iov[..count]),
            };
            match sent {
                Ok(n) => {
                    self.bytes_sent += n as u64;
                    written += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(libc::POLLOUT, deadline)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    // The node may have closed after telling us why (a fatal protocol error).
                    return Err(self.error_reply_after_reset().unwrap_or(ClientError::Io { peer: self.peer, source }));
                }
            }
        }
        // TLS records made of the frame and not written yet go before the reply is awaited.
        while let Some(tls) = &mut self.tls {
            match tls.flush(&mut &self.stream) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(libc::POLLOUT, deadline)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(ClientError::Io { peer: self.peer, source }),
            }
        }
        Ok(())
    }

    pub(super) fn error_reply_after_reset(&mut self) -> Option<ClientError> {
        self.stream.set_nonblocking(true).ok()?;
        let old = self.options.timeout.replace(Duration::from_millis(100));
        let reply = self.receive(0).err();
        self.options.timeout = old;
        reply.filter(|e| matches!(e, ClientError::Remote { .. }))
    }

    pub(super) fn receive(&mut self, request_id: u64) -> Result<Frame, ClientError> {
        let peer = self.peer;
        let deadline = self.options.timeout.map(|t| Instant::now() + t);
        let mut spin_until = Instant::now() + self.options.spin;
        loop {
            let mut oversized = None;
            let alloc = &mut PoolAlloc { pool: &self.pool, bound: self.reply_bound, oversized: &mut oversized };
            let event = self.reader.next_event(alloc);
            if let Some(announced) = oversized {
                // Rather than read (and skip) what could be gigabytes, the connection ends here.
                let _ = self.stream.shutdown(Shutdown::Both);
                return Err(ClientError::ReplyTooLarge { peer, announced, bound: self.reply_bound });
            }
            if let Some(event) = event {
                return reply_of(peer, request_id, event);
            }
            let target = self.reader.read_target();
            let mut iov = [IoSliceMut::new(target.payload), IoSliceMut::new(target.staging)];
            let iov = if iov[0].is_empty() { &mut iov[1..] } else { &mut iov[..] };
            let received = match &mut self.tls {
                None => recv_vectored(&self.stream, iov),
                Some(tls) => tls.read_vectored(&mut &self.stream, iov),
            };
            match received {
                Ok(0) => {
                    return Err(match self.reader.on_eof() {
                        Some(source) => ClientError::Protocol { peer, source },
                        None => ClientError::Closed { peer },
                    });
                }
                Ok(n) => {
                    self.bytes_received += n as u64;
                    self.reader.on_read(n);
                    spin_until = Instant::now() + self.options.spin;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // TLS records of ours that wait (a handshake's end) go out while we wait.
                    let unsent = self.tls.as_mut().is_some_and(|tls| {
                        let _ = tls.flush(&mut &self.stream);
                        tls.wants_write()
                    });
                    if Instant::now() >= spin_until {
                        self.wait(if unsent { libc::POLLIN | libc::POLLOUT } else { libc::POLLIN }, deadline)?;
                    } else {
                        // Give the core away while spinning: when the node shares it with us,
                        // a pure busy-wait would keep it from answering.
                        std::thread::yield_now();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(ClientError::Io { peer, source }),
            }
        }
    }

    /// Blocks until the socket is ready for `events` or the deadline passes.
    pub(super) fn wait(&self, events: libc::c_short, deadline: Option<Instant>) -> Result<(), ClientError> {
        loop {
            let timeout_ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ClientError::Timeout {
                            peer: self.peer,
                            timeout: self.options.timeout.unwrap_or_default(),
                        });
                    }
                    left.as_millis().clamp(1, i32::MAX as u128) as i32
                }
            };
            let mut fd = libc::pollfd { fd: self.stream.as_raw_fd(), events, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call.
            let rc = unsafe { libc::poll(&mut fd, 1, timeout_ms) };
            if rc > 0 {
                return Ok(());
            }
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(ClientError::Io { peer: self.peer, source: e });
                }
            }
        }
    }
}

/// `sendmsg` with `MSG_NOSIGNAL`: a closed peer is an error, never a SIGPIPE (the Python
/// extension runs in processes that do not ignore it).
fn send_vectored(stream: &TcpStream, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: IoSlice is ABI-compatible with iovec; msghdr is zeroed then filled.
    let n = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = iov.len();
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

fn recv_vectored(stream: &TcpStream, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
    // SAFETY: IoSliceMut is ABI-compatible with iovec and the slices outlive the call.
    let n = unsafe { libc::readv(stream.as_raw_fd(), iov.as_ptr() as *const libc::iovec, iov.len() as libc::c_int) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}
