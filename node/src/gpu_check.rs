//! `djinn gpu-check`: what this host's GPUs and drivers can do for a node, checked with the
//! node's own code rather than asked of nvidia-smi. Each check gives one line as it ends, PASS,
//! FAIL, SKIP (nothing to check it on: no CUDA driver), UNSUPPORTED (the platform cannot:
//! dma-buf under gVisor) or NOT RUN (it needs what this host lacks, or what is not built); the
//! whole fails when a check does.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use djinn_executor::tch::{self, Device, Kind, Tensor};
use djinn_gpudirect::{CopyStream, CudaContext, DeviceBuf, DmaBufError, PinnedBuf, export_dmabuf};
use djinn_memory::ByteSize;

#[derive(Debug, Clone, Copy)]
pub struct GpuCheck {
    /// The largest transfer of the staging checks (from 1 KiB up, ×64 each step, then this).
    pub max_size: ByteSize,
    /// The device to check.
    pub ordinal: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Fail,
    Skip,
    Unsupported,
    NotRun,
}

/// One check's outcome; shown as `OUTCOME  check  detail` in aligned columns.
#[derive(Debug, Clone)]
pub struct Line {
    pub outcome: Outcome,
    pub check: String,
    pub detail: String,
}

impl std::fmt::Display for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let label = match self.outcome {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Skip => "SKIP",
            Outcome::Unsupported => "UNSUPPORTED",
            Outcome::NotRun => "NOT RUN",
        };
        write!(f, "{label:<12} {:<34} {}", self.check, self.detail)
    }
}

struct Report<'a> {
    failed: usize,
    out: &'a mut dyn FnMut(&Line),
}

impl Report<'_> {
    fn line(&mut self, outcome: Outcome, check: &str, detail: impl std::fmt::Display) {
        self.failed += usize::from(outcome == Outcome::Fail);
        (self.out)(&Line { outcome, check: check.to_owned(), detail: detail.to_string() });
    }

    fn result(&mut self, check: &str, result: Result<String>) {
        match result {
            Ok(detail) => self.line(Outcome::Pass, check, detail),
            Err(e) => self.line(Outcome::Fail, check, format!("{e:#}")),
        }
    }
}

