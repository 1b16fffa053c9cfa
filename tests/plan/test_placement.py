import pytest

from hpc.errors import UserError
from hpc.plan.placement import plan
from hpc.plan.topology import rank_coords
from hpc.spec.catalog import load_cluster, load_recipe
from hpc.spec.cluster import ClusterProfile
from hpc.spec.recipe import Recipe

pytestmark = pytest.mark.unit


def _recipe(roles, **extra):
    return Recipe.model_validate({"name": "r", "model": {"path": "/m", "served_name": "m"}, "backend": "trtllm",
                                  "roles": roles, **extra})


def _cluster(**extra):
    return ClusterProfile.model_validate({"name": "c", "nodes_available": 64, "gpus_per_node": 8, **extra})


def test_tiny_disagg_on_dev_is_infra_prefill_decode_on_three_nodes():
    p = plan(load_cluster("dev")[0], load_recipe("tiny-disagg")[0])
    assert p.job_nodes == 3
    assert {s.name: s.node for s in p.services} == {"etcd": 0, "nats": 0, "frontend": 0}
    assert p.worker("prefill", 0).nodes == [1] and p.worker("decode", 0).nodes == [2]
    assert p.readiness_order == ["etcd", "nats", "frontend", "prefill-0", "decode-0"]


def test_multi_node_worker_uses_whole_nodes_and_block_ranks():
    p = plan(_cluster(), _recipe({"agg": {"tensor_parallel_size": 16}}))
    w = p.workers[0]
    assert w.nodes == [0, 1] and w.tasks == 16 and w.tasks_per_node == 8
    assert [(r.node, r.gpu) for r in w.ranks[7:9]] == [(0, 7), (1, 0)]


def test_workers_of_a_role_share_a_node_with_distinct_gpus_and_ports():
    p = plan(_cluster(), _recipe({"agg": {"count": 4, "tensor_parallel_size": 2}}))
    assert [w.nodes for w in p.workers] == [[0]] * 4
    assert [w.gpu_offset for w in p.workers] == [0, 2, 4, 6]
    ports = [port for w in p.workers for port in w.ports.values()]
    assert len(ports) == len(set(ports))


def test_spread_puts_each_role_on_nodes_of_its_own():
    p = plan(_cluster(), _recipe({"prefill": {"count": 5, "tensor_parallel_size": 2},
                                  "decode": {"tensor_parallel_size": 4}}, placement="spread"))
    assert [w.nodes[0] for w in p.workers] == [0, 0, 0, 0, 1, 2]
    assert p.job_nodes == 3


def test_pack_shares_nodes_between_roles_with_disjoint_gpus():
    p = plan(_cluster(), _recipe({"prefill": {"count": 5, "tensor_parallel_size": 2},
                                  "decode": {"tensor_parallel_size": 4}}))
    assert [w.nodes[0] for w in p.workers] == [0, 0, 0, 0, 1, 1]
    assert p.job_nodes == 2
    held = [(r.node, r.gpu) for w in p.workers for r in w.ranks]
    assert len(held) == len(set(held)) == 14  # each GPU held by one worker


@pytest.mark.parametrize("recipe, nodes, gpus", [("gpt-oss-120b-disagg", 1, {"prefill-0": "n0:0-3", "decode-0": "n0:4-7"}),
                                                 ("llava-epd", 1, {"encode-0": "n0:0", "prefill-0": "n0:1",
                                                                   "decode-0": "n0:2"})])
def test_shipped_recipes_that_fit_one_node_use_one(recipe, nodes, gpus):
    p = plan(load_cluster("eos")[0], load_recipe(recipe)[0])
    assert p.job_nodes == nodes
    assert {w.name: w.gpu_text() for w in p.workers} == gpus


def test_a_multi_node_worker_after_a_packed_one_starts_on_a_fresh_node():
    p = plan(_cluster(), _recipe({"prefill": {"tensor_parallel_size": 4}, "decode": {"tensor_parallel_size": 16}}))
    assert p.worker("prefill", 0).nodes == [0] and p.worker("decode", 0).nodes == [1, 2]


def test_partial_multi_node_worker_is_rejected():
    with pytest.raises(UserError, match="not a whole number of 8-GPU nodes"):
        plan(_cluster(), _recipe({"agg": {"tensor_parallel_size": 12}}))


def test_dedicated_infra_node():
    p = plan(_cluster(), _recipe({"agg": {"tensor_parallel_size": 8}}, infra={"placement": "dedicated"}))
    assert p.service("frontend").node == 0 and p.workers[0].nodes == [1]


def test_local_profile_puts_everything_on_one_node():
    p = plan(load_cluster("local")[0], load_recipe("tiny-epd")[0])
    assert p.job_nodes == 1 and {n for w in p.workers for n in w.nodes} == {0}


def test_topology_coordinates():
    c = rank_coords(13, tp=8, pp=2, ep=4, attention_dp=True, tasks_per_node=8)
    assert (c.pp, c.tp, c.ep, c.dp, c.node_offset, c.local_rank) == (1, 5, 1, 5, 1, 5)
    c = rank_coords(3, tp=4, pp=1, ep=1, attention_dp=False, tasks_per_node=4, gpu_offset=4)
    assert (c.gpu, c.dp, c.ep) == (7, 0, 0)
    with pytest.raises(ValueError):
        rank_coords(8, tp=4, pp=2, ep=1, attention_dp=False, tasks_per_node=8)


def test_frontend_processes_scale_with_the_cores_the_job_holds_on_its_node():
    def processes(cluster, recipe, setting=None):
        r = load_recipe(recipe, [f"frontend.processes={setting}"] if setting else None)[0]
        return plan(cluster, r).service("frontend").processes

    eos = load_cluster("eos")[0]  # exclusive nodes of 224 cores
    assert processes(eos, "deepseek-r1-disagg") == 4
    assert processes(eos, "deepseek-r1-disagg", 16) == 16
    eight = _cluster(cpus_per_node=16, exclusive=True)
    assert plan(eight, _recipe({"agg": {}})).service("frontend").processes == 2  # one per 8 cores
    # not exclusive: the job holds a CPU per task slot, and the frontend's processes get one each
    shared = _cluster(cpus_per_node=128)
    assert plan(shared, _recipe({"agg": {}})).service("frontend").processes == 1
    assert plan(shared, _recipe({"agg": {"tensor_parallel_size": 8}})).service("frontend").processes == 4
    assert plan(shared, _recipe({"agg": {"tensor_parallel_size": 2}}, frontend={"processes": 2})) \
        .service("frontend").processes == 2
    with pytest.raises(UserError) as err:
        plan(shared, _recipe({"agg": {}}, frontend={"processes": 2}))
    assert err.value.field == "frontend.processes" and "holds 1" in err.value.message
