"""RoPE against transformers' own code, without a model: the inverse frequencies and the attention factor of every
scaling type (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``), the rotation (``rotate_half``), and a config read
in either of transformers' layouts. Fast (no checkpoint), so the mutation check of ``rope.py`` runs it per mutant."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import rotate_half

from tokenselect.rope import RopeSpec, rotate

HEAD_DIM = 64
MAX_POS = 4096

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "truncate": False},
    "yarn-betas": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16.0,
                   "beta_slow": 2.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 0.7,
                    "mscale_all_dim": 0.3},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                              "attention_factor": 0.8},
    "yarn-no-original": {"rope_type": "yarn", "factor": 2.0},  # the original length is then max_position
    "yarn-mscale-only": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 0.7},
    "yarn-short-original": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},  # low < 0
    "yarn-clipped-high": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                          "rope_theta": 10.0},  # the ramp from dimension 22 to 70.8, clipped to d - 1 = 63
    "yarn-equal-betas": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 8.0, "beta_slow": 8.0, "truncate": False},  # low == high: the ramp's 0.001
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    "llama3-factors": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                       "original_max_position_embeddings": 1024},
    # the first frequency's wavelength 2 pi is exactly the low-frequency edge 512 / low_freq_factor (in fp32): there
    # the frequency is divided by the factor once (wavelen > edge is false, the smooth ramp is 0), not twice
    "llama3-at-the-edge": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 512 / (2 * math.pi),
                           "high_freq_factor": 100.0, "original_max_position_embeddings": 512},
}


def hf_config(params: dict, theta: float = 500_000.0) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
                       rope_parameters={"rope_theta": theta, **params})


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inverse_frequencies_and_attention_factor_match_transformers(name):
    cfg = hf_config(SCALINGS[name])
    spec = RopeSpec.from_hf(cfg.to_dict(), HEAD_DIM)
    assert spec.kind == SCALINGS[name]["rope_type"] and spec.max_position == MAX_POS
    assert spec.theta == SCALINGS[name].get("rope_theta", 500_000.0)
    for seq_len in (0, MAX_POS, MAX_POS + 1, 3 * MAX_POS):  # only dynamic reads it: equal to the window, then past it
        want, want_scale = ROPE_INIT_FUNCTIONS[spec.kind](cfg, "cpu", seq_len=max(seq_len, MAX_POS))
        got, scale = spec.inv_freq(seq_len)
        # measured: equal to the bit (0.0) for every type
        torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
        assert scale == pytest.approx(want_scale, rel=1e-12)


def test_default_frequencies_and_an_unscaled_config():
    cfg = {"max_position_embeddings": 2048, "rope_theta": 10000.0}
    spec = RopeSpec.from_hf(cfg, 16)
    assert (spec.kind, spec.factor, spec.original_max_position) == ("default", 1.0, None)
    inv, scale = spec.inv_freq(10**6)
    assert scale == 1.0
    assert inv.tolist() == pytest.approx([10000.0 ** (-i / 16) for i in range(0, 16, 2)], rel=1e-6)
    assert RopeSpec.from_hf({}, 16).theta == 10000.0 and RopeSpec.from_hf({}, 16).max_position == 2048


def test_dynamic_grows_the_base_only_past_the_window():
    spec = RopeSpec(HEAD_DIM, theta=10000.0, kind="dynamic", factor=2.0, max_position=1000)
    base, _ = RopeSpec(HEAD_DIM, theta=10000.0).inv_freq()
    assert torch.equal(spec.inv_freq(1000)[0], base)  # at the window: unchanged
    grown = spec.inv_freq(1001)[0]
    assert (grown[1:] < base[1:]).all() and grown[0] == base[0]  # the first frequency is theta^0 = 1 either way
    growth = 2.0 * 3000 / 1000 - 1
    want = 1.0 / (10000.0 * growth ** (HEAD_DIM / (HEAD_DIM - 2))) ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    torch.testing.assert_close(spec.inv_freq(3000)[0], want, atol=0, rtol=1e-6)


def test_the_v4_layout_reads_as_the_v5_one():
    v5 = hf_config(SCALINGS["yarn-mscale"]).to_dict()
    v4 = {"max_position_embeddings": MAX_POS, "rope_theta": 500_000.0,
          "rope_scaling": {"type": "yarn", **{k: v for k, v in SCALINGS["yarn-mscale"].items() if k != "rope_type"}}}
    assert RopeSpec.from_hf(v4, HEAD_DIM) == RopeSpec.from_hf(v5, HEAD_DIM)
    with pytest.raises(ValueError, match=r"unsupported rope scaling type 'su' \(supported: default, linear, dynamic, "
                                         r"yarn, llama3\)"):
        RopeSpec.from_hf({"rope_scaling": {"type": "su"}}, HEAD_DIM)
    # a raw config dict (no transformers defaults filled in): yarn's original length is the window; a type given as
    # null is the default
    raw = RopeSpec.from_hf({"max_position_embeddings": 3000, "rope_scaling": {"rope_type": "yarn", "factor": 2}}, 16)
    assert (raw.kind, raw.original_max_position, raw.factor) == ("yarn", 3000, 2.0)
    assert RopeSpec.from_hf({"rope_scaling": {"rope_type": "linear", "factor": 2}}, 16).original_max_position is None
    assert RopeSpec.from_hf({"rope_scaling": {"rope_type": None}}, 16).kind == "default"
    bare = RopeSpec.from_hf({"rope_scaling": {"rope_type": "llama3", "factor": 8}}, 16)  # llama3's factors left out
    assert (bare.low_freq_factor, bare.high_freq_factor, bare.beta_fast, bare.beta_slow) == (1.0, 4.0, 32.0, 1.0)
    assert RopeSpec.from_hf({"rope_scaling": {"type": "linear", "factor": 3}}, 16).kind == "linear"


@pytest.mark.parametrize("kind", ["ntk", "linear", "dynamic", "yarn"])
def test_user_overrides(kind):
    spec = RopeSpec(HEAD_DIM, theta=500_000.0, max_position=1000).with_scaling(kind, 4)
    assert (spec.kind, spec.factor, spec.original_max_position, spec.max_position) == (kind, 4.0, 1000, 1000)
    assert (spec.theta, spec.head_dim) == (500_000.0, HEAD_DIM)  # kept from the model's own
    if kind == "ntk":  # static NTK-aware: the base stretched once by factor^(d / (d - 2))
        base = 500_000.0 * 4 ** (HEAD_DIM / (HEAD_DIM - 2))
        want = [base ** (-i / HEAD_DIM) for i in range(0, HEAD_DIM, 2)]
        assert spec.inv_freq()[0].tolist() == pytest.approx(want, rel=1e-6) and spec.inv_freq()[1] == 1.0
    with pytest.raises(ValueError, match="unknown rope scaling 'llama3'"):
        spec.with_scaling("llama3", 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_transformers_rotate_half(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3, HEAD_DIM, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 4096, 70_000, 1_000_000])
    inv_freq, scale = RopeSpec.from_hf(hf_config(SCALINGS["yarn"]).to_dict(), HEAD_DIM).inv_freq()
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * scale).to(dtype)[:, None, :], (emb.sin() * scale).to(dtype)[:, None, :]
    want = x * cos + rotate_half(x) * sin
    got = rotate(x, positions, inv_freq, scale)
    assert got.dtype == dtype
    assert torch.equal(rotate(x, positions, inv_freq), rotate(x, positions, inv_freq, 1.0))  # the scale's default
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same operations: measured equal to the bit
    # position 0 is the identity (times the attention factor); a rotation keeps each pair's norm
    torch.testing.assert_close(got[0].float(), (x[0] * scale).float(), atol=0, rtol=0 if dtype == torch.float32 else 1e-2)
    if dtype == torch.float32:
        pairs = lambda t: torch.stack([t[..., :HEAD_DIM // 2], t[..., HEAD_DIM // 2:]], -1).norm(dim=-1)  # noqa: E731
        torch.testing.assert_close(pairs(got), pairs(x) * scale, atol=1e-5, rtol=1e-5)


def test_yarn_attention_factor_formula():
    """0.1 ln(factor) + 1 (and 1 for factor <= 1), the ratio of two such with mscale and mscale_all_dim."""
    assert RopeSpec(HEAD_DIM, kind="yarn", factor=4.0, max_position=4096).inv_freq()[1] == pytest.approx(
        0.1 * math.log(4.0) + 1.0)
    assert RopeSpec(HEAD_DIM, kind="yarn", factor=1.0, max_position=4096).inv_freq()[1] == 1.0
    assert RopeSpec(HEAD_DIM, kind="yarn", factor=0.5, max_position=4096).inv_freq()[1] == 1.0  # no shrinking
    both = RopeSpec(HEAD_DIM, kind="yarn", factor=4.0, max_position=4096, mscale=0.7, mscale_all_dim=0.3)
    assert both.inv_freq()[1] == pytest.approx((0.07 * math.log(4.0) + 1) / (0.03 * math.log(4.0) + 1))
