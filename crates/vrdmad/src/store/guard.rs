//! [`GuardedStore`]: a store whose every record has passed [`Check`] before the daemon sees it.
//!
//! Reads, snapshots and watch events all go through one [`View`] of the accepted records, which
//! also keeps addresses unique: a vNIC (or host) record claiming an address another record
//! already holds is refused while the holder lives, and admitted when the holder goes. A refused
//! record is logged once and otherwise ignored: the daemon keeps what it had accepted under that
//! name before (a bad write never stops a working vNIC, nor serves a bad one). Writes are checked
//! too, so the daemon never stores what it would refuse to read.

use std::collections::{BTreeMap, HashSet};
use std::net::Ipv4Addr;
use std::sync::Arc;

use parking_lot::Mutex;

use super::validate::{Check, RecordError};
use super::{HostRecord, RuleRecord, Snapshot, Store, StoreError, StoreEvent, TenantRecord, VnicRecord, WatchCallback, WatchHandle};

/// Refused records remembered to log each once; past this many the memory is cleared (a flood
/// of bad records then logs again, at a bounded rate).
const MAX_LOGGED: usize = 4096;

/// A kind of record [`View`] admits by address (vNICs, hosts): what it needs to check, log,
/// keep and announce one.
trait AddressedRecord: Clone {
    /// How refusals name the kind.
    const KIND: &'static str;
    fn name(&self) -> &str;
    /// The address it claims, unique among all vNICs and hosts.
    fn ip(&self) -> Ipv4Addr;
    fn check(&self, check: &Check) -> Result<(), RecordError>;
    /// Who other than `not` holds `ip`, as a refusal names them.
    fn holder(view: &View, ip: Ipv4Addr, not: &str) -> Option<String>;
    /// The accepted records of this kind, by name.
    fn accepted(view: &mut View) -> &mut BTreeMap<String, Self>;
    /// The valid records of this kind waiting for their address, by name.
    fn waiting(view: &mut View) -> &mut BTreeMap<String, Self>;
    fn put_event(self) -> StoreEvent;
    fn deleted_event(name: String) -> StoreEvent;
}

impl AddressedRecord for VnicRecord {
    const KIND: &'static str = "vNIC";
    fn name(&self) -> &str {
        &self.name
    }
    fn ip(&self) -> Ipv4Addr {
        self.ip
    }
    fn check(&self, check: &Check) -> Result<(), RecordError> {
        check.vnic(&self.name, self)
    }
    fn holder(view: &View, ip: Ipv4Addr, not: &str) -> Option<String> {
        view.vnic_holder(ip, not)
    }
    fn accepted(view: &mut View) -> &mut BTreeMap<String, Self> {
        &mut view.vnics
    }
    fn waiting(view: &mut View) -> &mut BTreeMap<String, Self> {
        &mut view.waiting_vnics
    }
    fn put_event(self) -> StoreEvent {
        StoreEvent::VnicPut(self)
    }
    fn deleted_event(name: String) -> StoreEvent {
        StoreEvent::VnicDeleted(name)
    }
}

impl AddressedRecord for HostRecord {
    const KIND: &'static str = "host";
    fn name(&self) -> &str {
        &self.name
    }
    fn ip(&self) -> Ipv4Addr {
        self.underlay_ip
    }
    fn check(&self, check: &Check) -> Result<(), RecordError> {
        check.host(&self.name, self)
    }
    fn holder(view: &View, ip: Ipv4Addr, not: &str) -> Option<String> {
        view.host_holder(ip, not)
    }
    fn accepted(view: &mut View) -> &mut BTreeMap<String, Self> {
        &mut view.hosts
    }
    fn waiting(view: &mut View) -> &mut BTreeMap<String, Self> {
        &mut view.waiting_hosts
    }
    fn put_event(self) -> StoreEvent {
        StoreEvent::HostPut(self)
    }
    fn deleted_event(name: String) -> StoreEvent {
        StoreEvent::HostDeleted(name)
    }
}

