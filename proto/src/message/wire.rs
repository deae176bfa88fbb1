//! The field encodings every family shares: integers, strings, tensor descriptors and values.
//! A family's own types (a model's description, a breakpoint) add their methods to [`Writer`]
//! and [`Reader`] in the family's file.

use crate::error::ProtocolError;
use crate::limits::Limits;
use crate::tensor::{DType, TensorDesc};
use crate::value::{Handle, Value};

/// Writes fields in the protocol's encodings (little-endian integers, u16-length strings,
/// u32-counted lists) to the end of a buffer.
#[derive(Debug)]
pub struct Writer<'a>(pub &'a mut Vec<u8>);

impl Writer<'_> {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    pub fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Strings longer than u16::MAX bytes are cut at a character boundary; names are bounded
    /// far below that by [`Limits::max_name`].
    pub fn str(&mut self, s: &str) {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.0.extend_from_slice(&s.as_bytes()[..end]);
    }
    /// A u32 count, then each item.
    pub fn list<T>(&mut self, items: &[T], mut item: impl FnMut(&mut Self, &T)) {
        self.u32(items.len() as u32);
        for i in items {
            item(self, i);
        }
    }
    pub fn handle(&mut self, h: &Handle) {
        h.encode(self.0);
    }
    pub fn tensor(&mut self, t: &TensorDesc) {
        self.u8(t.dtype.to_wire());
        self.u8(t.shape.len() as u8);
        for &d in &t.shape {
            self.u64(d);
        }
        self.u64(t.byte_len);
    }
    pub fn tensors(&mut self, tensors: &[TensorDesc]) {
        self.list(tensors, Self::tensor);
    }
    pub fn values(&mut self, values: &[Value]) {
        self.list(values, |w, v| v.encode(w.0));
    }
    pub fn value(&mut self, value: &Option<Value>) {
        match value {
            Some(v) => {
                self.u8(1);
                v.encode(self.0);
            }
            None => self.u8(0),
        }
    }
}

/// Reads fields written by [`Writer`], checking each length against what is left and against
/// `limits` before anything is allocated.
#[derive(Debug)]
pub struct Reader<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) limits: &'a Limits,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8], limits: &'a Limits) -> Self {
        Self { bytes, limits }
    }
    /// Bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.bytes
    }
    pub fn limits(&self) -> &'a Limits {
        self.limits
    }
    pub fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ProtocolError> {
        if self.bytes.len() < n {
            return Err(ProtocolError::MalformedMeta(format!("{what}: needs {n} bytes, {} left", self.bytes.len())));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    pub fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ProtocolError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }
    pub fn u8(&mut self, what: &str) -> Result<u8, ProtocolError> {
        Ok(self.array::<1>(what)?[0])
    }
    pub fn u16(&mut self, what: &str) -> Result<u16, ProtocolError> {
        self.array(what).map(u16::from_le_bytes)
    }
    pub fn u32(&mut self, what: &str) -> Result<u32, ProtocolError> {
        self.array(what).map(u32::from_le_bytes)
    }
    pub fn u64(&mut self, what: &str) -> Result<u64, ProtocolError> {
        self.array(what).map(u64::from_le_bytes)
    }
    pub fn bool(&mut self, what: &str) -> Result<bool, ProtocolError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(ProtocolError::MalformedMeta(format!("{what}: {v} is not a boolean"))),
        }
    }
    pub fn string(&mut self, what: &str) -> Result<String, ProtocolError> {
        let len = self.u16(what)? as usize;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ProtocolError::MalformedMeta(format!("{what} is not UTF-8")))
    }
    /// A string bounded by [`Limits::max_name`].
    pub fn name(&mut self) -> Result<String, ProtocolError> {
        let name = self.string("name")?;
        if name.len() > self.limits.max_name {
            return Err(ProtocolError::MalformedMeta(format!(
                "name of {} bytes is over the limit of {}",
                name.len(),
                self.limits.max_name
            )));
        }
        Ok(name)
    }
    /// A u32 count of items at least `min_item` bytes each, checked against what remains
    /// before anything is allocated, then each item.
    pub fn list<T>(
        &mut self,
        what: &str,
        min_item: usize,
        mut item: impl FnMut(&mut Self) -> Result<T, ProtocolError>,
    ) -> Result<Vec<T>, ProtocolError> {
        let count = self.u32(what)? as usize;
        if count.saturating_mul(min_item) > self.bytes.len() {
            return Err(ProtocolError::MalformedMeta(format!(
                "{count} {what} cannot fit in the {} bytes left",
                self.bytes.len()
            )));
        }
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            items.push(item(self)?);
        }
        Ok(items)
    }
    pub fn handle(&mut self) -> Result<Handle, ProtocolError> {
        Ok(Handle { id: self.u64("handle id")?, epoch: self.u64("handle epoch")? })
    }
    pub fn tensor(&mut self) -> Result<TensorDesc, ProtocolError> {
        let code = self.u8("dtype")?;
        let dtype =
            DType::from_wire(code).ok_or_else(|| ProtocolError::BadDescriptor(format!("unknown dtype code {code}")))?;
        let rank = self.u8("rank")? as usize;
        if rank > self.limits.max_dims {
            return Err(ProtocolError::BadDescriptor(format!(
                "{rank} dimensions, more than the limit of {}",
                self.limits.max_dims
            )));
        }
        let mut shape = Vec::with_capacity(rank);
        for _ in 0..rank {
            shape.push(self.u64("dimension")?);
        }
        let tensor = TensorDesc { dtype, shape, byte_len: self.u64("byte length")? };
        tensor.validate(self.limits)?;
        Ok(tensor)
    }
    /// The smallest descriptor is rank 0: dtype, rank and byte length.
    pub const TENSOR_MIN: usize = 10;
    pub fn tensors(&mut self) -> Result<Vec<TensorDesc>, ProtocolError> {
        self.list("tensors", Self::TENSOR_MIN, Self::tensor)
    }
    /// Values whose tensor indices are below `tensors`.
    pub fn values(&mut self, tensors: usize) -> Result<Vec<Value>, ProtocolError> {
        self.list("inputs", 1, |r| Value::decode(&mut r.bytes, tensors))
    }
    pub fn value(&mut self, tensors: usize) -> Result<Option<Value>, ProtocolError> {
        Ok(if self.bool("has value")? { Some(Value::decode(&mut self.bytes, tensors)?) } else { None })
    }
}
