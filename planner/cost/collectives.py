"""Collectives and point-to-point transfers, in ms.

Two layers live here.

**On one link** (the first functions; ``planner.cost.step`` and ``planner.mesh`` call them): :func:`transfer_ms`, :func:`allreduce_ms`, :func:`ring_ms` and
:func:`half_ring_ms` price a collective on an :class:`~planner.schema.Interconnect` the caller
chose.  Ring all-reduce (Patarasuk & Yuan 2009): 2(D-1)/D of the bytes cross each link.

**On the cluster's topology** (:class:`Group`, :func:`group_on` and the ``*_ms`` functions after
them): a communication group is placed on the nodes of a :class:`~planner.schema.Cluster`, and
its collectives are priced from where its members sit.  Notation: ``S`` = ``nbytes``, the whole
buffer each member holds (NCCL's and nccl-tests' "size": the input of an all-reduce or a
reduce-scatter, the output of an all-gather); ``n`` members, at most ``p`` of them in one node,
on ``N`` nodes; ``c`` groups of the same shape running at once side by side (``concurrent``);
``B_intra``, ``a_intra`` = ``cluster.intra_node`` (each device's own NVLink, per direction) and
``B_net``, ``a_net`` = ``cluster.inter_node`` (one NIC); ``nics`` = ``cluster.nics_per_node``
(``devices_per_node`` when None: one NIC per device).

Bandwidths:

* per member across nodes, when the ``senders = min(devices_per_node, p*c)`` devices of a node
  that take part all send across at once and share its NICs (a device drives at most one NIC)::

      b_x = B_net * min(1, nics / senders)                                  (cross_node_bandwidth)

* the bus bandwidth of a ring (or tree) collective, ``B_ring``: ``B_intra`` inside one node;
  across nodes, ``min(B_intra, p * b_x)`` (``p * b_x`` alone when ``p = 1``)   (ring_bandwidth).
  A ring enters and leaves each node once per channel, and NCCL runs one channel (ring) per NIC,
  so the bytes a node sends across equal one member's, spread over all the node's NICs it can
  drive: the ring's bus bandwidth is the node's aggregate NIC bandwidth, not one member's share
  of it.  Sources: NCCL maintainer S. Jeaugey, NVIDIA/nccl#687 ("Ring Allreduce requires data to
  go through each GPU and enter/exit the node once"), NVIDIA/nccl#412 (NCCL aggregates NICs
  with concurrent flows, each entering and leaving the node through a NIC), NVIDIA/nccl#307
  ("with rings, ~12 GB/s with each NIC, then ~24 when using 2 NICs"); NCCL's tuning model
  (``src/graph/tuning.cc``, ``ncclTopoTuneModel``): ``busBw = nChannels * speed``.

Times (seconds here, returned in ms; the bus-bandwidth factors are nccl-tests'
``doc/PERFORMANCE.md``: all-reduce busbw = algbw * 2(n-1)/n, reduce-scatter and all-gather
busbw = algbw * (n-1)/n, all-to-all busbw = algbw * (n-1)/n)::

    ring all-reduce       2(n-1)/n * S / B_ring + 2 * [(n-N) a_intra + (N-1) a_net]
    reduce-scatter        (n-1)/n * S / B_ring  +      (n-N) a_intra + (N-1) a_net
    all-gather            the same as reduce-scatter
    tree all-reduce       2 S / B_ring          + 2 * [(p-1) a_intra + floor(log2 N) a_net]
    auto all-reduce       min(ring, tree)
    all-to-all            max((p-1)/n * S / B_intra, (n-p)/n * S / b_x)
                                                +      (p-1) a_intra + (n-p) a_net
    send/recv             S / B + a  of cluster.link(src, dst) (across nodes: one NIC)

* Ring (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 69(2)): a reduce-scatter then an all-gather of n-1 steps each, every member
  moving (n-1)/n of S in each; so ring all-reduce = reduce-scatter + all-gather, exactly.  Of each
  pass's n-1 steps, N-1 cross a node boundary and n-N stay inside a node: the latency term of
  NCCL's tuning model (``nInterSteps = nNodes-1`` per pass, ``src/graph/tuning.cc``).
* Tree: NCCL's double binary tree across nodes and a chain inside each node (S. Jeaugey,
  "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA blog, 2019; Sanders, Speck
  & Traeff 2009, "Two-tree algorithms for full bandwidth broadcast, reduction and scan", Parallel
  Computing 35(12)).  Its bandwidth term is 2S/B (NCCL's tuning model: tree algbw = busBw / 2,
  an up and a down pass each moving S); its latency 2[(p-1) a_intra + floor(log2 N) a_net]
  (the same model, ``log2i(nNodes)``).  Inside one node the tree is a chain, never faster than
  the ring; across many nodes its log N latency beats the ring's for small messages.  Not
  modelled: NCCL's 2-node tree trick (up to 2x the network bandwidth, NVIDIA/nccl#307), protocol
  choice (LL, LL128), NVLS/SHARP.
* All-to-all: the pairwise exchange of Thakur, Rabenseifner & Gropp 2005 ("Optimization of
  Collective Communication Operations in MPICH", IJHPCA 19(1)): n-1 steps, one per peer, each a
  latency (the p-1 peers in the node at ``a_intra``, the n-p others at ``a_net``); each member
  sends S/n to every peer, its in-node part over NVLink and its cross-node part over its share of
  the NICs (every member sends its own bytes, nothing is combined: NVIDIA/nccl#687), the
  slower part bounding the time.

``n = 1`` or ``S <= 0``: 0 ms.  Placement (:func:`group_on`): members are devices ``i * stride``,
``i = 0 .. n-1``, the planner's default mesh placement (a tensor-parallel group has stride 1,
a data-parallel group of a D x T x K mesh stride T*K).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from planner.cost.layers import LayerCosts
from planner.errors import InputError
from planner.schema import Cluster, Interconnect


def transfer_ms(nbytes: float, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Point-to-point time: bytes / bandwidth + latency, in ms."""
    return (nbytes / bandwidth_bytes_per_s + latency_s) * 1e3


