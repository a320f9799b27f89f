"""Peak memory of one PPO batch: tether's full fine-tuning and LoRA configurations against TRL.

    python bench/scale/memory.py            # 125M GPT-2, batch 8, 256 tokens; the bench extra
    python bench/scale/memory.py --configs full,trl --layers 2 --seq-len 64   # a quick run

The workload, the same for every configuration: a ~125M-parameter GPT-2-style policy (GPT2Config
n_layer 12, n_embd 768, n_head 12, vocabulary 50257, random weights built from the config) with a
local BPE tokenizer (~2k tokens, pad included, so no embedding is resized); a reward model and a
SEPARATE critic of the same size; one rollout batch of `--batch-size` prompts of exactly
seq_len - response_len tokens, each answered by exactly `--response-len` sampled tokens
(temperature 1, no top-k/top-p); scoring (policy, reference, critic, reward); `--epochs` PPO
epochs over minibatches of `--minibatch-size` rows (the default 4 gives two optimizer steps, so
the second step's forward and backward run with the AdamW states already allocated); fp32, AdamW.

Equal response lengths: EOS and pad can never be sampled. GPT-2 ties its LM head to the token
embeddings, so the builder sets ln_f's bias to +8 on hidden unit 0 and the EOS and pad embeddings
to -8 there: their logits sit ~64 nats below every other token's. TRL gets no stop token
(`stop_token=None`), so both sides generate `--response-len` tokens per prompt (checked: the
largest LM-head output of each run is printed).

Configurations (each in a fresh subprocess):
  full             tether, full fine-tuning, chunked_lm_head=False (plain [B, R, V] logits)
  lora             tether, lora_r > 0: policy, reference (adapter off), critic (adapter + value
                   head) and reward model (adapter) on one frozen base; chunked_lm_head=False
  lora_chunked     + chunked_lm_head=True
  lora_chunked_gc  + gradient_checkpointing=True
  trl              TRL 1.12 experimental PPOTrainer: policy, reference, reward and value as four
                   separate models (its only layout with a value model); bf16=False,
                   gradient_checkpointing=False (its PPOTrainer never enables it anyway)
  full_chunked     (extra, not in the default list) full fine-tuning with the chunked head
  full_gc          (extra) full fine-tuning with gradient checkpointing, plain head

A tether configuration whose feature is not active in the installed tether (LoRA trains
everything, the base is held more than once, a [B, R, V] logits tensor is still built, no
transformer layer is checkpointed) prints "not measurable" and why, instead of a number; see
memory_probe.py for how each is observed. The LoRA configurations use a reward model written by
`tether rm` with the same `lora_r` (one step on 8 pairs): the adapter format tether's LoRA PPO reads.

Memory: peak RSS = the child's ru_maxrss (VmHWM); "above imports" = peak RSS - RSS after the
child imported torch, transformers, peft, tether (and trl for TRL) and before it loads anything.
Children run with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave RSS at once (glibc otherwise
keeps growing its heap threshold and freed blocks stay resident, see bench/kernels/logprobs.py). With
CUDA, torch.cuda.max_memory_allocated is reported too. Ratios are to TRL's figure of the same kind.

TRL is not a tether dependency: run with the venv that has the `bench` extra (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# tether first, before transformers, TRL or vLLM (here or in what this imports): in a venv
# with the vllm extra it hides the torchvision built for another torch before transformers
# looks for it (tether.hide_mismatched_extensions; tests/bench/test_bench_import_order.py holds the rule).
import tether  # noqa: F401

BENCH = Path(__file__).resolve().parent
CONFIGS = {  # name: (label, tether fields or None for TRL)
    "full": ("tether full fine-tuning", {"lora": False, "chunked_lm_head": False,
                                         "gradient_checkpointing": False}),
    "lora": ("tether LoRA, shared base", {"lora": True, "chunked_lm_head": False,
                                          "gradient_checkpointing": False}),
    "lora_chunked": ("+ chunked LM head", {"lora": True, "chunked_lm_head": True,
                                           "gradient_checkpointing": False}),
    "lora_chunked_gc": ("+ gradient checkpointing", {"lora": True, "chunked_lm_head": True,
                                                     "gradient_checkpointing": True}),
    "trl": ("TRL 1.12 PPOTrainer", None),
    "full_chunked": ("tether full FT, chunked head", {"lora": False, "chunked_lm_head": True,
                                                      "gradient_checkpointing": False}),
    "full_gc": ("tether full FT, checkpointing", {"lora": False, "chunked_lm_head": False,
                                                  "gradient_checkpointing": True}),
}
DEFAULT_CONFIGS = "full,lora,lora_chunked,lora_chunked_gc,trl"
WORDS = ("the movie was good bad great awful fine dull fun boring plot actor scene film story "
         "music ending long short loved hated it and but very quite slow fast sharp warm cold "
         "bright dark funny sad brave quiet loud river mountain window garden kitchen teacher "
         "student doctor engine rocket planet ocean forest summer winter autumn spring").split()


# ----------------------------------------------------------------------------- building (parent)

def texts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def build_policy(root: Path, args) -> tuple[Path, int]:
    """Tokenizer (pad included) + GPT-2-style LM from its config; returns (dir, parameter count)."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from tether.models.pretrained import PAD_TOKEN
    from tether.models.tiny import make_tokenizer

    tokenizer = make_tokenizer(texts(2000, 12), vocab_size=min(4096, args.vocab - 1))
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    assert len(tokenizer) <= args.vocab, "the tokenizer must fit the model's vocabulary"
    config = GPT2Config(vocab_size=args.vocab, n_layer=args.layers, n_embd=args.width,
                        n_head=args.heads, n_positions=max(1024, args.seq_len),
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # EOS and pad are never sampled (module docstring)
        model.transformer.ln_f.bias[0] = 8.0
        for token in (tokenizer.eos_token_id, tokenizer.pad_token_id):
            model.transformer.wte.weight[token, 0] = -8.0
    out = root / "policy"
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def build_reward_models(root: Path, policy_dir: Path, lora_r: int, need_lora: bool,
                        need_full: bool, device: str) -> dict[str, Path]:
    """A full reward model (TRL, tether full FT) and, for LoRA, one written by `tether rm`."""
    from tether.models.pretrained import load_tokenizer
    from tether.models.reward_model import RewardModel

    out: dict[str, Path] = {}
    if need_full:
        tokenizer = load_tokenizer(str(policy_dir))
        rm = RewardModel.from_causal_lm(str(policy_dir), tokenizer)
        out["full"] = rm.save_pretrained(root / "rm-full", tokenizer)
        del rm
    if need_lora:
        from tether.train.reward import RMConfig, run

        pairs = root / "pairs.jsonl"
        rows = zip(texts(8, 6, 1), texts(8, 4, 2), texts(8, 4, 3))
        pairs.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n"
                                 for p, c, r in rows))
        cfg = RMConfig(run_name="rm-lora", output_dir=str(root / "runs"), model=str(policy_dir),
                       data=str(pairs), max_steps=1, batch_size=8, eval_fraction=0.0,
                       save_every=0, lora_r=lora_r, device=device, max_length=64)
        out["lora"] = Path(run(cfg).output_path)
    return out


