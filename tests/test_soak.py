"""CPU smoke of the decode-loop soak (mla_fa3.bench.soak): the H200 run is `python -m mla_fa3.bench.soak`."""

from __future__ import annotations

import json

from mla_fa3.bench import soak


def test_soak_cpu_smoke(tmp_path, capsys):
    assert soak.main(["--steps", "50", "--device", "cpu", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "soak.json").read_text())
    c = res["first"]["counts"]
    assert c["joins"] > 0 and c["finishes"] > 0 and c["preemptions"] > 0 and c["checks"] > 0
    assert res["first"]["max_rel_err"] <= 1e-4  # fp32 reference kernels vs the soak's own fp32 reference
    assert res["bitwise_identical"] and not res["first"]["leaked"] and res["ok"]
    assert "OK" in capsys.readouterr().out
