import json

import pytest
import torch
from offline_fixtures import sft_rows, write_jsonl
from transformers import AutoModelForCausalLM

from tether.cli import main
from tether.data.batches import collate_sft
from tether.data.encoding import encode_sft
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.train.sft import SFTConfig, run, sft_loss


class LogitsLeaf(torch.nn.Module):
    """Returns fixed logits as a leaf tensor, so the test can read d loss / d logits per position."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"logits": self.logits})()


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
def test_prompt_positions_get_no_gradient(family, request):
    tok = load_tokenizer(str(request.getfixturevalue(family)))
    examples, _ = encode_sft(tok, sft_rows(3), max_length=64)
    batch = collate_sft(examples, tok.pad_token_id)
    n, t = batch["input_ids"].shape
    logits = torch.randn(n, t, len(tok), requires_grad=True)
    loss, n_tokens = sft_loss(LogitsLeaf(logits), batch, chunked=False)  # the plain path
    loss.backward()
    grad_rows = logits.grad.abs().sum(-1)  # [N, T]: nonzero where a position's prediction has loss
    # logits at t predict token t+1: exactly the positions before a response token carry loss
    expected = torch.zeros(n, t)
    expected[:, :-1] = batch["response_mask"][:, 1:].float()
    assert torch.equal(grad_rows > 0, expected.bool())
    # the value is the mean NLL over response tokens, computed here with a plain log_softmax
    logp = torch.log_softmax(logits[:, :-1].detach(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["response_mask"][:, 1:].float()
    assert n_tokens == mask.sum()
    torch.testing.assert_close(loss.detach(), -(logp * mask).sum() / mask.sum())


def _response_nll(model, tok, rows):
    model.eval()
    examples, _ = encode_sft(tok, rows, max_length=64)
    with torch.no_grad():
        loss, _ = sft_loss(model, collate_sft(examples, tok.pad_token_id))
    return loss.item()


@pytest.mark.slow
def test_sft_cli_end_to_end_lowers_response_loss(tiny_model_dir, tmp_path):
    rows = sft_rows(32)
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    code = main(["sft", "--model", str(tiny_model_dir), "--data", str(data), "--run-name", "s",
                 "--output-dir", str(tmp_path / "runs"), "--max-steps", "25", "--batch-size", "8",
                 "--lr", "3e-3", "--lr-schedule", "constant", "--log-every", "5", "--device", "cpu"])
    assert code == 0
    run_dir = tmp_path / "runs" / "s"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [5, 10, 15, 20, 25]
    assert (run_dir / "config.yaml").exists() and list((run_dir / "tb").iterdir())
    tok = load_tokenizer(str(tiny_model_dir))
    # the untrained model has ~uniform predictions (ln 300 ~ 5.7); training must clearly lower it
    before = _response_nll(load_causal_lm(str(tiny_model_dir), tok), tok, rows)
    after = _response_nll(AutoModelForCausalLM.from_pretrained(run_dir / "final"), tok, rows)
    assert after < before - 1.5, (before, after)


def test_sft_python_api_with_chat_messages(tiny_model_dir, tmp_path):
    chat_dir = tmp_path / "chat_model"
    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(chat_dir)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(chat_dir)
    rows = [{"messages": [{"role": "user", "content": r["prompt"]},
                          {"role": "assistant", "content": r["response"]}]} for r in sft_rows(8)]
    cfg = SFTConfig(run_name="chat", output_dir=str(tmp_path / "runs"), model=str(chat_dir),
                    data=str(write_jsonl(tmp_path / "chat.jsonl", rows)), max_steps=2, batch_size=4,
                    device="cpu")
    result = run(cfg)
    assert result.output_path == tmp_path / "runs" / "chat" / "final"
    assert result.metrics["data/rows"] == 8 and result.metrics["train/loss"] > 0
    # The output loads with plain transformers, and its embeddings fit the tokenizer saved with it
    # (the added pad token included); `from_pretrained` would raise, never return None.
    final = AutoModelForCausalLM.from_pretrained(result.output_path)
    assert final.get_input_embeddings().weight.shape[0] == len(load_tokenizer(str(result.output_path)))


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_mistral_dir"])
def test_sft_on_chat_templates_and_sentencepiece_tokenizers(family, request, tmp_path):
    # Llama-style (template writes BOS) and Mistral-style (Metaspace tokenizer adds BOS, template
    # does not): the first step's loss is the model's mean response NLL on ids computed here from
    # the whole rendered chat, so SFT trains on exactly the ids the model sees in context.
    model_dir = request.getfixturevalue(family)
    rows = [{"messages": [{"role": "user", "content": r["prompt"]},
                          {"role": "assistant", "content": r["response"].strip()}]} for r in sft_rows(4)]
    cfg = SFTConfig(run_name="s", output_dir=str(tmp_path / "runs"), model=str(model_dir),
                    data=str(write_jsonl(tmp_path / "chat.jsonl", rows)), max_steps=1, batch_size=4,
                    lr=1e-9, device="cpu")
    loss = run(cfg).metrics["train/loss"]
    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), tok).eval()
    total, count = 0.0, 0
    for row in rows:
        prompt = tok.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
        # the reply ends at its EOS: the newline the Llama-style template writes after it is
        # never generated, so it is not trained on
        full = tok.apply_chat_template(row["messages"], tokenize=False).rstrip("\n")
        assert full.endswith(tok.eos_token)
        ids = tok(full, add_special_tokens=not full.startswith(tok.bos_token))["input_ids"]
        n_prompt = len(tok(prompt, add_special_tokens=not prompt.startswith(tok.bos_token))["input_ids"])
        assert ids.count(tok.bos_token_id) == 1
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
        targets = torch.tensor(ids[1:])
        token_logp = logp.gather(-1, targets[:, None])[:, 0][n_prompt - 1:]
        total, count = total - token_logp.sum().item(), count + len(token_logp)
    assert loss == pytest.approx(total / count, rel=1e-4)
