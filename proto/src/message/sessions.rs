//! Sessions: a model's state that stays on the node between steps.

use super::breakpoints::Breakpoint;
use super::models::Fingerprint;
use super::wire::{Reader, Writer};
use crate::error::ProtocolError;
use crate::tensor::TensorDesc;
use crate::value::{Handle, Value};

family! {
    /// The messages of sessions. Their steps are answered by a `models.ExecuteReply`, or by a
    /// `breakpoints.Paused`.
    "sessions", SessionMessage, SessionKind {
        /// Opens a session of a registered model: the payload's tensors (`state`) are its
        /// initial state, which stays on the node between steps; `reserve` is the state's
        /// expected size at its largest (bytes), charged to the session budget while the state
        /// is on the device.
        Open { fingerprint: Fingerprint, state: Vec<TensorDesc>, reserve: u64 } = 0x114 request,
        Opened { session: Handle } = 0x115 reply,
        /// Runs the session's model on `inputs` followed by its state tensors. The model
        /// returns a tuple whose last items are the new state (as many as the state has
        /// tensors); the rest comes back in an `ExecuteReply` (one item unwrapped). With
        /// `until`, the step stops at that breakpoint; the session's later requests wait until
        /// it is resumed or aborted.
        Step { session: Handle, tensors: Vec<TensorDesc>, inputs: Vec<Value>, until: Option<Breakpoint> } = 0x116 request,
        /// Takes effect after the session's earlier steps and signals, before its later ones.
        Signal { session: Handle, signal: Signal } = 0x117 request,
        Signaled = 0x118 reply,
        /// Frees the session's state (after its earlier steps).
        Close { session: Handle } = 0x119 request,
        Closed = 0x11a reply,
        /// Moves the session to the node at `to` (host:port, as this node reaches it), after
        /// its earlier requests: this node sends the state there on `grant` (what that node's
        /// `ReceiveGrant` gave the tenant) and frees it once that node holds it. Answered by
        /// `Moved`; a move that fails leaves the session here, whole.
        Move { session: Handle, to: String, grant: String } = 0x122 request,
        /// The session is on the node at `to` now, as `session`: the answer to a `Move`, and to
        /// any later request for the session here.
        Moved { to: String, session: Handle } = 0x123 reply,
        /// Asks this node for a one-time capability to receive, for the caller's tenant, a
        /// session of the model `fingerprint` moved from another node. Answered by
        /// `kept.PushGranted`.
        ReceiveGrant { fingerprint: Fingerprint } = 0x124 request,
        /// Lists the caller's sessions (a node's or an operator's: every tenant's, what a
        /// draining node moves) whose ids come after `after`, in order; a page at most.
        List { after: u64 } = 0x127 request,
        /// `more`: sessions past the last listed remain.
        SessionList { sessions: Vec<SessionEntry>, more: bool } = 0x128 reply,
    }
}

/// A session a node holds, as `List` tells of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionEntry {
    /// Whose it is, by name: empty in a tenant's own list, and where the node needs no token.
    pub tenant: String,
    pub session: Handle,
    pub fingerprint: Fingerprint,
    /// Bytes of its state now.
    pub state_bytes: u64,
}

/// What a session's client says of it between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// The agent waits on something else (a tool): its state may leave the device, to be back
    /// before `resume_in_ms` when given.
    IoWait { resume_in_ms: Option<u32> },
    /// The agent computes again soon: bring its state back to the device.
    Compute,
}

impl SessionMessage {
    pub(super) fn tensors(&self) -> &[TensorDesc] {
        match self {
            Self::Open { state: tensors, .. } | Self::Step { tensors, .. } => tensors,
            Self::Opened { .. }
            | Self::Signal { .. }
            | Self::Signaled
            | Self::Close { .. }
            | Self::Closed
            | Self::Move { .. }
            | Self::Moved { .. }
            | Self::ReceiveGrant { .. }
            | Self::List { .. }
            | Self::SessionList { .. } => &[],
        }
    }

    pub(super) fn encode(&self, w: &mut Writer) {
        match self {
            Self::Open { fingerprint, state, reserve } => {
                w.fingerprint(fingerprint);
                w.tensors(state);
                w.u64(*reserve);
            }
            Self::Opened { session } | Self::Close { session } => w.handle(session),
            Self::Step { session, tensors, inputs, until } => {
                w.handle(session);
                w.tensors(tensors);
                w.values(inputs);
                w.breakpoint(until);
            }
            Self::Signal { session, signal } => {
                w.handle(session);
                w.signal(signal);
            }
            Self::Signaled | Self::Closed => {}
            Self::Move { session, to, grant } => {
                w.handle(session);
                w.str(to);
                w.str(grant);
            }
            Self::Moved { to, session } => {
                w.str(to);
                w.handle(session);
            }
            Self::ReceiveGrant { fingerprint } => w.fingerprint(fingerprint),
            Self::List { after } => w.u64(*after),
            Self::SessionList { sessions, more } => {
                w.list(sessions, |w, e| {
                    w.str(&e.tenant);
                    w.handle(&e.session);
                    w.fingerprint(&e.fingerprint);
                    w.u64(e.state_bytes);
                });
                w.bool(*more);
            }
        }
    }

