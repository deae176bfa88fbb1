//! What a graph run will take, known before it runs, and what it is charged for it.
//!
//! graph/plan.rs runs a graph's operators over meta tensors (sizes, strides and dtypes, no memory)
//! at a call's input shapes: that gives each operator's shapes, from which [`flops_of`] counts
//! its floating-point operations, and the storages each step creates and frees, from which the
//! most bytes the run's intermediates and outputs hold at once. A worker sets the [`Account`]
//! of the job it runs ([`within`]); each graph run of that job calls [`admit`] with its
//! [`Estimate`] first, which refuses it over the node's bound per run, charges the peak to the
//! tenant's device-memory quota until the run ends, and takes the operations from the tenant's
//! compute bucket ([`ComputeMeter`]). No I/O here; the meter is given the time.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use djinn_auth::TenantId;
use djinn_memory::{Charge, MemoryBudget};

use crate::error::ExecError;
use djinn_sync::Locked;

/// A graph run's cost at one call's shapes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Estimate {
    /// Floating-point operations (multiply-adds count two; other operators one per element).
    pub flops: u64,
    /// The most bytes of new storage (intermediates and outputs, not inputs or weights) held at
    /// once, each value freed after the last operator that reads it.
    pub peak_bytes: u64,
    /// The operator where the plan stopped, when an output's size depends on the data (as
    /// `nonzero`'s) or libtorch has no meta kernel for it: what follows is bounded as it runs
    /// (its memory by the node's allocator, its operations charged to the compute quota after
    /// each operator, its time by `--execute-deadline` between operators).
    pub stopped_at: Option<String>,
    /// The steps the plan reached (all of them unless it stopped).
    pub planned_steps: usize,
    /// Steps of at least [`LONG_STEP`] operations, with their operations, in order: each is
    /// held to what is left of the run's deadline before it runs.
    pub long_steps: Vec<(usize, u64)>,
}

/// Operations past which a step is weighed against the deadline before it runs (a few
/// milliseconds at a CPU's rate; below it the check between operators is soon enough).
pub const LONG_STEP: u64 = 1 << 24;

/// Operators whose cost is that of a product of matrices: which input is the left operand
/// (its last dimension is the one summed over).
fn left_operand(op: &str) -> Option<usize> {
    Some(match op {
        "aten::mm" | "aten::mm.dtype" | "aten::bmm" | "aten::bmm.dtype" | "aten::matmul" | "aten::linear" => 0,
        "aten::addmm" | "aten::addmm.dtype" | "aten::baddbmm" | "aten::baddbmm.dtype" | "aten::addbmm" => 1,
        _ => return None,
    })
}

fn numel(shape: &[i64]) -> u64 {
    shape.iter().fold(1u64, |n, &d| n.saturating_mul(d.max(0) as u64))
}