/// The accepted records, and the ones waiting for an address to free.
#[derive(Default)]
pub struct View {
    check: Check,
    vnics: BTreeMap<String, VnicRecord>,
    hosts: BTreeMap<String, HostRecord>,
    /// Valid records refused because another holds their address, by name.
    waiting_vnics: BTreeMap<String, VnicRecord>,
    waiting_hosts: BTreeMap<String, HostRecord>,
    logged: HashSet<String>,
    refused: u64,
}

impl View {
    /// An empty view checking against `check`.
    pub fn new(check: Check) -> View {
        View { check, ..Default::default() }
    }

    /// Records refused so far (each refusal of a put counts).
    pub fn refused(&self) -> u64 {
        self.refused
    }

    fn refuse(&mut self, what: &str, key: &str, e: &RecordError) {
        self.refused += 1;
        let line = format!("store: ignoring {what} record {key:?}: {e}");
        if self.logged.len() >= MAX_LOGGED {
            self.logged.clear();
        }
        if self.logged.insert(line.clone()) {
            log::warn!("{line}");
        }
    }

    /// Who else holds `ip`: another vNIC, or a host (a vNIC on a host's address would route
    /// that host's traffic to another).
    fn vnic_holder(&self, ip: Ipv4Addr, not: &str) -> Option<String> {
        let vnic = self.vnics.values().find(|o| o.ip == ip && o.name != not).map(|o| o.name.clone());
        vnic.or_else(|| self.hosts.values().find(|h| h.underlay_ip == ip).map(|h| format!("host {}", h.name)))
    }

    fn host_holder(&self, ip: Ipv4Addr, not: &str) -> Option<String> {
        let host = self.hosts.values().find(|o| o.underlay_ip == ip && o.name != not).map(|o| format!("host {}", o.name));
        host.or_else(|| self.vnics.values().find(|v| v.ip == ip).map(|v| v.name.clone()))
    }

    /// Admits a record if valid and its address free; the events it means.
    fn put<R: AddressedRecord>(&mut self, r: R, out: &mut Vec<StoreEvent>) {
        let name = r.name().to_owned();
        if let Err(e) = r.check(&self.check) {
            R::waiting(self).remove(&name);
            return self.refuse(R::KIND, &name, &e);
        }
        if let Some(holder) = R::holder(self, r.ip(), &name) {
            let e = RecordError::Duplicate { ip: r.ip().to_string(), holder };
            self.refuse(R::KIND, &name, &e);
            R::waiting(self).insert(name, r);
            return;
        }
        R::waiting(self).remove(&name);
        let old_ip = R::accepted(self).get(&name).map(R::ip).filter(|ip| *ip != r.ip());
        R::accepted(self).insert(name, r.clone());
        out.push(r.put_event());
        if let Some(ip) = old_ip {
            self.promote::<R>(ip, out);
        }
    }

    fn delete<R: AddressedRecord>(&mut self, name: String, out: &mut Vec<StoreEvent>) {
        R::waiting(self).remove(&name);
        let Some(old) = R::accepted(self).remove(&name) else { return };
        out.push(R::deleted_event(name));
        self.promote::<R>(old.ip(), out);
    }

    /// A record that waited for `ip` gets it (the first by name).
    fn promote<R: AddressedRecord>(&mut self, ip: Ipv4Addr, out: &mut Vec<StoreEvent>) {
        let waiting = R::waiting(self);
        if let Some(name) = waiting.values().find(|w| w.ip() == ip).map(|w| w.name().to_owned()) {
            if let Some(w) = waiting.remove(&name) {
                self.put(w, out);
            }
        }
    }

    fn rule(&mut self, r: &RuleRecord) -> bool {
        match self.check.rule(r) {
            Ok(()) => true,
            Err(e) => {
                self.refuse("rule", &format!("{}/{}", r.from_tenant, r.to_tenant), &e);
                false
            }
        }
    }

