"""EngineCore: scheduler + model runner + sampler behind a synchronous, I/O-free `step()`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from trio_llm.config import CPU_SOLO_PREFILL_TOKENS, EngineConfig
from trio_llm.engine.attention_probe import probe_model
from trio_llm.engine.block_manager import BlockManager
from trio_llm.engine.grammar_compiler import GrammarCompiler
from trio_llm.engine.grammar_waits import GrammarWaits
from trio_llm.engine.kv_cache import (
    KVCache,
    KVCacheSize,
    describe_groups,
    describe_layers,
    kv_cache_dtype,
    size_kv_cache,
)
from trio_llm.engine.logprobs import gather_logprobs
from trio_llm.engine.lora import attach_adapter
from trio_llm.engine.model_info import ModelInfo, eos_token_ids_of, max_model_len_of
from trio_llm.engine.model_runner import (
    PROMPT_LOGITS_ROWS,
    ModelOutput,
    ModelRunner,
    PromptHidden,
    gguf_file,
    load_quantized,
)
from trio_llm.engine.request import Request
from trio_llm.engine.sampler import Sampler
from trio_llm.engine.scheduled_batch import ScheduledBatch
from trio_llm.engine.scheduler import Scheduler
from trio_llm.engine.support import check_supported, describe
from trio_llm.messages import (
    AddRequest,
    EngineReady,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    StepStats,
    TokenLogprobs,
)
from trio_llm.structured_output.errors import internal_error_text, matcher_error

logger = logging.getLogger(__name__)


class EngineCore:
    """Continuous-batching inference over one model; every method is synchronous.

    ``step()`` does no I/O: the caller (the engine loop) feeds requests in with
    `add_request` / `abort` between steps and ships what `step` returns.

    A structured output's grammar is compiled in a worker thread (`GrammarCompiler`); its
    request waits in the scheduler's waiting queue, unscheduled and holding no KV blocks,
    while the batch keeps decoding. Each step first hands finished compiles to their
    requests (or ends a request whose grammar failed or ran past its time limit).
    `has_work` is true as soon as a compile is done or timed out, and `on_grammar_event`
    is called from the worker (or timer) thread whenever one starts, ends or times out, so
    an idle caller can wait for it instead of polling. Call `close` when done with the
    core.

    Args:
        model: a transformers causal LM; its attention implementation is switched to
            ``ATTENTION_NAME`` (the engine's paged attention) if it is not already.
        config: engine configuration (cache size, scheduler limits, seed).
        model_dir: where the model came from (reported to the server).

    Raises:
        EngineConfigError: the model is one the engine would serve wrongly (see
            `trio_llm.engine.support`), or the cache and context settings do not fit it.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        mconf = model.config
        max_model_len = max_model_len_of(mconf, config)
        layers = probe_model(model)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        #: The dtype of the cached keys and values (``--kv-cache-dtype``), and why.
        self.kv_cache_dtype, self._kv_dtype_reason = kv_cache_dtype(
            config.cache, dtype, config.model.weight_quantization
        )
        step_tokens = config.scheduler.max_num_batched_tokens
        size = size_kv_cache(layers, config.cache, max_model_len, step_tokens, self.kv_cache_dtype)
        self.info = ModelInfo(
            model_dir=model_dir,
            max_model_len=max_model_len,
            num_kv_blocks=size.num_blocks,
            block_size=size.block_size,
            eos_token_ids=eos_token_ids_of(model),
            vocab_size=mconf.vocab_size,
            dtype=str(dtype).removeprefix("torch."),
        )
        #: Each attention layer's key/value shape, window and softcap, probed from the model.
        self.layers = layers
        #: How the layers share the KV cache (sliding-window groups free what they leave).
        self.kv_groups = size.groups
        #: The fewest KV blocks this model and configuration accept: one request of
        #: max_model_len tokens.
        self.min_num_kv_blocks = size.min_num_blocks
        self.kv_cache = KVCache(
            layers, size.groups, size.num_blocks, size.block_size, self.kv_cache_dtype, device
        )
        self.block_manager = BlockManager(
            size.num_blocks,
            size.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            windows=size.groups.windows,
        )
        self.scheduler = _scheduler(
            config, device.type, self.block_manager, max_model_len, self.info.eos_token_ids
        )
        self.runner = _model_runner(model, self.kv_cache, config)
        #: The loaded LoRA adapters (``--enable-lora``), or None.
        lora = config.lora
        self.adapters = self.runner.enable_lora(lora, model_dir) if lora.enable_lora else None
        self.scheduler.max_loras = lora.max_loras
        self._log_model(mconf, size)
        self.sampler = Sampler(config.model.seed, self.info.eos_token_ids)
        #: Matchers for constrained outputs, compiled in a worker thread; the engine loop
        #: calls ``grammars.start()`` at start-up to build llguidance's tokenizer there.
        self.grammars = GrammarCompiler(model_dir, self.runner.vocab_size, self.info.eos_token_ids)
        self.grammars.on_event = self._grammar_event
        #: Requests in the scheduler waiting for their grammar's compile.
        self._grammar_waits = GrammarWaits(self.grammars)
        #: Called (from a worker or timer thread) whenever a grammar compile starts, ends
        #: or runs past its time limit; the engine loop sets it to wake up (and look at
        #: `has_work` again). Must be thread-safe and quick.
        self.on_grammar_event: Callable[[], None] | None = None

    def _log_model(self, mconf: object, size: KVCacheSize) -> None:
        """Log once how the model runs: its forward, attention layers, cache (and the
        dtype of its keys and values, with why) and head."""
        quantization = self.config.model.weight_quantization
        logger.info(
            "%s (%s%s): %s; %s in %s (%s); logits from %s",
            describe(mconf),
            "trio_llm's forward" if self.runner.native is not None else "transformers' modules",
            f", {quantization}" if quantization else "",
            describe_layers(self.layers),
            describe_groups(size.groups, size.num_blocks, size.block_size),
            str(self.kv_cache_dtype).removeprefix("torch."),
            self._kv_dtype_reason,
            "the output projection" if self.runner.lm_head_weight is not None else "its own head",
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        """Resolve and load the model named in ``config``, then build the core.

        Raises:
            trio_llm.errors.ModelNotFoundError: nothing loadable at ``config.model``.
            trio_llm.errors.ModelConversionError: a GGUF file that cannot be read.
            EngineConfigError: the model is one the engine would serve wrongly, or the
                cache and context settings do not fit it.
        """
        from trio_llm.model_files.loader import load_config, resolve_model_dir

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif config.model.device == "cuda" and not config.adaptive_threads:
            # As vLLM's GPU workers do: a GPU step's CPU work is small, and a pool of
            # spinning threads takes the cores the API server needs (issue 6's H200 run:
            # the engine used 85.7 CPU seconds in 13.4 s while the server fell 23 %
            # behind the offline engine).
            torch.set_num_threads(1)
        model_dir = resolve_model_dir(config.model.model, config.cache_dir())
        # Refuse an unsupported family before reading its weights (some cannot even be
        # loaded with the paged attention).
        check_supported(load_config(model_dir))
        model, config = load_quantized(model_dir, config)
        return cls(model, config, str(model_dir))

    def ready_message(self, pid: int) -> EngineReady:
        """The `EngineReady` message describing this core."""
        info = self.info
        return EngineReady(
            model_dir=info.model_dir,
            max_model_len=info.max_model_len,
            num_kv_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            eos_token_ids=sorted(info.eos_token_ids),
            vocab_size=info.vocab_size,
            dtype=info.dtype,
            pid=pid,
            scheduling_policy=self.config.scheduler.scheduling_policy,
        )

    # ------------------------------------------------------------ requests

    def add_request(self, message: AddRequest) -> RequestOutput | None:
        """Queue a request; returns a finished-with-error output if it is rejected.

        A structured output whose grammar is not compiled yet is compiled in the worker
        thread meanwhile: if it fails, a later `step` ends the request with the error
        (finish_reason "abort", error "structured_output: ..."), as this method does for a
        grammar that already failed.
        """
        error = self._check(message)
        if error is None:
            request = Request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                message.group,
                priority=message.scheduling.priority,
                batch=message.scheduling.batch,
            )
            error = attach_adapter(self.adapters, request)
            if error is None and message.params.structured_output is not None:
                error = self._grammar_waits.start(request)
        if error is not None:
            return RequestOutput(message.request_id, [], finish_reason="abort", error=error)
        self.scheduler.add(request)
        return None

    def _grammar_event(self) -> None:
        callback = self.on_grammar_event
        if callback is not None:
            callback()

    def _collect_grammars(self) -> list[RequestOutput]:
        """Hand finished compiles to their requests (they may be scheduled from now on)
        and end those whose grammar failed or timed out; their outputs."""
        failed = []
        for request_id, error in self._grammar_waits.collect():
            self.scheduler.abort([request_id])
            failed.append(RequestOutput(request_id, [], finish_reason="abort", error=error))
        return failed

    def _check(self, message: AddRequest) -> str | None:
        prompt = message.prompt_token_ids
        if not prompt:
            return "the prompt is empty"
        if len(prompt) >= self.info.max_model_len:
            return (
                f"the prompt has {len(prompt)} tokens; max_model_len is "
                f"{self.info.max_model_len} and one token must remain for the output"
            )
        if min(prompt) < 0 or max(prompt) >= self.info.vocab_size:
            return f"prompt token ids must be in [0, {self.info.vocab_size})"
        try:
            message.params.validate(self.info.vocab_size)
            message.scheduling.validate(self.config.scheduler.scheduling_policy)
        except ValueError as exc:
            return str(exc)
        if message.request_id in self.scheduler:
            return f"duplicate request id {message.request_id!r}"
        return None

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests and free their KV blocks; unknown ids are ignored. A request
        waiting for its grammar is dropped at once: a compile no other request waits for
        is cancelled if no worker began it yet (one under way goes on, for the cache)."""
        for request_id in request_ids:
            self._grammar_waits.drop(request_id)
        self.scheduler.abort(request_ids)

    def pause(self, request_ids: list[str]) -> None:
        """Stop scheduling these requests until `resume` (their KV blocks are freed)."""
        self.scheduler.pause(request_ids)

    def resume(self, request_ids: list[str]) -> None:
        """Schedule paused requests again; unknown ids are ignored."""
        self.scheduler.resume(request_ids)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or paused."""
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """True while a step would do something: a request is running, or waiting and not
        for its grammar, or a grammar finished compiling or timed out (the step hands it
        over). Requests whose grammar is still compiling, like paused ones, are no work
        yet."""
        return self.scheduler.has_work or self._grammar_waits.any_ready()

    def close(self) -> None:
        """Stop the grammar worker thread (compiles not started are cancelled; the one under
        way is not waited for). The core must not be used afterwards."""
        self.on_grammar_event = None
        self.grammars.on_event = None
        self.grammars.close()

    # ------------------------------------------------------------ the step

    def step(self) -> StepOutputs:
        """Schedule, run the model once, sample, and report new tokens and finished requests."""
        start = time.perf_counter()
        outputs = self._collect_grammars() if self._grammar_waits else []
        batch = self.scheduler.schedule()
        if not batch.is_empty():
            result = self.runner.execute(batch)
            tokens, logprobs = self._sample(result)
            prompt_logprobs = {
                id(item.request): self._prompt_logprobs(item) for item in result.prompt_hidden
            }
            self.scheduler.update(batch, {r.request_id: t for r, t in tokens.items()})
            outputs += self._outputs(batch, tokens, logprobs, prompt_logprobs)
        stats = self.stats(batch, time.perf_counter() - start)
        return StepOutputs(outputs, stats)

    def _sample(
        self, result: ModelOutput
    ) -> tuple[dict[Request, int], dict[Request, TokenLogprobs | None]]:
        """The next token (and its logprobs entry) of each request ``result`` has logits
        for; each constrained request's matcher consumes its token (a rejected token
        becomes the request's error)."""
        sampled = self.sampler(result.logits, result.requests)
        tokens = dict(zip(result.requests, sampled.token_ids, strict=True))
        logprobs = dict(zip(result.requests, sampled.logprobs, strict=True))
        for request, token in tokens.items():
            if request.matcher is not None and request.error is None:
                self._advance_grammar(request, token)
        return tokens, logprobs

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> None:
        """``request``'s matcher consumes ``token``: a rejected token, or any error of the
        matcher itself, becomes the request's error (it ends, the step goes on);
        `Request.grammar_done` says whether the grammar is complete."""
        matcher = request.matcher
        try:
            # A matcher can fail while its mask is filled (past llguidance's limits):
            # it then allows only EOS, which must not read as a completed grammar.
            if not matcher.consume_token(token) or matcher.is_error():
                reason = matcher_error(matcher) or "the token was rejected"
                request.error = f"structured output: {reason}"
            else:
                request.grammar_done = matcher.is_stopped()
        except Exception as exc:  # a bug in the grammar library: this request only
            logger.exception(f"request {request.request_id}: its grammar failed")
            request.error = internal_error_text(exc)

    def _outputs(
        self,
        batch: ScheduledBatch,
        tokens: dict[Request, int],
        logprobs: dict[Request, TokenLogprobs | None],
        prompt_logprobs: dict[int, list[TokenLogprobs]],
    ) -> list[RequestOutput]:
        """What the step tells of each scheduled request: its new token, logprobs, prompt
        logprobs and finish; nothing for one in the middle of its prefill, unless this is
        its first scheduling."""
        outputs = []
        for request, _ in batch.requests:
            token = tokens.get(request)
            entries = prompt_logprobs.get(id(request))
            if token is None and entries is None and request.queue_time_reported:
                continue  # in the middle of a prefill: nothing to tell
            # (A request's first scheduling is told at once, even in the middle of its
            # prefill: its queue time and prefix-cache hits, which a stream's opening
            # event reports, are known now.)
            new_tokens = [token] if token is not None and request.params.max_tokens else []
            entry = logprobs.get(request)
            output = RequestOutput(
                request.request_id,
                new_tokens,
                request.finish_reason,
                error=request.error,
                logprobs=[entry] if entry is not None and new_tokens else None,
                prompt_logprobs=entries,
            )
            if not request.queue_time_reported:
                request.queue_time_reported = True
                output.queue_seconds = request.queue_seconds
                output.num_cached_tokens = request.num_cached_tokens or 0
            outputs.append(output)
        return outputs

    def _prompt_logprobs(self, item: PromptHidden) -> list[TokenLogprobs]:
        """Logprobs of prompt tokens ``first_target ..`` from the hidden states before them.

        These are the model's own distribution (no sampling parameters applied).
        """
        request = item.request
        k = request.params.prompt_logprobs or 0
        entries: list[TokenLogprobs] = []
        for row in range(0, item.hidden.shape[0], PROMPT_LOGITS_ROWS):
            hidden = item.hidden[row : row + PROMPT_LOGITS_ROWS]
            first = item.first_target + row
            targets = torch.tensor(request.token_ids[first : first + hidden.shape[0]])
            logprobs = self.runner.compute_logits(hidden).log_softmax(dim=-1).cpu()
            entries += gather_logprobs(logprobs, targets, [k] * hidden.shape[0])
        request.next_prompt_logprob = item.first_target + len(entries)
        return entries

    def stats(self, batch: ScheduledBatch | None = None, step_seconds: float = 0.0) -> StepStats:
        """Scheduler and cache state now, with the counts of ``batch`` if a step just ran."""
        requests = batch.requests if batch is not None else []
        return StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_paused=len(self.scheduler.paused),
            num_scheduled_reqs=len(requests),
            num_scheduled_tokens=sum(n for _, n in requests),
            num_prefill_tokens=batch.num_prefill_tokens if batch is not None else 0,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_preemptions=batch.num_preemptions if batch is not None else 0,
            step_seconds=step_seconds,
            prefix_cache_queries=self.block_manager.num_queried_tokens,
            prefix_cache_hits=self.block_manager.num_hit_tokens,
        )

    def warm_up(self) -> None:
        """Run a short prefill and a few decode steps through the whole stack, then free them."""
        prompt_len = min(2 * self.info.block_size + 3, self.info.max_model_len - 4)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        self.scheduler.add(Request("__warmup__", [0] * max(prompt_len, 1), params))
        while self.has_unfinished_requests():
            self.step()
        manager = self.block_manager
        manager.reset_prefix_cache()
        manager.num_queried_tokens = manager.num_hit_tokens = 0


