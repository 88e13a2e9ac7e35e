#!/usr/bin/env python3
"""Per-stage latency of the mediated engine from its trace (vrdmad's VRDMA_ENGINE_TRACE).

Usage: scripts/engine-trace.py PREFIX

Reads PREFIX.<pid>, one file per vrdmad (two daemons, one clock: a simulated cluster), of a
ping-pong between one pair of QPs (e.g. `vrdma perf send_lat -s 8`), splits it into runs at
gaps of more than 100 ms, and prints per run and direction the medians (and 90th
percentiles) of the legs of one message, in microseconds:

  doorbell   the sender's doorbell thread, woken, until it writes the frame
  kernel     from that write until the receiving kernel has the segment (TCP, veth)
  wakeup     until the receiving daemon's reader has the frame (wakeup, switch, read)
  execute    until the reader has executed it (the completion is in the application's ring)
  turnaround until the receiving daemon's doorbell thread wakes again: its application
             saw the message, answered and rang
  one-way    half the time between two messages arriving at the same daemon

A read that brings several frames stamps the first with the last segment's arrival (the
kernel gives one timestamp per read): such a message's kernel leg reads long and its wakeup
short. In a ping-pong that is rare.
"""
import glob
import statistics
import sys

DOORBELL_WAKE, SEND_START, RECEIVED, REQUEST_READ, REQUEST_DONE, RESPONSE_READ = 2, 3, 5, 6, 7, 9


def load(prefix):
    files = sorted(glob.glob(prefix + ".*"))
    if len(files) != 2:
        sys.exit(f"engine-trace: want the files of two daemons, found {files}")
    events = []
    for daemon, path in enumerate(files):
        for line in open(path):
            ns, stage, cpu, qpn, psn = map(int, line.split())
            events.append((ns, daemon, stage, qpn, psn))
    events.sort()
    return files, events


def runs(events):
    run = []
    for e in events:
        if run and e[0] - run[-1][0] > 100_000_000:
            yield run
            run = []
        run.append(e)
    if run:
        yield run


def legs(run):
    out = {}
    last = {}
    pending = {}

    def add(name, ns):
        out.setdefault(name, []).append(ns / 1000)

    for ns, d, stage, qpn, psn in run:
        o = 1 - d
        if stage in (REQUEST_READ, REQUEST_DONE) and qpn == 0:
            continue  # a heartbeat (QPN 0 is no QP's), sent outside the doorbell's pumps
        if stage == SEND_START and (d, DOORBELL_WAKE) in last:
            # The first write after a wakeup; later ones of the same pass are not this leg.
            add(f"doorbell {d}", ns - last.pop((d, DOORBELL_WAKE)))
        elif stage == RECEIVED:
            # Paired with the read of the same header: readers of requests and of
            # responses run at once.
            pending[(d, qpn, psn)] = ns
        elif stage == RESPONSE_READ:
            pending.pop((d, qpn, psn), None)
        elif stage == REQUEST_READ:
            got = pending.pop((d, qpn, psn), None)
            if got is not None and (o, SEND_START) in last:
                add(f"kernel {o}->{d}", got - last[(o, SEND_START)])
                add(f"wakeup {o}->{d}", ns - got)
            if (d, REQUEST_READ) in last:
                add(f"one-way {o}->{d}", (ns - last[(d, REQUEST_READ)]) / 2)
        elif stage == REQUEST_DONE and (d, REQUEST_READ) in last:
            add(f"execute {o}->{d}", ns - last[(d, REQUEST_READ)])
        elif stage == DOORBELL_WAKE and qpn == 0:
            continue  # a timeout (the QPN field counts events): nobody rang
        elif stage == DOORBELL_WAKE and (d, REQUEST_DONE) in last:
            # The first wakeup after a message was delivered: its answer's doorbell.
            add(f"turnaround {d}", ns - last.pop((d, REQUEST_DONE)))
        last[(d, stage)] = ns
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    files, events = load(sys.argv[1])
    print(f"daemon 0: {files[0]}, daemon 1: {files[1]}")
    for i, run in enumerate(r for r in runs(events) if len(r) >= 1000):
        out = legs(run)
        print(f"run {i}: {len(run)} records")
        for name in sorted(out):
            v = sorted(out[name])
            print(f"  {name:18} median {statistics.median(v):7.2f}  p90 {v[len(v) * 9 // 10]:7.2f}  ({len(v)})")


if __name__ == "__main__":
    main()
