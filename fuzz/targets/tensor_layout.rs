//! Tensor descriptors built from arbitrary dtype codes, shapes and byte lengths, and the layout
//! of a payload carrying the valid ones. Checks, against arithmetic in 128 bits:
//! - `TensorDesc::validate` accepts exactly the descriptors whose rank, byte length (dtype size ×
//!   the product of the dimensions) and size are within the limits;
//! - `payload_layout` places each tensor at the first multiple of `TENSOR_ALIGN` after the one
//!   before, and fails exactly when the payload's length would overflow 64 bits;
//! - `payload_len`, `paddings` and `check_tensor_lens` agree with it;
//! - an `Execute` message carrying the descriptors decodes to the same descriptors.
//!
//! Input layout, repeated: a dtype code (u8), a rank byte (its low 5 bits), each dimension as a
//! byte (bit 7 set: the next 8 bytes are the dimension, little-endian; else the byte itself),
//! and a byte-length byte (0: the length that follows from dtype and shape; 1: that plus one;
//! else the next 8 bytes). Byte 0 picks the limits: bit 0 set, no payload limit at all.

use djinn_proto::{
    DType, Fingerprint, Kind, Limits, Message, ModelKind, ModelMessage, TENSOR_ALIGN, TensorDesc, check_tensor_lens,
    paddings, payload_layout, payload_len,
};

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn u64(&mut self) -> Option<u64> {
        let (head, rest) = self.0.split_first_chunk::<8>()?;
        self.0 = rest;
        Some(u64::from_le_bytes(*head))
    }

    /// The next raw descriptor: its dtype code, shape and byte length, unchecked.
    fn descriptor(&mut self) -> Option<(u8, Vec<u64>, u64)> {
        let code = self.byte()?;
        let rank = self.byte()? & 0x1f;
        let mut shape = Vec::with_capacity(rank.into());
        for _ in 0..rank {
            let b = self.byte()?;
            shape.push(if b & 0x80 != 0 { self.u64()? } else { b.into() });
        }
        let element = DType::from_wire(code).map_or(1, DType::size);
        let computed = shape.iter().fold(u128::from(element), |acc, &d| acc.saturating_mul(d.into()));
        let byte_len = match self.byte()? {
            0 => computed as u64,
            1 => (computed as u64).wrapping_add(1),
            _ => self.u64()?,
        };
        Some((code, shape, byte_len))
    }
}

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let limits = if mode & 1 != 0 { Limits { max_payload: u64::MAX, ..Limits::default() } } else { Limits::default() };
    let mut input = Input(rest);
    let mut valid = Vec::new();
    while let Some((code, shape, byte_len)) = input.descriptor() {
        let Some(dtype) = DType::from_wire(code) else { continue };
        // An empty tensor is empty whatever its other dimensions.
        let expected = if shape.contains(&0) {
            Some(0)
        } else {
            shape.iter().try_fold(u128::from(dtype.size()), |acc, &d| acc.checked_mul(d.into()))
        };
        let should_pass = shape.len() <= limits.max_dims
            && expected.is_some_and(|e| e <= u128::from(u64::MAX) && e == u128::from(byte_len))
            && byte_len <= limits.max_payload;
        let desc = TensorDesc { dtype, shape, byte_len };
        let result = desc.validate(&limits);
        assert_eq!(result.is_ok(), should_pass, "{desc:?}: {result:?}");
        if result.is_ok() {
            assert_eq!(TensorDesc::new(dtype, desc.shape.clone()).as_ref(), Ok(&desc));
            valid.push(desc);
        }
    }

    let end = valid.iter().try_fold(0u128, |end, d| {
        let start = end.next_multiple_of(u128::from(TENSOR_ALIGN));
        let end = start + u128::from(d.byte_len);
        (start <= u128::from(u64::MAX) && end <= u128::from(u64::MAX)).then_some(end)
    });
    match payload_layout(&valid) {
        Ok((offsets, total)) => {
            assert_eq!(Some(u128::from(total)), end);
            assert_eq!(payload_len(&valid), Ok(total));
            let mut previous_end = 0u64;
            for ((offset, desc), padding) in offsets.iter().zip(&valid).zip(paddings(&valid)) {
                assert_eq!(offset % TENSOR_ALIGN, 0);
                assert!(*offset >= previous_end && offset - previous_end < TENSOR_ALIGN);
                assert_eq!(padding as u64, offset - previous_end);
                previous_end = offset + desc.byte_len;
            }
            assert_eq!(previous_end, total);
            let lens: Vec<usize> = valid.iter().map(|d| d.byte_len as usize).collect();
            if valid.iter().all(|d| usize::try_from(d.byte_len).is_ok()) {
                assert!(check_tensor_lens(&valid, lens.iter().copied()).is_ok());
                if let Some(first) = lens.first() {
                    let mut wrong = lens.clone();
                    wrong[0] = first.wrapping_add(1);
                    assert!(check_tensor_lens(&valid, wrong.into_iter()).is_err());
                }
            }
        }
        Err(e) => {
            assert_eq!(end, None, "layout refused a payload that fits 64 bits: {e}");
            assert!(payload_len(&valid).is_err());
        }
    }

    // The descriptors go over the wire unchanged (a message whose payload would not fit 64
    // bits is refused whole, as checked above).
    if end.is_none() {
        return;
    }
    let message = Message::Model(ModelMessage::Execute {
        fingerprint: Fingerprint([0; 32]),
        tensors: valid.clone(),
        inputs: Vec::new(),
        keep: false,
        until: None,
    });
    let mut meta = Vec::new();
    message.encode(&mut meta);
    let wide = Limits { max_meta: u32::MAX, ..limits };
    match Message::decode(Kind::Model(ModelKind::Execute), &meta, &wide) {
        Ok(Message::Model(ModelMessage::Execute { tensors, .. })) => assert_eq!(tensors, valid),
        other => panic!("an Execute of valid descriptors does not decode: {other:?}"),
    }
}
