//! The table of vNICs this daemon serves: records, live usage and counters.

use vrdma_abi::control::{Limits, Usage, VnicInfo, VERSION};

use super::key_guard::KeyGuard;
use super::load::PendingGauge;
use super::{gid_of, Registry, RequestError};
use crate::store::VnicRecord;

/// Per-vNIC counters.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Counters {
    /// Requests refused as malformed or naming objects the caller does not own.
    pub bad_requests: u64,
    /// Connections refused by tenant rules or unknown destinations.
    pub refused_connections: u64,
    /// Connections established.
    pub connections: u64,
    /// MRs registered through the copying fallback (memory that could not be shared).
    pub copied_mrs: u64,
    /// Peer-MR requests refused: a remote key that is not an MR of the QP's peer, an MR
    /// that grants a peer nothing, an access beyond the MR's rights, or any request while
    /// the vNIC is throttled for naming too many such keys.
    pub bad_keys: u64,
    /// Requests (and sessions, and lanes) refused by one of the vNIC's limits.
    pub refused_by_limits: u64,
    /// Queue memory (bytes) vrdmad holds for the vNIC's QPs now, charged against
    /// `max_ring_bytes`.
    pub ring_bytes: u64,
    /// Lanes the vNIC's QPs hold now.
    pub lanes: u32,
    /// Descriptors vrdmad holds now for the vNIC's MRs, charged against `max_fds`.
    pub descriptors: u64,
    /// Times the vNIC was moved off the direct path for exceeding its caps there (see
    /// `registry::qos`; once per daemon's life of the vNIC).
    pub demotions: u64,
}

/// A vNIC as reported to administrators.
#[derive(Clone, Debug, serde::Serialize)]
pub struct VnicStatus {
    /// Stored record.
    pub record: VnicRecord,
    /// Live usage.
    pub usage: Usage,
    /// Counters.
    pub counters: Counters,
}

/// A served vNIC.
pub(super) struct VnicState {
    pub(super) rec: VnicRecord,
    pub(super) usage: Usage,
    pub(super) counters: Counters,
    /// Rate of bad remote keys this vNIC names.
    pub(super) key_guard: KeyGuard,
    /// Meter totals of its gone QPs (and of earlier daemons), see `metering`.
    pub(super) meter: vrdma_abi::ring::MeterWords,
    /// Control requests of the vNIC's sessions in progress (counted without the registry
    /// lock: see [`PendingGauge`]).
    pub(super) pending: PendingGauge,
}

impl Registry {
    /// Adds (or replaces the record of) a vNIC.
    pub fn add_vnic(&mut self, rec: VnicRecord) {
        match self.vnics.get_mut(&rec.name) {
            Some(v) => {
                v.pending.set_limits(&rec.limits);
                v.rec = rec;
            }
            None => {
                let meter = self.meter_base.remove(&rec.name).unwrap_or([0; vrdma_abi::ring::METER_WORDS]);
                let pending = PendingGauge::new(&rec.limits);
                let state = VnicState {
                    rec,
                    usage: Usage::default(),
                    counters: Counters::default(),
                    key_guard: KeyGuard::default(),
                    meter,
                    pending,
                };
                self.vnics.insert(state.rec.name.clone(), state);
            }
        }
    }

    /// Removes a vNIC; fails while clients use it.
    pub fn remove_vnic(&mut self, name: &str) -> Result<(), RequestError> {
        match self.vnics.get(name) {
            None => Err(RequestError::NoSuchVnic { name: name.into() }),
            Some(v) if v.usage.clients > 0 => Err(RequestError::VnicInUse { name: name.into(), clients: v.usage.clients }),
            Some(_) => {
                self.vnics.remove(name);
                Ok(())
            }
        }
    }

    /// Removes a vNIC even while clients use it (deleted or moved away in the store): their
    /// sessions stay until the daemon closes their sockets, and get ENODEV meanwhile.
    pub fn remove_vnic_forced(&mut self, name: &str) -> bool {
        // Its sessions are orphaned: a vNIC of the same name added later (a container
        // restarted) must not inherit them, their objects or their counts.
        for s in self.sessions.values_mut().filter(|s| s.vnic == name) {
            s.vnic.clear();
        }
        self.vnics.remove(name).is_some()
    }

    /// Status of every vNIC.
    pub fn status(&self) -> Vec<VnicStatus> {
        let mut v: Vec<_> =
            self.vnics.values().map(|v| VnicStatus { record: v.rec.clone(), usage: v.usage, counters: v.counters }).collect();
        v.sort_by(|a, b| a.record.name.cmp(&b.record.name));
        v
    }

    /// Whether a vNIC exists.
    pub fn has_vnic(&self, name: &str) -> bool {
        self.vnics.contains_key(name)
    }

    /// Records of every vNIC.
    pub fn records(&self) -> Vec<VnicRecord> {
        self.vnics.values().map(|v| v.rec.clone()).collect()
    }

    /// The gauge of `vnic`'s control requests in progress.
    pub fn pending_gauge(&self, vnic: &str) -> Option<PendingGauge> {
        self.vnics.get(vnic).map(|v| v.pending.clone())
    }

    /// Counts a request of `session` that a limit refused.
    pub fn count_limit_refusal(&mut self, session: u64) {
        if let Ok(v) = self.vnic_of(session) {
            v.counters.refused_by_limits += 1;
        }
    }

    /// Limits of a vNIC.
    pub fn limits(&self, vnic: &str) -> Option<Limits> {
        self.vnics.get(vnic).map(|v| v.rec.limits)
    }

    /// `Hello`: checks the protocol version and describes the session's vNIC.
    pub(super) fn hello(&mut self, session: u64, version: u32) -> Result<vrdma_abi::control::Reply, RequestError> {
        if version != u32::from(VERSION) {
            return Err(RequestError::Version { version });
        }
        let v = self.vnic_of(session)?;
        let info = VnicInfo {
            name: v.rec.name.clone(),
            tenant: v.rec.tenant.clone(),
            gids: vec![gid_of(v.rec.ip)],
            limits: v.rec.limits,
            node_guid: v.rec.node_guid,
        };
        Ok(vrdma_abi::control::Reply::Hello(info))
    }
}
