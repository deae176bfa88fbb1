//! Executor worker threads. The poller hands them model work over a crossbeam channel (it never
//! runs model code itself); they answer through the data plane's `Replier`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use djinn_dataplane::proto::{Frame, Handle, Message, Payload, SharedBytes, TensorDesc};
use djinn_dataplane::tcp::{Replier, Reply, ReplyTo};
use tch::Device;

use crate::convert::{OutputTensor, Outputs, input_tensors, kept_inputs, to_ivalue};
use crate::error::ExecError;
use crate::handles::HandleTable;
use crate::models::{Model, ModelStore, Upload};

pub enum Job {
    Execute {
        model: Arc<Model>,
        frame: Frame,
    },
    Load {
        upload: Upload,
    },
    /// Drops an unregistered model (the last reference, unless a request still runs it) and
    /// acknowledges the unregistration.
    Free {
        model: Arc<Model>,
    },
    /// Keeps a received tensor in device memory.
    Keep {
        tensor: TensorDesc,
        payload: Option<Payload>,
    },
    /// Sends a kept tensor's bytes back.
    Fetch {
        handle: Handle,
    },
}

struct Envelope {
    job: Job,
    to: ReplyTo,
    replier: Replier,
}

#[derive(Debug, Default)]
pub struct WorkerCounters {
    pub executions: AtomicU64,
    pub execution_errors: AtomicU64,
    pub loads: AtomicU64,
    pub load_errors: AtomicU64,
    /// Jobs submitted and not finished (waiting or running).
    pub queued: AtomicU64,
}

pub struct Workers {
    tx: Option<Sender<Envelope>>,
    threads: Vec<JoinHandle<()>>,
    pub counters: Arc<WorkerCounters>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers").field("threads", &self.threads.len()).finish()
    }
}

