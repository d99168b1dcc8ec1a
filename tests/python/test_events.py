# SPDX-License-Identifier: Apache-2.0
"""KV events (issue #29) as a vLLM consumer sees them: real kvpoold processes (host backend, a
host tier) publishing on ipc:// endpoints, and a consumer written with pyzmq and msgspec that
declares vLLM 0.33.0's event classes (vllm_events.py), decodes every batch with msgspec's strict
decoder, checks msgspec encodes the decoded batch back to the very bytes it received, and
rebuilds the set of cached blocks per scope and medium from the stream. After reserves with
token ids and commits from workers of two namespaces, forks and truncates, demotions and
promotions, evictions under pressure, scope and daemon flushes and a worker killed before its
commit, that set must equal `kvpoolctl cache dump -o json`, block for block (hash, parent,
scope, medium, token ids). A consumer that restarts replays from its last sequence number over
the ROUTER socket, or, past the replay buffer, loads the snapshot and continues from its
next_seq. Also: a bind that fails stops the start, a subscriber that never reads costs no more
than the high-water mark, and the counters. Needs pyzmq and msgspec (tests/python/run.sh)."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from conftest import BACKEND, BUILD, KVPOOLD, ROOT, wait_for  # noqa: E402
import vllm_events as ve  # noqa: E402

KVPOOLCTL = os.path.join(BUILD, "client", "kvpoolctl")
PS = 4  # tokens per page
# 2 layers x 64 pages x 4 tokens x 2 heads x 16 dims, fp32: a host slot is 2048 bytes
GEOM = ["--num-pages", "64", "--page-size", str(PS), "--num-layers", "2", "--num-kv-heads", "2",
        "--head-dim", "16", "--dtype", "fp32"]
TIER = ["--set", "cache.host_bytes=%d" % (32 * 2048), "--set", "cache.demote_free_pct=50"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def events_args(d, buffer_steps=10000, hwm=100000, topic="kv", batch_ms=1):
    return ["--set", "events.endpoint=ipc://%s/ev.sock" % d,
            "--set", "events.batch_ms=%d" % batch_ms,
            "--set", "events.replay_endpoint=ipc://%s/replay.sock" % d,
            "--set", "events.topic=" + topic,
            "--set", "events.buffer_steps=%d" % buffer_steps, "--set", "events.hwm=%d" % hwm]


@pytest.fixture
def evd(start, tmp_path):
    """A daemon with events and a host tier, and its event directory."""
    os.chmod(tmp_path, 0o700)
    d = start(*(GEOM + TIER + events_args(tmp_path)))
    d.evdir = str(tmp_path)
    return d



def metric(d, name):
    """A sample of the daemon's Metrics text (kvpoolctl metrics), as an int."""
    out = subprocess.run([KVPOOLCTL, "-s", d.sock, "metrics"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    m = re.search(r"^%s (\d+)$" % re.escape(name), out.stdout, re.M)
    assert m, "no %s in the metrics" % name
    return int(m.group(1))


def dump(d):
    """`kvpoolctl cache dump -o json`: (next_seq, {(medium, hash hex): (scope, parent, tokens)})."""
    out = subprocess.run([KVPOOLCTL, "-s", d.sock, "cache", "dump", "-o", "json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert j["events"] is True and j["block_size"] == PS
    blocks = {}
    for b in j["blocks"]:
        key = (b["medium"], b["hash"])
        assert key not in blocks, "a block twice in one medium"
        blocks[key] = (b["scope"], b["parent"], tuple(b["token_ids"]))
    return j["next_seq"], blocks


class Consumer:
    """A router's view of one daemon: the blocks per (medium, hash) and where it is in the
    stream. Every batch is decoded strictly and must re-encode to the same bytes."""

    def __init__(self, evdir, topic=b"kv"):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect("ipc://%s/ev.sock" % evdir)
        self.replay_ep = "ipc://%s/replay.sock" % evdir
        self.topic = topic
        self.blocks = {}
        self.next = None  # the next sequence number to apply
        self.batches = 0
        self.events = []  # (seq, event) of every event applied

    def close(self):
        self.sub.close(0)
        self.ctx.term()

    def apply(self, seq, payload):
        if self.next is not None and seq < self.next:
            return  # replayed and received live: applied once
        assert self.next is None or seq == self.next, "gap: %d after %d" % (seq, self.next)
        batch = ve.decode(payload)
        assert ve.encode(batch) == payload, "not msgspec's encoding of vLLM's classes"
        assert batch.data_parallel_rank == 0 and batch.ts > 1.7e9
        for ev in batch.events:
            self.events.append((seq, ev))
            if isinstance(ev, ve.AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(ev, ve.BlockStored):
                assert ev.block_size == PS and ev.lora_id is None and ev.lora_name is None
                assert len(ev.token_ids) == PS * len(ev.block_hashes)
                assert len(ev.extra_keys) == len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert isinstance(h, bytes) and len(h) == 16
                    key = (ev.medium, h.hex())
                    assert key not in self.blocks, "stored twice: %s" % (key,)
                    (scope,) = ev.extra_keys[i]
                    self.blocks[key] = (scope, parent.hex() if parent else None,
                                        tuple(ev.token_ids[i * PS:(i + 1) * PS]))
                    parent = h
            else:
                assert isinstance(ev, ve.BlockRemoved)
                for h in ev.block_hashes:
                    key = (ev.medium, h.hex())
                    assert key in self.blocks, "removed but never stored: %s" % (key,)
                    del self.blocks[key]
        self.next = seq + 1
        self.batches += 1

    def replay(self, start, apply=True):
        """Asks the ROUTER for every buffered batch from start; applies them in order (unless
        not apply). Returns the sequence numbers received."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_ep)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(10000), "no replay answer"
            f = dealer.recv_multipart()
            assert len(f) == 4 and f[0] == b""
            if f[2] == END_SEQ:
                assert f[1] == b"" and f[3] == b""
                break
            assert f[1] == self.topic
            seq = int.from_bytes(f[2], "big")
            got.append(seq)
            if apply and (self.next is None or seq >= self.next):
                self.apply(seq, f[3])
        dealer.close(0)
        return got

    def follow(self, until):
        """Applies live batches until `until` is the next one (replaying a gap)."""
        end = time.time() + 20
        while self.next is None or self.next < until:
            assert time.time() < end, "stream stopped at %s, want %d" % (self.next, until)
            if not self.sub.poll(200):
                continue
            topic, seqb, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seqb) == 8
            seq = int.from_bytes(seqb, "big")
            if self.next is not None and seq > self.next:
                self.replay(self.next)  # missed some: the buffer has them
            self.apply(seq, payload)


def join(c, d):
    """The consumer subscribed (the daemon counts it) and caught up from sequence 0."""
    wait_for("the subscription", lambda: metric(d, "kvpool_events_subscribers") >= 1)
    c.replay(0)


def reserve_commit(cl, seq, tokens, d=None, **kw):
    """Reserve with token ids, then Commit. On the cuda backend the daemon publishes when it
    sees the commit's event complete: with d, wait for that."""
    t = cl.reserve([seq], [len(tokens)], token_ids=tokens, **kw)
    cm = cl.commit([seq])
    if d is not None and cm.published < cm.pages:
        wait_for("the commit's event", lambda: metric(d, "kvpool_prefix_cache_commits_pending")
                 == 0)
    return t


PROMPT = list(range(5000, 5032))  # 8 pages
OTHER = list(range(9000, 9024))  # 6 pages


def test_the_stream_rebuilds_the_cache_exactly(evd):
    c = Consumer(evd.evdir)
    join(c, evd)
    assert isinstance(c.events[0][1], ve.AllBlocksCleared) and c.events[0][0] == 0
    a, b = evd.client("tenant-a"), evd.client("tenant-b")
    # a chain committed at once is one BlockStored of 8 hashes, parents chained
    reserve_commit(a, 1, PROMPT, d=evd)
    seq, snap = dump(evd)
    c.follow(seq)
    stored = [e for _, e in c.events if isinstance(e, ve.BlockStored)]
    assert len(stored) == 1 and len(stored[0].block_hashes) == 8
    assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
    assert stored[0].token_ids == PROMPT and stored[0].extra_keys == [("ns:tenant-a",)] * 8
    assert c.blocks == snap
    # the same tokens in another scope: other hashes (BlockRemoved names no scope)
    reserve_commit(b, 1, PROMPT, d=evd)
    seq, snap = dump(evd)
    c.follow(seq)
    hashes = {}
    for (medium, h), (scope, _, _) in c.blocks.items():
        hashes.setdefault(scope, set()).add(h)
    assert len(hashes["ns:tenant-a"]) == 8 and not hashes["ns:tenant-a"] & hashes["ns:tenant-b"]
    # forks and truncates: the child shares the chain; a truncate into a shared page keeps it,
    # a sole holder's rewrite removes it
    a.fork(1, 2)
    a.truncate(2, 10)
    # pages 2 (a rewritten copy) and 3 of the child
    reserve_commit(a, 2, [1, 2, 3, 4, 5, 6], d=evd)
    reserve_commit(a, 3, OTHER, d=evd)
    a.truncate(3, 18)  # its last page (tokens 16..20) becomes partial: rewritten, removed
    # a worker killed before its commit: its pages never become findable
    code = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, %r)
        import kvpool
        c = kvpool.Client(%r, "tenant-a", 0)
        c.reserve([77], [16], token_ids=list(range(123000, 123016)))
        os.kill(os.getpid(), 9)
    """ % (os.path.join(ROOT, "client", "python"), evd.sock))
    p = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert p.returncode == -signal.SIGKILL
    # the pool under the demoter's watermark (32 free pages): cached pages move to host memory
    a.release([1, 2, 3])
    b.release([1])
    a.reserve([10], [4 * 30])
    wait_for("demotions", lambda: sum(m == "CPU" for m, _ in dump(evd)[1]) >= 8)
    a.release([10])
    # a hit in the host tier promotes (CPU -> GPU)
    t = reserve_commit(a, 11, PROMPT, d=evd, reuse=True)
    assert int(t.cached_tokens[0]) == len(PROMPT)
    # a reservation beyond the free pages evicts cached ones for good
    a.reserve([12], [4 * 50])
    a.release([12])
    seq, snap = dump(evd)
    c.follow(seq)
    assert c.blocks == snap
    media = [(type(e).__name__, e.medium) for _, e in c.events
             if not isinstance(e, ve.AllBlocksCleared)]
    assert ("BlockRemoved", "GPU") in media and ("BlockStored", "CPU") in media  # demotion
    assert ("BlockRemoved", "CPU") in media  # promotion (and host evictions)
    assert not any(123000 in blk[2] for blk in snap.values()), "a killed worker's pages"
    # the snapshot read 3 blocks a call is the same; a tenant sees its own scope only
    op = evd.client("kvpoolctl")
    whole, paged = op.cache_dump(), op.cache_dump(page_blocks=3)
    assert paged == whole and len(whole.blocks) == len(snap) > 3
    assert {(b.medium, b.hash.hex()) for b in whole.blocks} == set(snap)
    # a scope flush removes that scope's blocks; a daemon flush clears and re-announces held ones
    b.cache_flush()
    seq, snap = dump(evd)
    c.follow(seq)
    assert c.blocks == snap and not any(s == "ns:tenant-b" for s, _, _ in snap.values())
    op.cache_flush(all=True)
    seq, snap = dump(evd)
    c.follow(seq)
    assert isinstance([e for _, e in c.events][-1], (ve.BlockStored, ve.AllBlocksCleared))
    assert any(isinstance(e, ve.AllBlocksCleared) for s, e in c.events if s > 0)
    assert c.blocks == snap and len(snap) == 8  # sequence 11 still holds its 8 pages
    assert metric(evd, "kvpool_events_batches_total") >= c.batches
    assert metric(evd, "kvpool_events_replay_requests_total{result=\"ok\"}") >= 1
    for cl in (a, b, op):
        cl.close()
    c.close()


def test_a_consumer_that_restarts_replays_or_loads_the_snapshot(start, tmp_path):
    os.chmod(tmp_path, 0o700)
    d = start(*(GEOM + events_args(tmp_path, buffer_steps=4)))
    c = Consumer(str(tmp_path))
    join(c, d)
    a = d.client("w")
    reserve_commit(a, 1, PROMPT, d=d)
    seq, _ = dump(d)
    c.follow(seq)
    last = c.next
    c.close()
    # within the buffer: the restarted consumer replays from where it stopped
    reserve_commit(a, 2, OTHER, d=d)
    seq, snap = dump(d)  # closes the open batch: every batch before seq is sent and buffered
    assert 0 < seq - last <= 4
    c2 = Consumer(str(tmp_path))
    c2.blocks, c2.next = dict(c.blocks), last
    assert c2.replay(last) == list(range(last, seq))
    assert c2.next == seq and c2.blocks == snap
    c2.close()
    # beyond it (more than 4 batches missed): replay starts later than asked, so the consumer
    # loads the snapshot and applies the stream from its next_seq
    for i in range(8):
        reserve_commit(a, 100 + i, list(range(20000 + 8 * i, 20008 + 8 * i)), d=d)
        dump(d)  # a batch per call
    c3 = Consumer(str(tmp_path))
    wait_for("the subscription", lambda: metric(d, "kvpool_events_subscribers") >= 1)
    seqs = c3.replay(last, apply=False)  # only what the buffer still has
    assert seqs and seqs[0] > last + 1 and len(seqs) <= 4
    seq, snap = dump(d)
    c3.blocks, c3.next = dict(snap), seq
    a.release([1])
    reserve_commit(a, 200, list(range(30000, 30008)), d=d)
    seq, snap = dump(d)
    c3.follow(seq)
    assert c3.blocks == snap
    a.close()
    c3.close()


def test_a_tenant_dumps_its_own_scope_only(start, tmp_path):
    """CacheDump shows an operator every scope, anyone else their namespace's scope."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client under a second uid")
    os.chmod(tmp_path, 0o700)
    d = start(*(GEOM + events_args(tmp_path) + ["--set", "access.allowed_uids=65534",
                                                 "--set", "server.socket_mode=0666"]))
    a = d.client("tenant-a")
    reserve_commit(a, 1, PROMPT, d=d)
    os.chmod(d.dir, 0o755)
    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, %r)
        import kvpool
        c = kvpool.Client(%r, "guest", 0)
        c.reserve([1], [%d], token_ids=%r)
        c.commit([1])
        s = c.cache_dump()
        print(json.dumps([s.next_seq, sorted({b.scope for b in s.blocks}), len(s.blocks)]))
    """ % (os.path.join(ROOT, "client", "python"), d.sock, len(OTHER), OTHER))
    out = subprocess.run([sys.executable, "-c", code], user=65534, capture_output=True,
                         text=True, timeout=30, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
    next_seq, scopes, n = json.loads(out.stdout)
    assert scopes == ["ns:guest"] and n == len(OTHER) // PS and next_seq >= 1
    whole = a.cache_dump()  # root: an operator
    assert sorted({b.scope for b in whole.blocks}) == ["ns:guest", "ns:tenant-a"]
    assert len(whole.blocks) == (len(PROMPT) + len(OTHER)) // PS
    a.close()


def test_an_endpoint_that_cannot_bind_stops_the_start(tmp_path):
    out = subprocess.run([KVPOOLD, "--backend", "host", "--socket", str(tmp_path / "s.sock"),
                          "--set", "events.endpoint=ipc:///nonexistent-dir/ev.sock"] + GEOM,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert ("events: cannot bind event endpoint ipc:///nonexistent-dir/ev.sock: No such file or "
            "directory") in out.stderr, out.stderr
    out = subprocess.run([KVPOOLD, "--check-config", "--set", "events.endpoint=http://x"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "events.endpoint" in out.stderr


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))


def test_a_subscriber_that_never_reads_is_bounded_by_the_hwm(start, tmp_path):
    os.chmod(tmp_path, 0o700)
    # a batch per loop iteration: many small batches, the most the subscriber's pipe must hold
    d = start(*(GEOM + events_args(tmp_path, buffer_steps=16, hwm=8, batch_ms=0)))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.connect("ipc://%s/ev.sock" % tmp_path)
    wait_for("the subscription", lambda: metric(d, "kvpool_events_subscribers") == 1)
    a = d.client("w")
    before = None
    for i in range(1500):
        toks = [(i * 64 + k) % 100000 for k in range(64)]  # 16 pages
        reserve_commit(a, 1, toks)
        a.release([1])
        if i == 300:
            before = rss_kib(d.proc.pid)
    dropped = wait_for("drops", lambda: metric(d, "kvpool_events_dropped_total{reason=\"hwm\"}"))
    sent = metric(d, "kvpool_events_batches_total")
    assert dropped > 0 and sent > 0
    assert rss_kib(d.proc.pid) - before < 8 * 1024, "the daemon grew with an unread subscriber"
    a.close()
    sub.close(0)
    ctx.term()
