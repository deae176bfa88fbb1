//! A job's CPU memory, counted by the node's allocator (csrc/allocator.cpp) as it is allocated,
//! whatever allocates it: an operator's output or its scratch from libtorch, an operator past
//! the point where a run's plan stopped, an output made contiguous after the run. A worker
//! opens a [`JobMemory`] for each job on a CPU node and makes it current on its thread for the
//! job; each graph run starts a new bound on what it adds (`--max-run-memory`), and what the
//! job holds beyond what the tenant's quota granted it is asked of the quota (in 64 KiB steps,
//! given back when the job ends). A refusal throws inside libtorch, which fails the operator;
//! the job's error becomes [`ExecError::AllocationRefused`].

use std::ffi::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::{Mutex, Once};

use djinn_auth::TenantId;
use djinn_memory::{Charge, MemoryBudget};
use djinn_sync::Locked;

use crate::error::ExecError;

mod ffi {
    use std::ffi::{c_int, c_void};

    #[repr(C)]
    pub struct Account {
        _private: [u8; 0],
    }

    pub type Grow = extern "C" fn(owner: *mut c_void, bytes: u64) -> c_int;

    pub const REFUSED_RUN_BOUND: i32 = 1;
    pub const REFUSED_QUOTA: i32 = 2;

    unsafe extern "C" {
        pub fn djinn_allocator_install();
        pub fn djinn_allocator_fill(byte: c_int);
        pub fn djinn_account_new(limit: u64, granted: u64, grow: Grow, owner: *mut c_void) -> *mut Account;
        pub fn djinn_account_enter(account: *mut Account) -> *mut Account;
        pub fn djinn_account_begin_run(account: *mut Account);
        pub fn djinn_account_live(account: *const Account) -> u64;
        pub fn djinn_account_refusal(account: *const Account, asked: *mut u64, held: *mut u64) -> i32;
        pub fn djinn_account_close(account: *mut Account);
    }
}

/// Installs the node's allocator for the process's CPU tensors (once; later calls do nothing).
pub fn install() {
    static ONCE: Once = Once::new();
    // SAFETY: no arguments; the allocator lives for the process.
    ONCE.call_once(|| unsafe { ffi::djinn_allocator_install() });
}

/// Fills every accounted allocation with `byte` from now on (`None`: stops). An output that
/// differs between two runs of a deterministic program with different fills read memory it
/// never wrote (the execution fuzzer's check).
pub fn fill_allocations(byte: Option<u8>) {
    // SAFETY: a plain store.
    unsafe { ffi::djinn_allocator_fill(byte.map_or(-1, c_int::from)) };
}

/// Grants an account more of its tenant's quota.
struct Grantor {
    tenant: TenantId,
    budget: MemoryBudget,
    charges: Mutex<Vec<Charge>>,
}

extern "C" fn grow(owner: *mut c_void, bytes: u64) -> c_int {
    // SAFETY: `owner` is the grantor boxed in the `JobMemory` that opened the account, which
    // closes the account (so it calls no more) before the box goes.
    let grantor = unsafe { &*owner.cast::<Grantor>() };
    match grantor.budget.charge(grantor.tenant, bytes) {
        Ok(charge) => {
            grantor.charges.locked().push(charge);
            1
        }
        Err(_) => 0,
    }
}

/// One job's account with the node's allocator.
pub struct JobMemory {
    raw: NonNull<ffi::Account>,
    run_limit: u64,
    grantor: Box<Grantor>,
}

impl std::fmt::Debug for JobMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobMemory").field("tenant", &self.grantor.tenant).field("live", &self.live()).finish()
    }
}

impl JobMemory {
    /// An account of `tenant`'s, each graph run bounded to `run_limit` bytes and the job to
    /// what `budget` grants the tenant (without a quota, to the run's bound alone).
    pub fn open(tenant: TenantId, budget: &MemoryBudget, run_limit: u64) -> Self {
        install();
        let granted = if budget.quota(tenant).is_some() { 0 } else { u64::MAX };
        let grantor = Box::new(Grantor { tenant, budget: budget.clone(), charges: Mutex::default() });
        let owner = std::ptr::from_ref::<Grantor>(&grantor).cast_mut().cast::<c_void>();
        // SAFETY: `owner` lives in the box this struct holds until `drop` has closed the account.
        let raw = unsafe { ffi::djinn_account_new(run_limit, granted, grow, owner) };
        let raw = NonNull::new(raw).expect("djinn_account_new returns an account");
        Self { raw, run_limit, grantor }
    }

