//! Messages: the typed content of a frame's metadata section, and its binary encoding.
//!
//! Messages come in families, one file each: [`data`] (the connection's own messages and named
//! tensors), [`models`], [`kept`] tensors, [`sessions`] and [`breakpoints`]. A family's file
//! declares each message once (its fields, its wire code, request or reply) and encodes and
//! decodes them, so adding a message touches only its family's file. The wire codes of all
//! families are one space; `tests::kinds_are_one_space` checks that no two share a code.
//!
//! Fields are little-endian; strings are a u16 length then UTF-8; a tensor descriptor is dtype
//! (u8), rank (u8), the dimensions (u64 each) and the byte length (u64). Decoding checks every
//! count against the bytes that remain before allocating, and rejects trailing bytes.

use crate::error::{ErrorCode, ProtocolError};
use crate::limits::Limits;
use crate::tensor::TensorDesc;

/// `request` or `reply`: whether a message of this kind is what a node answers with.
macro_rules! direction {
    (request) => {
        false
    };
    (reply) => {
        true
    };
}

/// Declares a family: the enum of its messages, and the enum of their kinds with each one's
/// wire code, direction and name (`family.Variant`).
macro_rules! family {
    (
        $(#[$meta:meta])*
        $family:literal, $message:ident, $kind:ident {
            $(
                $(#[$variant_meta:meta])*
                $name:ident
                    $({ $($field:ident : $ty:ty),* $(,)? })?
                    $(($inner:ty))?
                    = $code:literal $direction:ident,
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq)]
        pub enum $message {
            $($(#[$variant_meta])* $name $({ $($field: $ty),* })? $(($inner))?,)*
        }

        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $kind {
            $($name,)*
        }

        impl $kind {
            pub const ALL: &[$kind] = &[$($kind::$name,)*];

            pub fn to_wire(self) -> u16 {
                match self { $(Self::$name => $code,)* }
            }

            pub fn from_wire(code: u16) -> Option<Self> {
                match code { $($code => Some(Self::$name),)* _ => None }
            }

            pub fn name(self) -> &'static str {
                match self { $(Self::$name => concat!($family, ".", stringify!($name)),)* }
            }

            /// True for the kinds a node sends back; a node refuses them as requests.
            pub fn is_reply(self) -> bool {
                match self { $(Self::$name => direction!($direction),)* }
            }
        }

        impl $message {
            pub fn kind(&self) -> $kind {
                match self { $(Self::$name { .. } => $kind::$name,)* }
            }
        }
    };
}

pub mod breakpoints;
pub mod data;
pub mod kept;
pub mod models;
pub mod sessions;
pub(crate) mod wire;

use breakpoints::{BreakpointKind, BreakpointMessage};
use data::{DataKind, DataMessage};
use kept::{KeptKind, KeptMessage};
use models::{ModelKind, ModelMessage};
use sessions::{SessionKind, SessionMessage};
use wire::{Reader, Writer};

/// Declares the families: a message is one of theirs, and so is a kind.
macro_rules! families {
    ($($family:ident($message:ident, $kind:ident),)*) => {
        #[derive(Debug, Clone, PartialEq)]
        pub enum Message {
            $($family($message),)*
        }

        /// A message's kind: its family's kind, and its wire code in the frame header.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Kind {
            $($family($kind),)*
        }

        $(
            impl From<$message> for Message {
                fn from(message: $message) -> Self {
                    Self::$family(message)
                }
            }
        )*

        impl Kind {
            pub fn to_wire(self) -> u16 {
                match self { $(Self::$family(k) => k.to_wire(),)* }
            }

            pub fn from_wire(code: u16) -> Option<Self> {
                None $(.or_else(|| $kind::from_wire(code).map(Self::$family)))*
            }

            pub fn name(self) -> &'static str {
                match self { $(Self::$family(k) => k.name(),)* }
            }

            /// True for the kinds a node sends back; a node refuses them as requests.
            pub fn is_reply(self) -> bool {
                match self { $(Self::$family(k) => k.is_reply(),)* }
            }

            /// Every kind of every family.
            pub fn all() -> impl Iterator<Item = Kind> {
                std::iter::empty() $(.chain($kind::ALL.iter().map(|&k| Self::$family(k))))*
            }
        }

        impl Message {
            pub fn kind(&self) -> Kind {
                match self { $(Self::$family(m) => Kind::$family(m.kind()),)* }
            }

            /// The tensors whose bytes make up this message's payload, in payload order.
            pub fn tensors(&self) -> &[TensorDesc] {
                match self { $(Self::$family(m) => m.tensors(),)* }
            }

            pub fn encode(&self, out: &mut Vec<u8>) {
                let mut w = Writer(out);
                match self { $(Self::$family(m) => m.encode(&mut w),)* }
            }

            pub fn decode(kind: Kind, meta: &[u8], limits: &Limits) -> Result<Self, ProtocolError> {
                let mut r = Reader { bytes: meta, limits };
                let message = match kind { $(Kind::$family(k) => Self::$family($message::decode(k, &mut r)?),)* };
                if !r.bytes.is_empty() {
                    return Err(ProtocolError::MalformedMeta(format!(
                        "{} bytes left over after a {} message",
                        r.bytes.len(),
                        kind.name()
                    )));
                }
                Ok(message)
            }
        }
    };
}

families! {
    Data(DataMessage, DataKind),
    Model(ModelMessage, ModelKind),
    Kept(KeptMessage, KeptKind),
    Session(SessionMessage, SessionKind),
    Breakpoint(BreakpointMessage, BreakpointKind),
}

impl Message {
    /// True for the kinds a node sends back; a node refuses them as requests.
    pub fn is_reply(&self) -> bool {
        self.kind().is_reply()
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Data(DataMessage::Error { code, message: message.into() })
    }
}
