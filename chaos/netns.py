"""A chaos run's network: one network namespace per node, linked by veth to a bridge.

    root namespace: bridge sqb<tag>, address <subnet>.1 (the "host address": the harness's
                    clients, the gateways and push endpoints use it)
      veth sqv<tag>-<i>  <->  eth0 in namespace sq<tag>-<node>, addresses <subnet>.<10+i>
                              (its coordinator's) and <subnet>.<110+i> (its replica's),
                              default route via the host address

A node's coordinator and replica run inside its namespace (``ip netns exec``), so what
one node can reach is decided by that namespace's routing table: a partition between
nodes A and B is a blackhole route to B's addresses in A's namespace and to A's in B's
(``partition``); ``heal`` deletes them. The gateways and the harness stay in the root
namespace and reach every node throughout: a partition cuts nodes off from each other,
which is what the election and replication must survive. Only iproute2 is used
(iptables and nft are not installed on the test machines).

Each process has an address of its own so that one process can be cut off alone
(``partition_process``): a node's replica from the other replicas while its coordinator
still talks to theirs, or the other way round. Replicas talk only to replicas and
coordinators only to coordinators (and each to its own node's other process, inside the
namespace), so blackholing the replica addresses between A and the rest cuts exactly the
replica links. For that a connection must leave from the address of the process that
made it: a route per peer replica address names the own replica address as its source
(``src``, metric ``_SOURCE_ROUTE_METRIC``), and the coordinator's address is the
namespace's first, which the kernel picks for everything else. A blackhole route (metric
0) for the same address wins over the source route while it exists.

Names and the /24 are unique per run (a tag from the pid and a random number; a subnet no
interface or route of the machine uses yet), and ``teardown`` deletes every namespace
and the bridge (a namespace's veth goes with it) whatever state the run left them in; it
is safe to call twice and is registered by ``Topology.create`` callers as a finalizer.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_IP_TIMEOUT_S = 10.0
# Candidate /24s: 10.200.0.0/24 .. 10.239.255.0/24, well away from the usual defaults.
_SUBNET_SECOND_OCTETS = range(200, 240)
_SUBNET_ATTEMPTS = 64
_FIRST_NODE_HOST = 10
_FIRST_REPLICA_HOST = 110
_SOURCE_ROUTE_METRIC = 100
PROCESSES = ("coordinator", "replica")


class NetnsError(Exception):
    """An ip command failed; the message has the command and what it printed."""


def can_create() -> tuple[bool, str]:
    """Whether this process may make namespaces, and if not, why (for the run record)."""
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN"
    try:
        subprocess.run(["ip", "-V"], check=True, capture_output=True, timeout=_IP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"iproute2 `ip` not usable: {exc}"
    return True, ""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs `ip ARGS`; NetnsError (with its output) if it fails and check is set."""
    command = ["ip", *args]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{' '.join(command)}` did not finish in {_IP_TIMEOUT_S}s") from exc
    if check and result.returncode != 0:
        raise NetnsError(
            f"`{' '.join(command)}` failed ({result.returncode}): "
            f"{(result.stderr or result.stdout).strip()}"
        )
    return result


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network an interface address or a route of the root namespace covers."""
    networks: list[ipaddress.IPv4Network] = []
    for line in ip("-4", "-o", "addr", "show").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            networks.append(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).network)
    for line in ip("-4", "route", "show", "table", "all").stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("default", "broadcast", "local", "unreachable", "blackhole"):
            first = line.split()[1] if len(line.split()) > 1 else ""
        try:
            network = ipaddress.ip_network(first, strict=False)
        except ValueError:
            continue
        if isinstance(network, ipaddress.IPv4Network):
            networks.append(network)
    return [n for n in networks if n.prefixlen > 0]


def _pick_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    used = _used_networks()
    for _ in range(_SUBNET_ATTEMPTS):
        candidate = ipaddress.IPv4Network(
            f"10.{rng.choice(_SUBNET_SECOND_OCTETS)}.{rng.randrange(256)}.0/24"
        )
        if not any(candidate.overlaps(network) for network in used):
            return candidate
    raise NetnsError(f"no free /24 in 10.200-239.x.0 after {_SUBNET_ATTEMPTS} tries")


@dataclass
class Topology:
    """The namespaces, veths and bridge of one run (see the module docstring)."""

    node_ids: Sequence[str]
    tag: str
    subnet: ipaddress.IPv4Network
    created: bool = False
    # (namespace, blackholed address) of every route `partition` added.
    _blackholes: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def plan(cls, node_ids: Sequence[str], rng: random.Random | None = None) -> Topology:
        """Names and addresses for node_ids, unique to this process and run; nothing made."""
        # Seeded runs must not share names: the tag never comes from the run's seed.
        chooser = rng or random.Random()
        tag = f"{os.getpid() % 100:02d}{chooser.randrange(16**3):03x}"
        return cls(list(node_ids), tag, _pick_subnet(chooser))

    @property
    def bridge(self) -> str:
        return f"sqb{self.tag}"

    @property
    def host_address(self) -> str:
        """The bridge's address in the root namespace."""
        return str(self.subnet.network_address + 1)

    def netns(self, node_id: str) -> str:
        return f"sq{self.tag}-{self._index(node_id)}"

    def veth(self, node_id: str) -> str:
        return f"sqv{self.tag}-{self._index(node_id)}"

    def address(self, node_id: str, process: str = "coordinator") -> str:
        """The address of the node's process (coordinator or replica) in its namespace;
        the coordinator's is the namespace's first (what anything else leaves from)."""
        if process not in PROCESSES:
            raise KeyError(f"no process {process!r}: one of {', '.join(PROCESSES)}")
        first = _FIRST_NODE_HOST if process == "coordinator" else _FIRST_REPLICA_HOST
        return str(self.subnet.network_address + first + self._index(node_id))

    def addresses(self, node_id: str) -> list[str]:
        return [self.address(node_id, process) for process in PROCESSES]

    def _index(self, node_id: str) -> int:
        try:
            return list(self.node_ids).index(node_id)
        except ValueError:
            raise KeyError(f"no node {node_id!r} in this topology") from None

    def exec_prefix(self, node_id: str) -> list[str]:
        """The command prefix that runs a program inside the node's namespace."""
        return ["ip", "netns", "exec", self.netns(node_id)]

    def create(self) -> None:
        """Makes the bridge, and per node its namespace and veth; on failure, tears down
        what was made and raises NetnsError."""
        self.created = True  # from here on teardown has something to look for
        prefix = self.subnet.prefixlen
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.host_address}/{prefix}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for node_id in self.node_ids:
                ns, veth = self.netns(node_id), self.veth(node_id)
                ip("netns", "add", ns)
                ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                ip("link", "set", veth, "master", self.bridge)
                ip("link", "set", veth, "up")
                ip("-n", ns, "link", "set", "lo", "up")
                for address in self.addresses(node_id):  # the coordinator's first
                    ip("-n", ns, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "route", "add", "default", "via", self.host_address)
                own_replica = self.address(node_id, "replica")
                source = ["dev", "eth0", "src", own_replica, "metric", str(_SOURCE_ROUTE_METRIC)]
                for peer in self.node_ids:
                    if peer != node_id:
                        peer_replica = f"{self.address(peer, 'replica')}/32"
                        ip("-n", ns, "route", "add", peer_replica, *source)
        except NetnsError:
            self.teardown()
            raise

    def partition(self, groups: Iterable[Iterable[str]]) -> None:
        """Cuts every node off from every node of the other groups (both directions)."""
        sides = [list(group) for group in groups]
        for left, right in itertools.combinations(sides, 2):
            for a, b in itertools.product(left, right):
                for process in PROCESSES:
                    self._blackhole(a, b, process)
                    self._blackhole(b, a, process)

    def partition_process(self, node_id: str, process: str) -> None:
        """Cuts the node's process (coordinator or replica) off from the same process of
        every other node, both directions; its other process keeps every link."""
        for peer in self.node_ids:
            if peer != node_id:
                self._blackhole(node_id, peer, process)
                self._blackhole(peer, node_id, process)

    def _blackhole(self, node_id: str, unreachable: str, process: str) -> None:
        ns, address = self.netns(node_id), self.address(unreachable, process)
        if (ns, address) in self._blackholes:
            return
        ip("-n", ns, "route", "add", "blackhole", f"{address}/32")
        self._blackholes.add((ns, address))

    @property
    def partitioned(self) -> bool:
        return bool(self._blackholes)

    def heal(self) -> None:
        """Deletes every blackhole route partition added."""
        problems = []
        for ns, address in sorted(self._blackholes):
            result = ip("-n", ns, "route", "del", "blackhole", f"{address}/32", check=False)
            if result.returncode != 0 and "No such process" not in result.stderr:
                problems.append(f"{ns} {address}: {result.stderr.strip()}")
        self._blackholes.clear()
        if problems:
            raise NetnsError("could not delete blackhole routes: " + "; ".join(problems))

    def teardown(self) -> list[str]:
        """Deletes every namespace and the bridge that exist; returns what could not be
        deleted (empty when all is gone). Never raises."""
        if not self.created:
            return []
        left: list[str] = []
        self._blackholes.clear()
        existing = set(ip("netns", "list", check=False).stdout.split())
        for node_id in self.node_ids:
            ns = self.netns(node_id)
            if ns in existing:
                result = ip("netns", "del", ns, check=False)
                if result.returncode != 0:
                    left.append(f"netns {ns}: {result.stderr.strip()}")
            veth = self.veth(node_id)
            if ip("link", "show", veth, check=False).returncode == 0:
                ip("link", "del", veth, check=False)
        if ip("link", "show", self.bridge, check=False).returncode == 0:
            result = ip("link", "del", self.bridge, check=False)
            if result.returncode != 0:
                left.append(f"bridge {self.bridge}: {result.stderr.strip()}")
        self.created = bool(left)
        return left
