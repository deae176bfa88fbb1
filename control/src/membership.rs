//! Which nodes are alive, and what each told the control plane about itself. Liveness is the
//! metadata store's: a node's record is bound to a lease it renews, and the record goes when
//! the lease lapses; this is the in-memory view of those records.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// A node's name, chosen by the node (its host name by default); unique in the cluster.
pub type NodeId = String;

/// What a node tells the control plane about itself, at registration and with every renewal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inventory {
    /// Where clients reach its data plane.
    pub addr: String,
    /// The device models run on (`cuda:0`, `cpu`).
    pub device: String,
    /// The node's device-memory budget, and how much of it is free.
    pub memory_total: u64,
    pub memory_free: u64,
    /// Host memory free for streamed weights.
    pub host_memory_free: u64,
    /// Host-to-device copy rate, bytes per second (what streaming runs at).
    pub host_to_device: f64,
    /// Sustained compute, FLOP per second.
    pub flops: f64,
    /// Device-memory read rate, bytes per second (what a decode step runs at).
    pub memory_bandwidth: f64,
    /// Bandwidth between clients and the node, bytes per second.
    pub link_bandwidth: f64,
    /// `rdma`, `tcp`.
    pub transports: Vec<String>,
    /// How device memory meets the network: `staging` (through host memory).
    #[serde(default)]
    pub memory_path: String,
    /// Requests queued or running.
    pub queue_depth: u32,
    /// What an hour of the node costs, in any one currency the cluster agrees on.
    pub cost_per_hour: f64,
    /// Fingerprints (hex) of the models it holds.
    pub models: Vec<String>,
    /// What a drain waits for: its open sessions, kept tensors and requests parked at
    /// breakpoints.
    #[serde(default)]
    pub sessions: u64,
    #[serde(default)]
    pub kept: u64,
    #[serde(default)]
    pub parked: u64,
    /// Moves of a drain whose destination the control plane has not recorded yet.
    #[serde(default)]
    pub unrecorded: u64,
    /// Where tenants' kernels run: `in the node`, or in executor processes and the layers of
    /// their sandbox every live one is in (`no-new-privs,netns,…`).
    #[serde(default)]
    pub sandbox: String,
}

/// A lease's number; a renewal must name the node's current one.
pub type LeaseId = u64;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub inventory: Inventory,
    pub lease: LeaseId,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    #[error("node {0:?} is already registered with a live lease")]
    AlreadyRegistered(NodeId),
    #[error("no node {0:?} is registered (its lease may have lapsed: register again)")]
    UnknownNode(NodeId),
    #[error("lease {given} of node {node:?} is stale: the current one is {current}")]
    StaleLease { node: NodeId, given: LeaseId, current: LeaseId },
}

/// The live nodes.
#[derive(Debug, Clone, Default)]
pub struct Membership {
    members: HashMap<NodeId, Member>,
}

impl Membership {
    /// Adds `node` or replaces its record; the record it replaces.
    pub fn insert(&mut self, node: &str, member: Member) -> Option<Member> {
        self.members.insert(node.to_owned(), member)
    }

    pub fn remove(&mut self, node: &str) -> Option<Member> {
        self.members.remove(node)
    }

    pub fn get(&self, node: &str) -> Option<&Member> {
        self.members.get(node)
    }

    /// The live nodes, in no particular order.
    pub fn live(&self) -> impl Iterator<Item = (&NodeId, &Member)> {
        self.members.iter()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn inventory(addr: &str) -> Inventory {
        Inventory {
            addr: addr.into(),
            device: "cuda:0".into(),
            memory_total: 80 << 30,
            memory_free: 80 << 30,
            host_memory_free: 512 << 30,
            host_to_device: 50e9,
            flops: 100e12,
            memory_bandwidth: 2e12,
            link_bandwidth: 25e9,
            transports: vec!["tcp".into()],
            memory_path: "staging".into(),
            queue_depth: 0,
            cost_per_hour: 1.0,
            models: Vec::new(),
            sessions: 0,
            kept: 0,
            parked: 0,
            unrecorded: 0,
            sandbox: String::new(),
        }
    }
}
