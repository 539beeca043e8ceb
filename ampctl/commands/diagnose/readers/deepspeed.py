"""DeepSpeed ``save_checkpoint`` folders: ``latest`` + ``global_stepN/`` with
``mp_rank_00_model_states.pt`` (the module's weights, ``global_steps``, ``skipped_steps``,
``ds_config``; with ZeRO stage 0 also the optimizer state) and, with ZeRO stage 1/2,
``*zero_pp_rank_R_mp_rank_00_optim_states.pt`` (flat fp32 master partitions and flat Adam
moments, with DeepSpeed's map of each parameter's slice).

DeepSpeed pickles a few of its own classes into these files (its ``LossScaler``, the ZeRO stage
enum, ``fragment_address``): they are read as inert stand-ins that keep their fields as data
(see :func:`~ampctl.commands.diagnose.readers.base.load_restricted`); nothing of DeepSpeed is
imported or run, and DeepSpeed need not be installed. Any other class is refused.

Checked with DeepSpeed 0.19 on CPU: ZeRO stage 0 (fp32) and stage 2 (bf16), one data-parallel
rank (fp16 needs a GPU in DeepSpeed). With several ranks the flat partitions are checked per rank
and named where DeepSpeed's slice map covers them; ZeRO-3 folders are read for the weights only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ampctl.trust import read_bounded
from ampctl.trust_paths import check_folder_inside

from .base import FileNote, Found, InertObject, NotACheckpoint, float_tensors, load_restricted

__all__ = ["FORMAT_NAME", "claims", "read", "INERT"]

FORMAT_NAME = "deepspeed"
INERT = [
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
]
_STEP = re.compile(r"^global_step(\d+)\Z")
_MODEL = "mp_rank_00_model_states.pt"


def _tags(folder: Path) -> list[Path]:
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if p.is_dir() and (m := _STEP.match(p.name)) and (p / _MODEL).is_file()
    ]
    for _, p in found:  # a tag folder that is a symlink out of the checkpoint folder: refused
        check_folder_inside(p, folder, what="the DeepSpeed tag folder")
    return [p for _, p in sorted(found, reverse=True)]


def claims(path: Path) -> bool:
    if path.is_file():
        return path.name.endswith("model_states.pt")
    return path.is_dir() and ((path / _MODEL).is_file() or bool(_tags(path)))


def read(path: Path) -> Found:
    if path.is_file():
        path = path.parent
    siblings: list[Path] = []
    if not (path / _MODEL).is_file():
        tags = _tags(path)
        latest = path / "latest"
        chosen = None
        if latest.exists() or latest.is_symlink():  # a tag name, read whole under the cap
            name = read_bounded(latest).decode("utf-8", errors="replace").strip()
            chosen = next((t for t in tags if t.name == name), None)
        if not tags:
            raise NotACheckpoint(f"{str(path)!r} holds no global_stepN/{_MODEL}")
        chosen = chosen or tags[0]
        path, siblings = chosen, [t for t in tags if t != chosen]
    else:
        siblings = [t for t in _tags(path.parent) if t != path]
    ms = load_restricted(path / _MODEL, INERT)
    found = Found(format=FORMAT_NAME, path=path, siblings=siblings)
    module = ms.get("module") or {}
    found.weights = float_tensors(module)
    found.files.append(FileNote(_MODEL, True, "module weights, steps, ds_config"))
    found.step = ms.get("global_steps") if isinstance(ms.get("global_steps"), int) else None
    shapes = _param_shapes(ms)
    found.param_orders = (
        [("DeepSpeed param_shapes", shapes)]
        if shapes
        else [("module order", [(k, tuple(v.shape)) for k, v in found.weights.items()])]
    )
    cfg = ms.get("ds_config") if isinstance(ms.get("ds_config"), dict) else {}
    found.precision, found.precision_source = _precision(cfg)
    skipped = ms.get("skipped_steps")
    opt = ms.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("param_groups"), list):
        found.optimizer = opt  # ZeRO stage 0: a torch optimizer state dict
    elif isinstance(opt, dict) and "optimizer_state_dict" in opt:  # fp16/bf16 wrapper, stage 0
        found.optimizer = opt["optimizer_state_dict"]
        _scaler_from(found, opt, skipped)
    for f in sorted(path.glob("*optim_states.pt")):
        _read_zero(found, f, shapes, skipped)
    if found.scaler is None and isinstance(skipped, int):
        found.scaler = {"skipped_steps": skipped, "static": True}
        found.scaler_kind = "deepspeed"
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name not in {n.file for n in found.files}:
            found.files.append(FileNote(f.name, False, "not needed"))
    return found


def _param_shapes(ms: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for group in ms.get("param_shapes") or []:
        if isinstance(group, dict):
            out += [(str(k), tuple(v)) for k, v in group.items()]
    return out


def _precision(cfg: dict[str, Any]) -> tuple[str | None, str | None]:
    for key, name in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        node = cfg.get(key)
        if isinstance(node, dict) and node.get("enabled"):
            return name, f"ds_config.{key}.enabled"
    return "fp32", "ds_config (no fp16/bf16 section)"


def _scaler_from(found: Found, holder: dict[str, Any], skipped: Any) -> None:
    ls = holder.get("loss_scaler")
    fields = ls.fields() if isinstance(ls, InertObject) else {}
    if "cur_scale" in holder:
        fields.setdefault("cur_scale", holder["cur_scale"])
    if not fields:
        return
    fields["dynamic"] = bool(holder.get("dynamic_loss_scale", fields.get("dynamic", False)))
    if isinstance(skipped, int):
        fields["skipped_steps"] = skipped
    found.scaler, found.scaler_kind = fields, "deepspeed"


def _read_zero(
    found: Found, f: Path, shapes: list[tuple[str, tuple[int, ...]]], skipped: Any
) -> None:
    obj = load_restricted(f, INERT)
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if not isinstance(osd, dict):
        found.files.append(FileNote(f.name, False, "no optimizer_state_dict"))
        return
    found.files.append(FileNote(f.name, True, "ZeRO optimizer partitions, loss scaler"))
    _scaler_from(found, osd, skipped)
    shape_of = dict(shapes)
    base = osd.get("base_optimizer_state") or {}
    maps = osd.get("param_slice_mappings") or []
    flat_masters = osd.get("single_partition_of_fp32_groups") or []
    state: dict[str, dict[str, torch.Tensor]] = {}
    masters: list[torch.Tensor] = []
    names: list[str] = []
    rank = f.name
    for g, gstate in (base.get("state") or {}).items():
        mapping = maps[g] if isinstance(g, int) and g < len(maps) else None
        pieces = _slices(mapping, shape_of)
        for key, flat in gstate.items():
            if (
                not isinstance(flat, torch.Tensor)
                or not flat.is_floating_point()
                or flat.dim() == 0
            ):
                continue
            if pieces is None:
                state.setdefault(f"{rank}:group{g}", {})[key] = flat
                continue
            for name, start, numel, shape in pieces:
                state.setdefault(name, {})[key] = flat[start : start + numel].view(shape)
        if pieces is not None and isinstance(g, int) and g < len(flat_masters):
            for name, start, numel, shape in pieces:
                masters.append(flat_masters[g][start : start + numel].view(shape))
                names.append(name)
    if state:
        prior = found.optimizer["state"] if found.optimizer else {}
        state = {**prior, **state}
        groups = base.get("param_groups") or [{}]
        lr = groups[0].get("lr") if isinstance(groups[0], dict) else None
        found.optimizer = {"state": state, "param_groups": [{"params": list(state), "lr": lr}]}
    if masters:
        found.masters = (found.masters or []) + masters
        found.master_names = (found.master_names or []) + names


def _slices(
    mapping: Any, shape_of: dict[str, tuple[int, ...]]
) -> list[tuple[str, int, int, Any]] | None:
    if not isinstance(mapping, dict):
        return None
    out = []
    for name, addr in mapping.items():
        fields = addr.fields() if isinstance(addr, InertObject) else {}
        start, numel = fields.get("start"), fields.get("numel")
        if not isinstance(start, int) or not isinstance(numel, int):
            return None
        shape = shape_of.get(name)
        full = shape is not None and int(torch.Size(shape).numel()) == numel
        out.append((str(name), start, numel, shape if full else (numel,)))
    return out
