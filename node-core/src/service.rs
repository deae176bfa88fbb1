//! What a transport hands requests to.

use std::time::Instant;

use djinn_auth::TenantId;
use djinn_proto::{Frame, Message, Payload, Refusal};

use crate::{Delivery, Executed, Replier, Reply, ReplyTo};

/// What a node does with requests: the transport moves bytes, keeps connections and says who
/// is on each; the service decides what each may do and answers. Called on the poller thread:
/// it must not block. The transport passes the time (`now`); the service reads no clock for
/// what it decides.
pub trait Service {
    /// Memory for the payload of `tenant`'s `message` (`len` bytes), or why it is refused.
    /// Called before any payload byte is read, so a refused request costs no allocation.
    fn alloc(&mut self, message: &Message, len: usize, tenant: TenantId) -> Result<Payload, Refusal>;
    /// Answers a request that is not one of the data plane's own (hello, ping, stats), now
    /// (`Some`) or later from another thread through `replier` (`None`).
    fn handle(&mut self, frame: Frame, to: ReplyTo, replier: &Replier, now: Instant) -> Option<Reply>;
    /// Completes an answer sent through `replier` as [`crate::Answer::Executed`] for the
    /// request `to`: the reply to send, or `None` while the request goes on (answered later).
    fn complete(&mut self, _to: ReplyTo, answer: Executed, _replier: &Replier, _now: Instant) -> Option<Reply> {
        Some(answer.reply)
    }
    /// Answers a stats request: `counters` (the transport's own) with the service's after them,
    /// now (`Some`) or later through `replier` (`None`).
    fn stats(&mut self, counters: Vec<(String, u64)>, to: ReplyTo, replier: &Replier) -> Option<Reply>;
    /// Lets one request of `tenant` in at `now`, or says which of the tenant's quotas it is
    /// over. A request admitted and answered later is [`Self::started`] when it is handed on and
    /// [`Self::finished`] when its answer comes back. No quotas: everything is let in.
    fn admit(&mut self, _tenant: TenantId, _now: Instant) -> Result<(), Refusal> {
        Ok(())
    }
    fn started(&mut self, _tenant: TenantId) {}
    fn finished(&mut self, _tenant: TenantId) {}
    /// Takes the push grant `secret` presented for the tenant named `name`, when it is one and
    /// unexpired at `now`: the tenant, and the one delivery it lets the connection make.
    fn redeem(&mut self, _secret: &str, _name: &str, _now: Instant) -> Option<(TenantId, Delivery)> {
        None
    }
    /// A connection closed: whatever the service kept for it (an upload) can go.
    fn on_disconnect(&mut self, _connection: u64) {}
    /// Called on the poller's timeout tick (a few times a second at most, while connections
    /// are open) and by [`Self::next_expiry`]: what the service keeps past its time (an upload
    /// gone quiet, a kept tensor unused) can go, and what waited for it may be handed on
    /// (answered through `replier`).
    fn expire(&mut self, _now: Instant, _replier: &Replier) {}
    /// When the service next has something to expire, connections open or not.
    fn next_expiry(&self) -> Option<Instant> {
        None
    }
}
