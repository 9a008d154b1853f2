"""The communication straggler's signal on the node side: each rank's TCP send backlog (data its sockets hold
written and not yet acknowledged) and the bytes they hold received and unread, sampled by the agent from the
kernel (sock_diag, or /proc/<pid>/net/tcp), kept over the rate window and carried in the beat's `sendq` rows."""
import os
import socket
import time

from fabtrain.node.agent import policy, snapshot
from fabtrain.node.agent.samplers import TcpQueues, diag_tcp_queues, proc_tcp_queues, socket_inodes
from fabtrain.node.agent.supervisor import ProcessContext, Progress, RankSteps


def backed_up_connection():
    """A loopback TCP connection whose receiver never reads: the sender's data stays unacknowledged."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    sender.setblocking(False)
    try:
        while True:
            sender.send(b"x" * 65536)
    except BlockingIOError:
        pass
    return server, sender, receiver


def test_a_process_whose_sends_are_not_taken_has_a_backlog_and_one_that_drained_has_none():
    """The sender of a connection whose receiver does not read: its sends backed up; the receiver (the same
    process here) holds bytes received and unread. Once the receiver reads, both drain."""
    server, sender, receiver = backed_up_connection()
    try:
        me = os.getpid()
        assert sender.fileno() >= 0 and socket_inodes(me) and socket_inodes(2 ** 22 + 7) is None
        by_netlink = diag_tcp_queues()
        by_proc = proc_tcp_queues(me)
        out = os.stat("/proc/self/fd/%d" % sender.fileno()).st_ino
        into = os.stat("/proc/self/fd/%d" % receiver.fileno()).st_ino
        assert by_netlink[out][0] > 0 and by_netlink[out] == by_proc[out]
        assert by_netlink[into][1] > 0 and by_netlink[into] == by_proc[into]  # received, not read
        queues = TcpQueues()
        sampled = queues.sample([me, 2 ** 22 + 7])  # a pid that is gone: not in the answer
        assert list(sampled) == [me] and sampled[me][0] >= by_netlink[out][0] > 0 and sampled[me][1] > 0
        queues.netlink = False  # a process in another network namespace: read through its /proc/<pid>/net/tcp
        assert queues.sample([me])[me] == sampled[me]
        receiver.setblocking(False)
        deadline = time.time() + 5
        while time.time() < deadline and TcpQueues().sample([me])[me] != (0, 0):
            try:
                while receiver.recv(1 << 20):
                    pass
            except BlockingIOError:
                time.sleep(0.01)
        assert TcpQueues().sample([me])[me] == (0, 0)
    finally:
        for s in (server, sender, receiver):
            s.close()


def test_a_ranks_backlog_is_the_share_of_samples_with_one_over_the_window_once_four_are_in():
    r = RankSteps()
    for t, b in ((0, 100), (1, 0), (2, 5000)):
        r.send(b, float(t))
    assert r.send_backlog() is None
    r.send(7000, 3.0, unread=20)
    assert r.send_backlog() == (0.75, 3025.0, 0.25)
    for t in range(4, 30):
        r.send(1000, float(t))
    assert r.send_backlog() == (1.0, 1000.0, 0.0) and r.sends[0][0] >= 29 - 10
    slow = RankSteps()
    for t in (0, 20, 40, 60, 80):  # an interval longer than the window: the last four samples still count
        slow.send(1, float(t), unread=1)
    assert len(slow.sends) == 4 and slow.send_backlog() == (1.0, 1.0, 1.0)


class Queues:
    def __init__(self, by_pid):
        self.by_pid, self.asked = by_pid, []

    def sample(self, pids):
        self.asked.append(sorted(pids))
        return {p: self.by_pid[p] for p in pids if p in self.by_pid}


def trainer(tmp_path, timings):
    ctx = ProcessContext({"name": "trainer-0", "role": "trainer", "rank": 0}, str(tmp_path), str(tmp_path))
    ctx.record, ctx.progress = {"pid": 1}, Progress(floor=0)
    for rank, t in timings.items():
        ctx.progress.ranks[rank] = RankSteps()
        ctx.progress.ranks[rank].take({"rank": rank, "step": 1, "source": "auto", **t}, 1.0)
    return ctx


def test_the_agent_samples_the_sends_of_ranks_in_collectives_only_by_the_pids_whose_rank_they_are(tmp_path):
    bound = {"data_time": 0.01, "compute_time": 0.01, "comm_time": 0.5, "step_time": 0.52}
    alone = {**bound, "compute_time": 0.51, "comm_time": 0.0}  # one rank, no collectives: nothing to sample
    ctx = trainer(tmp_path, {0: bound, 1: bound, 2: {**bound, "compute_time": 0.47, "comm_time": 0.04}, 3: alone})
    # torchrun (pid 10, the RANK fabtrain gave it) and its workers 11 and 12; 13 is rank 2, whose wait the
    # hook counted as compute (it is sampled all the same); 15 is rank 3, in no collective
    ctx.rank_of = {10: (0.0, 0), 11: (0.0, 0), 12: (0.0, 1), 13: (0.0, 2), 14: (0.0, None), 15: (0.0, 3)}
    queues = Queues({10: (0, 0), 11: (300_000, 0), 12: (0, 0), 13: (9, 7), 15: (5, 0)})
    for t in range(4):
        ctx.sample_sends(queues, float(t))
    assert queues.asked == [[10, 11, 12, 13]] * 4
    assert snapshot.send_rows(ctx) == [[0, 1.0, 300000, 0.0], [1, 0.0, 0, 0.0], [2, 1.0, 9, 1.0]]
    beat = snapshot.beat({"job_id": "J", "node": "n1"}, policy.Ledger(), [ctx], False, 0)
    assert beat["procs"]["trainer-0"]["sendq"] == [[0, 1.0, 300000, 0.0], [1, 0.0, 0, 0.0], [2, 1.0, 9, 1.0]]
    assert [row[0] for row in beat["procs"]["trainer-0"]["timing"]] == [0, 1, 2, 3]  # 5-element rows, unchanged
    assert all(len(row) == 5 for row in beat["procs"]["trainer-0"]["timing"])
    # no longer in collectives: nothing is read, and its samples age out over the window
    for r in ctx.progress.ranks.values():
        r.timings = [(5.0, alone)]
    ctx.sample_sends(queues, 5.0)
    assert len(queues.asked) == 4 and snapshot.send_rows(ctx) == [[0, 1.0, 300000, 0.0], [1, 0.0, 0, 0.0], [2, 1.0, 9, 1.0]]
    ctx.sample_sends(queues, 12.5)
    assert len(queues.asked) == 4 and snapshot.send_rows(ctx) == []
    beat = snapshot.beat({"job_id": "J", "node": "n1"}, policy.Ledger(), [ctx], False, 0)
    assert "sendq" not in beat["procs"]["trainer-0"]
