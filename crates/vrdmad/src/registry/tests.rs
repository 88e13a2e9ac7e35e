//! Unit tests of the registry: the broker, remote datagrams, and how requests fail.

use std::net::{Ipv4Addr, SocketAddr};

use vrdma_abi::control::{Limits, MrChunk, QpCaps, Reply, Request};

use super::*;
use crate::store::{HostRecord, RuleRecord, VnicRecord};

/// A vNIC record at 198.18.0.`ip` on `host` (shared by the registry's test modules).
pub(super) fn rec(name: &str, tenant: &str, ip: u8, host: &str) -> VnicRecord {
    VnicRecord {
        name: name.into(),
        tenant: tenant.into(),
        ip: Ipv4Addr::new(198, 18, 0, ip),
        prefix_len: 15,
        limits: Limits::default(),
        node_guid: 1,
        host: host.into(),
        qos: Default::default(),
    }
}

/// The handle, CQ, QP number or key a request made.
pub(super) fn handle(r: &mut Registry, s: u64, req: Request) -> u32 {
    match r.handle_request(s, req, vec![]).unwrap().0 {
        Reply::Handle { handle } => handle,
        Reply::Cq { cq } => cq,
        Reply::Qp { qpn, .. } => qpn,
        Reply::Mr { lkey, .. } => lkey,
        other => panic!("{other:?}"),
    }
}

#[test]
fn broker_resolves_local_and_remote_gids_with_rules() {
    let mut r = Registry::default();
    r.cluster_mut().local_host = "h1".into();
    let h2 = HostRecord {
        name: "h2".into(),
        transport_addr: "198.19.255.12:4791".parse().unwrap(),
        underlay_ip: Ipv4Addr::new(198, 19, 255, 12),
    };
    for v in [rec("a", "red", 2, "h1"), rec("b", "blue", 3, "h1"), rec("far", "blue", 4, "h2"), rec("mine", "red", 5, "h1")] {
        r.cluster_mut().vnics.insert(v.name.clone(), v.clone());
        if v.host == "h1" && v.name != "mine" {
            r.add_vnic(v);
        }
    }
    r.cluster_mut().hosts.insert("h2".into(), h2.clone());
    let s = r.open_session("a", None).unwrap();
    let gid = |ip: u8| gid_of(Ipv4Addr::new(198, 18, 0, ip));

    // Cross-tenant: refused and counted on both local vNICs.
    assert_eq!(r.resolve_gid(s, 1, gid(3)).unwrap_err().errno(), libc::ECONNREFUSED);
    assert_eq!(r.resolve_gid(s, 1, gid(4)).unwrap_err().errno(), libc::ECONNREFUSED);
    // Unknown GIDs, and records of this host that are not served (yet).
    assert_eq!(r.resolve_gid(s, 1, gid(9)).unwrap_err().errno(), libc::EHOSTUNREACH);
    assert_eq!(r.resolve_gid(s, 1, gid(5)).unwrap_err().errno(), libc::EHOSTUNREACH);
    let counted = |r: &Registry, n: &str| r.status().iter().find(|v| v.record.name == n).unwrap().counters.refused_connections;
    assert_eq!((counted(&r, "a"), counted(&r, "b")), (4, 1));

    // A rule (either order) allows both directions.
    r.cluster_mut().rules.insert(RuleRecord::new("blue", "red"));
    assert_eq!(r.resolve_gid(s, 1, gid(3)).unwrap(), Resolved::Local("b".into()));
    assert_eq!(r.resolve_gid(s, 1, gid(4)).unwrap(), Resolved::Remote { vnic: rec("far", "blue", 4, "h2"), host: h2 });
    // A vNIC whose host is down.
    r.cluster_mut().hosts.clear();
    assert_eq!(r.resolve_gid(s, 1, gid(4)).unwrap_err().errno(), libc::EHOSTUNREACH);

    // Removed under a live session: requests get ENODEV, closing still works.
    assert_eq!(r.sessions_of("a"), vec![s]);
    assert!(r.remove_vnic_forced("a"));
    assert_eq!(r.handle_request(s, Request::AllocPd, vec![]).unwrap_err().errno(), libc::ENODEV);
    r.close_session(s);
    assert!(r.sessions_of("a").is_empty());
}

