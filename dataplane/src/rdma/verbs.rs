//! A reliable-connected queue pair and its completion queue. Set up through sideway: creation,
//! the INIT → RTR → RTS transitions from the peer's address (MTU and GID index negotiated),
//! memory registration. The hot path calls the provider through the raw bindings, with nothing
//! allocated: posting receives, SENDs (inline when small) and RDMA WRITEs with immediate, and
//! polling completions in batches.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use djinn_memory::HostBuf;
use rdma_mummy_sys as sys;
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue, GenericCompletionQueue};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState};

use super::device::{RdmaPort, mtu_of_bytes};

/// A failed verb, with what it was doing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    #[error("{verb} failed: {reason}")]
    Verb { verb: &'static str, reason: String },
    #[error("work request {wr_id} failed: {} (status {status}, vendor error {vendor_err:#x})", status_name(*status))]
    Completion { wr_id: u64, status: u32, vendor_err: u32 },
}

impl RdmaError {
    /// The work request a failed completion belongs to.
    pub fn wr_id(&self) -> Option<u64> {
        match self {
            Self::Completion { wr_id, .. } => Some(*wr_id),
            Self::Verb { .. } => None,
        }
    }
}

fn verb<E: std::fmt::Display>(verb: &'static str) -> impl FnOnce(E) -> RdmaError {
    move |e| RdmaError::Verb { verb, reason: e.to_string() }
}

/// What a peer needs to connect its queue pair to ours; exchanged over the TCP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointInfo {
    pub qp_number: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    /// The sender's active MTU in bytes; both sides use the smaller.
    pub mtu: u32,
}

/// A completed work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// The immediate value of a WRITE with immediate.
    pub imm: Option<u32>,
    pub kind: CompletionKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    Send,
    Write,
    Receive,
    /// An RDMA WRITE with immediate landed in our memory (it consumed a posted receive).
    ReceiveWrite,
    Other(u32),
}

/// Registered memory: the region and the address range it covers. Clones share the region,
/// which is deregistered with the last of them.
#[derive(Clone)]
pub struct Registered {
    mr: Arc<MemoryRegion>,
    pub addr: u64,
    pub len: usize,
}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered").field("addr", &self.addr).field("len", &self.len).finish()
    }
}

impl Registered {
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

/// A protection domain: a queue pair reaches only memory registered in its own domain, whatever
/// keys its peer has. Each RDMA connection gets its own ([`RdmaContext::new_domain`]), so a
/// peer can write only into the memory of its own connection's transfers, never into another
/// connection's, even with keys learned or guessed (issue 7's "a protection domain per
/// connection"; a memory window per transfer would bound a peer further, to one transfer).
#[derive(Clone)]
pub struct Domain {
    pd: Arc<ProtectionDomain>,
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain").finish_non_exhaustive()
    }
}

impl Domain {
    /// The registration of all of `buf`'s memory in this domain, made once and kept with the
    /// memory ([`HostBuf::attach`]) for its next uses, also after a trip through a pool; true
    /// when it was already there. The peers of this domain's queue pairs can write into the
    /// buffer for as long as it lives, whatever it holds by then: keep registrations only in a
    /// domain whose peers may see everything received in it.
    pub fn register_kept(&self, buf: &mut HostBuf) -> Result<(Registered, bool), RdmaError> {
        /// A registration and the address of the protection domain it was made in: the region
        /// holds the domain, so no other domain can have that address while it lives.
        struct Kept {
            pd: usize,
            registered: Registered,
        }

        let pd = Arc::as_ptr(&self.pd) as usize;
        if let Some(kept) = buf.attachment::<Kept>().filter(|k| k.pd == pd) {
            return Ok((kept.registered.clone(), true));
        }
        // SAFETY: the registration is kept with the memory, which drops it before it is freed,
        // and its clones live no longer than the transfers that use the buffer.
        let registered = unsafe { self.register_for_peer_writes(buf.as_ptr(), buf.capacity()) }?;
        buf.attach(Kept { pd, registered: registered.clone() });
        Ok((registered, false))
    }

