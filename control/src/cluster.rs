//! The control plane's state and its decisions: live nodes, which node holds (or was given)
//! each model, which node each session lives on, and placement by the rules in order:
//!
//! 1. a session's requests go to the node that first received it, while that node lives;
//! 2. a model some live node holds (or was given) goes there: identical weights are shared;
//! 3. a model that fits no node whole goes to the node that streams the fewest bytes per call;
//! 4. otherwise the policy's best node among those it fits whole.
//!
//! Memory promised by a placement counts against the node until its inventory shows the model
//! (or two leases pass), so placements made between two renewals do not all pick one node.
//!
//! The control process keeps this in step with the metadata store (nodes join and leave as
//! their records come and go; given models and sessions are records too); decisions read it
//! and touch nothing but the promised memory.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use crate::membership::{Inventory, Member, Membership, NodeId};
use crate::placement::{Block, Cost, Demand, Fit, Phase, Policy, SessionMove, fit, score};

/// A request for a place to run a model.
#[derive(Debug, Clone, PartialEq)]
pub struct PlaceRequest {
    /// The model's fingerprint (hex).
    pub fingerprint: String,
    pub blocks: Vec<Block>,
    /// Bytes of one call's inputs and outputs.
    pub io_bytes: u64,
    pub phase: Option<Phase>,
    pub session: Option<String>,
    pub policy: Policy,
    /// A session that would move to the chosen node (its state's move is part of the cost).
    pub moving: Option<SessionMove>,
}

/// Which rule chose the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    Session,
    Shared,
    Streamed,
    Policy,
}

impl Rule {
    pub fn name(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Shared => "shared",
            Self::Streamed => "streamed",
            Self::Policy => "policy",
        }
    }
}

impl Serialize for Rule {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

/// The chosen node and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    pub node: NodeId,
    pub addr: String,
    pub rule: Rule,
    pub policy: Policy,
    pub fit: Fit,
    pub cost: Cost,
    /// The policy's score of the chosen node (lower is better) and of the best other one.
    pub score: f64,
    pub runner_up: Option<(NodeId, f64)>,
    /// Nodes that were candidates under the rule that decided.
    pub considered: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error("no live nodes")]
    NoNodes,
    #[error(
        "no node can hold the model: its largest block ({largest} bytes) needs more free device memory, or its {weights} bytes more host memory, than any node has"
    )]
    FitsNowhere { weights: u64, largest: u64 },
    #[error("a model needs at least one block")]
    NoBlocks,
}

/// Memory promised to a node by placements its inventory does not show yet.
#[derive(Debug, Clone, Default)]
struct Promised {
    /// Fingerprint → (bytes, when).
    models: HashMap<String, (u64, u64)>,
    total: u64,
}

impl Promised {
    fn add(&mut self, fingerprint: &str, bytes: u64, now: u64) {
        if let Some((old, _)) = self.models.insert(fingerprint.to_owned(), (bytes, now)) {
            self.total -= old;
        }
        self.total += bytes;
    }

    fn retain(&mut self, mut keep: impl FnMut(&String, u64) -> bool) {
        self.models.retain(|fp, &mut (_, at)| keep(fp, at));
        self.total = self.models.values().map(|(bytes, _)| bytes).sum();
    }
}

/// The best two entries by a key, lowest first.
struct Best<K, T> {
    first: Option<(K, T)>,
    second: Option<(K, T)>,
}

impl<K: PartialOrd, T> Best<K, T> {
    fn new() -> Self {
        Self { first: None, second: None }
    }

    fn offer(&mut self, key: K, item: T) {
        if self.first.as_ref().is_none_or(|(k, _)| key < *k) {
            self.second = self.first.replace((key, item));
        } else if self.second.as_ref().is_none_or(|(k, _)| key < *k) {
            self.second = Some((key, item));
        }
    }
}

