//! The cost model and the policies: what running a model on a node would cost, per call, and
//! which node each policy prefers. Pure functions of the request and of what the nodes reported.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::membership::Inventory;

/// What a placement optimises, chosen per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Lowest time per call: compute + transfer + streaming + queueing.
    #[default]
    MinimizeLatency,
    /// Most calls per second from the node: device time per call (compute and streaming),
    /// scaled by the work already queued there; the network is not the bottleneck of a batch.
    MaximizeThroughput,
    /// Evenest use of device memory: the lowest share of its budget used once the model is there.
    LoadBalance,
    /// Lowest price per call: device time per call at the node's hourly price.
    MinimizeCost,
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "minimize_latency" => Self::MinimizeLatency,
            "maximize_throughput" => Self::MaximizeThroughput,
            "load_balance" => Self::LoadBalance,
            "minimize_cost" => Self::MinimizeCost,
            other => {
                return Err(format!(
                    "unknown policy {other:?}: minimize_latency, maximize_throughput, load_balance or minimize_cost"
                ));
            }
        })
    }
}

/// What bounds a model's calls, when the client says (the phase of an LLM it serves).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Many tokens per call (a prompt): bound by compute.
    Prefill,
    /// One token per call: bound by reading the weights from device memory; the FLOPs counted
    /// on a prompt-sized example overstate it.
    Decode,
}

/// Which resource a call's device time was taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    #[default]
    Compute,
    Memory,
}

/// One block of a model, as the client estimates it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub weight_bytes: u64,
    /// FLOPs of one call of the block (the Python package counts them on the example inputs).
    pub flops: f64,
}

/// What a model needs, summed over its blocks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    pub weight_bytes: u64,
    pub largest_block: u64,
    pub flops: f64,
    /// Bytes moved per call: inputs and outputs.
    pub io_bytes: u64,
    pub phase: Option<Phase>,
}

impl Demand {
    pub fn of(blocks: &[Block], io_bytes: u64, phase: Option<Phase>) -> Self {
        Self {
            weight_bytes: blocks.iter().map(|b| b.weight_bytes).sum(),
            largest_block: blocks.iter().map(|b| b.weight_bytes).max().unwrap_or(0),
            flops: blocks.iter().map(|b| b.flops).sum(),
            io_bytes,
            phase,
        }
    }
}

/// Whether, and how, a model can run on a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fit {
    /// Already there, or fits whole in the free budget.
    Resident,
    /// Runs with this many bytes streamed in per call (the node's planner keeps what fits).
    Streamed { bytes_per_call: u64 },
    /// Its largest block does not fit the free budget, or its weights not host memory.
    No,
}

impl Fit {
    /// Device bytes a model of `weight_bytes` takes on the node: all of it resident, what is
    /// not streamed otherwise (the ring and the resident blocks).
    pub fn device_bytes(self, weight_bytes: u64) -> u64 {
        match self {
            Self::Resident => weight_bytes,
            Self::Streamed { bytes_per_call } => weight_bytes - bytes_per_call,
            Self::No => 0,
        }
    }

    pub fn streamed_bytes(self) -> u64 {
        match self {
            Self::Streamed { bytes_per_call } => bytes_per_call,
            _ => 0,
        }
    }
}

/// How a node's memory would take a model. Mirrors the node's residency planner: a ring of
/// two of the largest blocks when there is room for two, else one, and what fits beside it
/// stays resident.
pub fn fit(demand: &Demand, free: u64, host_free: u64, holds: bool) -> Fit {
    if holds || demand.weight_bytes <= free {
        return Fit::Resident;
    }
    if demand.largest_block > free || demand.weight_bytes > host_free {
        return Fit::No;
    }
    let ring = if free >= 2 * demand.largest_block { 2 * demand.largest_block } else { demand.largest_block };
    Fit::Streamed { bytes_per_call: demand.weight_bytes - (free - ring).min(demand.weight_bytes) }
}

