//! `djinn._native`: the Python package's binding of `djinn-client`. The GIL is released around
//! every network call; input tensors are lent to the call through DLPack ([`lent`]): the call
//! holds each one's capsule, so its memory stays until the call is over, whatever other Python
//! threads do; output tensors are handed to Python as buffers over the received bytes, which
//! `torch.frombuffer` wraps without a copy.

mod lent;

use std::ffi::c_int;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use djinn_client::{
    Archive, BlockEstimate, Breakpoint, ClientError, ClientOptions, ClientTls, ClusterClient, ClusterError,
    DEFAULT_MAX_REPLY_PAYLOAD, DType, ErrorCode, FailoverOptions, Fingerprint, GraphAnnotations, Handle, HandleInfo,
    ModelDescription, Moving, Output, Paused, RemoteParked, RemoteSession, RemoteTensor, Resumed, Signal, Target,
    Tensor, TensorDesc, Value,
};
use lent::LentTensor;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use djinn_sync::Locked;

create_exception!(djinn, DjinnError, PyException, "Base of every error the djinn package raises.");
create_exception!(djinn, TransportError, DjinnError, "The node could not be reached or the connection broke.");
create_exception!(djinn, RemoteError, DjinnError, "The node refused or failed a request; the message is the node's.");
create_exception!(
    djinn,
    UnknownModelError,
    RemoteError,
    "The node does not hold that model (never registered, or evicted)."
);
create_exception!(djinn, ExecutionError, RemoteError, "The model failed on the node (libtorch's message).");
create_exception!(djinn, BadArchiveError, RemoteError, "The node could not load the TorchScript archive.");
create_exception!(djinn, OverBudgetError, RemoteError, "The node's device-memory budget cannot hold this.");
create_exception!(
    djinn,
    GraphRefusedError,
    RemoteError,
    "The node will not run the graph: an operator off its allowlist, a write to a weight or an input, ... (the message names the operator and why)."
);
create_exception!(
    djinn,
    DeadlineExceededError,
    RemoteError,
    "The request ran past the node's limit on one execution (`--execute-deadline`) and was ended; the node goes on."
);
create_exception!(
    djinn,
    ExecutorLostError,
    RemoteError,
    "The executor process holding the request (and what the tenant kept on its device) ended before it answered: a crash in a kernel, a kill, out of memory; the message says which. The node goes on and starts the tenant a new one."
);
create_exception!(
    djinn,
    QuotaExceededError,
    RemoteError,
    "The tenant's quota on the node (device memory, swap, concurrent requests or request rate) does not allow this now."
);
create_exception!(
    djinn,
    ControlPlaneError,
    DjinnError,
    "The control plane could not be reached, or refused (the message is its own)."
);
create_exception!(djinn, NotFoundError, RemoteError, "No such tensor, kept tensor or upload on the node.");
create_exception!(
    djinn,
    StaleHandleError,
    RemoteError,
    "The kept tensor is from an earlier life of its node: the node restarted and the tensor is gone."
);
create_exception!(
    djinn,
    BreakpointError,
    RemoteError,
    "A breakpoint outside the run, or a replacement activation unlike the parked one (the request stays parked)."
);
create_exception!(
    djinn,
    AuthenticationError,
    DjinnError,
    "The node or the control plane refused the token: none was given, it is unknown or revoked, or it does not allow this."
);
create_exception!(
    djinn,
    BadReplyError,
    DjinnError,
    "The node's reply was not one the request can have: larger than what was asked for (refused before it was read), another tensor than the one asked for, or a listing without end."
);
create_exception!(
    djinn,
    UntrustedAddressError,
    DjinnError,
    "A node sent the client to an address it does not follow (none of the live nodes the control plane lists, or anywhere at all for a client given one node's address): nothing was sent there."
);
create_exception!(
    djinn,
    HandleLostError,
    TransportError,
    "The node holding the kept tensor or the session cannot be reached: they are lost with it."
);

