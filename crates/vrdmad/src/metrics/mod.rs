//! Metering reports: the registry's meters (`crate::registry::VnicMeter`) named for people
//! (`report`), kept across daemon restarts (`persist`), and served to Prometheus
//! (`exposition`, `http`).

pub mod exposition;
pub mod http;
pub mod persist;
pub mod report;

pub use http::serve;
pub use report::MeterReport;