    /// Registers `len` bytes at `addr` for local use and for the writes of the peers of this
    /// domain's queue pairs.
    ///
    /// # Safety
    /// The memory must stay valid (neither freed nor unmapped) while the returned registration
    /// lives and while any work request that uses it is in flight.
    pub unsafe fn register_for_peer_writes(&self, addr: *const u8, len: usize) -> Result<Registered, RdmaError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.register_with(addr, len, AccessFlags::LocalWrite | AccessFlags::RemoteWrite) }
    }

    /// Registers `len` bytes at `addr` for local use alone: what is sent, written to the
    /// peer, or received by SEND. No peer can write into it, whatever key it has.
    ///
    /// # Safety
    /// As [`Self::register_for_peer_writes`].
    pub unsafe fn register_local(&self, addr: *const u8, len: usize) -> Result<Registered, RdmaError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.register_with(addr, len, AccessFlags::LocalWrite) }
    }

    /// # Safety
    /// As [`Self::register_for_peer_writes`].
    unsafe fn register_with(&self, addr: *const u8, len: usize, access: AccessFlags) -> Result<Registered, RdmaError> {
        // SAFETY: forwarded to the caller.
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, access) }.map_err(verb("ibv_reg_mr"))?;
        Ok(Registered { mr, addr: addr as u64, len })
    }
}

/// What the queue pairs of one process share: the port, one completion queue (a poller polls
/// one queue whatever the number of connections; `wr_id`s tell them apart) and its completion
/// channel (a file descriptor to sleep on); and a protection domain of its own, for queue
/// pairs and memory that may share one ([`Self::domain`]).
pub struct RdmaContext {
    port: RdmaPort,
    domain: Domain,
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
}

impl std::fmt::Debug for RdmaContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaContext").field("port", &self.port).finish()
    }
}

impl RdmaContext {
    /// `cqe`: completion queue entries, enough for every queue pair's send and receive depth.
    pub fn new(port: &RdmaPort, cqe: u32) -> Result<Arc<Self>, RdmaError> {
        let pd = port.context.alloc_pd().map_err(verb("ibv_alloc_pd"))?;
        let channel = CompletionChannel::new(&port.context).map_err(verb("ibv_create_comp_channel"))?;
        let cq = port
            .context
            .create_cq_builder()
            .setup_cqe(cqe)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(verb("ibv_create_cq"))?;
        set_nonblocking(channel.as_raw_fd())?;
        Ok(Arc::new(Self { port: port.clone(), domain: Domain { pd }, cq, channel }))
    }

    /// A new protection domain on this context's device.
    pub fn new_domain(&self) -> Result<Domain, RdmaError> {
        Ok(Domain { pd: self.port.context.alloc_pd().map_err(verb("ibv_alloc_pd"))? })
    }

    /// The context's own protection domain, for queue pairs and memory that may share one.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    pub fn port(&self) -> &RdmaPort {
        &self.port
    }

    /// The completion channel's descriptor: readable after [`Self::arm`] once a completion
    /// arrives.
    pub fn fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }

    /// Asks for an event on the channel at the next completion. Poll once more afterwards:
    /// a completion that arrived before arming raises no event.
    pub fn arm(&self) -> Result<(), RdmaError> {
        // SAFETY: the CQ lives as long as `self`.
        let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if rc == 0 { Ok(()) } else { Err(verb("ibv_req_notify_cq")(std::io::Error::from_raw_os_error(rc))) }
    }

    /// Consumes the events the channel raised (after its descriptor became readable).
    pub fn ack_events(&self) {
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the channel is non-blocking and outlives the call.
        let channel = unsafe { self.channel.comp_channel() }.as_ptr();
        // SAFETY: each event got is acknowledged at once, on the CQ it names.
        while unsafe { rdma_mummy_sys::ibv_get_cq_event(channel, &mut cq, &mut ctx) } == 0 {
            // SAFETY: `cq` came from the event just got.
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
        }
    }

    /// [`Domain::register_for_peer_writes`] in the context's own domain.
    ///
    /// # Safety
    /// As [`Domain::register_for_peer_writes`].
    pub unsafe fn register_for_peer_writes(&self, addr: *const u8, len: usize) -> Result<Registered, RdmaError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.domain.register_for_peer_writes(addr, len) }
    }

    /// [`Domain::register_local`] in the context's own domain.
    ///
    /// # Safety
    /// As [`Domain::register_for_peer_writes`].
    pub unsafe fn register_local(&self, addr: *const u8, len: usize) -> Result<Registered, RdmaError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.domain.register_local(addr, len) }
    }
}

