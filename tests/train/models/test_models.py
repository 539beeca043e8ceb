"""BertForMaskedLM: shapes, HF-style names and outputs, mixed precision, masking, learning."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from ampctl.train.data import IGNORE_INDEX, MASK_ID, SyntheticSource
from ampctl.train.models import BertForMaskedLM, MaskedLMOutput

VOCAB = 128
SEQ = 16


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """These models are tiny: one intra-op thread is as fast, and far faster when
    other processes compete for the cores (2 spinning threads can be ~20x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(**overrides: object) -> BertForMaskedLM:
    kw: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        ffn_size=64,
        max_position=32,
        dropout=0.0,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    return BertForMaskedLM(**kw)  # type: ignore[arg-type]


def make_batch(
    batch: int = 3, seq: int = SEQ, pad_from: int | None = None
) -> dict[str, torch.Tensor]:
    """Random tokens, CLS first; rows 1.. padded from ``pad_from`` on when given."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (batch, seq), generator=g)
    ids[:, 0] = 1
    mask = torch.ones(batch, seq, dtype=torch.bool)
    if pad_from is not None:
        mask[1:, pad_from:] = False
        ids = ids.masked_fill(~mask, 0)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 2:5] = ids[:, 2:5]
    ids[:, 2:4] = MASK_ID
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_forward_shape_and_finite_loss() -> None:
    model = tiny()
    out = model(**make_batch())
    assert isinstance(out, MaskedLMOutput)
    assert out.logits.shape == (3, SEQ, VOCAB)
    assert out.loss is not None and out.loss.shape == () and torch.isfinite(out.loss)
    # At init the prediction is near uniform.
    assert abs(out.loss.item() - math.log(VOCAB)) < 0.5
    out.loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_output_supports_attribute_and_mapping_access() -> None:
    model = tiny()
    batch = make_batch()
    out = model(**batch)
    assert out["loss"] is out.loss and out["logits"] is out.logits
    assert out.keys() == ["loss", "logits"] and "loss" in out
    assert dict(out) == {"loss": out.loss, "logits": out.logits}
    assert list(out) == ["loss", "logits"] and len(out) == 2

    no_labels = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    assert no_labels.loss is None and no_labels.keys() == ["logits"]
    with pytest.raises(KeyError, match="loss"):
        no_labels["loss"]


def test_module_names_follow_hugging_face() -> None:
    names = set(dict(tiny().named_modules()))
    expected = {
        "bert.embeddings.word_embeddings",
        "bert.embeddings.position_embeddings",
        "bert.embeddings.token_type_embeddings",
        "bert.embeddings.LayerNorm",
        "bert.embeddings.dropout",
        "cls.predictions.transform.dense",
        "cls.predictions.transform.LayerNorm",
        "cls.predictions.decoder",
    }
    for i in range(2):
        p = f"bert.encoder.layer.{i}"
        expected |= {
            f"{p}.attention.self.query",
            f"{p}.attention.self.key",
            f"{p}.attention.self.value",
            f"{p}.attention.output.dense",
            f"{p}.attention.output.LayerNorm",
            f"{p}.intermediate.dense",
            f"{p}.output.dense",
            f"{p}.output.LayerNorm",
        }
    assert expected <= names
    assert "bert.encoder.layer.2.attention.self.query" not in names


def test_tied_embeddings_and_init() -> None:
    model = tiny(hidden_size=64, ffn_size=128)
    word = model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight is word
    assert abs(word.std().item() - 0.02) < 0.002
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), name
        elif isinstance(module, torch.nn.Linear):
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), name
    untied = tiny(tie_embeddings=False)
    assert (
        untied.cls.predictions.decoder.weight is not untied.bert.embeddings.word_embeddings.weight
    )


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_runs_under_autocast(dtype: torch.dtype, attn_impl: str) -> None:
    model = tiny(attn_impl=attn_impl)
    with torch.autocast("cpu", dtype=dtype):
        out = model(**make_batch(pad_from=10))
    assert out.logits.dtype == dtype
    assert out.loss is not None and out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_half_weights_under_fp16_autocast(attn_impl: str) -> None:
    model = tiny(attn_impl=attn_impl).half()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(**make_batch(pad_from=10))
    assert out.logits.dtype == torch.float16
    assert out.loss is not None and out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    grad = model.bert.embeddings.word_embeddings.weight.grad
    assert grad is not None and grad.dtype == torch.float16 and torch.isfinite(grad).all()


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_padded_tokens_do_not_change_real_positions(attn_impl: str) -> None:
    model = tiny(attn_impl=attn_impl).eval()
    batch = make_batch(pad_from=9)
    mask = batch["attention_mask"]
    other = batch["input_ids"].clone()
    other[~mask] = torch.randint(4, VOCAB, (int((~mask).sum()),))
    with torch.no_grad():
        a = model(batch["input_ids"], attention_mask=mask).logits
        b = model(other, attention_mask=mask).logits
    torch.testing.assert_close(a[mask], b[mask], rtol=0, atol=1e-5)
    # Without the mask the padded tokens would matter: the test can fail.
    with torch.no_grad():
        c = model(other).logits
    assert not torch.allclose(a[mask], c[mask], atol=1e-3)


def test_eager_and_sdpa_agree() -> None:
    eager = tiny(attn_impl="eager").eval()
    sdpa = tiny(attn_impl="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    batch = make_batch(pad_from=7)
    with torch.no_grad():
        a = eager(**batch)
        b = sdpa(**batch)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-5)
    assert a.loss is not None and b.loss is not None
    assert abs(a.loss.item() - b.loss.item()) < 1e-5


def test_token_type_ids_are_used() -> None:
    model = tiny().eval()
    ids = make_batch()["input_ids"]
    with torch.no_grad():
        zero = model(ids).logits
        explicit = model(ids, token_type_ids=torch.zeros_like(ids)).logits
        ones = model(ids, token_type_ids=torch.ones_like(ids)).logits
    torch.testing.assert_close(zero, explicit)
    assert not torch.allclose(zero, ones)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(hidden_size=100, num_heads=12),
            r"hidden_size \(100\) must be divisible by num_heads \(12\)",
        ),
        (dict(attn_impl="flash"), r"attn_impl \('flash'\) must be one of eager, sdpa"),
        (dict(vocab_size=0), r"vocab_size \(0\) must be >= 1"),
        (dict(num_layers=0), r"num_layers \(0\) must be >= 1"),
        (dict(num_heads=2.0), r"num_heads must be an int"),
        (dict(ffn_size=-3), r"ffn_size \(-3\) must be >= 1"),
        (dict(max_position=0), r"max_position \(0\) must be >= 1"),
        (dict(dropout=1.0), r"dropout \(1.0\) must be in \[0, 1\)"),
        (dict(layer_norm_eps=0.0), r"layer_norm_eps \(0.0\) must be a positive"),
        (dict(tie_embeddings="yes"), r"tie_embeddings must be a bool"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BertForMaskedLM(**kwargs)  # type: ignore[arg-type]


def test_bad_inputs_are_reported() -> None:
    model = tiny(max_position=8)
    with pytest.raises(ValueError, match=r"seq_len 16, more than max_position \(8\)"):
        model(torch.ones(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="labels has shape"):
        model(torch.ones(2, 8, dtype=torch.long), labels=torch.ones(2, 7, dtype=torch.long))


def test_tiny_model_learns_synthetic_mlm() -> None:
    """150 AdamW steps on the synthetic chain take the loss far below ln(vocab)."""
    assert torch.get_num_threads() == 1
    torch.manual_seed(0)
    model = BertForMaskedLM(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        ffn_size=128,
        max_position=32,
        dropout=0.0,
    )
    data = SyntheticSource(vocab_size=128, seq_len=32, batch_size=16, seed=0, branching=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(150):
        loss = model(**data.next_batch()).loss
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    held_out = []
    with torch.no_grad():
        for i in range(10):  # batches far beyond the ones trained on
            out = model(**data.batch_at(10_000 + i))
            assert out.loss is not None
            held_out.append(out.loss.item())
    eval_loss = sum(held_out) / len(held_out)
    print(f"tiny model held-out MLM loss after 150 steps: {eval_loss:.3f}")
    assert eval_loss < 0.6 * math.log(128), eval_loss