impl Workers {
    pub fn start(
        count: usize,
        device: Device,
        models: Arc<Mutex<ModelStore>>,
        handles: Arc<Mutex<HandleTable>>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Envelope>();
        let counters = Arc::new(WorkerCounters::default());
        let threads = (0..count.max(1))
            .map(|i| {
                let rx = rx.clone();
                let models = Arc::clone(&models);
                let counters = Arc::clone(&counters);
                let handles = Arc::clone(&handles);
                std::thread::Builder::new()
                    .name(format!("djinn-worker-{i}"))
                    .spawn(move || work(rx, device, models, handles, counters))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { tx: Some(tx), threads, counters })
    }

    pub fn submit(&self, job: Job, to: ReplyTo, replier: &Replier) {
        let envelope = Envelope { job, to, replier: replier.clone() };
        self.counters.queued.fetch_add(1, Ordering::Relaxed);
        if let Some(tx) = &self.tx
            && let Err(e) = tx.send(envelope)
        {
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
            // Only when every worker is gone (they stop only on shutdown).
            let Envelope { to, replier, .. } = e.into_inner();
            replier.send(to, Reply::error(djinn_dataplane::proto::ErrorCode::Internal, "the executor has stopped"));
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How long an idle worker keeps polling its queue before it sleeps: a request that comes in
/// that window costs no thread wake-up (about 20 µs each on these machines).
const WORKER_SPIN: Duration = Duration::from_micros(100);

fn next_job(rx: &Receiver<Envelope>) -> Option<Envelope> {
    let until = Instant::now() + WORKER_SPIN;
    while Instant::now() < until {
        match rx.try_recv() {
            Ok(envelope) => return Some(envelope),
            Err(TryRecvError::Empty) => std::thread::yield_now(),
            Err(TryRecvError::Disconnected) => return None,
        }
    }
    rx.recv().ok()
}

fn work(
    rx: Receiver<Envelope>,
    device: Device,
    models: Arc<Mutex<ModelStore>>,
    handles: Arc<Mutex<HandleTable>>,
    counters: Arc<WorkerCounters>,
) {
    while let Some(Envelope { job, to, replier }) = next_job(&rx) {
        // What the node's stats count, by kind of job: (done, failed).
        let counted = match job {
            Job::Execute { .. } => Some((&counters.executions, &counters.execution_errors)),
            Job::Load { .. } => Some((&counters.loads, &counters.load_errors)),
            Job::Free { .. } | Job::Keep { .. } | Job::Fetch { .. } => None,
        };
        let result = catch_unwind(AssertUnwindSafe(|| match job {
            Job::Execute { model, frame } => execute(&model, frame, &handles),
            Job::Load { upload } => load(upload, device, &models),
            Job::Free { model } => {
                drop(model);
                Ok(Reply::message(Message::UnregisterAck))
            }
            Job::Keep { tensor, payload } => keep(&tensor, payload, device, &handles),
            Job::Fetch { handle } => fetch(handle, &handles),
        }))
        .unwrap_or_else(|panic| {
            let what =
                panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(ExecError::Internal(format!("worker panicked: {}", what.unwrap_or_default())))
        });
        let reply = match result {
            Ok(reply) => {
                if let Some((done, _)) = counted {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                reply
            }
            Err(e) => {
                if let Some((_, failed)) = counted {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(error = %e, "request failed");
                Reply::error(e.code(), e.to_string())
            }
        };
        counters.queued.fetch_sub(1, Ordering::Relaxed);
        replier.send(to, reply);
    }
}

fn execute(model: &Model, frame: Frame, handles: &Mutex<HandleTable>) -> Result<Reply, ExecError> {
    let Message::Execute { tensors, inputs, keep, .. } = frame.message else {
        return Err(ExecError::Internal("not an execute request".into()));
    };
    let payload = frame.payload.map(Arc::new);
    let tensors = input_tensors(&tensors, payload.as_ref(), model.device)?;
    let kept = kept_inputs(&inputs, handles)?;
    let args = inputs.iter().map(|v| to_ivalue(v, &tensors, &kept)).collect::<Result<Vec<_>, _>>()?;
    let output = model.forward(args)?;
    let mut outputs = Outputs::new(payload, keep.then_some(handles));
    let output = outputs.value(output).inspect_err(|_| outputs.release_kept())?;
    Ok(Reply {
        message: Message::ExecuteReply { tensors: outputs.descs, output, kept: outputs.kept },
        tensors: outputs.tensors.into_iter().map(|t| Arc::new(t) as SharedBytes).collect(),
    })
}

/// A received tensor kept on `device`: on the CPU a view of the payload it arrived in (no copy),
/// on a GPU a copy there.
fn keep(
    desc: &TensorDesc,
    payload: Option<Payload>,
    device: Device,
    handles: &Mutex<HandleTable>,
) -> Result<Reply, ExecError> {
    let payload = payload.map(Arc::new);
    let tensor = input_tensors(std::slice::from_ref(desc), payload.as_ref(), device)?
        .pop()
        .ok_or_else(|| ExecError::Internal("no tensor".into()))?;
    let mut table = handles.lock().unwrap_or_else(|e| e.into_inner());
    let kept = match payload {
        // The tensor is a view of the payload: the payload goes into the table with it.
        Some(payload) if device == Device::Cpu => {
            let payload = Arc::try_unwrap(payload).map_err(|_| ExecError::Internal("payload still shared".into()))?;
            table.keep_view(tensor, payload)?
        }
        _ => table.keep(tensor)?,
    };
    Ok(Reply::message(Message::Kept { kept }))
}

fn fetch(handle: Handle, handles: &Mutex<HandleTable>) -> Result<Reply, ExecError> {
    let (tensor, _) = handles.lock().unwrap_or_else(|e| e.into_inner()).get(handle)?;
    let (bytes, desc) = OutputTensor::new(tensor, None)?;
    Ok(Reply { message: Message::GetReply { tensor: desc }, tensors: vec![Arc::new(bytes) as SharedBytes] })
}

fn load(upload: Upload, device: Device, models: &Mutex<ModelStore>) -> Result<Reply, ExecError> {
    let started = std::time::Instant::now();
    let fingerprint = upload.fingerprint;
    let model = crate::models::load(upload, device, models)?;
    tracing::info!(model = %fingerprint, weight_bytes = model.weight_bytes, seconds = started.elapsed().as_secs_f64(), "model loaded");
    Ok(Reply::message(Message::Registered { model: model.info() }))
}