def write_prompts(root: Path, prompt_len: int, n: int) -> Path:
    """Prompts longer than `prompt_len` tokens; both sides keep their last `prompt_len` tokens."""
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts(n, prompt_len, 4)))
    return path


# ----------------------------------------------------------------------------- children

def _probe(spec: dict):
    sys.path.insert(0, str(BENCH))
    from memory_probe import Probe

    fields = spec["fields"]

    def check(report: dict) -> str:  # stop a tether run early when its feature is not there
        return "; ".join(feature_problems(fields, report, spec, final=False))

    return Probe(spec["vocab"], spec["base_params"],
                 check=check if fields is not None else None).install()


def _after_imports(spec: dict) -> dict[str, float]:
    import torch
    from memory_probe import status_mib

    torch.set_num_threads(spec["threads"])
    if spec["device"].startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    return {"baseline_mib": status_mib("VmRSS"), "started": time.perf_counter()}


def _finish(spec: dict, probe, start: dict, extra: dict) -> None:
    import torch
    from memory_probe import peak_rss_mib

    peak = peak_rss_mib()
    result = {"peak_rss_mib": peak, "baseline_mib": start["baseline_mib"],
              "above_imports_mib": peak - start["baseline_mib"],
              "seconds": time.perf_counter() - start["started"], **probe.report(), **extra}
    if spec["device"].startswith("cuda"):
        result["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(result), flush=True)


def child_tether(spec: dict) -> None:
    probe = _probe(spec)
    import peft  # noqa: F401  (LoRA's import cost stays in every tether baseline)

    from tether.train.ppo import PPOConfig, run

    start = _after_imports(spec)
    fields = spec["fields"]
    lora = fields["lora"]
    cfg = PPOConfig(run_name="ppo", output_dir=spec["out"], policy=spec["policy"],
                    reward_model=spec["rm_lora"] if lora else spec["rm_full"],
                    prompts=spec["prompts"], critic="separate", batch_size=spec["batch"],
                    num_minibatches=spec["batch"] // spec["minibatch"], ppo_epochs=spec["epochs"],
                    total_episodes=spec["batch"], max_new_tokens=spec["response_len"],
                    max_prompt_len=spec["prompt_len"], temperature=1.0, beta=0.05, lr=1e-5,
                    max_grad_norm=1.0, save_every=0, sample_every=0, device=spec["device"],
                    lora_r=spec["lora_r"] if lora else 0, lora_alpha=2.0 * spec["lora_r"],
                    chunked_lm_head=fields["chunked_lm_head"],
                    gradient_checkpointing=fields["gradient_checkpointing"])
    from memory_probe import NotMeasurable

    try:
        result = run(cfg)
    except NotMeasurable as exc:  # seen at the first update step; the update is not worth running
        print("RESULT " + json.dumps({"error": str(exc)}), flush=True)
        return
    lines = (Path(spec["out"]) / "ppo" / "metrics.jsonl").read_text().splitlines()
    response_len = json.loads(lines[-1]).get("rollout/response_len", float("nan"))
    _finish(spec, probe, start, {"response_len": response_len,
                                 "lora_adapter_saved": (result.output_path /
                                                        "adapter_config.json").exists()})


def child_trl(spec: dict) -> None:
    probe = _probe(spec)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import datasets
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError as exc:
        print("RESULT " + json.dumps({"error": f"TRL not importable ({exc}); run with the venv "
                                               "that has tether's bench extra"}))
        return
    datasets.disable_progress_bars()
    start = _after_imports(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec["policy"], padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(spec["policy"])
    ref = AutoModelForCausalLM.from_pretrained(spec["policy"])
    # TRL reads rewards and values through a sequence-classification head ("score").
    reward = AutoModelForSequenceClassification.from_pretrained(spec["rm_full"], num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(spec["rm_full"], num_labels=1)
    for model in (reward, value):
        model.config.pad_token_id = tokenizer.pad_token_id
    prompts = [json.loads(x)["prompt"] for x in Path(spec["prompts"]).read_text().splitlines()]
    ids = [tokenizer(p)["input_ids"][-spec["prompt_len"]:] for p in prompts[:spec["batch"]]]
    mb = spec["minibatch"]
    cfg = PPOConfig(output_dir=spec["out"], per_device_train_batch_size=mb,
                    gradient_accumulation_steps=spec["batch"] // mb,
                    num_mini_batches=spec["batch"] // mb, num_ppo_epochs=spec["epochs"],
                    total_episodes=spec["batch"], response_length=spec["response_len"],
                    temperature=1.0, stop_token=None, learning_rate=1e-5, kl_coef=0.05,
                    kl_estimator="k1", vf_coef=0.1, num_sample_generations=0, report_to="none",
                    save_strategy="no", logging_steps=1000, use_cpu=spec["device"] == "cpu",
                    bf16=False, fp16=False, gradient_checkpointing=False, seed=0,
                    dataloader_num_workers=0, disable_tqdm=True, local_rollout_forward_batch_size=mb)
    trainer = PPOTrainer(args=cfg, processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward, value_model=value,
                         train_dataset=datasets.Dataset.from_dict({"input_ids": ids}))
    trainer.train()
    # TRL's update takes logits over every position of [mb, P + R]: the width of its responses.
    width = probe.max_logit_rows / mb - spec["prompt_len"]
    _finish(spec, probe, start, {"response_len": width})


def run_child(name: str, spec: dict, threads: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads),
               TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    # A PYTHONPATH given by the caller wins (to measure another checkout's tether).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""),
                                                      str(BENCH.parents[1] / "src")]))
    cmd = [sys.executable, __file__, "--child", json.dumps({**spec, "name": name})]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"child exited {proc.returncode}: {tail}"}