/// A datagram from another host reaches a UD QP only if it is addressed to that QP's
/// GID, comes from the daemon serving the source vNIC, and tenant rules allow it.
#[test]
fn remote_ud_datagrams_are_checked_before_delivery() {
    let mut r = Registry::default();
    r.cluster_mut().local_host = "h1".into();
    let h2_addr: SocketAddr = "198.19.255.12:4791".parse().unwrap();
    let h2 = HostRecord { name: "h2".into(), transport_addr: h2_addr, underlay_ip: Ipv4Addr::new(198, 19, 255, 12) };
    for v in [rec("a", "red", 2, "h1"), rec("far", "red", 4, "h2"), rec("other", "blue", 6, "h2")] {
        r.cluster_mut().vnics.insert(v.name.clone(), v.clone());
        if v.host == "h1" {
            r.add_vnic(v);
        }
    }
    r.cluster_mut().hosts.insert("h2".into(), h2);
    let s = r.open_session("a", None).unwrap();
    let gid = |ip: u8| gid_of(Ipv4Addr::new(198, 18, 0, ip));
    let handle = |r: &mut Registry, req| match r.handle_request(s, req, vec![]).unwrap().0 {
        Reply::Handle { handle } => handle,
        Reply::Cq { cq } => cq,
        Reply::Qp { qpn, .. } => qpn,
        other => panic!("{other:?}"),
    };
    let pd = handle(&mut r, Request::AllocPd);
    let cq = handle(&mut r, Request::CreateCq { cqe: 16 });
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let ud = handle(&mut r, Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: QPT_UD, caps });
    let rc = handle(&mut r, Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: 2, caps });

    assert_eq!(r.accept_ud(h2_addr, &gid(4), ud, &gid(2)), Ok(()));
    assert!(r.ud_receiver(ud).is_some());
    // Not a UD QP, no such QP, or another GID than the QP's.
    assert!(r.accept_ud(h2_addr, &gid(4), rc, &gid(2)).is_err());
    assert!(r.ud_receiver(rc).is_none());
    assert!(r.accept_ud(h2_addr, &gid(4), 999, &gid(2)).is_err());
    assert!(r.accept_ud(h2_addr, &gid(4), ud, &gid(9)).is_err());
    // A source GID nobody has, or one served by another daemon than the sender.
    assert!(r.accept_ud(h2_addr, &gid(8), ud, &gid(2)).is_err());
    assert!(r.accept_ud("198.19.255.13:4791".parse().unwrap(), &gid(4), ud, &gid(2)).is_err());
    // Another tenant: refused and counted, until a rule allows it.
    let refused = |r: &Registry| r.status().iter().find(|v| v.record.name == "a").unwrap().counters.refused_connections;
    let before = refused(&r);
    assert!(matches!(r.accept_ud(h2_addr, &gid(6), ud, &gid(2)), Err(UdRefusal::TenantsNotAllowed { .. })));
    assert_eq!(refused(&r), before + 1);
    r.cluster_mut().rules.insert(RuleRecord::new("blue", "red"));
    assert_eq!(r.accept_ud(h2_addr, &gid(6), ud, &gid(2)), Ok(()));
    r.close_session(s);
    assert!(r.accept_ud(h2_addr, &gid(4), ud, &gid(2)).is_err());
}

