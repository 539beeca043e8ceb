"""GPT-2 and Llama causal LMs: Hugging Face parity, names, layout, masks, presets, training."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from ampctl.config import load_config
from ampctl.runlog.writers import new_run_dir
from ampctl.train.builders import build_model, data_objective
from ampctl.train.checkpoint import load_checkpoint
from ampctl.train.models.causal import CausalLMOutput
from ampctl.train.models.gpt2 import GPT2LMHeadModel
from ampctl.train.models.llama import LlamaForCausalLM
from ampctl.train.trainer import train
from tests.conftest import FAST, read_jsonl

VOCAB, SEQ = 50, 16


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _objective(cfg) -> str:
    return data_objective(cfg.data, cfg.model)


def gpt2(**kw: object) -> GPT2LMHeadModel:
    args: dict[str, object] = dict(
        vocab_size=VOCAB, max_position=SEQ, hidden_size=32, num_layers=2, num_heads=4
    )
    args.update(kw)
    torch.manual_seed(0)
    return GPT2LMHeadModel(**args).eval()  # type: ignore[arg-type]


def llama(**kw: object) -> LlamaForCausalLM:
    args: dict[str, object] = dict(
        vocab_size=VOCAB,
        max_position=SEQ,
        hidden_size=32,
        ffn_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    args.update(kw)
    torch.manual_seed(0)
    return LlamaForCausalLM(**args).eval()  # type: ignore[arg-type]


def ids(batch: int = 3, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------ Hugging Face parity


def _hf_gpt2(**kw):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, **kw)
    cfg._attn_implementation = "eager"
    return tf.GPT2LMHeadModel(cfg).eval()


def _hf_llama():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-5,
    )
    return tf.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("stability", [False, True])
def test_gpt2_matches_hugging_face_both_ways(attn_impl: str, stability: bool) -> None:
    opts = dict(scale_attn_by_inverse_layer_idx=stability, reorder_and_upcast_attn=stability)
    hf = _hf_gpt2(**opts)
    ours = gpt2(attn_impl=attn_impl, **opts)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = ids()
    a, b = hf(input_ids=x, labels=x), ours(input_ids=x, labels=x)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    # and ours loads into theirs: the state dict is Hugging Face's (Conv1D [in, out] layout)
    hf2 = _hf_gpt2(**opts)
    hf2.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(hf2(input_ids=x).logits, a.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_llama_matches_hugging_face_both_ways(attn_impl: str) -> None:
    hf = _hf_llama()
    ours = llama(attn_impl=attn_impl)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = ids()
    a, b = hf(input_ids=x, labels=x), ours(input_ids=x, labels=x)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    # padding: the real positions agree with Hugging Face's
    mask = torch.ones_like(x)
    mask[0, 10:] = 0
    mask[1, 3:6] = 0
    a, b = hf(input_ids=x, attention_mask=mask), ours(input_ids=x, attention_mask=mask)
    diff = (a.logits - b.logits).abs().amax(-1) * mask
    assert diff.max() < 1e-5
    hf2 = _hf_llama()
    hf2.load_state_dict(ours.state_dict(), strict=True)


def test_module_names_follow_hugging_face() -> None:
    g = dict(gpt2().named_parameters(remove_duplicate=False))
    for name in (
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.1.ln_1.weight",
        "transformer.h.1.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.bias",
        "transformer.h.1.ln_2.bias",
        "transformer.h.1.mlp.c_fc.weight",
        "transformer.h.1.mlp.c_proj.weight",
        "transformer.ln_f.weight",
        "lm_head.weight",
    ):
        assert name in g, name
    assert g["lm_head.weight"] is g["transformer.wte.weight"]  # tied, as GPT-2
    m = dict(llama().named_parameters(remove_duplicate=False))
    for name in (
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert name in m, name
    assert m["lm_head.weight"] is not m["model.embed_tokens.weight"]
    assert m["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads of 8
    assert not any("bias" in n for n in m)


def test_gpt2_layout_lives_in_the_state_dict_only() -> None:
    model = gpt2()
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, torch.nn.Linear) and c_attn.weight.shape == (96, 32)
    sd = model.state_dict()
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    assert torch.equal(
        sd["transformer.h.0.attn.c_proj.weight"], model.transformer.h[0].attn.c_proj.weight.t()
    )
    assert sd["lm_head.weight"].shape == (VOCAB, 32)  # not a Conv1D: left alone
    # a checkpoint round trip (torch.save / weights_only load) restores the same model
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    other = gpt2()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    # nested under a parent module, the prefix is respected
    parent = torch.nn.ModuleDict({"lm": gpt2()})
    psd = parent.state_dict()
    assert psd["lm.transformer.h.1.mlp.c_fc.weight"].shape == (32, 128)
    parent.load_state_dict(psd, strict=True)


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_causal_and_loss_convention(make, attn_impl: str) -> None:
    model = make(attn_impl=attn_impl)
    x = ids()
    out = model(input_ids=x, labels=x)
    assert isinstance(out, CausalLMOutput) and out.logits.shape == (3, SEQ, VOCAB)
    # labels are shifted inside: position t predicts token t + 1; -100 is ignored
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    labels = x.clone()
    labels[:, 8:] = -100
    part = model(input_ids=x, labels=labels).loss
    expected = F.cross_entropy(out.logits[:, :7].reshape(-1, VOCAB), x[:, 1:8].reshape(-1))
    torch.testing.assert_close(part, expected)
    assert model(input_ids=x).loss is None and "loss" not in model(input_ids=x)
    # causal: changing token 9 leaves the logits of positions 0..8 unchanged
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % VOCAB
    changed = model(input_ids=y).logits
    torch.testing.assert_close(changed[:, :9], out.logits[:, :9])
    assert not torch.allclose(changed[:, 9:], out.logits[:, 9:])


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_padding_keys_are_ignored_and_nothing_is_nan(make, attn_impl: str) -> None:
    model = make(attn_impl=attn_impl)
    x = ids()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, :4] = False  # left padding: those queries see no real key before them
    padded = x.clone()
    padded[1, :4] = 7
    other = padded.clone()
    other[1, :4] = 11  # different padding tokens
    a = model(input_ids=padded, attention_mask=mask).logits
    b = model(input_ids=other, attention_mask=mask).logits
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    torch.testing.assert_close(a[1, 4:], b[1, 4:])


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_precision_forward(make, dtype: torch.dtype) -> None:
    model = make()
    x = ids()
    ref = model(input_ids=x, labels=x).loss
    with torch.autocast("cpu", dtype=dtype):
        out = model(input_ids=x, labels=x)
    assert out.logits.dtype == dtype and out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref.item()) < 0.05
    half = make().half()  # fp16 weights (fp16-pure): rotary has no buffer to round
    with torch.autocast("cpu", dtype=torch.float16):
        out = half(input_ids=x, labels=x)
    assert math.isfinite(out.loss.item()) and abs(out.loss.item() - ref.item()) < 0.05


def test_rotary_is_computed_in_fp32() -> None:
    from ampctl.train.models.llama import apply_rotary, rotary_cos_sin

    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = rotary_cos_sin(2048, 64, 500000.0, torch.device("cpu"))
    assert cos.dtype == torch.float32
    inv_freq = 500000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    angles = torch.arange(2048, dtype=torch.float64)[:, None] * inv_freq
    ref = torch.cat((angles, angles), dim=-1).cos()
    assert (cos.double() - ref).abs().max() < 1e-3  # in bf16 an angle near 2000 is +-4 rad off
    x = torch.randn(1, 2, 2048, 64).bfloat16()
    y = apply_rotary(x, cos, sin)
    assert y.dtype == torch.bfloat16
    # rotated in fp32 and rounded once, not rounded after every bf16 operation
    assert torch.equal(y, apply_rotary(x.float(), cos, sin).bfloat16())


@pytest.mark.parametrize(
    "make, kwargs, message",
    [
        (gpt2, {"hidden_size": 30}, "hidden_size (30) must be divisible by num_heads (4)"),
        (gpt2, {"dropout": 1.5}, "dropout"),
        (gpt2, {"attn_impl": "flash"}, "attn_impl"),
        (gpt2, {"tie_embeddings": "yes"}, "tie_embeddings"),
        (llama, {"num_kv_heads": 3}, "num_heads (4) must be a multiple of num_kv_heads (3)"),
        (llama, {"rope_theta": 0.5}, "rope_theta"),
        (llama, {"num_layers": 0}, "num_layers (0) must be >= 1"),
    ],
)
def test_bad_arguments_name_the_argument(make, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(**kwargs)


def test_bad_inputs_are_reported() -> None:
    with pytest.raises(ValueError, match="more than max_position"):
        gpt2()(input_ids=ids(seq=SEQ + 1))
    with pytest.raises(ValueError, match="labels has shape"):
        llama()(input_ids=ids(), labels=ids()[:, :4])


# ------------------------------------------------------------------------ presets


@pytest.mark.parametrize(
    "preset, params",
    [("gpt2_small", 124_439_808), ("llama_1b", 1_235_814_400)],
)
def test_large_presets_build_lazily_on_the_meta_device(preset: str, params: int) -> None:
    cfg = load_config([f"conf={preset}"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    unique = {id(p): p for p in model.parameters()}.values()
    assert sum(p.numel() for p in unique) == params  # HF's gpt2 / Llama 3.2 1B count
    assert data_objective(cfg.data, cfg.model) == "causal"


def test_preset_precision_defaults_and_command_line_wins() -> None:
    gpt, lla = load_config(["conf=gpt2_tiny"]), load_config(["conf=llama_tiny"])
    assert (gpt.precision.name, gpt.precision.fp32_modules) == ("fp16", ["*ln_*"])
    assert (lla.precision.name, lla.precision.fp32_modules) == ("bf16", ["*norm*"])
    assert (gpt.scaler.growth_interval, gpt.scaler.hysteresis) == (100, 2)
    assert load_config(["conf=llama_1b", "precision=fp16"]).precision.name == "fp16"
    assert load_config(["conf=gpt2_small", "precision=bf16"]).precision == type(gpt.precision)(
        name="bf16", fp32_modules=["*ln_*"]
    )


def test_objective_auto_follows_the_model_name() -> None:
    assert _objective(load_config([])) == "mlm"
    assert _objective(load_config(["model=gpt2_tiny"])) == "causal"
    assert _objective(load_config(["model=llama_tiny"])) == "causal"
    hf = load_config(["model._target_=transformers.GPT2LMHeadModel"])
    assert data_objective(hf.data, hf.model) == "causal"
    assert _objective(load_config(["model=gpt2_tiny", "data.objective=mlm"])) == "mlm"


# ----------------------------------------------------------------------- training

DECODER_FAST = [*FAST, "model.num_heads=2"]


def _cfg(tmp_path, preset: str, *extra: str):
    extra_model = ["model.num_kv_heads=2"] if preset.startswith("llama") else []
    return load_config(
        [f"conf={preset}", *DECODER_FAST, *extra_model, f"trainer.runs_dir={tmp_path}", *extra]
    )


@pytest.mark.parametrize("preset", ["gpt2_tiny", "llama_tiny"])
def test_decoders_train_in_fp16_with_the_loss_falling(tmp_path, preset: str) -> None:
    cfg = _cfg(tmp_path, preset, "precision=fp16", "trainer.max_steps=16", "optim.lr=1e-2")
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, preset))
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert [r["precision"] for r in rows] == ["fp16"] * 4
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # from ~ln(64) = 4.16
    assert res.summary["status"] == "ok"


def test_gpt2_resume_gives_identical_losses(tmp_path) -> None:
    """Checkpoints go through the Conv1D-layout hooks: a resumed run must not notice."""
    cfg = _cfg(tmp_path, "gpt2_tiny")
    full = train(cfg, new_run_dir(cfg.trainer.runs_dir, "full"))
    part = train(cfg, new_run_dir(cfg.trainer.runs_dir, "part"))
    # cut the second run back to its step-6 checkpoint, as if it had died there
    (part.run_dir / "checkpoints" / "step_00000012.pt").unlink()
    rows = [r for r in read_jsonl(part.run_dir / "metrics.jsonl") if r["step"] <= 6]
    (part.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_checkpoint(part.run_dir)["step"] == 6
    res = train(cfg, part.run_dir, resume=part.run_dir)
    a = [r["loss"] for r in read_jsonl(full.run_dir / "metrics.jsonl")]
    b = [r["loss"] for r in read_jsonl(res.run_dir / "metrics.jsonl")]
    assert a == b and len(a) == 3