def allreduce_ms(nbytes: float, replicas: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-reduce: 2(D-1)/D x bytes / bandwidth, plus 2(D-1) latencies, in ms."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return (steps / replicas * nbytes / bandwidth_bytes_per_s + steps * latency_s) * 1e3


def boundary_transfer_ms(
    costs: LayerCosts,
    ranges: Sequence[tuple[int, int]],
    placement: Sequence[Sequence[int]],
    cluster: Cluster,
) -> list[float]:
    """Time to move one micro-batch across each stage boundary (the slowest replica's link).

    Stages on the same device exchange nothing over a link.
    """
    out = []
    for s in range(len(ranges) - 1):
        nbytes = costs.cut_bytes[ranges[s][1] - 1]
        worst = 0.0
        for src, dst in zip(placement[s], placement[s + 1], strict=True):
            if src != dst:
                link = cluster.link(src, dst)
                worst = max(worst, transfer_ms(nbytes, link.bandwidth_bytes_per_s, link.latency_s))
        out.append(worst)
    return out


def ring_ms(nbytes: float, members: int, collectives: int, link: Interconnect) -> float:
    """``collectives`` ring all-reduces (or reduce-scatter + all-gather pairs) moving ``nbytes``
    in all over ``members`` devices: 2(n-1)/n x bytes / bandwidth + 2(n-1) latencies each, ms."""
    if members <= 1 or (nbytes <= 0 and collectives <= 0):
        return 0.0
    steps = 2 * (members - 1)
    return (steps / members * nbytes / link.bandwidth_bytes_per_s + collectives * steps * link.latency_s) * 1e3


def half_ring_ms(nbytes: float, members: int, link: Interconnect) -> float:
    """One reduce-scatter or all-gather of ``nbytes``: (n-1)/n x bytes / bandwidth + (n-1) latencies, ms."""
    if members <= 1 or nbytes <= 0:
        return 0.0
    return ((members - 1) / members * nbytes / link.bandwidth_bytes_per_s + (members - 1) * link.latency_s) * 1e3


# --------------------------------------------------------------------------- on the topology

#: all-reduce algorithms :func:`all_reduce_ms` prices ("auto": the faster of ring and tree)
AllReduceAlgorithm = Literal["ring", "tree", "auto"]
ALL_REDUCE_ALGORITHMS: tuple[AllReduceAlgorithm, ...] = ("ring", "tree", "auto")


@dataclass(frozen=True)
class Group:
    """A communication group as placed on a cluster's nodes (make one with :func:`group_on`).

    ``size`` members, at most ``per_node`` of them inside any one node, spread over ``nodes``
    nodes (``size == per_node * nodes`` when the placement is even); ``concurrent`` groups of the
    same shape run the same collective at once, side by side, and share the nodes' NICs.
    """

    size: int
    per_node: int
    nodes: int
    concurrent: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or self.concurrent < 1:
            raise InputError(
                f"a group needs size >= 1 and concurrent >= 1, got size={self.size}, "
                f"concurrent={self.concurrent}"
            )
        if not 1 <= self.per_node <= self.size:
            raise InputError(f"per_node={self.per_node} must be between 1 and size={self.size}")
        fewest = -(-self.size // self.per_node)
        if not fewest <= self.nodes <= self.size:
            raise InputError(
                f"{self.size} members at most {self.per_node} per node need {fewest}..{self.size} "
                f"nodes, got nodes={self.nodes}: use group_on(cluster, size, stride=...)"
            )


def group_on(cluster: Cluster, size: int, *, stride: int = 1, concurrent: int = 1) -> Group:
    """The group of devices ``i * stride``, ``i = 0 .. size-1``, of ``cluster``.

    ``per_node``: ``min(size, ceil(devices_per_node / stride))`` when ``stride < devices_per_node``
    (the members node 0 holds; no node holds more, whatever the group's offset), else 1.
    ``nodes``: the nodes from the first member's to the last's.  ``size * stride`` devices must
    exist: the ``stride`` groups at offsets 0 .. stride-1 tile them (the planner's mesh), and
    ``concurrent`` groups of ``size`` need ``concurrent * size`` devices.
    """
    n, dpn = cluster.num_devices, cluster.devices_per_node
    if size < 1 or stride < 1 or concurrent < 1:
        raise InputError(
            f"group_on needs size, stride and concurrent >= 1, got size={size}, stride={stride}, "
            f"concurrent={concurrent} (stride 1: consecutive devices)"
        )
    if size * stride > n or size * concurrent > n:
        raise InputError(
            f"a group of {size} at stride {stride} ({concurrent} at once) needs "
            f"{size * max(stride, concurrent)} devices but the cluster has {n}: use size x stride "
            f"and size x concurrent <= {n}"
        )
    if stride >= dpn:
        return Group(size, 1, size, concurrent)
    return Group(size, min(size, -(-dpn // stride)), (size - 1) * stride // dpn + 1, concurrent)


def _check_fits(group: Group, cluster: Cluster) -> None:
    if group.size > cluster.num_devices or group.per_node > cluster.devices_per_node:
        raise InputError(
            f"{group} does not fit a cluster of {cluster.num_devices} devices, "
            f"{cluster.devices_per_node} per node: make it with group_on(cluster, size, stride=...)"
        )


def cross_node_bandwidth(group: Group, cluster: Cluster) -> float:
    """Bytes/s one member sends across nodes while every member of its node in the ``concurrent``
    groups does too: ``B_net * min(1, nics / senders)``, ``senders = min(devices_per_node,
    per_node * concurrent)``; at most one NIC's bandwidth (a device drives one NIC)."""
    nics = cluster.nics_per_node or cluster.devices_per_node
    senders = min(cluster.devices_per_node, group.per_node * group.concurrent)
    return cluster.inter_node.bandwidth_bytes_per_s * min(1.0, nics / senders)


def ring_bandwidth(group: Group, cluster: Cluster) -> float:
    """The bus bandwidth of the group's ring (and tree) collectives, bytes/s: NVLink inside one
    node; across nodes, the node's NICs the group drives (``per_node`` members' cross-node
    bandwidth: one ring channel per NIC), and NVLink too when a node holds several members."""
    intra = cluster.intra_node.bandwidth_bytes_per_s
    if group.nodes == 1:
        return intra
    across = group.per_node * cross_node_bandwidth(group, cluster)
    return across if group.per_node == 1 else min(intra, across)


def _ring_pass_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    """One reduce-scatter or all-gather pass: (n-1)/n x S / B_ring + (n-N) a_intra + (N-1) a_net."""
    n, hops = group.size, group.nodes - 1
    latency = (n - 1 - hops) * cluster.intra_node.latency_s + hops * cluster.inter_node.latency_s
    return (n - 1) / n * nbytes / ring_bandwidth(group, cluster) + latency


def _tree_s(nbytes: float, group: Group, cluster: Cluster) -> float:
    """Double binary tree across nodes, chain inside: 2 S / B_ring + 2 [(p-1) a_intra +
    floor(log2 N) a_net]."""
    depth = group.nodes.bit_length() - 1  # floor(log2 N), NCCL's log2i(nNodes)
    latency = (group.per_node - 1) * cluster.intra_node.latency_s + depth * cluster.inter_node.latency_s
    return 2 * nbytes / ring_bandwidth(group, cluster) + 2 * latency


def all_reduce_ms(
    nbytes: float, group: Group, cluster: Cluster, *, algorithm: AllReduceAlgorithm = "ring"
) -> float:
    """All-reduce of ``nbytes`` (each member's whole buffer) over ``group``, in ms: ``ring``
    (reduce-scatter + all-gather), ``tree`` (NCCL's double binary tree) or ``auto`` (the faster)."""
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise InputError(f"unknown all-reduce algorithm {algorithm!r}: use one of {', '.join(ALL_REDUCE_ALGORITHMS)}")
    _check_fits(group, cluster)
    if group.size == 1 or nbytes <= 0:
        return 0.0
    ring = 2 * _ring_pass_s(nbytes, group, cluster)
    if algorithm == "ring":
        return ring * 1e3
    tree = _tree_s(nbytes, group, cluster)
    return (tree if algorithm == "tree" else min(ring, tree)) * 1e3


def reduce_scatter_ms(nbytes: float, group: Group, cluster: Cluster) -> float:
    """Ring reduce-scatter of ``nbytes`` (the whole input) over ``group``, in ms."""
    _check_fits(group, cluster)
    if group.size == 1 or nbytes <= 0:
        return 0.0
    return _ring_pass_s(nbytes, group, cluster) * 1e3


def all_gather_ms(nbytes: float, group: Group, cluster: Cluster) -> float:
    """Ring all-gather of ``nbytes`` (the whole gathered output) over ``group``, in ms: the same
    bytes and steps as a reduce-scatter."""
    return reduce_scatter_ms(nbytes, group, cluster)


def all_to_all_ms(nbytes: float, group: Group, cluster: Cluster) -> float:
    """All-to-all of ``nbytes`` per member (S/n to each peer) over ``group``, in ms: the in-node
    part over NVLink and the cross-node part over the member's NIC share, the slower bounding it,
    plus one latency per peer (pairwise exchange)."""
    _check_fits(group, cluster)
    n, p = group.size, group.per_node
    if n == 1 or nbytes <= 0:
        return 0.0
    inside = (p - 1) / n * nbytes / cluster.intra_node.bandwidth_bytes_per_s
    across = (n - p) / n * nbytes / cross_node_bandwidth(group, cluster) if n > p else 0.0
    latency = (p - 1) * cluster.intra_node.latency_s + (n - p) * cluster.inter_node.latency_s
    return (max(inside, across) + latency) * 1e3


def send_recv_ms(nbytes: float, cluster: Cluster, src: int, dst: int) -> float:
    """``nbytes`` from device ``src`` to device ``dst``, in ms: over NVLink inside a node, over
    one NIC across nodes (``cluster.link``); 0 when ``src == dst`` or ``nbytes <= 0``."""
    n = cluster.num_devices
    for name, dev in (("src", src), ("dst", dst)):
        if not 0 <= dev < n:
            raise InputError(f"{name}={dev} is not a device of the cluster: use 0 .. {n - 1}")
    if src == dst or nbytes <= 0:
        return 0.0
    link = cluster.link(src, dst)
    return transfer_ms(nbytes, link.bandwidth_bytes_per_s, link.latency_s)


def ring_link(group: Group, cluster: Cluster) -> Interconnect:
    """The one link that prices ``group``'s ring collectives with the one-link formulas
    (:func:`ring_ms`, :func:`half_ring_ms`, :func:`allreduce_ms`): the ring's bus bandwidth
    (:func:`ring_bandwidth`) and the mean latency of its n - 1 steps, (n - N) inside nodes and
    N - 1 across; they then give exactly :func:`all_reduce_ms`, :func:`reduce_scatter_ms`."""
    n, hops = group.size, group.nodes - 1
    if n <= 1:
        return cluster.intra_node
    latency = ((n - 1 - hops) * cluster.intra_node.latency_s + hops * cluster.inter_node.latency_s) / (n - 1)
    return Interconnect(bandwidth_bytes_per_s=ring_bandwidth(group, cluster), latency_s=latency)


def devices_group(cluster: Cluster, devices: Sequence[int]) -> Group:
    """The :class:`Group` of the given devices, with every device of their nodes running the
    same collective at once (a step's data-parallel reductions: each node's devices all belong to
    some replica group), so its members share their nodes' NICs."""
    dpn = cluster.devices_per_node
    per: dict[int, int] = {}
    for d in devices:
        per[d // dpn] = per.get(d // dpn, 0) + 1
    per_node = max(per.values(), default=1)
    return Group(max(1, len(devices)), per_node, max(1, len(per)), max(1, dpn // per_node))


def replica_link(cluster: Cluster, devices: Sequence[int]) -> Interconnect:
    """:func:`ring_link` of the data-parallel group of ``devices`` (:func:`devices_group`)."""
    return ring_link(devices_group(cluster, devices), cluster)