fn to_py_err(e: ClusterError) -> PyErr {
    let e = match e {
        ClusterError::Node(e) => e,
        ClusterError::Control(e @ djinn_client::ControlError::Refused { status: 401 | 403, .. }) => {
            return AuthenticationError::new_err(e.to_string());
        }
        ClusterError::Control(e) => return ControlPlaneError::new_err(e.to_string()),
        ClusterError::Unavailable { .. } => return TransportError::new_err(e.to_string()),
        ClusterError::NotOneNode | ClusterError::NoControlPlane => return DjinnError::new_err(e.to_string()),
        ClusterError::HandleLost { .. } => return HandleLostError::new_err(e.to_string()),
        ClusterError::UntrustedAddress { .. } => return UntrustedAddressError::new_err(e.to_string()),
    };
    match &e {
        ClientError::Remote { code, message, .. } => {
            let message = message.clone();
            match code {
                ErrorCode::UnknownModel => UnknownModelError::new_err(message),
                ErrorCode::ExecutionFailed => ExecutionError::new_err(message),
                ErrorCode::BadArchive => BadArchiveError::new_err(message),
                ErrorCode::GraphRefused => GraphRefusedError::new_err(message),
                ErrorCode::OverBudget => OverBudgetError::new_err(message),
                ErrorCode::QuotaExceeded => QuotaExceededError::new_err(message),
                ErrorCode::DeadlineExceeded => DeadlineExceededError::new_err(message),
                ErrorCode::ExecutorLost => ExecutorLostError::new_err(message),
                ErrorCode::NotFound => NotFoundError::new_err(message),
                ErrorCode::StaleHandle => StaleHandleError::new_err(message),
                ErrorCode::BadBreakpoint => BreakpointError::new_err(message),
                ErrorCode::Unauthenticated | ErrorCode::Forbidden => AuthenticationError::new_err(message),
                _ => RemoteError::new_err(e.to_string()),
            }
        }
        ClientError::Io { .. } | ClientError::Closed { .. } | ClientError::Timeout { .. } => {
            TransportError::new_err(e.to_string())
        }
        ClientError::ReplyTooLarge { .. }
        | ClientError::WrongTensor { .. }
        | ClientError::ListTooLong { .. }
        | ClientError::BadListPage { .. } => BadReplyError::new_err(e.to_string()),
        _ => DjinnError::new_err(e.to_string()),
    }
}

/// Stands for input tensor `index` inside the nested inputs handed to `Client.execute`.
#[pyclass(frozen, module = "djinn._native")]
struct TensorSlot {
    #[pyo3(get)]
    index: u32,
}

#[pymethods]
impl TensorSlot {
    #[new]
    fn new(index: u32) -> Self {
        Self { index }
    }
}

/// An output tensor: dtype, shape and a writable buffer over its bytes.
#[pyclass(module = "djinn._native")]
struct OutputTensor {
    output: Arc<Output>,
    index: usize,
    #[pyo3(get)]
    dtype: &'static str,
    #[pyo3(get)]
    shape: Vec<u64>,
    #[pyo3(get)]
    nbytes: usize,
}

/// Fills `view` with a writable buffer over `bytes`, owned by `owner`.
///
/// # Safety
/// `view` comes from Python's buffer protocol; `bytes` live as long as `owner` (the view holds
/// a reference to it), belong to it alone, and Rust never reads them again, so Python may
/// write them (torch tensors are mutable).
unsafe fn fill_buffer(owner: &Bound<'_, PyAny>, bytes: &[u8], view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
    let (ptr, len) = (bytes.as_ptr() as *mut std::ffi::c_void, bytes.len() as ffi::Py_ssize_t);
    // SAFETY: as the caller promises.
    let rc = unsafe { ffi::PyBuffer_FillInfo(view, owner.as_ptr(), ptr, len, 0, flags) };
    if rc == 0 { Ok(()) } else { Err(PyErr::fetch(owner.py())) }
}

#[pymethods]
impl OutputTensor {
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let this = slf.borrow();
        // SAFETY: each output tensor's bytes belong to its one OutputTensor, which keeps the
        // output alive.
        unsafe { fill_buffer(slf.as_any(), this.output.tensor_bytes(this.index), view, flags) }
    }
}

/// A tensor kept on a node: which node, the node's handle, and what it holds.
#[pyclass(frozen, module = "djinn._native")]
struct Kept {
    #[pyo3(get)]
    node: String,
    #[pyo3(get)]
    id: u64,
    #[pyo3(get)]
    epoch: u64,
    #[pyo3(get)]
    dtype: &'static str,
    #[pyo3(get)]
    shape: Vec<u64>,
    #[pyo3(get)]
    nbytes: u64,
}

impl Kept {
    fn new(node: String, info: &HandleInfo) -> Self {
        Self {
            node,
            id: info.handle.id,
            epoch: info.handle.epoch,
            dtype: info.tensor.dtype.name(),
            shape: info.tensor.shape.clone(),
            nbytes: info.tensor.byte_len,
        }
    }

    fn handle(&self) -> Handle {
        Handle { id: self.id, epoch: self.epoch }
    }

    fn remote(&self) -> PyResult<RemoteTensor> {
        let dtype: DType = self.dtype.parse().map_err(PyValueError::new_err)?;
        let tensor = TensorDesc::new(dtype, self.shape.clone()).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(RemoteTensor { node: self.node.clone(), info: HandleInfo { handle: self.handle(), tensor } })
    }
}

#[pymethods]
impl Kept {
    fn __repr__(&self) -> String {
        format!("Kept(node={:?}, id={}, dtype={}, shape={:?})", self.node, self.id, self.dtype, self.shape)
    }
}

/// A session open on a node: which node, and the session's handle there (both change when the
/// session moves).
#[pyclass(frozen, module = "djinn._native")]
struct Session(Mutex<RemoteSession>);

#[pymethods]
impl Session {
    #[getter]
    fn node(&self) -> String {
        self.0.locked().node.clone()
    }

    fn __repr__(&self) -> String {
        let s = self.0.locked();
        format!("Session(node={:?}, id={})", s.node, s.session.id)
    }
}

