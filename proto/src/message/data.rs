//! The data plane: the connection's own messages (hello, ping, errors, the switch to RDMA, the
//! node's counters) and the node's named tensors.

use super::wire::{Reader, Writer};
use crate::error::{ErrorCode, ProtocolError};
use crate::header::PROTOCOL_VERSION;
use crate::limits::Limits;
use crate::tensor::TensorDesc;

family! {
    /// The data plane's messages.
    "data", DataMessage, DataKind {
        Hello(Hello) = 0x01 request,
        HelloAck(Hello) = 0x02 reply,
        Ping = 0x03 request,
        Pong = 0x04 reply,
        /// Store a named tensor (its bytes are the payload), replacing one of the same name.
        Put { name: String, tensor: TensorDesc } = 0x05 request,
        PutAck { replaced: bool } = 0x06 reply,
        Get { name: String } = 0x07 request,
        /// The tensor's bytes are the payload.
        GetReply { tensor: TensorDesc } = 0x08 reply,
        Delete { name: String } = 0x09 request,
        DeleteAck = 0x0a reply,
        /// Names in order, starting after `after`, at most `limit` of them.
        List { after: Option<String>, limit: u32 } = 0x0b request,
        /// `more` is true when names follow the last one returned.
        ListReply { entries: Vec<ListEntry>, more: bool } = 0x0c reply,
        Stats = 0x0d request,
        StatsReply { counters: Vec<(String, u64)> } = 0x0e reply,
        Error { code: ErrorCode, message: String } = 0x0f reply,
        /// Asks to carry this connection's frames over RDMA from now on.
        RdmaConnect(RdmaParams) = 0x10 request,
        /// The node's side; after it, frames go over the queue pairs.
        RdmaAccept(RdmaParams) = 0x11 reply,
    }
}

/// Transports a peer can speak, announced in the hello exchange.
pub mod transports {
    pub const TCP: u32 = 1 << 0;
    pub const RDMA: u32 = 1 << 1;
}

#[derive(Clone, PartialEq, Eq)]
pub struct Hello {
    pub protocol_version: u16,
    /// Bit set of [`transports`].
    pub transports: u32,
    /// The sender's limits: the peer must not send more than these.
    pub max_meta: u32,
    pub max_payload: u64,
    /// Software name and version, for logs.
    pub agent: String,
    /// How the sender's device memory meets the network (a node's: `staging`, through host
    /// memory); empty from a client.
    pub memory_path: String,
    /// The client's token (empty from a node, and where the node needs none).
    pub token: String,
    /// The tenant a node acts for when it moves that tenant's tensor to another node (empty
    /// otherwise); only a node's token may act for someone else.
    pub tenant: String,
}

impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hello")
            .field("protocol_version", &self.protocol_version)
            .field("transports", &self.transports)
            .field("max_meta", &self.max_meta)
            .field("max_payload", &self.max_payload)
            .field("agent", &self.agent)
            .field("memory_path", &self.memory_path)
            .field("token", &if self.token.is_empty() { "" } else { "<redacted>" })
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl Hello {
    pub fn new(limits: &Limits, transports: u32, agent: impl Into<String>) -> Self {
        Self {
            protocol_version: PROTOCOL_VERSION,
            transports,
            max_meta: limits.max_meta,
            max_payload: limits.max_payload,
            agent: agent.into(),
            memory_path: String::new(),
            token: String::new(),
            tenant: String::new(),
        }
    }
}

/// One side of an RDMA connection, exchanged over the TCP connection: its queue pair and the
/// receive slots both sides use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaParams {
    pub qp_number: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    /// Active MTU in bytes; both sides use the smaller.
    pub mtu: u32,
    pub slots: u32,
    pub slot_size: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub name: String,
    pub tensor: TensorDesc,
}

impl DataMessage {
    pub(super) fn tensors(&self) -> &[TensorDesc] {
        match self {
            Self::Put { tensor, .. } | Self::GetReply { tensor } => std::slice::from_ref(tensor),
            Self::Hello(_)
            | Self::HelloAck(_)
            | Self::Ping
            | Self::Pong
            | Self::PutAck { .. }
            | Self::Get { .. }
            | Self::Delete { .. }
            | Self::DeleteAck
            | Self::List { .. }
            | Self::ListReply { .. }
            | Self::Stats
            | Self::StatsReply { .. }
            | Self::Error { .. }
            | Self::RdmaConnect(_)
            | Self::RdmaAccept(_) => &[],
        }
    }

    pub(super) fn encode(&self, w: &mut Writer) {
        match self {
            Self::Hello(h) | Self::HelloAck(h) => {
                w.u16(h.protocol_version);
                w.u32(h.transports);
                w.u32(h.max_meta);
                w.u64(h.max_payload);
                w.str(&h.agent);
                w.str(&h.memory_path);
                w.str(&h.token);
                w.str(&h.tenant);
            }
            Self::Ping | Self::Pong | Self::DeleteAck | Self::Stats => {}
            Self::Put { name, tensor } => {
                w.str(name);
                w.tensor(tensor);
            }
            Self::PutAck { replaced } => w.bool(*replaced),
            Self::Get { name } | Self::Delete { name } => w.str(name),
            Self::GetReply { tensor } => w.tensor(tensor),
            Self::List { after, limit } => {
                match after {
                    Some(name) => {
                        w.u8(1);
                        w.str(name);
                    }
                    None => w.u8(0),
                }
                w.u32(*limit);
            }
            Self::ListReply { entries, more } => {
                w.list(entries, |w, e| {
                    w.str(&e.name);
                    w.tensor(&e.tensor);
                });
                w.bool(*more);
            }
            Self::StatsReply { counters } => w.list(counters, |w, (name, value)| {
                w.str(name);
                w.u64(*value);
            }),
            Self::Error { code, message } => {
                w.u16(code.to_wire());
                w.str(message);
            }
            Self::RdmaConnect(p) | Self::RdmaAccept(p) => {
                w.u32(p.qp_number);
                w.u32(p.psn);
                w.0.extend_from_slice(&p.gid);
                w.u32(p.mtu);
                w.u32(p.slots);
                w.u32(p.slot_size);
            }
        }
    }

