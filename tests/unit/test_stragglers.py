"""The straggler rule as data: step rates in, findings out (no process, no clock)."""
from fabtrain.node.coordination.stragglers import Behind, Rule, StepRate, judge, median, reason, standing

RULE = Rule(share=0.7, window=60.0)


def rates(**by_rank):
    return {("node%d" % (i + 1), name.replace("_", "-")): r for i, (name, r) in enumerate(sorted(by_rank.items()))}


def run(seq, rule=RULE):
    """Feed (time, rates) in order; every finding with its time."""
    behind, out = Behind(), []
    for t, r in seq:
        found, behind = judge(r, behind, t, rule)
        out += [(t, f) for f in found]
    return out


def test_a_rank_at_half_the_others_rate_is_a_straggler_once_it_stayed_behind_for_the_window():
    slow = rates(trainer_0=10.0, trainer_1=10.0, trainer_2=5.0, trainer_3=10.0)
    found = run([(t, slow) for t in range(0, 121, 5)])
    assert [(t, f.name, f.node, f.rate, f.median) for t, f in found] == [(60, "trainer-2", "node3", 5.0, 10.0)]
    assert reason(found[0][1], RULE) == ("trainer-2 on node3 runs at 5 steps/s, below 0.7 of the median rank's "
                                         "10 steps/s for 60 s or more")


def test_a_whole_job_that_slows_down_together_has_no_straggler():
    seq = [(t, rates(trainer_0=10.0 - t / 20, trainer_1=10.0 - t / 20, trainer_2=9.8 - t / 20)) for t in range(0, 181, 5)]
    assert run(seq) == []


def test_a_rank_that_catches_up_before_the_window_is_not_reported_and_its_clock_starts_again():
    behind = rates(trainer_0=10.0, trainer_1=4.0, trainer_2=10.0)
    even = rates(trainer_0=10.0, trainer_1=9.0, trainer_2=10.0)
    seq = [(t, behind) for t in range(0, 50, 5)] + [(50, even)] + [(t, behind) for t in range(55, 120, 5)]
    assert [t for t, _ in run(seq)] == [115]


def test_unknown_rates_and_a_stalled_job_compare_nothing():
    assert run([(t, {("n1", "trainer-0"): 10.0, ("n2", "trainer-1"): None}) for t in range(0, 200, 10)]) == []
    assert run([(t, rates(trainer_0=0.0, trainer_1=0.0, trainer_2=0.0)) for t in range(0, 200, 10)]) == []
    assert median([3, 1, 2]) == 2 and median([1, 2, 3, 4]) == 2.5 and median([]) == 0.0


def test_a_step_rate_is_steps_over_the_window_and_starts_again_when_the_steps_do():
    r = StepRate(window=10.0)
    assert r.rate() is None
    for t in range(0, 31):
        r.add(float(t), 2 * t)
    assert r.rate() == 2.0 and r.samples[0][0] >= 30 - 11
    r.add(31.0, 0)  # the program restarted from step 0
    r.add(32.0, 3)
    r.add(33.0, "x")  # not a number: ignored
    assert r.rate() == 3.0


def test_standing_names_a_reported_rank_while_it_stays_behind_and_none_once_it_caught_up():
    slow = rates(trainer_0=10.0, trainer_1=4.0, trainer_2=10.0)
    behind = Behind()
    for t in (0, 30, 60):
        _, behind = judge(slow, behind, t, RULE)
        if t < 60:
            assert standing(slow, behind) == []  # behind, not yet for the window: not reported
    assert standing(slow, behind) == [{"node": "node2", "name": "trainer-1", "rate": 4.0, "median": 10.0, "since": 0}]
    even = rates(trainer_0=10.0, trainer_1=9.0, trainer_2=10.0)
    _, behind = judge(even, behind, 65, RULE)
    assert standing(even, behind) == []


# -- synchronous training: the rank the others wait for, from its timings ---------------------------------

from fabtrain.node.coordination.stragglers import cause_reason, judge_timings, standing_timings, timings_of  # noqa: E402


