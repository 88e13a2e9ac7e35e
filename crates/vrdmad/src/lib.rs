//! vrdmad, the per-host daemon of vrdma: it owns the control path. Each vNIC is
//! served on its own `control.sock` in its own directory; the admin API is a separate socket
//! only the host can reach. The data path never enters the daemon on one host.

pub mod admin;
pub mod engine;
pub mod firewall;
pub mod procmem;
pub mod registry;
pub mod routes;
pub mod server;
pub mod store;

pub use server::{Config, Daemon};
