"""CPU smoke of the decode-loop soak (mla_fa3.bench.soak): the H200 run is `python -m mla_fa3.bench.soak`.

On the CPU the soak's two runs are the torch reference run twice from one seed, so their equal digests say only
that the soak is seeded; and its own check (every 5th step) shares the softmax scale and the recorded history
with the loop it checks. Here EVERY step's output is compared with the fp64 non-absorbed oracle
(``tests/oracle.mla_nonabsorbed``) fed what this test saw go in: the prefix rows the soak stored at a join (at
the slots the request's table names), the latent row of each decode step, the query, and the kv_b_proj weight;
the softmax scale is 1/sqrt(d_nope + d_rope) of the CPU config (8 + 8).
"""

from __future__ import annotations

import json

import torch

from oracle import mla_nonabsorbed

from mla_fa3.bench import soak

CPU_SCALE = (8 + 8) ** -0.5  # the CPU smoke config: qk_nope_head_dim 8, qk_rope_head_dim 8


def _watch(monkeypatch):
    """Spy on every soak run: record each request's latent rows as they go in, check each step's output."""
    seen = {"steps": 0, "rows": 0, "max_err": 0.0}
    init, join = soak._Soak.__init__, soak._Soak._join

    def watched_init(self, cfg):
        init(self, cfg)
        self._rows_in = {}  # row -> per layer: the latent rows [L, r + d_rope] of its cached tokens (fp64)
        self._stored = []  # (layer, slots, rows) of the current join's pool writes
        set_latent, run = self.pool.set_latent, self.runner.run

        def spy_set_latent(layer, loc, latent):
            self._stored.append((layer, loc.tolist(), latent.double().clone()))
            return set_latent(layer, loc, latent)

        def spy_run(batch, inputs):
            out = run(batch, inputs)
            rows = sorted(self.length)
            d, r = self.cfg.dims, self.cfg.kv_lora_rank
            for b, row in enumerate(rows):
                for layer in range(self.cfg.layers):
                    self._rows_in[row][layer] = torch.cat([self._rows_in[row][layer],
                                                           inputs["latent"][b:b + 1].double()])
                    lat = self._rows_in[row][layer]
                    assert lat.shape[0] == self.length[row] + 1
                    ref, _ = mla_nonabsorbed(inputs["q"][b:b + 1], lat[:, :r], lat[:, r:], self.kv_b[layer],
                                             qk_nope_head_dim=d.qk_nope_head_dim, v_head_dim=d.v_head_dim,
                                             scale=CPU_SCALE)
                    err = float((out[b, layer].double() - ref[0]).abs().max() / ref.abs().max())
                    seen["max_err"] = max(seen["max_err"], err)
                    seen["rows"] += 1
            seen["steps"] += 1
            return out

        self.pool.set_latent, self.runner.run = spy_set_latent, spy_run

    def watched_join(self):
        before = set(self.length)
        self._stored = []
        join(self)
        for row in self.length:
            if row in before:
                continue
            slots = self.req_pool.req_to_token[row, :self.length[row]].tolist()
            self._rows_in[row] = [next(rows for lid, s, rows in self._stored if lid == layer and s == slots)
                                  for layer in range(self.cfg.layers)]

    monkeypatch.setattr(soak._Soak, "__init__", watched_init)
    monkeypatch.setattr(soak._Soak, "_join", watched_join)
    return seen


def test_soak_cpu_smoke(tmp_path, capsys, monkeypatch):
    seen = _watch(monkeypatch)
    assert soak.main(["--steps", "50", "--device", "cpu", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "soak.json").read_text())
    c = res["first"]["counts"]
    assert c["joins"] > 0 and c["finishes"] > 0 and c["preemptions"] > 0 and c["checks"] > 0
    assert not res["first"]["leaked"] and res["ok"]
    # both runs, every decode step, every request and layer: fp32 reference kernels vs the fp64 oracle
    assert seen["rows"] == 2 * c["tokens"] * res["config"]["layers"]
    assert seen["max_err"] <= 1e-5
    assert "OK" in capsys.readouterr().out
