"""spec.scheduling.topology rendered for each gang scheduler (paratrain_operator.topology, api.kueue): Kueue's
topology-aware scheduling annotations with ranks in order, the native PodGroup's constraint, and pod affinity by
domain group where neither can say it; the deprecated topologyKey read as topology.level."""

from __future__ import annotations

from typing import Any

import pytest

from paratrain import contract
from paratrain.api import kueue, parse_job
from paratrain.api.platform import Platform
from paratrain_operator.planning import split_cost
from paratrain_operator.topology import GROUP_LABEL, placement, ranges

from .test_render import job_doc, pods, render

RACK = "network.example.com/rack"


def gang(nodes: int = 4, procs: int = 2, queue: str | None = None, **scheduling: Any) -> dict[str, Any]:
    doc = job_doc(nodes=nodes, procsPerNode=procs, parallelism={"data": nodes * procs},
                  training={"batchSize": 8 * nodes * procs}, scheduling=scheduling)
    if queue:
        doc["metadata"]["labels"] = {kueue.QUEUE_LABEL: queue}
    return doc


def kind(objects: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == name]


def test_kueue_places_the_whole_gang_or_slices_of_it_with_ranks_in_order() -> None:
    whole = pods(render(gang(queue="q", topology={"level": RACK, "mode": "preferred"})))
    for pod in whole:
        notes = pod["metadata"]["annotations"]
        assert notes[kueue.PREFERRED_TOPOLOGY] == RACK and kueue.REQUIRED_TOPOLOGY not in notes
        # Kueue copies the node rank into its pod index: domains fill in rank order
        assert notes[kueue.POD_INDEX_LABEL] == contract.LABEL_NODE_RANK
        assert pod["metadata"]["labels"][contract.LABEL_NODE_RANK] == notes["paratrain.dev/node-rank"]
        assert "affinity" not in pod["spec"] and GROUP_LABEL not in pod["metadata"]["labels"]
    sliced = pods(render(gang(queue="q", topology={"level": RACK, "ranksPerDomain": 4})))
    assert {(p["metadata"]["annotations"][kueue.SLICE_REQUIRED_TOPOLOGY],
             p["metadata"]["annotations"][kueue.SLICE_SIZE]) for p in sliced} == {(RACK, "2")}  # 4 ranks: 2 pods
    assert not any(kueue.REQUIRED_TOPOLOGY in p["metadata"]["annotations"] for p in sliced)
    refused = parse_job(gang(queue="q", topology={"level": RACK, "mode": "preferred", "ranksPerDomain": 4}))
    assert [path for path, _ in kueue.kueue_problems(refused)] == ["spec.scheduling.topology.mode"]


def test_the_native_podgroup_keeps_a_required_whole_gang_in_one_domain() -> None:
    objects = render(gang(gang="kubernetes", topology={"level": RACK}))
    (group,), (workload,) = kind(objects, "PodGroup"), kind(objects, "Workload")
    assert group["spec"]["schedulingConstraints"] == {"topology": [{"key": RACK}]}
    assert workload["spec"]["podGroupTemplates"][0]["schedulingConstraints"] == {"topology": [{"key": RACK}]}
    assert not any("affinity" in p["spec"] for p in pods(objects))
    # the field it replaces renders the same
    old = render(gang(gang="kubernetes", topologyKey=RACK))
    assert kind(old, "PodGroup") == [group] and pods(old) == pods(objects)