def sync(slow=None, data=0.01, compute=0.05, extra=0.0, ranks=4):
    """Every rank's mean timings a step when rank `slow` spends `extra` more on data or compute: the
    others wait that long in their all_reduce."""
    out = {}
    for r in range(ranks):
        t = {"data_time": data, "compute_time": compute, "comm_time": 0.005 + extra}
        if r == slow[0] if slow else False:
            t[slow[1]] += extra
            t["comm_time"] = 0.005
        t["step_time"] = t["data_time"] + t["compute_time"] + t["comm_time"]
        out[("node%d" % (r // 2 + 1), "trainer-%d" % (r // 2), r)] = t
    return out


def test_the_rank_the_others_wait_for_is_named_with_its_cause_after_the_window():
    timings = sync(slow=(1, "data_time"), extra=0.032)
    behind, found = Behind(), []
    for t in range(0, 70, 5):
        f, behind = judge_timings(timings, behind, t, RULE)
        found += f
    assert [(c.node, c.name, c.rank, c.cause, c.ratio) for c in found] == [("node1", "trainer-0", 1, "data loading", 4.2)]
    assert cause_reason(found[0]).startswith("rank 1 on node1: data loading 4.2x the median")
    assert standing_timings(timings, behind, RULE)[0]["cause"] == "data loading"
    f, _ = judge_timings(sync(slow=(2, "compute_time"), extra=0.1), Behind(), 0, Rule(share=0.7, window=0))
    assert [(c.rank, c.cause) for c in f] == [(2, "compute")]


def test_ranks_that_are_all_equally_slow_have_no_straggler():
    for timings in (sync(), sync(data=0.5, compute=2.0), sync(ranks=2)):
        assert judge_timings(timings, Behind(), 100, Rule(share=0.7, window=0)) == ([], Behind())
    # slow data on one rank that the others do not wait for (it is hidden): no straggler either
    hidden = sync()
    hidden[("node1", "trainer-0", 1)]["data_time"] = 0.04
    assert judge_timings(hidden, Behind(), 100, Rule(share=0.7, window=0))[0] == []


def test_timings_come_from_the_beats_running_trainers():
    tables = {"node1": {"trainer-0": {"role": "trainer", "state": "running",
                                      "timing": [[0, 0.01, 0.05, 0.2, 0.26], [1, 0.2, 0.05, 0.005, 0.26], "bad"]},
                        "pserver-0": {"role": "pserver", "state": "running", "timing": [[9, 1, 1, 1, 3]]}},
              "node2": {"trainer-1": {"role": "trainer", "state": "exited", "timing": [[2, 1, 1, 1, 3]]}}}
    assert timings_of(tables) == {
        ("node1", "trainer-0", 0): {"data_time": 0.01, "compute_time": 0.05, "comm_time": 0.2, "step_time": 0.26},
        ("node1", "trainer-0", 1): {"data_time": 0.2, "compute_time": 0.05, "comm_time": 0.005, "step_time": 0.26}}


# -- communication: the rank whose link does not keep up, from its send backlog ----------------------------------

def comm_bound_job(backlogs, comm=0.58, step=0.6, ranks=3):
    """Every rank's mean timings a step in a job bound by its all-reduce (every rank waits in it alike), each
    with the share of samples its sends were backed up in (None: not sampled)."""
    out = {}
    for r in range(ranks):
        t = {"data_time": 0.005, "compute_time": step - comm - 0.005, "comm_time": comm, "step_time": step}
        if backlogs[r] is not None:
            t.update(backlog=backlogs[r], backlog_bytes=220_000 * backlogs[r])
        out[("node%d" % (r + 1), "trainer-%d" % r, r)] = t
    return out


def test_a_rank_whose_sends_stay_backed_up_in_a_comm_bound_job_is_named_for_its_communication():
    # As measured (docs/watchdog.md): node3's egress capped at 20 mbit, its sends backed up in every sample, the
    # rank sending to it in half (its acknowledgements come late), the third in a few.
    timings = comm_bound_job([0.49, 0.11, 1.0])
    behind, found = Behind(), []
    for t in range(0, 70, 5):
        f, behind = judge_timings(timings, behind, t, RULE)
        found += f
    assert [(c.node, c.rank, c.cause, c.ratio, c.backed_up, c.others) for c in found] == [
        ("node3", 2, "communication", 3.33, 1.0, 0.3)]
    assert cause_reason(found[0]) == (
        "rank 2 on node3: communication, its sends back up (data waiting to go out in 100% of the samples, 220 kB on "
        "average, vs 30% for the median rank) while collectives take 97% of its step; the other ranks wait for it in "
        "their collectives")
    assert (found[0].seconds, found[0].median) == (0.58, 0.58)
    assert standing_timings(timings, behind, RULE) == [{"node": "node3", "name": "trainer-2", "rank": 2,
                                                       "cause": "communication", "ratio": 3.33, "seconds": 0.58,
                                                       "median": 0.58, "since": 0}]
    # two ranks; the other's sends never seen backed up: its share counts as MIN_SHARE
    f, _ = judge_timings(comm_bound_job([1.0, 0.0], ranks=2), Behind(), 0, Rule(share=0.7, window=0))
    assert [(c.rank, c.cause, c.ratio) for c in f] == [(0, "communication", 20.0)]


def test_no_rank_is_named_for_communication_unless_one_link_alone_backs_up_in_a_comm_bound_job():
    now = Rule(share=0.7, window=0)
    for timings in (comm_bound_job([0.15, 0.09, 0.03]),  # uncapped: every link drains (as measured)
                    comm_bound_job([0.9, 0.95, 1.0]),  # every link slow alike (a slow network): nobody to name
                    comm_bound_job([0.7, 0.1, 0.1]),  # backed up, but not most of the time
                    comm_bound_job([0.6, 0.55, 1.0]),  # the others back up too, more than half as often
                    comm_bound_job([0.1, 0.1, 1.0], comm=0.2),  # the others do not wait in collectives
                    comm_bound_job([0.1, None, 1.0])):  # a rank not sampled (an older agent): no comparison
        assert judge_timings(timings, Behind(), 100, now) == ([], Behind()), timings
    # rank 0 computes while the others wait, and reads late what rank 2 sends it: rank 2's sends back up, but
    # rank 0 waits for nobody: it is named, for its compute
    slow = {**comm_bound_job([0.1, 0.7, 1.0]), ("node1", "trainer-0", 0): {
        "data_time": 0.005, "compute_time": 0.55, "comm_time": 0.045, "step_time": 0.6, "backlog": 0.1}}
    assert [(c.rank, c.cause) for c in judge_timings(slow, Behind(), 0, now)[0]] == [(0, "compute")]
    # a rank the others wait for by its data loading is named for that: while they wait the links idle, and
    # rank 2's sends, backed up while the gradients go (a third of the step), drain
    timings = comm_bound_job([0.1, 0.1, 0.3])
    timings[("node1", "trainer-0", 0)].update(data_time=0.4, comm_time=0.18)
    assert [(c.rank, c.cause) for c in judge_timings(timings, Behind(), 0, now)[0]] == [(0, "data loading")]


def test_a_backed_up_link_is_named_where_the_hook_counts_part_of_some_ranks_wait_as_compute():
    """Seen with the link capped: the hook's split of a step put 0.18 s of one rank's 0.6 s and 0.34 s of
    another's in collectives (the rest of the wait counted as compute): the median rank is comm-bound."""
    timings = comm_bound_job([0.3, 0.05, 1.0])
    timings[("node1", "trainer-0", 0)].update(compute_time=0.25, comm_time=0.34)
    timings[("node3", "trainer-2", 2)].update(compute_time=0.41, comm_time=0.18)
    found, _ = judge_timings(timings, Behind(), 0, Rule(share=0.7, window=0))
    assert [(c.rank, c.cause) for c in found] == [(2, "communication")]


def test_a_backed_up_link_is_named_where_the_hook_counts_nearly_all_of_its_own_wait_as_compute():
    """Seen in 2 of about 6 runs with node3's link capped (the earlier rule): node3's rank spent under a quarter
    of its step in collectives by the hook's split (the rest of its wait counted as compute; 5% here) and looked
    like a rank the others wait for by its compute; its sends stay backed up, the others' drain. Its link is named, not its
    compute. A rank that computes long and waits for nobody, with another rank's sends backed up (it reads
    them late), is still named for its compute (test above)."""
    timings = comm_bound_job([0.45, 0.1, 1.0])
    timings[("node3", "trainer-2", 2)].update(compute_time=0.565, comm_time=0.03)
    f, _ = judge_timings(timings, Behind(), 0, Rule(share=0.7, window=0))
    assert [(c.rank, c.cause, c.comm_share) for c in f] == [(2, "communication", 0.05)]
    timings[("node3", "trainer-2", 2)].update(backlog=0.1)  # its sends drain: its compute, as the timings say
    f, _ = judge_timings(timings, Behind(), 0, Rule(share=0.7, window=0))
    assert [(c.rank, c.cause) for c in f] == [(2, "compute")]


def test_a_backed_up_link_is_named_where_the_hook_counts_its_receivers_wait_as_compute():
    """As seen with node3's egress capped (3 ranks, DDP over gloo, its agents' figures): rank 0, which receives
    from node3, by the hook's split computes 0.5 s of a 0.6 s step and waits 0.08 s in collectives, as a rank
    the others wait for would; node3's sends are backed up in every sample. Rank 0's sockets hold bytes
    received and unread in few samples: it reads what comes as it comes, so it waits for the link; node3's
    link is named. A rank that really computes while its neighbour's data waits in its sockets, unread, is
    named for its compute."""
    timings = comm_bound_job([0.35, 0.15, 1.0])
    timings[("node1", "trainer-0", 0)].update(compute_time=0.5, comm_time=0.08, unread=0.1)
    timings[("node2", "trainer-1", 1)].update(compute_time=0.156, comm_time=0.433, unread=0.05)
    timings[("node3", "trainer-2", 2)].update(compute_time=0.288, comm_time=0.301, unread=0.0)
    now = Rule(share=0.7, window=0)
    assert [(c.rank, c.cause) for c in judge_timings(timings, Behind(), 0, now)[0]] == [(2, "communication")]
    timings[("node1", "trainer-0", 0)].update(unread=0.9)  # busy elsewhere: node3's data waits in its sockets
    assert [(c.rank, c.cause) for c in judge_timings(timings, Behind(), 0, now)[0]] == [(0, "compute")]
    del timings[("node1", "trainer-0", 0)]["unread"]  # an older agent's 3-element rows: its timings, as before
    assert [(c.rank, c.cause) for c in judge_timings(timings, Behind(), 0, now)[0]] == [(0, "compute")]
    tables = {"node1": {"trainer-0": {"role": "trainer", "state": "running", "timing": [[0, 0.005, 0.5, 0.08, 0.6]],
                                      "sendq": [[0, 0.35, 70000, 0.1]]}}}
    assert timings_of(tables)[("node1", "trainer-0", 0)]["unread"] == 0.1


def test_a_backed_up_link_is_named_before_a_rank_that_computes_a_little_longer():
    """As seen with the link capped on a machine whose 2 cores the ranks share with other work: one rank gets
    less CPU for a while (0.15 s more compute a step), but every rank still waits over half its step in the
    all-reduce and node3's sends stay backed up: the link costs the step more, and it is named."""
    timings = comm_bound_job([0.49, 0.11, 1.0])
    timings[("node1", "trainer-0", 0)].update(compute_time=0.16, comm_time=0.435)
    assert judge_timings({k: t for k, t in timings.items() if k[2] != 2} | {
        ("node3", "trainer-2", 2): {**timings[("node3", "trainer-2", 2)], "backlog": 0.1}}, Behind(), 0,
        Rule(share=0.7, window=0))[0][0].cause == "compute"  # without the backed-up link: the compute
    behind, found = Behind(), []
    for t in range(0, 70, 5):
        f, behind = judge_timings(timings, behind, t, RULE)
        found += f
    assert [(c.rank, c.cause) for c in found] == [(2, "communication")]


def test_send_backlogs_come_from_the_beats_sendq_rows_and_a_beat_without_them_is_read_as_before():
    tables = {"node1": {"trainer-0": {"role": "trainer", "state": "running",
                                      "timing": [[0, 0.01, 0.01, 0.5, 0.52], [1, 0.01, 0.01, 0.5, 0.52]],
                                      "sendq": [[0, 1.0, 213000], [1, True, 5], [7, 0.5, 10], "bad", [1, 0.1]]}},
              "node2": {"trainer-1": {"role": "trainer", "state": "running", "timing": [[2, 0.01, 0.01, 0.5, 0.52]]}}}
    assert timings_of(tables) == {
        ("node1", "trainer-0", 0): {"data_time": 0.01, "compute_time": 0.01, "comm_time": 0.5, "step_time": 0.52,
                                    "backlog": 1.0, "backlog_bytes": 213000},
        ("node1", "trainer-0", 1): {"data_time": 0.01, "compute_time": 0.01, "comm_time": 0.5, "step_time": 0.52},
        ("node2", "trainer-1", 2): {"data_time": 0.01, "compute_time": 0.01, "comm_time": 0.5, "step_time": 0.52}}
    assert judge_timings(timings_of(tables), Behind(), 0, Rule(share=0.7, window=0))[0] == []  # node2 not sampled


def test_the_straggler_mark_says_communication():
    from fabtrain.controller.jobstate import Straggler
    assert Straggler("n3", "trainer-2", rank=2, cause="communication", ratio=3.33).mark == \
        "STRAGGLER rank 2: communication, sends backed up 3.3x the median"


def test_the_same_rank_found_for_another_cause_is_a_new_finding():
    """node3's rank named for its compute (starved of CPU before the cap), then for its link once capped."""
    starved = comm_bound_job([0.1, 0.1, 0.1], comm=0.3, step=0.32)
    starved[("node3", "trainer-2", 2)].update(compute_time=0.3, comm_time=0.015)
    behind, found = Behind(), []
    for t, timings in [(t, starved) for t in range(0, 10, 5)] + [(t, comm_bound_job([0.2, 0.1, 1.0]))
                                                                for t in range(10, 20, 5)]:
        f, behind = judge_timings(timings, behind, t, Rule(share=0.7, window=5))
        found += f
    assert [(c.rank, c.cause, c.since) for c in found] == [(2, "compute", 0), (2, "communication", 10)]
    assert [s["cause"] for s in standing_timings(comm_bound_job([0.2, 0.1, 1.0]), behind, RULE)] == ["communication"]
