//! vrdmad, the per-host daemon of vrdma: it owns the control path. Each vNIC is
//! served on its own `control.sock` in its own directory; the admin API is a separate socket
//! only the host can reach. The data path never enters the daemon on one host.

// A daemon serves every vNIC of the host: outside tests, a failure is an error to report,
// never a panic that takes them all down.
#![cfg_attr(not(test), deny(clippy::expect_used, clippy::unwrap_used))]

pub mod admin;
pub mod admin_client;
mod cdi;
pub mod engine;
pub mod firewall;
mod fuzz_choices;
pub mod metrics;
pub mod procmem;
pub mod registry;
pub mod routes;
pub mod server;
pub mod store;

pub use server::{Config, Daemon};
