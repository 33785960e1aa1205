"""Topic links' pure rules (services/replica/link_rules.py): IceStorm's cost and one-hop
rules, the refusals at link time, and where forwarding resumes.

Goal: an event travels at most one link, a costly link lets only cheap enough events
through, a bad link is refused with the reason named, and a forwarder that lost its
memory resumes exactly after the last event the destination holds.
"""

from __future__ import annotations

import pytest

from squall.v1 import common_pb2
from squall_server.replica import link_rules
from squall_server.replica.link_rules import LinkRefused, check_link, forwards, plan_forward

R, T = common_pb2.TOPIC_KIND_REPLICATED, common_pb2.TOPIC_KIND_TRANSIENT


@pytest.mark.parametrize(
    ("link_cost", "event_cost", "expected"),
    [(0, 0, True), (0, 9, True), (3, 0, True), (3, 3, True), (3, 4, False), (1, 2, False)],
)
def test_cost_rule_as_icestorm(link_cost: int, event_cost: int, expected: bool) -> None:
    assert forwards(link_cost, event_cost, "app-1") is expected


@pytest.mark.parametrize("link_cost", [0, 5])
def test_an_event_that_came_over_a_link_goes_no_further(link_cost: int) -> None:
    forwarded_id = link_rules.link_publisher_id(42)
    assert link_rules.is_forwarded(forwarded_id)
    assert not forwards(link_cost, 0, forwarded_id)
    assert not link_rules.is_forwarded("squall-linked-app")  # only the exact prefix


def _check(frm: str = "a", to: str = "b", cost: int = 0, **kw: object) -> None:
    args: dict[str, object] = {"from_kind": R, "to_kind": R, "existing": ()}
    args.update(kw)
    check_link(frm, to, cost, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "code", "words"),
    [
        ({"to": "a"}, "INVALID_ARGUMENT", "cannot be linked to itself"),
        ({"cost": -1}, "INVALID_ARGUMENT", "link cost -1 from 'a' to 'b' is negative"),
        ({"from_kind": None}, "NOT_FOUND", "topic 'a' does not exist"),
        ({"to_kind": None}, "NOT_FOUND", "topic 'b' does not exist"),
        ({"to_kind": T}, "INVALID_ARGUMENT", "topic 'b' is transient"),
        ({"existing": ("b",)}, "ALREADY_EXISTS", "already linked to 'b'"),
        (
            {"existing": tuple(f"t{i}" for i in range(link_rules.LINKS_PER_TOPIC_MAX))},
            "RESOURCE_EXHAUSTED",
            "the most one topic may have",
        ),
    ],
)
def test_bad_links_are_refused_naming_the_problem(
    kwargs: dict[str, object], code: str, words: str
) -> None:
    with pytest.raises(LinkRefused) as refused:
        _check(**kwargs)  # type: ignore[arg-type]
    assert refused.value.code == code
    assert words in refused.value.message


def test_a_cycle_is_allowed_since_no_event_crosses_two_links() -> None:
    _check("b", "a", existing=("c",))  # a -> b exists elsewhere; b -> a is fine


def _event(offset: int, cost: int = 0, publisher_id: str = "app") -> common_pb2.Event:
    return common_pb2.Event(
        offset=offset,
        payload=f"e{offset}".encode(),
        key=b"k",
        cost=cost,
        publisher_id=publisher_id,
        headers={"h": str(offset)},
    )


def test_plan_keeps_order_sequences_and_fields_and_skips_what_the_rules_stop() -> None:
    events = [
        _event(10),
        _event(11, cost=5),
        _event(12, publisher_id=link_rules.link_publisher_id(7)),
        _event(13, cost=2),
    ]
    plan = plan_forward(events, link_cost=2)
    assert [(e.payload, e.sequence, e.cost) for e in plan.events] == [
        (b"e10", 11, 0),
        (b"e13", 14, 2),
    ]
    assert plan.events[1].headers["h"] == "13" and plan.events[1].key == b"k"
    assert plan.next_offset == 14  # past the skipped ones too


def test_resume_is_after_the_last_forwarded_event_never_before_the_start() -> None:
    assert link_rules.resume_offset(start_offset=5, high_water=0) == 5
    # The destination holds the source's offset 8 (sequence 9): resume at 9.
    assert link_rules.resume_offset(start_offset=5, high_water=link_rules.sequence_of(8)) == 9
