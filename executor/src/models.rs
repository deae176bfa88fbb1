//! Registered models: uploads in progress, loading, the (scope, fingerprint) → model map, and
//! LRU eviction of idle models under the node's memory budget.
//!
//! A model is private to the tenant that registered it (another tenant registering the same
//! bytes gets a copy of its own: sharing would tell one tenant what another holds), or public:
//! held once, and usable by every tenant that registered those bytes as public.
//!
//! Each holder's quota is charged the model's device bytes (a public model's, once per
//! holder). A tenant over its quota first lets go of its own idle models; it may evict other
//! tenants' idle models only while what it holds is within its fair share of the budget.

use std::collections::{BTreeMap, HashMap};
use std::io::Read as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use djinn_auth::TenantId;
use djinn_memory::{Charge, MemoryBudget, OverBudget, Reservation};
use djinn_node_core::{Scope, Upload};
use djinn_proto::{BlockReader, Fingerprint, ModelInfo};
use tch::jit::CModule;
use tch::{Device, Tensor};

use crate::error::ExecError;
use crate::graph::GraphModule;
use crate::stream::{Plan, StreamStats, StreamedBlock, Streamer, plan};
use crate::tensors::tensor_bytes;
use crate::value::ModelValue;
use djinn_gpudirect::CudaContext;
use djinn_sync::Locked;

/// A model on the node's device: its blocks in execution order, some of them streamed when the
/// whole does not fit.
pub struct Model {
    pub fingerprint: Fingerprint,
    blocks: Vec<Block>,
    pub weight_bytes: u64,
    pub device: Device,
    executions: AtomicU64,
    /// The streamed blocks and their ring; one forward at a time goes through it.
    stream: Option<Mutex<Streamer>>,
    stream_stats: Option<Arc<StreamStats>>,
    reservation: Reservations,
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

/// The inverse of [`device_name`], and `auto`: the first GPU libtorch sees, else the CPU.
pub fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "auto" => Ok(Device::cuda_if_available()),
        "cpu" => Ok(Device::Cpu),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("{s:?} is not a device: use auto, cpu or cuda:N")),
    }
}

/// Loads an upload into `models` as a node does: sized against what is free, planned and
/// reserved, then published. The store is locked between the steps, never while loading.
pub fn load(upload: Upload, device: Device, models: &Mutex<ModelStore>) -> Result<Arc<Model>, ExecError> {
    let lock = || models.locked();
    let (scope, tenant) = (upload.scope, upload.tenant);
    let available = lock().available(tenant);
    let loaded = upload.load(device, available)?;
    let (plan, reservation, mut hold) = lock().reserve_for(&loaded, tenant)?;
    let model = loaded.into_model(&plan, reservation)?;
    let mut store = lock();
    hold._program = Some(store.program_charge(tenant, &model)?);
    Ok(store.publish(model, scope, (tenant, hold)))
}

impl Model {
    pub fn info(&self) -> ModelInfo {
        ModelInfo {
            fingerprint: self.fingerprint,
            blocks: self.blocks.len() as u32,
            weight_bytes: self.weight_bytes,
            device: device_name(self.device),
            executions: self.executions.load(Ordering::Relaxed),
            owners: Vec::new(),
        }
    }

    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Runs the blocks in order. A block's tuple output is spread over the next block's
    /// arguments (as the Python package chains blocks); the last block's output is returned.
    pub fn forward(&self, args: Vec<ModelValue>) -> Result<ModelValue, ExecError> {
        self.forward_range(args, 0, self.blocks.len().saturating_sub(1))
    }

    /// Runs blocks `first..=last` (a part of a run stopped at a breakpoint, or resumed from
    /// one) and returns the output of `last`.
    pub fn forward_range(&self, args: Vec<ModelValue>, first: usize, last: usize) -> Result<ModelValue, ExecError> {
        if first > last || last >= self.blocks.len() {
            return Err(ExecError::Internal(format!("blocks {first}..={last} of a model of {}", self.blocks.len())));
        }
        let _guard = tch::no_grad_guard();
        // A run that starts past block 0 makes the streamer bring its blocks in from there.
        let mut stream = self.stream.as_ref().map(|s| s.locked());
        let mut args = args;
        for (i, block) in self.blocks.iter().enumerate().take(last + 1).skip(first) {
            crate::deadline::check()?;
            if let Some(stream) = stream.as_mut() {
                stream.before(i)?;
            }
            let mut out = block.forward(std::mem::take(&mut args))?;
            if let Some(stream) = stream.as_mut() {
                out = stream.after(i, out)?;
            }
            if i == last {
                if i + 1 == self.blocks.len() {
                    self.executions.fetch_add(1, Ordering::Relaxed);
                }
                return Ok(out);
            }
            args = spread(out);
        }
        Err(ExecError::Internal("a model without blocks".into()))
    }

    /// The graph whose state a session of the model keeps (a KV cache), if it has one.
    pub fn stateful(&self) -> Option<&GraphModule> {
        match self.blocks.as_slice() {
            [Block::Graph(g)] if g.state_len() > 0 => Some(g.as_ref()),
            _ => None,
        }
    }

