"""The gateway's pure cores: which forwarded calls it retries, and whom it takes for master.

Goal: a forwarded call is retried only when its outcome is unknown and repeating it cannot
apply it twice (reads, Ack, a Publish whose events all carry publisher id + sequence), or
when a slave refused it with a redirect; a definite answer after a lost one is reported as
UNKNOWN. The master follows the coordinators' group views: higher epochs win, a deposed
master's views never come back, and the master's own "I lost my group" withdraws it.
"""

from __future__ import annotations

import ast
import inspect

import pytest
import tenacity

import squall
from squall.v1 import broker_pb2, common_pb2, coordinator_pb2
from squall_server.gateway import retry
from squall_server.gateway.forward import _BudgetSpent
from squall_server.gateway.master import GroupViews, Master, NodeSetChange

NORMAL = common_pb2.NODE_STATE_NORMAL
ELECTION = common_pb2.NODE_STATE_ELECTION
INACTIVE = common_pb2.NODE_STATE_INACTIVE
ADDRESSES = {"n1": "h:7201", "n2": "h:7202", "n3": "h:7203"}


def publish(publisher_id: str, *sequences: int) -> bytes:
    request = broker_pb2.PublishRequest(topic="t", publisher_id=publisher_id)
    for sequence in sequences:
        request.events.add(payload=b"x", sequence=sequence)
    return request.SerializeToString()


# --------------------------------------------------------------------------- retry rules


@pytest.mark.parametrize(
    ("request_bytes", "safe"),
    [
        (publish("p", 1, 2, 3), True),
        (publish("p", 1, 0, 3), False),  # sequence 0: not deduplicated
        (publish("", 1, 2), False),  # no publisher id: not deduplicated
        (publish("p"), False),  # no events
        (b"\xff\xff\xff", False),  # not a PublishRequest
    ],
)
def test_publish_is_safe_only_when_every_event_is_deduplicated(
    request_bytes: bytes, safe: bool
) -> None:
    assert retry.publish_deduplicated(request_bytes) is safe
    assert retry.repeatable("Publish", request_bytes) is safe


@pytest.mark.parametrize(
    ("method", "safe", "effects"),
    [
        ("RetrieveTopic", True, False),
        ("ListTopics", True, False),
        ("GetPublisher", True, False),
        ("GetNonReplicatedPublisher", True, False),
        ("ListSubscriptions", True, False),
        ("Ack", True, True),
        ("CreateTopic", False, True),
        ("DestroyTopic", False, True),
        ("DeleteSubscription", False, True),
        ("GetSubscribers", True, False),
        ("SubscribeAndGetPublisher", False, True),  # a repeat would be AlreadySubscribed
        ("Unsubscribe", False, True),
        ("SomeFutureMethod", False, True),
    ],
)
def test_method_safety(method: str, safe: bool, effects: bool) -> None:
    assert retry.repeatable(method, b"") is safe
    assert retry.has_effects(method) is effects


