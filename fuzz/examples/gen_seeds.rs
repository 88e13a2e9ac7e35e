//! Writes a seed corpus for the fuzz targets: one valid encoding of every control message
//! (plus a few near misses), and a few op sequences for the ring targets.
//!
//! Usage (from `fuzz/`): `cargo run --example gen_seeds [-- <corpus dir>]`; the default
//! directory is `corpus/`, with one subdirectory per target (what `cargo fuzz run` reads).

use std::path::{Path, PathBuf};
use vrdma_abi::control::{Limits, MrChunk, PeerInfo, QpCaps, Reply, Request, Usage, VnicInfo, HEADER_LEN, MAGIC, VERSION};

fn requests() -> Vec<Request> {
    vec![
        Request::Hello { version: 1 },
        Request::AllocPd,
        Request::DeallocPd { pd: 3 },
        Request::RegMr {
            pd: 1,
            addr: 0x7f00_0000_1000,
            length: 8192,
            access: 7,
            chunks: vec![MrChunk { mr_offset: 0, len: 4096, fd_offset: 0 }, MrChunk { mr_offset: 4096, len: 4096, fd_offset: 8192 }],
        },
        Request::DeregMr { key: 9 },
        Request::CreateCq { cqe: 100 },
        Request::DestroyCq { cq: 1 },
        Request::CreateSrq { pd: 1, max_wr: 10, max_sge: 2 },
        Request::DestroySrq { srq: 2 },
        Request::CreateQp {
            pd: 1,
            send_cq: 2,
            recv_cq: 3,
            srq: 0,
            qp_type: 2,
            caps: QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 },
        },
        Request::SetQpState { qpn: 5, state: 3 },
        Request::ConnectQp { qpn: 5, dgid: [0xfe; 16], dest_qpn: 8 },
        Request::DestroyQp { qpn: 5 },
        Request::MoveToEngine { qpn: 5 },
        Request::MapPeerMr { qpn: 5, key: 0xabcd },
        Request::QueryUsage,
        Request::PeerMrCopy {
            qpn: 5,
            dest_qpn: 0,
            key: 0xabcd,
            addr: 0x1000,
            lkey: 0x77,
            local_addr: 0x9000,
            len: 1 << 20,
            to_peer: false,
            need_remote: true,
            staged: true,
        },
        Request::CopyStaging,
    ]
}

fn replies() -> Vec<Reply> {
    vec![
        Reply::Error { errno: 22, message: "invalid argument".into() },
        Reply::Ok,
        Reply::Hello(VnicInfo {
            name: "vnic0".into(),
            tenant: "tenant-a".into(),
            gids: vec![[1; 16], [2; 16]],
            limits: Limits::default(),
            node_guid: 0x0002_c903_0000_0001,
        }),
        Reply::Handle { handle: 4 },
        Reply::Mr { lkey: 1, rkey: 2 },
        Reply::Cq { cq: 3 },
        Reply::Srq { srq: 1, entries: 16, max_sge: 2 },
        Reply::Qp { qpn: 1, rq_entries: 16, max_recv_sge: 2, comp_entries: 32 },
        Reply::Connected(PeerInfo { qpn: 9, rq_ring: Some((16, 2)), comp_entries: 32, srq_ring: None }),
        Reply::Connected(PeerInfo { qpn: 10, rq_ring: None, comp_entries: 32, srq_ring: Some((64, 1)) }),
        Reply::PeerMr { addr: 0x7f00_0000_1000, length: 4096, access: 3, chunks: vec![MrChunk { mr_offset: 0, len: 4096, fd_offset: 0 }] },
        Reply::Usage(Usage { clients: 1, pds: 2, cqs: 3, qps: 4, mrs: 5, mr_bytes: 6, srqs: 7 }),
    ]
}

fn header(op: u16, seq: u32, len: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_LEN);
    b.extend_from_slice(&MAGIC.to_le_bytes());
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&op.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).expect("create corpus dir");
    std::fs::write(dir.join(name), bytes).expect("write seed");
}