#[derive(Debug, Clone)]
pub struct Cluster {
    membership: Membership,
    /// Model fingerprint → the nodes that hold it or were given it.
    holders: HashMap<String, HashSet<NodeId>>,
    promised: HashMap<NodeId, Promised>,
    sessions: HashMap<String, NodeId>,
    /// Nodes being drained: nothing new is placed on them.
    draining: HashSet<NodeId>,
    lease_ttl_ms: u64,
    /// When the oldest promise is two leases old (`u64::MAX` without promises).
    promises_expire_at: u64,
}

impl Cluster {
    /// `lease_ttl_ms`: how long nodes' leases last (a promise not shown in two leases is
    /// dropped).
    pub fn new(lease_ttl_ms: u64) -> Self {
        Self {
            membership: Membership::default(),
            holders: HashMap::new(),
            promised: HashMap::new(),
            sessions: HashMap::new(),
            draining: HashSet::new(),
            lease_ttl_ms,
            promises_expire_at: u64::MAX,
        }
    }

    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// A node's record, new or renewed, at time `now` (ms).
    pub fn join(&mut self, node: &str, member: Member, now: u64) {
        let models = member.inventory.models.clone();
        if let Some(old) = self.membership.insert(node, member.clone())
            && old.lease != member.lease
        {
            // What an earlier lease of the same name left behind is gone with that process.
            self.forget(node);
        }
        self.note_holdings(node, &models);
        // Shown in the inventory now: its memory is counted there.
        if let Some(promised) = self.promised.get_mut(node) {
            promised.retain(|fp, _| !models.contains(fp));
        }
        self.expire_promises(now);
    }

    /// Drops the promises two leases old: those models are not coming. Called at every change
    /// and decision, so an idle node's promises go too; it scans only once one may be due.
    pub fn expire_promises(&mut self, now: u64) {
        if now < self.promises_expire_at {
            return;
        }
        let age = 2 * self.lease_ttl_ms;
        let mut next = u64::MAX;
        for promised in self.promised.values_mut() {
            promised.retain(|_, at| now.saturating_sub(at) < age);
            next = promised.models.values().map(|&(_, at)| at + age).fold(next, u64::min);
        }
        self.promises_expire_at = next;
    }

    /// A node's lease lapsed or was revoked: it goes with its models and sessions.
    pub fn leave(&mut self, node: &str) {
        self.membership.remove(node);
        self.forget(node);
    }

    /// `node` was given the model (by this or another control process).
    pub fn give(&mut self, fingerprint: &str, node: &str) {
        self.note_holdings(node, &[fingerprint.to_owned()]);
    }

    pub fn set_session(&mut self, session: &str, node: &str) {
        self.sessions.insert(session.to_owned(), node.to_owned());
    }

    pub fn end_session(&mut self, session: &str) {
        self.sessions.remove(session);
    }

    /// Marks `node` as draining (or not): placements leave it out, but for the sessions that
    /// are still there.
    pub fn set_draining(&mut self, node: &str, draining: bool) {
        if draining {
            self.draining.insert(node.to_owned());
        } else {
            self.draining.remove(node);
        }
    }

    pub fn is_draining(&self, node: &str) -> bool {
        self.draining.contains(node)
    }

    /// The sessions, by id.
    pub fn sessions(&self) -> &HashMap<String, NodeId> {
        &self.sessions
    }

    /// Memory of `node` promised to models it does not show yet.
    pub fn promised_bytes(&self, node: &str) -> u64 {
        self.promised.get(node).map_or(0, |p| p.total)
    }

    /// Counts the memory a decision gives a model against its node until the node's inventory
    /// shows the model (for a node that does not hold it already).
    pub fn promise(&mut self, decision: &Decision, fingerprint: &str, weight_bytes: u64, now: u64) {
        let bytes = decision.fit.device_bytes(weight_bytes);
        self.promised.entry(decision.node.clone()).or_default().add(fingerprint, bytes, now);
        self.promises_expire_at = self.promises_expire_at.min(now + 2 * self.lease_ttl_ms);
    }

