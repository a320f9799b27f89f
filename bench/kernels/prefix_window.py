"""DPO prefix sharing on sliding-window models: the shared pass against the concatenated one.

Not a speed benchmark: a side-by-side check, in one run, of what the shared [prompt | chosen |
rejected] row gives on a Mistral-style model (every layer windowed, W = 8) and a Qwen2-style one
(layer 0 full, layer 1 windowed), both built locally with `tether.tiny`, on 16 pairs of 20-30
tokens (longer than the window). For the mask without the window (what the shared pass used
before it carried the model's window) and with it (now), it prints the largest difference in a
pair's summed log-probs, the mean chosen log-prob (DPO's step-1 `logps/chosen`) of each pass, and
the relative error of the gradient of sum(chosen) - sum(rejected).

    python bench/kernels/prefix_window.py
"""

from __future__ import annotations

import random
import tempfile

import torch

from tether.data.batches import collate_pairs
from tether.data.encoding import encode_preferences
from tether.models import pair_row, tiny
from tether.models.prepare import disable_dropout
from tether.models.pretrained import load_causal_lm, load_tokenizer
from tether.train.dpo import pair_logprobs

WORDS = "the movie was good bad fine dull fun plot actor scene film story music ending long".split()


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _rows(n: int = 16, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _phrase(rng, 10), "chosen": " " + _phrase(rng, 8) + " great.",
             "rejected": " " + _phrase(rng, 8) + " awful."} for _ in range(n)]


def _pass(model, batch):
    model.zero_grad()
    chosen, rejected, _, _ = pair_logprobs(model, batch)
    (chosen.sum() - rejected.sum()).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return chosen.detach(), rejected.detach(), grad


def main() -> None:
    torch.manual_seed(0)
    texts = [_phrase(random.Random(i), 8) + "." for i in range(400)]
    root = tempfile.mkdtemp()
    dirs = {"mistral (W=8, all layers)": tiny.save_tiny_mistral(f"{root}/m", texts, vocab_size=300),
            "qwen2 (W=8, layer 1 of 2)": tiny.save_tiny_qwen2(f"{root}/q", texts, vocab_size=300,
                                                               use_sliding_window=True)}
    with_window = pair_row.attention_layout
    for name, path in dirs.items():
        tok = load_tokenizer(str(path))
        model = disable_dropout(load_causal_lm(str(path), tok))
        examples, _ = encode_preferences(tok, _rows(), max_length=128)
        chosen, rejected, grad = _pass(model, collate_pairs(examples, tok.pad_token_id))
        print(f"{name}: concatenated logps/chosen {chosen.mean():.4f}")
        for label, layout in (("no window (before)", lambda config: ({"full_attention"}, None)),
                              ("window (now)      ", with_window)):
            pair_row.attention_layout = layout
            c, r, g = _pass(model, pair_row.collate_shared(examples, tok.pad_token_id))
            print(f"  shared, {label}: logps/chosen {c.mean():.4f}, "
                  f"max |d chosen| {(c - chosen).abs().max():.4f} nats, "
                  f"max |d rejected| {(r - rejected).abs().max():.4f} nats, "
                  f"grad rel. error {(g - grad).norm() / grad.norm():.1e}")
        pair_row.attention_layout = with_window


if __name__ == "__main__":
    main()