/// Floating-point operations of operator `op` (qualified, `aten::addmm`) from its tensor
/// inputs' and outputs' shapes, in schema order. Products of matrices and convolutions count
/// two per multiply-add, attention its two products; `aliases`: the outputs are views of the
/// inputs (a reshape, a slice), which compute nothing; any other operator counts one per
/// element of the larger of what it reads and what it writes (a reduction reads more than it
/// writes, a broadcast writes more than it reads).
pub fn flops_of(op: &str, inputs: &[&[i64]], outputs: &[&[i64]], aliases: bool) -> u64 {
    let out = outputs.first().copied().unwrap_or(&[]);
    if let Some(left) = left_operand(op) {
        let summed = inputs.get(left).and_then(|a| a.last()).copied().unwrap_or(1).max(0) as u64;
        // addmm's and baddbmm's input, linear's bias: an addition per output.
        let bias = if left == 1 || (op == "aten::linear" && inputs.len() == 3) { numel(out) } else { 0 };
        return numel(out).saturating_mul(summed).saturating_mul(2).saturating_add(bias);
    }
    if op.starts_with("aten::convolution") || op.starts_with("aten::_convolution") || op.starts_with("aten::conv") {
        // weight: [out channels, in channels / groups, kernel...]
        let per_output = inputs.get(1).map_or(1, |w| numel(w.get(1..).unwrap_or(&[])));
        return numel(out).saturating_mul(per_output).saturating_mul(2);
    }
    if op.contains("scaled_dot_product") {
        // query [.., L, E], key [.., S, E], value [.., S, Ev]: QKᵀ and its product with V.
        let (Some(q), Some(k), Some(v)) = (inputs.first(), inputs.get(1), inputs.get(2)) else { return numel(out) };
        let dim = |t: &[i64], from_end: usize| t.len().checked_sub(from_end).map_or(1, |i| t[i].max(0) as u64);
        let scores = numel(q.get(..q.len().saturating_sub(1)).unwrap_or(&[])).saturating_mul(dim(k, 2));
        return scores.saturating_mul(2).saturating_mul(dim(q, 1).saturating_add(dim(v, 1)));
    }
    let base = op.split_once('.').map_or(op, |(b, _)| b);
    let first = inputs.first().copied().unwrap_or(&[]);
    let last_dim = |t: &[i64]| t.last().copied().unwrap_or(1).max(0) as u64;
    // n·log2(n) for a sort along the last dimension of n, and FFTs (five per element per step).
    let log_n = |t: &[i64]| u64::from(64 - last_dim(t).leading_zeros()).max(1);
    match base {
        // A distance per output, each over the points' dimensions (a difference, a power, a sum).
        "aten::_cdist_forward" | "aten::_pdist_forward" => {
            return numel(out).saturating_mul(last_dim(first)).saturating_mul(3);
        }
        "aten::sort" | "aten::topk" => return numel(first).saturating_mul(log_n(first)),
        "aten::_fft_r2c" | "aten::_fft_c2r" => return numel(first).max(numel(out)).saturating_mul(5 * log_n(first)),
        // Each element against each test element, at worst.
        "aten::isin" => return inputs.iter().map(|s| numel(s).max(1)).fold(1u64, u64::saturating_mul),
        _ => {}
    }
    if aliases && !op.ends_with('_') {
        return 0;
    }
    let written = outputs.iter().map(|s| numel(s)).fold(0u64, u64::saturating_add);
    let read = inputs.iter().map(|s| numel(s)).fold(0u64, u64::saturating_add);
    written.max(read)
}

/// Operations of a pooling operator: each output reads a window of `window` elements.
pub fn pooled_flops(outputs: &[&[i64]], window: u64) -> u64 {
    numel(outputs.first().copied().unwrap_or(&[])).saturating_mul(window.max(1))
}

/// A tenant's compute quota: operations per second and the bucket's size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ComputeQuota {
    pub flops_per_second: f64,
    pub burst: f64,
}

impl ComputeQuota {
    /// From a tenant's quota: none without `flops_per_second`; the burst one second's worth
    /// unless given.
    pub fn of(quota: &djinn_auth::Quota) -> Option<Self> {
        let rate = quota.flops_per_second?;
        Some(Self { flops_per_second: rate, burst: quota.flops_burst.unwrap_or(rate) })
    }
}

type QuotaOf = Arc<dyn Fn(TenantId) -> Option<ComputeQuota> + Send + Sync>;

/// Each tenant's compute bucket: full to begin with, refilled at its rate up to its burst; a
/// run takes its operations from it or is refused.
pub struct ComputeMeter {
    quota: QuotaOf,
    buckets: Mutex<HashMap<TenantId, Bucket>>,
}

#[derive(Debug)]
struct Bucket {
    flops: f64,
    refilled: Instant,
}

impl std::fmt::Debug for ComputeMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputeMeter").finish_non_exhaustive()
    }
}

impl ComputeMeter {
    pub fn new(quota: impl Fn(TenantId) -> Option<ComputeQuota> + Send + Sync + 'static) -> Self {
        Self { quota: Arc::new(quota), buckets: Mutex::default() }
    }

    /// No tenant has a compute quota.
    pub fn unbounded() -> Self {
        Self::new(|_| None)
    }

