"""Step-time profiles: the roofline charges what the formula says for hand-computed batches (dense and
MoE), KV capacity matches the hand computation, files round-trip, malformed files give one-line
errors naming file and field, and the fitter recovers known coefficients. No vLLM engine here."""

from __future__ import annotations

import json
import math
import random

import pytest
from vllm_mars.sim.fit import Sample, fit_profile, nnls, step_speed
from vllm_mars.sim.profile import Efficiency, available_profiles, load_profile
from vllm_mars.sim.shapes import ModelShape

GIB = 2 ** 30


def test_shipped_profiles_cover_both_gpus_and_three_models():
    names = set(available_profiles())
    for gpu in ("h100", "h200"):
        for model in ("qwen3-coder-30b-a3b", "qwen3-32b", "llama-3.1-8b"):
            assert f"{gpu}-{model}" in names
    for name in names:
        p = load_profile(name)
        assert p.name == name
        assert p.step_seconds([(p.max_num_batched_tokens, 0)], []) > 0
        assert p.kv_capacity_tokens() >= p.max_model_len, name  # vLLM refuses a context the pool cannot hold


def test_parameter_counts_match_the_model_cards():
    # model cards: Qwen3-Coder-30B-A3B 30.5B total / 3.3B activated; Qwen3-32B 32.8B; Llama-3.1-8B 8.0B
    coder = load_profile("h200-qwen3-coder-30b-a3b").shape
    assert coder.total_params / 1e9 == pytest.approx(30.5, rel=0.01)
    assert (coder.active_params + coder.embed_params) / 1e9 == pytest.approx(3.3, rel=0.03)
    assert load_profile("h200-qwen3-32b").shape.total_params / 1e9 == pytest.approx(32.8, rel=0.01)
    assert load_profile("h100-llama-3.1-8b").shape.total_params / 1e9 == pytest.approx(8.03, rel=0.01)


def test_dense_step_is_the_hand_computed_roofline():
    p = load_profile("h100-llama-3.1-8b")
    e = p.efficiency
    # Llama-3.1-8B config.json and the H100 SXM datasheet, typed here by hand
    layers, hidden, heads, kv_heads, hd, inter, vocab = 32, 4096, 32, 8, 128, 14336, 128256
    peak, bw = 989.4e12, 3.35e12
    attn_w = 2 * hidden * hd * (heads + kv_heads)          # q, o + k, v
    mlp_w = 3 * hidden * inter                             # gate, up, down
    lm_head = vocab * hidden
    shared = layers * (attn_w + mlp_w)
    prefill, decode = [(2048, 4096)], [1000, 3000]
    tokens, seqs = 2048 + 2, 3
    t_lin = max(2 * (tokens * shared + seqs * lm_head) / (peak * e.mfu), 2 * (shared + lm_head) / (bw * e.bw_eff))
    per_pair = 4 * layers * heads * hd                     # QK^T + PV, 2 FLOPs per multiply-add
    kv_tok = 2 * layers * kv_heads * hd * 2                # K and V, bf16
    t_pre = max(per_pair * 2048 * (4096 + 2049 / 2) / (peak * e.attn_mfu), (4096 + 2048) * kv_tok / (bw * e.bw_eff))
    t_dec = (1001 + 3001) * max(per_pair / (peak * e.attn_mfu), kv_tok / (bw * e.bw_eff))
    expected = t_lin + t_pre + t_dec + e.step_overhead_s + seqs * e.per_seq_overhead_s
    assert p.step_seconds(prefill, decode) == pytest.approx(expected, rel=1e-12)
    assert p.step_seconds([], []) == 0.0