/// A CONNECT_REQ's source is taken from the cluster view: its GID must be a vNIC the sending
/// daemon serves, and that vNIC's tenant is checked, whatever tenant the frame claims.
#[test]
fn connect_requests_take_their_tenant_from_the_cluster_view() {
    let mut r = Registry::default();
    r.cluster_mut().local_host = "h1".into();
    let h2_addr: SocketAddr = "198.19.255.12:4791".parse().unwrap();
    let h3_addr: SocketAddr = "198.19.255.13:4791".parse().unwrap();
    for (name, addr) in [("h2", h2_addr), ("h3", h3_addr)] {
        let underlay = match addr.ip() {
            std::net::IpAddr::V4(a) => a,
            std::net::IpAddr::V6(_) => unreachable!(),
        };
        r.cluster_mut().hosts.insert(name.into(), HostRecord { name: name.into(), transport_addr: addr, underlay_ip: underlay });
    }
    for v in [rec("blue1", "blue", 2, "h1"), rec("red2", "red", 4, "h2"), rec("blue3", "blue", 6, "h3")] {
        r.cluster_mut().vnics.insert(v.name.clone(), v.clone());
        if v.host == "h1" {
            r.add_vnic(v);
        }
    }
    let s = r.open_session("blue1", None).unwrap();
    let pd = match r.handle_request(s, Request::AllocPd, vec![]).unwrap().0 {
        Reply::Handle { handle } => handle,
        other => panic!("{other:?}"),
    };
    let cq = match r.handle_request(s, Request::CreateCq { cqe: 16 }, vec![]).unwrap().0 {
        Reply::Cq { cq } => cq,
        other => panic!("{other:?}"),
    };
    let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = match r.handle_request(s, Request::CreateQp { pd, send_cq: cq, recv_cq: cq, srq: 0, qp_type: QPT_RC, caps }, vec![]).unwrap().0
    {
        Reply::Qp { qpn, .. } => qpn,
        other => panic!("{other:?}"),
    };
    let gid = |ip: u8| gid_of(Ipv4Addr::new(198, 18, 0, ip));
    let req = |src: u8, tenant: &str| vrdma_abi::wire::ConnectReq { src_gid: gid(src), dst_gid: gid(2), src_tenant: tenant.into() };
    // A red vNIC claiming to be blue: refused for its real tenant.
    let e = r.accept_remote(h2_addr, 7, qp, &req(4, "blue")).unwrap_err();
    assert!(matches!(&e, RequestError::TenantsNotAllowed { from, .. } if from == "red"), "{e}");
    // A daemon speaking for a vNIC another daemon serves, or for a GID nobody has.
    let e = r.accept_remote(h2_addr, 7, qp, &req(6, "blue")).unwrap_err();
    assert!(matches!(e, RequestError::ForeignSource { .. }), "{e}");
    assert_eq!(e.errno(), libc::ECONNREFUSED);
    assert!(matches!(r.accept_remote(h2_addr, 7, qp, &req(9, "blue")), Err(RequestError::ForeignSource { .. })));
    // The real blue vNIC, from its own daemon (whatever tenant it claims).
    r.accept_remote(h3_addr, 7, qp, &req(6, "red")).unwrap();
    let refused = r.status().iter().find(|v| v.record.name == "blue1").unwrap().counters.refused_connections;
    assert_eq!(refused, 3);
}

#[test]
fn the_registry_alone_answers_only_what_needs_no_other_daemon() {
    let (reply, fds) = Plan::<()>::Done(Reply::Ok, vec![]).answered_here().unwrap();
    assert!(matches!(reply, Reply::Ok) && fds.is_empty());
    let step = |()| Ok((Reply::UdRemote, vec![]));
    assert!(matches!(Plan::Remote(()).answer_or(step), Ok((Reply::UdRemote, _))));
    let refused = Plan::Remote(()).answered_here().unwrap_err();
    assert!(matches!(refused, RequestError::RemoteNeedsDaemon), "{refused}");
    assert_eq!(refused.errno(), libc::EHOSTUNREACH);
    assert!(!refused.is_bad_input());
}

/// SRQ and CQ rings are the daemon's memory like QP rings: a tenant that asks for many
/// large ones meets its vNIC's `max_ring_bytes`, and gets the bytes back on destroy and when
/// its session ends.
#[test]
fn srq_and_cq_rings_are_charged_to_the_vnic() {
    let mut r = Registry::default();
    let mut v = rec("a", "red", 2, "");
    v.limits.max_ring_bytes = 8 << 20;
    r.add_vnic(v);
    let ring_bytes = |r: &Registry| r.status()[0].counters.ring_bytes;
    let s = r.open_session("a", None).unwrap();
    let pd = match r.handle_request(s, Request::AllocPd, vec![]).unwrap().0 {
        Reply::Handle { handle } => handle,
        other => panic!("{other:?}"),
    };
    let mut srqs = Vec::new();
    let refused = loop {
        match r.handle_request(s, Request::CreateSrq { pd, max_wr: 4096, max_sge: 16 }, vec![]) {
            Ok((Reply::Srq { srq, .. }, _)) => srqs.push(srq),
            Ok((other, _)) => panic!("{other:?}"),
            Err(e) => break e,
        }
        assert!(srqs.len() < 64, "SRQs are not charged: {} made", srqs.len());
    };
    assert_eq!(refused.errno(), libc::ENOMEM, "{refused}");
    assert!(!srqs.is_empty() && ring_bytes(&r) <= 8 << 20);
    let full = ring_bytes(&r);
    r.handle_request(s, Request::DestroySrq { srq: srqs[0] }, vec![]).unwrap();
    assert!(ring_bytes(&r) < full);
    let before_cq = ring_bytes(&r);
    let cq = match r.handle_request(s, Request::CreateCq { cqe: 16 }, vec![]).unwrap().0 {
        Reply::Cq { cq } => cq,
        other => panic!("{other:?}"),
    };
    assert!(ring_bytes(&r) > before_cq, "a CQ's page is charged");
    r.handle_request(s, Request::DestroyCq { cq }, vec![]).unwrap();
    assert_eq!(ring_bytes(&r), before_cq);
    r.handle_request(s, Request::CreateCq { cqe: 16 }, vec![]).unwrap();
    r.close_session(s);
    assert_eq!(ring_bytes(&r), 0, "the session's queues are given back");
}

