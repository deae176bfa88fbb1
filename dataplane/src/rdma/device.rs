//! Finding an RDMA port to use. A host without RDMA support at all (`ibv_get_device_list` fails
//! with ENOSYS, as on these development machines) or without an active port is a normal state:
//! the data plane then speaks TCP.

use std::fmt;
use std::net::Ipv6Addr;
use std::sync::Arc;

use sideway::ibverbs::address::{Gid, GidType};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};

/// An active port of an RDMA device and the GID to address it by.
#[derive(Clone)]
pub struct RdmaPort {
    pub device: String,
    pub context: Arc<DeviceContext>,
    pub port: u8,
    pub gid_index: u32,
    pub gid: Gid,
    /// The port's active MTU, bytes.
    pub mtu: u32,
}

impl fmt::Debug for RdmaPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaPort")
            .field("device", &self.device)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("gid", &Ipv6Addr::from(self.gid.raw))
            .field("mtu", &self.mtu)
            .finish()
    }
}

impl fmt::Display for RdmaPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} port {} (GID {} at index {}, MTU {})",
            self.device,
            self.port,
            Ipv6Addr::from(self.gid.raw),
            self.gid_index,
            self.mtu
        )
    }
}

/// Why no RDMA port is used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoRdma {
    #[error("this host has no RDMA support ({0})")]
    Unsupported(String),
    #[error("no RDMA device{}", .0.as_ref().map(|d| format!(" named {d}")).unwrap_or_default())]
    NoDevice(Option<String>),
    #[error("RDMA device {device}: {reason}")]
    Unusable { device: String, reason: String },
}

/// An error's message followed by its sources' (sideway keeps the errno in a source).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

pub fn mtu_bytes(mtu: Mtu) -> u32 {
    match mtu {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

pub fn mtu_of_bytes(bytes: u32) -> Mtu {
    match bytes {
        b if b >= 4096 => Mtu::Mtu4096,
        b if b >= 2048 => Mtu::Mtu2048,
        b if b >= 1024 => Mtu::Mtu1024,
        b if b >= 512 => Mtu::Mtu512,
        _ => Mtu::Mtu256,
    }
}

/// The first active port (of the device named `wanted`, when given) and its best GID: RoCE v2
/// with an IPv4-mapped address first (what routes between hosts on an IP network), then any
/// RoCE v2, then any non-link-local GID, then anything non-zero.
pub fn find_port(wanted: Option<&str>) -> Result<RdmaPort, NoRdma> {
    let list = DeviceList::new().map_err(|e| NoRdma::Unsupported(with_sources(&e)))?;
    let mut reasons = Vec::new();
    for device in list.iter() {
        let name = device.name();
        if wanted.is_some_and(|w| w != name) {
            continue;
        }
        match usable_port(&device, &name) {
            Ok(port) => return Ok(port),
            Err(reason) => reasons.push(NoRdma::Unusable { device: name, reason }),
        }
    }
    Err(reasons.pop().unwrap_or_else(|| NoRdma::NoDevice(wanted.map(str::to_owned))))
}

fn usable_port(device: &sideway::ibverbs::device::Device<'_>, name: &str) -> Result<RdmaPort, String> {
    let context = device.open().map_err(|e| format!("cannot open: {}", with_sources(&e)))?;
    let attr = context.query_device().map_err(|e| format!("cannot query: {}", with_sources(&e)))?;
    let gids = context.query_gid_table().map_err(|e| format!("cannot read the GID table: {}", with_sources(&e)))?;
    for port in 1..=attr.phys_port_cnt() {
        let Ok(port_attr) = context.query_port(port) else { continue };
        if port_attr.port_state() != PortState::Active {
            continue;
        }
        let candidates: Vec<_> =
            gids.iter().filter(|g| g.port_num() == u32::from(port) && !g.gid().is_zero()).collect();
        let rank = |g: &&sideway::ibverbs::address::GidEntry| {
            let v2 = g.gid_type() == GidType::RoceV2;
            let ipv4 = Ipv6Addr::from(g.gid().raw).to_ipv4_mapped().is_some();
            match (v2, ipv4, g.gid().is_unicast_link_local()) {
                (true, true, _) => 0,
                (true, false, false) => 1,
                (_, _, false) => 2,
                _ => 3,
            }
        };
        if let Some(best) = candidates.into_iter().min_by_key(rank) {
            return Ok(RdmaPort {
                device: name.to_owned(),
                context: Arc::clone(&context),
                port,
                gid_index: best.gid_index(),
                gid: best.gid(),
                mtu: mtu_bytes(port_attr.active_mtu()),
            });
        }
    }
    Err("no active port with a GID".into())
}