# ----------------------------------------------------------------------------- verdicts, table

def feature_problems(fields: dict, report: dict, spec: dict, final: bool = True) -> list[str]:
    """Why a run's numbers would not measure what its tether fields ask for ([] when they do).
    `final=False`: called at the first update step, before any layer could be checkpointed."""
    problems = []
    if fields["lora"]:
        share = report["trainable_params"] / spec["base_params"]
        if share >= 0.5:  # full fine-tuning trains >= 1 base (policy alone); adapters a few %
            problems.append(f"LoRA not active ({100 * share:.0f}% of a base's parameters train)")
        elif report["base_copies"] > 1.5:
            problems.append(f"base not shared ({report['base_copies']:.1f} copies resident)")
    full_rows = spec["minibatch"] * spec["response_len"]  # one [mb, R, V] logits tensor
    if fields["chunked_lm_head"] and report["max_logit_rows"] >= full_rows:
        problems.append(f"chunked LM head not active (an LM-head output of "
                        f"{report['max_logit_rows']} rows x V >= [mb, R] = {full_rows})")
    if final and fields["gradient_checkpointing"] and report["layer_checkpoint_calls"] == 0:
        problems.append("gradient checkpointing not active (no transformer layer checkpointed)")
    return problems


def verdict(name: str, r: dict, spec: dict) -> str:
    """'ok', or why this configuration's number would not measure what its name says."""
    if "error" in r:
        return "not measurable: " + r["error"]
    problems = []
    if abs(r["response_len"] - spec["response_len"]) > 1e-6:
        problems.append(f"mean response length {r['response_len']:.1f}, not {spec['response_len']}")
    if CONFIGS[name][1] is not None:
        problems += feature_problems(CONFIGS[name][1], r, spec)
    return ("not measurable: " + "; ".join(problems)) if problems else "ok"


