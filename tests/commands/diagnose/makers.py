"""Real checkpoints of other tools, written by the tools themselves on CPU (tiny models, a few
steps), and NaN/inf planted with the same libraries. Used by the tests and by README's runs:

    python -m tests.commands.diagnose.makers OUT_DIR     # writes every format, healthy and -nan

The MLP has parameters of four distinct shapes, so formats that keep no parameter order
(safetensors, Accelerate) still get their optimizer state named by shape.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

PLANT_WEIGHT = "0.weight"  # a NaN at [1, 2]
PLANT_MOMENT = "2.weight"  # an inf in exp_avg_sq element 5
DEEPSPEED = Path(__file__).resolve().parent / "data" / "deepspeed"


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train_plain(model: nn.Module, steps: int = 3) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def plant_state_dict(sd: dict[str, torch.Tensor], key: str = PLANT_WEIGHT) -> None:
    with torch.no_grad():
        sd[key][1, 2] = float("nan")


def plant_optimizer(osd: dict, index: int) -> None:
    osd["state"][index]["exp_avg_sq"].view(-1)[5] = float("inf")


# ---------------------------------------------------------------------------- plain files
def make_plain(out: Path) -> dict[str, Path]:
    """torch.save(state_dict), .safetensors, and a hand-rolled {model, optimizer, scaler,
    step} dict whose GradScaler (the real one) collapsed on persistent inf gradients."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model = mlp()
    opt = _train_plain(model)
    paths = {}
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(sd, out / "model.pt")
    save_file(sd, str(out / "model.safetensors"))
    bad = {k: v.clone() for k, v in sd.items()}
    plant_state_dict(bad)
    torch.save(bad, out / "model-nan.pt")
    save_file(bad, str(out / "model-nan.safetensors"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    torch.save(
        {"model": sd, "optimizer": opt.state_dict(), "scaler": scaler.state_dict(), "step": 3},
        out / "train_state.pt",
    )
    # the same loop later: every gradient inf, GradScaler skips and halves 24 times
    for _ in range(24):
        loss = model(torch.full((4, 8), float("inf"))).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    torch.save(
        {"model": sd, "optimizer": opt.state_dict(), "scaler": scaler.state_dict(), "step": 27},
        out / "train_state-collapsed.pt",
    )
    for name in ("model.pt", "model-nan.pt", "model.safetensors", "model-nan.safetensors"):
        paths[name] = out / name
    paths["train_state.pt"] = out / "train_state.pt"
    paths["train_state-collapsed.pt"] = out / "train_state-collapsed.pt"
    return paths


# ---------------------------------------------------------------------------- Hugging Face
def make_hf(out: Path, *, lr: float = 1e-3, steps: int = 4) -> Path:
    """A Trainer run of a tiny BertForMaskedLM (use_cpu=True): output_dir with checkpoint-N."""
    from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

    cfg = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {
                "input_ids": ids,
                "attention_mask": torch.ones(8, dtype=torch.long),
                "labels": ids,
            }

    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        max_steps=steps,
        per_device_train_batch_size=4,
        save_steps=steps // 2,
        logging_steps=1,
        report_to=[],
        learning_rate=lr,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=Tokens()).train()
    return out


def plant_hf(src: Path, dest: Path) -> Path:
    """A copy of an output_dir whose newest checkpoint got a NaN in one weight (safetensors) and
    an inf in that weight's Adam second moment (optimizer.pt)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    ckpt = max(dest.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    weights = load_file(str(ckpt / "model.safetensors"))
    name = "bert.encoder.layer.0.intermediate.dense.weight"
    weights[name][1, 2] = float("nan")
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    osd = torch.load(ckpt / "optimizer.pt", weights_only=True)
    pid = hf_index(ckpt, name)
    osd["state"][pid]["exp_avg_sq"].view(-1)[5] = float("inf")
    torch.save(osd, ckpt / "optimizer.pt")
    return dest


def hf_index(ckpt: Path, name: str) -> int:
    """The optimizer index of a parameter, as the Trainer groups them (decay, then no decay),
    computed with transformers' own helper, independently of ampctl."""
    from transformers import AutoConfig, AutoModelForMaskedLM
    from transformers.trainer_pt_utils import get_parameter_names

    model = AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(str(ckpt)))
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = set(get_parameter_names(model, [nn.LayerNorm], patterns))
    named = [n for n, p in model.named_parameters() if p.requires_grad]
    order = [n for n in named if n in decay] + [n for n in named if n not in decay]
    return order.index(name)


# ---------------------------------------------------------------------------- Accelerate
def make_accelerate(out: Path, *, plant: bool = False) -> Path:
    from accelerate import Accelerator

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        acc.backward(model(torch.randn(4, 8, generator=g)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    if plant:
        with torch.no_grad():
            model[0].weight[1, 2] = float("nan")
        opt.state[model[2].weight]["exp_avg_sq"].view(-1)[5] = float("inf")
    acc.save_state(str(out))
    return out


# ---------------------------------------------------------------------------- Lightning
def make_lightning(out: Path) -> Path:
    """Trainer.fit of a LightningModule wrapping the MLP, CSVLogger: version_0/ with a .ckpt and
    metrics.csv."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, _i):
            (x,) = batch
            loss = self.net(x).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(
        torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    )
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        default_root_dir=str(out),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=pl.loggers.CSVLogger(str(out)),
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    return out / "lightning_logs" / "version_0"


def plant_lightning(version: Path, dest: Path) -> Path:
    shutil.copytree(version, dest)
    ckpt = next(dest.rglob("*.ckpt"))
    obj = torch.load(ckpt, weights_only=True)
    plant_state_dict(obj["state_dict"], "net.0.weight")
    plant_optimizer(obj["optimizer_states"][0], 2)
    torch.save(obj, ckpt)
    rows = (dest / "metrics.csv").read_text().splitlines()
    rows.append(rows[-1].split(",")[0] + ",4,nan")  # the next logged loss: NaN
    (dest / "metrics.csv").write_text("\n".join(rows) + "\n")
    return dest


# ---------------------------------------------------------------------------- DCP
def make_dcp(out: Path, *, plant: bool = False) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = mlp()
    opt = _train_plain(model)
    if plant:
        with torch.no_grad():
            model[0].weight[1, 2] = float("nan")
        opt.state[model[2].weight]["exp_avg_sq"].view(-1)[5] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": 3}, checkpoint_id=str(out))
    return out


def main(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    make_plain(root / "plain")
    make_hf(root / "hf")
    plant_hf(root / "hf", root / "hf-nan")
    make_hf(root / "hf-diverged", lr=1e6, steps=6)
    make_accelerate(root / "accelerate")
    make_accelerate(root / "accelerate-nan", plant=True)
    version = make_lightning(root / "lightning")
    plant_lightning(version, root / "lightning-nan")
    make_dcp(root / "dcp")
    make_dcp(root / "dcp-nan", plant=True)
    shutil.copytree(DEEPSPEED, root / "deepspeed", dirs_exist_ok=True)
    print(json.dumps(sorted(str(p.relative_to(root)) for p in root.iterdir())))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