def _scheduler(config: EngineConfig, device: str, *args: Any) -> Scheduler:
    """The scheduler of ``config`` on ``device`` (``args``: `Scheduler`'s block manager,
    max_model_len and EOS ids) with the long-prefill threshold resolved for the device, and
    on the CPU with that threshold's default `CPU_SOLO_PREFILL_TOKENS` for a prompt alone."""
    scheduling = config.scheduler
    threshold = scheduling.resolved_long_prefill_token_threshold(device)
    scheduler = Scheduler(scheduling, *args, long_prefill_token_threshold=threshold)
    if device == "cpu" and scheduling.long_prefill_token_threshold is None:
        scheduler.solo_prefill_tokens = CPU_SOLO_PREFILL_TOKENS
    return scheduler


def _model_runner(model: torch.nn.Module, kv_cache: KVCache, config: EngineConfig) -> ModelRunner:
    """The runner of ``model`` over ``kv_cache`` with the configuration's forward options."""
    model_config = config.model
    return ModelRunner(
        model,
        kv_cache,
        model_impl=model_config.model_impl,
        attention_backend=model_config.attention_backend,
        quantization=model_config.weight_quantization,
        cuda_graphs=not model_config.enforce_eager,
        max_num_seqs=config.scheduler.max_num_seqs,
        gguf_file=gguf_file(config) if model_config.weight_quantization == "gguf" else None,
    )
