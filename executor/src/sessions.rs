//! Server-resident sessions: a model's state (a KV cache, a position) kept on the node between
//! steps, moved to host memory while its agent waits on a tool, and back on the device before it
//! computes again.
//!
//! The table decides where each session's state lives; it runs no model. A session's requests
//! come from the node's core one at a time, in the order they were sent (the core keeps whose
//! each session is and what waits), and run on workers: they hold the table while they move a
//! state between device and host memory, which the poller must never wait on.
//!
//! Device memory for state is bounded twice: by the session budget (so the policies can be
//! compared at a fixed number of resident sessions) and by the node's device budget (which every
//! other feature shares). When a step needs room, a resident session that is not stepping is
//! swapped out to the host pool: under the semantic policy sessions in IO_WAIT go first, then the
//! least recently used; under LRU only recency counts and signals move nothing. State is never
//! dropped: a swap the host pool cannot take leaves the state where it is.
//!
//! A session moves to another node in its turn: the worker reads the state into host memory and
//! answers with it, and the node's core opens it on the other node as a session of that node's
//! own (on a grant the tenant got from it). The core's `EndMove` says how it went, and the state
//! here is freed only once the other node holds it. A move that fails leaves the session here
//! as it was.

use crate::kept::HandleSpace;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_memory::{MemoryBudget, Reservation};
use djinn_proto::{Fingerprint, Handle, Signal};
use tch::{Device, Tensor};

use crate::error::{ExecError, SessionError};
use crate::models::Model;
use crate::tensors::tensor_bytes;

/// Which resident session makes room for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Sessions whose agent said IO_WAIT first (swapped out at the signal, restored ahead of
    /// the expected resume), then the least recently used.
    Semantic,
    /// The least recently used, on pressure only; signals are acknowledged and ignored.
    Lru,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "semantic" => Ok(Self::Semantic),
            "lru" => Ok(Self::Lru),
            _ => Err(format!("{s:?} is not a session policy: use semantic or lru")),
        }
    }
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Self::Semantic => "semantic",
            Self::Lru => "lru",
        }
    }
}

#[derive(Debug, Clone)]
pub struct SessionOptions {
    pub policy: Policy,
    /// Device bytes that session state may take (within the node's device budget).
    pub budget: u64,
    /// Host bytes that swapped-out state may take.
    pub host_pool: u64,
}

enum Place {
    /// On the device, charged to both budgets (one reservation each per growth).
    Device(Vec<Reservation>),
    Host {
        _pool: Reservation,
    },
}

struct Session {
    /// Whose session it is: only that tenant may step, signal or close it.
    tenant: TenantId,
    model: Arc<Model>,
    state: Vec<Tensor>,
    /// What the state is charged on the device: at least the size announced at open, and the
    /// largest it has been.
    charge: u64,
    place: Place,
    last_used: Instant,
    io_wait: bool,
    resume_at: Option<Instant>,
    /// A step is running on (shallow clones of) the state: it must stay where it is.
    stepping: bool,
    /// The session's own charge (`MIN_CHARGE`) against the device budget and the tenant's
    /// quota, whatever its state: a session of no state still counts.
    _bookkeeping: Reservation,
}

/// What the sessions counted, read by stats replies without the table's lock.
#[derive(Debug, Default)]
struct Counters {
    opened: AtomicU64,
    closed: AtomicU64,
    expired: AtomicU64,
    steps: AtomicU64,
    swaps_out: AtomicU64,
    swaps_in: AtomicU64,
    restores_ahead: AtomicU64,
    swaps_refused: AtomicU64,
    state_bytes_in_place: AtomicU64,
    state_bytes_replaced: AtomicU64,
    /// Sessions whose state is on the device now.
    on_device: AtomicU64,
    moved_out: AtomicU64,
    moves_failed: AtomicU64,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

pub struct SessionTable {
    epoch: u64,
    next_id: u64,
    sessions: HashMap<u64, Session>,
    options: SessionOptions,
    budget: MemoryBudget,
    device_budget: MemoryBudget,
    host_pool: MemoryBudget,
    device: Device,
    /// Host-to-device bytes per second seen in restores, for how far ahead to start one.
    restore_rate: f64,
    counters: Arc<Counters>,
    /// Woken when a restore is scheduled (the clock thread sleeps until the next one is due).
    clock: Option<std::thread::Thread>,
}

impl std::fmt::Debug for SessionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionTable")
            .field("epoch", &format_args!("{:016x}", self.epoch))
            .field("sessions", &self.sessions.len())
            .field("policy", &self.options.policy)
            .finish()
    }
}

