"""A vision recipe whose model could not take an image in a chat request is refused by `hpc validate` where the
model's directory is readable, instead of every image chat (the smoke check's first) failing after launch."""

from __future__ import annotations

import json

import pytest

from hpc.cli.main import main

pytestmark = pytest.mark.unit

TEXT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
PARTS_TEMPLATE = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<img>"
                  "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")


def _model(tmp_path, model_type: str, template: str, where: str = "tokenizer_config") -> str:
    model = tmp_path / f"{model_type}-{where}"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": model_type, "num_attention_heads": 32}))
    config = {"chat_template": template} if where == "tokenizer_config" else {}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    if where == "processor":
        (model / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    return str(model)


@pytest.mark.parametrize("model_type, template, where, refused", [
    ("mystery_vl", TEXT_TEMPLATE, "tokenizer_config", True),  # text template, placeholder unknown
    ("llava_next", TEXT_TEMPLATE, "tokenizer_config", False),  # hpc writes <image> into the text
    ("mystery_vl", PARTS_TEMPLATE, "processor", False),  # the template writes its own placeholder
])
def test_a_vision_model_images_cannot_reach_is_refused_at_validate(tmp_path, capsys, model_type, template, where,
                                                                   refused):
    path = _model(tmp_path, model_type, template, where)
    code = main(["validate", "-c", "eos", "-r", "qwen2-vl-agg", "--set", f"model.path={path}"])
    err = capsys.readouterr().err
    if refused:
        assert code == 2 and "recipes/qwen2-vl-agg.yaml: model.chat_template: images cannot reach this model in " \
            "chat requests: its chat template prints a message's content as text, and hpc does not know the image " \
            "placeholder of model_type 'mystery_vl' (give a template that loops over content parts" in err, err
    else:
        assert code == 0, err
    # a template given in the recipe decides instead of the checkpoint's
    parts = tmp_path / "parts.jinja"
    parts.write_text(PARTS_TEMPLATE)
    assert main(["validate", "-c", "eos", "-r", "qwen2-vl-agg", "--set", f"model.path={path}",
                 "--set", f"model.chat_template={parts}"]) == 0