@pytest.mark.parametrize("gang_kind", ["kubernetes", "none", "volcano", "kai", "coscheduling"])
def test_groups_of_ranks_per_domain_share_a_domain_by_pod_affinity(gang_kind: str) -> None:
    objects = render(gang(gang=gang_kind, topology={"level": RACK, "ranksPerDomain": 4}), attempt=2)
    assert not any("schedulingConstraints" in o.get("spec", {}) for o in kind(objects, "PodGroup"))
    for rank, pod in enumerate(pods(objects)):
        group = str(rank // 2)  # 4 ranks a domain, 2 per pod: node ranks 0-1, 2-3
        assert pod["metadata"]["labels"][GROUP_LABEL] == group
        (term,) = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term == {"topologyKey": RACK, "labelSelector": {"matchLabels": {
            contract.LABEL_JOB: "j", contract.LABEL_ATTEMPT: "2", GROUP_LABEL: group}}}


def test_a_preferred_domain_is_a_weighted_preference_beside_the_users_own_affinity() -> None:
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]}},
        "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 5, "podAffinityTerm": {"topologyKey": "zone", "labelSelector": {"matchLabels": {"x": "y"}}}}]}}
    doc = gang(topology={"level": RACK, "mode": "preferred"}, affinity=own)
    for pod in pods(render(doc)):
        affinity = pod["spec"]["affinity"]
        assert affinity["nodeAffinity"] == own["nodeAffinity"]
        mine, theirs = (affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][i]
                        for i in (1, 0))
        assert theirs == own["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert mine["weight"] == 100 and mine["podAffinityTerm"]["topologyKey"] == RACK
        assert pod["metadata"]["labels"][GROUP_LABEL] == "0"  # one group: the whole gang
    assert len(own["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]) == 1  # the spec's untouched


# ---- where the gang landed (status.placement, SplitAcrossDomains) ------------------------------------------------


@pytest.mark.parametrize("topology,expected", [
    ({"level": RACK}, {"networkTopology": {"mode": "hard", "highestTierAllowed": 1}}),
    ({"level": RACK, "mode": "preferred"}, {"networkTopology": {"mode": "soft"}}),
    ({"level": RACK, "ranksPerDomain": 4}, {"subGroupPolicy": [{
        "name": "domain", "subGroupSize": 2, "labelSelector": {"matchLabels": {contract.LABEL_JOB: "j"}},
        "matchLabelKeys": [GROUP_LABEL, contract.LABEL_ATTEMPT],
        "networkTopology": {"mode": "hard", "highestTierAllowed": 1}}]}),
    ({"level": RACK, "mode": "preferred", "ranksPerDomain": 4}, {}),  # Volcano takes no soft subgroup constraint
    ({"level": "network.example.com/block"}, {}),  # a level the platform gives no tier
])
def test_volcano_gets_its_own_network_topology_where_the_platform_names_the_levels_tier(topology, expected):
    """Volcano places by HyperNode tiers, not labels: the platform's volcanoTiers says which tier a label stands for.
    The pods keep their group labels (the subgroups' keys) and pod affinity either way."""
    platform = Platform.model_validate({"volcanoTiers": {RACK: 1}})
    from paratrain_operator.render import render_job

    objects = render_job(parse_job(gang(gang="volcano", topology=topology)), "ns", 0, platform)
    (group,) = kind(objects, "PodGroup")
    assert {k: v for k, v in group["spec"].items() if k in ("networkTopology", "subGroupPolicy")} == expected
    assert all("podAffinity" in p["spec"]["affinity"] for p in pods(objects))
    if topology.get("ranksPerDomain"):
        assert [p["metadata"]["labels"][GROUP_LABEL] for p in pods(objects)] == ["0", "0", "1", "1"]
    assert "networkTopology" not in kind(render(gang(gang="volcano", topology={"level": RACK})), "PodGroup")[0]["spec"]


KAI_TOPOLOGY = "cluster-topology"


@pytest.mark.parametrize("topology,expected", [
    ({"level": RACK}, {"minMember": 4, "topologyConstraint": {"topology": KAI_TOPOLOGY,
                                                             "requiredTopologyLevel": RACK}}),
    ({"level": RACK, "mode": "preferred"}, {"minMember": 4, "topologyConstraint": {
        "topology": KAI_TOPOLOGY, "preferredTopologyLevel": RACK}}),
    ({"level": RACK, "mode": "preferred", "ranksPerDomain": 4}, {"minSubGroup": 2, "subGroups": [
        {"name": f"group-{g}", "minMember": 2, "topologyConstraint": {
            "topology": KAI_TOPOLOGY, "preferredTopologyLevel": RACK}} for g in (0, 1)]}),  # KAI takes soft ones
])
def test_kai_gets_its_own_topology_constraints_where_the_platform_names_its_topology(topology, expected):
    """KAI places by its Topology resource's levels (node labels): the platform names the resource. With
    ranksPerDomain each group of ranks is a KAI subgroup (all required: minSubGroup), its pods labelled with it in
    node-rank order; the pods keep their pod affinity either way. Without the platform's name, no constraint."""
    from paratrain_operator.render import render_job

    from .test_render_valid import validate

    objects = render_job(parse_job(gang(gang="kai", topology=topology)), "ns", 0,
                         Platform.model_validate({"kaiTopology": KAI_TOPOLOGY}))
    (group,) = kind(objects, "PodGroup")
    assert {k: v for k, v in group["spec"].items() if k not in ("queue", "priorityClassName")} == expected
    subgroups = [p["metadata"]["labels"].get("kai.scheduler/subgroup-name") for p in pods(objects)]
    assert subgroups == (["group-0", "group-0", "group-1", "group-1"] if "subGroups" in expected else [None] * 4)
    assert all("podAffinity" in p["spec"]["affinity"] for p in pods(objects))
    for obj in objects:
        validate(obj)
    (bare,) = kind(render(gang(gang="kai", topology=topology)), "PodGroup")
    assert not any("topologyConstraint" in g for g in [bare["spec"], *bare["spec"].get("subGroups", [])])


def test_placement_lists_each_domains_node_ranks_and_names_the_ranks_outside_their_groups_domain() -> None:
    job = parse_job(gang(nodes=4, procs=2, topology={"level": RACK, "ranksPerDomain": 4}))  # groups: ranks 0-1, 2-3
    nodes = {r: (contract.pod_name("job", 0, r), f"n{r}") for r in range(4)}
    domains = {"n0": "a", "n1": "a", "n2": "b", "n3": "c"}  # group 1 split: ranks 2 (b) and 3 (c)
    placed, outliers = placement(job, 0, nodes, domains)
    assert placed == {"attempt": 0, "level": RACK, "splitGroups": 1, "domains": [
        {"domain": "a", "nodeRanks": "0-1"}, {"domain": "b", "nodeRanks": "2"}, {"domain": "c", "nodeRanks": "3"}]}
    assert [(o.rank, o.domain, o.group_domain, o.group) for o in outliers] == [(3, "c", "b", (2, 3))]
    whole, none = placement(job, 0, nodes, {f"n{r}": "a" for r in range(4)})
    assert whole["splitGroups"] == 0 and none == [] and whole["domains"] == [{"domain": "a", "nodeRanks": "0-3"}]


def test_a_node_without_the_label_is_its_own_unnamed_domain_and_a_long_rank_list_is_cut() -> None:
    job = parse_job(gang(nodes=2, procs=1, topology={"level": RACK}))
    placed, outliers = placement(job, 3, {0: ("p0", "n0"), 1: ("p1", "n1")}, {"n0": "a"})
    assert placed["domains"][1] == {"domain": "", "nodeRanks": "1"} and outliers[0].domain == ""
    assert len(ranges(range(0, 4000, 2))) == 256 and ranges(range(0, 4000, 2)).endswith("…")


def test_the_planner_prices_a_split_by_its_inter_node_traffic_at_the_spines_rate() -> None:
    spec = parse_job(gang(nodes=4, procs=8, topology={"level": RACK})).spec.model_copy(update={"resources": parse_job(
        gang(nodes=4, procs=8)).spec.resources.model_copy(update={"gpus_per_node": 8})})
    platform = Platform.model_validate({"planner": {"gpu": "H100-80GB"}})
    said = split_cost(spec, [], platform)
    assert "s more a step" in said and "on H100-80GB" in said and "at 25 GB/s (half the network bandwidth" in said
    assert "instead of 50 GB/s" in said
    stated = split_cost(spec, [], Platform.model_validate({"planner": {"gpu": "H100-80GB",
                                                                        "crossDomainBandwidth": "12.5G"}}))
    assert "at 12.5 GB/s (the platform's planner.crossDomainBandwidth)" in stated
    more = [float(text.split(" s more")[0].rsplit(" ", 1)[1]) for text in (said, stated)]
    assert 0 < more[0] < more[1], "a slower spine costs more"
    assert split_cost(parse_job(gang(nodes=4, procs=8)).spec.model_copy(update={"resources": spec.resources}), [],
                      Platform()).startswith("no cost predicted: mode auto cannot tell which GPU")