    fn tenant(&mut self, t: &TenantRecord) -> bool {
        match self.check.tenant(&t.name, t) {
            Ok(()) => true,
            Err(e) => {
                self.refuse("tenant", &t.name, &e);
                false
            }
        }
    }

    /// The whole store again: the accepted subset of `snap`. Records accepted before keep
    /// their addresses (incumbents first), and a name whose new record is invalid keeps its
    /// previously accepted one.
    fn resync(&mut self, snap: Snapshot) -> Snapshot {
        let (old_vnics, old_hosts) = (std::mem::take(&mut self.vnics), std::mem::take(&mut self.hosts));
        self.waiting_vnics.clear();
        self.waiting_hosts.clear();
        let mut sink = Vec::new();
        let (mut vnics, mut later) = (Vec::new(), Vec::new());
        for v in snap.vnics {
            match old_vnics.get(&v.name) {
                Some(o) if *o == v => vnics.push(v),
                Some(o) => match self.check.vnic(&v.name, &v) {
                    Err(e) => {
                        self.refuse("vNIC", &v.name.clone(), &e);
                        vnics.push(o.clone());
                    }
                    Ok(()) => later.push(v),
                },
                _ => later.push(v),
            }
        }
        for v in vnics.into_iter().chain(later) {
            self.put(v, &mut sink);
        }
        let (mut hosts, mut later) = (Vec::new(), Vec::new());
        for h in snap.hosts {
            match old_hosts.get(&h.name) {
                Some(o) if *o == h => hosts.push(h),
                _ => later.push(h),
            }
        }
        for h in hosts.into_iter().chain(later) {
            self.put(h, &mut sink);
        }
        let rules = snap.rules.into_iter().filter(|r| self.rule(r)).collect();
        let tenants = snap.tenants.into_iter().filter(|t| self.tenant(t)).collect();
        Snapshot {
            vnics: self.vnics.values().cloned().collect(),
            hosts: self.hosts.values().cloned().collect(),
            rules,
            tenants,
            revision: snap.revision,
        }
    }

    /// The events `e` means for the daemon once checked (none, one, or more when a record that
    /// waited for an address gets it).
    pub fn admit(&mut self, e: StoreEvent) -> Vec<StoreEvent> {
        let mut out = Vec::new();
        match e {
            StoreEvent::VnicPut(v) => self.put(v, &mut out),
            StoreEvent::VnicDeleted(n) => self.delete::<VnicRecord>(n, &mut out),
            StoreEvent::HostPut(h) => self.put(h, &mut out),
            StoreEvent::HostDeleted(n) => self.delete::<HostRecord>(n, &mut out),
            StoreEvent::RulePut(r) => {
                if self.rule(&r) {
                    out.push(StoreEvent::RulePut(r));
                }
            }
            StoreEvent::RuleDeleted(r) => {
                if self.check.rule(&r).is_ok() {
                    out.push(StoreEvent::RuleDeleted(r));
                }
            }
            StoreEvent::TenantPut(t) => {
                // (A bad policy is ignored: the tenant keeps the one accepted before.)
                if self.tenant(&t) {
                    out.push(StoreEvent::TenantPut(t));
                }
            }
            StoreEvent::TenantDeleted(n) => {
                if super::valid_tenant(&n) {
                    out.push(StoreEvent::TenantDeleted(n));
                }
            }
            StoreEvent::Resync(s) => out.push(StoreEvent::Resync(self.resync(s))),
        }
        out
    }
}

/// A store whose reads, snapshots and watch events carry only records that passed [`Check`].
pub struct GuardedStore {
    inner: Arc<dyn Store>,
    check: Check,
    view: Arc<Mutex<View>>,
}

impl GuardedStore {
    /// Guards `inner` with `check`.
    pub fn new(inner: Arc<dyn Store>, check: Check) -> GuardedStore {
        GuardedStore { inner, check, view: Arc::new(Mutex::new(View::new(check))) }
    }

    /// Records refused so far.
    pub fn refused(&self) -> u64 {
        self.view.lock().refused()
    }

