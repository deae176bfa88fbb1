/// Bounds every length read from the wire is checked against before anything is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest metadata section, bytes.
    pub max_meta: u32,
    /// Largest payload of one frame, bytes (inclusive: a payload of exactly this size is fine).
    pub max_payload: u64,
    /// Most dimensions a tensor may have.
    pub max_dims: usize,
    /// Longest tensor name, bytes of UTF-8.
    pub max_name: usize,
}

/// The metadata a frame may carry before its connection's hello: a hello, a ping.
pub const MAX_META_BEFORE_HELLO: u32 = 4096;

impl Limits {
    /// These limits for a connection that has not said a good hello yet: a frame head of a few
    /// KiB is all a stranger may make a node hold.
    pub fn before_hello(self) -> Self {
        Self { max_meta: self.max_meta.min(MAX_META_BEFORE_HELLO), ..self }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_meta: 1 << 20, max_payload: 16 << 30, max_dims: 16, max_name: 1024 }
    }
}
