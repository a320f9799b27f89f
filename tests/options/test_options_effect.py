"""Every option takes effect: each test fails when a stage silently ignores the options it names.

Issue 13 found options that were accepted, validated and recorded, then ignored. These tests
hold the options no other test caught to the standard "fails when ignored", each against an
independent truth: a count of steps or rows, a closed form of the first AdamW step, a tensor
shape seen by the model, a file the option must write. tests/audit/mutate_options.py checks the
claim (it makes each option ignored in turn and runs the tests mapped to it in
tests/audit/option_tests.py); docs/options.md has the table.

Runs are tiny (two-layer models, a few rows, 1-5 steps) and in process.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from safetensors.torch import load_file

from tether.errors import TetherError
from tether.train import dpo, reward, sft
from tether.train.offline_config import DPOConfig, RMConfig, SFTConfig

OFFLINE = {"sft": (SFTConfig, sft.run, sft_rows), "rm": (RMConfig, reward.run, preference_rows),
           "dpo": (DPOConfig, dpo.run, preference_rows)}


# sequences in one forward for n rows: rm scores chosen and rejected as two sequences each; dpo
# writes a pair as one row [prompt | chosen | rejected] (share_prompt)
ROWS_PER_FORWARD = {"sft": lambda n: n, "rm": lambda n: 2 * n, "dpo": lambda n: n}


def offline_run(stage, model_dir, tmp_path, n_rows=8, name="r", rows=None, **overrides):
    """Run one offline stage in process on `n_rows` rows; returns (result, run directory)."""
    cls, run, make_rows = OFFLINE[stage]
    data = write_jsonl(tmp_path / f"{stage}-{name}.jsonl", rows if rows is not None else make_rows(n_rows))
    values = dict(run_name=name, output_dir=str(tmp_path / "runs"), model=str(model_dir),
                  data=str(data), batch_size=2, max_steps=1, device="cpu", save_every=0,
                  report_to="none", lr=1e-3)
    if stage == "rm":
        values["eval_fraction"] = 0.0  # every row trains: step counts are rows / batch
    values.update(overrides)
    result = run(cls(**values))
    return result, tmp_path / values["output_dir"] / values["run_name"]


def train_lines(run_dir):
    """The training lines of metrics.jsonl (rm also writes its final evaluation as a line)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "train/loss" in m]


def logged_steps(run_dir):
    return [m["step"] for m in train_lines(run_dir)]


