//! Device context, attributes and protection domains.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::RwLock;
use vrdma_abi::control::{Reply, Request, Usage, VnicInfo, VERSION};

use crate::ctl::Control;
use crate::error::Error;
use crate::mr::LocalMr;

/// Device attributes (`ibv_device_attr` subset that applications read).
#[derive(Clone, Debug)]
#[allow(missing_docs)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_srq_sge: u32,
    pub max_inline_data: u32,
    pub phys_port_cnt: u8,
    /// Atomics are atomic across all QPs of the host (IBV_ATOMIC_GLOB).
    pub atomic_glob: bool,
}

/// Port attributes (`ibv_port_attr` subset).
#[derive(Clone, Debug)]
#[allow(missing_docs)]
pub struct PortAttr {
    /// IBV_PORT_ACTIVE (4).
    pub state: u32,
    /// Path MTU enum (5 = 4096).
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: u32,
    pub lid: u16,
    /// IBV_LINK_LAYER_ETHERNET (2).
    pub link_layer: u8,
    pub active_speed: u8,
    pub active_width: u8,
}

pub(crate) struct CtxInner {
    pub(crate) ctl: Control,
    pub(crate) info: VnicInfo,
    pub(crate) mrs: RwLock<HashMap<u32, Arc<LocalMr>>>,
    /// See [`Context::set_peer_loss_like_hardware`].
    pub(crate) hw_peer_loss: AtomicBool,
    /// Mediated QPs, and the thread that fails them if vrdmad goes away.
    daemon_watch: parking_lot::Mutex<DaemonWatch>,
    /// Moving MRs to new pages when a peer loses the right to them.
    pub(crate) rehome: parking_lot::Mutex<crate::rehome::RehomeWatch>,
    /// The session's staging buffer for staged direct copies ([`crate::peer::copy_path`]),
    /// held while one is filled and emptied.
    pub(crate) copy_staging: parking_lot::Mutex<crate::peer::CopyStaging>,
}

/// Watches the control socket for vrdmad's end (started at the first mediated QP, or when
/// the application asks for the context's events).
#[derive(Default)]
struct DaemonWatch {
    qps: Vec<Weak<crate::qp::QpInner>>,
    /// Where `DeviceFatal` goes ([`Context::watch_events`]; one per `ibv_open_device` of
    /// the drop-in, which share this context).
    events: Vec<Weak<crate::events::EventsInner>>,
    /// Written to stop the thread (the context is closing).
    stop: Option<OwnedFd>,
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        if let Some(stop) = &self.daemon_watch.get_mut().stop {
            vrdma_abi::fd::signal_eventfd(stop);
        }
    }
}

impl CtxInner {
    /// Blocks until vrdmad hangs up the control socket (then fails the mediated QPs) or the
    /// context closes (`stop` becomes readable). Never reads or writes the socket.
    fn watch_daemon(me: Weak<CtxInner>, ctl_fd: RawFd, stop: RawFd) {
        loop {
            let mut fds = [
                libc::pollfd { fd: stop, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: ctl_fd, events: libc::POLLRDHUP, revents: 0 },
            ];
            // SAFETY: poll(2) on an array of two pollfds we own.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            // Stop first: once the context closed, `ctl_fd` may name another file.
            if fds[0].revents != 0 {
                return;
            }
            if fds[1].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                let Some(ctx) = me.upgrade() else { return };
                let (qps, events) = {
                    let w = ctx.daemon_watch.lock();
                    let qps: Vec<_> = w.qps.iter().filter_map(Weak::upgrade).collect();
                    (qps, w.events.iter().filter_map(Weak::upgrade).collect::<Vec<_>>())
                };
                drop(ctx);
                for q in qps {
                    q.daemon_gone();
                }
                // After the QPs' own events: the device's is the last word.
                for ev in events {
                    ev.raise(crate::AsyncEvent { kind: crate::AsyncEventKind::DeviceFatal, qpn: 0 });
                }
                return;
            }
        }
    }
}

