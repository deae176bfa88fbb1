//! Breakpoints: a run parked on the node after a block, inspected, resumed or aborted.

use super::wire::{Reader, Writer};
use crate::error::ProtocolError;
use crate::tensor::TensorDesc;
use crate::value::{Handle, Value};

family! {
    /// The messages of parked requests.
    "breakpoints", BreakpointMessage, BreakpointKind {
        /// A run stopped after `block`: `parked` names it on the node. `activation` (block
        /// `block`'s output, its tensors the payload) when it was asked for.
        Paused { parked: Handle, block: u32, tensors: Vec<TensorDesc>, activation: Option<Value> } = 0x11b reply,
        /// Runs a parked request on from the block after its breakpoint, on its activation or
        /// on `activation` (its tensors the payload; the same structure, shapes and dtypes), to
        /// the end (an `ExecuteReply`) or to a later breakpoint (a `Paused` with a new handle).
        Resume { parked: Handle, tensors: Vec<TensorDesc>, activation: Option<Value>, until: Option<Breakpoint> } = 0x11c request,
        /// Asks for a parked request's activation; answered by a `Paused` that carries it.
        Inspect { parked: Handle } = 0x11d request,
        /// Drops a parked request (a session's state stays as it was before the step).
        Abort { parked: Handle } = 0x11e request,
        Aborted = 0x11f reply,
    }
}

/// Where a run stops: after block `block` (blocks `0..=block` ran), with the request parked on
/// the node until it is resumed or aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breakpoint {
    pub block: u32,
    /// The reply carries the activation (block `block`'s output); else it stays on the node.
    pub send_activation: bool,
}

impl BreakpointMessage {
    pub(super) fn tensors(&self) -> &[TensorDesc] {
        match self {
            Self::Paused { tensors, .. } | Self::Resume { tensors, .. } => tensors,
            Self::Inspect { .. } | Self::Abort { .. } | Self::Aborted => &[],
        }
    }

    pub(super) fn encode(&self, w: &mut Writer) {
        match self {
            Self::Paused { parked, block, tensors, activation } => {
                w.handle(parked);
                w.u32(*block);
                w.tensors(tensors);
                w.value(activation);
            }
            Self::Resume { parked, tensors, activation, until } => {
                w.handle(parked);
                w.tensors(tensors);
                w.value(activation);
                w.breakpoint(until);
            }
            Self::Inspect { parked } | Self::Abort { parked } => w.handle(parked),
            Self::Aborted => {}
        }
    }

    pub(super) fn decode(kind: BreakpointKind, r: &mut Reader) -> Result<Self, ProtocolError> {
        Ok(match kind {
            BreakpointKind::Paused => {
                let parked = r.handle()?;
                let block = r.u32("block")?;
                let tensors = r.tensors()?;
                let activation = r.value(tensors.len())?;
                Self::Paused { parked, block, tensors, activation }
            }
            BreakpointKind::Resume => {
                let parked = r.handle()?;
                let tensors = r.tensors()?;
                let activation = r.value(tensors.len())?;
                Self::Resume { parked, tensors, activation, until: r.breakpoint()? }
            }
            BreakpointKind::Inspect => Self::Inspect { parked: r.handle()? },
            BreakpointKind::Abort => Self::Abort { parked: r.handle()? },
            BreakpointKind::Aborted => Self::Aborted,
        })
    }
}

impl Writer<'_> {
    /// A tag (0: none, 1: stop, 2: stop and send the activation), then the block.
    pub fn breakpoint(&mut self, until: &Option<Breakpoint>) {
        match until {
            Some(b) => {
                self.u8(if b.send_activation { 2 } else { 1 });
                self.u32(b.block);
            }
            None => self.u8(0),
        }
    }
}

impl Reader<'_> {
    pub fn breakpoint(&mut self) -> Result<Option<Breakpoint>, ProtocolError> {
        let send_activation = match self.u8("breakpoint")? {
            0 => return Ok(None),
            1 => false,
            2 => true,
            v => return Err(ProtocolError::MalformedMeta(format!("breakpoint tag {v} is not 0, 1 or 2"))),
        };
        Ok(Some(Breakpoint { block: self.u32("breakpoint block")?, send_activation }))
    }
}

#[cfg(test)]
pub(crate) fn breakpoint() -> impl proptest::strategy::Strategy<Value = Option<Breakpoint>> {
    use proptest::prelude::*;
    prop::option::of(
        (any::<u32>(), any::<bool>()).prop_map(|(block, send_activation)| Breakpoint { block, send_activation }),
    )
}

#[cfg(test)]
pub(crate) fn arbitrary() -> impl proptest::strategy::Strategy<Value = BreakpointMessage> {
    use crate::strategies::{handle, tensors, value};
    use proptest::prelude::*;

    // Payload tensors, and an activation whose tensor indices name them.
    let activation = || {
        tensors().prop_flat_map(|tensors| {
            let n = tensors.len();
            (Just(tensors), prop::option::of(value(n)))
        })
    };
    prop_oneof![
        (handle(), any::<u32>(), activation()).prop_map(|(parked, block, (tensors, activation))| {
            BreakpointMessage::Paused { parked, block, tensors, activation }
        }),
        (handle(), activation(), breakpoint()).prop_map(|(parked, (tensors, activation), until)| {
            BreakpointMessage::Resume { parked, tensors, activation, until }
        }),
        handle().prop_map(|parked| BreakpointMessage::Inspect { parked }),
        handle().prop_map(|parked| BreakpointMessage::Abort { parked }),
        Just(BreakpointMessage::Aborted),
    ]
}