def final_metrics(run_dir):
    """Every metric of the run, the last value of each."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        out |= json.loads(line)
    return out


class ModelCalls:
    """Global forward hooks: what every module saw while installed.

    `token_inputs`: shapes of the inputs of the largest embedding (the token embedding), i.e.
    [rows, tokens] of every forward; `dtypes`: dtypes of every module's tensor output;
    `vocab_shapes`: shapes of outputs shaped [N, T, V] (logits, V the token embedding's size);
    `layers`: the transformer layers that ran.
    """

    def __init__(self):
        self.token_inputs, self.dtypes, self.vocab_shapes, self.layers = [], set(), [], {}
        self.vocab = 0

    @property
    def full_logits(self) -> int:
        """Logits of a batch at many positions: [N, T, V] with N >= 2 and T > 1 (not tether's
        one-row probe of the trunk/head split, nor a rollout's one position per step)."""
        return sum(1 for n, t, _ in self.vocab_shapes if n >= 2 and t > 1)

    def hook(self, module, args, output):
        if isinstance(module, torch.nn.Embedding) and module.num_embeddings >= self.vocab:
            if module.num_embeddings > self.vocab:
                self.vocab, self.token_inputs = module.num_embeddings, []
            self.token_inputs.append(tuple(args[0].shape))
        if isinstance(output, torch.Tensor):
            self.dtypes.add(output.dtype)
            if output.dim() == 3 and output.shape[-1] == self.vocab:
                self.vocab_shapes.append(tuple(output.shape))
        if type(module).__name__ in ("GPT2Block", "LlamaDecoderLayer"):
            self.layers[id(module)] = module

    def __enter__(self):
        self.handle = torch.nn.modules.module.register_module_forward_hook(self.hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def trunk_moves(base_dir, final_dir):
    """{name: (before, after)} of every weight in final/ that the starting model also has (the
    reward model saves its trunk without the LM's `transformer.`/`model.` prefix)."""
    before, after = load_file(base_dir / "model.safetensors"), load_file(final_dir / "model.safetensors")
    pairs = {}
    for name, tensor in after.items():
        for prefix in ("", "transformer.", "model."):
            if prefix + name in before and before[prefix + name].shape == tensor.shape:
                pairs[name] = (before[prefix + name], tensor)
                break
    assert pairs
    return pairs


# ----------------------------------------------------------------------------- run bookkeeping

@pytest.mark.parametrize("stage", list(OFFLINE))
def test_where_when_and_what_a_run_writes(stage, tiny_model_dir, tmp_path):
    # run_name, output_dir, max_steps, log_every, save_every, report_to, on 12 rows of batch 2
    # (an epoch would be 6 steps): 5 steps, lines at 2, 4 and the last, one checkpoint at 3
    _, run_dir = offline_run(stage, tiny_model_dir, tmp_path, n_rows=12, name="named",
                             output_dir=str(tmp_path / "elsewhere"), max_steps=5, log_every=2,
                             save_every=3, report_to="none")
    assert run_dir == tmp_path / "elsewhere" / "named" and (run_dir / "final").is_dir()
    assert logged_steps(run_dir) == [2, 4, 5]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3"]
    assert not (run_dir / "tb").exists()  # report_to none: no TensorBoard events


@pytest.mark.parametrize("stage", list(OFFLINE))
def test_epochs_batch_size_and_split_count_steps(stage, tiny_model_dir, tmp_path):
    import datasets

    make_rows = OFFLINE[stage][2]
    data = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(make_rows(12)),
                          "small": datasets.Dataset.from_list(make_rows(4, seed=1))}).save_to_disk(str(data))
    # 4 rows of split "small", batch 2 (a forward of 2 rows, 4 sequences for rm), 2 epochs: 4 steps
    with ModelCalls() as calls:
        _, run_dir = offline_run(stage, tiny_model_dir, tmp_path, data=str(data), split="small",
                                 epochs=2, max_steps=0, batch_size=2, log_every=1)
    assert logged_steps(run_dir) == [1, 2, 3, 4]
    assert max(shape[0] for shape in calls.token_inputs) == ROWS_PER_FORWARD[stage](2)


@pytest.mark.parametrize("stage", list(OFFLINE))
def test_seed_reproduces_bit_for_bit_and_another_seed_differs(stage, tiny_model_dir, tmp_path):
    finals = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        _, run_dir = offline_run(stage, tiny_model_dir, tmp_path, n_rows=8, name=name, seed=seed,
                                 max_steps=2)
        finals[name] = load_file(run_dir / "final" / "model.safetensors")
    assert all(torch.equal(finals["a"][k], finals["b"][k]) for k in finals["a"])
    assert any(not torch.equal(finals["a"][k], finals["c"][k]) for k in finals["a"])


# ----------------------------------------------------------------------------- optimisation

@pytest.mark.parametrize("stage", list(OFFLINE))
def test_first_adamw_step_moves_each_weight_by_lr_times_warmup(stage, tiny_model_dir, tmp_path):
    # AdamW's first step is lr * m/(sqrt(v)+eps) with m = g, v = g^2 after bias correction: each
    # weight with a gradient moves by lr * |g|/(|g| + 1e-8), i.e. lr to ~1e-4, whatever g is.
    # warmup_steps 4: the first step runs at lr / 4 (linear warm-up from 0, step 1 of 4).
    lr = 2e-3
    _, run_dir = offline_run(stage, tiny_model_dir, tmp_path, lr=lr, warmup_steps=4, max_steps=1,
                             max_grad_norm=0.0, lr_schedule="constant")
    moves = [(after - before).abs().max().item()
             for before, after in trunk_moves(tiny_model_dir, run_dir / "final").values()]
    assert max(moves) == pytest.approx(lr / 4, rel=1e-2)


@pytest.mark.parametrize("stage", list(OFFLINE))
def test_weight_decay_shrinks_matrices_by_lr_times_decay(stage, tiny_model_dir, tmp_path):
    # AdamW (Loshchilov & Hutter 2019): p <- p - lr*wd*p - lr*adam(g); the gradient step is the
    # same with and without decay on step 1, so the difference of the two runs is -lr*wd*p0 on
    # matrices and 0 on biases and norms (tether decays matrices only)
    lr, wd = 1e-3, 0.5
    finals = {}
    for name, decay in (("plain", 0.0), ("decayed", wd)):
        _, run_dir = offline_run(stage, tiny_model_dir, tmp_path, name=name, lr=lr, weight_decay=decay)
        finals[name] = trunk_moves(tiny_model_dir, run_dir / "final")
    n_matrices = 0
    for name, (before, plain) in finals["plain"].items():
        diff = finals["decayed"][name][1] - plain
        expected = -lr * wd * before if before.dim() >= 2 else torch.zeros_like(before)
        torch.testing.assert_close(diff, expected, atol=1e-6, rtol=0)
        n_matrices += before.dim() >= 2
    assert n_matrices


@pytest.mark.parametrize("stage", list(OFFLINE))
def test_max_grad_norm_clips_the_update(stage, tiny_model_dir, tmp_path):
    # clipped to a norm of 1e-12, every |g| << Adam's eps (1e-8): the first step shrinks from
    # lr per weight to at most lr * 1e-4
    lr = 1e-3
    _, run_dir = offline_run(stage, tiny_model_dir, tmp_path, lr=lr, max_grad_norm=1e-12)
    moves = [(after - before).abs().max().item()
             for before, after in trunk_moves(tiny_model_dir, run_dir / "final").values()]
    assert max(moves) < lr * 1e-3


@pytest.mark.parametrize("stage", list(OFFLINE))
def test_lr_schedule_after_warmup_by_hand(stage, tiny_model_dir, tmp_path):
    # 5 steps, warm-up 2, cosine: after step s the lr is lr * factor(s), factor = (s+1)/2 while
    # s < 2, then 0.5 * (1 + cos(pi * (s-2)/3))
    lr = 1e-3
    _, run_dir = offline_run(stage, tiny_model_dir, tmp_path, n_rows=10, lr=lr, max_steps=5,
                             warmup_steps=2, lr_schedule="cosine", log_every=1)
    logged = [m["train/lr"] for m in train_lines(run_dir)]
    expected = [1.0, 1.0, 0.75, 0.25, 0.0]
    assert logged == pytest.approx([lr * f for f in expected], abs=1e-12)


@pytest.mark.parametrize("stage", list(OFFLINE))
def test_grad_accum_steps_splits_each_batch(stage, tiny_model_dir, tmp_path):
    # batch 4 in 2 micro-batches: every forward sees 2 rows, not 4
    with ModelCalls() as calls:
        offline_run(stage, tiny_model_dir, tmp_path, batch_size=4, grad_accum_steps=2, max_steps=2)
    assert max(shape[0] for shape in calls.token_inputs) == ROWS_PER_FORWARD[stage](2)


# ----------------------------------------------------------------------------- model and memory

@pytest.mark.parametrize("stage", list(OFFLINE))
def test_max_length_truncates_to_exactly_that_many_tokens(stage, tiny_model_dir, tmp_path):
    long = " ".join(["the movie was fine"] * 12)
    rows = ([{"prompt": "it", "response": " " + long}] * 4 if stage == "sft" else
            [{"prompt": "it", "chosen": " " + long + " great.", "rejected": " " + long}] * 4)
    with ModelCalls() as calls:
        offline_run(stage, tiny_model_dir, tmp_path, rows=rows, max_length=12,
                    **({"share_prompt": False} if stage == "dpo" else {}))
    assert max(shape[1] for shape in calls.token_inputs) == 12


@pytest.mark.parametrize("stage", list(OFFLINE))
def test_on_long_prompt_skip_drops_the_row_instead_of_stopping(stage, tiny_model_dir, tmp_path):
    rows = OFFLINE[stage][2](4)
    rows.append({**rows[0], "prompt": " ".join(["the movie was fine"] * 12)})
    with pytest.raises(TetherError, match="prompt"):
        offline_run(stage, tiny_model_dir, tmp_path, name="e", rows=rows, max_length=40)
    _, run_dir = offline_run(stage, tiny_model_dir, tmp_path, name="s", rows=rows, max_length=40,
                             on_long_prompt="skip")
    assert final_metrics(run_dir)["data/skipped_long_prompt"] == 1


def test_cosine_by_hand_is_what_the_test_expects():
    # the expected factors above, from the formula, so a typo in them cannot pass silently
    factors = [(s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / 3)) for s in range(1, 6)]
    assert factors == pytest.approx([1.0, 1.0, 0.75, 0.25, 0.0])


