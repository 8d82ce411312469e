"""Each validation rule has a case that only it rejects (issue 22), so a rule removed or loosened fails here.

The TP degree rules (`Qwen35Config.valid_tp_degrees` / `check_tp_degree`): attention heads, DeltaNet key heads,
KV heads (divide t, or t a multiple of them: replicated), value heads in whole groups of their key head. The real
sizes never reject a degree by the KV-head rule alone (tests/test_config.py), so each rule gets a made-up head
layout here where it is the only one that says no. The export-folder checks are in
tests/optimum_neuron/test_export_checks.py; the command line's fallback for unexpected errors at the end here.
"""

from __future__ import annotations

import json

import pytest

from optimum_qwen35.cli import main
from optimum_qwen35.config import Qwen35Config
from optimum_qwen35.errors import UnsupportedModelError, UsageError
from tests.kit import build_tiny_checkpoint

from .test_config import real_config


def heads_config(heads: int, kv: int, nk: int, nv: int) -> Qwen35Config:
    config = real_config()
    config["text_config"].update(
        num_attention_heads=heads, num_key_value_heads=kv, linear_num_key_heads=nk, linear_num_value_heads=nv
    )
    return Qwen35Config.from_dict(config)


# (rule, heads, kv heads, key heads, value heads, a degree only that rule refuses, the valid degrees)
RULES = [
    ("attention heads divide by t", 6, 2, 16, 16, 4, [1, 2]),  # 4 splits the key heads and the KV heads, not 6 heads
    ("DeltaNet key heads divide by t", 16, 4, 6, 12, 4, [1, 2]),  # 4 splits heads and KV heads, not 6 key heads
    ("KV heads divide by t, or t is a multiple of them", 12, 6, 12, 12, 4, [1, 2, 3, 6, 12]),  # 6 KV heads on 4 ranks
    # Value heads follow their key head, so the key-head rule keeps each group of 3 value heads on one rank: a rule
    # written on the value heads (12 % 6 == 0) would accept t = 6 and split the groups.
    ("value heads stay in whole groups of their key head", 12, 6, 4, 12, 6, [1, 2]),
]


@pytest.mark.parametrize("rule, heads, kv, nk, nv, refused, valid", RULES, ids=[r[0] for r in RULES])
def test_each_tp_rule_refuses_a_degree_the_others_allow(rule, heads, kv, nk, nv, refused, valid):
    config = heads_config(heads, kv, nk, nv)
    assert config.valid_tp_degrees() == valid
    with pytest.raises(UsageError, match=rf"tensor_parallel_size={refused} does not split this model by whole heads"):
        config.check_tp_degree(refused)
    for t in valid:
        config.check_tp_degree(t)


def test_kv_heads_replicated_when_t_is_their_multiple():
    """12 heads, 2 KV heads: t = 4 and 12 replicate each KV head on 2 and 6 ranks (allowed); 3 does not divide 2
    and is not a multiple of it (refused)."""
    config = heads_config(12, 2, 12, 12)
    assert config.valid_tp_degrees() == [1, 2, 4, 6, 12]
    with pytest.raises(UsageError, match="tensor_parallel_size=3 "):
        config.check_tp_degree(3)


@pytest.mark.parametrize(
    "heads, kv, nk, nv, message",
    [
        (8, 3, 16, 16, r"num_attention_heads \(8\) must be a multiple of num_key_value_heads \(3\)"),
        (8, 2, 4, 10, r"linear_num_value_heads \(10\) must be a multiple of linear_num_key_heads \(4\)"),
    ],
)
def test_head_groups_that_do_not_divide_are_refused(heads, kv, nk, nv, message):
    with pytest.raises(UnsupportedModelError, match=message):
        heads_config(heads, kv, nk, nv)


def test_tp_degree_must_be_a_positive_integer():
    config = heads_config(8, 2, 16, 16)
    for bad in (0, -2, 2.0, True, "2"):
        with pytest.raises(UsageError, match="tensor_parallel_size"):
            config.check_tp_degree(bad)


# ------------------------------------------------------------------------------------------ command line
def test_cli_unexpected_error_is_one_line(tmp_path, capsys):
    """An error nobody anticipated (here a broken chat template: jinja2's TemplateSyntaxError, neither this package's
    error nor an OSError) prints one line naming it and how to get the traceback, exit status 1; --debug raises it."""
    folder = build_tiny_checkpoint(tmp_path / "ckpt", "tiny-2b", seed=3)
    tokenizer_config = folder / "tokenizer_config.json"
    data = json.loads(tokenizer_config.read_text())
    data["chat_template"] = "{% for message in messages %}{{ message['content'] }"  # unclosed block
    tokenizer_config.write_text(json.dumps(data))
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    argv = ["generate", "--model", str(folder), "--prompt", "hi", "--dtype", "float32", "--max-new-tokens", "2"]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 1
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("optimum-qwen35: error: unexpected TemplateSyntaxError: "), err
    assert "rerun with --debug and report the traceback" in err, err
    with pytest.raises(Exception) as raised:  # noqa: PT011 (the type is jinja2's, checked by name below)
        main(["--debug", *argv])
    assert type(raised.value).__name__ == "TemplateSyntaxError"
