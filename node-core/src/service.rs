//! What a transport hands requests to.

use std::time::Instant;

use djinn_auth::TenantId;
use djinn_proto::{Frame, Message, Payload, Refusal};

use crate::{Replier, Reply, ReplyTo};

/// What a node does with requests. Called on the poller thread: it must not block.
pub trait Service {
    /// Memory for the payload of `tenant`'s `message` (`len` bytes), or why it is refused.
    /// Called before any payload byte is read, so a refused request costs no allocation.
    fn alloc(&mut self, message: &Message, len: usize, tenant: TenantId) -> Result<Payload, Refusal>;
    /// Answers a request that is not one of the data plane's own (hello, ping, stats), now
    /// (`Some`) or later from another thread through `replier` (`None`).
    fn handle(&mut self, frame: Frame, to: ReplyTo, replier: &Replier) -> Option<Reply>;
    /// Appends the service's counters to a stats reply.
    fn stats(&self, out: &mut Vec<(String, u64)>);
    /// A connection closed: whatever the service kept for it (an upload) can go.
    fn on_disconnect(&mut self, _connection: u64) {}
    /// Called on the poller's timeout tick (a few times a second at most, while connections
    /// are open): what the service keeps past its time (an upload gone quiet) can go.
    fn expire(&mut self, _now: Instant) {}
}