@pytest.mark.parametrize("stage", list(OFFLINE))
def test_lr_and_max_length_on_the_llama_style_model(stage, tiny_llama_dir, tmp_path):
    # the two closed forms above on a Llama-style model (BOS-adding tokenizer, untied head):
    # no forward sees more than max_length, and the first AdamW step moves a weight by
    # lr * |g| / (|g| + 1e-8): never more than lr, and close to it (its gradients here are
    # smaller than GPT-2's, so the largest move is 0.66-0.97 lr, not ~lr)
    long = " ".join(["the movie was fine"] * 12)
    rows = ([{"prompt": "it", "response": " " + long}] * 4 if stage == "sft" else
            [{"prompt": "it", "chosen": " " + long + " great.", "rejected": " " + long}] * 4)
    with ModelCalls() as calls:
        _, run_dir = offline_run(stage, tiny_llama_dir, tmp_path, rows=rows, lr=2e-3, max_length=12,
                                 max_grad_norm=0.0, **({"share_prompt": False} if stage == "dpo" else {}))
    assert max(shape[1] for shape in calls.token_inputs) == 12
    moves = [(after - before).abs().max().item()
             for before, after in trunk_moves(tiny_llama_dir, run_dir / "final").values()]
    assert 2e-3 / 2 < max(moves) <= 2e-3 * (1 + 1e-6)