    /// Whether any block is TorchScript (code: only principals with the right may run it).
    pub fn has_torchscript(&self) -> bool {
        self.blocks.iter().any(|b| matches!(b, Block::Script(..)))
    }

    /// The lengths of the model's archives, where they can be read back: a model whose blocks
    /// all stay on the device (a streamed block's weights move between the host and the ring).
    pub fn archive_lens(&self) -> Result<Vec<u64>, ExecError> {
        if self.stream.is_some() {
            return Err(ExecError::Unsupported("a streamed model's archives cannot be read back".into()));
        }
        self.blocks
            .iter()
            .map(|b| match b {
                Block::Graph(g) => g.container_len().ok_or_else(|| {
                    ExecError::Unsupported("this model's archives are padded with more than zeros: not kept".into())
                }),
                Block::Script(_, archive) => Ok(archive.len() as u64),
            })
            .collect()
    }

    /// Bytes `offset..offset + len` of the model's archives, concatenated (the bytes it was
    /// registered with: the program kept, the weights read back from the device).
    pub fn read_archives(&self, offset: u64, len: u64) -> Result<(Vec<u64>, Vec<u8>), ExecError> {
        let lens = self.archive_lens()?;
        let total: u64 = lens.iter().sum();
        let end = offset.checked_add(len).filter(|&end| end <= total);
        let end =
            end.ok_or_else(|| ExecError::BadInput(format!("{len} bytes at {offset} pass the {total} archived")))?;
        let mut out = vec![0u8; (end - offset) as usize];
        let mut at = 0;
        for (block, block_len) in self.blocks.iter().zip(&lens) {
            let (start, stop) = (offset.max(at), end.min(at + block_len));
            if start < stop {
                let part = &mut out[(start - offset) as usize..(stop - offset) as usize];
                match block {
                    Block::Graph(g) => g.read_container(start - at, part)?,
                    Block::Script(_, archive) => {
                        part.copy_from_slice(&archive[(start - at) as usize..(stop - at) as usize])
                    }
                }
            }
            at += block_len;
        }
        Ok((lens, out))
    }

    /// Device bytes the model holds: its resident blocks and its ring.
    pub fn device_bytes(&self) -> u64 {
        self.reservation.device.bytes()
    }

    /// Host memory its graphs' programs and prepared calls take (TorchScript blocks, which only
    /// trusted principals register, count none).
    pub fn host_bytes(&self) -> u64 {
        self.blocks
            .iter()
            .map(|b| match b {
                Block::Graph(g) => g.host_bytes(),
                _ => 0,
            })
            .sum()
    }
}

/// One block of a model: a checked graph, which is data run through libtorch's dispatcher, or
/// a TorchScript module, which is code (only principals with the right may register one).
pub(crate) enum Block {
    Graph(Box<GraphModule>),
    /// The module and its archive.
    Script(CModule, Vec<u8>),
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Block::Graph(g) => g.fmt(f),
            Block::Script(..) => f.write_str("Script"),
        }
    }
}

