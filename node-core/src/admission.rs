//! Each tenant's request quotas on a node: requests being worked on at once, and the request
//! rate (a token bucket). Bookkeeping only, kept by the core on the poller's thread; the
//! caller passes the time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use djinn_auth::{Authenticator, Quota, TenantId};

use djinn_proto::{ErrorCode, Refusal};

#[derive(Debug)]
pub struct Admission {
    auth: Arc<Authenticator>,
    tenants: HashMap<TenantId, Gate>,
}

#[derive(Debug)]
struct Gate {
    quota: Quota,
    /// The token file's generation `quota` was read from.
    generation: u64,
    /// Requests handed to other threads and not answered yet.
    in_flight: u32,
    /// Requests the rate's bucket still lets through at once (full to begin with).
    tokens: f64,
    refilled: Instant,
}

impl Admission {
    pub fn new(auth: Arc<Authenticator>) -> Self {
        Self { auth, tenants: HashMap::new() }
    }

    fn gate(&mut self, tenant: TenantId, now: Instant) -> &mut Gate {
        let generation = self.auth.generation();
        let gate = self.tenants.entry(tenant).or_insert_with(|| Gate {
            quota: self.auth.quota(tenant),
            generation,
            in_flight: 0,
            tokens: f64::INFINITY,
            refilled: now,
        });
        if gate.generation != generation {
            gate.quota = self.auth.quota(tenant);
            gate.generation = generation;
        }
        gate
    }

    /// Lets one request of `tenant` in, or says which quota it is over.
    pub fn admit(&mut self, tenant: TenantId, now: Instant) -> Result<(), Refusal> {
        let gate = self.gate(tenant, now);
        if let Some(limit) = gate.quota.concurrent_requests
            && gate.in_flight >= limit
        {
            return Err(over(format!("{limit} requests are already being worked on (the tenant's quota)")));
        }
        if let Some(rate) = gate.quota.requests_per_second {
            let burst = gate.quota.burst.map_or(rate.ceil().max(1.0), f64::from);
            let elapsed = now.saturating_duration_since(gate.refilled).as_secs_f64();
            gate.tokens = (gate.tokens + elapsed * rate).min(burst);
            gate.refilled = now;
            if gate.tokens < 1.0 {
                return Err(over(format!("over the tenant's rate of {rate} requests per second")));
            }
            gate.tokens -= 1.0;
        }
        Ok(())
    }

    /// A request of `tenant` went to another thread.
    pub fn started(&mut self, tenant: TenantId) {
        if let Some(gate) = self.tenants.get_mut(&tenant) {
            gate.in_flight += 1;
        }
    }

    /// A request that `started` is answered.
    pub fn finished(&mut self, tenant: TenantId) {
        if let Some(gate) = self.tenants.get_mut(&tenant) {
            gate.in_flight = gate.in_flight.saturating_sub(1);
        }
    }
}

fn over(message: String) -> Refusal {
    Refusal { code: ErrorCode::QuotaExceeded, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn admission(quota: &str) -> (tempfile::NamedTempFile, Admission, TenantId) {
        let f = tempfile::NamedTempFile::new().unwrap();
        let json = format!(r#"{{"principals": [{{"name": "a", "tokens": ["a-secret-00000001"], "quota": {quota}}}]}}"#);
        std::fs::write(f.path(), json).unwrap();
        let auth = Authenticator::load(f.path()).unwrap();
        let tenant = auth.verify("a-secret-00000001").unwrap().tenant;
        (f, Admission::new(auth), tenant)
    }

    #[test]
    fn the_rate_is_a_token_bucket() {
        let (_f, mut gates, t) = admission(r#"{"requests_per_second": 10, "burst": 3}"#);
        let start = Instant::now();
        for _ in 0..3 {
            gates.admit(t, start).unwrap();
        }
        let e = gates.admit(t, start).unwrap_err();
        assert_eq!(e.code, ErrorCode::QuotaExceeded);
        // 100 ms bring one request back, and a long quiet spell no more than the burst.
        gates.admit(t, start + Duration::from_millis(100)).unwrap();
        assert!(gates.admit(t, start + Duration::from_millis(100)).is_err());
        let later = start + Duration::from_secs(60);
        for _ in 0..3 {
            gates.admit(t, later).unwrap();
        }
        assert!(gates.admit(t, later).is_err());
    }

    #[test]
    fn requests_at_once_are_bounded_until_answered() {
        let (_f, mut gates, t) = admission(r#"{"concurrent_requests": 2}"#);
        let now = Instant::now();
        for _ in 0..2 {
            gates.admit(t, now).unwrap();
            gates.started(t);
        }
        assert_eq!(gates.admit(t, now).unwrap_err().code, ErrorCode::QuotaExceeded);
        gates.finished(t);
        gates.admit(t, now).unwrap();
    }

    #[test]
    fn no_quota_admits_everything_and_a_reload_applies() {
        let (f, mut gates, t) = admission("{}");
        let now = Instant::now();
        for _ in 0..10_000 {
            gates.admit(t, now).unwrap();
        }
        let json =
            r#"{"principals": [{"name": "a", "tokens": ["a-secret-00000001"], "quota": {"requests_per_second": 1}}]}"#;
        std::fs::write(f.path(), json).unwrap();
        assert!(gates.auth.reload().unwrap());
        gates.admit(t, now).unwrap();
        assert!(gates.admit(t, now).is_err());
    }
}