    pub(super) fn decode(kind: DataKind, r: &mut Reader) -> Result<Self, ProtocolError> {
        Ok(match kind {
            DataKind::Hello => Self::Hello(r.hello()?),
            DataKind::HelloAck => Self::HelloAck(r.hello()?),
            DataKind::Ping => Self::Ping,
            DataKind::Pong => Self::Pong,
            DataKind::Put => Self::Put { name: r.name()?, tensor: r.tensor()? },
            DataKind::PutAck => Self::PutAck { replaced: r.bool("replaced")? },
            DataKind::Get => Self::Get { name: r.name()? },
            DataKind::GetReply => Self::GetReply { tensor: r.tensor()? },
            DataKind::Delete => Self::Delete { name: r.name()? },
            DataKind::DeleteAck => Self::DeleteAck,
            DataKind::List => {
                let after = if r.bool("has cursor")? { Some(r.name()?) } else { None };
                Self::List { after, limit: r.u32("limit")? }
            }
            DataKind::ListReply => Self::ListReply {
                // The smallest entry is an empty name (2) plus a rank-0 descriptor.
                entries: r.list("entries", 2 + Reader::TENSOR_MIN, |r| {
                    Ok(ListEntry { name: r.name()?, tensor: r.tensor()? })
                })?,
                more: r.bool("more")?,
            },
            DataKind::Stats => Self::Stats,
            DataKind::StatsReply => Self::StatsReply {
                counters: r.list("counters", 2 + 8, |r| Ok((r.string("counter name")?, r.u64("counter value")?)))?,
            },
            DataKind::Error => {
                Self::Error { code: ErrorCode::from_wire(r.u16("code")?), message: r.string("message")? }
            }
            DataKind::RdmaConnect => Self::RdmaConnect(r.rdma_params()?),
            DataKind::RdmaAccept => Self::RdmaAccept(r.rdma_params()?),
        })
    }
}

impl Reader<'_> {
    fn hello(&mut self) -> Result<Hello, ProtocolError> {
        Ok(Hello {
            protocol_version: self.u16("protocol version")?,
            transports: self.u32("transports")?,
            max_meta: self.u32("max meta")?,
            max_payload: self.u64("max payload")?,
            agent: self.string("agent")?,
            memory_path: self.string("memory path")?,
            token: self.string("token")?,
            tenant: self.string("tenant")?,
        })
    }

    fn rdma_params(&mut self) -> Result<RdmaParams, ProtocolError> {
        Ok(RdmaParams {
            qp_number: self.u32("qp number")?,
            psn: self.u32("psn")?,
            gid: self.array("gid")?,
            mtu: self.u32("mtu")?,
            slots: self.u32("slots")?,
            slot_size: self.u32("slot size")?,
        })
    }
}

#[cfg(test)]
pub(crate) fn arbitrary() -> impl proptest::strategy::Strategy<Value = DataMessage> {
    use crate::strategies::{name, tensor};
    use proptest::prelude::*;

    let hello = || {
        (any::<u32>(), any::<u32>(), any::<u64>(), name(), "(staging|)", name(), name()).prop_map(
            |(transports, max_meta, max_payload, agent, memory_path, token, tenant)| Hello {
                protocol_version: PROTOCOL_VERSION,
                transports,
                max_meta,
                max_payload,
                agent,
                memory_path,
                token,
                tenant,
            },
        )
    };
    let rdma_params = || {
        (any::<u32>(), any::<u32>(), any::<[u8; 16]>(), any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
            |(qp_number, psn, gid, mtu, slots, slot_size)| RdmaParams { qp_number, psn, gid, mtu, slots, slot_size },
        )
    };
    prop_oneof![
        hello().prop_map(DataMessage::Hello),
        hello().prop_map(DataMessage::HelloAck),
        Just(DataMessage::Ping),
        Just(DataMessage::Pong),
        (name(), tensor()).prop_map(|(name, tensor)| DataMessage::Put { name, tensor }),
        any::<bool>().prop_map(|replaced| DataMessage::PutAck { replaced }),
        name().prop_map(|name| DataMessage::Get { name }),
        tensor().prop_map(|tensor| DataMessage::GetReply { tensor }),
        name().prop_map(|name| DataMessage::Delete { name }),
        Just(DataMessage::DeleteAck),
        (prop::option::of(name()), any::<u32>()).prop_map(|(after, limit)| DataMessage::List { after, limit }),
        (prop::collection::vec((name(), tensor()), 0..5), any::<bool>()).prop_map(|(entries, more)| {
            let entries = entries.into_iter().map(|(name, tensor)| ListEntry { name, tensor }).collect();
            DataMessage::ListReply { entries, more }
        }),
        Just(DataMessage::Stats),
        prop::collection::vec((name(), any::<u64>()), 0..5).prop_map(|counters| DataMessage::StatsReply { counters }),
        (1u16..40, ".{0,40}")
            .prop_map(|(code, message)| DataMessage::Error { code: ErrorCode::from_wire(code), message }),
        rdma_params().prop_map(DataMessage::RdmaConnect),
        rdma_params().prop_map(DataMessage::RdmaAccept),
    ]
}