    pub(super) fn decode(kind: SessionKind, r: &mut Reader) -> Result<Self, ProtocolError> {
        Ok(match kind {
            SessionKind::Open => {
                Self::Open { fingerprint: r.fingerprint()?, state: r.tensors()?, reserve: r.u64("reserve")? }
            }
            SessionKind::Opened => Self::Opened { session: r.handle()? },
            SessionKind::Step => {
                let session = r.handle()?;
                let tensors = r.tensors()?;
                let inputs = r.values(tensors.len())?;
                Self::Step { session, tensors, inputs, until: r.breakpoint()? }
            }
            SessionKind::Signal => Self::Signal { session: r.handle()?, signal: r.signal()? },
            SessionKind::Signaled => Self::Signaled,
            SessionKind::Close => Self::Close { session: r.handle()? },
            SessionKind::Closed => Self::Closed,
            SessionKind::Move => {
                Self::Move { session: r.handle()?, to: r.string("peer address")?, grant: r.string("grant")? }
            }
            SessionKind::Moved => Self::Moved { to: r.string("peer address")?, session: r.handle()? },
            SessionKind::ReceiveGrant => Self::ReceiveGrant { fingerprint: r.fingerprint()? },
            SessionKind::List => Self::List { after: r.u64("after")? },
            // The smallest entry: an empty name, a handle, a fingerprint, a u64.
            SessionKind::SessionList => Self::SessionList {
                sessions: r.list("sessions", 2 + 16 + 32 + 8, |r| {
                    Ok(SessionEntry {
                        tenant: r.string("tenant")?,
                        session: r.handle()?,
                        fingerprint: r.fingerprint()?,
                        state_bytes: r.u64("state bytes")?,
                    })
                })?,
                more: r.bool("more")?,
            },
        })
    }
}

impl Writer<'_> {
    /// A tag (0: I/O wait, with a flag and the time when given; 1: compute).
    pub fn signal(&mut self, signal: &Signal) {
        match signal {
            Signal::IoWait { resume_in_ms } => {
                self.u8(0);
                match resume_in_ms {
                    Some(ms) => {
                        self.u8(1);
                        self.u32(*ms);
                    }
                    None => self.u8(0),
                }
            }
            Signal::Compute => self.u8(1),
        }
    }
}

impl Reader<'_> {
    pub fn signal(&mut self) -> Result<Signal, ProtocolError> {
        Ok(match self.u8("signal")? {
            0 => Signal::IoWait {
                resume_in_ms: if self.bool("has resume time")? { Some(self.u32("resume in ms")?) } else { None },
            },
            1 => Signal::Compute,
            v => return Err(ProtocolError::MalformedMeta(format!("signal {v} is neither 0 nor 1"))),
        })
    }
}

#[cfg(test)]
pub(crate) fn arbitrary() -> impl proptest::strategy::Strategy<Value = SessionMessage> {
    use super::breakpoints::breakpoint;
    use super::models::fingerprint;
    use crate::strategies::{handle, name, tensors, values};
    use proptest::prelude::*;

    let signal = prop_oneof![
        prop::option::of(any::<u32>()).prop_map(|resume_in_ms| Signal::IoWait { resume_in_ms }),
        Just(Signal::Compute),
    ];
    prop_oneof![
        (fingerprint(), tensors(), any::<u64>()).prop_map(|(fingerprint, state, reserve)| SessionMessage::Open {
            fingerprint,
            state,
            reserve
        }),
        handle().prop_map(|session| SessionMessage::Opened { session }),
        (handle(), tensors())
            .prop_flat_map(|(h, tensors)| {
                let n = tensors.len();
                (Just(h), Just(tensors), values(n), breakpoint())
            })
            .prop_map(|(session, tensors, inputs, until)| SessionMessage::Step { session, tensors, inputs, until }),
        (handle(), signal).prop_map(|(session, signal)| SessionMessage::Signal { session, signal }),
        Just(SessionMessage::Signaled),
        handle().prop_map(|session| SessionMessage::Close { session }),
        Just(SessionMessage::Closed),
        (handle(), name(), name()).prop_map(|(session, to, grant)| SessionMessage::Move { session, to, grant }),
        (name(), handle()).prop_map(|(to, session)| SessionMessage::Moved { to, session }),
        fingerprint().prop_map(|fingerprint| SessionMessage::ReceiveGrant { fingerprint }),
        any::<u64>().prop_map(|after| SessionMessage::List { after }),
        (
            prop::collection::vec(
                ("[a-z]{0,8}", handle(), fingerprint(), any::<u64>()).prop_map(
                    |(tenant, session, fingerprint, state_bytes)| SessionEntry {
                        tenant,
                        session,
                        fingerprint,
                        state_bytes
                    }
                ),
                0..4
            ),
            any::<bool>()
        )
            .prop_map(|(sessions, more)| SessionMessage::SessionList { sessions, more }),
    ]
}