def print_table(results: dict[str, dict], spec: dict) -> None:
    trl = results.get("trl", {})
    trl_ok = "peak_rss_mib" in trl
    gpu = any("cuda_max_allocated_mib" in r for r in results.values())
    head = ("| configuration | peak RSS (MiB) | above imports (MiB) | x TRL (RSS) | x TRL (above) "
            "| base copies | params with requires_grad | largest LM-head output (rows) | s |"
            + (" CUDA max alloc (MiB) | x TRL (CUDA) |" if gpu else ""))
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for name, r in results.items():
        label = f"({list(CONFIGS).index(name) + 1}) {CONFIGS[name][0]}"
        status = verdict(name, r, spec)
        if status != "ok" and (status.startswith("not measurable") or "peak_rss_mib" not in r):
            print(f"| {label} | {status} |" + " |" * (head.count("|") - 3))
            continue
        def ratio(key: str, r: dict = r) -> str:
            return f"{r[key] / trl[key]:.2f}x" if trl_ok and key in r else "n/a"

        row = (f"| {label} | {r['peak_rss_mib']:.0f} | {r['above_imports_mib']:.0f} | "
               f"{ratio('peak_rss_mib')} | {ratio('above_imports_mib')} | {r['base_copies']:.2f} | "
               f"{r['trainable_params'] / 1e6:.2f}M | {r['max_logit_rows']} | {r['seconds']:.0f} |")
        if gpu:
            row += f" {r.get('cuda_max_allocated_mib', float('nan')):.0f} | {ratio('cuda_max_allocated_mib')} |"
        print(row + ("" if status == "ok" else f" ({status})"))
    goal = results.get("lora_chunked")
    if goal and trl_ok and verdict("lora_chunked", goal, spec) == "ok":
        x = goal["above_imports_mib"] / trl["above_imports_mib"]
        print(f"\ngoal: LoRA + shared base + chunked head <= 0.35x TRL's peak (above imports): "
              f"{x:.2f}x -> {'met' if x <= 0.35 else 'NOT met'}")
    else:
        print("\ngoal (LoRA + shared base + chunked head <= 0.35x TRL): not measurable in this run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma list of: {', '.join(CONFIGS)}")
    parser.add_argument("--batch-size", type=int, default=8, help="rollout batch (prompts)")
    parser.add_argument("--minibatch-size", type=int, default=4, help="rows per PPO minibatch")
    parser.add_argument("--epochs", type=int, default=1, help="PPO epochs")
    parser.add_argument("--seq-len", type=int, default=256, help="prompt + response tokens")
    parser.add_argument("--response-len", type=int, default=0, help="0: half of --seq-len")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per child")
    parser.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    parser.add_argument("--json", default="", help="also write the raw results here")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        (child_trl if spec["name"] == "trl" else child_tether)(spec)
        return
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or args.batch_size % args.minibatch_size:
        parser.error(f"unknown configs {unknown}" if unknown
                     else "--minibatch-size must divide --batch-size")
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    response_len = args.response_len or args.seq_len // 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy_dir, base_params = build_policy(root, args)
        need_lora = any(CONFIGS[n][1] and CONFIGS[n][1]["lora"] for n in names)
        need_full = any(not CONFIGS[n][1] or not CONFIGS[n][1]["lora"] for n in names)
        rms = build_reward_models(root, policy_dir, args.lora_r, need_lora, need_full, device)
        spec = {"policy": str(policy_dir), "rm_full": str(rms.get("full", "")),
                "rm_lora": str(rms.get("lora", "")),
                "prompts": str(write_prompts(root, args.seq_len - response_len, args.batch_size)),
                "batch": args.batch_size, "minibatch": args.minibatch_size, "epochs": args.epochs,
                "prompt_len": args.seq_len - response_len, "response_len": response_len,
                "vocab": args.vocab, "layers": args.layers, "width": args.width,
                "base_params": base_params, "lora_r": args.lora_r,
                "threads": args.threads, "device": device}
        print(f"one PPO batch: {base_params / 1e6:.1f}M-parameter GPT-2 ({args.layers} layers, "
              f"width {args.width}, vocab {args.vocab}), batch {args.batch_size}, minibatch "
              f"{args.minibatch_size}, {args.epochs} epoch(s), {spec['prompt_len']} prompt + "
              f"{response_len} response tokens, fp32, {device}, {args.threads} thread(s)",
              flush=True)
        results = {}
        for name in names:
            results[name] = run_child(name, {**spec, "fields": CONFIGS[name][1],
                                             "out": str(root / f"run-{name}")}, args.threads)
            peak = results[name].get("peak_rss_mib")
            print(f"  {name}: {verdict(name, results[name], spec)}"
                  + (f" (peak RSS {peak:.0f} MiB)" if peak is not None else ""), flush=True)
    print()
    print_table(results, spec)
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": spec, "results": results}, indent=1))


if __name__ == "__main__":
    main()