/// A vNIC deleted in the store while clients hold it, then created again under the same
/// name (a restarted container): the new vNIC starts empty, and the old clients' objects and
/// their hanging up never show in its counts. (Found by the `registry_requests` fuzz target.)
#[test]
fn a_vnic_added_again_does_not_inherit_orphaned_sessions() {
    let mut r = Registry::default();
    r.add_vnic(rec("a", "red", 2, ""));
    let old = r.open_session("a", None).unwrap();
    r.handle_request(old, Request::AllocPd, vec![]).unwrap();
    assert!(r.remove_vnic_forced("a"));
    r.add_vnic(rec("a", "red", 2, ""));
    let usage = |r: &Registry| r.status()[0].usage;
    assert_eq!((usage(&r).clients, usage(&r).pds), (0, 0));
    assert_eq!(r.handle_request(old, Request::AllocPd, vec![]).unwrap_err().errno(), libc::ENODEV);
    let new = r.open_session("a", None).unwrap();
    r.handle_request(new, Request::AllocPd, vec![]).unwrap();
    r.close_session(old);
    assert_eq!((usage(&r).clients, usage(&r).pds), (1, 1));
    r.check_invariants().unwrap();
}

/// Every registration leaves vrdmad holding the memfds it sent: one tenant registering many
/// MRs meets its vNIC's `max_fds` (EMFILE, counted), and all tenants together meet the
/// daemon's budget, so no tenant can run vrdmad out of descriptors for the others.
/// Deregistration and the session's end give them back.
#[test]
fn descriptors_held_for_mrs_are_bounded_per_vnic_and_in_all() {
    let mut r = Registry::default();
    let mut a = rec("a", "red", 2, "");
    a.limits.max_fds = 16;
    r.add_vnic(a);
    r.add_vnic(rec("b", "blue", 3, ""));
    let s = r.open_session("a", None).unwrap();
    let pd = |r: &mut Registry, s| match r.handle_request(s, Request::AllocPd, vec![]).unwrap().0 {
        Reply::Handle { handle } => handle,
        other => panic!("{other:?}"),
    };
    let reg = |r: &mut Registry, s: u64, pd: u32, n: usize| {
        let page = 4096u64;
        let chunks: Vec<_> = (0..n).map(|i| MrChunk { mr_offset: i as u64 * page, len: page, fd_offset: 0 }).collect();
        let fds = (0..n).map(|_| vrdma_abi::shm::create_memfd("test-mr", page as usize, true).unwrap()).collect();
        let req = Request::RegMr { pd, addr: 0x10_0000, length: n as u64 * page, access: 0x7, chunks };
        r.handle_request(s, req, fds)
    };
    let held = |r: &Registry, n: &str| r.status().iter().find(|v| v.record.name == n).unwrap().counters.descriptors;
    let p = pd(&mut r, s);
    let mut keys = Vec::new();
    let refused = loop {
        match reg(&mut r, s, p, 2) {
            Ok((Reply::Mr { lkey, .. }, _)) => keys.push(lkey),
            Ok((other, _)) => panic!("{other:?}"),
            Err(e) => break e,
        }
        assert!(keys.len() < 100, "descriptors are not bounded: {} MRs of 2 memfds each", keys.len());
    };
    assert_eq!(refused.errno(), libc::EMFILE, "{refused}");
    assert!(held(&r, "a") <= 16 && held(&r, "a") >= 12, "{}", held(&r, "a"));
    r.check_invariants().unwrap();
    r.handle_request(s, Request::DeregMr { key: keys[0] }, vec![]).unwrap();
    reg(&mut r, s, p, 2).expect("room again after a deregistration");

    // The daemon's budget bounds all vNICs together: b (default max_fds) meets it.
    r.set_descriptor_budget(held(&r, "a") + 6);
    let sb = r.open_session("b", None).unwrap();
    let pb = pd(&mut r, sb);
    reg(&mut r, sb, pb, 2).unwrap();
    reg(&mut r, sb, pb, 2).unwrap();
    assert_eq!(reg(&mut r, sb, pb, 2).unwrap_err().errno(), libc::EMFILE);
    r.check_invariants().unwrap();
    r.close_session(s);
    assert_eq!(held(&r, "a"), 0);
    reg(&mut r, sb, pb, 2).expect("a's session gave its descriptors back");
    r.close_session(sb);
    r.check_invariants().unwrap();
}
