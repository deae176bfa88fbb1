//! Djinn's control plane, as a core with no I/O in it: membership (nodes and their leases)
//! and placement (a cost model, four policies, and the rules that come before them: sessions
//! stay where they started, identical weights are shared, a model too large for every node goes
//! where it streams least). Time is an argument, never read from a clock.

pub mod cluster;
pub mod membership;
pub mod placement;

pub use cluster::{Cluster, Decision, PlaceError, PlaceRequest, Rule};
pub use membership::{Inventory, LeaseId, Member, Membership, MembershipError, NodeId};
pub use placement::{Block, Cost, Demand, Fit, Policy};