/// Slack added to the expected copy time when scheduling a restore ahead of a resume.
const RESTORE_MARGIN: Duration = Duration::from_millis(5);

impl SessionTable {
    /// The sessions of the executor's handles `space`; `host_pool` holds swapped-out state
    /// (`options.host_pool` bytes, with tenants' quotas).
    pub fn new(
        options: SessionOptions,
        space: HandleSpace,
        device_budget: MemoryBudget,
        host_pool: MemoryBudget,
        device: Device,
    ) -> Self {
        Self {
            epoch: space.epoch,
            next_id: space.first_id,
            sessions: HashMap::new(),
            budget: MemoryBudget::new(options.budget),
            host_pool,
            options,
            device_budget,
            device,
            restore_rate: 1e9,
            counters: Arc::default(),
            clock: None,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The sessions' counters and budgets as stats replies read them, without this table's lock.
    pub fn stats_view(&self) -> SessionStats {
        SessionStats {
            counters: Arc::clone(&self.counters),
            budget: self.budget.clone(),
            host_pool: self.host_pool.clone(),
        }
    }

    /// The thread to wake when a restore is scheduled.
    pub fn set_clock(&mut self, thread: std::thread::Thread) {
        self.clock = Some(thread);
    }

    /// The sessions (`tenant`'s only, when given) whose ids come after `after`, in order, a
    /// page of [`djinn_node_core::LIST_PAGE`] at most: whose, which, of what model, and their state's
    /// bytes now; and whether more remain.
    pub fn list(&self, tenant: Option<TenantId>, after: u64) -> (Vec<(TenantId, Handle, Fingerprint, u64)>, bool) {
        let theirs = self.sessions.iter().filter(|(_, s)| tenant.is_none_or(|t| s.tenant == t));
        let (ids, more) = crate::page(theirs.map(|(&id, _)| id), after);
        let listed = ids
            .into_iter()
            .filter_map(|id| self.sessions.get(&id).map(|s| (id, s)))
            .map(|(id, s)| (s.tenant, Handle { id, epoch: self.epoch }, s.model.fingerprint, state_bytes(&s.state)))
            .collect();
        (listed, more)
    }

    /// Refuses, before it is made, a state larger than the budgets could ever hold.
    pub fn could_hold(&self, bytes: u64) -> Result<(), SessionError> {
        let limit = self.budget.limit().min(self.device_budget.limit());
        if bytes > limit {
            return Err(SessionError::Full(format!("a state of {bytes} bytes; session state may take {limit}")));
        }
        Ok(())
    }

    /// Opens a session whose initial state (already on the device) is `state`.
    pub fn open(
        &mut self,
        tenant: TenantId,
        model: Arc<Model>,
        state: Vec<Tensor>,
        reserve: u64,
    ) -> Result<Handle, ExecError> {
        let held = self.sessions.values().filter(|s| s.tenant == tenant).count();
        if held >= crate::MAX_SESSIONS_PER_TENANT {
            return Err(ExecError::TooMany(format!(
                "this tenant has {held} sessions open, the most one tenant may: close some first"
            )));
        }
        let bookkeeping = self.device_budget.try_reserve_for(tenant, crate::MIN_CHARGE)?;
        let bytes = state_bytes(&state);
        let charge = reserve.max(bytes);
        let reservations = self.make_room(tenant, charge, None, false)?;
        let id = self.next_id;
        self.next_id += 1;
        let now = Instant::now();
        self.sessions.insert(
            id,
            Session {
                tenant,
                model,
                state,
                charge,
                place: Place::Device(reservations),
                last_used: now,
                io_wait: false,
                resume_at: None,
                stepping: false,
                _bookkeeping: bookkeeping,
            },
        );
        add(&self.counters.opened, 1);
        add(&self.counters.on_device, 1);
        Ok(Handle { id, epoch: self.epoch })
    }

    /// Where the session's state tensors are (a parked activation that passes them on shares
    /// them, and they are charged here already).
    pub fn state_addrs(&self, id: u64) -> Vec<usize> {
        self.sessions.get(&id).map_or_else(Vec::new, |s| s.state.iter().map(|t| t.data_ptr() as usize).collect())
    }

    /// Readies a step: brings the state to the device (making room) and hands out the model
    /// and the state (sharing its memory; the state stays put until [`Self::end_step`]).
    pub fn begin_step(&mut self, id: u64) -> Result<(Arc<Model>, Vec<Tensor>), ExecError> {
        self.restore(id, false)?;
        let s = self.session_mut(id)?;
        s.stepping = true;
        s.io_wait = false;
        s.resume_at = None;
        s.last_used = Instant::now();
        Ok((Arc::clone(&s.model), s.state.iter().map(Tensor::shallow_clone).collect()))
    }

    /// Ends a step: `new_state` replaces the state (charging any growth, which may swap other
    /// sessions out); with `None` (the step failed) the state is unchanged. When the growth
    /// cannot be charged the step fails and the old state stays.
    pub fn end_step(&mut self, id: u64, new_state: Option<Vec<Tensor>>) -> Result<(), ExecError> {
        let Some(s) = self.sessions.get_mut(&id) else { return Ok(()) };
        s.stepping = false;
        s.last_used = Instant::now();
        let Some(state) = new_state else { return Ok(()) };
        let bytes = state_bytes(&state);
        if bytes > s.charge {
            let (extra, tenant) = (bytes - s.charge, s.tenant);
            let mut more = self.make_room(tenant, extra, Some(id), false)?;
            let s = self.session_mut(id)?;
            if let Place::Device(charges) = &mut s.place {
                charges.append(&mut more);
            }
            s.charge = bytes;
        }
        let s = self.session_mut(id)?;
        // State the step wrote where it was (a graph's KV cache) against state it replaced.
        let in_place: u64 = state
            .iter()
            .zip(&s.state)
            .filter(|(new, old)| new.numel() > 0 && new.data_ptr() == old.data_ptr())
            .map(|(new, _)| tensor_bytes(new))
            .sum();
        s.state = state;
        add(&self.counters.steps, 1);
        add(&self.counters.state_bytes_in_place, in_place);
        add(&self.counters.state_bytes_replaced, bytes - in_place);
        Ok(())
    }

    /// Applies a signal, after the session's earlier requests.
    pub fn signal(&mut self, id: u64, signal: Signal) {
        let now = Instant::now();
        let semantic = self.options.policy == Policy::Semantic;
        let rate = self.restore_rate;
        let Some(s) = self.sessions.get_mut(&id) else { return };
        match signal {
            Signal::IoWait { resume_in_ms } => {
                s.io_wait = true;
                if !semantic {
                    return;
                }
                let lead = Duration::from_secs_f64(state_bytes(&s.state) as f64 / rate) + RESTORE_MARGIN;
                s.resume_at =
                    resume_in_ms.map(|ms| (now + Duration::from_millis(ms.into())).checked_sub(lead).unwrap_or(now));
                if s.resume_at.is_some()
                    && let Some(clock) = &self.clock
                {
                    clock.unpark();
                }
                if let Err(e) = self.swap_out(id) {
                    tracing::debug!(session = id, error = %e, "IO_WAIT: the state stays on the device");
                }
            }
            Signal::Compute => {
                s.io_wait = false;
                s.resume_at = None;
                if semantic && let Err(e) = self.restore(id, true) {
                    tracing::debug!(session = id, error = %e, "COMPUTE: the state stays in host memory until the next step");
                }
            }
        }
    }

    /// A restore scheduled ahead of a resume: done when it fits, making room from sessions in
    /// IO_WAIT only (the step will do it otherwise).
    pub fn restore_ahead(&mut self, id: u64) {
        let on_host = self.sessions.get(&id).is_some_and(|s| matches!(s.place, Place::Host { .. }));
        if on_host && self.restore(id, true).is_ok() {
            add(&self.counters.restores_ahead, 1);
        }
    }

    /// Closes the session; its state's memory goes with what this returns, for the caller to
    /// drop outside the table's lock.
    pub fn close(&mut self, id: u64) -> Option<Vec<Tensor>> {
        let s = self.take(id)?;
        add(&self.counters.closed, 1);
        Some(s.state)
    }

    /// Readies a move: hands out the model, the state (sharing its memory, on the device or in
    /// host memory) and what it is charged; the state stays put until [`Self::moved_out`] or
    /// [`Self::move_failed`].
    pub fn begin_move(&mut self, id: u64) -> Result<(Arc<Model>, Vec<Tensor>, u64), ExecError> {
        let s = self.session_mut(id)?;
        s.stepping = true;
        Ok((Arc::clone(&s.model), s.state.iter().map(Tensor::shallow_clone).collect(), s.charge))
    }

    /// The session is on another node now: it leaves the table, and its charges with it. Its
    /// state's memory goes with what this returns, for the caller to drop once it has answered
    /// (freeing a large state takes a while).
    pub fn moved_out(&mut self, id: u64) -> Vec<Tensor> {
        let Some(s) = self.take(id) else { return Vec::new() };
        add(&self.counters.moved_out, 1);
        s.state
    }

    /// The move failed: the session stays, as it was.
    pub fn move_failed(&mut self, id: u64) {
        if let Some(s) = self.sessions.get_mut(&id) {
            s.stepping = false;
        }
        add(&self.counters.moves_failed, 1);
    }

    fn take(&mut self, id: u64) -> Option<Session> {
        let s = self.sessions.remove(&id)?;
        if matches!(s.place, Place::Device(_)) {
            self.counters.on_device.fetch_sub(1, Ordering::Relaxed);
        }
        Some(s)
    }

    /// Frees sessions the core found idle past its time limit; their states' memory goes with
    /// what this returns, for the caller to drop outside the table's lock.
    pub fn expire(&mut self, ids: &[u64]) -> Vec<Vec<Tensor>> {
        let states: Vec<Vec<Tensor>> = ids.iter().filter_map(|&id| self.take(id)).map(|s| s.state).collect();
        add(&self.counters.expired, states.len() as u64);
        states
    }

    /// Sessions whose restore is due (each is returned once, with its tenant), and when the
    /// next one is.
    pub fn due_restores(&mut self, now: Instant) -> (Vec<(u64, TenantId)>, Option<Instant>) {
        let mut due = Vec::new();
        let mut next = None::<Instant>;
        for (&id, s) in &mut self.sessions {
            match s.resume_at {
                Some(at) if at <= now => {
                    s.resume_at = None;
                    if matches!(s.place, Place::Host { .. }) {
                        due.push((id, s.tenant));
                    }
                }
                Some(at) => next = Some(next.map_or(at, |n| n.min(at))),
                None => {}
            }
        }
        (due, next)
    }

    /// A session that a caller holding the table just saw.
    fn session_mut(&mut self, id: u64) -> Result<&mut Session, ExecError> {
        self.sessions.get_mut(&id).ok_or_else(|| ExecError::Internal(format!("session {id} vanished")))
    }

    /// Brings a session's state to the device when it is in host memory. `waiting_only`: make
    /// room from sessions in IO_WAIT only.
    fn restore(&mut self, id: u64, waiting_only: bool) -> Result<(), ExecError> {
        let Some(s) = self.sessions.get(&id) else { return Ok(()) };
        if matches!(s.place, Place::Device(_)) {
            return Ok(());
        }
        let reservations = self.make_room(s.tenant, s.charge, Some(id), waiting_only)?;
        let started = Instant::now();
        let device = self.device;
        let s = self.session_mut(id)?;
        let state = s.state.iter().map(|t| move_to(t, device)).collect::<Result<Vec<_>, _>>()?;
        s.state = state;
        s.place = Place::Device(reservations);
        let (bytes, seconds) = (state_bytes(&s.state), started.elapsed().as_secs_f64());
        add(&self.counters.on_device, 1);
        if bytes > 0 && seconds > 0.0 {
            // A moving average: one slow copy does not set every later lead time.
            self.restore_rate = 0.8 * self.restore_rate + 0.2 * (bytes as f64 / seconds);
        }
        add(&self.counters.swaps_in, 1);
        Ok(())
    }

    /// Moves a resident session's state to the host pool; the state stays when the pool
    /// cannot take it.
    fn swap_out(&mut self, id: u64) -> Result<(), ExecError> {
        let Some(s) = self.sessions.get_mut(&id) else { return Ok(()) };
        if !matches!(s.place, Place::Device(_)) || s.stepping {
            return Ok(());
        }
        let pool = match self.host_pool.try_reserve_for(s.tenant, state_bytes(&s.state)) {
            Ok(r) => r,
            Err(e) => {
                add(&self.counters.swaps_refused, 1);
                return Err(SessionError::Full(format!("the host pool cannot take the state: {e}")).into());
            }
        };
        let state = s.state.iter().map(|t| move_to(t, Device::Cpu)).collect::<Result<Vec<_>, _>>()?;
        s.state = state;
        // The device reservations go with the old place.
        s.place = Place::Host { _pool: pool };
        self.counters.on_device.fetch_sub(1, Ordering::Relaxed);
        add(&self.counters.swaps_out, 1);
        Ok(())
    }

    /// Reserves `bytes` for `tenant` in the session budget and the device budget, swapping
    /// resident sessions out (never `except`, never one stepping) until both have room. Other
    /// tenants' sessions are swapped out only while `tenant` holds no more than its fair share
    /// of both budgets, and never to make room in its quota.
    fn make_room(
        &mut self,
        tenant: TenantId,
        bytes: u64,
        except: Option<u64>,
        waiting_only: bool,
    ) -> Result<Vec<Reservation>, ExecError> {
        let mut unswappable = Vec::new();
        let mut first = true;
        loop {
            let over = match self.budget.try_reserve_for(tenant, bytes) {
                Ok(session) => match self.device_budget.try_reserve_for(tenant, bytes) {
                    Ok(device) => return Ok(vec![session, device]),
                    Err(e) => e,
                },
                Err(e) => e,
            };
            let beyond_share = |b: &MemoryBudget| b.used_by(tenant) + bytes > b.fair_share(tenant);
            let own_only = over.tenant.is_some() || beyond_share(&self.budget) || beyond_share(&self.device_budget);
            let swappable = |&(id, s): &(&u64, &Session)| {
                Some(*id) != except
                    && !s.stepping
                    && matches!(s.place, Place::Device(_))
                    && !unswappable.contains(id)
                    && (!waiting_only || s.io_wait)
                    && (!own_only || s.tenant == tenant)
            };
            // Nothing is swapped out when swapping all that may go would not make room.
            let freeable: u64 = self.sessions.iter().filter(swappable).map(|(_, s)| s.charge).sum();
            let room = |b: &MemoryBudget| b.used().saturating_sub(freeable) + bytes <= b.limit();
            let quota_room = self.device_budget.quota(tenant).is_none_or(|q| {
                let own: u64 = self
                    .sessions
                    .iter()
                    .filter(swappable)
                    .filter(|(_, s)| s.tenant == tenant)
                    .map(|(_, s)| s.charge)
                    .sum();
                self.device_budget.used_by(tenant).saturating_sub(own) + bytes <= q
            });
            let hopeless = first && !(room(&self.budget) && room(&self.device_budget) && quota_room);
            first = false;
            let victim = self
                .sessions
                .iter()
                .filter(swappable)
                .min_by_key(|(_, s)| match self.options.policy {
                    Policy::Semantic => (!s.io_wait, s.last_used),
                    Policy::Lru => (false, s.last_used),
                })
                .map(|(&id, _)| id)
                .filter(|_| !hopeless);
            let Some(victim) = victim else {
                if over.tenant.is_some() {
                    return Err(over.into());
                }
                return Err(SessionError::Full(format!(
                    "{bytes} bytes of session state do not fit: {} of {} bytes in the session budget and {} of {} in the device budget are in use, and the resident sessions this tenant may swap out would not make room",
                    self.budget.used(),
                    self.budget.limit(),
                    self.device_budget.used(),
                    self.device_budget.limit()
                ))
                .into());
            };
            if self.swap_out(victim).is_err() {
                unswappable.push(victim);
            }
        }
    }
}

/// The sessions' part of a stats reply, read without the table's lock.
#[derive(Clone)]
pub struct SessionStats {
    counters: Arc<Counters>,
    budget: MemoryBudget,
    host_pool: MemoryBudget,
}

impl std::fmt::Debug for SessionStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionStats").finish_non_exhaustive()
    }
}

