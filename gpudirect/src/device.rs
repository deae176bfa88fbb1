//! CUDA device discovery. The driver is loaded dynamically; a host without it (as CI and the
//! development machines are) simply has no devices.

use cudarc::driver::{result, sys};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDevice {
    pub ordinal: i32,
    pub name: String,
    pub total_memory: u64,
    /// `domain:bus:device.0`, as `nvidia-smi` prints it.
    pub pci_bus_id: String,
    /// The NUMA node the device hangs off, when the kernel knows it (pinned buffers and the
    /// NIC are best on the same one).
    pub numa_node: Option<u32>,
}

/// The NUMA node of a PCI device, from sysfs; `None` when the kernel reports none (-1) or the
/// file is absent (no NUMA, or not Linux).
pub fn numa_node_of(pci_bus_id: &str) -> Option<u32> {
    let path = format!("/sys/bus/pci/devices/{}/numa_node", pci_bus_id.to_ascii_lowercase());
    parse_numa_node(&std::fs::read_to_string(path).ok()?)
}

fn parse_numa_node(sysfs: &str) -> Option<u32> {
    sysfs.trim().parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
}

#[derive(Debug, thiserror::Error)]
#[error("CUDA driver call failed during {during}: {source}")]
pub struct DeviceError {
    pub(crate) during: &'static str,
    #[source]
    pub(crate) source: result::DriverError,
}

/// The CUDA devices of this host; empty when there is no CUDA driver.
pub fn cuda_devices() -> Result<Vec<CudaDevice>, DeviceError> {
    // SAFETY: only probes whether the driver library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Ok(Vec::new());
    }
    let ctx = |during| move |source| DeviceError { during, source };
    result::init().map_err(ctx("cuInit"))?;
    let count = result::device::get_count().map_err(ctx("cuDeviceGetCount"))?;
    (0..count)
        .map(|ordinal| {
            let dev = result::device::get(ordinal).map_err(ctx("cuDeviceGet"))?;
            let name = result::device::get_name(dev).map_err(ctx("cuDeviceGetName"))?;
            // SAFETY: `dev` was returned by cuDeviceGet.
            let total = unsafe { result::device::total_mem(dev) }.map_err(ctx("cuDeviceTotalMem"))?;
            // SAFETY: as above.
            let attr = |a| unsafe { result::device::get_attribute(dev, a) };
            use sys::CUdevice_attribute::*;
            let domain = attr(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID).map_err(ctx("cuDeviceGetAttribute"))?;
            let bus = attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID).map_err(ctx("cuDeviceGetAttribute"))?;
            let device = attr(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID).map_err(ctx("cuDeviceGetAttribute"))?;
            let pci_bus_id = format!("{domain:08x}:{bus:02x}:{device:02x}.0");
            Ok(CudaDevice {
                ordinal,
                name,
                total_memory: total as u64,
                numa_node: numa_node_of(&pci_bus_id),
                pci_bus_id,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn numa_nodes_read_as_the_kernel_writes_them() {
        assert_eq!(super::parse_numa_node("1\n"), Some(1));
        assert_eq!(super::parse_numa_node("-1\n"), None, "the kernel's 'no node'");
        assert_eq!(super::parse_numa_node(""), None);
        assert_eq!(super::numa_node_of("0000:ff:ff.9"), None, "no such device");
    }

    #[test]
    fn discovery_never_panics() {
        // SAFETY: only probes whether the driver library can be loaded.
        let driver = unsafe { cudarc::driver::sys::is_culib_present() };
        match super::cuda_devices() {
            Ok(devices) if !driver => assert!(devices.is_empty(), "no driver, yet devices: {devices:?}"),
            Ok(devices) => {
                for (i, d) in devices.iter().enumerate() {
                    assert_eq!(d.ordinal, i as i32, "{d:?}");
                    assert!(d.total_memory > 0 && !d.name.is_empty(), "{d:?}");
                    assert!(d.pci_bus_id.ends_with(".0") && d.pci_bus_id.len() == 16, "{d:?}");
                }
            }
            // A driver with no usable device fails its first call, and says which.
            Err(e) => {
                assert!(driver, "an error without a driver: {e}");
                assert_eq!(e.during, "cuInit", "{e}");
            }
        }
    }
}