    fn bad(key: &str, e: RecordError) -> StoreError {
        StoreError::BadRecord { key: key.to_string(), reason: e.to_string() }
    }
}

impl Store for GuardedStore {
    fn refused_records(&self) -> u64 {
        self.refused()
    }
    fn list_vnics(&self) -> Result<Vec<VnicRecord>, StoreError> {
        let all = self.inner.list_vnics()?;
        let mut v = self.view.lock();
        Ok(all.into_iter().filter(|r| self.check.vnic(&r.name, r).map_err(|e| v.refuse("vNIC", &r.name, &e)).is_ok()).collect())
    }

    fn get_vnic(&self, name: &str) -> Result<Option<VnicRecord>, StoreError> {
        let Some(r) = self.inner.get_vnic(name)? else { return Ok(None) };
        match self.check.vnic(name, &r) {
            Ok(()) => Ok(Some(r)),
            Err(e) => {
                self.view.lock().refuse("vNIC", name, &e);
                Ok(None)
            }
        }
    }

    fn create_vnic(&self, v: &VnicRecord) -> Result<(), StoreError> {
        self.check.vnic(&v.name, v).map_err(|e| Self::bad(&v.name, e))?;
        self.inner.create_vnic(v)
    }

    fn update_vnic(&self, v: &VnicRecord) -> Result<(), StoreError> {
        self.check.vnic(&v.name, v).map_err(|e| Self::bad(&v.name, e))?;
        self.inner.update_vnic(v)
    }

    fn delete_vnic(&self, name: &str) -> Result<bool, StoreError> {
        // Any key may be deleted (that is how an operator removes a bad record).
        self.inner.delete_vnic(name)
    }

    fn put_host(&self, h: &HostRecord) -> Result<(), StoreError> {
        self.check.host(&h.name, h).map_err(|e| Self::bad(&h.name, e))?;
        self.inner.put_host(h)
    }

    fn list_hosts(&self) -> Result<Vec<HostRecord>, StoreError> {
        let all = self.inner.list_hosts()?;
        let mut v = self.view.lock();
        Ok(all.into_iter().filter(|h| self.check.host(&h.name, h).map_err(|e| v.refuse("host", &h.name, &e)).is_ok()).collect())
    }

    fn put_rule(&self, r: &RuleRecord) -> Result<(), StoreError> {
        self.check.rule(r).map_err(|e| Self::bad(&format!("{}/{}", r.from_tenant, r.to_tenant), e))?;
        self.inner.put_rule(r)
    }

    fn delete_rule(&self, r: &RuleRecord) -> Result<bool, StoreError> {
        self.inner.delete_rule(r)
    }

    fn list_rules(&self) -> Result<Vec<RuleRecord>, StoreError> {
        let all = self.inner.list_rules()?;
        let mut v = self.view.lock();
        Ok(all.into_iter().filter(|r| v.rule(r)).collect())
    }

    fn put_tenant(&self, t: &TenantRecord) -> Result<(), StoreError> {
        self.check.tenant(&t.name, t).map_err(|e| Self::bad(&t.name, e))?;
        self.inner.put_tenant(t)
    }

    fn delete_tenant(&self, name: &str) -> Result<bool, StoreError> {
        self.inner.delete_tenant(name)
    }

    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        let all = self.inner.list_tenants()?;
        let mut v = self.view.lock();
        Ok(all.into_iter().filter(|t| v.tenant(t)).collect())
    }

    fn snapshot(&self) -> Result<Snapshot, StoreError> {
        let snap = self.inner.snapshot()?;
        Ok(self.view.lock().resync(snap))
    }

    fn watch(&self, from_revision: i64, mut cb: WatchCallback) -> Result<WatchHandle, StoreError> {
        let view = self.view.clone();
        self.inner.watch(
            from_revision,
            Box::new(move |e| {
                let events = view.lock().admit(e);
                for e in events {
                    cb(e);
                }
            }),
        )
    }
}

#[cfg(test)]
mod tests;
