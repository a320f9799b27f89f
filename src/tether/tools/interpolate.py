"""`tether interpolate --from SFT --to RL --points 0,0.5,1 --output-dir D`: the models on the
straight line from an SFT model to an RL model trained from it, and (with --prompts) the
reward-KL curve they trace.

    theta(eta) = theta_SFT + eta (theta_RL - theta_SFT),    0 <= eta <= 1

WiSE-FT (Wortsman et al. 2022, "Robust fine-tuning of zero-shot models") interpolates the
weights of a fine-tuned model with those of its start; WARP (Rame et al. 2024, "WARP: On the
Benefits of Weight Averaged Rewarded Policies", its LITI step) does the same from the SFT model
to an RL policy, where the points trace a reward-KL front. Every tensor is interpolated in
float32 and stored in --to's dtype; eta 0 and 1 are the end tensors themselves, bit for bit; a
non-float tensor is --to's.

A LoRA policy (--to an adapter whose base is --from) differs from its start by s B A in each
adapted layer (s = alpha / r; Hu et al. 2021, eq. 3), so theta(eta) is the same adapter with
every B scaled by eta: s (eta B) A = eta s B A. Each point is then an adapter on --from, not a
merged copy.

    checks, before any weight loads (one line each)  `check_inputs`: safetensors weights, one
                                                     architecture and the same tensor shapes
                                                     (config.json, the safetensors headers), an
                                                     adapter's base is --from, D new or empty
    D/eta<point>/ per point, as --to's files are     `write_points` (each written atomically)
    each point evaluated as `tether eval` does       tools.evaluate.run, reference --from:
                                                     D/eta<point>.eval.json beside it
    D/interpolate.json: [{eta, path, metrics...}]    and a table on stdout
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tether.data.rows import load_rows
from tether.errors import TetherError
from tether.models.adapter_checks import check_adapter_files, read_json
from tether.models.base_location import write_json, write_location
from tether.models.lora import adapter_base, is_adapter
from tether.models.saving import atomic_dir
from tether.run.config import section
from tether.run.launch import resolve_device
from tether.tools import evaluate
from tether.tools.config import EvalConfig, InterpolateConfig


def interpolated(sft: torch.Tensor, rl: torch.Tensor, eta: float) -> torch.Tensor:
    """theta_SFT + eta (theta_RL - theta_SFT) for one tensor (any shape, the same for both), in
    float32, stored in `rl`'s dtype; at eta 0 and 1 the end tensor itself; a non-float one `rl`."""
    if eta == 1 or not rl.is_floating_point():
        return rl
    if eta == 0:
        return sft
    return (sft.float() + eta * (rl.float() - sft.float())).to(rl.dtype)


def signature(model_dir: Path, flag: str) -> dict:
    """A full model's config.json `model_type` and `architectures`, then each tensor's name ->
    shape, from the safetensors headers (no weight is read)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TetherError(f"{flag} {model_dir} holds no safetensors weights; give a local model")
    config = read_json(model_dir / "config.json", "give full models or --to an adapter on --from")
    out = {key: config.get(key) for key in ("model_type", "architectures")}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out |= {name: f.get_slice(name).get_shape() for name in f.keys()}
    return out


def grown(sft_shape, rl_shape) -> bool:
    """Whether --to's tensor is --from's with rows added: the pad token tether adds to a
    tokenizer without one (models.pretrained.grow_embeddings), on the embeddings' first dim."""
    return (isinstance(sft_shape, list) and isinstance(rl_shape, list) and len(sft_shape) > 0
            and sft_shape[1:] == rl_shape[1:] and sft_shape[0] < rl_shape[0])