/// A request parked at a breakpoint on a node: which node, and its handle there.
#[pyclass(frozen, module = "djinn._native")]
struct Parked(RemoteParked);

#[pymethods]
impl Parked {
    #[getter]
    fn node(&self) -> &str {
        &self.0.node
    }

    fn __repr__(&self) -> String {
        format!("Parked(node={:?}, id={})", self.0.node, self.0.parked.id)
    }
}

/// A parked request and its activation (None when it was not asked for), for Python.
fn paused_to_py<'py>(py: Python<'py>, paused: Paused, node: &str) -> PyResult<(Parked, Bound<'py, PyAny>)> {
    let parked = Parked(RemoteParked { node: node.to_owned(), parked: paused.parked });
    Ok((parked, activation_to_py(py, paused.activation, node)?))
}

fn activation_to_py<'py>(py: Python<'py>, activation: Option<Output>, node: &str) -> PyResult<Bound<'py, PyAny>> {
    match activation {
        Some(output) => {
            let output = Arc::new(output);
            value_to_py(py, &output.value, &output, node)
        }
        None => Ok(py.None().into_bound(py)),
    }
}

fn breakpoint(block: u32, send_activation: bool) -> Breakpoint {
    Breakpoint { block, send_activation }
}

/// A tensor fetched from a node: a writable buffer over the received bytes.
#[pyclass(module = "djinn._native")]
struct Fetched {
    tensor: Tensor,
}

#[pymethods]
impl Fetched {
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let this = slf.borrow();
        // SAFETY: the fetched bytes belong to this object alone and live as long as it does.
        unsafe { fill_buffer(slf.as_any(), this.tensor.bytes(), view, flags) }
    }
}

fn value_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    if obj.is_none() {
        return Ok(Value::None);
    }
    if let Ok(kept) = obj.cast::<Kept>() {
        return Ok(Value::Handle(kept.get().handle()));
    }
    if let Ok(slot) = obj.cast::<TensorSlot>() {
        return Ok(Value::Tensor(slot.get().index));
    }
    // bool before int: a Python bool is an int.
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(Value::Int(obj.extract()?));
    }
    if obj.is_instance_of::<PyFloat>() {
        return Ok(Value::Float(obj.extract()?));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return Ok(Value::Tuple(t.iter().map(|v| value_from_py(&v)).collect::<PyResult<_>>()?));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return Ok(Value::List(l.iter().map(|v| value_from_py(&v)).collect::<PyResult<_>>()?));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        return Ok(Value::Dict(
            d.iter().map(|(k, v)| Ok((value_from_py(&k)?, value_from_py(&v)?))).collect::<PyResult<_>>()?,
        ));
    }
    Err(PyTypeError::new_err(format!("cannot send a {} to a remote model", obj.get_type().name()?)))
}

/// `node`: where the output's kept tensors are.
fn value_to_py<'py>(py: Python<'py>, value: &Value, output: &Arc<Output>, node: &str) -> PyResult<Bound<'py, PyAny>> {
    let value_to_py = |v| value_to_py(py, v, output, node);
    Ok(match value {
        Value::None => py.None().into_bound(py),
        Value::Handle(h) => {
            let info = output
                .kept
                .iter()
                .find(|k| k.handle == *h)
                .ok_or_else(|| DjinnError::new_err(format!("the node kept no tensor {h}")))?;
            Bound::new(py, Kept::new(node.to_owned(), info))?.into_any()
        }
        Value::Tensor(i) => {
            let index = *i as usize;
            let desc = output.tensors.get(index).ok_or_else(|| DjinnError::new_err(format!("no output tensor {i}")))?;
            let tensor = OutputTensor {
                output: Arc::clone(output),
                index,
                dtype: desc.dtype.name(),
                shape: desc.shape.clone(),
                nbytes: desc.byte_len as usize,
            };
            Bound::new(py, tensor)?.into_any()
        }
        Value::Int(v) => v.into_pyobject(py)?.into_any(),
        Value::Float(v) => v.into_pyobject(py)?.into_any(),
        Value::Bool(v) => PyBool::new(py, *v).to_owned().into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Tuple(items) => {
            PyTuple::new(py, items.iter().map(value_to_py).collect::<PyResult<Vec<_>>>()?)?.into_any()
        }
        Value::List(items) => PyList::new(py, items.iter().map(value_to_py).collect::<PyResult<Vec<_>>>()?)?.into_any(),
        Value::Dict(entries) => {
            let d = PyDict::new(py);
            for (k, v) in entries {
                d.set_item(value_to_py(k)?, value_to_py(v)?)?;
            }
            d.into_any()
        }
    })
}

fn parse_fingerprint(hex: &str) -> PyResult<Fingerprint> {
    Fingerprint::from_hex(hex).ok_or_else(|| PyValueError::new_err(format!("{hex:?} is not a model fingerprint")))
}

