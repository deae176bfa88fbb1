//! Named tensors kept in node memory, under the node's memory budget. Names are per tenant: a
//! tenant sees, lists and replaces only its own.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use djinn_auth::TenantId;
use djinn_memory::{BufferPool, HostBuf, MemoryBudget, Reservation};
use djinn_proto::{DataMessage, ErrorCode, ListEntry, Message, Payload, Refusal, TensorDesc};

use crate::Reply;

/// A tensor in the store: its descriptor and the received payload it lives in (never copied).
#[derive(Debug)]
struct StoredTensor {
    desc: TensorDesc,
    data: Payload,
    /// The entry's own charge (`MIN_CHARGE` and its name), whatever its bytes.
    _bookkeeping: Reservation,
}

impl AsRef<[u8]> for StoredTensor {
    fn as_ref(&self) -> &[u8] {
        self.data.buf.as_slice()
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct StoreStats {
    tensors: u64,
    /// Bytes of the tensors in the store.
    stored_bytes: u64,
}

/// The node's named tensors. A put's payload is received straight into memory reserved from
/// the budget; replies to gets share that memory with the store, so a tensor deleted while its
/// bytes are being sent stays alive (and accounted) until the send ends.
#[derive(Debug)]
pub struct TensorStore {
    budget: MemoryBudget,
    pool: BufferPool,
    tensors: BTreeMap<(TenantId, String), Arc<StoredTensor>>,
    /// Named tensors per tenant, each at most `MAX_OBJECTS_PER_TENANT`.
    held: HashMap<TenantId, usize>,
    stats: StoreStats,
    /// Bound on a list reply's encoded entries, so it fits the peer's metadata limit.
    max_list_meta: usize,
}

/// Most entries one list reply carries.
pub const MAX_LIST: u32 = 1000;

impl TensorStore {
    pub fn new(budget: MemoryBudget, pool: BufferPool, max_meta: u32) -> Self {
        Self {
            budget,
            pool,
            tensors: BTreeMap::new(),
            held: HashMap::new(),
            stats: StoreStats::default(),
            max_list_meta: max_meta as usize / 2,
        }
    }

    fn put(&mut self, tenant: TenantId, name: String, desc: TensorDesc, data: Payload) -> Reply {
        let key = (tenant, name);
        if !self.tensors.contains_key(&key)
            && let Err(refusal) = self.room_for(tenant)
        {
            return Reply::error(refusal.code, refusal.message);
        }
        let bookkeeping = match self.budget.try_reserve_for(tenant, crate::MIN_CHARGE + key.1.len() as u64) {
            Ok(r) => r,
            Err(e) => {
                let refusal = Refusal::from(e);
                return Reply::error(refusal.code, refusal.message);
            }
        };
        let bytes = desc.byte_len;
        let old = self.tensors.insert(key, Arc::new(StoredTensor { desc, data, _bookkeeping: bookkeeping }));
        self.stats.tensors += 1;
        self.stats.stored_bytes += bytes;
        match &old {
            Some(old) => self.forget(old),
            None => *self.held.entry(tenant).or_default() += 1,
        }
        Reply::message(DataMessage::PutAck { replaced: old.is_some() })
    }

    /// Refused when `tenant` holds as many named tensors as one tenant may.
    fn room_for(&self, tenant: TenantId) -> Result<(), Refusal> {
        let held = self.held.get(&tenant).copied().unwrap_or(0);
        if held >= crate::MAX_OBJECTS_PER_TENANT {
            return Err(Refusal {
                code: ErrorCode::QuotaExceeded,
                message: format!("this tenant has {held} named tensors, the most one tenant may: delete some first"),
            });
        }
        Ok(())
    }

    fn forget(&mut self, tensor: &StoredTensor) {
        self.stats.tensors -= 1;
        self.stats.stored_bytes -= tensor.desc.byte_len;
    }

    fn list(&self, tenant: TenantId, after: Option<String>, limit: u32) -> Reply {
        let start = match after {
            Some(name) => Bound::Excluded((tenant, name)),
            None => Bound::Included((tenant, String::new())),
        };
        let end = match tenant.0.checked_add(1) {
            Some(next) => Bound::Excluded((TenantId(next), String::new())),
            None => Bound::Unbounded,
        };
        let mut entries = Vec::new();
        let mut size = 0;
        let mut more = false;
        for ((_, name), tensor) in self.tensors.range((start, end)) {
            let entry_size = 2 + name.len() + 10 + 8 * tensor.desc.shape.len();
            if entries.len() as u32 >= limit.min(MAX_LIST) || size + entry_size > self.max_list_meta {
                more = true;
                break;
            }
            size += entry_size;
            entries.push(ListEntry { name: name.clone(), tensor: tensor.desc.clone() });
        }
        Reply::message(DataMessage::ListReply { entries, more })
    }
}

impl TensorStore {
    /// `tenant`'s named tensor: its descriptor and its bytes, shared with the store.
    pub fn shared(&self, tenant: TenantId, name: &str) -> Option<(TensorDesc, djinn_proto::SharedBytes)> {
        // The key is owned; a look-up by borrowed parts would need a custom Borrow.
        self.tensors.get(&(tenant, name.to_owned())).map(|t| (t.desc.clone(), Arc::clone(t) as _))
    }

    /// Memory for `tenant`'s put: reserved from the budget, then taken from the pool.
    pub fn alloc(&mut self, tenant: TenantId, len: usize) -> Result<Payload, Refusal> {
        // At the cap nothing is received (a put that would replace a tensor is refused too).
        self.room_for(tenant)?;
        let reservation = self.budget.try_reserve_for(tenant, len as u64)?;
        let buf = self.pool.take(len)?;
        Ok(Payload { buf, reservation: Some(reservation) })
    }

    /// Answers `tenant`'s put, get, delete and list.
    pub fn handle(&mut self, tenant: TenantId, message: Message, payload: Option<Payload>) -> Reply {
        match (message, payload) {
            (Message::Data(DataMessage::Put { name, tensor }), Some(data)) => self.put(tenant, name, tensor, data),
            // An empty tensor has no payload bytes.
            (Message::Data(DataMessage::Put { name, tensor }), None) => {
                self.put(tenant, name, tensor, Payload { buf: HostBuf::empty(), reservation: None })
            }
            (Message::Data(DataMessage::Get { name }), _) => {
                let key = (tenant, name);
                match self.tensors.get(&key) {
                    Some(tensor) => Reply {
                        message: Message::Data(DataMessage::GetReply { tensor: tensor.desc.clone() }),
                        tensors: vec![Arc::clone(tensor) as _],
                    },
                    None => Reply::error(ErrorCode::NotFound, format!("no tensor named {:?}", key.1)),
                }
            }
            (Message::Data(DataMessage::Delete { name }), _) => {
                let key = (tenant, name);
                match self.tensors.remove(&key) {
                    Some(old) => {
                        self.forget(&old);
                        if let std::collections::hash_map::Entry::Occupied(mut n) = self.held.entry(tenant) {
                            *n.get_mut() -= 1;
                            if *n.get() == 0 {
                                n.remove();
                            }
                        }
                        Reply::message(DataMessage::DeleteAck)
                    }
                    None => Reply::error(ErrorCode::NotFound, format!("no tensor named {:?}", key.1)),
                }
            }
            (Message::Data(DataMessage::List { after, limit }), _) => self.list(tenant, after, limit),
            (message, _) => Reply::error(
                ErrorCode::Unexpected,
                format!("the tensor store does not serve {} requests", message.kind().name()),
            ),
        }
    }

    pub fn stats(&self, out: &mut Vec<(String, u64)>) {
        let pool = self.pool.stats();
        out.extend(
            [
                ("store_tensors", self.stats.tensors),
                ("store_bytes", self.stats.stored_bytes),
                ("budget_used_bytes", self.budget.used()),
                ("budget_limit_bytes", self.budget.limit()),
                ("pool_retained_bytes", pool.retained_bytes),
                ("pool_hits", pool.hits),
                ("pool_misses", pool.misses),
            ]
            .map(|(k, v)| (k.to_owned(), v)),
        );
    }
}