fn main() {
    let root = std::env::args_os().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("corpus"));
    let mut n = 0;

    let dir = root.join("control_request");
    for (i, r) in requests().iter().enumerate() {
        let b = r.encode(i as u32);
        write(&dir, &format!("seed-req-{i:02}"), &b);
        write(&root.join("control_header"), &format!("seed-req-{i:02}"), &b);
        n += 2;
    }
    let dir = root.join("control_reply");
    for (i, r) in replies().iter().enumerate() {
        let b = r.encode(i as u32);
        write(&dir, &format!("seed-rep-{i:02}"), &b);
        write(&root.join("control_header"), &format!("seed-rep-{i:02}"), &b);
        n += 2;
    }
    // Near misses: a header whose length disagrees, a bare header, a short one.
    let hdir = root.join("control_header");
    write(&hdir, "seed-hdr-bad-len", &header(1, 1, 4));
    write(&hdir, "seed-hdr-empty", &header(2, 7, 0));
    write(&hdir, "seed-hdr-short", &header(2, 7, 0)[..HEADER_LEN - 1]);
    n += 3;

    write(&root.join("registry_requests"), "seed-sequence", &vrdmad::registry::seed_sequence());
    n += 1;
    for (i, seed) in vrdmad::engine::responder_seeds().iter().enumerate() {
        write(&root.join("responder_frames"), &format!("seed-{i}"), seed);
        n += 1;
    }

    // Ring targets: layout bytes, no garbage, then a run of op bytes (push/take/pop mixed).
    for t in ["recv_ring_garbage", "comp_ring_garbage"] {
        let d = root.join(t);
        write(&d, "seed-clean", &[4, 1, 0, 0, 0, 1, 0, 1, 1, 2, 0, 0, 0, 1, 1, 1, 2]);
        let mut full = vec![8, 2, 0, 0];
        full.extend((0..64u8).map(|i| i % 3));
        write(&d, "seed-fill", &full);
        let mut garbage = vec![2, 1, 0xff, 0x10];
        garbage.extend(std::iter::repeat_n(0xffu8, 256));
        garbage.extend([0, 1, 0, 1, 3, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        write(&d, "seed-garbage", &garbage);
        n += 3;
    }
    // Host-to-host frames: a header of every kind, and a CONNECT_REQ with its payload.
    let d = root.join("wire_frame");
    for (i, k) in [
        vrdma_abi::wire::Kind::Hello,
        vrdma_abi::wire::Kind::Write,
        vrdma_abi::wire::Kind::ReadReq,
        vrdma_abi::wire::Kind::AtomicResp,
        vrdma_abi::wire::Kind::ConnectReq,
    ]
    .into_iter()
    .enumerate()
    {
        let mut h = vrdma_abi::wire::FrameHeader::new(k);
        h.psn = i as u32;
        let mut b = h.encode().to_vec();
        if k == vrdma_abi::wire::Kind::ConnectReq {
            b.extend(vrdma_abi::wire::ConnectReq { src_gid: [1; 16], dst_gid: [2; 16], src_tenant: "t".into() }.encode());
        }
        write(&d, &format!("seed-frame-{i}"), &b);
        n += 1;
    }
    // UD datagrams: a client's message to vrdmad, and the GIDs + payload of a UD_SEND frame.
    let d = root.join("ud_datagram");
    let dg = vrdma_abi::ud::UdDatagram { dest_qpn: 5, qkey: 0x1111_1111, imm: 7, flags: vrdma_abi::ud::UD_F_IMM, dgid: [9; 16] };
    let mut b = dg.encode_header().to_vec();
    b.extend_from_slice(b"payload");
    write(&d, "seed-datagram", &b);
    let mut f = vec![1u8; 32];
    f.extend_from_slice(b"payload");
    write(&d, "seed-frame", &f);
    n += 2;
    let d = root.join("sq_ring_garbage");
    write(&d, "seed-clean", &[4, 1, 16, 3, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 4]);
    write(&d, "seed-garbage", &[2, 1, 8, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 0xff, 0xff, 0xff, 0xff]);
    n += 2;
    // etcd replies as vrdmad's client reads them (first byte: the incremental decoder's
    // piece size).
    let d = root.join("etcd_response");
    let range = r#"{"header":{"revision":"7"},"kvs":[{"key":"L3ZyZG1hL3J1bGVzL2EvYg==","create_revision":"2","mod_revision":"5","version":"1","value":"e30="}],"count":"1"}"#;
    let watch = concat!(
        r#"{"result":{"header":{"revision":"3"},"created":true}}"#, "\n",
        r#"{"result":{"header":{"revision":"4"},"events":[{"kv":{"key":"L3ZyZG1hL3ZuaWNzL3g=","mod_revision":"4","value":"e30="}},{"type":"DELETE","kv":{"key":"L3ZyZG1hL2hvc3RzL2gx","mod_revision":"4"}}]}}"#, "\n",
        r#"{"result":{"canceled":true,"compact_revision":"2"}}"#, "\n"
    );
    let chunked = |body: &str| {
        let mut s = String::from("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n");
        for part in body.as_bytes().chunks(40) {
            s.push_str(&format!("{:x}\r\n{}\r\n", part.len(), String::from_utf8_lossy(part)));
        }
        s.push_str("0\r\n\r\n");
        s
    };
    let seeds = [
        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{range}", range.len()),
        chunked(watch),
        chunked(r#"{"header":{"revision":"9"},"succeeded":true,"responses":[{"response_put":{}}]}"#),
        chunked(r#"{"result":{"header":{},"ID":"77","TTL":"10"}}"#),
        "HTTP/1.1 400 Bad Request\r\nContent-Length: 42\r\n\r\n{\"error\":\"x\",\"message\":\"x\",\"code\":3}".to_string(),
        "HTTP/1.0 200 OK\r\n\r\n{\"kvs\":[]}".to_string(),
    ];
    for (i, s) in seeds.iter().enumerate() {
        for step in [1u8, 7, 255] {
            let mut b = vec![step];
            b.extend_from_slice(s.as_bytes());
            write(&d, &format!("seed-etcd-{i}-{step}"), &b);
            n += 1;
        }
    }
    println!("wrote {n} seeds under {}", root.display());
}
