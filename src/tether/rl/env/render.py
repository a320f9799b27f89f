"""Tokens in, tokens out: what an observation adds to an episode's tokens after the policy's turn.

The policy's sampled ids are kept as sampled, never decoded and re-encoded (decoding and
encoding again changes ids, and the log-probs would no longer belong to the tokens the policy
chose). Only what the environment says is rendered and encoded:

    plain episodes   (reset gave text) an observation is text, encoded and appended as it is
    chat episodes    (reset gave messages) the observation messages (a str is a user turn) are
                     appended to the conversation, and the tokens are what the chat template
                     writes between the policy's end-of-turn token and the next assistant turn

The prefix proof (chat episodes): with the conversation ending in the policy's turn,

    before = render(messages)                       the template's text up to that turn's end
    after  = render(messages + observation, generation prompt)

`after` must start with `before` (the template appends; it does not rewrite an earlier turn),
and `before` must end with the template's closing of an assistant turn, which itself starts with
the end-of-turn token the policy sampled, or with another of the model's EOS tokens (a Qwen
model's turn may end in `<|endoftext|>` where ChatML writes `<|im_end|>`: the sampled token stays
in its place). The tokens appended are then the rest of that closing after its end-of-turn token
(e.g. the newline after `<|im_end|>`, which the policy never samples) and `after[len(before):]`.
When a proof fails (a template that drops a separator at the assistant -> tool boundary, or
strips the reasoning of earlier turns), nothing is appended silently: the episode continues as a
new segment whose context is `after` encoded whole, as the model would see it at inference
(`Appended.segment`), the episode counts it (`env/segments`), and the first split of each cause
is said in a warning that names the turn and where the texts part.

An observation's content longer than `max_observation_tokens` keeps its first tokens and a
visible marker (`CUT_MARKER`); the cap counts content tokens, the template's role markers come on
top.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from dataclasses import dataclass

from tether.data.chat import render_chat
from tether.data.encoding import encode_prompt, special_prefix
from tether.data.prompts import encode_prompt_row
from tether.errors import TetherError

CUT_MARKER = " [... observation cut: {cut} more tokens]"
_PROBE = "tether0probe"  # an assistant turn's content, to read the template's closing off


@dataclass
class Appended:
    """What an observation adds: tokens after the policy's turn, or a new segment's context."""

    ids: list[int]  # the tokens to append after the policy's last sampled token
    cut: bool = False  # an observation's content was longer than the cap
    segment: bool = False  # the template cannot append: `ids` is a new segment's whole context


class Renderer:
    """Encodes an episode's first prompt and its observations for one tokenizer (and tools)."""

    def __init__(self, tokenizer, max_prompt_len: int, max_observation_tokens: int,
                 tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools
        self.max_prompt_len, self.cap = max_prompt_len, max_observation_tokens
        self.prefix = special_prefix(tokenizer)
        self._closing: str | None | bool = False  # False: not read yet; None: unreadable
        self._said: set[str] = set()  # the causes of a split already warned about

    def first(self, prompt: str | list[dict], where: str) -> tuple[str, list[int], list[dict] | None]:
        """(text, ids, messages or None) of an episode's first prompt under the encoding rule of
        every stage (tether.data.prompts), cut to `max_prompt_len` without losing its special
        prefix."""
        chat = isinstance(prompt, list)
        row = {"messages": prompt} if chat else {"prompt": prompt}
        if not chat and self.tools:
            raise TetherError(f"{where} is plain text, but tools are rendered by a chat template; "
                              "return chat messages from reset() to use --tools")
        text, ids = encode_prompt_row(self.tokenizer, row, self.max_prompt_len, self.prefix,
                                      where, self.tools)
        return text, ids, [dict(m) for m in prompt] if chat else None

    def observation(self, messages: list[dict] | None, observation, last_id: int,
                    eos: Collection[int], where: str) -> Appended:
        """The tokens `observation` adds after the policy's turn (already the last of
        `messages`, in a chat episode; its last sampled id `last_id`, an end-of-turn token when
        it is one of the model's EOS ids `eos`). A chat episode's `messages` gain the
        observation's messages."""
        if messages is None:  # a plain episode: text, encoded as it is
            if observation is None:
                return Appended([])
            if not isinstance(observation, str):
                raise TetherError(f"{where} returned chat messages in a plain-text episode; return "
                                  "text, or start the episode with chat messages from reset()")
            text, cut = self._capped(observation)
            return Appended(self._fragment(text), cut)
        if isinstance(observation, str):  # a user turn
            observation = [{"role": "user", "content": observation}]
        added = [dict(m) for m in observation or []]
        cut = False
        for message in added:
            message["content"], was_cut = self._capped(message["content"])
            cut |= was_cut
        before = self._render(messages, False, where)
        messages.extend(added)
        after = self._render(messages, True, where)
        tail, why = self._tail(before, after, last_id, eos, where)
        if tail is None:
            if why.split(":")[0] not in self._said:  # the first split of each cause
                self._said.add(why.split(":")[0])
                print(f"warning: {where}: the episode goes on as a new segment (a row of its "
                      f"own, counted in env/segments; said once): {why}", file=sys.stderr,
                      flush=True)
            return Appended(encode_prompt(self.tokenizer, after, self.prefix), cut, segment=True)
        return Appended(self._fragment(tail + after[len(before):]), cut)

    # ---- pieces

    def _tail(self, before: str, after: str, last_id: int, eos: Collection[int],
              where: str) -> tuple[str | None, str]:
        """(the template's text between the policy's last sampled token and `after[len(before):]`,
        ""), or (None, why) when the prefix proof fails."""
        closing = self._assistant_closing(where)
        if closing is None:
            return None, ("the chat template changes an assistant turn's content (a probe turn "
                          "does not come back as written), so no observation can follow it")
        if not after.startswith(before):
            at = len(os.path.commonprefix([before, after]))
            return None, (f"the chat template's text with the observation does not start with "
                          f"its text without it: after {before[max(at - 24, 0):at]!r} they have "
                          f"{before[at:at + 24]!r} and {after[at:at + 24]!r} (it rewrites an "
                          "earlier turn, e.g. drops its reasoning or a separator)")
        if not before.endswith(closing):
            return None, (f"the chat template closes an assistant turn with {closing!r} but "
                          f"not this one: its text ends {before[-24:]!r}")
        if last_id not in eos:
            return closing, ""  # a stop string ended the turn: the template closes it
        # the sampled end-of-turn token, or another EOS that it stands in for (Qwen's
        # <|endoftext|> where ChatML writes <|im_end|>): the sampled id stays
        ends = [self.tokenizer.decode([i], skip_special_tokens=False) for i in (last_id, *eos)]
        end = next((e for e in ends if closing.startswith(e)), None)
        if end is None:
            return None, (f"the turn ended in {ends[0]!r} and the chat template closes an "
                          f"assistant turn with {closing!r}, which starts with none of the "
                          "model's EOS tokens")
        return closing[len(end):], ""

    def _capped(self, text: str) -> tuple[str, bool]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.cap:
            return text, False
        kept = self.tokenizer.decode(ids[:self.cap], skip_special_tokens=False)
        return kept + CUT_MARKER.format(cut=len(ids) - self.cap), True

    def _fragment(self, text: str) -> list[int]:
        """`text`'s ids as they follow other text: encoded after an anchor (the EOS token), whose
        ids are then dropped, so a tokenizer that marks the start of a text (SentencePiece's
        leading space) does not mark this one."""
        if not text:
            return []
        eos = self.tokenizer.eos_token or ""
        anchor = self.tokenizer(eos, add_special_tokens=False)["input_ids"] if eos else []
        ids = self.tokenizer(eos + text, add_special_tokens=False)["input_ids"]
        if anchor and ids[:len(anchor)] == anchor:
            return ids[len(anchor):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        return render_chat(self.tokenizer, messages, generation_prompt, where, self.tools)

    def _assistant_closing(self, where: str) -> str | None:
        """The text the template writes after an assistant turn's content (`<|im_end|>\\n`), read
        once off a probe conversation; None when the template changes the content itself."""
        if self._closing is False:
            user = [{"role": "user", "content": "q"}]
            opened = self._render(user, True, where)
            full = self._render(user + [{"role": "assistant", "content": _PROBE}], False, where)
            start = len(opened) + len(_PROBE)
            ok = full.startswith(opened) and full[len(opened):start] == _PROBE
            self._closing = full[start:] if ok else None
        return self._closing