def test_moe_step_reads_only_the_experts_the_batch_touches():
    p = load_profile("h200-qwen3-coder-30b-a3b")
    e = p.efficiency
    layers, hidden, heads, kv_heads, hd, vocab, experts, k, moe_inter = 48, 2048, 32, 4, 128, 151936, 128, 8, 768
    peak, bw = 989.4e12, 4.8e12
    shared = layers * (2 * hidden * hd * (heads + kv_heads) + hidden * experts)   # attention + router
    expert = 3 * hidden * moe_inter
    lm_head = vocab * hidden

    def expected(decode):
        n = len(decode)
        touched = experts * (1 - (1 - k / experts) ** n)
        flops = 2 * (n * (shared + layers * k * expert) + n * lm_head)
        bytes_ = 2 * (shared + lm_head + layers * touched * expert)
        t_lin = max(flops / (peak * e.mfu), bytes_ / (bw * e.bw_eff))
        kv_tok = 2 * layers * kv_heads * hd * 2
        t_dec = sum(c + 1 for c in decode) * max(4 * layers * heads * hd / (peak * e.attn_mfu), kv_tok / (bw * e.bw_eff))
        return t_lin + t_dec + e.step_overhead_s + n * e.per_seq_overhead_s

    for batch in ([8192], [1000] * 16, [32768] * 64):
        assert p.step_seconds([], batch) == pytest.approx(expected(batch), rel=1e-12)
    shape = p.shape
    assert shape.experts_touched(1) == pytest.approx(8)
    assert shape.experts_touched(10_000) == pytest.approx(128)
    # one decode reads far fewer weight bytes than 64 decodes (3.3B vs ~30B parameters)
    one, many = p.step_terms([], [0]), p.step_terms([], [0] * 64)
    assert many.lin_bytes / one.lin_bytes > 5


def test_kv_capacity_matches_hand_computation():
    p = load_profile("h200-qwen3-coder-30b-a3b")
    params = (2 * 151936 * 2048                      # embedding + untied lm_head
              + 48 * (2 * 2048 * 128 * (32 + 4)     # attention
                      + 128 * 3 * 2048 * 768         # 128 experts
                      + 2048 * 128))                 # router
    assert p.shape.total_params == params
    kv_per_token = 2 * 48 * 4 * 128 * 2              # 96 KiB
    assert p.kv_bytes_per_token() == kv_per_token == 98304
    free = 143771 * 2 ** 20 * 0.9 - 2 * params - 3 * GIB
    blocks = int(free) // (16 * kv_per_token)
    assert p.num_kv_blocks() == blocks
    assert p.kv_capacity_tokens() == blocks * 16
    assert 650_000 < p.kv_capacity_tokens() < 800_000
    # KV heads are split over TP (and replicated when fewer than the TP degree)
    assert p.shape.kv_bytes_per_token(2) == kv_per_token // 2
    assert p.shape.kv_bytes_per_token(8) == kv_per_token // 4


def test_tensor_parallel_divides_compute_and_adds_allreduce(tmp_path):
    p = load_profile("h100-qwen3-32b")
    d = p.to_dict()
    d["hardware"]["tp"] = 2
    d["model"] = p.model_dir()
    (tmp_path / "tp2.json").write_text(json.dumps(d))
    p2 = load_profile(str(tmp_path / "tp2.json"))
    assert p2.kv_capacity_tokens() > 4 * p.kv_capacity_tokens()   # half the weights and half the KV per GPU
    t1, t2 = p.step_seconds([(8192, 0)], []), p2.step_seconds([(8192, 0)], [])
    terms = p2.step_terms([(8192, 0)], [])
    ar = 2 * 64 * (2 * 8192 * 5120 * 2 * 0.5 / 450e9 + 1e-5)     # 2 all-reduces/layer, ring: 2(tp-1)/tp x bytes
    assert terms.fixed_s == pytest.approx(ar)
    overhead = p.efficiency.step_overhead_s + p.efficiency.per_seq_overhead_s
    assert t2 - overhead == pytest.approx((t1 - overhead) / 2 + ar, rel=1e-9)