/// An open vNIC.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

impl Context {
    /// Opens the vNIC served at `socket`.
    pub fn open(socket: &Path) -> Result<Context, Error> {
        let ctl = Control::connect(socket)?;
        let (r, mut fds) = ctl.call("open_device", &Request::Hello { version: u32::from(VERSION) }, &[])?;
        let rehome_eventfd = (fds.len() == 1).then(|| fds.remove(0));
        let Reply::Hello(info) = r else {
            return Err(Error::UnexpectedReply { op: "open_device" });
        };
        Ok(Context {
            inner: Arc::new(CtxInner {
                ctl,
                info,
                mrs: RwLock::new(HashMap::new()),
                hw_peer_loss: AtomicBool::new(false),
                daemon_watch: parking_lot::Mutex::new(DaemonWatch::default()),
                rehome: parking_lot::Mutex::new(crate::rehome::RehomeWatch::new(rehome_eventfd)),
                copy_staging: parking_lot::Mutex::new(crate::peer::CopyStaging::default()),
            }),
        })
    }

    /// Makes `qp` (mediated) fail with flushes if vrdmad goes away; the first one starts
    /// the watching thread.
    pub(crate) fn watch_daemon(&self, qp: Weak<crate::qp::QpInner>) {
        let mut w = self.inner.daemon_watch.lock();
        w.qps.retain(|q| q.strong_count() > 0);
        w.qps.push(qp);
        self.start_daemon_watch(&mut w);
    }

    /// Device-level asynchronous events of this context also go to `events`: `DeviceFatal`
    /// when vrdmad hangs up the vNIC's control socket (a thread waits for that, sleeping).
    pub fn watch_events(&self, events: &crate::AsyncEvents) {
        let mut w = self.inner.daemon_watch.lock();
        w.events.retain(|e| e.strong_count() > 0);
        w.events.push(Arc::downgrade(&events.inner));
        self.start_daemon_watch(&mut w);
    }