/// A connection to one node, or to a cluster through its control plane. Safe to share between
/// threads (calls are serialised); for parallel calls, give each thread its own client.
#[pyclass(frozen, module = "djinn._native")]
struct Client {
    inner: Mutex<ClusterClient>,
    #[pyo3(get)]
    address: String,
    /// Kept tensors dropped by Python, to release with the next call (a finaliser must not
    /// wait on the network, nor on a call in progress).
    unreleased: Mutex<Vec<(String, Handle)>>,
    /// Sessions dropped by Python without being closed, to close with the next call.
    unclosed: Mutex<Vec<RemoteSession>>,
    /// Parked requests dropped by Python without being resumed, to abort with the next call.
    unaborted: Mutex<Vec<RemoteParked>>,
}

impl Client {
    /// The client, after releasing what Python dropped since the last call.
    fn lock(&self) -> MutexGuard<'_, ClusterClient> {
        let mut client = self.inner.locked();
        let dropped = std::mem::take(&mut *self.unreleased.locked());
        for (node, handles) in by_node(dropped) {
            // A failure means the node is gone, and its tensors with it: nothing is left to
            // free. (Unreleased tensors on a live node expire after its --handle-ttl.)
            let _ = client.release(&node, &handles);
        }
        for mut session in std::mem::take(&mut *self.unclosed.locked()) {
            // Likewise: a session on a live node that this misses is closed after the node's
            // --session-idle-timeout.
            let _ = client.session_close(&mut session);
        }
        for parked in std::mem::take(&mut *self.unaborted.locked()) {
            // Likewise: the node releases it after its --parked-ttl.
            let _ = client.abort(&parked);
        }
        client
    }
}

/// Handles grouped by the node that holds them, for one release request per node.
fn by_node(handles: impl IntoIterator<Item = (String, Handle)>) -> std::collections::BTreeMap<String, Vec<Handle>> {
    let mut grouped: std::collections::BTreeMap<String, Vec<Handle>> = Default::default();
    for (node, handle) in handles {
        grouped.entry(node).or_default().push(handle);
    }
    grouped
}

fn progress_callback(progress: &Option<Py<PyAny>>) -> impl FnMut(u64, u64) + '_ {
    move |sent, total| {
        if let Some(cb) = progress {
            Python::attach(|py| {
                if let Err(e) = cb.call1(py, (sent, total)) {
                    e.write_unraisable(py, None);
                }
            });
        }
    }
}

/// The control plane's model description from the Python side's dict: `blocks` (a list of
/// (weight bytes, FLOPs)), `io_bytes`, `phase`.
fn description_from_py(d: &Bound<'_, PyDict>) -> PyResult<ModelDescription> {
    let blocks: Vec<(u64, f64)> = d.get_item("blocks")?.ok_or_else(|| PyValueError::new_err("no blocks"))?.extract()?;
    let io_bytes: u64 = d.get_item("io_bytes")?.map(|v| v.extract()).transpose()?.unwrap_or(0);
    let phase: Option<String> = d.get_item("phase")?.map(|v| v.extract()).transpose()?.flatten();
    let graph = match d.get_item("graph")? {
        Some(g) if !g.is_none() => Some(graph_from_py(g.cast::<PyDict>()?)?),
        _ => None,
    };
    Ok(ModelDescription {
        blocks: blocks.into_iter().map(|(weight_bytes, flops)| BlockEstimate { weight_bytes, flops }).collect(),
        io_bytes,
        phase,
        graph,
    })
}

/// A captured graph's annotations (`SemanticGraph.summary()` in the Python package).
fn graph_from_py(g: &Bound<'_, PyDict>) -> PyResult<GraphAnnotations> {
    macro_rules! field {
        ($name:literal) => {
            g.get_item($name)?
                .ok_or_else(|| PyValueError::new_err(concat!("graph annotations without ", $name)))?
                .extract()?
        };
    }
    Ok(GraphAnnotations {
        phase: field!("phase"),
        modality: field!("modality"),
        operations: field!("operations"),
        attention: field!("attention"),
        flops: field!("flops"),
        weight_bytes: field!("weight_bytes"),
        kv_cache_bytes: field!("kv_cache_bytes"),
        activation_bytes: field!("activation_bytes"),
    })
}

