//! Tensor descriptors: what a payload's bytes mean. A descriptor whose byte length disagrees with
//! its dtype and shape is an error, never a silent reinterpretation.

use std::fmt;
use std::str::FromStr;

use super::error::ProtocolError;
use super::limits::Limits;

/// Each tensor of a payload starts at a multiple of this many bytes from the payload's start,
/// so a received payload (itself 64-byte aligned) can back tensors without a copy.
pub const TENSOR_ALIGN: u64 = 64;

macro_rules! dtypes {
    ($($name:ident = $code:literal, $size:literal, $text:literal;)*) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum DType { $($name,)* }

        impl DType {
            pub const ALL: &[DType] = &[$(DType::$name,)*];

            pub fn to_wire(self) -> u8 {
                match self { $(DType::$name => $code,)* }
            }

            pub fn from_wire(code: u8) -> Option<Self> {
                match code { $($code => Some(DType::$name),)* _ => None }
            }

            /// Bytes per element.
            pub fn size(self) -> u64 {
                match self { $(DType::$name => $size,)* }
            }

            /// The name torch gives it (`torch.float16` is `f16` here).
            pub fn name(self) -> &'static str {
                match self { $(DType::$name => $text,)* }
            }
        }

        impl FromStr for DType {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s { $($text => Ok(DType::$name),)* _ => Err(format!("unknown dtype {s:?}")) }
            }
        }
    };
}

dtypes! {
    F16 = 1, 2, "f16";
    BF16 = 2, 2, "bf16";
    F32 = 3, 4, "f32";
    F64 = 4, 8, "f64";
    I8 = 5, 1, "i8";
    I16 = 6, 2, "i16";
    I32 = 7, 4, "i32";
    I64 = 8, 8, "i64";
    U8 = 9, 1, "u8";
    Bool = 10, 1, "bool";
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorDesc {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub byte_len: u64,
}

impl TensorDesc {
    /// A descriptor whose byte length follows from dtype and shape.
    pub fn new(dtype: DType, shape: Vec<u64>) -> Result<Self, ProtocolError> {
        let byte_len = Self::expected_len(dtype, &shape)?;
        Ok(Self { dtype, shape, byte_len })
    }

    /// Elements, for a descriptor that validated (the product of the dimensions could overflow
    /// on the way even when one of them is zero).
    pub fn numel(&self) -> u64 {
        self.byte_len / self.dtype.size()
    }

    fn expected_len(dtype: DType, shape: &[u64]) -> Result<u64, ProtocolError> {
        // An empty tensor is empty whatever its other dimensions.
        if shape.contains(&0) {
            return Ok(0);
        }
        shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| ProtocolError::BadDescriptor(format!("shape {shape:?} of {dtype} overflows 64 bits")))
    }

    pub fn validate(&self, limits: &Limits) -> Result<(), ProtocolError> {
        if self.shape.len() > limits.max_dims {
            return Err(ProtocolError::BadDescriptor(format!(
                "{} dimensions, more than the limit of {}",
                self.shape.len(),
                limits.max_dims
            )));
        }
        let expected = Self::expected_len(self.dtype, &self.shape)?;
        if expected != self.byte_len {
            return Err(ProtocolError::BadDescriptor(format!(
                "byte length {} disagrees with {} × {:?} = {expected} bytes",
                self.byte_len, self.dtype, self.shape
            )));
        }
        if self.byte_len > limits.max_payload {
            return Err(ProtocolError::FrameTooLarge { len: self.byte_len, limit: limits.max_payload });
        }
        Ok(())
    }
}

impl fmt::Display for TensorDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?} ({} bytes)", self.dtype, self.shape, self.byte_len)
    }
}

