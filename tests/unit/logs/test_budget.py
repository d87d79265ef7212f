"""budget.py: the log budget shared between namespaces and their pods, on a clock moved by
hand."""

from vlm_operator.logs.budget import LineBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def take(budget, namespace, uid, n):
    return sum(budget.admit(namespace, uid) for _ in range(n))


def test_shares_split_between_namespaces_then_between_their_pods():
    clock = Clock()
    budget = LineBudget(lines_per_s=1_000, cpu_per_s=1.0, burst_s=1.0, clock=clock)
    assert take(budget, "a", "a1", 5_000) == 1_000  # alone: all of it, one second's burst
    assert budget.share("a") == (1_000, 1.0)
    take(budget, "b", "b1", 1)
    assert budget.share("a") == budget.share("b") == (500, 0.5)
    take(budget, "b", "b2", 1)
    assert budget.share("b") == (250, 0.25)  # b's half split between its two pods
    clock.now += 2.0  # refilled at the pod's share, up to its burst
    assert take(budget, "a", "a1", 5_000) == 500
    clock.now += 11.0  # b went quiet: a alone again once the shares are counted anew
    assert take(budget, "a", "a1", 5_000) == 1_000
    assert budget.share("a") == (1_000, 1.0)


def test_cpu_spent_holds_the_pods_lines_until_it_refilled():
    clock = Clock()
    budget = LineBudget(lines_per_s=1_000, cpu_per_s=0.01, burst_s=1.0, clock=clock)
    assert budget.admit("a", "a1")
    budget.spend("a", "a1", 0.07)  # one costly line: 7 s of its CPU share, past its 20 ms
    assert not budget.admit("a", "a1")
    clock.now += 4.0
    assert not budget.admit("a", "a1")
    clock.now += 1.5
    assert budget.admit("a", "a1")
    assert budget.admit("b", "b1")  # another namespace's pod: its own buckets


def test_a_forgotten_pod_leaves_nothing_behind():
    budget = LineBudget(clock=Clock())
    budget.admit("a", "a1")
    budget.forget("a", "a1")
    budget.spend("a", "a1", 1.0)  # a late charge for a pod gone: ignored
    assert budget._pods == {}
