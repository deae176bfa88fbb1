//! Which nodes are alive: each registers with its inventory and holds a lease it must renew
//! before it lapses. No clock in here: every call takes the time (milliseconds on one
//! monotonic clock), so tests and several control processes drive it as they need.

use std::collections::HashMap;

/// A node's name, chosen by the node (its host name by default); unique in the cluster.
pub type NodeId = String;

/// What a node tells the control plane about itself, at registration and with every renewal.
#[derive(Debug, Clone, PartialEq)]
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
    /// Bandwidth between clients and the node, bytes per second.
    pub link_bandwidth: f64,
    /// `rdma`, `tcp`.
    pub transports: Vec<String>,
    /// Requests queued or running.
    pub queue_depth: u32,
    /// What an hour of the node costs, in any one currency the cluster agrees on.
    pub cost_per_hour: f64,
    /// Fingerprints (hex) of the models it holds.
    pub models: Vec<String>,
}

/// A lease's number; a renewal must name the node's current one.
pub type LeaseId = u64;

#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub inventory: Inventory,
    pub lease: LeaseId,
    /// When the lease lapses unless renewed.
    pub expires_at: u64,
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

/// The live nodes and their leases.
#[derive(Debug, Clone)]
pub struct Membership {
    members: HashMap<NodeId, Member>,
    ttl_ms: u64,
    next_lease: LeaseId,
}

impl Membership {
    /// Leases last `ttl_ms` from each registration or renewal.
    pub fn new(ttl_ms: u64) -> Self {
        Self { members: HashMap::new(), ttl_ms, next_lease: 1 }
    }

    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// Admits `node`. A node whose earlier lease is still live is refused: two processes
    /// claiming one name is a configuration error, and a restarted node waits out its lease.
    pub fn register(&mut self, node: &str, inventory: Inventory, now: u64) -> Result<LeaseId, MembershipError> {
        if self.members.get(node).is_some_and(|m| m.expires_at > now) {
            return Err(MembershipError::AlreadyRegistered(node.to_owned()));
        }
        let lease = self.next_lease;
        self.next_lease += 1;
        self.members.insert(node.to_owned(), Member { inventory, lease, expires_at: now + self.ttl_ms });
        Ok(lease)
    }

    /// Extends `node`'s lease and, if given, replaces its inventory.
    pub fn renew(
        &mut self,
        node: &str,
        lease: LeaseId,
        inventory: Option<Inventory>,
        now: u64,
    ) -> Result<(), MembershipError> {
        let member = self
            .members
            .get_mut(node)
            .filter(|m| m.expires_at > now)
            .ok_or_else(|| MembershipError::UnknownNode(node.to_owned()))?;
        if member.lease != lease {
            return Err(MembershipError::StaleLease { node: node.to_owned(), given: lease, current: member.lease });
        }
        member.expires_at = now + self.ttl_ms;
        if let Some(inventory) = inventory {
            member.inventory = inventory;
        }
        Ok(())
    }

    /// Removes the nodes whose leases have lapsed by `now`, and names them.
    pub fn expire(&mut self, now: u64) -> Vec<NodeId> {
        let lapsed: Vec<NodeId> =
            self.members.iter().filter(|(_, m)| m.expires_at <= now).map(|(n, _)| n.clone()).collect();
        for node in &lapsed {
            self.members.remove(node);
        }
        lapsed
    }

    /// A live node.
    pub fn get(&self, node: &str, now: u64) -> Option<&Member> {
        self.members.get(node).filter(|m| m.expires_at > now)
    }

    /// The live nodes, in no particular order.
    pub fn live(&self, now: u64) -> impl Iterator<Item = (&NodeId, &Member)> {
        self.members.iter().filter(move |(_, m)| m.expires_at > now)
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
            link_bandwidth: 25e9,
            transports: vec!["tcp".into()],
            queue_depth: 0,
            cost_per_hour: 1.0,
            models: Vec::new(),
        }
    }

    #[test]
    fn a_lease_lapses_unless_renewed() {
        let mut m = Membership::new(1000);
        let lease = m.register("a", inventory("a:1"), 0).unwrap();
        m.renew("a", lease, None, 900).unwrap();
        assert!(m.expire(1899).is_empty());
        assert_eq!(m.expire(1900), vec!["a".to_string()]);
        assert_eq!(m.renew("a", lease, None, 1901), Err(MembershipError::UnknownNode("a".into())));
    }

    #[test]
    fn a_second_registration_while_live_is_refused_and_a_stale_lease_too() {
        let mut m = Membership::new(1000);
        let first = m.register("a", inventory("a:1"), 0).unwrap();
        assert_eq!(m.register("a", inventory("a:2"), 500), Err(MembershipError::AlreadyRegistered("a".into())));
        // After the lease lapses the name is free again, with a new lease.
        let second = m.register("a", inventory("a:2"), 1000).unwrap();
        assert_ne!(first, second);
        assert!(matches!(m.renew("a", first, None, 1100), Err(MembershipError::StaleLease { .. })));
        assert_eq!(m.get("a", 1100).map(|n| n.inventory.addr.as_str()), Some("a:2"));
    }
}
