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

impl Default for Limits {
    fn default() -> Self {
        Self { max_meta: 1 << 20, max_payload: 16 << 30, max_dims: 16, max_name: 1024 }
    }
}