    /// Whether `node` holds the model or was given it.
    pub fn holds(&self, fingerprint: &str, node: &str) -> bool {
        self.holders.get(fingerprint).is_some_and(|h| h.contains(node))
    }

    /// Whether a live node's inventory lists the model: what a node holds now, not what it
    /// was once given.
    pub fn in_inventory(&self, fingerprint: &str) -> bool {
        self.membership.live().any(|(_, m)| m.inventory.models.iter().any(|fp| fp == fingerprint))
    }

    /// The live nodes that hold the model or were given it, by name.
    pub fn holders(&self, fingerprint: &str) -> Vec<NodeId> {
        let mut nodes: Vec<NodeId> = self
            .holders
            .get(fingerprint)
            .map(|h| h.iter().filter(|n| self.membership.get(n).is_some()).cloned().collect())
            .unwrap_or_default();
        nodes.sort();
        nodes
    }

    fn forget(&mut self, node: &str) {
        self.holders.retain(|_, nodes| {
            nodes.remove(node);
            !nodes.is_empty()
        });
        self.promised.remove(node);
        self.sessions.retain(|_, n| n != node);
        self.draining.remove(node);
    }

    fn note_holdings(&mut self, node: &str, models: &[String]) {
        for fp in models {
            self.holders.entry(fp.clone()).or_default().insert(node.to_owned());
        }
    }

    /// Free device memory of `node` less what placements promised it.
    fn free(&self, node: &str, inventory: &Inventory) -> u64 {
        inventory.memory_free.saturating_sub(self.promised_bytes(node))
    }

    /// Chooses a node for `request` and records the choice here (the model as given to the
    /// node, the session as living there): placement in one process, with no store.
    pub fn place(&mut self, request: &PlaceRequest, now: u64) -> Result<Decision, PlaceError> {
        self.expire_promises(now);
        let decision = self.decide(request)?;
        if !self.holds(&request.fingerprint, &decision.node) {
            let demand = Demand::of(&request.blocks, request.io_bytes, request.phase);
            self.promise(&decision, &request.fingerprint, demand.weight_bytes, now);
            self.give(&request.fingerprint, &decision.node);
        }
        if let Some(session) = &request.session {
            self.set_session(session, &decision.node);
        }
        Ok(decision)
    }

    /// Whether new placements may go to `node`: it is live and not draining.
    fn open(&self, node: &str) -> bool {
        self.membership.get(node).is_some() && !self.draining.contains(node)
    }

