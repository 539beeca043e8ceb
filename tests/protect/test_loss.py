"""The loss of a model call (ampctl.protect.loss): a tensor, ``.loss`` or ``["loss"]``, and the
one clear error for anything else."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ampctl.errors import BuildError
from ampctl.protect.loss import default_forward, extract_loss

HINT = (
    "no scalar loss: model(**batch) must return a loss tensor, an object with .loss, or a dict "
    "with 'loss' (pass labels= through to the loss)"
)


def test_a_tensor_an_attribute_or_a_key_is_the_loss_as_a_scalar():
    t = torch.tensor([2.5])
    assert extract_loss(t).shape == () and extract_loss(t).item() == 2.5
    assert extract_loss(SimpleNamespace(loss=torch.tensor(1.5))).item() == 1.5
    assert extract_loss({"loss": torch.tensor([[3.0]]), "logits": torch.ones(2)}).item() == 3.0
    # an object with .loss wins over a mapping lookup; a dict's 'loss' key is read when no attr
    both = SimpleNamespace(loss=torch.tensor(4.0))
    assert extract_loss(both).item() == 4.0


@pytest.mark.parametrize(
    "out, name",
    [
        (torch.ones(2), "Tensor"),
        ({"logits": torch.ones(1)}, "dict"),
        ({"loss": 1.0}, "dict"),
        (SimpleNamespace(loss=None), "SimpleNamespace"),
        (SimpleNamespace(loss=torch.ones(3)), "SimpleNamespace"),
        (None, "NoneType"),
        ((torch.ones(()),), "tuple"),
    ],
)
def test_anything_else_is_one_build_error_naming_what_came_back(out, name):
    with pytest.raises(BuildError) as e:
        extract_loss(out)
    assert str(e.value) == f"the model returned {name} with {HINT}"


class Half(nn.Module):
    def forward(self, x, scale):
        return {"loss": (x * scale).sum().half()}


def test_default_forward_calls_the_model_with_the_batch_and_returns_fp32():
    loss = default_forward(Half(), {"x": torch.ones(3), "scale": torch.tensor(2.0)})
    assert loss.dtype == torch.float32 and loss.shape == () and loss.item() == 6.0