/// Where each tensor starts in a payload, and the payload's total length: tensors in order, each
/// at the next multiple of [`TENSOR_ALIGN`], zero padding between them.
pub fn payload_layout(tensors: &[TensorDesc]) -> Result<(Vec<u64>, u64), ProtocolError> {
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut end = 0u64;
    for t in tensors {
        let start = tensor_start(end)?;
        offsets.push(start);
        end = tensor_end(start, t.byte_len)?;
    }
    Ok((offsets, end))
}

/// The payload length [`payload_layout`] gives, without the offsets (nothing allocated).
pub fn payload_len(tensors: &[TensorDesc]) -> Result<u64, ProtocolError> {
    tensors.iter().try_fold(0, |end, t| tensor_end(tensor_start(end)?, t.byte_len))
}

/// Checks the byte lengths of the tensors going with a message against its descriptors.
pub fn check_tensor_lens(
    descs: &[TensorDesc],
    lens: impl ExactSizeIterator<Item = usize>,
) -> Result<(), ProtocolError> {
    if descs.len() != lens.len() {
        return Err(ProtocolError::PayloadMismatch { announced: lens.len() as u64, expected: descs.len() as u64 });
    }
    for (len, desc) in lens.zip(descs) {
        if len as u64 != desc.byte_len {
            return Err(ProtocolError::PayloadMismatch { announced: len as u64, expected: desc.byte_len });
        }
    }
    Ok(())
}

/// The zero padding before each tensor of a payload ([`payload_layout`]), whose length is
/// known not to overflow ([`payload_len`] succeeded).
pub fn paddings(descs: &[TensorDesc]) -> impl Iterator<Item = usize> + '_ {
    let mut end = 0u64;
    descs.iter().map(move |desc| {
        let start = end.next_multiple_of(TENSOR_ALIGN);
        let padding = (start - end) as usize;
        end = start + desc.byte_len;
        padding
    })
}

/// Where the tensor after one ending at `end` starts.
fn tensor_start(end: u64) -> Result<u64, ProtocolError> {
    end.checked_next_multiple_of(TENSOR_ALIGN).ok_or_else(overflow)
}

fn tensor_end(start: u64, byte_len: u64) -> Result<u64, ProtocolError> {
    start.checked_add(byte_len).ok_or_else(overflow)
}

fn overflow() -> ProtocolError {
    ProtocolError::BadDescriptor("payload length overflows 64 bits".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_length_must_match_dtype_and_shape() {
        let limits = Limits::default();
        let good = TensorDesc::new(DType::BF16, vec![3, 5]).unwrap();
        assert_eq!(good.byte_len, 30);
        good.validate(&limits).unwrap();
        let bad = TensorDesc { byte_len: 60, ..good };
        assert!(matches!(bad.validate(&limits), Err(ProtocolError::BadDescriptor(_))));
        assert!(TensorDesc::new(DType::F64, vec![u64::MAX, 2]).is_err());
    }

    #[test]
    fn scalars_and_empty_tensors() {
        assert_eq!(TensorDesc::new(DType::F32, vec![]).unwrap().byte_len, 4);
        assert_eq!(TensorDesc::new(DType::F32, vec![0, 7]).unwrap().byte_len, 0);
        // Found by the tensor_layout fuzz target: the product of the other dimensions may
        // overflow; the tensor is still empty.
        let empty = TensorDesc::new(DType::F32, vec![16213159869161668608, 0]).unwrap();
        assert_eq!(empty.byte_len, 0);
        empty.validate(&Limits::default()).unwrap();
    }

    #[test]
    fn layout_aligns_every_tensor() {
        let t = |n| TensorDesc::new(DType::U8, vec![n]).unwrap();
        let (offsets, total) = payload_layout(&[t(3), t(64), t(1)]).unwrap();
        assert_eq!(offsets, vec![0, 64, 128]);
        assert_eq!(total, 129);
    }

    #[test]
    fn dtype_codes_and_names_round_trip() {
        for &d in DType::ALL {
            assert_eq!(DType::from_wire(d.to_wire()), Some(d));
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
    }
}
