import pytest

from hpc.errors import UserError
from hpc.spec.base import parse_model
from hpc.spec.catalog import apply_set, find, load_cluster, load_recipe
from hpc.spec.cluster import ClusterProfile, time_to_minutes
from hpc.spec.recipe import Recipe

pytestmark = pytest.mark.unit


def test_every_shipped_cluster_and_recipe_parses():
    for name in ("eos", "generic-h100", "dev", "local"):
        assert load_cluster(name)[0].name == name
    for name in ("deepseek-r1-agg", "deepseek-r1-disagg", "deepseek-r1-wide-ep", "deepseek-r1-mtp",
                 "gpt-oss-120b-disagg", "qwen3-agg", "llama4-eagle", "gemma3-vswa", "llava-epd", "qwen2-vl-agg", "qwen3-vl-epd",
                 "tiny-agg", "tiny-disagg", "tiny-epd"):
        assert load_recipe(name)[0].name == name


def test_unknown_cluster_key_lists_valid_keys():
    with pytest.raises(UserError) as err:
        parse_model(ClusterProfile, {"name": "x", "gpus_per_nod": 8}, file="c.yaml")
    text = err.value.render()
    assert "c.yaml: gpus_per_nod: unknown key" in text
    assert "did you mean 'gpus_per_node'" in text and "partition" in text


def test_nested_unknown_key_lists_that_models_keys():
    data = {"name": "r", "model": {"path": "/m", "served_name": "m", "tokenzier": "x"}, "backend": "torch",
            "roles": {"agg": {}}}
    with pytest.raises(UserError) as err:
        parse_model(Recipe, data, file="r.yaml")
    assert "model.tokenzier" in str(err.value) and "did you mean 'tokenizer'" in str(err.value)


@pytest.mark.parametrize("key, meant", [("tp", "tensor_parallel_size"), ("ep_size", "expert_parallel_size")])
def test_role_key_abbreviation_suggests_the_full_key(key, meant):
    data = {"name": "r", "model": {"path": "/m", "served_name": "m"}, "backend": "torch", "roles": {"agg": {key: 2}}}
    with pytest.raises(UserError) as err:
        parse_model(Recipe, data, file="r.yaml")
    assert f"r.yaml: roles.agg.{key}: unknown key (did you mean '{meant}'?" in err.value.render()


@pytest.mark.parametrize("model, roles, line", [
    (3, {"agg": {}}, "r.yaml: model: expected a mapping, got 3 (its keys: canned_completion, chat_template,"),
    ({"path": "/m", "served_name": "m"}, {"agg": [1]},
     "r.yaml: roles.agg: expected a mapping, got a list (its keys: count,"),
])
def test_scalar_where_a_section_belongs_lists_the_sections_keys(model, roles, line):
    with pytest.raises(UserError) as err:
        parse_model(Recipe, {"name": "r", "model": model, "backend": "torch", "roles": roles}, file="r.yaml")
    assert err.value.render().startswith(line)


def test_wrong_enum_value_names_field():
    data = {"name": "r", "model": {"path": "/m", "served_name": "m"}, "backend": "vllm", "roles": {"agg": {}}}
    with pytest.raises(UserError, match="r.yaml: backend: .*'trtllm', 'torch' or 'mock'"):
        parse_model(Recipe, data, file="r.yaml")


def test_role_shape_rules():
    base = {"name": "r", "model": {"path": "/m", "served_name": "m"}, "backend": "torch"}
    with pytest.raises(UserError, match="needs both 'prefill' and 'decode'"):
        parse_model(Recipe, {**base, "roles": {"prefill": {}}}, file="r.yaml")
    with pytest.raises(UserError, match="cannot be mixed"):
        parse_model(Recipe, {**base, "roles": {"agg": {}, "prefill": {}, "decode": {}}}, file="r.yaml")


def test_malformed_override_json_is_a_clear_error():
    data = {"name": "r", "model": {"path": "/m", "served_name": "m"}, "backend": "torch",
            "roles": {"agg": {"override_engine_args": '{"max_batch_size": 8,'}}}
    with pytest.raises(UserError, match="roles.agg.override_engine_args: malformed JSON"):
        parse_model(Recipe, data, file="r.yaml")


def test_time_limits():
    assert time_to_minutes("01:30:00") == 90
    assert time_to_minutes("2-00:00:01") == 2881
    with pytest.raises(ValueError):
        time_to_minutes("90 minutes")


def test_set_overrides_are_typed_and_do_not_mutate():
    data = {"roles": {"decode": {"count": 1}}}
    out = apply_set(data, ["roles.decode.count=3", "frontend.router=least_loaded", "smoke.enabled=false"])
    assert out["roles"]["decode"]["count"] == 3 and out["smoke"]["enabled"] is False
    assert data["roles"]["decode"]["count"] == 1
    with pytest.raises(UserError, match="expected path.to.key=value"):
        apply_set(data, ["roles.decode.count"])
    with pytest.raises(UserError, match="is not a mapping"):
        apply_set(data, ["roles.decode.count.x=1"])


def test_unknown_recipe_lists_available():
    with pytest.raises(UserError) as err:
        find("recipes", "tiny-disag")
    assert "did you mean 'tiny-disagg'" in str(err.value) and "deepseek-r1-agg" in str(err.value)


def test_recipe_name_cannot_carry_shell():
    data = {"name": "x; rm -rf /", "model": {"path": "/m", "served_name": "m"}, "backend": "torch",
            "roles": {"agg": {}}}
    with pytest.raises(UserError, match="name: String should match pattern"):
        parse_model(Recipe, data, file="r.yaml")


def test_env_names_must_be_shell_names():
    with pytest.raises(UserError, match="not a valid shell name"):
        parse_model(ClusterProfile, {"name": "c", "env": {"A B": "1"}}, file="c.yaml")
