//! Djinn's control plane.
//!
//! The core has no I/O in it: membership (the live nodes and what they reported), placement (a
//! cost model, four policies, and the rules that come before them: sessions stay where they
//! started, identical weights are shared, a model too large for every node goes where it
//! streams least) and the cluster state decisions read. Time is an argument there, never read
//! from a clock.
//!
//! Around it: the metadata store (a key-value store with leases: embedded redb or etcd), the
//! service that keeps the cluster state in step with the store, and the HTTP/JSON API.

pub mod cluster;
pub mod http;
pub mod membership;
pub mod placement;
pub mod principals;
pub mod service;
pub mod store;

pub use cluster::{Cluster, Decision, PlaceError, PlaceRequest, Rule};
pub use membership::{Inventory, LeaseId, Member, Membership, MembershipError, NodeId};
pub use placement::{Block, Bound, Cost, Demand, Fit, Phase, Policy, SessionMove};
pub use service::{
    ClusterStatus, ControlConfig, ControlError, ControlPlane, DrainStatus, GraphAnnotations, GraphPhase, Modality,
    ModelRecord, Placement, Registered, Renewed,
};