impl Block {
    fn forward(&self, args: Vec<ModelValue>) -> Result<ModelValue, ExecError> {
        match self {
            Block::Script(module, _) => crate::torchscript::forward(module, args),
            Block::Graph(graph) => {
                let inputs = args
                    .into_iter()
                    .map(|a| match a {
                        ModelValue::Tensor(t) => Ok(t),
                        other => Err(ExecError::BadInput(format!("a graph takes tensors, not {}", kind_name(&other)))),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let mut outputs: Vec<ModelValue> = graph.run(inputs)?.into_iter().map(ModelValue::from).collect();
                Ok(if outputs.len() == 1 { outputs.remove(0) } else { ModelValue::Tuple(outputs) })
            }
        }
    }

    /// Its weights by name, and the bytes they take.
    fn weights(&self) -> Result<(Vec<(String, Tensor)>, u64), ExecError> {
        match self {
            Block::Script(module, _) => {
                let params = module.named_parameters()?;
                let bytes = params.iter().map(|(_, t)| tensor_bytes(t)).sum();
                Ok((params, bytes))
            }
            Block::Graph(graph) => {
                let weights = graph.weights();
                let bytes = weights.iter().map(|(_, t)| tensor_bytes(t)).sum();
                Ok((weights, bytes))
            }
        }
    }
}

fn kind_name(v: &ModelValue) -> &'static str {
    match v {
        ModelValue::Int(_) => "an int",
        ModelValue::Float(_) => "a float",
        ModelValue::Bool(_) => "a bool",
        ModelValue::None => "None",
        ModelValue::Tuple(_) => "a tuple",
        ModelValue::List(_) => "a list",
        _ => "a value of another kind",
    }
}

/// Loading a model's upload.
pub(crate) trait LoadUpload {
    fn load(self, device: Device, available: u64) -> Result<LoadedModel, ExecError>;
}

impl LoadUpload for Upload {
    /// Verifies the fingerprint and loads every block onto `device`; or, on a GPU, when the
    /// archives are not well within the `available` device bytes, only sizes the blocks on the
    /// CPU, so that a model larger than device memory is planned before any of it goes there.
    fn load(self, device: Device, available: u64) -> Result<LoadedModel, ExecError> {
        self.archives.verify().map_err(|e| ExecError::BadArchive(e.to_string()))?;
        // The archives hold the weights and a little more; twice the room is ample.
        let size_only = device != Device::Cpu && self.archives.total().saturating_mul(2) > available;
        let count = self.archives.block_lens().len();
        let mut blocks = Vec::with_capacity(count);
        let mut slot_lens = Vec::with_capacity(count);
        let mut weight_bytes = 0;
        let mut stateful = false;
        for (i, reader) in self.archives.blocks().into_iter().enumerate() {
            let block = load_block(reader, i, if size_only { Device::Cpu } else { device }, self.torchscript)?;
            let (params, bytes) = block.weights()?;
            weight_bytes += bytes;
            stateful |= matches!(&block, Block::Graph(g) if g.state_len() > 0);
            slot_lens.push(StreamedBlock::slot_len(&params));
            if !size_only {
                blocks.push(block);
            }
            log_progress(
                &self.archives.fingerprint(),
                i,
                count,
                if size_only { "sizing blocks" } else { "loading blocks" },
            );
        }
        let fingerprint = self.archives.fingerprint();
        if count > 1 && stateful {
            return Err(ExecError::Unsupported(
                "a graph with session state in a model of several blocks: state is kept by models of one block".into(),
            ));
        }
        let blocks = if size_only { LoadedBlocks::Sized(self) } else { LoadedBlocks::OnDevice(blocks) };
        Ok(LoadedModel { fingerprint, blocks, slot_lens, weight_bytes, device })
    }
}

/// Loads block `i`: a graph (its container's magic says so), or TorchScript where `torchscript`
/// allows it.
fn load_block(mut reader: BlockReader<'_>, i: usize, device: Device, torchscript: bool) -> Result<Block, ExecError> {
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < head.len() {
        match reader.read(&mut head[got..])? {
            0 => break,
            n => got += n,
        }
    }
    let head = &head[..got];
    if djinn_graph::is_graph(head) {
        let mut bytes = head.to_vec();
        reader.read_to_end(&mut bytes)?;
        return GraphModule::load(&bytes, device).map(|g| Block::Graph(Box::new(g))).map_err(|e| match e {
            ExecError::BadArchive(why) => ExecError::BadArchive(format!("block {i}: {why}")),
            ExecError::Refused(why) => ExecError::Refused(format!("block {i}: {why}")),
            other => other,
        });
    }
    if !torchscript {
        return Err(ExecError::Forbidden(format!(
            "block {i} is TorchScript, which is code that runs on the node: only a principal given the right \
             \"torchscript\" may register it. Register the model as a graph instead: djinn.register(model, example) \
             exports it with torch.export (docs/python.md, \"From TorchScript to graphs\")"
        )));
    }
    // Kept as received: TorchScript cannot be written again byte for byte, and a draining node
    // sends the archive on (only principals trusted with code register it).
    let mut bytes = head.to_vec();
    reader.read_to_end(&mut bytes)?;
    let mut block = CModule::load_data_on_device(&mut std::io::Cursor::new(&bytes), device)
        .map_err(|e| ExecError::BadArchive(format!("block {i} is neither a graph nor a TorchScript archive: {e}")))?;
    block.f_set_eval()?;
    Ok(Block::Script(block, bytes))
}

/// A line every tenth of the blocks of a model with many.
fn log_progress(model: &Fingerprint, i: usize, count: usize, what: &'static str) {
    if count >= 10 && (i + 1).is_multiple_of(count / 10) {
        tracing::info!(%model, done = i + 1, blocks = count, "{what}");
    }
}

/// A block's output as the next block's arguments: a tuple's items, or the one value.
pub(crate) fn spread(out: ModelValue) -> Vec<ModelValue> {
    match out {
        ModelValue::Tuple(items) => items,
        other => vec![other],
    }
}

/// A model loaded (or sized) but not yet charged to the budget nor visible to clients.
#[derive(Debug)]
pub struct LoadedModel {
    fingerprint: Fingerprint,
    blocks: LoadedBlocks,
    /// Bytes each block's parameters take laid out in a ring slot.
    slot_lens: Vec<u64>,
    weight_bytes: u64,
    device: Device,
}

#[derive(Debug)]
enum LoadedBlocks {
    /// Loaded on the model's device.
    OnDevice(Vec<Block>),
    /// Sized on the CPU only: [`LoadedModel::into_model`] loads the blocks on the device one at
    /// a time from the upload, taking a streamed block's weights out before loading the next.
    Sized(Upload),
}

impl LoadedModel {
    /// The model, holding `reservation`, with the blocks `plan` streams moved out of device
    /// memory into host memory (one copy of each, done here, outside any lock).
    fn into_model(self, plan: &Plan, reservation: Reservations) -> Result<Model, ExecError> {
        let count = self.slot_lens.len();
        let streams = plan.streamed.iter().any(|s| *s);
        let cuda = match self.device {
            Device::Cuda(ordinal) if streams => Some(CudaContext::primary(ordinal as i32)?),
            _ => None,
        };
        let (mut on_device, upload) = match self.blocks {
            LoadedBlocks::OnDevice(blocks) => (blocks.into_iter(), None),
            LoadedBlocks::Sized(upload) => (Vec::new().into_iter(), Some(upload)),
        };
        let mut readers = upload.as_ref().map(|u| u.archives.blocks().into_iter());
        let mut blocks = Vec::with_capacity(count);
        let mut streamed = Vec::with_capacity(count);
        for (i, &is_streamed) in plan.streamed.iter().enumerate() {
            let block = match readers.as_mut() {
                Some(readers) => {
                    let reader =
                        readers.next().ok_or_else(|| ExecError::Internal("fewer archives than blocks".into()))?;
                    log_progress(&self.fingerprint, i, count, "loading blocks");
                    load_block(reader, i, self.device, upload.as_ref().is_some_and(|u| u.torchscript))?
                }
                None => on_device.next().ok_or_else(|| ExecError::Internal("fewer modules than blocks".into()))?,
            };
            streamed.push(match is_streamed {
                false => None,
                true => Some(StreamedBlock::take(block.weights()?.0, cuda.as_ref())?),
            });
            blocks.push(block);
        }
        let stream = if streams {
            let streamer = Streamer::new(streamed, plan.ring, self.device)?;
            tracing::info!(
                model = %self.fingerprint,
                streamed = streamer.streamed(),
                blocks = count,
                ring = plan.ring,
                host_bytes = streamer.host_bytes(),
                "the model does not fit the device budget: streaming blocks through a ring"
            );
            Some(streamer)
        } else {
            None
        };
        Ok(Model {
            fingerprint: self.fingerprint,
            blocks,
            weight_bytes: self.weight_bytes,
            device: self.device,
            executions: AtomicU64::new(0),
            stream_stats: stream.as_ref().map(Streamer::stats),
            stream: stream.map(Mutex::new),
            reservation,
        })
    }
}

/// What a model holds of the node's budgets.
#[derive(Debug)]
pub struct Reservations {
    device: Reservation,
    _host: Reservation,
}

type Key = (Scope, Fingerprint);

struct Entry {
    model: Arc<Model>,
    last_used: u64,
    /// The tenants that registered it (one, for a private model), with what each is charged:
    /// it is theirs to use until the last one unregisters it.
    owners: BTreeMap<TenantId, Hold>,
}

/// What a tenant's hold on a model charges it: the model's device bytes against its quota,
/// and host memory for the hold's bookkeeping (a page, however few bytes the model has) and
/// the model's program and prepared calls.
#[derive(Debug)]
struct Hold {
    _device: Charge,
    _bookkeeping: Reservation,
    _program: Option<Reservation>,
}

impl Entry {
    fn is_idle(&self) -> bool {
        Arc::strong_count(&self.model) == 1
    }
}

/// What an unregistration did.
#[derive(Debug)]
pub enum Unregistered {
    /// The tenant's last hold on the model: it goes once no request runs it.
    Freed(Arc<Model>),
    /// A public model other tenants still hold: only this tenant's hold went.
    StillShared,
    /// The tenant holds no such model.
    Unknown,
}

/// (scope, fingerprint) → model, shared by the poller (look-ups) and the workers (inserts
/// after loads).
pub struct ModelStore {
    budget: MemoryBudget,
    /// Host memory for streamed blocks' weights.
    host_budget: MemoryBudget,
    models: HashMap<Key, Entry>,
    clock: u64,
    evictions: u64,
}

impl std::fmt::Debug for ModelStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelStore").field("models", &self.models.len()).finish()
    }
}