    /// Takes `flops` from `tenant`'s bucket at `now`, or says why not (and takes nothing).
    pub fn charge(&self, tenant: TenantId, flops: u64, now: Instant) -> Result<(), ExecError> {
        let Some(quota) = (self.quota)(tenant) else { return Ok(()) };
        let cost = flops as f64;
        if cost > quota.burst {
            return Err(ExecError::ComputeQuota(format!(
                "the run costs {flops} floating-point operations, more than the tenant's compute burst of {:.0}: \
                 it can never run under this quota",
                quota.burst
            )));
        }
        let mut buckets = self.buckets.locked();
        let bucket = buckets.entry(tenant).or_insert(Bucket { flops: quota.burst, refilled: now });
        let elapsed = now.saturating_duration_since(bucket.refilled).as_secs_f64();
        bucket.flops = (bucket.flops + elapsed * quota.flops_per_second).min(quota.burst);
        bucket.refilled = now.max(bucket.refilled);
        if bucket.flops < cost {
            let wait = (cost - bucket.flops) / quota.flops_per_second;
            return Err(ExecError::ComputeQuota(format!(
                "over the tenant's compute rate of {:.3e} floating-point operations per second: the run costs \
                 {flops}, {:.0} are left; enough in {wait:.3} s",
                quota.flops_per_second, bucket.flops
            )));
        }
        bucket.flops -= cost;
        Ok(())
    }
}

/// What the node's stats count of graph runs' plans.
#[derive(Debug, Default)]
pub struct CostCounters {
    /// Operations of every run admitted.
    pub planned_flops: AtomicU64,
    /// The largest peak of any run admitted.
    pub largest_peak_bytes: AtomicU64,
    /// Runs whose plan stopped before their end (see [`Estimate::stopped_at`]).
    pub partly_planned: AtomicU64,
    /// Runs refused for their plan: over the node's bound per run, a memory quota or a
    /// compute quota.
    pub refused: AtomicU64,
    /// Jobs ended by an allocation the node's allocator refused (see `allocator.rs`).
    pub allocations_refused: AtomicU64,
}

/// What bounds one execution (an execute, a session step, a resume): its time, and for each
/// of its graph runs the node's bound per run, the budget whose tenants' quotas the run's peak
/// is charged to, the compute meter; and the counters of plans.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The longest an execution may run (see `deadline.rs`); `None`: no limit.
    pub deadline: Option<std::time::Duration>,
    /// The most bytes one run may plan to hold at once.
    pub max_run_bytes: u64,
    pub budget: MemoryBudget,
    pub meter: Arc<ComputeMeter>,
    pub counters: Arc<CostCounters>,
    /// The node's rate of floating-point operations (measured at start-up, or `--flops`): a
    /// step planned to take longer than what is left of the deadline at it is refused.
    pub flops_per_second: Option<f64>,
}

/// The account of the job a worker runs: whose quotas its graph runs are charged to.
#[derive(Debug)]
pub(crate) struct Account {
    pub tenant: TenantId,
    pub limits: Limits,
    /// On a CPU node, the job's allocations as the node's allocator counts them: the bound
    /// that holds whatever the plan saw, and the tenant's quota charged by it.
    pub memory: Option<crate::allocator::JobMemory>,
}

thread_local! {
    static ACCOUNT: RefCell<Option<Rc<Account>>> = const { RefCell::new(None) };
}

/// Runs `f` with `account` as this thread's account (none for `None`: runs are not planned).
pub(crate) fn within<T>(account: Option<Rc<Account>>, f: impl FnOnce() -> T) -> T {
    /// Puts the account before back, however `f` ends (a panic is caught by the worker).
    struct Restore(Option<Rc<Account>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ACCOUNT.set(self.0.take());
        }
    }
    let _restore = Restore(ACCOUNT.replace(account));
    f()
}

/// Whether this thread's runs are charged (and so need a plan).
pub(crate) fn charged() -> bool {
    ACCOUNT.with_borrow(Option::is_some)
}

/// Refuses step `op`, planned at `flops` operations, where at the node's rate it would run past
/// what is left of this thread's deadline.
pub(crate) fn fits_deadline(op: &str, flops: u64) -> Result<(), ExecError> {
    let rate = ACCOUNT.with_borrow(|a| a.as_ref().and_then(|a| a.limits.flops_per_second.filter(|r| *r > 0.0)));
    let (Some(rate), Some((left, limit))) = (rate, crate::deadline::left()) else { return Ok(()) };
    let seconds = flops as f64 / rate;
    if seconds > left.as_secs_f64() {
        return Err(ExecError::WouldOverrun { op: op.to_owned(), flops, seconds, left, limit });
    }
    Ok(())
}