#[pymethods]
impl Client {
    /// `address`: a node's `HOST:PORT`, or a control plane's `http://HOST:PORT` (a bare
    /// `HOST:PORT` serving HTTP is taken as a control plane). `failover`: seconds one request
    /// may spend finding a live node when its node fails.
    /// `token`: the tenant's token, where the cluster needs one. `tls`: PEM roots that nodes'
    /// certificates must chain to, for nodes that speak TLS (`tls_name`: the name expected in
    /// them, by default the node's address). `max_reply_bytes`: the largest reply whose size
    /// its request does not fix (default `DEFAULT_MAX_REPLY_PAYLOAD`).
    #[new]
    #[pyo3(signature = (address, timeout = 60.0, transport = "auto", failover = 30.0, token = String::new(), tls = None, tls_name = None, max_reply_bytes = None))]
    #[expect(clippy::too_many_arguments, reason = "the Python constructor's keyword arguments")]
    fn new(
        py: Python<'_>,
        address: String,
        timeout: f64,
        transport: &str,
        failover: f64,
        token: String,
        tls: Option<Vec<u8>>,
        tls_name: Option<String>,
        max_reply_bytes: Option<u64>,
    ) -> PyResult<Self> {
        let tls = match tls {
            Some(roots) => {
                let tls = ClientTls::trusting(&roots).map_err(|e| PyValueError::new_err(e.to_string()))?;
                Some(match tls_name {
                    Some(name) => tls.with_server_name(&name).map_err(|e| PyValueError::new_err(e.to_string()))?,
                    None => tls,
                })
            }
            None => None,
        };
        let options = ClientOptions {
            timeout: (timeout > 0.0).then(|| Duration::from_secs_f64(timeout)),
            transport: transport.parse().map_err(PyValueError::new_err)?,
            token,
            tls,
            max_reply_payload: max_reply_bytes.unwrap_or(DEFAULT_MAX_REPLY_PAYLOAD),
            ..ClientOptions::default()
        };
        let failover = FailoverOptions { deadline: Duration::from_secs_f64(failover.max(0.0)), ..Default::default() };
        let client = py.detach(|| ClusterClient::open(&address, options, failover)).map_err(to_py_err)?;
        Ok(Self {
            inner: Mutex::new(client),
            address,
            unreleased: Mutex::default(),
            unclosed: Mutex::default(),
            unaborted: Mutex::default(),
        })
    }