    fn start_daemon_watch(&self, w: &mut DaemonWatch) {
        if w.stop.is_some() {
            return;
        }
        // SAFETY: eventfd(2) returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return; // no watch: a mediated QP then waits for vrdmad as before, no DeviceFatal
        }
        // SAFETY: a fresh descriptor owned by nobody else.
        let stop = unsafe { OwnedFd::from_raw_fd(fd) };
        let (me, ctl_fd, stop_fd) = (Arc::downgrade(&self.inner), self.inner.ctl.raw_fd(), stop.as_raw_fd());
        let spawned =
            std::thread::Builder::new().name("vrdma-daemon-watch".into()).spawn(move || CtxInner::watch_daemon(me, ctl_fd, stop_fd));
        if spawned.is_ok() {
            w.stop = Some(stop);
        }
    }

    /// Opens the vNIC at `$VRDMA_SOCKET`, or [`crate::DEFAULT_SOCKET`].
    pub fn open_default() -> Result<Context, Error> {
        let p = std::env::var_os("VRDMA_SOCKET").unwrap_or_else(|| crate::DEFAULT_SOCKET.into());
        Context::open(Path::new(&p))
    }

    /// How this context's RC QPs learn that the process of their connected peer went away.
    ///
    /// By default (`false`) vrdmad's notice moves the QP to ERR at once and flushes every
    /// outstanding WR, so a receiver waiting for a dead peer wakes up with WR_FLUSH_ERR.
    /// With `true` the QP behaves like a NIC's, which hears nothing when a remote QP is
    /// destroyed: receives stay posted, and the QP fails (RETRY_EXC_ERR, then ERR) only when
    /// it next sends to the peer and its retries are spent (the ACK timeout times
    /// `retry_cnt + 1`). Unmodified applications (the drop-in libibverbs) need this:
    /// peers of a ping-pong finish at slightly different times, and the one finishing last
    /// must not see its spare receives flushed.
    pub fn set_peer_loss_like_hardware(&self, on: bool) {
        self.inner.hw_peer_loss.store(on, Ordering::Relaxed);
    }

    /// The vNIC's name.
    pub fn name(&self) -> &str {
        &self.inner.info.name
    }

    /// The vNIC's tenant.
    pub fn tenant(&self) -> &str {
        &self.inner.info.tenant
    }

    /// Device attributes.
    pub fn query_device(&self) -> DeviceAttr {
        let l = &self.inner.info.limits;
        DeviceAttr {
            fw_ver: env!("CARGO_PKG_VERSION").to_string(),
            node_guid: self.inner.info.node_guid,
            sys_image_guid: self.inner.info.node_guid,
            max_mr_size: l.max_mr_bytes,
            page_size_cap: 0xffff_f000,
            vendor_id: 0x5652,
            vendor_part_id: 1,
            hw_ver: 1,
            max_qp: l.max_qp,
            max_qp_wr: 16384,
            max_sge: 32,
            max_cq: l.max_cq,
            max_cqe: 65536,
            max_mr: l.max_mr,
            max_pd: l.max_pd,
            max_qp_rd_atom: 16,
            max_qp_init_rd_atom: 16,
            max_srq: l.max_srq,
            max_srq_wr: 16384,
            max_srq_sge: 32,
            max_inline_data: 4096,
            phys_port_cnt: 1,
            atomic_glob: true,
        }
    }

    /// Attributes of port 1 (the only port).
    pub fn query_port(&self, port: u8) -> Result<PortAttr, Error> {
        if port != 1 {
            return Err(crate::error::invalid("query_port", format!("port {port} does not exist")));
        }
        Ok(PortAttr {
            state: 4,
            max_mtu: 5,
            active_mtu: 5,
            gid_tbl_len: self.inner.info.gids.len() as u32,
            lid: 0,
            link_layer: 2,
            active_speed: 32,
            active_width: 2,
        })
    }

    /// GID `index` of port 1.
    pub fn query_gid(&self, port: u8, index: usize) -> Result<[u8; 16], Error> {
        if port != 1 {
            return Err(crate::error::invalid("query_gid", format!("port {port} does not exist")));
        }
        self.inner
            .info
            .gids
            .get(index)
            .copied()
            .ok_or_else(|| crate::error::invalid("query_gid", format!("GID index {index} out of range")))
    }

    /// The GID table.
    pub fn gids(&self) -> &[[u8; 16]] {
        &self.inner.info.gids
    }

    /// Resources this vNIC holds now (all clients).
    pub fn usage(&self) -> Result<Usage, Error> {
        match self.inner.ctl.call("query_usage", &Request::QueryUsage, &[])?.0 {
            Reply::Usage(u) => Ok(u),
            _ => Err(Error::UnexpectedReply { op: "query_usage" }),
        }
    }

    /// Whether `dgid` is a vNIC this one may reach (`ibv_create_ah` resolves its destination
    /// like hardware resolves an address): EHOSTUNREACH or ECONNREFUSED otherwise.
    pub fn check_gid(&self, dgid: [u8; 16]) -> Result<(), Error> {
        self.inner.ctl.call("create_ah", &Request::CheckGid { dgid }, &[]).map(|_| ())
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<Pd, Error> {
        match self.inner.ctl.call("alloc_pd", &Request::AllocPd, &[])?.0 {
            Reply::Handle { handle } => Ok(Pd { inner: Arc::new(PdInner { ctx: self.clone(), handle }) }),
            _ => Err(Error::UnexpectedReply { op: "alloc_pd" }),
        }
    }
}

/// A protection domain (cheap to clone; deallocated when the last user goes).
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pub(crate) ctx: Context,
    pub(crate) handle: u32,
}

impl Pd {
    /// The context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }
    /// vrdmad's handle of the PD (what control requests name it by).
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }
}

impl Drop for PdInner {
    fn drop(&mut self) {
        let _ = self.ctx.inner.ctl.call("dealloc_pd", &Request::DeallocPd { pd: self.handle }, &[]);
    }
}