/// The transfer sizes: 1 KiB, 64 KiB, 4 MiB, 256 MiB, ... up to `max`, and `max` itself.
fn sizes(max: u64) -> Vec<u64> {
    let mut out: Vec<u64> =
        std::iter::successors(Some(1u64 << 10), |s| s.checked_mul(64)).take_while(|&s| s < max).collect();
    out.push(max.max(1));
    out
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

fn gb_per_s(bytes: u64, since: Instant) -> f64 {
    bytes as f64 / since.elapsed().as_secs_f64() / 1e9
}

/// Runs the checks, giving each line to `out` as it ends; fails when a check does.
pub fn run(args: GpuCheck, out: &mut dyn FnMut(&Line)) -> Result<()> {
    let mut report = Report { failed: 0, out };
    match djinn_executor::libtorch::check() {
        Ok(torch) => report.line(
            Outcome::Pass,
            "libtorch",
            format!("{torch} (built for {})", djinn_executor::libtorch::BUILT_FOR),
        ),
        Err(e) => report.line(Outcome::Fail, "libtorch", e),
    }
    let devices = match djinn_gpudirect::cuda_devices() {
        Ok(devices) => devices,
        Err(e) => {
            report.line(Outcome::Fail, "CUDA driver", e);
            Vec::new()
        }
    };
    let Some(device) = devices.iter().find(|d| d.ordinal == args.ordinal) else {
        let why = if devices.is_empty() {
            "no CUDA driver or device".to_owned()
        } else {
            format!("no device {}", args.ordinal)
        };
        for check in [
            "CUDA device",
            "libtorch sees the devices",
            "device buffer",
            "pinned buffer",
            "staging",
            "dma-buf export",
            "GPU memory registration (NIC)",
        ] {
            report.line(Outcome::Skip, check, &why);
        }
        anyhow::ensure!(report.failed == 0, "{} checks failed", report.failed);
        return Ok(());
    };
    for d in &devices {
        let numa = d.numa_node.map_or("unsupported".to_owned(), |n| n.to_string());
        report.line(
            Outcome::Pass,
            &format!("CUDA device {}", d.ordinal),
            format!("{}, {}, bus {}, NUMA node {numa}", d.name, ByteSize(d.total_memory), d.pci_bus_id),
        );
    }
    let seen = tch::Cuda::device_count();
    report.result(
        "libtorch sees the devices",
        if seen == devices.len() as i64 {
            Ok(format!("{seen} (cuDNN {})", if tch::Cuda::cudnn_is_available() { "available" } else { "absent" }))
        } else {
            Err(anyhow::anyhow!(
                "libtorch sees {seen} CUDA devices, the driver {}: is libtorch_cuda linked?",
                devices.len()
            ))
        },
    );
    let context = match CudaContext::primary(device.ordinal) {
        Ok(c) => c,
        Err(e) => {
            report.line(Outcome::Fail, "CUDA context", e);
            anyhow::bail!("{} checks failed", report.failed);
        }
    };
    report.result("device buffer", device_buffer(&context));
    report.result(
        "pinned buffer",
        PinnedBuf::zeroed(&context, 64 << 20)
            .map(|b| format!("{} page-locked", ByteSize(b.len() as u64)))
            .map_err(Into::into),
    );
    for size in sizes(args.max_size.0) {
        report.result(&format!("staging {}", ByteSize(size)), staging(&context, device.ordinal, size as usize));
    }
    let dmabuf = DeviceBuf::alloc(&context, 2 << 20).map_err(DmaBufError::from).and_then(|buf| export_dmabuf(&buf));
    match dmabuf {
        Ok(fd) => report.line(
            Outcome::Pass,
            "dma-buf export",
            format!("2 MiB of device memory as fd {}", std::os::fd::AsRawFd::as_raw_fd(&fd)),
        ),
        Err(DmaBufError::Unsupported(why)) => report.line(Outcome::Unsupported, "dma-buf export", why),
        Err(e) => report.line(Outcome::Fail, "dma-buf export", e),
    }
    let nics: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    let why = if nics.is_empty() {
        "no RDMA device on this host".to_owned()
    } else {
        format!(
            "RDMA devices {}: registering GPU memory with them is not built yet (nodes stage through host memory)",
            nics.join(", ")
        )
    };
    report.line(Outcome::NotRun, "GPU memory registration (NIC)", why);
    anyhow::ensure!(report.failed == 0, "{} checks failed", report.failed);
    Ok(())
}

fn device_buffer(context: &Arc<CudaContext>) -> Result<String> {
    let bytes = pattern(64 << 20, 1);
    let mut buf = DeviceBuf::alloc(context, bytes.len())?;
    buf.write(&bytes)?;
    let mut back = vec![0u8; bytes.len()];
    buf.read(&mut back)?;
    anyhow::ensure!(back == bytes, "64 MiB came back changed");
    Ok(format!("{} written and read back", ByteSize(bytes.len() as u64)))
}

/// One size through both ways a node moves bytes onto the device: pinned memory and the copy
/// stream (streaming's path), and libtorch's copy of a pageable tensor to the device and back
/// (what a node does with a request's inputs and outputs). Each must come back bit for bit.
fn staging(context: &Arc<CudaContext>, ordinal: i32, size: usize) -> Result<String> {
    let bytes = pattern(size, size as u64);
    let mut pinned = PinnedBuf::zeroed(context, size)?;
    pinned.as_mut_slice().copy_from_slice(&bytes);
    let device = DeviceBuf::alloc(context, size)?;
    let stream = CopyStream::new(context)?;
    let start = Instant::now();
    // SAFETY: both buffers hold `size` bytes and outlive the copy, which is waited for below
    // before either is read, written or dropped.
    let done = unsafe { stream.copy_to_device(device.device_ptr(), pinned.as_slice().as_ptr(), size) }?;
    done.synchronize()?;
    let pinned_rate = gb_per_s(size as u64, start);
    let mut back = vec![0u8; size];
    device.read(&mut back)?;
    anyhow::ensure!(back == bytes, "changed on the way through pinned memory and the copy stream");

    let host = Tensor::from_slice(&bytes);
    let start = Instant::now();
    let on_device = host.f_to_device(Device::Cuda(ordinal as usize))?;
    let returned = on_device.f_to_device(Device::Cpu)?;
    let round_trip = gb_per_s(2 * size as u64, start);
    anyhow::ensure!(returned.kind() == Kind::Uint8 && returned.numel() == size, "libtorch returned {returned:?}");
    let mut got = vec![0u8; size];
    returned.f_copy_data_u8(&mut got, size)?;
    anyhow::ensure!(got == bytes, "changed on the way through libtorch's device copy");
    let mut detail = String::new();
    write!(detail, "pinned→device {pinned_rate:.2} GB/s; pageable round trip through libtorch {round_trip:.2} GB/s")?;
    Ok(detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_go_from_one_kib_to_the_largest() {
        assert_eq!(sizes(1 << 30), vec![1 << 10, 64 << 10, 4 << 20, 256 << 20, 1 << 30]);
        assert_eq!(sizes(1 << 20), vec![1 << 10, 64 << 10, 1 << 20]);
        assert_eq!(sizes(512), vec![512]);
    }
}