/// Charges `flops` of a step past where the run's plan stopped to the tenant's compute bucket,
/// after the step ran: a tenant's unplanned tail is metered as it goes, and ended at the first
/// step the bucket cannot pay for.
pub(crate) fn charge_unplanned(flops: u64) -> Result<(), ExecError> {
    let Some(account) = ACCOUNT.with_borrow(Option::clone) else { return Ok(()) };
    account.limits.counters.planned_flops.fetch_add(flops, Ordering::Relaxed);
    account.limits.meter.charge(account.tenant, flops, Instant::now()).inspect_err(|_| {
        account.limits.counters.refused.fetch_add(1, Ordering::Relaxed);
    })
}

/// Admits a run planned as `estimate` on this thread's account: refused over the node's bound
/// per run, over the tenant's memory quota or its compute bucket (which it then does not
/// touch). The returned charge holds the peak against the tenant's quota until the run ends.
pub(crate) fn admit(estimate: &Estimate) -> Result<Option<Charge>, ExecError> {
    let Some(account) = ACCOUNT.with_borrow(Option::clone) else { return Ok(None) };
    let limits = &account.limits;
    let refused = |e: ExecError| {
        limits.counters.refused.fetch_add(1, Ordering::Relaxed);
        e
    };
    if estimate.peak_bytes > limits.max_run_bytes {
        return Err(refused(ExecError::RunTooLarge { planned: estimate.peak_bytes, limit: limits.max_run_bytes }));
    }
    let charge = match limits.budget.quota(account.tenant) {
        Some(_) => Some(
            limits
                .budget
                .charge(account.tenant, estimate.peak_bytes)
                .map_err(|e| refused(ExecError::RunOverQuota { planned: estimate.peak_bytes, quota: e }))?,
        ),
        None => None,
    };
    // Where the allocator counts the job's memory, it charges the quota as the run allocates:
    // the plan's charge only checks that the run fits, and a new bound on the run begins.
    let charge = match &account.memory {
        Some(memory) => {
            memory.begin_run();
            None
        }
        None => charge,
    };
    limits.meter.charge(account.tenant, estimate.flops, Instant::now()).map_err(refused)?;
    let counters = &limits.counters;
    counters.planned_flops.fetch_add(estimate.flops, Ordering::Relaxed);
    counters.largest_peak_bytes.fetch_max(estimate.peak_bytes, Ordering::Relaxed);
    if let Some(op) = &estimate.stopped_at {
        counters.partly_planned.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(operator = %op, "a run planned up to an operator whose output size depends on its data");
    }
    Ok(charge)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn products_and_convolutions_count_their_multiply_adds() {
        // [8, 256] @ [256, 1024] + bias: 2·8·1024·256 and the bias's 8·1024 additions.
        assert_eq!(flops_of("aten::addmm", &[&[1024], &[8, 256], &[256, 1024]], &[&[8, 1024]], false), 4_202_496);
        assert_eq!(flops_of("aten::mm", &[&[8, 256], &[256, 1024]], &[&[8, 1024]], false), 4_194_304);
        assert_eq!(flops_of("aten::bmm", &[&[4, 8, 16], &[4, 16, 32]], &[&[4, 8, 32]], false), 2 * 4 * 8 * 32 * 16);
        // 3×3 convolution, 64 → 128 channels in 2 groups, on a 2×128×10×10 output.
        let w: &[i64] = &[128, 32, 3, 3];
        assert_eq!(
            flops_of("aten::convolution", &[&[2, 64, 12, 12], w], &[&[2, 128, 10, 10]], false),
            2 * (2 * 128 * 10 * 10) * (32 * 9)
        );
        // Attention over 2 heads, 5 queries, 7 keys, 16 wide: QKᵀ and the product with V.
        let (q, kv): (&[i64], &[i64]) = (&[1, 2, 5, 16], &[1, 2, 7, 16]);
        assert_eq!(
            flops_of("aten::_scaled_dot_product_flash_attention_for_cpu", &[q, kv, kv], &[q], false),
            2 * 2 * 5 * 7 * (16 + 16)
        );
    }

    #[test]
    fn other_operators_count_elements_and_views_nothing() {
        assert_eq!(flops_of("aten::relu", &[&[4, 1024]], &[&[4, 1024]], false), 4096);
        assert_eq!(flops_of("aten::sum.dim_IntList", &[&[4, 1024]], &[&[4]], false), 4096, "a reduction reads");
        assert_eq!(flops_of("aten::add.Tensor", &[&[4, 1], &[1, 5]], &[&[4, 5]], false), 20, "a broadcast writes");
        assert_eq!(flops_of("aten::view", &[&[4, 1024]], &[&[4096]], true), 0);
        assert_eq!(flops_of("aten::expand", &[&[1]], &[&[1 << 40]], true), 0, "an expanded view computes nothing");
        assert_eq!(flops_of("aten::copy_", &[&[8], &[8]], &[&[8]], true), 16, "in place is work");
        assert_eq!(flops_of("aten::mm", &[&[i64::MAX, 2], &[2, i64::MAX]], &[&[i64::MAX, i64::MAX]], false), u64::MAX);
        assert_eq!(flops_of("aten::relu", &[&[-3, 4]], &[&[-3, 4]], false), 0);
    }

    #[test]
    fn distances_sorts_transforms_and_windows_count_what_they_read_per_output() {
        // 100 × 200 distances over 64 dimensions: a difference, a power and a sum each.
        assert_eq!(
            flops_of("aten::_cdist_forward", &[&[100, 64], &[200, 64]], &[&[100, 200]], false),
            3 * 100 * 200 * 64
        );
        assert_eq!(flops_of("aten::sort", &[&[8, 1024]], &[&[8, 1024], &[8, 1024]], false), 8 * 1024 * 11);
        assert_eq!(flops_of("aten::topk", &[&[1000]], &[&[5], &[5]], false), 1000 * 10);
        assert_eq!(flops_of("aten::_fft_r2c", &[&[4, 256]], &[&[4, 129]], false), 4 * 256 * 5 * 9);
        assert_eq!(flops_of("aten::isin.Tensor_Tensor", &[&[1000], &[500]], &[&[1000]], false), 500_000);
        // A 1,000 × 1,000 window over a 2,048² image, stride 1: a window per output.
        assert_eq!(pooled_flops(&[&[1, 1, 1049, 1049]], 1_000_000), 1049 * 1049 * 1_000_000);
    }

    fn meter(rate: f64, burst: f64) -> (ComputeMeter, TenantId, TenantId) {
        let (limited, free) = (TenantId(1), TenantId(2));
        let meter =
            ComputeMeter::new(move |t| (t == limited).then_some(ComputeQuota { flops_per_second: rate, burst }));
        (meter, limited, free)
    }

    #[test]
    fn a_tenants_bucket_empties_refills_at_its_rate_and_bounds_one_run() {
        let (meter, limited, free) = meter(1000.0, 3000.0);
        let t0 = Instant::now();
        meter.charge(limited, 2000, t0).unwrap();
        meter.charge(limited, 1000, t0).unwrap();
        let e = meter.charge(limited, 500, t0).unwrap_err();
        assert!(e.to_string().contains("enough in 0.500 s"), "{e}");
        assert_eq!(e.code(), djinn_proto::ErrorCode::QuotaExceeded);
        assert!(meter.charge(limited, 500, t0 + Duration::from_millis(499)).is_err(), "not refilled yet");
        meter.charge(limited, 500, t0 + Duration::from_millis(500)).unwrap();
        // A quiet spell refills no more than the burst.
        let later = t0 + Duration::from_secs(3600);
        meter.charge(limited, 3000, later).unwrap();
        assert!(meter.charge(limited, 1, later).is_err());
        let e = meter.charge(limited, 3001, later + Duration::from_secs(3600)).unwrap_err();
        assert!(e.to_string().contains("can never run"), "{e}");
        meter.charge(limited, 3000, later + Duration::from_secs(3600)).unwrap();
        // Another tenant is not metered; a clock read out of order refills nothing.
        meter.charge(free, u64::MAX, t0).unwrap();
        assert!(meter.charge(limited, 1, t0).is_err());
    }
}
