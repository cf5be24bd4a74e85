"""Collectives priced from the cluster's topology (planner/cost/collectives.py: Group, group_on,
all_reduce_ms, reduce_scatter_ms, all_gather_ms, all_to_all_ms, send_recv_ms), against cases
computed by hand and properties every pricing must keep.

The hand cases use an 8-GPU node of 240e9 B/s NVLink per direction and 3 us latency, and NICs of
22.5e9 B/s and 5 us: the numbers in the comments were worked out on paper from the formulas of
the module docstring, not by running the code."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cost.collectives import (
    ALL_REDUCE_ALGORITHMS,
    Group,
    all_gather_ms,
    all_reduce_ms,
    all_to_all_ms,
    allreduce_ms,
    cross_node_bandwidth,
    group_on,
    half_ring_ms,
    reduce_scatter_ms,
    ring_bandwidth,
    send_recv_ms,
)
from planner.errors import InputError
from planner.schema import Cluster

GIB = 2**30
NVLINK, NVLINK_LAT = 240e9, 3e-6
NIC, NIC_LAT = 22.5e9, 5e-6
MS = 1e3  # seconds to ms


def _cluster(
    devices: int = 16,
    per_node: int = 8,
    *,
    nics: int | None = None,
    intra: tuple[float, float] = (NVLINK, NVLINK_LAT),
    inter: tuple[float, float] = (NIC, NIC_LAT),
) -> Cluster:
    return Cluster.model_validate({
        "devices": devices, "memory": "80GiB", "devices_per_node": per_node, "nics_per_node": nics,
        "intra_node": {"bandwidth_bytes_per_s": intra[0], "latency_s": intra[1]},
        "inter_node": {"bandwidth_bytes_per_s": inter[0], "latency_s": inter[1]},
    })


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize(
    ("size", "stride", "expected"),
    [
        (16, 1, Group(16, 8, 2)),  # a tensor-parallel group of 16: two full nodes
        (4, 1, Group(4, 4, 1)),  # T = 4 inside one node
        (2, 8, Group(2, 1, 2)),  # the data-parallel group of a 2 x 8 mesh: one member per node
        (8, 2, Group(8, 4, 2)),  # devices 0 2 4 6 | 8 10 12 14
        (5, 3, Group(5, 3, 2)),  # devices 0 3 6 | 9 12: node 0 holds three
        (1, 16, Group(1, 1, 1)),
    ],
)
def test_group_on_places_members_by_hand(size: int, stride: int, expected: Group) -> None:
    assert group_on(_cluster(), size, stride=stride) == expected


@settings(max_examples=200, deadline=None)
@given(dpn=st.integers(1, 12), nodes=st.integers(1, 6), data=st.data())
def test_group_on_matches_counting_the_members(dpn: int, nodes: int, data: st.DataObject) -> None:
    # count the members of every node for the group at 0 (what group_on reports) and for the
    # groups at every other offset the planner's mesh tiles (no node of theirs holds more)
    devices = dpn * nodes
    stride = data.draw(st.integers(1, devices))
    size = data.draw(st.integers(1, devices // stride))
    group = group_on(_cluster(devices, dpn), size, stride=stride)
    at_zero = Counter(i * stride // dpn for i in range(size))
    assert group.per_node == max(at_zero.values())
    assert group.nodes == len(at_zero)
    for offset in range(stride):
        assert max(Counter((offset + i * stride) // dpn for i in range(size)).values()) <= group.per_node


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 0}, "size=0"),
        ({"size": 4, "stride": 0}, "stride=0"),
        ({"size": 4, "concurrent": 0}, "concurrent=0"),
        ({"size": 9, "stride": 2}, "needs 18 devices but the cluster has 16"),
        ({"size": 8, "concurrent": 3}, "needs 24 devices but the cluster has 16"),
    ],
)
def test_group_on_refuses_what_the_cluster_cannot_host(kwargs: dict[str, int], message: str) -> None:
    size = kwargs.pop("size")
    with pytest.raises(InputError, match=message):
        group_on(_cluster(), size, **kwargs)


def test_a_group_built_by_hand_is_checked() -> None:
    with pytest.raises(InputError, match="per_node=5 must be between 1 and size=4"):
        Group(4, 5, 1)
    with pytest.raises(InputError, match="need 2..4 nodes, got nodes=1"):
        Group(4, 2, 1)
    with pytest.raises(InputError, match="does not fit a cluster of 16 devices, 8 per node"):
        all_reduce_ms(GIB, Group(16, 16, 1), _cluster())


# --------------------------------------------------------------------------- bandwidths


def test_cross_node_bandwidth_shares_the_nodes_nics_by_hand() -> None:
    tp16 = group_on(_cluster(), 16)
    # 8 NICs for 8 senders: each member has one NIC; a ring drives all 8 (8 x 22.5e9 = 180e9 < NVLink)
    assert cross_node_bandwidth(tp16, _cluster(nics=8)) == NIC
    assert ring_bandwidth(tp16, _cluster(nics=8)) == 8 * NIC
    assert ring_bandwidth(tp16, _cluster(nics=None)) == 8 * NIC  # None: one NIC per device
    # 1 NIC for 8 senders: each member has an eighth of it; the ring gets the one NIC
    assert cross_node_bandwidth(tp16, _cluster(nics=1)) == NIC / 8
    assert ring_bandwidth(tp16, _cluster(nics=1)) == NIC
    # NICs faster than NVLink: the ring is bound by NVLink inside the nodes
    assert ring_bandwidth(tp16, _cluster(nics=8, inter=(100e9, NIC_LAT))) == NVLINK
    # one member per node never touches the in-node link: a PCIe box with faster NICs
    pcie_box = _cluster(intra=(25e9, NVLINK_LAT), inter=(50e9, NIC_LAT))
    assert ring_bandwidth(group_on(pcie_box, 2, stride=8), pcie_box) == 50e9
    # inside one node: NVLink, whatever the NICs
    assert ring_bandwidth(group_on(_cluster(), 8), _cluster(nics=1)) == NVLINK


def test_concurrent_data_parallel_groups_share_one_nic_by_hand() -> None:
    # a 2 x 8 mesh's data-parallel groups {i, i + 8}: one member per node, and the 8 groups
    # all-reduce at once; with one NIC per node each gets an eighth of it
    one_nic = _cluster(nics=1)
    alone, all_eight = group_on(one_nic, 2, stride=8), group_on(one_nic, 2, stride=8, concurrent=8)
    assert ring_bandwidth(alone, one_nic) == NIC
    assert ring_bandwidth(all_eight, one_nic) == NIC / 8
    # 2(n-1)/n x S / B + 2 [(n-N) a_intra + (N-1) a_net] = 2^30 / 2.8125e9 s + 10 us
    assert all_reduce_ms(GIB, all_eight, one_nic) == pytest.approx(381.7748708 + 0.010, rel=1e-8)
    # one NIC per device: the 8 groups do not meet
    assert ring_bandwidth(group_on(_cluster(), 2, stride=8, concurrent=8), _cluster()) == NIC


# --------------------------------------------------------------------------- times by hand


def test_ring_all_reduce_inside_one_node_by_hand() -> None:
    # 2 x 7/8 x 2^30 / 240e9 s + 14 x 3 us = 7.82936747 + 0.042 ms
    cluster, group = _cluster(8, 8), group_on(_cluster(8, 8), 8)
    assert all_reduce_ms(GIB, group, cluster) == pytest.approx(7.87136747, rel=1e-8)
    assert all_reduce_ms(GIB, group, cluster) == pytest.approx((2 * 7 / 8 * GIB / NVLINK + 14 * NVLINK_LAT) * MS)
    # the one-link functions other code calls price the same group the same
    assert all_reduce_ms(GIB, group, cluster) == pytest.approx(allreduce_ms(GIB, 8, NVLINK, NVLINK_LAT))
    assert reduce_scatter_ms(GIB, group, cluster) == pytest.approx(half_ring_ms(GIB, 8, cluster.intra_node))
    # a reduce-scatter or an all-gather is half of it: 7/8 x 2^30 / 240e9 s + 7 x 3 us
    assert reduce_scatter_ms(GIB, group, cluster) == pytest.approx(3.91468373 + 0.021, rel=1e-8)
    assert all_gather_ms(GIB, group, cluster) == reduce_scatter_ms(GIB, group, cluster)


def test_ring_all_reduce_over_two_nodes_by_hand() -> None:
    # 16 over 2 nodes: 2 x 15/16 x 2^30 / B_ring + 2 (14 x 3 us + 1 x 5 us)
    assert all_reduce_ms(GIB, group_on(_cluster(), 16), _cluster(nics=8)) == pytest.approx(
        11.18481067 + 0.094, rel=1e-8
    )  # B_ring = 180e9
    assert all_reduce_ms(GIB, group_on(_cluster(), 16), _cluster(nics=1)) == pytest.approx(
        89.47848533 + 0.094, rel=1e-8
    )  # B_ring = 22.5e9


def test_a_tensor_parallel_group_across_nodes_is_not_priced_like_nvlink() -> None:
    # the motivating bug: T = 16 over two nodes was priced as if all 16 sat on one NVLink domain
    nbytes = 16 * 2**20
    for nics in (8, 1):
        cluster = _cluster(nics=nics)
        across = all_reduce_ms(nbytes, group_on(cluster, 16), cluster)
        assert across > allreduce_ms(nbytes, 16, NVLINK, NVLINK_LAT)  # the old price
        assert across > all_reduce_ms(nbytes, group_on(cluster, 8), cluster)  # T = 8 in one node
    assert all_reduce_ms(nbytes, group_on(_cluster(), 16), _cluster(nics=1)) > 4 * all_reduce_ms(
        nbytes, group_on(_cluster(), 16), _cluster(nics=8)
    )


def test_tree_beats_ring_on_latency_for_small_messages_and_many_nodes() -> None:
    # 64 nodes of one device: ring 2 x 63 x 5 us = 630 us of latency, tree 2 x log2(64) x 5 us = 60 us
    cluster = _cluster(64, 1)
    group = group_on(cluster, 64)
    small = 1024  # ring: 2 x 63/64 x 1024 / 22.5e9 s + 630 us; tree: 2 x 1024 / 22.5e9 s + 60 us
    assert all_reduce_ms(small, group, cluster) == pytest.approx(0.63008960, rel=1e-7)
    assert all_reduce_ms(small, group, cluster, algorithm="tree") == pytest.approx(0.06009102, rel=1e-7)
    assert all_reduce_ms(small, group, cluster, algorithm="auto") == all_reduce_ms(small, group, cluster, algorithm="tree")
    # 1 GiB: the ring's 63/64 of the bytes beat the tree's latency (94.582 against 95.504 ms)
    assert all_reduce_ms(GIB, group, cluster) == pytest.approx(93.95240959 + 0.630, rel=1e-8)
    assert all_reduce_ms(GIB, group, cluster, algorithm="tree") == pytest.approx(95.44371769 + 0.060, rel=1e-8)
    assert all_reduce_ms(GIB, group, cluster, algorithm="auto") == all_reduce_ms(GIB, group, cluster)


def test_tree_is_a_chain_inside_a_node_and_a_tree_across_by_hand() -> None:
    # inside a node: 2 x 7 latencies, as many as the ring, and 2 S / B: never faster than the ring
    one = _cluster(8, 8)
    assert all_reduce_ms(1024, group_on(one, 8), one, algorithm="tree") == pytest.approx(
        (2 * 1024 / NVLINK + 14 * NVLINK_LAT) * MS
    )
    assert all_reduce_ms(1024, group_on(one, 8), one, algorithm="auto") == all_reduce_ms(1024, group_on(one, 8), one)
    # 16 over 2 nodes: 2 (7 x 3 us + 1 x 5 us) = 52 us against the ring's 94 us
    two = _cluster(nics=8)
    assert all_reduce_ms(1024, group_on(two, 16), two, algorithm="tree") == pytest.approx(
        (2 * 1024 / 180e9 + 52e-6) * MS
    )


def test_all_to_all_by_hand() -> None:
    # one node of 8: 7/8 x 2^30 / 240e9 s + 7 x 3 us
    one = _cluster(8, 8)
    assert all_to_all_ms(GIB, group_on(one, 8), one) == pytest.approx(3.91468373 + 0.021, rel=1e-8)
    # 16 over 2 nodes: each member sends 7/16 of S over NVLink and 8/16 over its NIC share, and
    # pays 7 x 3 us + 8 x 5 us = 61 us; the NIC part bounds it
    assert all_to_all_ms(GIB, group_on(_cluster(), 16), _cluster(nics=8)) == pytest.approx(
        23.86092942 + 0.061, rel=1e-8
    )  # 0.5 x 2^30 / 22.5e9
    assert all_to_all_ms(GIB, group_on(_cluster(), 16), _cluster(nics=1)) == pytest.approx(
        190.8874354 + 0.061, rel=1e-8
    )  # 0.5 x 2^30 / 2.8125e9: no aggregation, every member shares the one NIC


def test_send_recv_by_hand() -> None:
    cluster = _cluster(nics=1)
    assert send_recv_ms(GIB, cluster, 0, 7) == pytest.approx(4.47392427 + 0.003, rel=1e-8)  # NVLink
    assert send_recv_ms(GIB, cluster, 0, 8) == pytest.approx(47.72185884 + 0.005, rel=1e-8)  # one NIC
    assert send_recv_ms(GIB, cluster, 3, 3) == 0.0
    with pytest.raises(InputError, match="dst=16 is not a device of the cluster: use 0 .. 15"):
        send_recv_ms(GIB, cluster, 0, 16)
    with pytest.raises(InputError, match="src=-1"):
        send_recv_ms(GIB, cluster, -1, 0)


def test_nothing_to_move_costs_nothing() -> None:
    cluster = _cluster()
    single, pair = group_on(cluster, 1), group_on(cluster, 2, stride=8)
    for algorithm in ALL_REDUCE_ALGORITHMS:
        assert all_reduce_ms(GIB, single, cluster, algorithm=algorithm) == 0.0
        assert all_reduce_ms(0, pair, cluster, algorithm=algorithm) == 0.0
        assert all_reduce_ms(-1, pair, cluster, algorithm=algorithm) == 0.0
    for fn in (reduce_scatter_ms, all_gather_ms, all_to_all_ms):
        assert fn(GIB, single, cluster) == 0.0 and fn(0, pair, cluster) == 0.0
    assert send_recv_ms(0, cluster, 0, 8) == 0.0


def test_an_unknown_algorithm_is_refused_with_the_choices() -> None:
    with pytest.raises(InputError, match="unknown all-reduce algorithm 'rings': use one of ring, tree, auto"):
        all_reduce_ms(GIB, group_on(_cluster(), 8), _cluster(), algorithm="rings")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- properties

_BW = st.floats(1e8, 1e12)
_LAT = st.floats(0, 1e-4)
_NBYTES = st.floats(1, 1e11)


@st.composite
def _placed(draw: Any, *, nics: int | None = -1) -> tuple[Cluster, Group]:
    """A cluster (1-8 nodes of 1-8 devices, any links and NICs) and a group placed on it."""
    dpn, nodes = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    devices = dpn * nodes
    stride = draw(st.integers(1, devices))
    size = draw(st.integers(1, devices // stride))
    concurrent = draw(st.integers(1, devices // size))
    if nics == -1:
        nics = draw(st.none() | st.integers(1, 16))
    cluster = _cluster(devices, dpn, nics=nics, intra=(draw(_BW), draw(_LAT)), inter=(draw(_BW), draw(_LAT)))
    return cluster, group_on(cluster, size, stride=stride, concurrent=concurrent)


def _all_times(nbytes: float, group: Group, cluster: Cluster) -> list[float]:
    return [
        all_reduce_ms(nbytes, group, cluster),
        all_reduce_ms(nbytes, group, cluster, algorithm="tree"),
        all_reduce_ms(nbytes, group, cluster, algorithm="auto"),
        reduce_scatter_ms(nbytes, group, cluster),
        all_gather_ms(nbytes, group, cluster),
        all_to_all_ms(nbytes, group, cluster),
    ]


_PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@_PROPERTY
@given(placed=_placed(), a=_NBYTES, b=_NBYTES)
def test_time_never_falls_as_the_bytes_grow(placed: tuple[Cluster, Group], a: float, b: float) -> None:
    cluster, group = placed
    small, large = sorted((a, b))
    for t_small, t_large in zip(_all_times(small, group, cluster), _all_times(large, group, cluster), strict=True):
        assert 0 <= t_small <= t_large


@_PROPERTY
@given(placed=_placed(), nbytes=_NBYTES)
def test_ring_all_reduce_is_exactly_a_reduce_scatter_and_an_all_gather(placed: tuple[Cluster, Group], nbytes: float) -> None:
    cluster, group = placed
    assert all_reduce_ms(nbytes, group, cluster) == reduce_scatter_ms(nbytes, group, cluster) + all_gather_ms(
        nbytes, group, cluster
    )


@_PROPERTY
@given(placed=_placed(), nbytes=_NBYTES)
def test_auto_is_the_faster_algorithm(placed: tuple[Cluster, Group], nbytes: float) -> None:
    cluster, group = placed
    ring, tree, auto = _all_times(nbytes, group, cluster)[:3]
    assert auto == min(ring, tree)


@_PROPERTY
@given(placed=_placed(nics=1), nbytes=_NBYTES, more=st.integers(1, 16))
def test_more_nics_are_never_slower(placed: tuple[Cluster, Group], nbytes: float, more: int) -> None:
    cluster, group = placed
    richer = cluster.model_copy(update={"nics_per_node": 1 + more})
    every_device = cluster.model_copy(update={"nics_per_node": None})
    for fewer, plenty, one_each in zip(
        _all_times(nbytes, group, cluster), _all_times(nbytes, group, richer),
        _all_times(nbytes, group, every_device), strict=True,
    ):  # fmt: skip
        assert plenty <= fewer and one_each <= fewer


@_PROPERTY
@given(placed=_placed(), nbytes=_NBYTES)
def test_more_concurrent_groups_are_never_faster(placed: tuple[Cluster, Group], nbytes: float) -> None:
    cluster, group = placed
    if (group.concurrent + 1) * group.size > cluster.num_devices:
        return
    busier = Group(group.size, group.per_node, group.nodes, group.concurrent + 1)
    for alone, crowded in zip(_all_times(nbytes, group, cluster), _all_times(nbytes, busier, cluster), strict=True):
        assert crowded >= alone


@_PROPERTY
@given(placed=_placed(), nbytes=_NBYTES)
def test_a_ring_never_beats_the_links_it_runs_on(placed: tuple[Cluster, Group], nbytes: float) -> None:
    cluster, group = placed
    nics = cluster.nics_per_node or cluster.devices_per_node
    net = cluster.inter_node.bandwidth_bytes_per_s
    assert cross_node_bandwidth(group, cluster) <= net
    if group.nodes > 1:  # no more than the node's NICs, and no more than NVLink when it is on the path
        assert ring_bandwidth(group, cluster) <= nics * net * (1 + 1e-12)
        if group.per_node > 1:
            assert ring_bandwidth(group, cluster) <= cluster.intra_node.bandwidth_bytes_per_s
    else:
        assert ring_bandwidth(group, cluster) == cluster.intra_node.bandwidth_bytes_per_s


@_PROPERTY
@given(
    dpn=st.integers(2, 8), nodes=st.integers(2, 8), nics=st.none() | st.integers(1, 16),
    intra=_BW, inter=_BW, lat_intra=_LAT, lat_inter=_LAT, nbytes=_NBYTES, data=st.data(),
)  # fmt: skip
def test_a_group_inside_one_node_is_never_slower_than_spread_over_nodes(
    dpn: int, nodes: int, nics: int | None, intra: float, inter: float, lat_intra: float,
    lat_inter: float, nbytes: float, data: st.DataObject,
) -> None:  # fmt: skip
    # on a cluster whose network is no faster than NVLink and no quicker to answer (every real one);
    # the ring collectives only: a spread all-to-all adds the NIC as a second path beside NVLink,
    # and a tree across nodes has log N latencies where the chain inside a node has n - 1
    net_bw, nvlink_bw = sorted((intra, inter))
    nvlink_lat, net_lat = sorted((lat_intra, lat_inter))
    cluster = _cluster(dpn * nodes, dpn, nics=nics, intra=(nvlink_bw, nvlink_lat), inter=(net_bw, net_lat))
    size = data.draw(st.integers(2, dpn))
    stride = data.draw(st.integers(2, dpn * nodes // size))
    inside, spread = group_on(cluster, size), group_on(cluster, size, stride=stride)
    for fn in (all_reduce_ms, reduce_scatter_ms, all_gather_ms):
        assert fn(nbytes, spread, cluster) >= fn(nbytes, inside, cluster) * (1 - 1e-12)


@_PROPERTY
@given(n=st.integers(1, 8), nbytes=_NBYTES, bw=_BW, lat=_LAT)
def test_one_node_prices_as_the_one_link_functions(n: int, nbytes: float, bw: float, lat: float) -> None:
    cluster = _cluster(8, 8, intra=(bw, lat))
    group = group_on(cluster, n)
    assert all_reduce_ms(nbytes, group, cluster) == pytest.approx(allreduce_ms(nbytes, n, bw, lat), rel=1e-12)
    assert reduce_scatter_ms(nbytes, group, cluster) == pytest.approx(half_ring_ms(nbytes, n, cluster.intra_node), rel=1e-12)