impl ModelStore {
    pub fn new(budget: MemoryBudget, host_budget: MemoryBudget) -> Self {
        Self { budget, host_budget, models: HashMap::new(), clock: 0, evictions: 0 }
    }

    /// Where `tenant`'s model of this fingerprint is: its private one first, else a public one
    /// it registered.
    fn key_of(&self, tenant: TenantId, fingerprint: &Fingerprint) -> Option<Key> {
        let private = (Scope::Private(tenant), *fingerprint);
        if self.models.contains_key(&private) {
            return Some(private);
        }
        let public = (Scope::Public, *fingerprint);
        self.models.get(&public).filter(|e| e.owners.contains_key(&tenant)).map(|_| public)
    }

    /// Whether `tenant`'s model of this fingerprint is held as public.
    pub fn is_public(&self, tenant: TenantId, fingerprint: &Fingerprint) -> bool {
        self.key_of(tenant, fingerprint).is_some_and(|(scope, _)| scope == Scope::Public)
    }

    /// `tenant`'s model, marked as just used.
    pub fn get(&mut self, tenant: TenantId, fingerprint: &Fingerprint) -> Option<Arc<Model>> {
        self.clock += 1;
        let key = self.key_of(tenant, fingerprint)?;
        let entry = self.models.get_mut(&key)?;
        entry.last_used = self.clock;
        Some(Arc::clone(&entry.model))
    }

