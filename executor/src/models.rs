//! Registered models: uploads in progress, loading, the fingerprint → model map shared by every
//! client, and LRU eviction of idle models under the node's memory budget.

use std::collections::HashMap;
use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use djinn_dataplane::proto::{Fingerprint, ModelInfo, Payload};
use djinn_gpudirect::{MemoryBudget, OverBudget, Reservation};
use tch::jit::{CModule, IValue};
use tch::{Device, Tensor};

use crate::error::ExecError;

/// A model on the node's device: its blocks in execution order.
pub struct Model {
    pub fingerprint: Fingerprint,
    blocks: Vec<CModule>,
    pub weight_bytes: u64,
    pub device: Device,
    executions: AtomicU64,
    _reservation: Reservation,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("fingerprint", &self.fingerprint)
            .field("blocks", &self.blocks.len())
            .field("weight_bytes", &self.weight_bytes)
            .finish()
    }
}

pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

impl Model {
    pub fn info(&self) -> ModelInfo {
        ModelInfo {
            fingerprint: self.fingerprint,
            blocks: self.blocks.len() as u32,
            weight_bytes: self.weight_bytes,
            device: device_name(self.device),
            executions: self.executions.load(Ordering::Relaxed),
        }
    }

    /// Runs the blocks in order. A block's tuple output is spread over the next block's
    /// arguments (as the Python package chains blocks); the last block's output is returned.
    pub fn forward(&self, args: Vec<IValue>) -> Result<IValue, ExecError> {
        let _guard = tch::no_grad_guard();
        let (last, first) =
            self.blocks.split_last().ok_or_else(|| ExecError::Internal("a model without blocks".into()))?;
        let mut args = args;
        for block in first {
            args = match block.forward_is(&args)? {
                IValue::Tuple(items) => items,
                other => vec![other],
            };
        }
        let out = last.forward_is(&args)?;
        self.executions.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }
}

/// The bytes of a model being uploaded: its blocks' archives, concatenated, in the chunks they
/// arrived in (kept as received, not copied together).
#[derive(Debug)]
pub struct Upload {
    pub fingerprint: Fingerprint,
    pub block_lens: Vec<u64>,
    pub total: u64,
    pub received: u64,
    pub connection: u64,
    chunks: Vec<Payload>,
}

impl Upload {
    pub fn new(fingerprint: Fingerprint, block_lens: Vec<u64>, connection: u64) -> Result<Self, String> {
        if block_lens.is_empty() {
            return Err("a model needs at least one block".into());
        }
        let total = block_lens.iter().try_fold(0u64, |a, &b| a.checked_add(b)).ok_or("block lengths overflow")?;
        Ok(Self { fingerprint, block_lens, total, received: 0, connection, chunks: Vec::new() })
    }

    /// Appends the chunk that starts at `offset`; chunks come in order.
    pub fn add(&mut self, offset: u64, chunk: Payload) -> Result<(), String> {
        let len = chunk.buf.len() as u64;
        if offset != self.received {
            return Err(format!("chunk at offset {offset}, expected {}", self.received));
        }
        if self.received + len > self.total {
            return Err(format!("chunk ends at {} past the model's {} bytes", self.received + len, self.total));
        }
        self.received += len;
        self.chunks.push(chunk);
        Ok(())
    }

    fn block_readers(&self) -> Vec<ChunkReader<'_>> {
        let mut start = 0;
        self.block_lens
            .iter()
            .map(|&len| {
                let reader = ChunkReader::new(&self.chunks, start, len);
                start += len;
                reader
            })
            .collect()
    }

    /// Verifies the fingerprint and loads every block onto `device`.
    pub fn load(self, device: Device) -> Result<LoadedModel, ExecError> {
        if self.received != self.total {
            return Err(ExecError::BadArchive(format!("{} of {} bytes uploaded", self.received, self.total)));
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update(&(self.block_lens.len() as u64).to_le_bytes());
        for (reader, len) in self.block_readers().into_iter().zip(&self.block_lens) {
            hasher.update(&len.to_le_bytes());
            for slice in reader.slices() {
                hasher.update(slice);
            }
        }
        let computed = Fingerprint(*hasher.finalize().as_bytes());
        if computed != self.fingerprint {
            return Err(ExecError::BadArchive(format!(
                "the archives hash to {computed}, not to the announced fingerprint {}",
                self.fingerprint
            )));
        }
        let mut blocks = Vec::with_capacity(self.block_lens.len());
        for (i, mut reader) in self.block_readers().into_iter().enumerate() {
            let mut block = CModule::load_data_on_device(&mut reader, device)
                .map_err(|e| ExecError::BadArchive(format!("block {i} is not a TorchScript archive: {e}")))?;
            block.f_set_eval()?;
            blocks.push(block);
        }
        let weight_bytes = blocks.iter().try_fold(0u64, |acc, b| {
            Ok::<_, ExecError>(acc + b.named_parameters()?.iter().map(|(_, t)| tensor_bytes(t)).sum::<u64>())
        })?;
        Ok(LoadedModel { fingerprint: self.fingerprint, blocks, weight_bytes, device })
    }
}