def test_every_broker_method_is_classified() -> None:
    names = {
        method.name
        for service in broker_pb2.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert names == set(retry.METHOD_KINDS)
    streams = {name for name, kind in retry.METHOD_KINDS.items() if kind == "stream"}
    assert streams == {"PublishStream", "Subscribe"}


# code x redirected x safe -> action
ACTIONS = [
    ("OK", False, True, "answer"),
    ("UNAVAILABLE", False, True, "retry"),
    ("UNKNOWN", False, True, "retry"),
    ("DEADLINE_EXCEEDED", False, True, "retry"),
    ("CANCELLED", False, True, "retry"),
    ("UNAVAILABLE", False, False, "answer"),  # not repeatable: indeterminate goes back
    ("UNKNOWN", False, False, "answer"),
    ("UNAVAILABLE", True, False, "retry"),  # a slave refused: nothing was applied
    ("FAILED_PRECONDITION", False, True, "answer"),
    ("INVALID_ARGUMENT", False, True, "answer"),
    ("NOT_FOUND", False, True, "answer"),
    ("ALREADY_EXISTS", False, True, "answer"),
    ("RESOURCE_EXHAUSTED", False, True, "answer"),
    ("ABORTED", False, True, "answer"),
]


@pytest.mark.parametrize(("code", "redirected", "safe", "action"), ACTIONS)
def test_after_attempt(code: str, redirected: bool, safe: bool, action: str) -> None:
    assert retry.after_attempt(code, redirected=redirected, safe=safe) == action


@pytest.mark.parametrize(
    ("outcomes", "code", "effects", "answer"),
    [
        # A publish whose first answer was lost and whose retry found no topic: it may be
        # stored, so the app hears UNKNOWN, not NOT_FOUND.
        (["indeterminate", "definite"], "NOT_FOUND", True, "UNKNOWN"),
        (["indeterminate", "definite"], "FAILED_PRECONDITION", True, "UNKNOWN"),
        # Reads have no effects: the last answer is the truth.
        (["indeterminate", "definite"], "NOT_FOUND", False, "NOT_FOUND"),
        # Nothing was ever in doubt.
        (["definite"], "NOT_FOUND", True, "NOT_FOUND"),
        (["definite", "definite"], "INVALID_ARGUMENT", True, "INVALID_ARGUMENT"),
        # Indeterminate stays as it came.
        (["indeterminate", "indeterminate"], "UNAVAILABLE", True, "UNAVAILABLE"),
        (["indeterminate"], "UNKNOWN", True, "UNKNOWN"),
    ],
)
def test_answer_code(outcomes: list[retry.Outcome], code: str, effects: bool, answer: str) -> None:
    assert retry.answer_code(outcomes, code, effects=effects) == answer


def test_attempt_outcome() -> None:
    assert retry.attempt_outcome("UNAVAILABLE", redirected=False) == "indeterminate"
    assert retry.attempt_outcome("UNAVAILABLE", redirected=True) == "definite"
    assert retry.attempt_outcome("UNAVAILABLE", redirected=False, forwarded=False) == "definite"


def test_gateway_retry_module_is_pure() -> None:
    tree = ast.parse(inspect.getsource(retry))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    for banned in ("grpc", "asyncio", "time", "random", "threading", "tenacity"):
        assert not any(name == banned or name.startswith(banned + ".") for name in imported)


# --------------------------------------------------------------------------- group views


def view(
    node: str, state: int, epoch: int, master: str = "", group: str = "g"
) -> coordinator_pb2.GroupView:
    message = coordinator_pb2.GroupView(node_id=node, state=state, epoch=epoch, group_name=group)
    if master:
        message.master.node_id = master
        message.master.replica_address = "ignored:1"  # the configured address is used
    return message


def test_a_normal_view_sets_the_master_from_the_configuration() -> None:
    views = GroupViews(ADDRESSES)
    assert views.master is None and not views.heard
    assert views.observe("n2", view("n2", NORMAL, 4, "n1")) == Master("n1", "h:7201", 4)
    assert views.heard


def test_higher_epoch_wins() -> None:
    views = GroupViews(ADDRESSES)
    views.observe("n1", view("n1", NORMAL, 4, "n1"))
    # n3 has not noticed yet, n2 already leads epoch 5.
    views.observe("n3", view("n3", NORMAL, 4, "n1"))
    assert views.observe("n2", view("n2", NORMAL, 5, "n2")) == Master("n2", "h:7202", 5)


def test_master_losing_its_group_clears_it_even_while_slaves_still_name_it() -> None:
    views = GroupViews(ADDRESSES)
    for node in ("n1", "n2", "n3"):
        views.observe(node, view(node, NORMAL, 4, "n1"))
    assert views.observe("n1", view("n1", ELECTION, 4)) is None
    # A slave's view of the same epoch cannot bring it back.
    assert views.observe("n3", view("n3", NORMAL, 4, "n1")) is None


def test_a_slave_losing_its_group_does_not_clear_the_master() -> None:
    views = GroupViews(ADDRESSES)
    for node in ("n1", "n2", "n3"):
        views.observe(node, view(node, NORMAL, 4, "n1"))
    assert views.observe("n3", view("n3", INACTIVE, 4)) == Master("n1", "h:7201", 4)


def test_killed_master_then_new_election() -> None:
    # kill -9 of n1: its watch ends; the slaves still name it until they notice, then
    # elect; meanwhile there is no master, and then n2 in a newer epoch.
    views = GroupViews(ADDRESSES)
    for node in ("n1", "n2", "n3"):
        views.observe(node, view(node, NORMAL, 4, "n1"))
    assert views.forget("n1") == Master("n1", "h:7201", 4)
    views.observe("n2", view("n2", ELECTION, 4))
    assert views.observe("n3", view("n3", ELECTION, 4)) is None
    views.observe("n2", view("n2", NORMAL, 5, "n2"))
    assert views.master == Master("n2", "h:7202", 5)


def test_a_deposed_master_never_comes_back_at_its_old_epoch() -> None:
    views = GroupViews(ADDRESSES)
    views.observe("n2", view("n2", NORMAL, 5, "n2"))
    # n2's watch ends; a stale NORMAL view of epoch 4 from n1 must not win.
    views.forget("n2")
    assert views.observe("n1", view("n1", NORMAL, 4, "n1")) is None
    assert views.epoch_floor == 5


def test_views_naming_unknown_masters_are_ignored_and_unknown_reporters_refused() -> None:
    views = GroupViews(ADDRESSES)
    assert views.observe("n2", view("n2", NORMAL, 9, "n9")) is None
    with pytest.raises(ValueError, match="unknown node"):
        views.observe("n9", view("n9", NORMAL, 9, "n1"))


def test_the_masters_own_higher_epoch_view_wins() -> None:
    views = GroupViews(ADDRESSES)
    views.observe("n3", view("n3", NORMAL, 6, "n1"))
    views.observe("n1", view("n1", NORMAL, 7, "n1"))
    assert views.master == Master("n1", "h:7201", 7)
    # n1 loses its group in epoch 7: n3's older claim (epoch 6) is below the floor.
    assert views.observe("n1", view("n1", INACTIVE, 7)) is None


def test_the_gateways_retry_budget_is_time_with_an_optional_attempt_cap() -> None:
    # Issue 14: the gateway's forwarded unary calls are retried for retry_total_ms_max,
    # however many attempts that takes; retry_attempts_max caps them only when set.
    now = [0.0]
    stop = _BudgetSpent(squall.RetryPolicy(), lambda: now[0])
    state = tenacity.RetryCallState(None, None, (), {})
    state.attempt_number = 500
    now[0] = 9.99
    assert not stop(state)
    now[0] = 10.0
    assert stop(state)
    capped = _BudgetSpent(squall.RetryPolicy(attempts_max=3), lambda: now[0])
    state.attempt_number = 3
    assert capped(state)


def _with_set(
    message: coordinator_pb2.GroupView, version: int, epoch: int, *nodes: str
) -> coordinator_pb2.GroupView:
    """A view carrying a running node set: node ``nX`` at coordinator cX:1, replica rX:1
    (``nX@2``: moved to cX:2/rX:2)."""
    message.membership_version, message.membership_epoch = version, epoch
    for spec in nodes:
        node, _, where = spec.partition("@")
        port = where or "1"
        message.nodes.add(
            node_id=node,
            coordinator_address=f"c{node}:{port}",
            replica_address=f"r{node}:{port}",
        )
    return message


def test_a_gateway_learns_added_and_moved_nodes_from_the_newest_running_set() -> None:
    """An added node (n4) becomes known with its addresses, so a master on it is reached
    without a restart; a replaced node's new machine moves its addresses; an older set
    reported later (a lagging coordinator) changes nothing."""
    views = GroupViews(ADDRESSES, {n: f"c{n}:0" for n in ADDRESSES})
    views.observe("n1", view("n1", NORMAL, 7, "n4"))
    assert views.master is None  # n4 is not known yet: the view cannot name it
    grown = _with_set(view("n1", NORMAL, 8, "n4"), 1, 8, "n1", "n2", "n3", "n4")
    views.observe("n1", grown)
    assert views.learn(grown) == NodeSetChange(("n1", "n2", "n3", "n4"))  # all addresses differ
    assert views.master == Master("n4", "rn4:1", 8)
    assert views.coordinators["n4"] == "cn4:1"
    older = _with_set(view("n2", NORMAL, 8, "n4"), 1, 7, "n1", "n2", "n3")
    assert views.learn(older) == NodeSetChange()
    moved = _with_set(view("n4", NORMAL, 9, "n4"), 2, 9, "n1", "n2@2", "n3", "n4")
    assert views.learn(moved) == NodeSetChange(("n2",))
    assert views.address("n2") == "rn2:2" and views.coordinators["n2"] == "cn2:2"
    assert views.learn(view("n3", NORMAL, 9, "n4")) == NodeSetChange()  # no set: the file's


def test_a_gateway_drops_nodes_the_newest_running_set_removed() -> None:
    """Issue 20: after `remove-node n1` a gateway no longer lists n1 (in `squall status`)
    nor lets n1's stale view name a master; an older set reported later by a lagging
    coordinator does not bring n1 back, and a set that adds it again does."""
    views = GroupViews(ADDRESSES, {n: f"c{n}:0" for n in ADDRESSES})
    views.observe("n1", view("n1", NORMAL, 7, "n1"))
    views.observe("n2", view("n2", NORMAL, 7, "n1"))
    assert views.master == Master("n1", "h:7201", 7)
    shrunk = _with_set(view("n2", INACTIVE, 8), 3, 8, "n2", "n3")
    views.observe("n2", shrunk)
    assert views.learn(shrunk) == NodeSetChange(("n2", "n3"), ("n1",))
    assert sorted(views.coordinators) == ["n2", "n3"] and "n1" not in views.views
    # n1's own view (epoch 7, naming itself) no longer counts: no master until n2/n3 elect.
    assert views.master is None
    with pytest.raises(ValueError, match="unknown node 'n1'"):
        views.observe("n1", view("n1", NORMAL, 7, "n1"))
    lagging = _with_set(view("n3", NORMAL, 8, "n3"), 2, 8, "n1", "n2", "n3")
    for member in ("n3", "n1"):
        lagging.members.add(node_id=member)
    assert views.learn(lagging) == NodeSetChange()
    assert views.observe("n3", lagging) == Master("n3", "rn3:1", 8)
    assert views.members == ("n3",)  # n1, named by the lagging view, is not known
    regrown = _with_set(view("n3", NORMAL, 9, "n3"), 4, 9, "n1", "n2", "n3")
    assert views.learn(regrown) == NodeSetChange(("n1",))
    assert views.coordinators["n1"] == "cn1:1"


def test_a_majority_reporting_one_group_below_the_floor_is_followed() -> None:
    """Every node restored from a backup: their coordinators' epochs start again below
    the highest the gateway saw. No majority can be NORMAL in an epoch older than one a
    majority formed, so a majority's group below the floor is the restored cluster."""
    views = GroupViews(ADDRESSES)
    for node in ("n1", "n2", "n3"):
        views.observe(node, view(node, NORMAL, 4, "n1"))
    for node in ("n1", "n2", "n3"):
        views.forget(node)
    # One node's view, or two naming different masters or groups, is not the cluster.
    assert views.observe("n2", view("n2", NORMAL, 2, "n2", group="a")) is None
    assert views.observe("n3", view("n3", NORMAL, 2, "n2", group="b")) is None
    # The master's own word that it lost the group outweighs the others.
    views.observe("n2", view("n2", INACTIVE, 2))
    assert views.observe("n3", view("n3", NORMAL, 2, "n2", group="a")) is None
    assert views.epoch_floor == 4
    # A majority in one group, with its master: followed, and the floor comes down.
    views.observe("n1", view("n1", NORMAL, 2, "n1", group="c"))
    assert views.observe("n2", view("n2", NORMAL, 2, "n1", group="c")) == Master("n1", "h:7201", 2)
    assert views.epoch_floor == 2
    # A stale view of a lone node below the new floor still cannot win.
    views.observe("n3", view("n3", NORMAL, 1, "n3", group="d"))
    assert views.master == Master("n1", "h:7201", 2)


def test_views_of_an_older_group_held_while_a_newer_master_was_heard_never_win() -> None:
    """n1 formed epoch 4; n2's and n3's watches still carry their epoch-3 views naming n2
    when n1's watch ends. They are a majority, but heard before: not a restart."""
    views = GroupViews(ADDRESSES)
    views.observe("n2", view("n2", NORMAL, 3, "n2", group="old"))
    views.observe("n3", view("n3", NORMAL, 3, "n2", group="old"))
    assert views.observe("n1", view("n1", NORMAL, 4, "n1", group="new")) == Master(
        "n1", "h:7201", 4
    )
    assert views.forget("n1") is None
    assert views.epoch_floor == 4