    /// True when a registration needs no upload: the tenant holds the model in that scope, or
    /// (public) another tenant registered the same bytes as public, which `tenant` now holds
    /// too, charged to its quota.
    /// Makes a model the node holds already `tenant`'s too; `Ok(false)` when it holds none.
    /// A TorchScript model only for a principal with the right (`torchscript`).
    pub fn claim(
        &mut self,
        tenant: TenantId,
        fingerprint: &Fingerprint,
        public: bool,
        torchscript: bool,
    ) -> Result<bool, ExecError> {
        let scope = if public { Scope::Public } else { Scope::Private(tenant) };
        let key = (scope, *fingerprint);
        let bytes = match self.models.get(&key) {
            None => return Ok(false),
            Some(entry) if entry.model.has_torchscript() && !torchscript => {
                return Err(ExecError::Forbidden(
                    "the model is TorchScript, which is code that runs on the node: only a principal given the right \
                     \"torchscript\" may register it"
                        .into(),
                ));
            }
            Some(entry) if entry.owners.contains_key(&tenant) => return Ok(true),
            Some(entry) => entry.model.device_bytes(),
        };
        let bookkeeping = self.bookkeeping(tenant)?;
        let program = match self.models.get(&key) {
            Some(entry) => Some(self.program_charge(tenant, &entry.model)?),
            None => None,
        };
        let charge = self.charge_evicting(tenant, bytes, Some(key))?;
        // `except` kept the entry: it is still here.
        if let Some(entry) = self.models.get_mut(&key) {
            entry.owners.insert(tenant, Hold { _device: charge, _bookkeeping: bookkeeping, _program: program });
        }
        Ok(true)
    }

    /// Plans where a loaded model's blocks live, charges their device bytes to `tenant` and
    /// takes them from the budget, evicting idle models to make room (see [`Self::evictable`]);
    /// a model some request is using is never evicted. The plan counts what could be evicted
    /// as available, so a model streams only when it cannot fit whole even after evictions.
    /// The weights of the streamed blocks are charged to the host budget.
    fn reserve_for(&mut self, loaded: &LoadedModel, tenant: TenantId) -> Result<(Plan, Reservations, Hold), ExecError> {
        let bookkeeping = self.bookkeeping(tenant)?;
        let (room, quota_room) = self.room(tenant);
        let plan = match plan(&loaded.slot_lens, quota_room.map_or(room, |q| q.min(room))) {
            // Where the quota is what is short, that is the error.
            Err(ExecError::BlockTooLarge { len, .. }) if quota_room.is_some_and(|q| q < room) => {
                return Err(ExecError::OverBudget(OverBudget {
                    requested: len,
                    used: self.budget.used_by(tenant),
                    limit: self.budget.quota(tenant).unwrap_or(0),
                    tenant: Some(tenant),
                }));
            }
            plan => plan?,
        };
        let host_bytes = loaded.slot_lens.iter().zip(&plan.streamed).filter(|(_, s)| **s).map(|(l, _)| l).sum();
        let host = self.host_budget.try_reserve(host_bytes)?;
        let bytes = plan.device_bytes(&loaded.slot_lens);
        let charge = self.charge_evicting(tenant, bytes, None)?;
        let device = self.reserve_evicting(tenant, bytes)?;
        let hold = Hold { _device: charge, _bookkeeping: bookkeeping, _program: None };
        Ok((plan, Reservations { device, _host: host }, hold))
    }

    /// A new hold's bookkeeping, unless `tenant` holds as many models as a node allows one.
    fn bookkeeping(&self, tenant: TenantId) -> Result<Reservation, ExecError> {
        let held = self.models.values().filter(|e| e.owners.contains_key(&tenant)).count();
        if held >= crate::MAX_MODELS_PER_TENANT {
            return Err(ExecError::TooMany(format!(
                "this tenant holds {held} models on this node, the most one tenant may: unregister some first"
            )));
        }
        Ok(self.host_budget.try_reserve_for(tenant, crate::MIN_CHARGE)?)
    }

    /// The host memory of `model`'s program and prepared calls, taken for `tenant` (each holder
    /// of a shared model pays for it, as each pays for its weights).
    fn program_charge(&self, tenant: TenantId, model: &Model) -> Result<Reservation, ExecError> {
        Ok(self.host_budget.try_reserve_for(tenant, model.host_bytes())?)
    }

    /// Device bytes a new model of `tenant` may have: what is free and what it may evict,
    /// within what its quota leaves (its own idle models counted as free).
    pub fn available(&self, tenant: TenantId) -> u64 {
        let (room, quota_room) = self.room(tenant);
        quota_room.map_or(room, |q| q.min(room))
    }

