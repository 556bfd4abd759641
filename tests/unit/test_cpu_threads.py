"""worker_svc.cpu.threads.SmallStepThreads: small steps run on the thread count that has been faster lately, the other
count is still tried now and then, and large steps always get every thread. Times are given, not measured."""

from __future__ import annotations

from worker_svc.cpu.threads import SMALL_STEP_TOKENS, SmallStepThreads


def _serve(choice: SmallStepThreads, seconds_on: dict[int, float], steps: int, tokens: int = 1) -> list[int]:
    """`steps` small steps of `tokens` tokens, each taking `seconds_on[threads]`: the counts chosen."""
    chosen = []
    for _ in range(steps):
        n = choice.choose(tokens)
        choice.record(tokens, n, seconds_on[n])
        chosen.append(n)
    return chosen


def test_large_steps_use_every_thread_and_are_not_timed():
    choice = SmallStepThreads(most=4)
    assert [choice.choose(t) for t in (SMALL_STEP_TOKENS, 512)] == [4, 4]
    choice.record(512, 4, 9.0)
    assert choice.recent_s == {} and choice.small_steps == 0


def test_size_classes():
    from worker_svc.cpu.threads import size_class

    assert [size_class(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 31)] == [1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_each_count_is_timed_three_times_in_turns_then_the_faster_serves():
    chosen = _serve(SmallStepThreads(most=2, trial_every=8), {2: 0.019, 1: 0.024}, 32)
    assert chosen[:6] == [2, 1, 2, 1, 2, 1]
    assert chosen[6:] == [1 if k % 8 == 0 else 2 for k in range(7, 33)]  # the slower count on every 8th step


def test_a_cold_first_step_does_not_decide():
    """A large model's first decode is slow whatever the count (its pages cold): one step each would pick the other
    count for good."""
    choice = SmallStepThreads(most=2, trial_every=16)
    choice.record(1, choice.choose(1), 1.9)  # 2 threads, cold
    assert _serve(choice, {2: 0.20, 1: 0.26}, 20)[-10:].count(2) >= 9


def test_steps_of_another_size_are_not_compared():
    """16 decodes on 2 threads take longer than 1 decode on 1: that says nothing about which count is faster."""
    choice = SmallStepThreads(most=2, trial_every=16)
    _serve(choice, {2: 0.20, 1: 0.26}, 10, tokens=1)
    assert choice.choose(16) == 2  # a class not timed yet starts in turns, every thread first
    chosen = _serve(choice, {2: 0.50, 1: 0.90}, 16, tokens=16)
    assert chosen[-8:].count(2) >= 7
    assert _serve(choice, {2: 0.20, 1: 0.26}, 8, tokens=1).count(2) >= 7


def test_a_busier_box_moves_small_steps_to_one_thread_fewer_and_back():
    choice = SmallStepThreads(most=2, trial_every=4)
    assert _serve(choice, {2: 0.019, 1: 0.024}, 20)[-4:].count(2) == 3
    # Other processes now want the cores: two threads wait on each other at every barrier.
    busy = _serve(choice, {2: 0.040, 1: 0.025}, 40)
    assert busy[-12:].count(1) >= 9
    quiet = _serve(choice, {2: 0.019, 1: 0.024}, 40)
    assert quiet[-12:].count(2) >= 9


def test_one_thread_stays_one():
    choice = SmallStepThreads(most=1)
    assert _serve(choice, {1: 0.02}, 5) == [1] * 5


def test_one_slow_step_does_not_move_the_choice():
    choice = SmallStepThreads(most=2, trial_every=16)
    _serve(choice, {2: 0.019, 1: 0.024}, 20)
    assert choice.choose(1) == 2
    choice.record(1, 2, 0.5)  # preempted for half a second
    assert _serve(choice, {2: 0.019, 1: 0.024}, 10).count(2) >= 9