impl SessionStats {
    /// Appends the counters (the core counts the sessions open).
    pub fn append(&self, out: &mut Vec<(String, u64)>) {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let gone = get(&c.closed) + get(&c.expired) + get(&c.moved_out);
        let open = get(&c.opened).saturating_sub(gone);
        let on_device = get(&c.on_device).min(open);
        out.extend(
            [
                ("sessions_on_device", on_device),
                ("sessions_on_host", open - on_device),
                ("session_device_bytes", self.budget.used()),
                ("session_budget_bytes", self.budget.limit()),
                ("session_host_bytes", self.host_pool.used()),
                ("sessions_opened", get(&c.opened)),
                ("sessions_closed", get(&c.closed)),
                ("sessions_moved_out", get(&c.moved_out)),
                ("session_moves_failed", get(&c.moves_failed)),
                ("session_steps", get(&c.steps)),
                ("session_swaps_out", get(&c.swaps_out)),
                ("session_swaps_in", get(&c.swaps_in)),
                ("session_restores_ahead", get(&c.restores_ahead)),
                ("session_swaps_refused", get(&c.swaps_refused)),
                ("session_state_bytes_in_place", get(&c.state_bytes_in_place)),
                ("session_state_bytes_replaced", get(&c.state_bytes_replaced)),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
    }
}

/// A node's sessions: the table of their states, and their counters for stats.
#[derive(Debug, Clone)]
pub struct Sessions {
    pub table: Arc<std::sync::Mutex<SessionTable>>,
    pub stats: SessionStats,
}

impl Sessions {
    pub fn new(table: SessionTable) -> Self {
        let stats = table.stats_view();
        Self { table: Arc::new(std::sync::Mutex::new(table)), stats }
    }
}

/// What a session's state keeps alive: the storages it views, each once (a state that is a
/// slice of a larger intermediate keeps all of it).
fn state_bytes(state: &[Tensor]) -> u64 {
    crate::tensors::held_bytes(state)
}

/// A copy of `t` on `device` (host memory for the CPU; pinned when the session's device is a
/// GPU, so the copy back can be asynchronous). On a CPU node both sides are host memory: the
/// copy is what a swap costs there, and the budgets see the move.
fn move_to(t: &Tensor, device: Device) -> Result<Tensor, ExecError> {
    let copy = match (t.device(), device) {
        (Device::Cuda(_), Device::Cpu) => {
            let mut host = Tensor::f_empty(t.size(), (t.kind(), Device::Cpu))?.f_pin_memory(t.device())?;
            host.f_copy_(t)?;
            host
        }
        (_, Device::Cpu) => t.f_detach_copy()?,
        (_, device) => t.f_to_device(device)?,
    };
    Ok(copy)
}