fn set_nonblocking(fd: RawFd) -> Result<(), RdmaError> {
    // SAFETY: fcntl on a descriptor we own.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
    if rc < 0 { Err(verb("fcntl(O_NONBLOCK)")(std::io::Error::last_os_error())) } else { Ok(()) }
}

pub struct RcEndpoint {
    ctx: Arc<RdmaContext>,
    qp: BasicQueuePair,
    psn: u32,
    max_inline: u32,
}

impl std::fmt::Debug for RcEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RcEndpoint").field("qp_number", &self.qp.qp_number()).finish()
    }
}

/// Depths of the queues of one endpoint.
#[derive(Debug, Clone, Copy)]
pub struct QueueDepths {
    pub send: u32,
    pub recv: u32,
    /// Bytes a SEND may carry inline (copied into the work request, no registration needed).
    pub max_inline: u32,
}

impl Default for QueueDepths {
    fn default() -> Self {
        Self { send: 128, recv: 128, max_inline: 220 }
    }
}

impl RcEndpoint {
    /// A queue pair in the INIT state in the context's own domain, completing into the
    /// context's queue.
    pub fn new(ctx: &Arc<RdmaContext>, depths: QueueDepths) -> Result<Self, RdmaError> {
        Self::in_domain(ctx, ctx.domain(), depths)
    }

    /// A queue pair in the INIT state in `domain`, completing into the context's queue: it
    /// reaches only memory registered in `domain`.
    pub fn in_domain(ctx: &Arc<RdmaContext>, domain: &Domain, depths: QueueDepths) -> Result<Self, RdmaError> {
        let port = &ctx.port;
        let handle = GenericCompletionQueue::from(Arc::clone(&ctx.cq));
        let mut qp = domain
            .pd
            .create_qp_builder()
            .setup_max_send_wr(depths.send)
            .setup_max_recv_wr(depths.recv)
            .setup_max_send_sge(4)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(depths.max_inline)
            .setup_send_cq(handle.clone())
            .setup_recv_cq(handle)
            .build()
            .map_err(verb("ibv_create_qp"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr).map_err(verb("ibv_modify_qp(INIT)"))?;
        // A random starting packet sequence number, as the verbs examples do (24 bits).
        let psn = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
            ^ std::process::id())
            & 0x00ff_ffff;
        Ok(Self { ctx: Arc::clone(ctx), qp, psn, max_inline: depths.max_inline })
    }