/// Seconds per call on one node, by part.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Cost {
    /// The device's time on the call: its FLOPs at the node's rate, or its weights read at the
    /// node's memory bandwidth, whichever `bound` says (the phase's, else the slower).
    pub compute_s: f64,
    pub bound: Bound,
    /// Inputs and outputs over the client's link.
    pub transfer_s: f64,
    /// Weights streamed in per call, at the node's host-to-device rate.
    pub stream_s: f64,
    /// Waiting behind the work queued there (each queued request taken to cost as much).
    pub queue_s: f64,
    /// Once, not per call: a session's state moved here from the node it is on, over the slower
    /// of the two nodes' links (0 on that node itself).
    pub move_s: f64,
}

/// A session that would move to the chosen node: where it is, its state's size, and how many
/// calls the move is paid over (its decode steps, say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionMove {
    pub from: String,
    pub state_bytes: u64,
    pub calls: u32,
}

impl Cost {
    pub fn of(demand: &Demand, inventory: &Inventory, fit: Fit) -> Self {
        let per_second = |bytes: u64, rate: f64| if rate > 0.0 { bytes as f64 / rate } else { f64::INFINITY };
        let flops_s = if inventory.flops > 0.0 { demand.flops / inventory.flops } else { f64::INFINITY };
        let weights_s = per_second(demand.weight_bytes, inventory.memory_bandwidth);
        let (compute_s, bound) = match demand.phase {
            Some(Phase::Prefill) => (flops_s, Bound::Compute),
            Some(Phase::Decode) => (weights_s, Bound::Memory),
            None if weights_s > flops_s => (weights_s, Bound::Memory),
            None => (flops_s, Bound::Compute),
        };
        let stream_s = match fit {
            Fit::Streamed { bytes_per_call } => per_second(bytes_per_call, inventory.host_to_device),
            _ => 0.0,
        };
        let transfer_s = per_second(demand.io_bytes, inventory.link_bandwidth);
        let queue_s = f64::from(inventory.queue_depth) * (compute_s + stream_s + transfer_s);
        Self { compute_s, bound, transfer_s, stream_s, queue_s, move_s: 0.0 }
    }

    /// Time per call: the call's parts, and the move's share when there is one.
    pub fn total_s(&self, calls: u32) -> f64 {
        self.compute_s + self.transfer_s + self.stream_s + self.queue_s + self.move_s / f64::from(calls.max(1))
    }

    /// Time the device spends on one call.
    pub fn device_s(&self) -> f64 {
        self.compute_s + self.stream_s
    }
}

/// The policy's score of a node (lower is better). `free` is the node's free budget before the
/// model lands; `adds` the device bytes the model would add there; `calls` what a session's
/// move (in `cost`) is paid over.
pub fn score(policy: Policy, cost: &Cost, inventory: &Inventory, free: u64, adds: u64, calls: u32) -> f64 {
    let moving = cost.move_s / f64::from(calls.max(1));
    match policy {
        Policy::MinimizeLatency => cost.total_s(calls),
        Policy::MaximizeThroughput => (cost.device_s() + moving) * (1.0 + f64::from(inventory.queue_depth)),
        Policy::LoadBalance => {
            let used = inventory.memory_total.saturating_sub(free) + adds;
            used as f64 / inventory.memory_total.max(1) as f64
        }
        Policy::MinimizeCost => (cost.device_s() + moving) * inventory.cost_per_hour / 3600.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(weights: u64, largest: u64) -> Demand {
        Demand { weight_bytes: weights, largest_block: largest, flops: 1e9, io_bytes: 1 << 20, phase: None }
    }

    #[test]
    fn fit_follows_the_nodes_planner() {
        assert_eq!(fit(&demand(100, 10), 100, 0, false), Fit::Resident);
        assert_eq!(fit(&demand(100, 10), 0, 0, true), Fit::Resident);
        // 40 free: a ring of 20 and 20 resident, 80 streamed.
        assert_eq!(fit(&demand(100, 10), 40, 1000, false), Fit::Streamed { bytes_per_call: 80 });
        // 15 free: room for one slot only.
        assert_eq!(fit(&demand(100, 10), 15, 1000, false), Fit::Streamed { bytes_per_call: 95 });
        assert_eq!(fit(&demand(100, 10), 9, 1000, false), Fit::No);
        assert_eq!(fit(&demand(100, 10), 40, 99, false), Fit::No);
    }

    #[test]
    fn policies_parse_by_their_api_names() {
        assert_eq!("load_balance".parse(), Ok(Policy::LoadBalance));
        assert!("fastest".parse::<Policy>().is_err());
    }
}