def test_step_terms_and_step_seconds_agree():
    rng = random.Random(0)
    for name in available_profiles():
        p = load_profile(name)
        if p.kernels is not None:  # kernel tables price those steps; step_terms stay the roofline's (refits)
            continue
        e = p.efficiency
        peak, bw = p.hardware.peak_flops * p.hardware.tp, p.hardware.hbm_bandwidth * p.hardware.tp
        for _ in range(20):
            prefill = [(rng.randint(2, 4096), rng.randint(0, 60000)) for _ in range(rng.randint(0, 3))]
            decode = [rng.randint(0, 60000) for _ in range(rng.randint(0, 100))]
            t = p.step_terms(prefill, decode)
            secs = max(t.lin_flops / (peak * e.mfu), t.lin_bytes / (bw * e.bw_eff)) if t.n_seq else 0.0
            secs += sum(max(f / (peak * e.attn_mfu), b / (bw * e.bw_eff)) for f, b in t.attn)
            secs += t.fixed_s + (e.step_overhead_s + t.n_seq * e.per_seq_overhead_s if t.n_seq else 0.0)
            assert p.step_seconds(prefill, decode) == pytest.approx(secs, rel=1e-9)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_profile_file_round_trip(tmp_path, suffix):
    p = load_profile("h200-qwen3-coder-30b-a3b")
    path = p.with_efficiency(p.efficiency, model=p.model_dir()).write(tmp_path / f"copy{suffix}")
    q = load_profile(str(path))
    assert q.efficiency == p.efficiency and q.hardware == p.hardware
    assert q.kv_capacity_tokens() == p.kv_capacity_tokens()
    assert q.step_seconds([(512, 1000)], [100, 200]) == p.step_seconds([(512, 1000)], [100, 200])


def _write(tmp_path, mutate, suffix=".json"):
    d = load_profile("h100-llama-3.1-8b").to_dict()
    d["model"] = "llama-3.1-8b"
    mutate(d)
    path = tmp_path / f"bad{suffix}"
    path.write_text(json.dumps(d) if suffix == ".json" else d)
    return str(path)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["efficiency"].pop("mfu"), "efficiency.mfu"),
    (lambda d: d["efficiency"].update(mfu="fast"), "efficiency.mfu"),
    (lambda d: d["efficiency"].update(bw_eff=-1.0), "bw_eff"),
    (lambda d: d["hardware"].update(tp=1.5), "hardware.tp"),
    (lambda d: d["hardware"].update(hbm_bytes=1), "leave no KV memory"),
    (lambda d: d.update(block_size=0), "block_size"),
    (lambda d: d.update(speed=3), "speed"),
    (lambda d: d["memory"].update(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (lambda d: d["memory"].update(kv_blocks=3), "memory.kv_blocks"),
    (lambda d: d.update(model="no-such-model"), "no-such-model"),
    (lambda d: d.pop("name"), "name"),
])
def test_malformed_profile_is_one_line_naming_file_and_field(tmp_path, mutate, field):
    path = _write(tmp_path, mutate)
    with pytest.raises(ValueError) as ei:
        load_profile(path)
    msg = str(ei.value)
    assert "\n" not in msg and path in msg and field in msg, msg


def test_malformed_syntax_and_unknown_names(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("name = \n")
    with pytest.raises(ValueError, match=r"broken\.toml.*invalid TOML"):
        load_profile(str(bad))
    badj = tmp_path / "broken.json"
    badj.write_text("{\n  \"name\": ,\n}")
    with pytest.raises(ValueError, match=r"broken\.json:2: invalid JSON"):
        load_profile(str(badj))
    with pytest.raises(ValueError, match="h200-qwen3-coder-30b-a3b") as ei:
        load_profile("h300-nonsense")
    assert "unknown profile 'h300-nonsense'" in str(ei.value)
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"config\.json: missing field 'num_attention_heads'"):
        ModelShape.from_model_dir(cfg)


def test_nnls_is_exact_and_non_negative():
    a = [[1, 0, 1], [1, 1, 0], [1, 2, 1], [1, 3, 0]]
    import numpy as np

    a = np.array(a, dtype=float)
    x = nnls(a, a @ np.array([0.5, 2.0, 0.0]))
    assert np.allclose(x, [0.5, 2.0, 0.0])
    x = nnls(a, a @ np.array([3.0, -1.0, 0.0]))   # the unconstrained solution is negative
    assert np.all(x >= 0)


