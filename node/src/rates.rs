//! What a node's device can do, measured briefly at start-up for the control plane's cost
//! model (`--flops`, `--memory-bandwidth` and `--host-to-device` give them instead).

use std::time::{Duration, Instant};

use djinn_executor::tch;

/// Units per second of `op` on `device`, each call doing `units`: one call to warm up, then
/// timed calls, with the device synchronised before and after.
fn rate(device: tch::Device, units: f64, mut op: impl FnMut()) -> f64 {
    op();
    sync(device);
    let rounds = 4;
    let started = Instant::now();
    for _ in 0..rounds {
        op();
    }
    sync(device);
    f64::from(rounds) * units / started.elapsed().as_secs_f64().max(1e-9)
}

fn sync(device: tch::Device) {
    if let tch::Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// FLOP/s of a float matrix product on `device` (a short measurement at start-up): of 512 by
/// 512 matrices, or of the first smaller size whose product takes over `SLOW_PRODUCT`, so that
/// a slow host (an emulated CPU takes minutes at 512) starts in seconds.
pub fn measure_flops(device: tch::Device) -> f64 {
    const SLOW_PRODUCT: Duration = Duration::from_millis(20);
    let ones = |n: i64| tch::Tensor::ones([n, n], (tch::Kind::Float, device));
    // Warmed up on the smallest size first: the first product on a GPU starts its libraries.
    let mut n = 64i64;
    let _ = ones(n).matmul(&ones(n));
    sync(device);
    loop {
        let a = ones(n);
        let started = Instant::now();
        drop(a.matmul(&a));
        sync(device);
        if n >= 512 || started.elapsed() > SLOW_PRODUCT {
            return rate(device, (2 * n * n * n) as f64, || drop(a.matmul(&a)));
        }
        n *= 2;
    }
}

/// Bytes per second read from `device`'s memory: a copy within it reads and writes each byte.
pub fn measure_memory_bandwidth(device: tch::Device) -> f64 {
    let len = 64i64 << 20;
    let src = tch::Tensor::ones([len], (tch::Kind::Uint8, device));
    let mut dst = tch::Tensor::zeros([len], (tch::Kind::Uint8, device));
    rate(device, (2 * len) as f64, || dst.copy_(&src))
}

/// Bytes per second copied from host memory (pinned, for a GPU) to `device`.
pub fn measure_host_to_device(device: tch::Device) -> f64 {
    let len = 64i64 << 20;
    let mut src = tch::Tensor::zeros([len], (tch::Kind::Uint8, tch::Device::Cpu));
    if let tch::Device::Cuda(_) = device {
        src = src.pin_memory(device);
    }
    let mut dst = tch::Tensor::zeros([len], (tch::Kind::Uint8, device));
    rate(device, len as f64, || dst.copy_(&src))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpus_rates_are_positive_and_finite() {
        for rate in [
            measure_flops(tch::Device::Cpu),
            measure_memory_bandwidth(tch::Device::Cpu),
            measure_host_to_device(tch::Device::Cpu),
        ] {
            assert!(rate.is_finite() && rate > 0.0, "{rate}");
        }
    }
}