    /// Runs `f` with this account current on the thread (the one before it back after).
    pub fn charging<T>(&self, f: impl FnOnce() -> T) -> T {
        struct Restore(*mut ffi::Account);
        impl Drop for Restore {
            fn drop(&mut self) {
                // SAFETY: puts back the account that was current (or none).
                unsafe { ffi::djinn_account_enter(self.0) };
            }
        }
        // SAFETY: the account is open while `self` lives, which outlives the call.
        let _restore = Restore(unsafe { ffi::djinn_account_enter(self.raw.as_ptr()) });
        f()
    }

    /// A graph run begins: its bound is on what it adds to what the job holds now.
    pub fn begin_run(&self) {
        // SAFETY: an open account, on the job's thread.
        unsafe { ffi::djinn_account_begin_run(self.raw.as_ptr()) };
    }

    /// Bytes of live allocations the account paid for.
    pub fn live(&self) -> u64 {
        // SAFETY: an open account.
        unsafe { ffi::djinn_account_live(self.raw.as_ptr()) }
    }

    /// The first allocation refused, as the error the job ends with.
    pub fn refusal(&self) -> Option<ExecError> {
        let (mut asked, mut held) = (0u64, 0u64);
        // SAFETY: an open account; two out-values.
        let why = unsafe { ffi::djinn_account_refusal(self.raw.as_ptr(), &mut asked, &mut held) };
        let limit = match why {
            ffi::REFUSED_RUN_BOUND => Some(self.run_limit),
            ffi::REFUSED_QUOTA => None,
            _ => return None,
        };
        let quota = self.grantor.budget.quota(self.grantor.tenant);
        Some(ExecError::AllocationRefused { asked, held, run_limit: limit, quota })
    }
}

impl Drop for JobMemory {
    fn drop(&mut self) {
        // SAFETY: closed once; the account asks the grantor nothing more, and lives on (in
        // C++) while allocations it paid for do.
        unsafe { ffi::djinn_account_close(self.raw.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tch::{Device, Kind, Tensor};

    use super::*;

    const MIB: u64 = 1 << 20;

    fn bytes(n: u64) -> Tensor {
        Tensor::zeros([n as i64], (Kind::Uint8, Device::Cpu))
    }

    /// What a job allocates while its account is current is counted, bounded per run and by the
    /// tenant's quota (taken as it grows, given back when the job ends), and credited back
    /// whichever thread frees it, after the job too; what is allocated outside is not counted.
    #[test]
    fn a_jobs_allocations_are_counted_bounded_and_credited_wherever_they_are_freed() {
        let tenant = TenantId(7);
        let budget = MemoryBudget::with_quotas(1 << 40, Arc::new(move |t| (t == tenant).then_some(16 * MIB)));
        let memory = JobMemory::open(tenant, &budget, 8 * MIB);
        let outside = bytes(MIB);
        let (kept, elsewhere) = memory.charging(|| {
            memory.begin_run();
            let a = bytes(3 * MIB);
            let b = bytes(3 * MIB);
            assert_eq!(memory.live(), 6 * MIB);
            assert!(budget.used_by(tenant) >= 6 * MIB, "the quota is charged as the job grows");
            // Past the run's bound: refused inside libtorch, the job's tensors untouched.
            assert!(Tensor::f_zeros([3 << 20], (Kind::Uint8, Device::Cpu)).is_err());
            let refused = memory.refusal().expect("a refusal is recorded");
            assert_eq!(refused.code(), djinn_proto::ErrorCode::OverBudget, "{refused}");
            // A new run is bounded on what it adds: 6 MiB more, and the quota's 16 MiB is the
            // bound now.
            memory.begin_run();
            let c = bytes(6 * MIB);
            assert!(Tensor::f_zeros([5 << 20], (Kind::Uint8, Device::Cpu)).is_err(), "over the quota");
            drop(c);
            (a, b)
        });
        assert_eq!(memory.live(), 6 * MIB, "what the job freed is credited");
        let _ = bytes(32 * MIB); // outside the job: not counted, not bounded
        drop(outside);
        assert_eq!(memory.live(), 6 * MIB);
        std::thread::spawn(move || drop(elsewhere)).join().unwrap();
        assert_eq!(memory.live(), 3 * MIB, "freed on another thread, credited to the account");
        drop(memory);
        assert_eq!(budget.used_by(tenant), 0, "the quota comes back when the job ends");
        drop(kept); // the account outlives its job while memory it paid for does
    }
}