    pub fn info(&self) -> EndpointInfo {
        let port = &self.ctx.port;
        EndpointInfo { qp_number: self.qp.qp_number(), psn: self.psn, gid: port.gid.raw, mtu: port.mtu }
    }

    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }

    /// Connects to the peer described by `remote`: RTR then RTS, at the smaller of the two MTUs.
    pub fn connect(&mut self, remote: &EndpointInfo) -> Result<(), RdmaError> {
        let port = &self.ctx.port;
        let mtu = mtu_of_bytes(port.mtu.min(remote.mtu));
        let mut av = AddressHandleAttribute::new();
        av.setup_dest_lid(0)
            .setup_port(port.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(port.gid_index as u8)
            .setup_grh_dest_gid(&Gid { raw: remote.gid })
            .setup_grh_hop_limit(64);
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote.qp_number)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(0)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&av);
        self.qp.modify(&attr).map_err(verb("ibv_modify_qp(RTR)"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            // 4.096 µs × 2^14 ≈ 67 ms per try, 7 tries: a vanished peer fails the work request
            // in about half a second instead of hanging.
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(0);
        self.qp.modify(&attr).map_err(verb("ibv_modify_qp(RTS)"))
    }

    /// Posts a receive into `len` bytes at `addr` (inside `region`).
    ///
    /// # Safety
    /// `addr..addr + len` lies in `region` and stays valid until the receive completes.
    pub unsafe fn post_recv(&mut self, wr_id: u64, region: &Registered, addr: u64, len: u32) -> Result<(), RdmaError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.post_recvs(region, len, [(wr_id, addr)]) }
    }

    /// Posts one receive of `len` bytes per `(wr_id, addr)`, in order, a chain of up to
    /// [`RECV_CHAIN`] per `ibv_post_recv` (one lock of the receive queue each).
    ///
    /// # Safety
    /// As [`Self::post_recv`], for each receive.
    pub unsafe fn post_recvs(
        &mut self,
        region: &Registered,
        len: u32,
        recvs: impl IntoIterator<Item = (u64, u64)>,
    ) -> Result<(), RdmaError> {
        // The hot path calls the provider directly with work requests on the stack: sideway's
        // guards build two `Vec`s per call, which under emulation cost as much as the post.
        let mut recvs = recvs.into_iter().peekable();
        while recvs.peek().is_some() {
            let mut sges = [sys::ibv_sge { addr: 0, length: 0, lkey: 0 }; RECV_CHAIN];
            let mut wrs =
                [sys::ibv_recv_wr { wr_id: 0, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 1 };
                    RECV_CHAIN];
            for (n, (wr_id, addr)) in recvs.by_ref().take(RECV_CHAIN).enumerate() {
                sges[n] = sys::ibv_sge { addr, length: len, lkey: region.lkey() };
                wrs[n].wr_id = wr_id;
                wrs[n].sg_list = &raw mut sges[n];
                if n > 0 {
                    wrs[n - 1].next = &raw mut wrs[n];
                }
            }
            let mut bad = std::ptr::null_mut();
            // SAFETY: the chain and its scatter entries live on this stack frame for the call
            // (the provider copies them into the queue); the buffers are the caller's promise.
            let rc = unsafe { sys::ibv_post_recv(self.raw_qp(), wrs.as_mut_ptr(), &mut bad) };
            if rc != 0 {
                return Err(verb("ibv_post_recv")(std::io::Error::from_raw_os_error(rc)));
            }
        }
        Ok(())
    }

    /// Sends `bytes`, inline (copied into the work request) when they fit. Without `signaled`
    /// the SEND completes silently unless it fails (a later signalled one reclaims its place
    /// in the send queue).
    ///
    /// # Safety
    /// When `bytes` does not fit inline it must lie in `region` and stay unchanged until the
    /// send completes.
    pub unsafe fn post_send(
        &mut self,
        wr_id: u64,
        bytes: &[u8],
        region: Option<&Registered>,
        signaled: bool,
    ) -> Result<(), RdmaError> {
        let inline = bytes.len() as u32 <= self.max_inline;
        let mut flags = if signaled { sys::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
        let lkey = if inline {
            // Providers that take the data inline only when the flag says so (rxe) need it.
            flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
            0
        } else {
            region
                .ok_or_else(|| RdmaError::Verb {
                    verb: "ibv_post_send",
                    reason: format!("{} bytes need registered memory", bytes.len()),
                })?
                .lkey()
        };
        let sge = sys::ibv_sge { addr: bytes.as_ptr() as u64, length: bytes.len() as u32, lkey };
        // SAFETY: inline data is copied during the call; otherwise forwarded to the caller.
        unsafe { self.post_one(wr_id, sys::ibv_wr_opcode::IBV_WR_SEND, flags, sge, None, None) }
    }

    /// Writes `len` bytes at `addr` (in `region`) to the peer's `remote_addr` (`rkey`); with
    /// `imm`, then delivers it to the peer's next posted receive.
    ///
    /// # Safety
    /// `addr..addr + len` lies in `region` and stays unchanged until the write completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_write(
        &mut self,
        wr_id: u64,
        region: &Registered,
        addr: u64,
        len: u32,
        rkey: u32,
        remote_addr: u64,
        imm: Option<u32>,
    ) -> Result<(), RdmaError> {
        let opcode = match imm {
            Some(_) => sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None => sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        };
        let sge = sys::ibv_sge { addr, length: len, lkey: region.lkey() };
        let flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        // SAFETY: forwarded to the caller.
        unsafe { self.post_one(wr_id, opcode, flags, sge, Some((remote_addr, rkey)), imm) }
    }

    /// Writes `bytes` to the peer's `remote_addr` (`rkey`) inline: they are copied into the work
    /// request, so no registered memory is needed and the buffer is free once this returns.
    /// Without `signaled` the WRITE completes silently unless it fails.
    pub fn post_write_inline(
        &mut self,
        wr_id: u64,
        bytes: &[u8],
        rkey: u32,
        remote_addr: u64,
        signaled: bool,
    ) -> Result<(), RdmaError> {
        if bytes.len() as u32 > self.max_inline {
            return Err(RdmaError::Verb {
                verb: "ibv_post_send(WRITE)",
                reason: format!("{} bytes do not fit inline ({} at most)", bytes.len(), self.max_inline),
            });
        }
        let mut flags = sys::ibv_send_flags::IBV_SEND_INLINE.0;
        if signaled {
            flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        let sge = sys::ibv_sge { addr: bytes.as_ptr() as u64, length: bytes.len() as u32, lkey: 0 };
        // SAFETY: inline data is copied during the call; the remote side is the peer's promise.
        unsafe {
            self.post_one(wr_id, sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE, flags, sge, Some((remote_addr, rkey)), None)
        }
    }

    /// Posts one work request with one scatter entry through `ibv_post_send`.
    ///
    /// # Safety
    /// The memory `sge` names is valid for the operation (see the callers).
    unsafe fn post_one(
        &mut self,
        wr_id: u64,
        opcode: sys::ibv_wr_opcode::Type,
        send_flags: u32,
        mut sge: sys::ibv_sge,
        remote: Option<(u64, u32)>,
        imm: Option<u32>,
    ) -> Result<(), RdmaError> {
        // SAFETY: an all-zero work request is a valid starting point (null pointers, no flags).
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &raw mut sge;
        wr.num_sge = 1;
        wr.opcode = opcode;
        wr.send_flags = send_flags;
        if let Some(imm) = imm {
            // Passed through as given: the peer reads it back unchanged from its completion.
            wr.imm_data_invalidated_rkey_union.imm_data = imm;
        }
        if let Some((remote_addr, rkey)) = remote {
            wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: the request and its scatter entry outlive the call (the provider copies them,
        // and inline data, into the send queue); the memory it names is the caller's promise.
        let rc = unsafe { sys::ibv_post_send(self.raw_qp(), &mut wr, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            let what = if opcode == sys::ibv_wr_opcode::IBV_WR_SEND { "ibv_post_send" } else { "ibv_post_send(WRITE)" };
            Err(verb(what)(std::io::Error::from_raw_os_error(rc)))
        }
    }

    fn raw_qp(&self) -> *mut sys::ibv_qp {
        // SAFETY: the queue pair lives as long as `self`; the pointer is used only while it does.
        unsafe { self.qp.qp() }.as_ptr()
    }
}

/// Receives chained into one `ibv_post_recv` at most.
const RECV_CHAIN: usize = 16;

impl RdmaContext {
    /// Hands every available completion to `each`: a successful one as `Ok`, a failed one (its
    /// work request, and the connection it belongs to, are done for) as `Err`.
    pub fn poll(&self, mut each: impl FnMut(Result<Completion, RdmaError>)) -> Result<usize, RdmaError> {
        // `ibv_poll_cq` takes a batch under one lock and fills plain structs. The extended
        // polling API costs an indirect call per field, and rdma-core 44's rxe provider
        // (Debian 12) runs its consumer index past the producer when `ibv_next_poll` finds the
        // queue empty. The bound keeps a busy queue from holding the caller forever.
        // SAFETY: the queue lives as long as `self`.
        let cq = unsafe { self.cq.cq() }.as_ptr();
        let mut n = 0;
        while n < MAX_POLL_BATCH {
            let mut wcs = [const { std::mem::MaybeUninit::<sys::ibv_wc>::uninit() }; POLL_CHUNK];
            // SAFETY: room for `POLL_CHUNK` entries; the provider fills the first `got`.
            let got = unsafe { sys::ibv_poll_cq(cq, POLL_CHUNK as i32, wcs.as_mut_ptr().cast()) };
            if got < 0 {
                return Err(verb("ibv_poll_cq")(std::io::Error::from_raw_os_error(-got)));
            }
            let got = got as usize;
            for wc in &wcs[..got] {
                // SAFETY: written by the provider above.
                let wc = unsafe { wc.assume_init_ref() };
                each(completion_of(wc));
            }
            n += got;
            if got < POLL_CHUNK {
                break;
            }
        }
        Ok(n)
    }
}

fn completion_of(wc: &sys::ibv_wc) -> Result<Completion, RdmaError> {
    use sys::ibv_wc_opcode as op;
    if wc.status != sys::ibv_wc_status::IBV_WC_SUCCESS {
        return Err(RdmaError::Completion { wr_id: wc.wr_id, status: wc.status, vendor_err: wc.vendor_err });
    }
    let kind = match wc.opcode {
        op::IBV_WC_SEND => CompletionKind::Send,
        op::IBV_WC_RDMA_WRITE => CompletionKind::Write,
        op::IBV_WC_RECV => CompletionKind::Receive,
        op::IBV_WC_RECV_RDMA_WITH_IMM => CompletionKind::ReceiveWrite,
        o => CompletionKind::Other(o),
    };
    let receives = matches!(kind, CompletionKind::Receive | CompletionKind::ReceiveWrite);
    // Immediates travel only with WRITEs here.
    let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
    // SAFETY: a plain `u32` whatever the union holds; it is the immediate when the flag says so.
    let imm = (kind == CompletionKind::ReceiveWrite && with_imm)
        .then_some(unsafe { wc.imm_data_invalidated_rkey_union.imm_data });
    Ok(Completion { wr_id: wc.wr_id, byte_len: if receives { wc.byte_len } else { 0 }, imm, kind })
}

/// Completions taken per `ibv_poll_cq`.
const POLL_CHUNK: usize = 16;

/// Completions handed out by one [`RdmaContext::poll`].
const MAX_POLL_BATCH: usize = 256;

/// What `enum ibv_wc_status` calls a completion status.
pub fn status_name(status: u32) -> &'static str {
    const NAMES: [&str; 24] = [
        "success",
        "local length error",
        "local QP operation error",
        "local EE context operation error",
        "local protection error",
        "work request flushed",
        "memory window bind error",
        "bad response",
        "local access error",
        "remote invalid request",
        "remote access error",
        "remote operation error",
        "transport retries exceeded (the peer stopped answering)",
        "receiver-not-ready retries exceeded",
        "local RDD violation",
        "remote invalid RD request",
        "remote abort",
        "invalid EE context number",
        "invalid EE context state",
        "fatal error",
        "response timeout",
        "general error",
        "tag matching error",
        "tag matching rendezvous incomplete",
    ];
    NAMES.get(status as usize).copied().unwrap_or("unknown status")
}