    /// The device bytes free or evictable for `tenant`, and what its quota leaves it.
    fn room(&self, tenant: TenantId) -> (u64, Option<u64>) {
        let bytes =
            |keys: &mut dyn Iterator<Item = Key>| keys.map(|k| self.models[&k].model.device_bytes()).sum::<u64>();
        let free = self.budget.limit().saturating_sub(self.budget.used());
        let room = free + bytes(&mut self.evictable(tenant));
        let quota_room = self
            .budget
            .quota(tenant)
            .map(|quota| (quota + bytes(&mut self.own_idle(tenant, None))).saturating_sub(self.budget.used_by(tenant)));
        (room, quota_room)
    }

    /// The idle models `tenant` may evict to free device memory: any, while it holds no more
    /// than its fair share of the budget; else only those it alone holds.
    fn evictable(&self, tenant: TenantId) -> impl Iterator<Item = Key> + '_ {
        let own_only = self.budget.used_by(tenant) > self.budget.fair_share(tenant);
        self.models
            .iter()
            .filter(move |(_, e)| e.is_idle() && (!own_only || e.owners.keys().eq([&tenant])))
            .map(|(k, _)| *k)
    }

    /// The idle models `tenant` holds (but `except`), whose charges it may let go of.
    fn own_idle(&self, tenant: TenantId, except: Option<Key>) -> impl Iterator<Item = Key> + '_ {
        self.models
            .iter()
            .filter(move |(k, e)| Some(**k) != except && e.is_idle() && e.owners.contains_key(&tenant))
            .map(|(k, _)| *k)
    }

    /// The least recently used of `keys`.
    fn least_recent(&self, keys: impl Iterator<Item = Key>) -> Option<Key> {
        keys.min_by_key(|k| self.models[k].last_used)
    }

    /// Charges `bytes` to `tenant`'s quota, letting go of its own idle models (never
    /// `except`) as needed.
    fn charge_evicting(&mut self, tenant: TenantId, bytes: u64, except: Option<Key>) -> Result<Charge, OverBudget> {
        loop {
            match self.budget.charge(tenant, bytes) {
                Ok(charge) => return Ok(charge),
                Err(over) => {
                    let Some(victim) = self.least_recent(self.own_idle(tenant, except)) else { return Err(over) };
                    self.let_go(tenant, victim);
                }
            }
        }
    }

    /// Takes `bytes` from the budget for `tenant`, evicting idle models as needed.
    fn reserve_evicting(&mut self, tenant: TenantId, bytes: u64) -> Result<Reservation, OverBudget> {
        loop {
            match self.budget.try_reserve(bytes) {
                Ok(r) => return Ok(r),
                Err(over) => {
                    let Some(victim) = self.least_recent(self.evictable(tenant)) else { return Err(over) };
                    if let Some(entry) = self.models.remove(&victim) {
                        self.evictions += 1;
                        tracing::info!(model = %victim.1, bytes = entry.model.weight_bytes, "evicted an idle model");
                    }
                }
            }
        }
    }

    /// Drops `tenant`'s hold on an idle model to make room in its quota; the model goes when
    /// nobody else holds it.
    fn let_go(&mut self, tenant: TenantId, key: Key) {
        let Some(entry) = self.models.get_mut(&key) else { return };
        entry.owners.remove(&tenant);
        self.evictions += 1;
        tracing::info!(model = %key.1, %tenant, "let go of an idle model to stay within the tenant's quota");
        if entry.owners.is_empty() {
            self.models.remove(&key);
        }
    }

    /// Makes a model visible to `tenant`, charged `charge`. If it is already here in that
    /// scope (two clients uploaded it at once), the copy already serving is kept and this one
    /// dropped.
    fn publish(&mut self, model: Model, scope: Scope, (tenant, charge): (TenantId, Hold)) -> Arc<Model> {
        self.clock += 1;
        let key = (scope, model.fingerprint);
        if let Some(entry) = self.models.get_mut(&key) {
            entry.owners.entry(tenant).or_insert(charge);
            entry.last_used = self.clock;
            return Arc::clone(&entry.model);
        }
        let model = Arc::new(model);
        let entry =
            Entry { model: Arc::clone(&model), last_used: self.clock, owners: BTreeMap::from([(tenant, charge)]) };
        self.models.insert(key, entry);
        model
    }

    /// Drops `tenant`'s hold on a model; the model is forgotten with its last holder, and
    /// freed when the caller drops it and no request uses it.
    pub fn remove(&mut self, tenant: TenantId, fingerprint: &Fingerprint) -> Unregistered {
        let Some(key) = self.key_of(tenant, fingerprint) else { return Unregistered::Unknown };
        let Some(entry) = self.models.get_mut(&key) else { return Unregistered::Unknown };
        entry.owners.remove(&tenant);
        if !entry.owners.is_empty() {
            return Unregistered::StillShared;
        }
        match self.models.remove(&key) {
            Some(entry) => Unregistered::Freed(entry.model),
            None => Unregistered::Unknown,
        }
    }

    /// Every model, with the names `name` gives its holders (a tenant without one is left out).
    pub fn list_all(&self, name: impl Fn(TenantId) -> Option<String>) -> Vec<ModelInfo> {
        let mut infos: Vec<ModelInfo> = self
            .models
            .values()
            .map(|e| ModelInfo { owners: e.owners.keys().filter_map(|&t| name(t)).collect(), ..e.model.info() })
            .collect();
        infos.sort_by_key(|m| m.fingerprint);
        infos
    }

    /// The models `tenant` holds.
    pub fn list(&self, tenant: TenantId) -> Vec<ModelInfo> {
        let mut infos: Vec<ModelInfo> =
            self.models.values().filter(|e| e.owners.contains_key(&tenant)).map(|e| e.model.info()).collect();
        infos.sort_by_key(|m| m.fingerprint);
        infos
    }

    pub fn stats(&self, out: &mut Vec<(String, u64)>) {
        out.push(("models".into(), self.models.len() as u64));
        out.push(("model_bytes".into(), self.models.values().map(|e| e.model.weight_bytes).sum()));
        out.push(("model_evictions".into(), self.evictions));
        let streams = || self.models.values().filter_map(|e| e.model.stream_stats.as_ref());
        let sum = |f: fn(&StreamStats) -> &AtomicU64| streams().map(|s| f(s).load(Ordering::Relaxed)).sum::<u64>();
        out.push(("streamed_models".into(), streams().count() as u64));
        out.push(("stream_bytes".into(), sum(|s| &s.bytes_streamed)));
        out.push(("stream_stall_us".into(), sum(|s| &s.stall_ns) / 1000));
        out.push(("ring_bytes".into(), sum(|s| &s.ring_bytes)));
        out.push(("ring_peak_bytes".into(), sum(|s| &s.ring_peak_bytes)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use djinn_proto::ErrorCode;

    /// A multiple of the ring's slot alignment, so sizes are what they say.
    const K: u64 = 256;
    const T: TenantId = TenantId(1);

    fn loaded(tag: u8, weight_bytes: u64) -> LoadedModel {
        LoadedModel {
            fingerprint: Fingerprint([tag; 32]),
            blocks: LoadedBlocks::OnDevice(vec![Block::Script(identity(), Vec::new())]),
            slot_lens: vec![weight_bytes],
            weight_bytes,
            device: Device::Cpu,
        }
    }

    /// A block without weights (the tests give it a size of their own).
    fn identity() -> CModule {
        let example = Tensor::zeros([1], (tch::Kind::Float, Device::Cpu));
        CModule::create_by_tracing("identity", "forward", &[example], &mut |xs| vec![xs[0].shallow_clone()]).unwrap()
    }

    fn contains(store: &ModelStore, fingerprint: &Fingerprint) -> bool {
        store.key_of(T, fingerprint).is_some()
    }

    fn insert(store: &mut ModelStore, loaded: LoadedModel) -> Result<Arc<Model>, ExecError> {
        publish(store, loaded, Scope::Private(T), T)
    }

    fn publish(
        store: &mut ModelStore,
        loaded: LoadedModel,
        scope: Scope,
        tenant: TenantId,
    ) -> Result<Arc<Model>, ExecError> {
        let (plan, reservation, charge) = store.reserve_for(&loaded, tenant)?;
        Ok(store.publish(loaded.into_model(&plan, reservation)?, scope, (tenant, charge)))
    }

    #[test]
    fn a_model_in_use_is_never_evicted() {
        let budget = MemoryBudget::new(100 * K);
        let mut store = ModelStore::new(budget.clone(), MemoryBudget::new(100 * K));
        let a = insert(&mut store, loaded(1, 60 * K)).unwrap();
        // `a` is held, as a running request holds its model: no room for b.
        assert!(insert(&mut store, loaded(2, 60 * K)).is_err());
        assert!(contains(&store, &Fingerprint([1; 32])));
        drop(a);
        insert(&mut store, loaded(2, 60 * K)).unwrap();
        assert!(!contains(&store, &Fingerprint([1; 32])));
        assert_eq!(budget.used(), 60 * K);
    }

    #[test]
    fn the_least_recently_used_idle_model_goes_first() {
        let mut store = ModelStore::new(MemoryBudget::new(100 * K), MemoryBudget::new(100 * K));
        insert(&mut store, loaded(1, 40 * K)).unwrap();
        insert(&mut store, loaded(2, 40 * K)).unwrap();
        store.get(T, &Fingerprint([1; 32]));
        insert(&mut store, loaded(3, 40 * K)).unwrap();
        assert!(contains(&store, &Fingerprint([1; 32])) && !contains(&store, &Fingerprint([2; 32])));
    }

    #[test]
    fn private_models_are_per_tenant_and_public_ones_shared() {
        let budget = MemoryBudget::new(100 * K);
        let mut store = ModelStore::new(budget.clone(), MemoryBudget::new(100 * K));
        let (a, b) = (TenantId(1), TenantId(2));
        let fp = Fingerprint([7; 32]);
        let publish = |store: &mut ModelStore, scope, tenant| publish(store, loaded(7, 10 * K), scope, tenant).unwrap();
        // Private: a's model is unknown to b, and b's registration of the same bytes loads a copy.
        publish(&mut store, Scope::Private(a), a);
        assert!(store.get(b, &fp).is_none() && !store.claim(b, &fp, false, true).unwrap());
        assert!(matches!(store.remove(b, &fp), Unregistered::Unknown));
        publish(&mut store, Scope::Private(b), b);
        assert_eq!(budget.used(), 20 * K);
        assert_eq!(store.list(a).len(), 1);
        // Public: one copy; a second tenant claims it without an upload; it goes with its last holder.
        assert!(!store.claim(a, &fp, true, true).unwrap());
        publish(&mut store, Scope::Public, a);
        // The model is TorchScript: a tenant without the right may not claim it either.
        let e = store.claim(b, &fp, true, false).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Forbidden, "{e}");
        assert!(store.claim(b, &fp, true, true).unwrap());
        assert_eq!(budget.used(), 30 * K);
        // Each holder is charged the public weights.
        assert_eq!((budget.used_by(a), budget.used_by(b)), (20 * K, 20 * K));
        assert!(matches!(store.remove(a, &fp), Unregistered::Freed(_)), "a's private copy goes first");
        assert!(matches!(store.remove(a, &fp), Unregistered::StillShared), "then a's hold on the public one");
        assert!(store.get(a, &fp).is_none() && store.get(b, &fp).is_some());
        assert!(matches!(store.remove(b, &fp), Unregistered::Freed(_)));
        assert!(matches!(store.remove(b, &fp), Unregistered::Freed(_)));
        assert!(matches!(store.remove(b, &fp), Unregistered::Unknown));
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_tenant_over_its_quota_lets_go_of_its_own_idle_models() {
        let (a, b) = (TenantId(1), TenantId(2));
        let budget = MemoryBudget::with_quotas(100 * K, Arc::new(move |t| (t == a).then_some(50 * K)));
        let mut store = ModelStore::new(budget.clone(), MemoryBudget::new(100 * K));
        let held = publish(&mut store, loaded(1, 30 * K), Scope::Private(a), a).unwrap();
        publish(&mut store, loaded(2, 20 * K), Scope::Private(b), b).unwrap();
        // a's first model runs: a second one does not fit a's quota, whatever the node has free.
        let e = publish(&mut store, loaded(3, 30 * K), Scope::Private(a), a).unwrap_err();
        assert_eq!(e.code(), ErrorCode::QuotaExceeded, "{e}");
        // Once idle, it makes room for the new one; b's model is untouched.
        drop(held);
        publish(&mut store, loaded(3, 30 * K), Scope::Private(a), a).unwrap();
        assert_eq!(store.list(a).len(), 1);
        assert_eq!(store.list(b).len(), 1);
        assert_eq!(budget.used_by(a), 30 * K);
        // A public model counts against the quota of each tenant that holds it.
        publish(&mut store, loaded(4, 40 * K), Scope::Public, b).unwrap();
        let fp = Fingerprint([4; 32]);
        let e = store.claim(a, &fp, true, true);
        assert!(e.is_ok(), "a lets go of its idle model to hold the public one: {e:?}");
        assert_eq!(store.list(a).iter().map(|m| m.fingerprint).collect::<Vec<_>>(), vec![fp]);
    }

    #[test]
    fn others_models_are_evicted_only_within_the_fair_share() {
        let (a, b) = (TenantId(1), TenantId(2));
        let budget = MemoryBudget::new(100 * K);
        let mut store = ModelStore::new(budget.clone(), MemoryBudget::new(100 * K));
        publish(&mut store, loaded(1, 40 * K), Scope::Private(a), a).unwrap();
        publish(&mut store, loaded(2, 40 * K), Scope::Private(a), a).unwrap();
        // b holds 40 of 100, within its half: a's least recently used idle model goes.
        publish(&mut store, loaded(3, 40 * K), Scope::Private(b), b).unwrap();
        assert_eq!(store.list(a).len(), 1);
        // b would hold 80: beyond its half, it can only evict its own.
        publish(&mut store, loaded(4, 40 * K), Scope::Private(b), b).unwrap();
        assert_eq!(store.list(a).len(), 1, "a keeps its fair share");
        assert_eq!(store.list(b).iter().map(|m| m.fingerprint).collect::<Vec<_>>(), vec![Fingerprint([4; 32])]);
        // And with nothing of its own to evict, b is refused (a's model stays).
        let held = store.get(b, &Fingerprint([4; 32])).unwrap();
        let e = publish(&mut store, loaded(5, 40 * K), Scope::Private(b), b).unwrap_err();
        assert_eq!(e.code(), ErrorCode::OverBudget, "{e}");
        assert_eq!(store.list(a).len(), 1);
        drop(held);
    }
}
