//! The Djinn client: a connection to a node with typed operations on named tensors.
//!
//! ```no_run
//! use djinn_client::{Client, DType};
//! let mut client = Client::connect("127.0.0.1:7070").unwrap();
//! let bytes: Vec<u8> = (0..16u8).collect();
//! client.put("x", DType::F32, &[2, 2], &bytes).unwrap();
//! let x = client.get("x").unwrap();
//! assert_eq!(x.bytes(), &bytes[..]);
//! ```

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

pub use djinn_dataplane::proto::{DType, ErrorCode, Hello, ListEntry, TensorDesc};
use djinn_dataplane::proto::{Frame, Limits, Message, ProtocolError, transports};
use djinn_dataplane::tcp::ClientConn;
pub use djinn_dataplane::tcp::{ClientError, ClientOptions};

/// A tensor received from a node: its descriptor and its bytes, in a buffer that goes back to
/// the client's pool when dropped.
#[derive(Debug)]
pub struct Tensor {
    pub desc: TensorDesc,
    data: Option<djinn_dataplane::proto::Payload>,
}

impl Tensor {
    pub fn bytes(&self) -> &[u8] {
        self.data.as_ref().map_or(&[], |p| p.buf.as_slice())
    }
}

pub struct Client {
    conn: ClientConn,
    node: Hello,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("peer", &self.conn.peer()).field("node", &self.node.agent).finish()
    }
}

impl Client {
    pub fn connect(addr: impl ToSocketAddrs) -> Result<Self, ClientError> {
        Self::connect_with(addr, ClientOptions::default())
    }

    /// Connects and exchanges hellos; a node speaking another protocol version is refused with
    /// an error naming both versions.
    pub fn connect_with(addr: impl ToSocketAddrs, options: ClientOptions) -> Result<Self, ClientError> {
        let limits = options.limits;
        let mut conn = ClientConn::connect(addr, options)?;
        let hello = Hello::new(&limits, transports::TCP, concat!("djinn-client/", env!("CARGO_PKG_VERSION")));
        let reply = conn.request(&Message::Hello(hello), &[])?;
        let Message::HelloAck(node) = reply.message else {
            return Err(unexpected(&conn, reply));
        };
        if node.protocol_version != djinn_dataplane::proto::PROTOCOL_VERSION {
            return Err(ClientError::Protocol {
                peer: conn.peer(),
                source: ProtocolError::VersionMismatch {
                    ours: djinn_dataplane::proto::PROTOCOL_VERSION,
                    theirs: node.protocol_version,
                },
            });
        }
        Ok(Self { conn, node })
    }

    /// What the node announced: its version, transports and limits.
    pub fn node(&self) -> &Hello {
        &self.node
    }

    pub fn node_limits(&self) -> Limits {
        Limits { max_meta: self.node.max_meta, max_payload: self.node.max_payload, ..Limits::default() }
    }

    /// One round trip; returns its duration.
    pub fn ping(&mut self) -> Result<Duration, ClientError> {
        let start = Instant::now();
        let reply = self.conn.request(&Message::Ping, &[])?;
        match reply.message {
            Message::Pong => Ok(start.elapsed()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Stores `bytes` as tensor `name`; returns whether it replaced one. The bytes are written
    /// to the socket from `bytes` itself.
    pub fn put(&mut self, name: &str, dtype: DType, shape: &[u64], bytes: &[u8]) -> Result<bool, ClientError> {
        let tensor = TensorDesc::new(dtype, shape.to_vec()).map_err(ClientError::Request)?;
        let message = Message::Put { name: name.to_owned(), tensor };
        let reply = self.conn.request(&message, &[bytes])?;
        match reply.message {
            Message::PutAck { replaced } => Ok(replaced),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    pub fn get(&mut self, name: &str) -> Result<Tensor, ClientError> {
        let reply = self.conn.request(&Message::Get { name: name.to_owned() }, &[])?;
        match reply.message {
            Message::GetReply { tensor } => Ok(Tensor { desc: tensor, data: reply.payload }),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    pub fn delete(&mut self, name: &str) -> Result<(), ClientError> {
        let reply = self.conn.request(&Message::Delete { name: name.to_owned() }, &[])?;
        match reply.message {
            Message::DeleteAck => Ok(()),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }

    /// Every tensor on the node, in name order (fetched page by page).
    pub fn list(&mut self) -> Result<Vec<ListEntry>, ClientError> {
        let mut all = Vec::new();
        let mut after = None;
        loop {
            let reply = self.conn.request(&Message::List { after: after.take(), limit: u32::MAX }, &[])?;
            let Message::ListReply { entries, more } = reply.message else {
                return Err(unexpected(&self.conn, reply));
            };
            after = entries.last().map(|e| e.name.clone());
            all.extend(entries);
            if !more || after.is_none() {
                return Ok(all);
            }
        }
    }

    /// The node's counters, by name.
    pub fn stats(&mut self) -> Result<Vec<(String, u64)>, ClientError> {
        let reply = self.conn.request(&Message::Stats, &[])?;
        match reply.message {
            Message::StatsReply { counters } => Ok(counters),
            _ => Err(unexpected(&self.conn, reply)),
        }
    }
}

fn unexpected(conn: &ClientConn, reply: Frame) -> ClientError {
    ClientError::UnexpectedReply { peer: conn.peer(), request_id: reply.request_id, kind: reply.message.kind().name() }
}