    /// "control" or "node".
    #[getter]
    fn mode(&self) -> &'static str {
        match self.lock().target() {
            Target::Control(_) => "control",
            Target::Node(_) => "node",
        }
    }

    /// Round-trip time in seconds (to the node; not with a control plane).
    fn ping(&self, py: Python<'_>) -> PyResult<f64> {
        py.detach(|| Ok(self.lock().node()?.ping()?)).map(|d| d.as_secs_f64()).map_err(to_py_err)
    }

    /// Describes the model to the control plane (when there is one), places it and uploads the
    /// blocks (TorchScript archives, in execution order) unless the node holds them already.
    /// `public`: weights shared with every tenant that registers the same bytes as public.
    /// Returns (fingerprint, uploaded, weight bytes or None).
    #[pyo3(signature = (blocks, progress = None, description = None, policy = None, public = false))]
    fn register_model(
        &self,
        py: Python<'_>,
        blocks: Vec<PyBackedBytes>,
        progress: Option<Py<PyAny>>,
        description: Option<Bound<'_, PyDict>>,
        policy: Option<String>,
        public: bool,
    ) -> PyResult<(String, bool, Option<u64>)> {
        let description = description.as_ref().map(description_from_py).transpose()?;
        let archives: Vec<Archive> = blocks.into_iter().map(|b| Archive(Arc::new(b))).collect();
        let registration = py
            .detach(|| self.lock().register_model(archives, description, policy, public, progress_callback(&progress)))
            .map_err(to_py_err)?;
        let weight_bytes = registration.uploaded.as_ref().map(|m| m.weight_bytes);
        Ok((registration.fingerprint.to_hex(), registration.uploaded.is_some(), weight_bytes))
    }

    /// Runs a model. `inputs`: the positional arguments, nested, with `TensorSlot(i)` for
    /// tensors and `Kept` for tensors kept on a node; `tensors[i]`: a contiguous CPU tensor of
    /// a wire dtype (anything with `__dlpack__`), held by the call until it returns.
    /// `keep`: the output tensors stay on the node (as `Kept`). `at`: the node holding the
    /// `Kept` inputs, where the call must run.
    #[pyo3(signature = (fingerprint, inputs, tensors, keep = false, at = None))]
    fn execute<'py>(
        &self,
        py: Python<'py>,
        fingerprint: &str,
        inputs: Vec<Bound<'py, PyAny>>,
        tensors: Vec<Bound<'py, PyAny>>,
        keep: bool,
        at: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fingerprint = parse_fingerprint(fingerprint)?;
        let inputs = inputs.iter().map(value_from_py).collect::<PyResult<Vec<_>>>()?;
        let lent = lent::lend_all(&tensors)?;
        let refs = lent::refs(&lent);
        let (output, node) = py
            .detach(|| {
                let mut client = self.lock();
                match (&at, keep) {
                    (Some(node), _) => {
                        client.execute_at(node, &fingerprint, &inputs, &refs, keep).map(|o| (o, node.clone()))
                    }
                    (None, true) => client.execute_keep(&fingerprint, None, &inputs, &refs),
                    (None, false) => client.execute(&fingerprint, None, &inputs, &refs).map(|o| (o, String::new())),
                }
            })
            .map_err(to_py_err)?;
        let output = Arc::new(output);
        value_to_py(py, &output.value, &output, &node)
    }

    /// Runs a model (as `execute`) up to block `block` and parks the request on the node.
    /// Returns the parked request and the activation (block `block`'s output) when
    /// `send_activation`, else None.
    #[pyo3(signature = (fingerprint, inputs, tensors, block, send_activation = true, keep = false, at = None))]
    #[allow(clippy::too_many_arguments)]
    fn execute_until<'py>(
        &self,
        py: Python<'py>,
        fingerprint: &str,
        inputs: Vec<Bound<'py, PyAny>>,
        tensors: Vec<Bound<'py, PyAny>>,
        block: u32,
        send_activation: bool,
        keep: bool,
        at: Option<String>,
    ) -> PyResult<(Parked, Bound<'py, PyAny>)> {
        let fingerprint = parse_fingerprint(fingerprint)?;
        let inputs = inputs.iter().map(value_from_py).collect::<PyResult<Vec<_>>>()?;
        let lent = lent::lend_all(&tensors)?;
        let refs = lent::refs(&lent);
        let until = breakpoint(block, send_activation);
        let (paused, node) = py
            .detach(|| self.lock().execute_until(&fingerprint, at.as_deref(), &inputs, &refs, keep, until))
            .map_err(to_py_err)?;
        paused_to_py(py, paused, &node)
    }

    /// A session step (as `session_step`) stopped after block `block`; the session's later
    /// requests wait until it is resumed to its end or aborted.
    #[pyo3(signature = (session, inputs, tensors, block, send_activation = true))]
    fn session_step_until<'py>(
        &self,
        py: Python<'py>,
        session: &Session,
        inputs: Vec<Bound<'py, PyAny>>,
        tensors: Vec<Bound<'py, PyAny>>,
        block: u32,
        send_activation: bool,
    ) -> PyResult<(Parked, Bound<'py, PyAny>)> {
        let inputs = inputs.iter().map(value_from_py).collect::<PyResult<Vec<_>>>()?;
        let lent = lent::lend_all(&tensors)?;
        let refs = lent::refs(&lent);
        let until = breakpoint(block, send_activation);
        let (paused, node) = py
            .detach(|| {
                let mut s = session.0.locked();
                self.lock().session_step_until(&mut s, &inputs, &refs, until).map(|p| (p, s.node.clone()))
            })
            .map_err(to_py_err)?;
        paused_to_py(py, paused, &node)
    }

    /// Runs a parked request on, on its activation or on `activation` (nested, with
    /// `TensorSlot(i)` for `tensors[i]`), to the end or, with `until`, to a later breakpoint.
    /// Returns (None, output) at the end, or (the new parked request, its activation or None).
    #[pyo3(signature = (parked, activation = None, tensors = Vec::new(), until = None, send_activation = true))]
    fn resume<'py>(
        &self,
        py: Python<'py>,
        parked: &Parked,
        activation: Option<Bound<'py, PyAny>>,
        tensors: Vec<Bound<'py, PyAny>>,
        until: Option<u32>,
        send_activation: bool,
    ) -> PyResult<(Option<Parked>, Bound<'py, PyAny>)> {
        let value = activation.as_ref().map(value_from_py).transpose()?;
        let lent = lent::lend_all(&tensors)?;
        let refs = lent::refs(&lent);
        let until = until.map(|block| breakpoint(block, send_activation));
        let resumed = py
            .detach(|| self.lock().resume(&parked.0, value.as_ref().map(|v| (v, &refs[..])), until))
            .map_err(to_py_err)?;
        let node = &parked.0.node;
        match resumed {
            Resumed::Done(output) => Ok((None, activation_to_py(py, Some(output), node)?)),
            Resumed::Paused(paused) => {
                let (parked, activation) = paused_to_py(py, paused, node)?;
                Ok((Some(parked), activation))
            }
        }
    }

    /// A parked request's activation.
    fn inspect<'py>(&self, py: Python<'py>, parked: &Parked) -> PyResult<Bound<'py, PyAny>> {
        let paused = py.detach(|| self.lock().inspect(&parked.0)).map_err(to_py_err)?;
        activation_to_py(py, paused.activation, &parked.0.node)
    }

    /// Drops a parked request.
    fn abort(&self, py: Python<'_>, parked: &Parked) -> PyResult<()> {
        py.detach(|| self.lock().abort(&parked.0)).map_err(to_py_err)
    }

    /// Aborts a parked request with the next call (for finalisers: never waits).
    fn abort_later(&self, parked: &Parked) {
        self.unaborted.locked().push(parked.0.clone());
    }

    /// Uploads a tensor (contiguous, on the CPU, as for `execute`) to be kept
    /// on `node` (by default this client's node).
    #[pyo3(signature = (tensor, node = None))]
    fn keep(&self, py: Python<'_>, tensor: Bound<'_, PyAny>, node: Option<String>) -> PyResult<Kept> {
        let lent = LentTensor::lend(&tensor)?;
        let remote = py.detach(|| self.lock().keep(node.as_deref(), lent.tensor_ref())).map_err(to_py_err)?;
        Ok(Kept::new(remote.node, &remote.info))
    }

    /// The bytes of a kept tensor, as a buffer.
    fn fetch(&self, py: Python<'_>, kept: &Kept) -> PyResult<Fetched> {
        let remote = kept.remote()?;
        let tensor = py.detach(|| self.lock().fetch(&remote)).map_err(to_py_err)?;
        Ok(Fetched { tensor })
    }

    /// Has the node holding `kept` copy it into the device memory of the node at `to`.
    /// Returns the copy there and the path the bytes took.
    fn push(&self, py: Python<'_>, kept: &Kept, to: String) -> PyResult<(Kept, String)> {
        let remote = kept.remote()?;
        let (copy, path) = py.detach(|| self.lock().push(&remote, &to)).map_err(to_py_err)?;
        Ok((Kept::new(copy.node, &copy.info), path))
    }

    /// Frees kept tensors now; returns how many their nodes held.
    fn release(&self, py: Python<'_>, kept: Vec<Bound<'_, Kept>>) -> PyResult<u32> {
        let grouped = by_node(kept.iter().map(|k| (k.get().node.clone(), k.get().handle())));
        py.detach(|| {
            let mut client = self.lock();
            grouped.iter().try_fold(0, |n, (node, handles)| Ok(n + client.release(node, handles)?))
        })
        .map_err(to_py_err)
    }

    /// Frees a kept tensor with the next call (for finalisers: never waits).
    fn release_later(&self, kept: &Kept) {
        self.unreleased.locked().push((kept.node.clone(), kept.handle()));
    }

    /// Opens a session of a registered model on its node. `state`: the initial state tensors
    /// (as `tensors` for `execute`); `reserve`: device bytes to hold for the state as it grows;
    /// `key`: the session id the control plane places it by (and records it under as it moves);
    /// `node`: the node to open it on instead.
    #[pyo3(signature = (fingerprint, state, reserve, key = None, node = None))]
    fn session_open(
        &self,
        py: Python<'_>,
        fingerprint: &str,
        state: Vec<Bound<'_, PyAny>>,
        reserve: u64,
        key: Option<&str>,
        node: Option<&str>,
    ) -> PyResult<Session> {
        let fingerprint = parse_fingerprint(fingerprint)?;
        let lent = lent::lend_all(&state)?;
        let refs = lent::refs(&lent);
        py.detach(|| match node {
            Some(node) => self.lock().session_open_on(node, &fingerprint, &refs, reserve),
            None => self.lock().session_open(&fingerprint, &refs, reserve, key),
        })
        .map(|s| Session(Mutex::new(s)))
        .map_err(to_py_err)
    }

    /// One step of a session: its model runs on `inputs` (as for `execute`) and the session's
    /// state, which stays on the node.
    fn session_step<'py>(
        &self,
        py: Python<'py>,
        session: &Session,
        inputs: Vec<Bound<'py, PyAny>>,
        tensors: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let inputs = inputs.iter().map(value_from_py).collect::<PyResult<Vec<_>>>()?;
        let lent = lent::lend_all(&tensors)?;
        let refs = lent::refs(&lent);
        let (output, node) = py
            .detach(|| {
                let mut s = session.0.locked();
                self.lock().session_step(&mut s, &inputs, &refs).map(|o| (o, s.node.clone()))
            })
            .map_err(to_py_err)?;
        let output = Arc::new(output);
        value_to_py(py, &output.value, &output, &node)
    }

    /// The session's agent waits (on a tool, on a user), for about `expected_ms` when given.
    #[pyo3(signature = (session, expected_ms = None))]
    fn session_io_wait(&self, py: Python<'_>, session: &Session, expected_ms: Option<u32>) -> PyResult<()> {
        let signal = Signal::IoWait { resume_in_ms: expected_ms };
        py.detach(|| self.lock().session_signal(&mut session.0.locked(), signal)).map_err(to_py_err)
    }

    /// The session's agent is about to compute again.
    fn session_compute(&self, py: Python<'_>, session: &Session) -> PyResult<()> {
        py.detach(|| self.lock().session_signal(&mut session.0.locked(), Signal::Compute)).map_err(to_py_err)
    }

    /// Frees the session's state on its node.
    fn session_close(&self, py: Python<'_>, session: &Session) -> PyResult<()> {
        py.detach(|| self.lock().session_close(&mut session.0.locked())).map_err(to_py_err)
    }

    /// Moves a session to the node at `node`, node to node (its state never comes here);
    /// `session` follows it. A move that fails leaves the session where it was.
    fn session_move(&self, py: Python<'_>, session: &Session, node: &str) -> PyResult<()> {
        py.detach(|| self.lock().session_move(&mut session.0.locked(), node)).map_err(to_py_err)
    }

    /// Closes a session with the next call (for finalisers: never waits).
    fn close_later(&self, session: &Session) {
        self.unclosed.locked().push(session.0.locked().clone());
    }

    fn unregister_model(&self, py: Python<'_>, fingerprint: &str) -> PyResult<()> {
        let fingerprint = parse_fingerprint(fingerprint)?;
        py.detach(|| self.lock().unregister_model(&fingerprint)).map_err(to_py_err)
    }

    /// The control plane's decision for a model as JSON, once it was placed.
    fn placement(&self, fingerprint: &str) -> PyResult<Option<String>> {
        let fingerprint = parse_fingerprint(fingerprint)?;
        Ok(self.lock().placement(&fingerprint, None).map(|p| p.decision.clone()))
    }

    /// Where the control plane would run calls of a model in `phase` ("prefill" or "decode"),
    /// weighing the move of a session on the node at `moving_from` with `state_bytes` of state
    /// paid over `calls` calls: its decision as JSON (not cached).
    #[pyo3(signature = (fingerprint, phase = None, moving_from = None, state_bytes = 0, calls = 1))]
    fn place_calls(
        &self,
        py: Python<'_>,
        fingerprint: &str,
        phase: Option<&str>,
        moving_from: Option<&str>,
        state_bytes: u64,
        calls: u32,
    ) -> PyResult<String> {
        let fingerprint = parse_fingerprint(fingerprint)?;
        let moving = moving_from.map(|from| Moving { from, state_bytes, calls });
        py.detach(|| self.lock().place_calls(&fingerprint, phase, moving)).map(|p| p.decision).map_err(to_py_err)
    }

    /// The cluster (nodes, models, sessions) as the control plane's JSON.
    fn cluster(&self, py: Python<'_>) -> PyResult<String> {
        let control = self.lock().control().cloned();
        let control = control.ok_or_else(|| DjinnError::new_err("connected to a node alone: there is no cluster"))?;
        py.detach(|| control.cluster()).map_err(|e| to_py_err(e.into()))
    }

    /// The node's models: a list of dicts (a node alone).
    fn list_models<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let models = py.detach(|| Ok(self.lock().node()?.list_models()?)).map_err(to_py_err)?;
        models
            .into_iter()
            .map(|m| {
                let d = PyDict::new(py);
                d.set_item("fingerprint", m.fingerprint.to_hex())?;
                d.set_item("blocks", m.blocks)?;
                d.set_item("weight_bytes", m.weight_bytes)?;
                d.set_item("device", m.device)?;
                d.set_item("executions", m.executions)?;
                Ok(d)
            })
            .collect()
    }

    /// This client's transports, bytes and request counts, and its failover counts.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let client = self.lock();
        let (cluster, counts, sent, received) = client.stats();
        let d = PyDict::new(py);
        d.set_item("address", &self.address)?;
        d.set_item("transport", client.transports().join(","))?;
        d.set_item("memory_path", client.memory_paths().join(","))?;
        d.set_item("bytes_sent", sent)?;
        d.set_item("bytes_received", received)?;
        let registrations = client.rdma_registrations();
        d.set_item("rdma_registrations", registrations.made)?;
        d.set_item("rdma_registrations_reused", registrations.reused)?;
        d.set_item("requests", counts.requests)?;
        d.set_item("errors", counts.errors)?;
        d.set_item("reconnects", counts.reconnects)?;
        d.set_item("placements", cluster.placements)?;
        d.set_item("node_failures", cluster.node_failures)?;
        d.set_item("reregistrations", cluster.reregistrations)?;
        d.set_item("replays", cluster.replays)?;
        Ok(d)
    }

    /// The node's counters (a node alone).
    fn node_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counters = py.detach(|| Ok(self.lock().node()?.stats()?)).map_err(to_py_err)?;
        let d = PyDict::new(py);
        for (k, v) in counters {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Client>()?;
    m.add_class::<TensorSlot>()?;
    m.add_class::<OutputTensor>()?;
    m.add_class::<Kept>()?;
    m.add_class::<Fetched>()?;
    m.add_class::<Session>()?;
    m.add_class::<Parked>()?;
    for (name, ty) in [
        ("DjinnError", py.get_type::<DjinnError>()),
        ("AuthenticationError", py.get_type::<AuthenticationError>()),
        ("TransportError", py.get_type::<TransportError>()),
        ("RemoteError", py.get_type::<RemoteError>()),
        ("UnknownModelError", py.get_type::<UnknownModelError>()),
        ("ExecutionError", py.get_type::<ExecutionError>()),
        ("BadArchiveError", py.get_type::<BadArchiveError>()),
        ("OverBudgetError", py.get_type::<OverBudgetError>()),
        ("QuotaExceededError", py.get_type::<QuotaExceededError>()),
        ("DeadlineExceededError", py.get_type::<DeadlineExceededError>()),
        ("ExecutorLostError", py.get_type::<ExecutorLostError>()),
        ("GraphRefusedError", py.get_type::<GraphRefusedError>()),
        ("NotFoundError", py.get_type::<NotFoundError>()),
        ("StaleHandleError", py.get_type::<StaleHandleError>()),
        ("HandleLostError", py.get_type::<HandleLostError>()),
        ("UntrustedAddressError", py.get_type::<UntrustedAddressError>()),
        ("BreakpointError", py.get_type::<BreakpointError>()),
        ("ControlPlaneError", py.get_type::<ControlPlaneError>()),
        ("BadReplyError", py.get_type::<BadReplyError>()),
    ] {
        m.add(name, ty)?;
    }
    Ok(())
}