def test_fit_recovers_known_coefficients():
    """Steps timed by a known profile (plus 1% noise) give back its coefficients."""
    base = load_profile("h200-llama-3.1-8b")
    truth = base.with_efficiency(Efficiency(mfu=0.42, attn_mfu=0.3, bw_eff=0.8, step_overhead_s=0.003,
                                            per_seq_overhead_s=5e-5))
    rng = random.Random(1)
    samples = []
    for c in (256, 1024, 4096, 8192):
        for ctx in (0, 8192, 32768):
            samples.append(Sample(((c, ctx),), (), truth.step_seconds([(c, ctx)], []) * rng.uniform(0.99, 1.01), "p"))
    for b in (1, 8, 64, 256):
        for ctx in (1024, 8192, 32768):
            samples.append(Sample((), (ctx,) * b, truth.step_seconds([], [ctx] * b) * rng.uniform(0.99, 1.01), "d"))
    start = base.with_efficiency(Efficiency(mfu=0.9, bw_eff=0.3, attn_mfu=0.9))
    res = fit_profile(start, samples, source="test")
    e = res.profile.efficiency
    assert e.mfu == pytest.approx(0.42, rel=0.05)
    assert e.attn_mfu == pytest.approx(0.3, rel=0.05)
    assert e.bw_eff == pytest.approx(0.8, rel=0.05)
    assert e.step_overhead_s == pytest.approx(0.003, rel=0.2)
    assert res.rms_rel_err < 0.02
    assert math.isfinite(res.points[0].rel_err) and "rms relative error" in res.table()
    assert "test; relative loss; rms relative step error" in e.source
    res_abs = fit_profile(start, samples, loss="absolute")
    assert res_abs.profile.efficiency.mfu == pytest.approx(0.42, rel=0.05) and abs(res_abs.total_err) < 0.01
    with pytest.raises(ValueError, match="loss"):
        fit_profile(start, samples, loss="median")


def test_step_scale_scales_every_step_and_keeps_the_pool():
    for name in ("cpu-tiny", "h200-qwen3-coder-30b-a3b"):
        p = load_profile(name)
        for factor in (0.5, 2.0):
            q = p.with_step_scale(factor)
            assert q.num_kv_blocks() == p.num_kv_blocks()
            assert q.max_num_seqs == p.max_num_seqs and q.block_size == p.block_size
            for prefill, decode in ([(512, 0)], []), ([], [100] * 32), ([(2048, 30000)], [5000] * 8):
                assert q.step_seconds(prefill, decode) == pytest.approx(factor * p.step_seconds(prefill, decode))
    with pytest.raises(ValueError, match="step scale"):
        load_profile("cpu-tiny").with_step_scale(0)


def test_step_speed_is_measured_over_predicted_time_for_the_same_batches():
    """A run whose steps took 1.5x what the profile predicts, whatever its batch mix, reads 1.5;
    steps with no batch are left out; nothing to compare is a ValueError."""
    prof = load_profile("h200-llama-3.1-8b")
    batches = [(((512, 0),), ()), ((), (4096,) * 8), (((256, 1024),), (2048, 300))]
    slow = [Sample(p, d, 1.5 * prof.step_seconds(p, d)) for p, d in batches]
    assert step_speed(prof, slow + [Sample((), (), 9.0)]) == pytest.approx(1.5)
    # The mix does not matter: one heavy prefill and many decodes, each 1.5x, still read 1.5.
    assert step_speed(prof, slow[:1] + slow[1:2] * 20) == pytest.approx(1.5)
    assert step_speed(prof, [Sample(p, d, prof.step_seconds(p, d)) for p, d in batches]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no timed steps"):
        step_speed(prof, [Sample((), (), 1.0)])
