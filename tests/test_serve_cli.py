"""``mla-fa3 plan`` and ``mla-fa3 bench serve`` from the command line (CPU, tiny config)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from mla_fa3 import cli


@pytest.fixture(autouse=True)
def _restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_plan_table_and_json(capsys):
    assert cli.main(["plan", "--kv-dtype", "fp8", "--max-context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "KV pool" in out and "576 B/token/layer (fp8)" in out
    assert cli.main(["plan", "--kv-dtype", "bf16", "--max-context", "32768", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token_layer"] == 1152 and plan["num_layers"] == 61
    assert plan["kv_tokens"] == (plan["num_pages"] - 1) * plan["page_size"]


def test_plan_refuses_with_exit_status_2(capsys):
    assert cli.main(["plan", "--weight-dtype", "bf16"]) == 2
    assert "weights" in capsys.readouterr().err
