//! Values a model takes and returns: tensors (by index into the frame's tensors, or by handle
//! when they stay on the node), scalars, strings, and tuples, lists and dicts of them, nested.
//! Encoded as a tag byte then the body.

use super::error::ProtocolError;

/// Deepest nesting accepted from the wire (decoding recurses).
pub const MAX_VALUE_DEPTH: usize = 32;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    /// The frame's tensor at this index.
    Tensor(u32),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    /// Keys are strings or ints in TorchScript; kept in order.
    Dict(Vec<(Value, Value)>),
    /// A tensor kept in the node's device memory.
    Handle(Handle),
}

/// A tensor kept on a node, named by that node. `id` is never reused in the node's life;
/// `epoch` is drawn at random when the node starts, so a handle from an earlier life of a node
/// restarted on the same address is told apart from a live one instead of naming the wrong
/// tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle {
    pub id: u64,
    pub epoch: u64,
}

impl Handle {
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
    }
}

impl std::fmt::Display for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{:016x}", self.id, self.epoch)
    }
}

mod tag {
    pub const NONE: u8 = 0;
    pub const TENSOR: u8 = 1;
    pub const INT: u8 = 2;
    pub const FLOAT: u8 = 3;
    pub const BOOL: u8 = 4;
    pub const STR: u8 = 5;
    pub const TUPLE: u8 = 6;
    pub const LIST: u8 = 7;
    pub const DICT: u8 = 8;
    pub const HANDLE: u8 = 9;
}

impl Value {
    /// Calls `f` on every handle in the value, depth first.
    pub fn for_each_handle(&self, f: &mut impl FnMut(&Handle)) {
        match self {
            Self::Handle(h) => f(h),
            Self::Tuple(items) | Self::List(items) => items.iter().for_each(|v| v.for_each_handle(f)),
            Self::Dict(entries) => entries.iter().for_each(|(k, v)| {
                k.for_each_handle(f);
                v.for_each_handle(f);
            }),
            _ => {}
        }
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Self::None => out.push(tag::NONE),
            Self::Tensor(i) => {
                out.push(tag::TENSOR);
                out.extend_from_slice(&i.to_le_bytes());
            }
            Self::Int(v) => {
                out.push(tag::INT);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Self::Float(v) => {
                out.push(tag::FLOAT);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Self::Bool(v) => out.extend_from_slice(&[tag::BOOL, u8::from(*v)]),
            Self::Str(s) => {
                out.push(tag::STR);
                out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            Self::Tuple(items) | Self::List(items) => {
                out.push(if matches!(self, Self::Tuple(_)) { tag::TUPLE } else { tag::LIST });
                out.extend_from_slice(&(items.len() as u32).to_le_bytes());
                for item in items {
                    item.encode(out);
                }
            }
            Self::Dict(entries) => {
                out.push(tag::DICT);
                out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
                for (k, v) in entries {
                    k.encode(out);
                    v.encode(out);
                }
            }
            Self::Handle(h) => {
                out.push(tag::HANDLE);
                h.encode(out);
            }
        }
    }

    /// Decodes one value from the front of `bytes`, advancing it. Tensor indices must be below
    /// `tensors`.
    pub fn decode(bytes: &mut &[u8], tensors: usize) -> Result<Self, ProtocolError> {
        Self::decode_at(bytes, tensors, 0)
    }

    fn decode_at(bytes: &mut &[u8], tensors: usize, depth: usize) -> Result<Self, ProtocolError> {
        if depth > MAX_VALUE_DEPTH {
            return Err(malformed(format!("values nested deeper than {MAX_VALUE_DEPTH}")));
        }
        let value = match take::<1>(bytes)?[0] {
            tag::NONE => Self::None,
            tag::TENSOR => {
                let i = u32::from_le_bytes(take(bytes)?);
                if i as usize >= tensors {
                    return Err(malformed(format!("tensor index {i} but the frame has {tensors} tensors")));
                }
                Self::Tensor(i)
            }
            tag::INT => Self::Int(i64::from_le_bytes(take(bytes)?)),
            tag::FLOAT => Self::Float(f64::from_le_bytes(take(bytes)?)),
            tag::BOOL => match take::<1>(bytes)?[0] {
                0 => Self::Bool(false),
                1 => Self::Bool(true),
                b => return Err(malformed(format!("{b} is not a boolean"))),
            },
            tag::STR => {
                let len = u32::from_le_bytes(take(bytes)?) as usize;
                if len > bytes.len() {
                    return Err(malformed(format!("string of {len} bytes, {} left", bytes.len())));
                }
                let (s, rest) = bytes.split_at(len);
                *bytes = rest;
                Self::Str(String::from_utf8(s.to_vec()).map_err(|_| malformed("string is not UTF-8".into()))?)
            }
            t @ (tag::TUPLE | tag::LIST) => {
                let n = count(bytes, 1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(Self::decode_at(bytes, tensors, depth + 1)?);
                }
                if t == tag::TUPLE { Self::Tuple(items) } else { Self::List(items) }
            }
            tag::DICT => {
                let n = count(bytes, 2)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    let k = Self::decode_at(bytes, tensors, depth + 1)?;
                    entries.push((k, Self::decode_at(bytes, tensors, depth + 1)?));
                }
                Self::Dict(entries)
            }
            tag::HANDLE => {
                Self::Handle(Handle { id: u64::from_le_bytes(take(bytes)?), epoch: u64::from_le_bytes(take(bytes)?) })
            }
            t => return Err(malformed(format!("unknown value tag {t}"))),
        };
        Ok(value)
    }
}

fn malformed(message: String) -> ProtocolError {
    ProtocolError::MalformedMeta(message)
}

fn take<const N: usize>(bytes: &mut &[u8]) -> Result<[u8; N], ProtocolError> {
    let Some((head, rest)) = bytes.split_first_chunk::<N>() else {
        return Err(malformed(format!("value truncated: needs {N} bytes, {} left", bytes.len())));
    };
    *bytes = rest;
    Ok(*head)
}

/// A u32 count of items of at least `min_item` bytes each, checked against what remains.
fn count(bytes: &mut &[u8], min_item: usize) -> Result<usize, ProtocolError> {
    let n = u32::from_le_bytes(take(bytes)?) as usize;
    if n.saturating_mul(min_item) > bytes.len() {
        return Err(malformed(format!("{n} items cannot fit in the {} bytes left", bytes.len())));
    }
    Ok(n)
}