def check_inputs(cfg: InterpolateConfig) -> bool:
    """Refuse, in one line and before any weight loads, what cannot be interpolated or written
    (the module docstring's list); returns whether --to is a LoRA adapter."""
    sft, rl, out = Path(cfg.reference), Path(cfg.model), Path(cfg.output_dir)
    start = signature(sft, "--from")
    if is_adapter(rl):
        check_adapter_files(rl)
        if Path(adapter_base(rl)).resolve() != sft.resolve():
            raise TetherError(f"--to {rl} is a LoRA adapter on {adapter_base(rl)}, not on --from "
                              f"{sft}; give --from the base it was trained on")
    else:
        end = signature(rl, "--to")
        for key in (k for k in start | end if start.get(k) != end.get(k)
                    and not grown(start.get(k), end.get(k))):
            raise TetherError(f"--from and --to differ in {key} ({start.get(key)} and "
                              f"{end.get(key)}); give two models of one architecture and shapes")
    if any(out.iterdir() if out.is_dir() else ()) or any(
            out.resolve().is_relative_to(p.resolve()) for p in (sft, rl)):
        raise TetherError(f"--output-dir {out} must be new or empty, outside --from and --to")
    if cfg.prompts:  # what evaluating the points reads first: before any point is written
        resolve_device(cfg.device)
        load_rows(cfg.prompts)
    return is_adapter(rl)


def write_points(cfg: InterpolateConfig, lora: bool) -> list[dict]:
    """Each point's model, D/eta<point>/: --to's files with every weight interpolated (a LoRA
    adapter: B scaled, the rest as is, --from recorded as its base); [{eta, path}]."""
    sft_dir, rl_dir = Path(cfg.reference), Path(cfg.model)
    rl = {file.name: load_file(file) for file in sorted(rl_dir.glob("*.safetensors"))}
    # a LoRA line starts at the adapter with B = 0, which adds nothing to --from
    sft = {n: torch.zeros_like(t) if "lora_B" in n or "lora_embedding_B" in n else t
           for tensors in rl.values() for n, t in tensors.items()} if lora else {
        n: t for file in sorted(sft_dir.glob("*.safetensors")) for n, t in load_file(file).items()}
    for tensors in rl.values():  # --from as tether loads it for --to's tokenizer: new rows at
        for n, t in tensors.items():  # the mean row (grow_embeddings)
            if sft[n].shape[0] < t.shape[0]:
                added = t.shape[0] - sft[n].shape[0]  # a bias's rows too: any rank
                mean = sft[n].mean(0, keepdim=True)
                sft[n] = torch.cat([sft[n], mean.expand(added, *t.shape[1:])])
    rows = []
    for eta in cfg.points:
        path = Path(cfg.output_dir) / f"eta{str(eta).removesuffix('.0')}"
        with atomic_dir(path) as tmp:  # config, tokenizer, adapter config, base record
            shutil.copytree(rl_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors"),
                            dirs_exist_ok=True)
            for name, tensors in rl.items():
                save_file({n: interpolated(sft[n], t, eta) for n, t in tensors.items()},
                          str(tmp / name), metadata={"format": "pt"})
            if lora:
                write_location(tmp, str(sft_dir), home=path)
        rows.append({"eta": eta, "path": str(path)})
    return rows


def run(cfg: InterpolateConfig) -> list[dict]:
    """Write every point and, with --prompts, evaluate each against --from; returns
    D/interpolate.json's rows: {eta, path} and `tether eval`'s metrics."""
    rows = write_points(cfg, check_inputs(cfg))
    for row in rows if cfg.prompts else []:
        point = section(EvalConfig, cfg, model=row["path"], base="", output="")
        row |= evaluate.run(point).metrics
    write_json(Path(cfg.output_dir) / "interpolate.json", rows, indent=1)
    return rows


def cli(argv: list[str]) -> int:
    """`tether interpolate --from SFT --to RL --points 0,0.5,1 --output-dir D [--prompts P ...]`."""
    from tether.run.parse import parse_config

    rows = run(parse_config(InterpolateConfig, argv, prog="tether interpolate"))
    for name in [name for name in rows[0] if name != "path"]:  # a column per point
        print(f"{name:<24}" + "".join(f"{row[name]:>10.4f}" for row in rows))
    print(f"written to {Path(rows[0]['path']).parent}")
    return 0