fn tensor_bytes(t: &Tensor) -> u64 {
    t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
}

/// Reads bytes `start..start + len` of a list of chunks.
struct ChunkReader<'a> {
    chunks: &'a [Payload],
    chunk: usize,
    offset: usize,
    left: u64,
}

impl<'a> ChunkReader<'a> {
    fn new(chunks: &'a [Payload], start: u64, len: u64) -> Self {
        let mut chunk = 0;
        let mut start = start;
        while chunk < chunks.len() && start >= chunks[chunk].buf.len() as u64 {
            start -= chunks[chunk].buf.len() as u64;
            chunk += 1;
        }
        Self { chunks, chunk, offset: start as usize, left: len }
    }

    fn slices(self) -> impl Iterator<Item = &'a [u8]> {
        let mut reader = self;
        std::iter::from_fn(move || {
            while reader.left > 0 && reader.chunk < reader.chunks.len() {
                let bytes = &reader.chunks[reader.chunk].buf.as_slice()[reader.offset..];
                let n = bytes.len().min(reader.left as usize);
                reader.chunk += 1;
                reader.offset = 0;
                reader.left -= n as u64;
                if n > 0 {
                    return Some(&bytes[..n]);
                }
            }
            None
        })
    }
}

impl Read for ChunkReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.left > 0 && self.chunk < self.chunks.len() {
            let bytes = &self.chunks[self.chunk].buf.as_slice()[self.offset..];
            if bytes.is_empty() {
                self.chunk += 1;
                self.offset = 0;
                continue;
            }
            let n = bytes.len().min(out.len()).min(self.left as usize);
            out[..n].copy_from_slice(&bytes[..n]);
            self.offset += n;
            self.left -= n as u64;
            return Ok(n);
        }
        Ok(0)
    }
}

/// A model loaded on the device but not yet charged to the budget nor visible to clients.
pub struct LoadedModel {
    fingerprint: Fingerprint,
    blocks: Vec<CModule>,
    weight_bytes: u64,
    device: Device,
}

struct Entry {
    model: Arc<Model>,
    last_used: u64,
}

/// Fingerprint → model, shared by the poller (look-ups) and the workers (inserts after loads).
pub struct ModelStore {
    budget: MemoryBudget,
    models: HashMap<Fingerprint, Entry>,
    clock: u64,
    evictions: u64,
}

impl std::fmt::Debug for ModelStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelStore").field("models", &self.models.len()).finish()
    }
}

impl ModelStore {
    pub fn new(budget: MemoryBudget) -> Self {
        Self { budget, models: HashMap::new(), clock: 0, evictions: 0 }
    }

    /// The model, marked as just used.
    pub fn get(&mut self, fingerprint: &Fingerprint) -> Option<Arc<Model>> {
        self.clock += 1;
        let entry = self.models.get_mut(fingerprint)?;
        entry.last_used = self.clock;
        Some(Arc::clone(&entry.model))
    }

    pub fn contains(&self, fingerprint: &Fingerprint) -> bool {
        self.models.contains_key(fingerprint)
    }