    /// Chooses a node for `request`, changing nothing.
    pub fn decide(&self, request: &PlaceRequest) -> Result<Decision, PlaceError> {
        if request.blocks.is_empty() {
            return Err(PlaceError::NoBlocks);
        }
        let demand = &Demand::of(&request.blocks, request.io_bytes, request.phase);
        let holders = self.holders.get(&request.fingerprint);
        let holds = |node: &str| holders.is_some_and(|h| h.contains(node));
        let session_node = request.session.as_ref().and_then(|s| self.sessions.get(s));
        let (rule, candidates): (Rule, Vec<(&NodeId, &Inventory)>) =
            if let Some(member) = session_node.and_then(|n| self.membership.get(n).map(|m| (n, m))) {
                (Rule::Session, vec![(member.0, &member.1.inventory)])
            } else if let Some(h) = holders
                // A session moving on may go anywhere: the node it goes to gets the model.
                .filter(|h| request.moving.is_none() && h.iter().any(|n| self.open(n)))
            {
                let live =
                    h.iter().filter(|n| self.open(n)).filter_map(|n| self.membership.get(n).map(|m| (n, &m.inventory)));
                (Rule::Shared, live.collect())
            } else {
                let live = self.membership.live().filter(|(n, _)| !self.draining.contains(*n));
                (Rule::Policy, live.map(|(n, m)| (n, &m.inventory)).collect())
            };
        if candidates.is_empty() {
            return Err(PlaceError::NoNodes);
        }
        let considered = candidates.len();
        #[derive(Clone, Copy)]
        struct Scored<'a> {
            node: &'a NodeId,
            inventory: &'a Inventory,
            fit: Fit,
            cost: Cost,
            score: f64,
        }
        // One pass: the best two that fit whole, and the best two by fewest bytes streamed.
        // Ties go to the node name, so every control process decides alike.
        let mut resident = Best::new();
        let mut streaming = Best::new();
        for (node, inventory) in candidates {
            let free = self.free(node, inventory);
            let fit = fit(demand, free, inventory.host_memory_free, holds(node));
            // A session's node is kept even if the model no longer fits it: the node streams
            // what it must or says why it cannot.
            if fit == Fit::No && rule != Rule::Session {
                continue;
            }
            let mut adds = if holds(node) { 0 } else { fit.device_bytes(demand.weight_bytes) };
            let mut cost = Cost::of(demand, inventory, fit);
            if let Some(moving) = request.moving.as_ref().filter(|m| m.from != *node) {
                // The state needs room beside the model, and crosses the slower of the links.
                if free < adds.saturating_add(moving.state_bytes) {
                    continue;
                }
                adds += moving.state_bytes;
                let link = self.membership.get(&moving.from).map_or(0.0, |m| m.inventory.link_bandwidth);
                let link = link.min(inventory.link_bandwidth);
                cost.move_s = if link > 0.0 { moving.state_bytes as f64 / link } else { f64::INFINITY };
            }
            let streamed = fit.streamed_bytes();
            let calls = request.moving.as_ref().map_or(1, |m| m.calls);
            let score = score(request.policy, &cost, inventory, free, adds, calls);
            let scored = Scored { node, inventory, fit, cost, score };
            if fit == Fit::Resident {
                resident.offer((score, node.as_str()), scored);
            } else {
                streaming.offer((streamed, score, node.as_str()), scored);
            }
        }
        let (rule, best, runner_up) = match (resident.first, streaming.first) {
            (Some((_, best)), _) => (rule, best, resident.second.map(|(_, s)| s)),
            // Fits nowhere whole: the node that streams the fewest bytes per call.
            (None, Some((_, best))) => {
                (if rule == Rule::Policy { Rule::Streamed } else { rule }, best, streaming.second.map(|(_, s)| s))
            }
            (None, None) => {
                return Err(PlaceError::FitsNowhere { weights: demand.weight_bytes, largest: demand.largest_block });
            }
        };
        Ok(Decision {
            node: best.node.clone(),
            addr: best.inventory.addr.clone(),
            rule,
            policy: request.policy,
            fit: best.fit,
            cost: best.cost,
            score: best.score,
            runner_up: runner_up.map(|s| (s.node.clone(), s.score)),
            considered,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::LeaseId;
    use crate::membership::tests::inventory;
    use crate::placement::Bound;

    const GIB: u64 = 1 << 30;

    fn node(memory: u64) -> Inventory {
        Inventory { memory_total: memory, memory_free: memory, ..inventory("") }
    }

    fn cluster(nodes: &[(&str, Inventory)]) -> Cluster {
        let mut c = Cluster::new(1000);
        for (lease, (name, inv)) in nodes.iter().enumerate() {
            join(&mut c, name, lease as u64 + 1, inv.clone(), 0);
        }
        c
    }

    fn join(c: &mut Cluster, name: &str, lease: LeaseId, inventory: Inventory, now: u64) {
        let inventory = Inventory { addr: format!("{name}:7070"), ..inventory };
        c.join(name, Member { inventory, lease }, now);
    }

    fn request(fp: &str, weights: u64, policy: Policy) -> PlaceRequest {
        PlaceRequest {
            fingerprint: fp.into(),
            blocks: vec![Block { weight_bytes: weights / 2, flops: 1e9 }; 2],
            io_bytes: 1 << 20,
            phase: None,
            session: None,
            policy,
            moving: None,
        }
    }

    /// A session's decode goes to the node that reads memory fastest when its state's move,
    /// paid over its calls, costs less than that saves; it stays where it is when the move
    /// costs more, and goes nowhere without room for the state beside the model.
    #[test]
    fn a_moving_session_weighs_its_move_against_what_the_other_node_saves() {
        let compute = Inventory { flops: 1000e12, memory_bandwidth: 100e9, ..node(80 * GIB) };
        let memory = Inventory { flops: 10e12, memory_bandwidth: 3e12, ..node(80 * GIB) };
        let mut c = cluster(&[("compute", compute), ("memory", memory)]);
        // Prefill: compute-bound, to the fastest compute; the model is held there now.
        let mut r = request("m", 4 * GIB, Policy::MinimizeLatency);
        r.phase = Some(Phase::Prefill);
        assert_eq!(c.decide(&r).unwrap().node, "compute");
        c.give("m", "compute");
        // Decode of a 1 GiB state paid over 100 steps: the move (43 ms, 0.4 ms a step) is worth
        // the 41 ms a step saves reading the weights; the explanation carries it.
        r.phase = Some(Phase::Decode);
        r.moving = Some(SessionMove { from: "compute".into(), state_bytes: GIB, calls: 100 });
        let d = c.decide(&r).unwrap();
        assert_eq!((d.node.as_str(), d.rule), ("memory", Rule::Policy));
        assert!((d.cost.move_s - GIB as f64 / 25e9).abs() < 1e-9, "{:?}", d.cost);
        assert_eq!(d.runner_up.as_ref().map(|(n, _)| n.as_str()), Some("compute"));
        // Paid over one step it is not (43 ms to save 41): the session stays, at no move cost.
        r.moving = Some(SessionMove { from: "compute".into(), state_bytes: GIB, calls: 1 });
        let d = c.decide(&r).unwrap();
        assert_eq!((d.node.as_str(), d.cost.move_s), ("compute", 0.0));
        // A state the other node has no room for beside the model stays too.
        r.moving = Some(SessionMove { from: "compute".into(), state_bytes: 77 * GIB, calls: 100 });
        assert_eq!(c.decide(&r).unwrap().node, "compute");
    }

    #[test]
    fn load_balance_spreads_registrations_in_proportion_to_budgets() {
        let mut c = cluster(&[("a", node(8 * GIB)), ("b", node(16 * GIB)), ("c", node(24 * GIB))]);
        let mut count: HashMap<NodeId, usize> = HashMap::new();
        for i in 0..30 {
            let d = c.place(&request(&format!("m{i}"), GIB, Policy::LoadBalance), 10).unwrap();
            assert_eq!(d.rule, Rule::Policy);
            *count.entry(d.node).or_default() += 1;
        }
        // 48 GiB for 30 GiB of models: each node ends 30/48 full, within one model.
        assert!(
            count["a"].abs_diff(5) <= 1 && count["b"].abs_diff(10) <= 1 && count["c"].abs_diff(15) <= 1,
            "{count:?}"
        );
    }

    #[test]
    fn a_session_stays_on_its_first_node_while_it_lives() {
        let mut c = cluster(&[("a", node(8 * GIB)), ("b", node(8 * GIB)), ("c", node(8 * GIB))]);
        let mut r = request("m", GIB, Policy::LoadBalance);
        r.session = Some("s1".into());
        let first = c.place(&r, 10).unwrap().node;
        for i in 0..99 {
            // Other models fill the first node: load_balance alone would move away from it.
            c.place(&request(&format!("other{i}"), GIB / 64, Policy::LoadBalance), 10).unwrap();
            let d = c.place(&r, 10).unwrap();
            assert_eq!((d.node.as_str(), d.rule), (first.as_str(), Rule::Session));
        }
        // Its node dies: the session moves, and stays where it moved.
        let others: Vec<&str> = ["a", "b", "c"].into_iter().filter(|n| *n != first).collect();
        c.leave(&first);
        let moved = c.place(&r, 1000).unwrap().node;
        assert!(others.contains(&moved.as_str()));
        assert_eq!(c.place(&r, 1000).unwrap().node, moved);
    }

    /// A draining node gets no new model, not even one it holds, and no new session; a session
    /// that lives there is still placed there until it moves; once the drain stops, it is a
    /// node like the others again; a drained node that leaves takes its mark with it.
    #[test]
    fn a_draining_node_gets_nothing_new_but_its_sessions_until_they_move() {
        let mut c = cluster(&[("a", node(8 * GIB)), ("b", node(8 * GIB))]);
        let mut s = request("m", GIB, Policy::LoadBalance);
        s.session = Some("s1".into());
        let first = c.place(&s, 10).unwrap().node;
        let other = if first == "a" { "b" } else { "a" };
        c.set_draining(&first, true);
        for i in 0..20 {
            let d = c.place(&request(&format!("new{i}"), GIB / 64, Policy::LoadBalance), 10).unwrap();
            assert_eq!(d.node, other, "a new model went to the draining node");
        }
        assert_eq!(c.decide(&request("m", GIB, Policy::LoadBalance)).unwrap().node, other, "shared, but draining");
        assert_eq!(c.decide(&s).unwrap().node, first, "the session is there until it moves");
        let mut s2 = s.clone();
        s2.session = Some("s2".into());
        assert_eq!(c.decide(&s2).unwrap().node, other);
        c.set_draining(&first, false);
        assert_eq!(c.decide(&request("m", GIB, Policy::LoadBalance)).unwrap().node, first, "shared again");
        c.set_draining(&first, true);
        c.leave(&first);
        assert!(!c.is_draining(&first));
        c.set_draining(other, true);
        assert!(matches!(c.decide(&request("x", GIB, Policy::LoadBalance)), Err(PlaceError::NoNodes)));
    }

    #[test]
    fn latency_counts_the_link_and_throughput_the_device() {
        let fast_gpu = Inventory { flops: 400e12, link_bandwidth: 1e9, ..node(80 * GIB) };
        let near = Inventory { flops: 100e12, link_bandwidth: 50e9, ..node(80 * GIB) };
        let mut c = cluster(&[("fast-gpu", fast_gpu), ("near", near)]);
        let mut r = request("m", GIB, Policy::MinimizeLatency);
        r.blocks = vec![Block { weight_bytes: GIB, flops: 1e12 }];
        r.io_bytes = 64 << 20;
        // 64 MiB at 1 GB/s is 67 ms against 10 ms of compute saved.
        let d = c.place(&r, 10).unwrap();
        assert_eq!(d.node, "near");
        assert!(d.runner_up.as_ref().is_some_and(|(n, s)| n == "fast-gpu" && *s > d.score));
        r.fingerprint = "m2".into();
        r.policy = Policy::MaximizeThroughput;
        assert_eq!(c.place(&r, 10).unwrap().node, "fast-gpu");
    }

    #[test]
    fn a_promise_not_kept_lapses_on_an_idle_node() {
        let mut c = cluster(&[("a", node(8 * GIB))]);
        c.place(&request("never-loaded", GIB, Policy::LoadBalance), 10).unwrap();
        assert_eq!(c.promised_bytes("a"), GIB);
        // No renewal changed the node's record; two leases later the promise is gone.
        c.place(&request("next", 2 * GIB, Policy::LoadBalance), 10 + 2000).unwrap();
        assert_eq!(c.promised_bytes("a"), 2 * GIB);
        c.expire_promises(10 + 4000);
        assert_eq!(c.promised_bytes("a"), 0);
    }

    #[test]
    fn the_phase_hint_picks_the_bound() {
        // One node computes fast, the other reads its memory fast.
        let compute = Inventory { flops: 1000e12, memory_bandwidth: 1e12, ..node(80 * GIB) };
        let memory = Inventory { flops: 100e12, memory_bandwidth: 8e12, ..node(80 * GIB) };
        let mut c = cluster(&[("compute", compute), ("memory", memory)]);
        // 16 GiB of weights and 1e13 FLOPs a call: 10 ms against 17 ms of reads on `compute`.
        let mut r = request("prefill", 16 * GIB, Policy::MinimizeLatency);
        r.blocks = vec![Block { weight_bytes: 16 * GIB, flops: 1e13 }];
        r.phase = Some(Phase::Prefill);
        let d = c.place(&r, 10).unwrap();
        assert_eq!((d.node.as_str(), d.cost.bound), ("compute", Bound::Compute), "{d:?}");
        r.fingerprint = "decode".into();
        r.phase = Some(Phase::Decode);
        let d = c.place(&r, 10).unwrap();
        assert_eq!((d.node.as_str(), d.cost.bound), ("memory", Bound::Memory), "{d:?}");
        assert!((d.cost.compute_s - (16 * GIB) as f64 / 8e12).abs() < 1e-9, "{d:?}");
        // No hint: the slower of the two bounds, node by node (17 ms of reads on `compute`,
        // 100 ms of compute on `memory`).
        r.fingerprint = "either".into();
        r.phase = None;
        let d = c.place(&r, 10).unwrap();
        assert_eq!((d.node.as_str(), d.cost.bound), ("compute", Bound::Memory), "{d:?}");
    }

    #[test]
    fn minimize_cost_takes_the_cheaper_node_per_call() {
        let dear = Inventory { flops: 200e12, cost_per_hour: 10.0, ..node(80 * GIB) };
        let cheap = Inventory { flops: 100e12, cost_per_hour: 2.0, ..node(80 * GIB) };
        let mut c = cluster(&[("dear", dear), ("cheap", cheap)]);
        assert_eq!(c.place(&request("m", GIB, Policy::MinimizeCost), 10).unwrap().node, "cheap");
        let mut r = request("n", GIB, Policy::MinimizeLatency);
        // Compute-bound: the faster node is quicker (with 1e9 FLOPs a block, reading the
        // weights would take longest, equally on both).
        r.blocks = vec![Block { weight_bytes: GIB, flops: 1e12 }];
        assert_eq!(c.place(&r, 10).unwrap().node, "dear");
    }

    #[test]
    fn identical_weights_share_a_node_whatever_the_policy() {
        let mut c = cluster(&[("a", node(8 * GIB)), ("b", node(8 * GIB))]);
        let first = c.place(&request("same", GIB, Policy::LoadBalance), 10).unwrap();
        for policy in [Policy::LoadBalance, Policy::MinimizeLatency, Policy::MaximizeThroughput, Policy::MinimizeCost] {
            let d = c.place(&request("same", GIB, policy), 10).unwrap();
            assert_eq!((d.node.as_str(), d.rule), (first.node.as_str(), Rule::Shared));
        }
        // A node reporting the model in its inventory shares it too.
        let mut c = cluster(&[("a", node(8 * GIB)), ("b", Inventory { models: vec!["held".into()], ..node(8 * GIB) })]);
        assert_eq!(c.place(&request("held", GIB, Policy::LoadBalance), 10).unwrap().node, "b");
    }

    #[test]
    fn a_model_too_large_for_every_node_goes_where_it_streams_least() {
        let mut c = cluster(&[("small", node(4 * GIB)), ("large", node(12 * GIB)), ("mid", node(8 * GIB))]);
        let mut r = request("huge", 40 * GIB, Policy::MinimizeCost);
        r.blocks = vec![Block { weight_bytes: GIB, flops: 1e9 }; 40];
        let d = c.place(&r, 10).unwrap();
        assert_eq!((d.node.as_str(), d.rule), ("large", Rule::Streamed));
        assert_eq!(d.fit, Fit::Streamed { bytes_per_call: 30 * GIB });
        // A block larger than every node's budget fits nowhere.
        r.fingerprint = "blocky".into();
        r.blocks = vec![Block { weight_bytes: 16 * GIB, flops: 1e9 }];
        assert!(matches!(c.place(&r, 10), Err(PlaceError::FitsNowhere { .. })));
    }

    #[test]
    fn a_lapsed_node_loses_its_models_and_no_nodes_is_an_error() {
        let mut c = cluster(&[("a", node(8 * GIB))]);
        c.place(&request("m", GIB, Policy::LoadBalance), 10).unwrap();
        c.leave("a");
        assert_eq!(c.place(&request("m", GIB, Policy::LoadBalance), 1000), Err(PlaceError::NoNodes));
        join(&mut c, "b", 2, node(8 * GIB), 1000);
        assert_eq!(c.place(&request("m", GIB, Policy::LoadBalance), 1000).unwrap().rule, Rule::Policy);
    }

    #[test]
    fn promised_memory_is_released_once_the_inventory_shows_the_model() {
        let mut c = cluster(&[("a", node(3 * GIB))]);
        c.place(&request("m", 2 * GIB, Policy::LoadBalance), 10).unwrap();
        // 2 of the 3 GiB are promised away: a second model of 2 GiB would have to stream.
        assert!(matches!(c.place(&request("n", 2 * GIB, Policy::LoadBalance), 10).unwrap().fit, Fit::Streamed { .. }));
        // The node renews showing both loaded in a larger budget: nothing is promised any more.
        let lease = c.membership().get("a").unwrap().lease;
        let shows = Inventory { memory_free: 2 * GIB, models: vec!["m".into(), "n".into()], ..node(6 * GIB) };
        join(&mut c, "a", lease, shows, 20);
        assert_eq!(c.place(&request("o", 2 * GIB, Policy::LoadBalance), 20).unwrap().fit, Fit::Resident);
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        proptest! {
            /// Whatever the cluster and the requests: the chosen node is live and can run the
            /// model; a session keeps its node; a model is refused only when its largest block
            /// fits no node's free budget.
            #[test]
            fn decisions_are_live_feasible_and_sticky(
                budgets in prop::collection::vec(1u64..64, 1..8),
                models in prop::collection::vec((1u64..32, 1usize..4, 0usize..4, prop::option::of(0u8..4)), 1..40),
            ) {
                let nodes: Vec<(String, Inventory)> =
                    budgets.iter().enumerate().map(|(i, &b)| (format!("n{i}"), node(b * GIB))).collect();
                let named: Vec<(&str, Inventory)> = nodes.iter().map(|(n, i)| (n.as_str(), i.clone())).collect();
                let mut c = cluster(&named);
                let policies = [Policy::MinimizeLatency, Policy::MaximizeThroughput, Policy::LoadBalance, Policy::MinimizeCost];
                let mut sessions: HashMap<String, NodeId> = HashMap::new();
                for (i, &(block_gib, blocks, policy, session)) in models.iter().enumerate() {
                    let mut r = request(&format!("m{i}"), 0, policies[policy]);
                    r.blocks = vec![Block { weight_bytes: block_gib * GIB, flops: 1e9 }; blocks];
                    r.session = session.map(|s| format!("s{s}"));
                    match c.place(&r, 10) {
                        Ok(d) => {
                            prop_assert!(c.membership().get(&d.node).is_some());
                            if d.rule != Rule::Session {
                                prop_assert!(d.fit != Fit::No);
                            }
                            if let Some(s) = &r.session {
                                if let Some(before) = sessions.get(s) {
                                    prop_assert_eq!(before, &d.node);
                                }
                                sessions.insert(s.clone(), d.node.clone());
                            }
                        }
                        Err(PlaceError::FitsNowhere { largest, .. }) => {
                            prop_assert!(r.session.as_ref().is_none_or(|s| !sessions.contains_key(s)));
                            let fits_somewhere = c.membership().live().any(|(n, m)| largest <= c.free(n, &m.inventory));
                            prop_assert!(!fits_somewhere);
                        }
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
            }
        }
    }
}