    /// Makes a loaded model visible, charging its weights to the budget and evicting idle
    /// models (least recently used first) to make room. A model some request is using is never
    /// evicted. If the fingerprint is already here (two clients uploaded it at once), the copy
    /// already serving is kept.
    pub fn insert(&mut self, loaded: LoadedModel) -> Result<Arc<Model>, OverBudget> {
        if let Some(existing) = self.get(&loaded.fingerprint) {
            return Ok(existing);
        }
        let reservation = self.reserve_evicting(loaded.weight_bytes)?;
        self.clock += 1;
        let model = Arc::new(Model {
            fingerprint: loaded.fingerprint,
            blocks: loaded.blocks,
            weight_bytes: loaded.weight_bytes,
            device: loaded.device,
            executions: AtomicU64::new(0),
            _reservation: reservation,
        });
        self.models.insert(model.fingerprint, Entry { model: Arc::clone(&model), last_used: self.clock });
        Ok(model)
    }

    /// Takes `bytes` from the budget, evicting idle models as needed.
    pub fn reserve_evicting(&mut self, bytes: u64) -> Result<Reservation, OverBudget> {
        loop {
            match self.budget.try_reserve(bytes) {
                Ok(r) => return Ok(r),
                Err(over) => {
                    let idle = self
                        .models
                        .iter()
                        .filter(|(_, e)| Arc::strong_count(&e.model) == 1)
                        .min_by_key(|(_, e)| e.last_used)
                        .map(|(f, _)| *f);
                    let Some(victim) = idle else { return Err(over) };
                    let entry = self.models.remove(&victim);
                    self.evictions += 1;
                    tracing::info!(model = %victim, bytes = entry.map_or(0, |e| e.model.weight_bytes), "evicted an idle model");
                }
            }
        }
    }

    pub fn remove(&mut self, fingerprint: &Fingerprint) -> bool {
        self.models.remove(fingerprint).is_some()
    }

    pub fn list(&self) -> Vec<ModelInfo> {
        let mut infos: Vec<ModelInfo> = self.models.values().map(|e| e.model.info()).collect();
        infos.sort_by_key(|m| m.fingerprint);
        infos
    }

    pub fn stats(&self, out: &mut Vec<(String, u64)>) {
        out.push(("models".into(), self.models.len() as u64));
        out.push(("model_bytes".into(), self.models.values().map(|e| e.model.weight_bytes).sum()));
        out.push(("model_evictions".into(), self.evictions));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(tag: u8, weight_bytes: u64) -> LoadedModel {
        LoadedModel { fingerprint: Fingerprint([tag; 32]), blocks: Vec::new(), weight_bytes, device: Device::Cpu }
    }

    #[test]
    fn a_model_in_use_is_never_evicted() {
        let budget = MemoryBudget::new(100);
        let mut store = ModelStore::new(budget.clone());
        let a = store.insert(loaded(1, 60)).unwrap();
        // `a` is held, as a running request holds its model: no room for b.
        assert!(store.insert(loaded(2, 60)).is_err());
        assert!(store.contains(&Fingerprint([1; 32])));
        drop(a);
        store.insert(loaded(2, 60)).unwrap();
        assert!(!store.contains(&Fingerprint([1; 32])));
        assert_eq!(budget.used(), 60);
    }

    #[test]
    fn the_least_recently_used_idle_model_goes_first() {
        let mut store = ModelStore::new(MemoryBudget::new(100));
        store.insert(loaded(1, 40)).unwrap();
        store.insert(loaded(2, 40)).unwrap();
        store.get(&Fingerprint([1; 32]));
        store.insert(loaded(3, 40)).unwrap();
        assert!(store.contains(&Fingerprint([1; 32])) && !store.contains(&Fingerprint([2; 32])));
    }

    #[test]
    fn chunks_are_read_back_across_their_boundaries() {
        let chunk =
            |bytes: &[u8]| Payload { buf: djinn_gpudirect::HostBuf::copy_from(bytes).unwrap(), reservation: None };
        let mut upload = Upload::new(Fingerprint([0; 32]), vec![3, 4], 1).unwrap();
        upload.add(0, chunk(b"ab")).unwrap();
        upload.add(2, chunk(b"cdef")).unwrap();
        assert!(upload.add(5, chunk(b"g")).is_err(), "out of order");
        upload.add(6, chunk(b"g")).unwrap();
        let blocks: Vec<Vec<u8>> = upload
            .block_readers()
            .into_iter()
            .map(|mut r| {
                let mut v = Vec::new();
                r.read_to_end(&mut v).unwrap();
                v
            })
            .collect();
        assert_eq!(blocks, vec![b"abc".to_vec(), b"defg".to_vec()]);
    }
}
